"""Train the tokenizer, the token-level baseline, and the dual-end model converted from it.

    python -m builder.train tokenizer --out runs/tokenizer.json
    python -m builder.train baseline --tokenizer runs/tokenizer.json --run runs/baseline --steps 6000
    python -m builder.train dualend --baseline checkpoints/baseline --run runs/dualend --steps 6000
    python -m builder.train dualend --baseline checkpoints/baseline --init-from checkpoints/dualend \
        --run runs/dualend_more --steps 3000 --lr 5e-4 --seed 1
    python -m builder.train promote --source runs/dualend/best --to checkpoints/dualend
    python -m builder.train convert --baseline checkpoints/smollm2 --run runs/smollm2_dualend \
        --time-limit-minutes 30
    python -m builder.train merge-adapters --base checkpoints/smollm2 \
        --adapters runs/smollm2_dualend/adapters --out build/smollm2_dualend
    python -m builder.train ship-adapters --adapters runs/smollm2_dualend/adapters --to checkpoints/smollm2_dualend
    python -m builder.train baseline --init-from checkpoints/baseline --run runs/baseline_gpu --steps 30000 \
        --device cuda --data-workers 10 --batch-size 64 --time-limit-minutes 4

A run folder holds `state.pt` (resumable: model, optimizer, step, RNG), `log.jsonl`, and `best/`,
the checkpoint with the best held-out greedy accuracy so far. Re-running the same command resumes.

`convert` turns a pretrained token-level checkpoint (builder.import_model's) into a dual-end model
with LoRA adapters, distilled from the base's own outputs (dualend.train.conversion). Its run folder
holds `state.pt`, `log.jsonl` (the held-out curve against the teacher), `chat.json` (the teacher's
greedy answers, made once) and `adapters/`, what the conversion adds to the base; each invocation
trains --time-limit-minutes more. `merge-adapters` folds adapters into their base (a checkpoint
folder, or a GGUF file / Hugging Face folder imported on the spot) as an ordinary dual-end checkpoint;
`ship-adapters` writes them in bf16 where they ship from (the assembler merges them at build time).

`draft-head` trains an MTP draft head on a frozen token-level checkpoint (dualend.train.draft_head):
its drafts are verified by the base, so the output stays the base's. The run folder holds
`state.pt`, `log.jsonl` (held-out top-1 agreement with the base on its own chat answers: the greedy
first-draft acceptance), `chat.json` and `head/`; `--ship-to` writes the head where it ships from.

    python -m builder.train draft-head --baseline build/checkpoints/smollm2 --run runs/smollm2_mtp \
        --time-limit-minutes 60 --ship-to checkpoints/smollm2_mtp
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from builder.evaluate_conversion import task_questions
from dualend.engine.checkpoint import CONFIG, Checkpoint, load_checkpoint
from dualend.engine.model import LanguageModel, ModelConfig, count_parameters, default_ffn_hidden
from dualend.engine.onnx_engine import OnnxComponents
from dualend.engine.tokenizer import TextTokenizer, train_tokenizer
from dualend.train import conversion, draft_head
from dualend.train.data import FAMILIES, examples, stdlib_chunks
from dualend.train.open_prompts import open_prompts
from dualend.train.short_questions import short_questions
from dualend.train.parallel import Replicas, state_digest
from dualend.train.evaluation import evaluate_pass1
from dualend.train.training import (
    AUGMENTATIONS,
    TRAIN_MIX,
    Sample,
    baseline_batch,
    baseline_loss,
    batch_stream,
    batch_stream_in_workers,
    dualend_batch,
    dualend_loss,
)

DEFAULTS = dict(
    vocab_size=1024, d_model=256, n_layers=4, n_heads=4, batch_size=32, max_tokens=192,
    context=1024, long_fraction=0.5, mix=TRAIN_MIX,
    lr=2e-3, warmup=200, text_fraction=0.1, eval_every=500, eval_examples=40, patience=4,
    distill_weight=0.5, seed=0, threads=2, device="cpu", data_workers=0, time_limit_minutes=0.0,
)
# `convert`: per invocation, --time-limit-minutes of training (0: no limit) or up to --steps in all (0: none).
# --decay-tokens: the rate falls by a cosine to a tenth over that many tokens (0: constant after warm-up);
# --decay-minutes: the same over that many minutes of this run's training (a GPU run with a time budget,
# whose tokens per second are not known ahead).
STARTED_FROM = "started_from.json"  # in a run folder: the adapters it started from (--init-adapters)
STUDENT_ANSWERS = "student_answers.json"  # in a run folder: --student-answers, made at an invocation's start
CONVERT_DEFAULTS = dict(
    lora_rank=16, lora_alpha=32.0, frozen_layers=0, batch_size=4, seq_tokens=256, lr=5e-4, warmup=10, steps=0,
    time_limit_minutes=5.0, eval_every=10, eval_rows=4, chat_prompts=32, open_prompts=0, short_prompts=0,
    chat_fraction=0.25, chat_tokens=96, hidden_weight=1.0, confidence_weight=1.0, autocast="auto", seed=0, threads=2,
    device="cpu", compressor_init="mean", decay_tokens=0, decay_minutes=0.0, hidden_fade_minutes=0.0, teacher_cache=0,
    student_answers=0.0,
)
CONVERT_HELP = {
    "open_prompts": "beside the --chat-prompts task questions, the teacher's answers to this many open-ended requests "
                    "(dualend.train.open_prompts: explain, describe, advise, write) in the chat rows (a run with chat "
                    "rows logs open_ figures on --eval-rows held-out requests, on topics training never sees, with or "
                    "without them)",
    "short_prompts": "and the teacher's answers to this many short questions with short answers "
                     "(dualend.train.short_questions: capitals, colours, counts, words, arithmetic; held apart from "
                     "the task check's), which end with EOS where the task questions and open requests, cut at "
                     "--chat-tokens, seldom do",
    "chat_fraction": "the share of batches made of chat rows (the others are text windows; a batch is never both)",
    "hidden_fade_minutes": "the final-hidden-state target's weight falls linearly from --hidden-weight to 0 over this "
                           "many minutes of this invocation's training, as --decay-minutes counts (0: constant)",
    "teacher_cache": "train on this many samples of the data stream (text windows and chat answers; each batch "
                     "drawn at random from one kind, as --chat-fraction says), the teacher's hidden states for them "
                     "made once and kept in the run folder, so that its blocks never run again (0: fresh samples, "
                     "the teacher reads each batch)",
    "student_answers": "this share of the chat rows (spread evenly over them) answered by the student itself, greedy "
                       "with drafting off as it serves, in place of the teacher's answers: the teacher still labels "
                       "every position, so the student learns the teacher's next token after its own words (on-policy "
                       "distillation); made at the start of each invocation by the student as it then is (0: none)",
}
# `draft-head`: per invocation, --time-limit-minutes of training and/or up to --steps in all (neither: none).
DRAFT_HEAD_DEFAULTS = dict(
    batch_size=8, seq_tokens=192, lr=1e-3, warmup=20, time_limit_minutes=10.0, eval_every=25, eval_rows=32,
    chat_prompts=384, open_prompts=0, short_prompts=0, chat_fraction=0.6, chat_tokens=96, seed=0, threads=2,
    draft_vocab=8192, decay_tokens=0, decay_minutes=0.0, steps=0, greedy_weight=0.0,
)
DRAFT_HEAD_HELP = {"greedy_weight": "add this weight x the head's cross-entropy against the base's top token to the "
                                    "KL (greedy requests keep a draft only when it is that token; 0: KL alone)",
                   "open_prompts": "beside the --chat-prompts task questions, the base's answers to this many "
                                   "open-ended requests (dualend.train.open_prompts) in the chat rows",
                   "short_prompts": "and to this many short questions (dualend.train.short_questions)"}

RECORD_SOURCES = {"open": "open-ended chat requests (dualend.train.open_prompts)",
                  "task": "the project's task questions under the chat template",
                  "text": "standard-library text windows continued as raw text"}
# `draft-head-records`: prompts per source (RECORD_SOURCES) for training and for the held-out shard.
RECORDS_HELP = {"temperature": "0: greedy training continuations; above: sampled at this temperature (other text after "
                                "the same prompts); held-out ones are always greedy",
                "open_from": "skip the first N training open requests (an earlier folder's --open N: a list keeps "
                             "its order when topics are added, so from N on is what that folder lacks)"}
RECORDS_DEFAULTS = dict(
    open=len(open_prompts("train")), open_from=0, task=384, text=600,
    held_out_open=64, held_out_task=32, held_out_text=32,
    max_tokens=192, text_tokens=64, rows=48, temperature=0.0, time_limit_minutes=0.0, seed=0, threads=2,
)


def tokenizer_corpus(seed: int, per_family: int = 4000, text_chunks: int = 3000):
    for family in FAMILIES:
        for example in itertools.islice(examples(family, "train", seed), per_family):
            yield example.prompt + example.completion
    yield from itertools.islice(stdlib_chunks("train", 2000, seed), text_chunks)


def cmd_tokenizer(args) -> None:
    tokenizer = train_tokenizer(tokenizer_corpus(args.seed), args.vocab_size)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(tokenizer.to_str(), encoding="utf-8")
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens -> {args.out}")


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine from `peak` to a tenth of it as `progress`
    (the share of the run done, 0..1) goes."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def decay_progress(args, tokens: int, run_elapsed_s: float) -> float:
    """How far a conversion's cosine has gone: over --decay-tokens (all the tokens its adapters saw),
    or over --decay-minutes of this run's training; 0 (a constant rate) without either."""
    if args.decay_tokens:
        return tokens / args.decay_tokens
    if args.decay_minutes:
        return run_elapsed_s / (60 * args.decay_minutes)
    return 0.0


def replica_data_seed(seed: int, rank: int) -> int:
    return seed + 1000 * rank  # each replica its own batches


def stream_key(data_seed: int, step: int) -> int | str:
    """The seed of a replica's data from `step` on: from the start its data seed, resumed a key, not a
    sum (replica r's seed resumed at step 1000k summed to replica r+k's at step 0, replaying its batches)."""
    return data_seed if step == 0 else f"{data_seed}@{step}"


def hidden_weight_at(args, run_elapsed_s: float) -> float:
    if not args.hidden_fade_minutes:
        return args.hidden_weight
    return args.hidden_weight * max(0.0, 1 - run_elapsed_s / (60 * args.hidden_fade_minutes))


def time_share(args, elapsed_s: float) -> float:
    """The share of --time-limit-minutes spent (0 without a limit); at 1 the run stops."""
    return elapsed_s / (60 * args.time_limit_minutes) if args.time_limit_minutes else 0.0


def run_progress(args, step: int, elapsed_s: float) -> float:
    """Steps done after warm-up over those planned, or the share of the time limit spent when
    that is further along (so a time-limited run still ends its schedule)."""
    return max(max(0, step - args.warmup) / max(1, args.steps - args.warmup), time_share(args, elapsed_s))


def on_cpu(model: LanguageModel) -> LanguageModel:
    """The model itself on a CPU run; a CPU copy of it otherwise, for evaluation and saving."""
    if next(model.parameters()).device.type == "cpu":
        return model
    return copy.deepcopy(model).to("cpu")


def train_loop(args, model: LanguageModel, tokenizer: TextTokenizer, recipe: dict, loss_fn,
               make_batch, trainable) -> None:
    """With --device cuda, batches and model live on the GPU and evaluation runs on a CPU copy;
    --time-limit-minutes ends a run early (evaluated and saved) when its wall time is spent."""
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    state_path, log_path = run / "state.pt", run / "log.jsonl"
    step, best, stale, elapsed = 0, -1.0, 0, 0.0
    data_rng = random.Random(args.seed)
    def batches(seed: int):
        settings = dict(batch_size=args.batch_size, text_fraction=args.text_fraction, short_tokens=args.max_tokens,
                        context=args.context, long_fraction=args.long_fraction, mix=args.mix)
        if args.data_workers:
            return batch_stream_in_workers(tokenizer, seed, args.data_workers, **settings)
        return batch_stream(tokenizer, seed, **settings)

    stream = batches(args.seed)
    if state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location=args.device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, best, stale, elapsed = state["step"], state["best"], state["stale"], state["elapsed"]
        data_rng.setstate(state["data_rng"])
        torch.set_rng_state(state["torch_rng"].cpu())
        stream = batches(args.seed + step)
        print(f"resumed at step {step} (best held-out accuracy {best:.3f})")
    bar = tqdm(total=args.steps, initial=step, desc=recipe["kind"], file=sys.stdout, mininterval=30)
    started = time.time() - elapsed
    out_of_time = time_share(args, elapsed) >= 1  # a run that spent its limit stays finished
    while step < args.steps and stale < args.patience and not out_of_time:
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, run_progress(args, step, time.time() - started), args.lr, args.warmup)
        batch = make_batch(next(stream), data_rng)
        loss, parts = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        out_of_time = time_share(args, time.time() - started) >= 1
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            model.eval()
            with torch.device("cpu"):
                evaluated = on_cpu(model)
                accuracy = evaluate_pass1(evaluated, tokenizer, args.eval_examples, args.context, seed=1)
            mean = sum(accuracy.values()) / len(accuracy)
            improved = mean > best
            best, stale = (mean, 0) if improved else (best, stale + 1)
            record = {"step": step, "minutes": round((time.time() - started) / 60, 2),
                      "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in parts.items()},
                      "heldout_pass1": accuracy, "mean": round(mean, 4)}
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
            if improved:  # `steps`: those behind this checkpoint; `planned_steps`: the run's --steps
                recipe.update(steps=step, planned_steps=args.steps, minutes=record["minutes"], heldout_pass1=accuracy)
                Checkpoint(evaluated, tokenizer, dict(recipe)).save(run / "best")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step, "best": best, "stale": stale,
                        "elapsed": time.time() - started, "data_rng": data_rng.getstate(),
                        "torch_rng": torch.get_rng_state()}, state_path)
    bar.close()
    stream.close()  # ends its workers, if any
    print(f"done at step {step}{' (time limit)' if out_of_time else ''}; "
          f"best held-out mean pass@1 {best:.3f} -> {run / 'best'}")


def _recipe(args, kind: str) -> dict:
    keys = ("batch_size", "max_tokens", "context", "long_fraction", "mix", "lr", "warmup", "text_fraction", "seed",
            "steps", "device", "data_workers", "time_limit_minutes")
    keys += ("distill_weight",) if kind == "dualend" else ()
    return {"kind": kind, "python": sys.version.split()[0], "torch": torch.__version__,
            **{k: getattr(args, k) for k in keys if hasattr(args, k)}}


def cmd_baseline(args) -> None:
    torch.manual_seed(args.seed)
    recipe = _recipe(args, "baseline")
    if args.init_from:
        start = load_checkpoint(args.init_from)
        if start.model.cfg.is_dualend:
            sys.exit(f"{args.init_from} is a dual-end checkpoint, not a baseline")
        model, tokenizer = start.model, start.tokenizer
        recipe["continued_from"] = {"id": start.id, **start.recipe}
    else:
        if not args.tokenizer:
            sys.exit("a new baseline needs --tokenizer (or --init-from a baseline checkpoint)")
        tokenizer = TextTokenizer.from_json(Path(args.tokenizer).read_text(encoding="utf-8"))
        cfg = ModelConfig(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                          bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pair_size=1,
                          d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                          ffn_hidden=default_ffn_hidden(args.d_model))
        model = LanguageModel(cfg)
    cfg = model.cfg
    print(f"baseline: {count_parameters(model) / 1e6:.2f}M parameters")
    model.to(args.device)
    train_loop(args, model, tokenizer, recipe, baseline_loss,
               lambda samples, rng: baseline_batch(samples, cfg.pad_id), list(model.parameters()))


def convert_baseline(baseline: LanguageModel, compressor_init: str, position_stride: int = 1) -> LanguageModel:
    """A dual-end model whose embedding and backbone start as the baseline's."""
    cfg = ModelConfig(**{**baseline.cfg.to_dict(), "pair_size": 2, "compressor_init": compressor_init,
                         "position_stride": position_stride})
    model = LanguageModel(cfg)
    model.embedding.load_state_dict(baseline.embedding.state_dict())
    model.backbone.load_state_dict(baseline.backbone.state_dict())
    # The MTP layer starts as a copy of the backbone's last layer.
    model.mtp.layer.load_state_dict(baseline.backbone.layers[-1].state_dict())
    return model


def cmd_dualend(args) -> None:
    teacher_ckpt = load_checkpoint(args.baseline)
    teacher, tokenizer = teacher_ckpt.model, teacher_ckpt.tokenizer
    for p in teacher.parameters():
        p.requires_grad_(False)
    torch.manual_seed(args.seed)
    recipe = _recipe(args, "dualend") | {"augmentation": args.augmentation, "teacher": teacher_ckpt.id,
                                         "baseline_recipe": teacher_ckpt.recipe}
    if args.init_from:
        start = load_checkpoint(args.init_from)
        if not start.model.cfg.is_dualend:
            sys.exit(f"{args.init_from} is not a dual-end checkpoint")
        model = start.model
        recipe |= {k: start.recipe[k] for k in ("converted_from", "compressor_init", "position_stride")}
        recipe["continued_from"] = {"id": start.id, **{k: v for k, v in start.recipe.items()
                                                       if k != "baseline_recipe"}}
    else:
        model = convert_baseline(teacher, args.compressor_init, args.position_stride)
        recipe |= {"converted_from": teacher_ckpt.id, "compressor_init": args.compressor_init,
                   "position_stride": args.position_stride}
    pad = model.cfg.pad_id
    model.to(args.device)
    teacher.to(args.device)
    teacher_or_none = teacher if args.distill_weight > 0 else None
    train_loop(args, model, tokenizer, recipe,
               lambda m, b: dualend_loss(m, b, teacher_or_none, args.distill_weight),
               lambda samples, rng: dualend_batch(samples, pad, rng, augment=AUGMENTATIONS[args.augmentation]),
               list(model.parameters()))


def cmd_merge(args) -> None:
    """A dual-end checkpoint moved by what a baseline learned since it was converted (task vectors):
    every weight the two share gets dual-end + (baseline after - baseline before); the compressor,
    MTP head and confidence head stay. Used to carry a baseline's longer context into a dual-end
    model converted from its earlier self, as the start of further dual-end training."""
    dualend, before, after = (load_checkpoint(p) for p in (args.dualend, args.baseline_before, args.baseline_after))
    if dualend.recipe.get("converted_from") != before.id:
        sys.exit(f"{args.dualend} was converted from {dualend.recipe.get('converted_from')}, not {before.id}")
    merged, old, new = dualend.model.state_dict(), before.model.state_dict(), after.model.state_dict()
    for name in merged:
        if name in new:
            merged[name] = merged[name] + new[name] - old[name]
    dualend.model.load_state_dict(merged)
    recipe = {**dualend.recipe, "kind": "dualend", "converted_from": after.id,
              "merged": {"dualend": dualend.id, "baseline_before": before.id, "baseline_after": after.id},
              "context": after.recipe.get("context")}
    ckpt_id = Checkpoint(dualend.model, dualend.tokenizer, recipe).save(args.out)
    print(f"{args.dualend} + ({args.baseline_after} - {args.baseline_before}) -> {args.out} (checkpoint {ckpt_id})")


def chat_data(args, run: Path, teacher: LanguageModel, tokenizer: TextTokenizer, teacher_id: str,
              replicas: Replicas, open_held_out: bool = True) -> tuple[list, list, list]:
    """The teacher's greedy answers under the chat template, made once per run folder (`chat.json`, by the
    main replica): (train: to --chat-prompts task questions, --open-prompts open-ended requests
    (`open_prompts`) and --short-prompts short questions (`short_questions`); held out: to --eval-rows task
    questions; to as many open-ended requests on topics training never sees, where `open_held_out`). Answers
    already in the folder's `chat.json` for the same teacher and --chat-tokens are kept, so that changing
    the counts makes only the new ones. Empty lists for a tokenizer without a chat template."""
    if not tokenizer.chat_template or not (args.chat_prompts or args.open_prompts or args.short_prompts):
        return [], [], []
    path = run / "chat.json"
    if not replicas.main:
        replicas.wait_for_main()  # the main replica has written it
    cached = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    made_for = {"task": args.chat_prompts, "open": args.open_prompts, "held_out": args.eval_rows,
                "open_held_out": args.eval_rows if open_held_out else 0, "seed": args.seed, "tokens": args.chat_tokens,
                **({"short": args.short_prompts} if args.short_prompts else {})}
    if cached.get("teacher") != teacher_id or cached.get("prompts") != made_for:
        started = time.time()
        prompts = {"train": conversion.chat_prompts("train", args.chat_prompts, args.seed)
                   + open_prompts("train", args.seed)[:args.open_prompts]
                   + short_questions(args.short_prompts, args.seed, exclude=frozenset(q for q, _ in task_questions())),
                   "calibration": conversion.chat_prompts("calibration", args.eval_rows, args.seed),
                   "open_held_out": open_prompts("held_out", args.seed)[:made_for["open_held_out"]]}
        if (cached.get("teacher"), cached.get("prompts", {}).get("tokens")) == (teacher_id, args.chat_tokens):
            known = {tuple(p): c for split in prompts for p, c in cached.get(split, [])}
        else:
            known = {}
        made = {split: answered(teacher, tokenizer, questions, known, args.chat_tokens)
                for split, questions in prompts.items()}
        cached = {"teacher": teacher_id, "prompts": made_for,
                  **{split: [[s.prompt, s.completion] for s, _ in samples] for split, samples in made.items()}}
        path.write_text(json.dumps(cached) + "\n", encoding="utf-8")
        kept = sum(was_known for samples in made.values() for _, was_known in samples)
        print(f"chat data: {sum(map(len, prompts.values()))} teacher answers ({kept} of them kept from before) "
              f"in {time.time() - started:.0f} s")
    if replicas.main:
        replicas.wait_for_main()
    return tuple([Sample(p, c) for p, c in cached[split]] for split in ("train", "calibration", "open_held_out"))


def student_answered(args, run: Path, student: LanguageModel, eos_id: int, chat: list[Sample],
                     replicas: Replicas) -> list[Sample]:
    """--student-answers: the chat rows with that share of them (spread evenly) answered by the student as it
    starts this invocation (`conversion.greedy_answers`) in place of the teacher's (a row it answers with nothing,
    not even EOS, keeps the teacher's). The main replica makes them
    into the run folder's student_answers.json, kept while the student's weights, the rows and the share are
    the same: resumed, a run that trained meanwhile answers again as the student it has become."""
    share = args.student_answers
    picked = [i for i in range(len(chat)) if math.floor((i + 1) * share) > math.floor(i * share)]
    path = run / STUDENT_ANSWERS
    if replicas.main:
        made_for = {"student": state_digest(conversion.trainable_state(student)), "share": share,
                    "tokens": args.chat_tokens,
                    "rows": hashlib.sha256(json.dumps([s.prompt for s in chat]).encode()).hexdigest()}
        cached = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if cached.get("made_for") != made_for:
            started = time.time()
            answers = conversion.greedy_answers(student.eval(), [chat[i].prompt for i in picked], args.chat_tokens,
                                                eos_id)
            path.write_text(json.dumps({"made_for": made_for, "answers": answers}) + "\n", encoding="utf-8")
            print(f"student answers: {len(answers)} of {len(chat)} chat rows in {time.time() - started:.0f} s")
    replicas.wait_for_main()
    answers = dict(zip(picked, json.loads(path.read_text(encoding="utf-8"))["answers"]))
    return [Sample(s.prompt, answers[i]) if answers.get(i) else s for i, s in enumerate(chat)]


def answered(teacher: LanguageModel, tokenizer: TextTokenizer, questions: list[str], known: dict,
             max_tokens: int) -> list[tuple[Sample, bool]]:
    """The teacher's answers to `questions`, in their order, each with whether it was in `known` (encoded
    prompt -> answer) already; the others are made (on the CPU, where the reference decoder runs)."""
    encoded = [tuple(tokenizer.encode_prompt(tokenizer.user_turn(q))) for q in questions]
    was_known = [e in known for e in encoded]
    missing = [q for q, k in zip(questions, was_known) if not k]
    if missing:
        with torch.device("cpu"):
            for sample in conversion.teacher_chat_samples(on_cpu(teacher), tokenizer, missing, max_tokens):
                known[tuple(sample.prompt)] = sample.completion
    return [(Sample(list(e), known[e]), k) for e, k in zip(encoded, was_known) if e in known]


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively: a CUDA device, or a CPU with AVX-512 BF16 or AMX.
    Elsewhere torch emulates them, tens of times slower than fp32 (reports/bf16_on_cpu.txt), so a
    conversion there trains in fp32."""
    if device.type == "cuda":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def start_from_adapters(student, teacher, directory: str, base_id: str, spec: conversion.ConversionSpec) -> dict:
    """Loads a run's (or the shipped) adapters into the student, as the same model under its spec (an adapted MTP
    block folded into its weights, adapters widened to a higher rank: `conversion.adapters_as`); returns what they
    were (their sha256, the tokens, steps and minutes they were trained for), for the recipe."""
    adapters, meta = conversion.load_adapters(directory)
    found = conversion.ConversionSpec(**meta["spec"])
    if meta["base"]["checkpoint_id"] != base_id:
        sys.exit(f"{directory} converts base {meta['base']['checkpoint_id']}, not {base_id}")
    try:
        adapters = conversion.adapters_as(teacher, adapters, found, spec)
    except ValueError as error:
        sys.exit(f"{directory}: {error}")
    unknown = sorted(set(adapters) - set(conversion.trainable_state(student)))
    if unknown:
        sys.exit(f"{directory} holds weights this student does not train: {unknown[:3]}")
    student.load_state_dict(adapters, strict=False)
    return {"adapters_sha256": conversion.adapters_sha256(directory),
            **{key: meta["recipe"].get(key, 0) for key in ("tokens", "steps", "minutes")}}


def cmd_convert(args) -> None:
    """LoRA conversion of a pretrained token-level checkpoint, distilled from it (the frozen teacher).
    Under torchrun, each replica trains on its own batches and their gradients are averaged
    (dualend.train.parallel); the main one evaluates, logs and saves."""
    if args.autocast not in ("auto", "bf16", "none"):
        sys.exit(f"--autocast {args.autocast}: bf16 (measured on SmolLM2: losses within 0.5% of fp32), none, "
                 "or auto (bf16 where the device multiplies bf16 natively)")
    if args.decay_tokens and args.decay_minutes:
        sys.exit("--decay-tokens and --decay-minutes each set the rate's schedule: give one")
    if args.mtp_layer_full and not args.lora_rank:
        sys.exit("--mtp-layer-full: with --lora-rank 0 every block trains its own weights already")
    if args.compressor_init not in conversion.COMPRESSOR_STARTS:
        sys.exit(f"--compressor-init {args.compressor_init}: expected one of {', '.join(conversion.COMPRESSOR_STARTS)}")
    if not 0 <= args.student_answers <= 1:
        sys.exit(f"--student-answers {args.student_answers}: a share of the chat rows, from 0 to 1")
    if args.student_answers and args.teacher_cache:
        sys.exit("--student-answers with --teacher-cache: the cache keeps one set of answers, the student answers "
                 "afresh each invocation; give one")
    if args.teacher_cache and args.teacher_cache < args.batch_size:
        sys.exit(f"--teacher-cache {args.teacher_cache}: a batch draws --batch-size {args.batch_size} cached samples, "
                 "so cache at least that many (or 0: no cache)")
    replicas = Replicas(args.device)
    device = replicas.device
    if args.autocast == "auto":
        args.autocast = "bf16" if native_bf16(device) else "none"
    base = load_checkpoint(args.baseline)
    teacher, tokenizer = base.model.eval().requires_grad_(False), base.tokenizer
    if teacher.cfg.is_dualend:
        sys.exit(f"{args.baseline} is a dual-end checkpoint; convert starts from a token-level one")
    spec = conversion.ConversionSpec(args.lora_rank, args.lora_alpha, args.frozen_layers, args.compressor_init,
                                     args.mtp_layer_full)
    base_ref = {"checkpoint_id": base.id, "source": base.recipe.get("source")}
    pad = teacher.cfg.pad_id
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    state_path, log_path = run / "state.pt", run / "log.jsonl"
    torch.manual_seed(args.seed)  # the same start on every replica
    student = conversion.build_student(teacher, spec)
    step, tokens, elapsed = 0, 0, 0.0
    data_seed = replica_data_seed(args.seed, replicas.rank)
    data_rng = random.Random(data_seed)
    state = torch.load(state_path, weights_only=False) if state_path.exists() else None
    if state is not None:
        if (state["base"], conversion.ConversionSpec(**state["spec"])) != (base_ref["checkpoint_id"], spec):
            sys.exit(f"{run} converts base {state['base']} with {state['spec']}, not {base_ref['checkpoint_id']} "
                     f"with {asdict(spec)}")
        student.load_state_dict(state["trainable"], strict=False)
        step, tokens, elapsed = state["step"], state["tokens"], state["elapsed"]
        if replicas.main:
            data_rng.setstate(state["data_rng"])
        else:
            data_rng.seed(stream_key(data_seed, step))
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed at step {step} ({tokens} tokens, {elapsed / 60:.1f} minutes)")
    elif args.init_adapters:
        started_from = start_from_adapters(student, teacher, args.init_adapters, base_ref["checkpoint_id"], spec)
        tokens = int(started_from["tokens"])
        if replicas.main:
            (run / STARTED_FROM).write_text(json.dumps(started_from) + "\n", encoding="utf-8")
            print(f"started from {args.init_adapters} ({tokens} tokens of training)")
    chat_train, chat_eval, open_eval = chat_data(args, run, teacher, tokenizer, base_ref["checkpoint_id"], replicas)
    if args.student_answers:
        if not chat_train:
            sys.exit("--student-answers: the run has no chat rows (--chat-prompts, --open-prompts, --short-prompts)")
        chat_train = student_answered(args, run, student, tokenizer.eos_id, chat_train, replicas)
    references = {}
    if replicas.main:
        references[""] = conversion.held_out(teacher, conversion.held_out_samples(tokenizer, args.eval_rows,
                                                                                  args.seq_tokens), pad)
        if chat_eval:
            references["chat_"] = conversion.held_out(teacher, chat_eval, pad)
        if open_eval:
            references["open_"] = conversion.held_out(teacher, open_eval, pad)
        references = {prefix: conversion.held_out_on(ref, device) for prefix, ref in references.items()}
    teacher, student = teacher.to(device), student.to(device)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = conversion.optimizer(trainable, args.lr)
    if state is not None:
        conversion.resume_optimizer(optimizer, state["optimizer"])
    stream = (None if args.teacher_cache  # batches come from the cache
              else conversion.batch_stream(tokenizer, stream_key(data_seed, step), args.seq_tokens, chat_train,
                                           args.chat_fraction, args.batch_size))
    keys = ("batch_size", "seq_tokens", "lr", "warmup", "decay_tokens", "decay_minutes", "chat_prompts",
            "open_prompts", "short_prompts", "chat_fraction", "chat_tokens", "hidden_weight", "hidden_fade_minutes",
            "confidence_weight", "autocast", "seed", "teacher_cache", "compile", "student_answers")
    recipe = {"kind": "dualend-conversion", "base": base_ref, "torch": torch.__version__,
              **{k: getattr(args, k) for k in keys}, "replicas": replicas.world, "batches": "one kind"}
    if (run / STARTED_FROM).exists():  # the tokens count on from these; steps and minutes are this run's
        recipe["started_from"] = json.loads((run / STARTED_FROM).read_text(encoding="utf-8"))
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16")
    if autocast["enabled"]:
        conversion.frozen_linears_in(torch.bfloat16, teacher, student)
    kl = conversion.compile_step(teacher, student) if args.compile else conversion.kl_rows
    window = {"parts": {}, "steps": 0, "tokens": 0, "seconds": 0.0}

    def record_and_save() -> None:
        # every replica takes part; one process alone has nobody to be in step with
        digests = replicas.digests(conversion.trainable_state(student)) if replicas.world > 1 else None
        if not replicas.main:
            return
        student.eval()
        with torch.autocast(**autocast):
            figures = {prefix + k: v for prefix, ref in references.items()
                       for k, v in conversion.evaluate(student, ref).items()
                       if not (prefix and k == "nll_t1_split")}
        record = {"step": step, "tokens": tokens, "minutes": round(elapsed / 60, 2),
                  "tokens_per_s": round(window["tokens"] / window["seconds"], 1) if window["seconds"] else None,
                  **{k: round(v / window["steps"], 4) for k, v in window["parts"].items()}, **figures}
        if digests is not None:
            record["replica_digests"] = digests
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
        window.update(parts={}, steps=0, tokens=0, seconds=0.0)
        recipe.update(steps=step, tokens=tokens, minutes=record["minutes"], heldout=figures)
        conversion.save_adapters(student, spec, base_ref, recipe, run / "adapters")
        torch.save({"trainable": conversion.trainable_state(student), "optimizer": optimizer.state_dict(),
                    "step": step, "tokens": tokens, "elapsed": elapsed, "base": base_ref["checkpoint_id"],
                    "spec": asdict(spec), "data_rng": data_rng.getstate(), "torch_rng": torch.get_rng_state()},
                   state_path)

    if step == 0:
        record_and_save()
    deadline = time.time() + 60 * args.time_limit_minutes if args.time_limit_minutes else math.inf
    run_started_at = elapsed  # a resumed run's schedule counts its minutes from here
    cache, cache_seconds = None, 0.0
    if args.teacher_cache:
        with torch.autocast(**autocast):
            taught, seconds = teacher_cache(args, run, teacher, tokenizer, chat_train, data_seed, base_ref, replicas)
        cache = conversion.CachedBatches(taught, args.batch_size, args.chat_fraction)
        cache_seconds = replicas.total(seconds) / replicas.world  # training time on one clock: minutes, schedules
        elapsed += cache_seconds
    bar = tqdm(desc="convert", initial=step, total=args.steps or None, file=sys.stdout, mininterval=30,
               disable=not replicas.main)
    # a cache just made counts in the minutes even if no step follows (this step is then recorded again)
    saved = cache_seconds == 0
    while (not args.steps or step < args.steps) and not replicas.any(time.time() >= deadline):
        started = time.time()
        student.train()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, decay_progress(args, tokens, elapsed - run_started_at), args.lr, args.warmup)
        batch = (conversion.taught_batch(cache.draw(data_rng), pad, data_rng) if cache
                 else conversion.conversion_batch(next(stream), pad, data_rng))
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        with torch.autocast(**autocast):
            loss, parts = conversion.conversion_loss(student, teacher, batch,
                                                     hidden_weight_at(args, elapsed - run_started_at),
                                                     args.confidence_weight, kl)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        replicas.average_gradients(trainable)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        batch_tokens = int(replicas.total(conversion.real_tokens(batch, pad)))
        seconds = replicas.total(time.time() - started) / replicas.world  # one clock for --decay-minutes
        step, tokens, elapsed = step + 1, tokens + batch_tokens, elapsed + seconds
        window["steps"] += 1
        window["tokens"] += batch_tokens
        window["seconds"] += seconds
        for k, v in {"loss": loss.item(), **parts}.items():
            window["parts"][k] = window["parts"].get(k, 0.0) + v
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{batch_tokens / seconds:.0f}")
        saved = step % args.eval_every == 0
        if saved:
            record_and_save()
    bar.close()
    if not saved:
        record_and_save()
    if replicas.main:
        print(f"stopped at step {step} ({tokens} tokens, {elapsed / 60:.1f} minutes of training); "
              f"adapters -> {run / 'adapters'}")
    replicas.exit_together()


def teacher_cache(args, run: Path, teacher: LanguageModel, tokenizer: TextTokenizer, chat: list[Sample],
                  data_seed: int, base_ref: dict, replicas: Replicas) -> tuple[list[conversion.TaughtSample], float]:
    """--teacher-cache: the first N samples of the replica's data stream with the teacher's hidden
    states, made once into the run folder (teacher_cache_RANK.pt) and read back on resume; and the
    seconds its making took (0 when read back)."""
    path = run / f"teacher_cache_{replicas.rank}.pt"
    meta = {"teacher": base_ref["checkpoint_id"], "samples": args.teacher_cache, "seq_tokens": args.seq_tokens,
            "chat_fraction": args.chat_fraction, "chat_samples": len(chat), "chat_tokens": args.chat_tokens,
            **({k: getattr(args, k) for k in ("chat_prompts", "open_prompts", "short_prompts")} if args.short_prompts
               else {}),
            "autocast": args.autocast, "seed": data_seed, "batches": "one kind"}
    if path.exists():
        cache, made_with = conversion.load_taught(path)
        if made_with != meta:
            sys.exit(f"{path} holds a teacher cache made otherwise ({made_with}, not {meta}); choose another --run")
        return cache, 0.0
    started = time.time()
    batches = conversion.batch_stream(tokenizer, data_seed, args.seq_tokens, chat, args.chat_fraction, args.batch_size)
    samples = list(itertools.islice((s for batch in batches for s in batch), args.teacher_cache))
    cache = conversion.taught_samples(teacher, samples, teacher.cfg.pad_id, chat)
    conversion.save_taught(cache, meta, path)
    seconds = time.time() - started
    tokens = sum(len(t.hidden) for t in cache)
    if replicas.main:
        print(f"teacher cache: {len(cache)} samples, {tokens} tokens in {seconds:.0f} s -> {path}", flush=True)
    return cache, seconds


def token_rows(samples: list[Sample], pad_id: int, length: int) -> tuple[torch.Tensor, ...]:
    """Prompt + completion of each sample, cut to `length` and padded: tokens and valid [B, T], and
    each row's prompt's last position [B]."""
    rows = [(list(s.prompt) + list(s.completion))[:length] for s in samples]
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, :len(row)], valid[i, :len(row)] = torch.tensor(row), True
    return tokens, valid, torch.tensor([min(len(s.prompt), length) - 1 for s in samples])


def load_records(directories: list[str], base_id: str) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records of draft-head-records folders: every train shard written so far in
    each, the held-out shard of the first."""
    if len(set(map(Path, directories))) < len(directories):
        sys.exit(f"--records names a folder twice: {' '.join(directories)}")
    held_out = Path(directories[0]) / "held_out.pt"
    if not held_out.exists():
        sys.exit(f"{directories[0]} holds no held-out shard: name a folder that has one first")
    train = []
    for directory in map(Path, directories):
        meta = json.loads((directory / "records.json").read_text(encoding="utf-8"))
        if meta["base"] != base_id:
            sys.exit(f"{directory} holds records of base {meta['base']}, not {base_id}")
        train += [r for shard in sorted(directory.glob("train_*.pt")) for r in torch.load(shard, weights_only=True)]
    if not train:
        sys.exit(f"{', '.join(directories)}: no train shard yet")
    return train, torch.load(held_out, weights_only=True)


class BaseRunDraftData:
    """The head's data made on the fly: the base's answers to task questions and open-ended requests
    (chat.json) and text windows, the base run on every batch."""

    def __init__(self, args, run: Path, base: Checkpoint, ids: torch.Tensor | None):
        self.args, self.base = args, base
        self.chat_train, chat_eval, _ = chat_data(args, run, base.model, base.tokenizer, base.id, Replicas("cpu"),
                                                  open_held_out=False)
        self.held_out = token_rows(chat_eval, base.config.pad_id, args.seq_tokens)
        self.stream, self.ids = None, ids  # the --init-head's; otherwise its draft tokens are chosen when it ships

    def start(self, step: int) -> None:
        args = self.args
        self.stream = conversion.batch_stream(self.base.tokenizer, stream_key(args.seed, step), args.seq_tokens,
                                              self.chat_train, args.chat_fraction, args.batch_size)

    def train_loss(self, model: LanguageModel) -> tuple[torch.Tensor, dict, int]:
        """The loss of the next batch, its figures, and the tokens it read."""
        tokens, valid, start = token_rows(next(self.stream), self.base.config.pad_id, self.args.seq_tokens)
        return *draft_head.draft_loss(model, tokens, valid, start, self.args.greedy_weight), int(valid.sum())

    def held_out_figures(self, model: LanguageModel) -> dict:
        _, figures = draft_head.draft_loss(model, *self.held_out)
        return {"chat_kl": figures["kl"], "chat_top1": figures["top1"], "chat_positions": figures["positions"]}

    def draft_ids(self) -> torch.Tensor | None:
        """The --init-head's draft tokens, or the --draft-vocab tokens most frequent in the training data's
        targets (the teacher's answers and text)."""
        if not self.args.draft_vocab:
            return None
        if self.ids is not None:
            return self.ids
        text = conversion.text_samples(self.base.tokenizer, "train", self.args.seed, self.args.seq_tokens)
        targets = [s.completion for s in self.chat_train] + [next(text).completion for _ in range(len(self.chat_train))]
        return draft_head.frequent_tokens(targets, self.args.draft_vocab, always=[self.base.config.eos_id])

    def describe(self) -> dict:
        return {"batches": "one kind"}


class RecordDraftData:
    """The head's data from teacher records (draft-head-records): the base never runs. The head drafts
    from the --draft-vocab tokens most frequent in the records' targets from the start; a resumed run
    keeps the tokens it started with (`ids`), whatever shards were added since."""

    def __init__(self, args, base: Checkpoint, ids: torch.Tensor | None):
        self.args = args
        self.train, held_out = load_records(args.records, base.id)
        if ids is None:
            ids = (draft_head.frequent_tokens([r["tokens"][1:] for r in self.train], args.draft_vocab,
                                              always=[base.config.eos_id])
                   if args.draft_vocab else torch.arange(base.config.vocab_size))
        self.ids = ids
        self.held_out = {source: draft_head.record_rows([r for r in held_out if r["source"] == source])
                         for source in sorted({r["source"] for r in held_out})}
        self.rng = None
        self.tokens = sum(len(r["tokens"]) for r in self.train)
        print(f"records: {len(self.train)} continuations, {self.tokens} tokens; drafts from {len(self.ids)} tokens")

    def start(self, step: int) -> None:
        self.rng = random.Random(stream_key(self.args.seed, step))

    def train_loss(self, model: LanguageModel) -> tuple[torch.Tensor, dict, int]:
        """The loss of the next batch, its figures, and the tokens it read."""
        records = self.rng.sample(self.train, self.args.batch_size)
        return *draft_head.record_loss(model, draft_head.record_rows(records), self.ids, self.args.greedy_weight), \
            sum(len(r["tokens"]) for r in records)

    def held_out_figures(self, model: LanguageModel) -> dict:
        figures, positions, kl, top1 = {}, 0, 0.0, 0.0
        for source, rows in self.held_out.items():
            _, part = draft_head.record_loss(model, rows, self.ids)
            figures[f"{source}_top1"] = part["top1"]
            positions, kl, top1 = (positions + part["positions"], kl + part["kl"] * part["positions"],
                                   top1 + part["top1"] * part["positions"])
        return {"records_kl": kl / max(positions, 1), "records_top1": top1 / max(positions, 1), **figures,
                "records_positions": positions}

    def draft_ids(self) -> torch.Tensor | None:
        return self.ids if self.args.draft_vocab else None

    def describe(self) -> dict:
        return {"records_continuations": len(self.train), "records_tokens": self.tokens}


def cmd_draft_head(args) -> None:
    """Only the head learns; the base runs without gradients (or not at all, from --records).
    Resumable; each invocation trains --time-limit-minutes more; held-out figures are logged every
    --eval-every steps."""
    if args.decay_tokens and args.decay_minutes:
        sys.exit("--decay-tokens and --decay-minutes each set the rate's schedule: give one")
    base = load_checkpoint(args.baseline)
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    state_path, log_path = run / "state.pt", run / "log.jsonl"
    torch.manual_seed(args.seed)
    model = draft_head.with_draft_head(base.model.eval())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, tokens, elapsed, draft_ids, earlier_invocations, started_from = 0, 0, 0.0, None, [], None
    resumed = state_path.exists()
    if resumed:
        state = torch.load(state_path, weights_only=False)
        if state["base"] != base.id:
            sys.exit(f"{run} trains a head for base {state['base']}, not {base.id}")
        model.load_state_dict(state["head"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step, tokens, elapsed, draft_ids = state["step"], state["tokens"], state["elapsed"], state.get("draft_ids")
        earlier_invocations = (state.get("invocations")
                               or [{"from_step": 0, "to_step": step, "arguments": "not recorded"}])
        started_from = state.get("started_from")
        print(f"resumed at step {step} ({tokens} tokens, {elapsed / 60:.1f} minutes)")
    elif args.init_head:
        weights, meta = draft_head.load_head(args.init_head)
        if meta["base"] != base.id:
            sys.exit(f"{args.init_head} is a head for base {meta['base']}, not {base.id}")
        model.load_state_dict({k: v for k, v in weights.items() if k != "mtp.draft_ids"}, strict=False)
        started_from = meta["recipe"]  # how the head it starts from was made (its path may hold another later)
        if args.draft_vocab and "mtp.draft_ids" in weights:  # it goes on drafting the tokens it learned to draft
            draft_ids = weights["mtp.draft_ids"]
            print(f"{args.init_head} drafts from {len(draft_ids)} tokens: kept "
                  "(--draft-vocab counts only for a new head)")
    data = RecordDraftData(args, base, draft_ids) if args.records else BaseRunDraftData(args, run, base, draft_ids)
    data.start(step)
    # this invocation's arguments, also at the recipe's top level; `invocations` lists every one's
    invocation = {**{k: getattr(args, k) for k in DRAFT_HEAD_DEFAULTS if k not in ("threads", "draft_vocab")},
                  "records": args.records, "init_head": None if resumed else args.init_head, **data.describe()}
    recipe = {"kind": "draft-head", "torch": torch.__version__, **invocation,
              **({"started_from": started_from} if started_from is not None else {})}
    started_at_step = step

    def record_and_save(window: dict) -> None:
        model.eval()
        with torch.no_grad():
            figures = data.held_out_figures(model)
        record = {"step": step, "tokens": tokens, "minutes": round(elapsed / 60, 2),
                  "tokens_per_s": round(window["tokens"] / window["seconds"], 1) if window["seconds"] else None,
                  "train_kl": round(window["kl"] / max(window["steps"], 1), 4),
                  **{k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}}
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
        invocations = earlier_invocations + [{"from_step": started_at_step, "to_step": step, **invocation}]
        recipe.update(steps=step, tokens=tokens, minutes=record["minutes"], invocations=invocations,
                      **{f"heldout_{k}": record[k] for k in figures if not k.endswith("positions")})
        draft_head.write_head(model, base.id, dict(recipe), run / "head")
        torch.save({"head": draft_head.head_state(model), "optimizer": optimizer.state_dict(), "step": step,
                    "tokens": tokens, "elapsed": elapsed, "base": base.id,
                    "draft_ids": data.ids, "invocations": invocations, "started_from": started_from}, state_path)
        window.update(steps=0, tokens=0, seconds=0.0, kl=0.0)

    window = {"steps": 0, "tokens": 0, "seconds": 0.0, "kl": 0.0}
    if step == 0:
        record_and_save(window)
    run_started_at, deadline = elapsed, time.time() + 60 * args.time_limit_minutes

    def trains_on() -> bool:
        """Within --time-limit-minutes and --steps, where given; neither given: no training."""
        within_time = time.time() < deadline if args.time_limit_minutes else bool(args.steps)
        return within_time and (not args.steps or step < args.steps)

    while trains_on():
        started = time.time()
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, decay_progress(args, tokens, elapsed - run_started_at), args.lr, args.warmup)
        loss, parts, read = data.train_loss(model)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        seconds = time.time() - started
        step, tokens, elapsed = step + 1, tokens + read, elapsed + seconds
        window.update(steps=window["steps"] + 1, tokens=window["tokens"] + read,
                      seconds=window["seconds"] + seconds, kl=window["kl"] + parts["kl"])
        if step % args.eval_every == 0:
            record_and_save(window)
    if window["steps"]:
        record_and_save(window)
    print(f"stopped at step {step} ({tokens} tokens, {elapsed / 60:.1f} minutes); head -> {run / 'head'}")
    if args.ship_to:
        ship_draft_head(args, model, base, run, data)


def record_prompts(tokenizer: TextTokenizer, split: str, counts: dict[str, int], text_tokens: int,
                   seed: int, open_from: int = 0) -> list[tuple[str, list[int]]]:
    """(source, prompt tokens) for each source's first `counts[source]` prompts of `split` ("train" or
    "held_out"), the open requests from the `open_from`th, shuffled together; a question is a user turn
    under the chat template (as it is, for a tokenizer without one)."""
    def chat(question: str) -> list[int]:
        return tokenizer.encode_prompt(tokenizer.user_turn(question)
                                       if tokenizer.chat_template else question)

    made = [("open", chat(q)) for q in open_prompts(split, seed)[open_from:open_from + counts["open"]]]
    made += [("task", chat(q)) for q in conversion.chat_prompts("train" if split == "train" else "calibration",
                                                                 counts["task"], seed)]
    windows = stdlib_chunks("train" if split == "train" else "calibration", 8 * text_tokens, seed)
    made += [("text", tokenizer.encode_prompt(tokenizer.decode(tokenizer.encode(next(windows))[:text_tokens - 1])))
             for _ in range(counts["text"])]
    random.Random(f"records-{split}-{seed}").shuffle(made)
    return made


def cmd_draft_head_records(args) -> None:
    """The base's continuations with their hidden states, in shards of --rows prompts (`held_out.pt`
    first, unless no held-out prompt is asked for, then `train_NNNN.pt`); resumable: shards already
    written are kept. Training continuations are greedy, or sampled at --temperature (more text from
    the same prompts); held-out ones are always greedy, as served."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        sys.exit(f"--temperature must be a finite number >= 0 (0: greedy), not {args.temperature}")
    base = load_checkpoint(args.baseline)
    teacher, engine_label = base.model, "torch"
    if args.engine:
        teacher = OnnxComponents(args.engine, threads=args.threads, max_sequences=args.rows)
        if teacher.exported.checkpoint_id != base.id:
            sys.exit(f"{args.engine} is an export of checkpoint {teacher.exported.checkpoint_id}, not of the "
                     f"--baseline {base.id}")
        settings = teacher.exported.settings  # what makes its hidden states what they are
        engine_label = {"runtime": "onnxruntime", "weight_precision": teacher.exported.weight_precision,
                        **{k: settings[k] for k in ("weight_quantization", "backbone_graph") if k in settings}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"base": base.id, "max_tokens": args.max_tokens, "text_tokens": args.text_tokens, "seed": args.seed,
            "rows": args.rows, "temperature": args.temperature, "engine": engine_label,
            "open_from": args.open_from, "train": {"open": args.open, "task": args.task, "text": args.text},
            "held_out": {"open": args.held_out_open, "task": args.held_out_task, "text": args.held_out_text}}
    meta_path = out / "records.json"
    # (a folder written before --temperature, --engine and --open-from: greedy records made by torch, from the first)
    if meta_path.exists() and {"temperature": 0.0, "engine": "torch", "open_from": 0,
                               **json.loads(meta_path.read_text(encoding="utf-8"))} != meta:
        sys.exit(f"{out} holds records made otherwise ({meta_path}); choose another --out")
    meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    deadline = time.time() + 60 * args.time_limit_minutes if args.time_limit_minutes else float("inf")
    shards = ([("held_out", record_prompts(base.tokenizer, "held_out", meta["held_out"], args.text_tokens, args.seed))]
              if any(meta["held_out"].values()) else [])
    train = record_prompts(base.tokenizer, "train", meta["train"], args.text_tokens, args.seed, args.open_from)
    shards += [(f"train_{i // args.rows:04d}", train[i:i + args.rows]) for i in range(0, len(train), args.rows)]
    for name, prompts in shards:
        path = out / f"{name}.pt"
        if path.exists():
            continue
        if time.time() > deadline:
            print(f"time limit: stopped before {name}")
            return
        started = time.time()
        records = []
        held_out = name == "held_out"  # greedy, as served
        temperature, shard = (0.0, 0) if held_out else (args.temperature, 1 + int(name.removeprefix("train_")))
        for at in range(0, len(prompts), args.rows):
            chunk = prompts[at:at + args.rows]
            made = draft_head.teacher_records(teacher, [p for _, p in chunk], args.max_tokens, temperature,
                                              seed=[args.seed, shard, at])
            records += [{**r, "source": source} for (source, _), r in zip(chunk, made)]
        torch.save(records, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        tokens = sum(len(r["tokens"]) for r in records)
        print(f"{name}: {len(records)} continuations, {tokens} tokens, {tokens / (time.time() - started):.0f} tokens/s",
              flush=True)
    print(f"all {len(shards)} shards in {out}")


def ship_draft_head(args, model, base: Checkpoint, run: Path, data) -> None:
    """The run's head in bf16 where it ships from, drafting from the data's --draft-vocab tokens; the
    held-out figures of the shipped head are recorded beside the run's."""
    weights, meta = draft_head.load_head(run / "head")
    model.mtp.load_state_dict({k.removeprefix("mtp."): v for k, v in weights.items()})
    recipe = dict(meta["recipe"])
    ids = data.draft_ids()
    if ids is not None:
        model = draft_head.restricted(model, ids)
    shipped = draft_head.with_draft_head(base.model, model.cfg.draft_vocab)
    shipped.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                             for k, v in model.state_dict().items() if k.startswith("mtp.")}, strict=False)
    with torch.no_grad():
        recipe.update({f"shipped_{k}": round(v, 4) for k, v in data.held_out_figures(shipped.eval()).items()
                       if k.endswith("top1")})  # (a KL against a head that cannot draft most tokens is infinite)
    draft_head.write_head(shipped, base.id, recipe, args.ship_to, dtype=torch.bfloat16)
    print(f"shipped (bf16, draft vocabulary {model.cfg.draft_vocab or 'all'}; held-out "
          f"{ {k: v for k, v in recipe.items() if k.startswith('shipped_')} }) -> {args.ship_to}")


def load_base(source: str) -> Checkpoint:
    """A checkpoint folder, or a GGUF file / Hugging Face folder imported on the spot."""
    if (Path(source) / CONFIG).exists() and (Path(source) / "model.safetensors").exists():
        return load_checkpoint(source)
    from builder.import_model import import_model
    return import_model(source)


def cmd_merge_adapters(args) -> None:
    """Base + adapters -> an ordinary dual-end checkpoint (its id covers both)."""
    try:
        merged = conversion.merged_checkpoint(load_base(args.base), args.adapters)
    except ValueError as error:
        sys.exit(str(error))
    print(f"{args.base} + {args.adapters} -> {args.out} (checkpoint {merged.save(args.out)})")


def cmd_ship_adapters(args) -> None:
    conversion.ship_adapters(args.adapters, args.to)
    print(f"{args.adapters} -> {args.to} (bf16)")


def cmd_promote(args) -> None:
    """Verify a run's checkpoint and write it, in the current format, where it ships from."""
    checkpoint = load_checkpoint(args.source)
    ckpt_id = checkpoint.save(args.to)
    print(f"{args.source} -> {args.to} (checkpoint {ckpt_id})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge")
    for flag in ("--dualend", "--baseline-before", "--baseline-after", "--out"):
        merge.add_argument(flag, required=True)
    promote = sub.add_parser("promote")
    promote.add_argument("--source", required=True)
    promote.add_argument("--to", required=True)
    merge_adapters = sub.add_parser("merge-adapters")
    merge_adapters.add_argument("--base", required=True, help="the base checkpoint folder, GGUF file or HF folder")
    merge_adapters.add_argument("--adapters", required=True, help="a convert run's adapters/ folder")
    merge_adapters.add_argument("--out", required=True)
    ship = sub.add_parser("ship-adapters", help="a run's adapters in bf16, where they ship from (checkpoints/NAME)")
    ship.add_argument("--adapters", required=True)
    ship.add_argument("--to", required=True)
    convert = sub.add_parser("convert")
    for key, value in CONVERT_DEFAULTS.items():
        convert.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value, help=CONVERT_HELP.get(key))
    convert.add_argument("--baseline", required=True, help="the token-level checkpoint to convert (the teacher)")
    convert.add_argument("--init-adapters", help="start from these adapters (a run's, or the shipped ones; at a "
                         "--lora-rank at least theirs, each adapter widened as the same model); ignored when the run "
                         "folder holds a state to resume")
    convert.add_argument("--run", "--run-dir", dest="run", required=True,
                         help="the run folder (under torchrun write --run-dir: torchrun reads --run as its --run-path)")
    convert.add_argument("--mtp-layer-full", action="store_true",
                         help="the MTP head's block trains its own weights (the backbone's blocks keep --lora-rank "
                              "adapters; ships ~7 MB more on SmolLM2); --init-adapters may be of a run without it")
    convert.add_argument("--compile", action="store_true",
                         help="torch.compile (inductor) the blocks and the KL: the same losses in fewer minutes once "
                              "compiled (the first steps wait for it; needs a C++ compiler on a CPU)")
    head = sub.add_parser("draft-head", help="an MTP draft head on a frozen token-level checkpoint")
    for key, value in DRAFT_HEAD_DEFAULTS.items():
        head.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value, help=DRAFT_HEAD_HELP.get(key))
    head.add_argument("--baseline", required=True, help="the token-level checkpoint (frozen; the teacher)")
    head.add_argument("--run", required=True)
    head.add_argument("--records", nargs="+", help="train from these teacher records folders (draft-head-records; "
                      "held-out figures from the first): the base does not run; --batch-size counts continuations")
    head.add_argument("--init-head", help="start from this head (a run's head/ or a shipped one), with the tokens it "
                      "drafts from when it has a draft vocabulary; ignored when the run folder holds a state to resume")
    head.add_argument("--ship-to", help="write the head in bf16 here at the end (checkpoints/NAME), drafting from "
                      "the --draft-vocab most frequent tokens (0: all)")
    records = sub.add_parser("draft-head-records", help="the base's continuations with their hidden states, "
                             "for draft-head --records")
    for key, value in RECORDS_DEFAULTS.items():
        source = RECORD_SOURCES.get(key.removeprefix("held_out_"))
        records.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value,
                             help=f"prompts of {source}" if source else RECORDS_HELP.get(key))
    records.add_argument("--baseline", required=True, help="the token-level checkpoint (the teacher)")
    records.add_argument("--out", required=True, help="the records folder (resumed when it exists)")
    records.add_argument("--engine", help="an export of the baseline (build/export/NAME, e.g. smollm2_int4) that "
                         "continues the prompts on ONNX Runtime, its weight precision's hidden states and choices "
                         "recorded (int4: ~1.2x torch's tokens/s on two cores); default: the torch model")
    for name in ("tokenizer", "baseline", "dualend"):
        p = sub.add_parser(name)
        for key, value in DEFAULTS.items():
            p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    sub.choices["tokenizer"].add_argument("--out", required=True)
    for name in ("baseline", "dualend"):
        sub.choices[name].add_argument("--run", required=True)
        sub.choices[name].add_argument("--steps", type=int, default=6000)
    sub.choices["baseline"].add_argument("--tokenizer", help="tokenizer of a new baseline")
    sub.choices["baseline"].add_argument("--init-from", help="continue training this baseline checkpoint")
    sub.choices["dualend"].add_argument("--baseline", required=True)
    sub.choices["dualend"].add_argument("--compressor-init", choices=("sum", "second", "random"), default="sum")
    sub.choices["dualend"].add_argument("--position-stride", type=int, choices=(1, 2), default=1)
    sub.choices["dualend"].add_argument("--augmentation", choices=tuple(AUGMENTATIONS), default="gated-steps",
                                        help="how rejected drafts are shown in training (split-pairs: ablation)")
    sub.choices["dualend"].add_argument("--init-from", help="continue training this dual-end checkpoint "
                                        "(converted from --baseline) instead of converting afresh")
    args = parser.parse_args(argv)
    torch.set_num_threads(getattr(args, "threads", 2))
    commands = {"tokenizer": cmd_tokenizer, "baseline": cmd_baseline, "dualend": cmd_dualend, "merge": cmd_merge,
                "promote": cmd_promote, "convert": cmd_convert, "merge-adapters": cmd_merge_adapters,
                "ship-adapters": cmd_ship_adapters, "draft-head": cmd_draft_head,
                "draft-head-records": cmd_draft_head_records}
    with torch.device(getattr(args, "device", "cpu")):  # batches are built where the model is
        commands[args.command](args)


if __name__ == "__main__":
    main()
