"""Converting a pretrained token-level model to pair-in/pair-out (dualend.train.conversion and
`builder.train convert` / `merge-adapters`), on a tiny random LlamaForCausalLM as the teacher."""
import argparse
import copy
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder import train
from builder.evaluate_conversion import task_questions
from dualend.engine.checkpoint import Checkpoint, load_checkpoint
from dualend.engine.tokenizer import BOS, EOS, PAD, TextTokenizer
from dualend.train import conversion
from dualend.train.open_prompts import open_prompts
from dualend.train.short_questions import short_questions, subject_questions
from dualend.train.training import Sample, baseline_forward, dualend_batch
from test_llama_family import hf_model, imported

SPEC = conversion.ConversionSpec(lora_rank=4, lora_alpha=8.0, frozen_layers=0)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base(tiny_tokenizer) -> Checkpoint:
    """A tiny random Llama (GQA, untied) over the tiny tokenizer's vocabulary, as imported."""
    model = imported(hf_model("llama", False, None, vocab=tiny_tokenizer.vocab_size, bos=tiny_tokenizer.bos_id,
                              eos=tiny_tokenizer.eos_id), pad_id=tiny_tokenizer.pad_id)
    return Checkpoint(model.requires_grad_(False), tiny_tokenizer,
                      {"source": {"file": "tiny.gguf", "sha256": "0" * 64}, "context": 512})


def _batch(tokenizer, rows=2, tokens=24, seed=0):
    stream = conversion.text_samples(tokenizer, "train", seed, tokens)
    return dualend_batch([next(stream) for _ in range(rows)], tokenizer.pad_id, random.Random(seed))


def test_lora_at_init_leaves_the_backbone_equal_to_the_teacher(base):
    """Same inputs: the student's pair i (stride 2) sits at the teacher's position 2i+1."""
    student = conversion.build_student(base.model, SPEC)
    x = torch.randn(1, 6, base.config.d_model)
    valid = torch.ones(1, 6, dtype=torch.bool)
    with torch.no_grad():
        ours, _, _ = student.backbone(x, torch.arange(6)[None], valid)
        teachers, _, _ = base.model.backbone(x, (2 * torch.arange(6) + 1)[None], valid)
    assert torch.allclose(ours, teachers, atol=1e-5)
    assert any(isinstance(m, conversion.LoRALinear) for m in student.backbone.modules())


def test_the_compressor_starts_as_the_mean_or_as_pipos_sum_of_the_pairs_embeddings(base):
    pairs = torch.tensor([[[5, 9], [17, 3]]])
    embeddings = base.model.embedding(pairs)  # [1, 2, 2, D]
    for start, expected in (("mean", embeddings.mean(-2)), ("sum", embeddings.sum(-2))):
        student = conversion.build_student(base.model, conversion.ConversionSpec(4, 8.0, 0, start))
        with torch.no_grad():
            assert torch.allclose(student.latents(pairs), expected, atol=1e-6)
    assert SPEC.compressor_init == "mean"  # adapters saved before the choice existed name none: the mean
    with pytest.raises(ValueError, match="compressor_init 'second': expected one of mean, sum"):
        conversion.build_student(base.model, conversion.ConversionSpec(compressor_init="second"))
    with pytest.raises(SystemExit, match="--compressor-init second: expected one of mean, sum"):
        train.main(["convert", "--baseline", "unused", "--run", "unused", "--compressor-init", "second"])


def test_a_few_steps_lower_the_loss(base, tiny_tokenizer):
    torch.manual_seed(0)
    student = conversion.build_student(base.model, SPEC)
    trainable = [p for p in student.parameters() if p.requires_grad]
    assert trainable and all(not p.requires_grad for p in base.model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    batch = _batch(tiny_tokenizer)
    losses = []
    for _ in range(8):
        loss, parts = conversion.conversion_loss(student, base.model, batch)
        assert set(parts) == {"kl_t1", "kl_t2", "hidden", "conf"}
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_lora_rank_0_trains_the_blocks_own_weights_and_merges_to_the_student(base, tiny_tokenizer):
    """A full fine-tune of the blocks (and the MTP layer): no adapters, the embedding and LM head frozen."""
    spec = conversion.ConversionSpec(lora_rank=0)
    torch.manual_seed(2)
    student = conversion.build_student(base.model, spec)
    assert not any(isinstance(m, conversion.LoRALinear) for m in student.modules())
    trainable = conversion.trainable_state(student)
    assert "backbone.layers.0.attn.qkv.weight" in trainable and "mtp.layer.ffn.down.weight" in trainable
    assert not any(name.startswith(("embedding", "output")) for name in trainable)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    loss, _ = conversion.conversion_loss(student, base.model, _batch(tiny_tokenizer))
    loss.backward()
    optimizer.step()
    assert not torch.equal(student.backbone.layers[0].attn.qkv.weight, base.model.backbone.layers[0].attn.qkv.weight)
    merged = conversion.merge_adapters(base.model, conversion.trainable_state(student), spec)
    batch = _batch(tiny_tokenizer, seed=3)
    with torch.no_grad():
        for ours, theirs in zip(conversion.student_forward(student.eval(), batch), conversion.student_forward(merged, batch)):
            assert torch.allclose(ours, theirs, atol=1e-5)


def test_save_then_merge_reproduces_the_student_with_a_stable_checkpoint_id(base, tiny_tokenizer, tmp_path):
    torch.manual_seed(1)
    student = conversion.build_student(base.model, SPEC)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # so the LoRA B matrices are no longer zero
        loss, _ = conversion.conversion_loss(student, base.model, _batch(tiny_tokenizer))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    conversion.save_adapters(student, SPEC, {"checkpoint_id": base.id, "source": base.recipe["source"]},
                             {"steps": 2}, tmp_path / "adapters")
    adapters, meta = conversion.load_adapters(tmp_path / "adapters")
    assert meta["base"]["checkpoint_id"] == base.id and meta["model"]["pair_size"] == 2
    assert not any(name.startswith(("embedding", "output")) or ".base." in name for name in adapters)
    merged = conversion.merge_adapters(base.model, adapters, SPEC)
    assert not any(isinstance(m, conversion.LoRALinear) for m in merged.modules())
    batch = _batch(tiny_tokenizer, seed=3)
    student.eval()
    with torch.no_grad():
        for ours, theirs in zip(conversion.student_forward(student, batch), conversion.student_forward(merged, batch)):
            assert torch.allclose(ours, theirs, atol=1e-4)
    again = conversion.merge_adapters(base.model, adapters, SPEC)
    assert Checkpoint(merged, tiny_tokenizer).id == Checkpoint(again, tiny_tokenizer).id != base.id

    # the command: base folder + adapters -> an ordinary dual-end checkpoint, same id each time
    base.save(tmp_path / "base")
    for out in ("merged_a", "merged_b"):
        train.main(["merge-adapters", "--base", str(tmp_path / "base"), "--adapters", str(tmp_path / "adapters"),
                    "--out", str(tmp_path / out)])
    first, second = load_checkpoint(tmp_path / "merged_a"), load_checkpoint(tmp_path / "merged_b")
    assert first.id == second.id == Checkpoint(merged, tiny_tokenizer).id
    assert first.config.is_dualend and first.recipe["converted_from"] == base.id
    assert first.recipe["source"] == base.recipe["source"]


def test_two_replicas_under_torchrun_train_on_their_own_batches_and_stay_in_step(base, tmp_path):
    """Two CPU processes (gloo): each replica's digest of its trainable weights, gathered at every save,
    is the same on both, and changes from save to save. Their batches differ (each its own data
    seed), so only the averaged gradients keep them equal."""
    base.save(tmp_path / "base")
    run = tmp_path / "run"
    options = ["convert", "--baseline", str(tmp_path / "base"), "--lora-rank", "4", "--batch-size", "2",
               "--seq-tokens", "32", "--eval-rows", "2", "--eval-every", "2", "--steps", "4", "--chat-prompts", "0",
               "--autocast", "none", "--threads", "1", "--time-limit-minutes", "0"]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "builder.train", *options, "--run-dir", str(run)],
                   check=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    train.main([*options, "--run", str(tmp_path / "alone")])  # one process, the first replica's batches only
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log] == [0, 2, 4]
    digests = [record["replica_digests"] for record in log]
    assert all(len(pair) == 2 and pair[0] == pair[1] for pair in digests), digests
    assert len({pair[0] for pair in digests}) == 3  # the weights moved between saves
    assert log[-1]["tokens"] == 2 * 4 * 2 * 32  # replicas x steps x rows x 32-token text windows
    assert json.loads((run / "adapters" / conversion.ADAPTERS_CONFIG).read_text())["recipe"]["replicas"] == 2
    together, alone = conversion.load_adapters(run / "adapters")[0], conversion.load_adapters(tmp_path / "alone" / "adapters")[0]
    assert any(not torch.equal(together[name], alone[name]) for name in together)  # the second replica's batches counted


def test_merge_refuses_adapters_of_another_base(base, tiny_tokenizer, tmp_path):
    other = imported(hf_model("llama", False, None, vocab=tiny_tokenizer.vocab_size, seed=5),
                     pad_id=tiny_tokenizer.pad_id)
    student = conversion.build_student(other, SPEC)
    conversion.save_adapters(student, SPEC, {"checkpoint_id": "not-this-base"}, {}, tmp_path / "adapters")
    base.save(tmp_path / "base")
    with pytest.raises(SystemExit, match="adapt base not-this-base"):
        train.main(["merge-adapters", "--base", str(tmp_path / "base"), "--adapters", str(tmp_path / "adapters"),
                    "--out", str(tmp_path / "out")])


def test_a_run_that_hits_its_time_limit_saves_and_the_next_run_resumes(base, tmp_path, capsys):
    base.save(tmp_path / "base")
    command = ["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"),
               "--lora-rank", "4", "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2",
               "--eval-every", "1000", "--time-limit-minutes", "0.002", "--autocast", "none"]
    train.main(command)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first = log[-1]["step"]
    assert log[0]["step"] == 0 and first >= 1  # the start, then the save at the time limit
    for key in ("nll_t1", "nll_t2", "teacher_nll_t1", "teacher_nll_t2", "agree_t1", "agree_t2", "ece",
                "nll_t1_split", "tokens_per_s"):
        assert key in log[-1], key
    assert (tmp_path / "run" / "adapters" / conversion.ADAPTERS).exists()
    capsys.readouterr()
    train.main(command)
    assert f"resumed at step {first}" in capsys.readouterr().out
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] > first and log[-1]["tokens"] > log[-2]["tokens"]


def saved_with_chat_template(base: Checkpoint, folder: Path) -> TextTokenizer:
    """The base saved at `folder` with a chat template that joins the messages' contents; its tokenizer."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = TextTokenizer(base.tokenizer.tokenizer, {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
                                                         "add_bos_token": True, "chat_template": template})
    Checkpoint(base.model, tokenizer, base.recipe).save(folder)
    return tokenizer


def test_chat_rows_are_the_teachers_greedy_answers_under_its_chat_template(base, tmp_path):
    tokenizer = saved_with_chat_template(base, tmp_path / "base")
    train.main(["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
                "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--chat-prompts", "3",
                "--chat-tokens", "5", "--chat-fraction", "1.0", "--steps", "1", "--autocast", "none"])
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())
    assert len(chat["train"]) == 3 and len(chat["calibration"]) == 2
    prompt, answer = chat["train"][0]
    assert prompt == tokenizer.encode_prompt(conversion.chat_prompts("train", 3, 0)[0])
    greedy = conversion.teacher_chat_samples(base.model, tokenizer, conversion.chat_prompts("train", 1, 0), 5)
    assert answer == greedy[0].completion and 1 <= len(answer) <= 6
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 1 and "chat_nll_t1" in log[-1] and "chat_agree_t2" in log[-1]


def test_open_prompts_join_the_chat_rows_and_held_out_requests_are_evaluated_with_or_without_them(base, tmp_path):
    """--open-prompts: the teacher's answers to the first open-ended train requests follow the task questions'
    in the chat rows; held-out requests (topics training never sees) get open_ figures in every run with chat
    rows, and a chat.json made for another seed, other answer lengths or other counts is made again."""
    tokenizer = saved_with_chat_template(base, tmp_path / "base")
    args = ["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
            "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--chat-prompts", "2",
            "--chat-tokens", "4", "--chat-fraction", "1.0", "--steps", "1", "--autocast", "none"]
    train.main(args + ["--open-prompts", "3"])
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())
    assert chat["prompts"] == {"task": 2, "open": 3, "held_out": 2, "open_held_out": 2, "seed": 0, "tokens": 4}
    requests = open_prompts("train")[:3]
    assert [p for p, _ in chat["train"]] == [tokenizer.encode_prompt(q) for q in
                                             conversion.chat_prompts("train", 2, 0) + requests]
    held_out = open_prompts("held_out")[:2]
    assert [p for p, _ in chat["open_held_out"]] == [tokenizer.encode_prompt(q) for q in held_out]
    greedy = conversion.teacher_chat_samples(base.model, tokenizer, requests[:1], 4)
    assert chat["train"][2][1] == greedy[0].completion
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert "open_nll_t1" in log[-1] and "open_agree_t1" in log[-1] and "chat_nll_t1" in log[-1]
    assert json.loads((tmp_path / "run" / "adapters" / "adapters.json").read_text())["recipe"]["open_prompts"] == 3
    (tmp_path / "run" / "state.pt").unlink()
    train.main(args + ["--open-prompts", "3", "--seed", "1"])
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())
    assert [p for p, _ in chat["train"]] == [tokenizer.encode_prompt(q) for q in
                                             conversion.chat_prompts("train", 2, 1) + open_prompts("train", 1)[:3]]
    assert max(len(answer) for _, answer in chat["train"]) == 4
    (tmp_path / "run" / "state.pt").unlink()
    train.main(args + ["--open-prompts", "3", "--seed", "1", "--chat-tokens", "2"])
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())
    assert max(len(answer) for _, answer in chat["train"]) <= 3  # 2 tokens (and EOS)
    (tmp_path / "run" / "state.pt").unlink()
    train.main(args)
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())
    assert len(chat["train"]) == 2 and [p for p, _ in chat["open_held_out"]] == [tokenizer.encode_prompt(q)
                                                                                  for q in held_out]
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert "open_nll_t1" in log[-1]


def test_short_questions_join_the_chat_rows_and_answers_already_made_are_kept(base, tmp_path, monkeypatch):
    """--short-prompts: the teacher's answers to short questions follow the task and open ones; a run folder
    whose chat.json answered the other prompts (same teacher, same --chat-tokens) asks the teacher only the
    new questions, and its earlier answers stay as they were; answers of another length are all made again."""
    tokenizer = saved_with_chat_template(base, tmp_path / "base")
    args = ["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
            "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--chat-prompts", "2", "--open-prompts", "2",
            "--chat-tokens", "4", "--chat-fraction", "1.0", "--steps", "1", "--autocast", "none"]
    train.main(args)
    before = json.loads((tmp_path / "run" / "chat.json").read_text())
    asked, teacher_chat_samples = [], conversion.teacher_chat_samples
    monkeypatch.setattr(conversion, "teacher_chat_samples",
                        lambda teacher, tok, prompts, *a, **k: asked.extend(prompts) or teacher_chat_samples(
                            teacher, tok, prompts, *a, **k))
    (tmp_path / "run" / "state.pt").unlink()
    train.main(args + ["--short-prompts", "3"])
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())
    short = short_questions(3, 0, exclude=frozenset(q for q, _ in task_questions()))
    assert asked == short
    assert chat["prompts"] == {**before["prompts"], "short": 3}
    assert chat["train"][:4] == before["train"] and chat["calibration"] == before["calibration"]
    assert [p for p, _ in chat["train"][4:]] == [tokenizer.encode_prompt(tokenizer.user_turn(q)) for q in short]
    assert chat["open_held_out"] == before["open_held_out"]
    asked.clear()
    (tmp_path / "run" / "state.pt").unlink()
    longer = args + ["--short-prompts", "3"]
    longer[longer.index("--chat-tokens") + 1] = "3"
    train.main(longer)  # answers of another length: all made again
    assert len(asked) == len(chat["train"]) + len(chat["calibration"]) + len(chat["open_held_out"]) == 11


def test_student_answers_replace_that_share_of_the_chat_rows_made_again_once_the_student_has_trained(
        base, tmp_path, monkeypatch):
    """--student-answers 0.5: every second chat row is answered by the student as it starts the invocation (its
    greedy answer, drafting off), the others keep the teacher's; kept while the student is the same, made again
    by a resumed run whose student has trained since."""
    tokenizer = saved_with_chat_template(base, tmp_path / "base")
    args = ["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
            "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--chat-prompts", "4", "--chat-tokens", "5",
            "--chat-fraction", "1.0", "--autocast", "none", "--lr", "1e-2", "--warmup", "1", "--student-answers", "0.5"]
    trained_on, batch_stream = [], conversion.batch_stream
    monkeypatch.setattr(conversion, "batch_stream",
                        lambda tok, seed, tokens, chat, *a: trained_on.append(chat) or batch_stream(tok, seed, tokens,
                                                                                                    chat, *a))
    made, greedy_answers = [], conversion.greedy_answers

    def answering(model, *rest):
        if conversion.trainable_state(model):  # the student's (the teacher's chat.json answers: no trainable state)
            made.append({k: v.clone() for k, v in conversion.trainable_state(model).items()})
        return greedy_answers(model, *rest)
    monkeypatch.setattr(conversion, "greedy_answers", answering)
    train.main(args + ["--steps", "2"])
    teacher_rows = [Sample(p, c) for p, c in json.loads((tmp_path / "run" / "chat.json").read_text())["train"]]
    torch.manual_seed(0)
    student = conversion.build_student(base.model, SPEC)  # the run's start: LoRA's B is zero, the scale no matter
    answers = greedy_answers(student, [s.prompt for s in teacher_rows[1::2]], 5, tokenizer.eos_id)
    assert trained_on[0][0::2] == teacher_rows[0::2]
    assert [s.completion for s in trained_on[0][1::2]] == answers
    assert answers != [s.completion for s in teacher_rows[1::2]]  # the pair model does not answer as its teacher
    assert all(1 <= len(a) <= 6 for a in answers)
    assert len(made) == 1
    train.main(args + ["--steps", "2"])  # resumed at step 2: the student trained since its answers were made
    assert len(made) == 2 and any(not torch.equal(made[0][k], made[1][k]) for k in made[0])
    train.main(args + ["--steps", "2"])  # nothing trained since: the same answers
    assert len(made) == 2 and trained_on[-1] == trained_on[-2]
    meta = json.loads((tmp_path / "run" / "adapters" / "adapters.json").read_text())
    assert meta["recipe"]["student_answers"] == 0.5


@pytest.mark.parametrize("options, refused", [
    (["--student-answers", "1.5", "--chat-prompts", "2"], "a share of the chat rows"),
    (["--student-answers", "0.5", "--chat-prompts", "2", "--teacher-cache", "4"], "give one"),
    (["--student-answers", "0.5", "--chat-prompts", "0"], "no chat rows"),
])
def test_student_answers_outside_a_share_with_a_teacher_cache_or_without_chat_rows_are_refused(
        base, tmp_path, options, refused):
    saved_with_chat_template(base, tmp_path / "base")
    with pytest.raises(SystemExit, match=refused):
        train.main(["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank",
                    "4", "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--chat-tokens", "4",
                    "--steps", "1", "--autocast", "none", *options])


def test_short_questions_are_distinct_and_never_a_task_check_question_nor_its_subject():
    """The task check stays held out: no short question is one of its questions or asks its sum in other
    words, and no subject (a unit's container), without its article, stands as a word in one of them,
    singular or plural."""
    asked = [q for q, _ in task_questions()]
    every = short_questions(10 ** 5, 13, exclude=frozenset(asked))
    assert len(every) == len(set(every)) > 2000 and not set(every) & set(asked)
    assert short_questions(40, 13) == every[:40] and short_questions(40, 14) != every[:40]
    assert sum(q.startswith("What is ") and q[8].isdigit() for q in every[:400]) == 100  # every fourth a sum
    assert {"What is 3 plus 5?", "What is 5 plus 3?", "What is 10 divided by 2?"} <= set(short_questions(10 ** 5, 13))
    assert not {"What is 3 plus 5?", "What is 5 plus 3?", "What is 10 divided by 2?"} & set(every)
    for subject, question in subject_questions():
        assert "{" not in question
        words = re.sub(r"^(a|an|the|half a|half an) ", "", subject.split("|")[-1], flags=re.IGNORECASE)
        pattern = rf"(?<!\w){re.escape(words)}(s|es)?(?!\w)"
        assert not [a for a in asked if re.search(pattern, re.sub(r"(?<!\w)(\w+?)(es|s)(?!\w)", r"\1", a),
                                                  re.IGNORECASE) or re.search(pattern, a, re.IGNORECASE)], subject


def test_a_batch_is_chat_answers_or_text_windows_never_both(tiny_tokenizer):
    chat = [Sample([1, 2], [3, 4]), Sample([1, 2], [5, 6, 7])]
    stream = conversion.batch_stream(tiny_tokenizer, 0, 24, chat, 0.4, rows=4)
    kinds = [{s in chat for s in next(stream)} for _ in range(400)]
    assert all(len(kind) == 1 for kind in kinds)
    assert 120 <= sum(True in kind for kind in kinds) <= 200
    assert all(len(s.prompt) + len(s.completion) == 24 for s in next(conversion.batch_stream(
        tiny_tokenizer, 0, 24, [], 0.4, rows=4)))


def test_cached_batches_are_one_kind_too_drawn_as_the_chat_fraction_says():
    hidden = torch.zeros(4, 2)
    cache = [conversion.TaughtSample(Sample([1, 2], [3, 4]), hidden, chat=i < 6) for i in range(20)]
    draws = conversion.CachedBatches(cache, 4, 0.4)
    rng = random.Random(0)
    kinds = [{t.chat for t in draws.draw(rng)} for _ in range(400)]
    assert all(len(kind) == 1 for kind in kinds)
    assert 120 <= sum(True in kind for kind in kinds) <= 200
    assert all(not t.chat for t in conversion.CachedBatches(cache, 8, 0.9).draw(rng))  # 6 chat rows: too few
    assert len(conversion.CachedBatches(cache[:5] + cache[-2:], 6, 0.5).draw(rng)) == 6  # neither kind has 6


def test_a_draft_head_run_on_its_base_trains_on_the_answers_to_open_requests_too(base, tmp_path):
    """draft-head --open-prompts: the same chat rows as convert's (task answers, then open ones); its
    held-out rows stay the task answers, so no held-out open answers are made."""
    tokenizer = saved_with_chat_template(base, tmp_path / "base")
    train.main(["draft-head", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"),
                "--chat-prompts", "2", "--open-prompts", "2", "--chat-tokens", "3", "--eval-rows", "2",
                "--batch-size", "2", "--seq-tokens", "32", "--steps", "1", "--time-limit-minutes", "0",
                "--draft-vocab", "0"])
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())
    assert [p for p, _ in chat["train"]] == [tokenizer.encode_prompt(q) for q in
                                             conversion.chat_prompts("train", 2, 0) + open_prompts("train")[:2]]
    assert chat["open_held_out"] == [] and len(chat["calibration"]) == 2


def test_a_new_run_started_from_adapters_begins_where_they_ended(base, tmp_path):
    """--init-adapters: the new run's first evaluation is the old run's last (same weights, same
    held-out rows), and it counts on from the old run's tokens."""
    base.save(tmp_path / "base")
    options = ["convert", "--baseline", str(tmp_path / "base"), "--lora-rank", "4", "--batch-size", "2",
               "--seq-tokens", "32", "--eval-rows", "2", "--eval-every", "3", "--steps", "3", "--chat-prompts", "0",
               "--autocast", "none"]
    train.main([*options, "--run", str(tmp_path / "first")])
    train.main([*options, "--run", str(tmp_path / "second"), "--init-adapters", str(tmp_path / "first" / "adapters")])
    first, second = ([json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
                     for name in ("first", "second"))
    assert second[0]["nll_t1"] == first[-1]["nll_t1"] != first[0]["nll_t1"]
    assert second[0]["tokens"] == first[-1]["tokens"] > 0
    started_from = conversion.load_adapters(tmp_path / "second" / "adapters")[1]["recipe"]["started_from"]
    assert started_from["adapters_sha256"] == conversion.adapters_sha256(tmp_path / "first" / "adapters")
    assert started_from["steps"] == 3
    with pytest.raises(SystemExit, match="lora_rank"):  # a lower rank is another model
        train.main([*options[:3], "--lora-rank", "2", *options[5:], "--run", str(tmp_path / "third"),
                    "--init-adapters", str(tmp_path / "first" / "adapters")])


def test_a_run_at_a_higher_rank_starts_from_lower_rank_adapters_as_the_same_model(base, tmp_path):
    """--lora-rank above the adapters' (the same alpha, so half the scale): each adapter is widened, the old
    directions rescaled to the new alpha / rank and the new ones starting at zero, so the first evaluation is
    the old run's last; the new directions then train."""
    base.save(tmp_path / "base")
    options = ["convert", "--baseline", str(tmp_path / "base"), "--batch-size", "2", "--seq-tokens", "32",
               "--eval-rows", "2", "--eval-every", "3", "--steps", "3", "--chat-prompts", "0", "--autocast", "none"]
    train.main([*options, "--lora-rank", "4", "--run", str(tmp_path / "narrow")])
    train.main([*options, "--lora-rank", "8", "--run", str(tmp_path / "wide"),
                "--init-adapters", str(tmp_path / "narrow" / "adapters")])
    narrow, wide = ([json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
                    for name in ("narrow", "wide"))
    for key in ("nll_t1", "nll_t2", "agree_t1"):
        assert wide[0][key] == pytest.approx(narrow[-1][key], abs=1e-4)
    old, _ = conversion.load_adapters(tmp_path / "narrow" / "adapters")
    new, meta = conversion.load_adapters(tmp_path / "wide" / "adapters")
    assert meta["spec"]["lora_rank"] == 8 and new["backbone.layers.0.attn.qkv.lora_a"].shape[0] == 8
    assert new["backbone.layers.0.attn.qkv.lora_b"][:, 4:].abs().sum() > 0  # the new directions trained
    assert not torch.equal(new["backbone.layers.0.attn.qkv.lora_a"][:4], old["backbone.layers.0.attn.qkv.lora_a"])


def test_a_run_training_the_mtp_block_whole_starts_from_adapted_ones_as_the_same_model_and_merges(base, tmp_path):
    """--mtp-layer-full: the MTP head's block trains its own weights (the backbone's blocks keep adapters); from
    adapters that adapted it, their fold is the start: the first evaluation is theirs, t2 included."""
    base.save(tmp_path / "base")
    options = ["convert", "--baseline", str(tmp_path / "base"), "--lora-rank", "4", "--batch-size", "2",
               "--seq-tokens", "32", "--eval-rows", "2", "--eval-every", "3", "--steps", "3", "--chat-prompts", "0",
               "--autocast", "none"]
    train.main([*options, "--run", str(tmp_path / "adapted")])
    train.main([*options, "--mtp-layer-full", "--run", str(tmp_path / "whole"),
                "--init-adapters", str(tmp_path / "adapted" / "adapters")])
    adapted, whole = ([json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
                      for name in ("adapted", "whole"))
    for key in ("nll_t1", "nll_t2", "agree_t2"):
        assert whole[0][key] == pytest.approx(adapted[-1][key], abs=1e-3)
    assert whole[-1]["nll_t2"] != whole[0]["nll_t2"]  # it trained
    adapters, meta = conversion.load_adapters(tmp_path / "whole" / "adapters")
    assert meta["spec"]["mtp_layer_full"] and "mtp.layer.ffn.down.weight" in adapters
    assert not any(n.startswith("mtp.layer.") and "lora" in n for n in adapters)
    assert any(n.startswith("backbone.layers.0.") and "lora" in n for n in adapters)
    merged = conversion.merged_checkpoint(load_checkpoint(tmp_path / "base"), tmp_path / "whole" / "adapters").model
    assert torch.equal(merged.mtp.layer.ffn.down.weight, adapters["mtp.layer.ffn.down.weight"])
    with pytest.raises(SystemExit, match="'mtp_layer_full': True"):  # they cannot start an adapted block
        train.main([*options, "--run", str(tmp_path / "back"), "--init-adapters", str(tmp_path / "whole" / "adapters")])


def test_the_rate_falls_by_a_cosine_over_tokens_or_over_this_runs_minutes(base, tmp_path):
    """--decay-tokens counts every token the adapters saw; --decay-minutes this run's training time
    (a GPU run with a time budget); neither: a constant rate after warm-up; both: refused."""
    options = argparse.Namespace(decay_tokens=0, decay_minutes=0.0)
    assert train.decay_progress(options, tokens=10**9, run_elapsed_s=10**6) == 0.0
    assert train.lr_at(50, 0.0, 1e-3, warmup=10) == pytest.approx(1e-3)
    options.decay_tokens = 2000
    assert train.decay_progress(options, tokens=1000, run_elapsed_s=0) == 0.5
    options.decay_tokens, options.decay_minutes = 0, 10.0
    assert train.decay_progress(options, tokens=0, run_elapsed_s=300) == 0.5
    assert train.lr_at(50, train.decay_progress(options, 0, 600), 1e-3, warmup=10) == pytest.approx(1e-4)
    assert train.lr_at(50, train.decay_progress(options, 0, 300), 1e-3, warmup=10) == pytest.approx(5.5e-4)
    base.save(tmp_path / "base")
    with pytest.raises(SystemExit, match="give one"):
        train.main(["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"),
                    "--decay-tokens", "1000", "--decay-minutes", "1"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: convert on CUDA in bf16 did not run")
def test_convert_runs_on_cuda_in_bf16_with_chat_rows(base, tmp_path):
    """The GPU path as users run it: teacher answers made (on the CPU's reference decoder), the
    losses under CUDA's bf16 autocast (which refuses binary cross-entropy on probabilities), a save."""
    saved_with_chat_template(base, tmp_path / "base")
    train.main(["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
                "--batch-size", "4", "--seq-tokens", "32", "--eval-rows", "2", "--chat-prompts", "3",
                "--chat-tokens", "5", "--steps", "3", "--eval-every", "3", "--device", "cuda", "--autocast", "bf16",
                "--decay-minutes", "1"])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log] == [0, 3] and log[-1]["chat_agree_t1"] >= 0
    assert (tmp_path / "run" / "adapters" / conversion.ADAPTERS).exists()


def test_a_batch_of_cached_teacher_states_gives_the_loss_of_the_teacher_itself(base, tiny_tokenizer, monkeypatch,
                                                                                 tmp_path):
    """--teacher-cache: the cached hidden states stand in for the teacher's blocks (fp16 rounding
    aside), also for rows of different lengths, and the blocks do not run for such a batch; a cached
    chat row stays marked as one when read back."""
    student = conversion.build_student(base.model, SPEC)
    stream = conversion.text_samples(tiny_tokenizer, "train", 0, 24)
    third = next(stream)
    samples = [next(stream), next(stream), Sample(third.prompt, third.completion[:9])]
    taught = conversion.taught_samples(base.model, samples, tiny_tokenizer.pad_id, chat=samples[2:], rows=2)
    assert [len(t.hidden) for t in taught] == [len(s.prompt) + len(s.completion) for s in samples]
    conversion.save_taught(taught, {}, tmp_path / "cache.pt")
    assert [t.chat for t in conversion.load_taught(tmp_path / "cache.pt")[0]] == [False, False, True]
    live_batch = conversion.conversion_batch(samples, tiny_tokenizer.pad_id, random.Random(5))
    live, _ = conversion.conversion_loss(student, base.model, live_batch)
    cached_batch = conversion.taught_batch(taught, tiny_tokenizer.pad_id, random.Random(5))
    monkeypatch.setattr(conversion, "teacher_hidden", lambda *a: pytest.fail("the teacher's blocks ran"))
    cached, _ = conversion.conversion_loss(student, base.model, cached_batch)
    assert cached.item() == pytest.approx(live.item(), rel=1e-3)


def test_convert_makes_its_teacher_cache_once_and_reads_it_back_when_resumed(base, tmp_path, monkeypatch):
    base.save(tmp_path / "base")
    options = ["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
               "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--eval-every", "1000",
               "--chat-prompts", "0", "--autocast", "none", "--teacher-cache", "3"]
    train.main([*options, "--steps", "2"])
    cache, meta = conversion.load_taught(tmp_path / "run" / "teacher_cache_0.pt")
    assert len(cache) == 3 and meta["samples"] == 3 and all(len(t.hidden) == 32 for t in cache)
    assert meta["batches"] == "one kind" and not any(t.chat for t in cache)  # no chat prompts: text windows only
    recipe = conversion.load_adapters(tmp_path / "run" / "adapters")[1]["recipe"]
    assert recipe["teacher_cache"] == 3 and recipe["steps"] == 2
    monkeypatch.setattr(conversion, "taught_samples", lambda *a: pytest.fail("the cache was made again"))
    train.main([*options, "--steps", "4"])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 4
    with pytest.raises(SystemExit, match="made otherwise"):
        train.main([*options[:-1], "4", "--steps", "5"])
    with pytest.raises(SystemExit, match="at least"):
        train.main([*options[:-1], "1", "--run", str(tmp_path / "other"), "--steps", "1"])


def test_a_teacher_cache_of_chat_batches_holds_chat_rows_marked_so(base, tmp_path):
    saved_with_chat_template(base, tmp_path / "base")
    train.main(["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
                "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--eval-every", "1000",
                "--chat-prompts", "4", "--chat-tokens", "8", "--chat-fraction", "1.0", "--autocast", "none",
                "--teacher-cache", "3", "--steps", "1"])
    cache, _ = conversion.load_taught(tmp_path / "run" / "teacher_cache_0.pt")
    chat = json.loads((tmp_path / "run" / "chat.json").read_text())["train"]
    assert len(cache) == 3 and all(t.chat for t in cache)
    assert all([*t.sample.prompt, *t.sample.completion] in [[*p, *a] for p, a in chat] for t in cache)


def test_a_run_out_of_time_while_making_its_teacher_cache_keeps_the_caches_minutes(base, tmp_path):
    """The cache is part of the run's training time (its schedules count it): saved even when no step follows."""
    base.save(tmp_path / "base")
    train.main(["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
                "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--chat-prompts", "0",
                "--autocast", "none", "--teacher-cache", "3", "--time-limit-minutes", "1e-9"])
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    assert state["step"] == 0 and state["elapsed"] > 0


def test_convert_under_bf16_autocast_on_the_cpu_trains_evaluates_and_resumes(base, tmp_path):
    """Its frozen linears are then stored in bf16: every pass after that (the teacher cache, the loss, the
    held-out evaluation) runs under autocast, and the weights saved stay fp32."""
    base.save(tmp_path / "base")
    options = ["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "4",
               "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--eval-every", "1",
               "--chat-prompts", "0", "--autocast", "bf16", "--teacher-cache", "3"]
    train.main([*options, "--steps", "2"])
    train.main([*options, "--steps", "3"])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3] and all(math.isfinite(r["nll_t1"]) for r in log)
    adapters, meta = conversion.load_adapters(tmp_path / "run" / "adapters")
    assert meta["recipe"]["autocast"] == "bf16" and all(t.dtype == torch.float32 for t in adapters.values())


def test_a_resumed_optimizer_keeps_its_fused_kernel_and_takes_the_saved_moments():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    unfused = torch.optim.AdamW([weight], lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95))  # as saved before
    weight.grad = torch.randn(8, 4)
    unfused.step()
    resumed = conversion.optimizer([weight], lr=1e-3)
    conversion.resume_optimizer(resumed, copy.deepcopy(unfused.state_dict()))  # as read back from state.pt
    group = resumed.param_groups[0]
    assert group["fused"] and group["lr"] == 1e-2  # the kernel kept; the saved hyperparameters taken
    assert torch.equal(resumed.state[weight]["exp_avg"], unfused.state[weight]["exp_avg"])
    before = weight.detach().clone()
    unfused.step()
    expected = weight.detach().clone()
    weight.data.copy_(before)
    resumed.step()  # the fused kernel on the loaded moments: the same update as the unfused one's
    assert torch.allclose(weight, expected, atol=1e-6)


def test_a_replica_resumed_at_step_1000k_does_not_replay_another_replicas_data(tiny_tokenizer):
    """Replica r's data seed is seed + 1000 r: resumed at step 1000, replica 0's seed summed with the
    step was replica 1's fresh seed."""
    def first_windows(rank: int, step: int) -> list[list[int]]:
        stream = conversion.batch_stream(tiny_tokenizer, train.stream_key(train.replica_data_seed(13, rank), step),
                                         24, [], 0.0, rows=4)
        return [[*s.prompt, *s.completion] for s in next(stream)]

    assert first_windows(0, 1000) != first_windows(1, 0)
    assert train.stream_key(13, 0) == 13  # a fresh run's data as before
    assert first_windows(1, 0) == first_windows(1, 0)  # one key, one stream


def test_the_hidden_target_fades_over_this_runs_minutes_when_asked():
    options = argparse.Namespace(hidden_weight=0.5, hidden_fade_minutes=0.0)
    assert train.hidden_weight_at(options, 10**6) == 0.5
    options.hidden_fade_minutes = 10.0
    assert train.hidden_weight_at(options, 0) == 0.5
    assert train.hidden_weight_at(options, 150) == pytest.approx(0.375)
    assert train.hidden_weight_at(options, 600) == train.hidden_weight_at(options, 900) == 0.0


def test_the_convert_step_benchmark_times_each_part_with_the_teacher_live_or_cached(base, tmp_path, capsys):
    from benchmarks import convert_step
    base.save(tmp_path / "base")
    options = ["--baseline", str(tmp_path / "base"), "--lora-rank", "4", "--steps", "2", "--batch-size", "2",
               "--seq-tokens", "32"]
    convert_step.main(options)
    convert_step.main([*options, "--teacher-cache"])
    live, cached = capsys.readouterr().out.splitlines()
    assert "lora_rank 4, 1 thread(s)" in live and "tokens/s; teacher " in live and "teacher 0.0 ms" not in live
    assert all(f"{part} " in live for part in convert_step.PARTS)
    assert "teacher cached" in cached and "teacher 0.0 ms" in cached


def test_the_losses_parts_are_their_definitions_at_the_scored_positions(base, tiny_tokenizer):
    """kl_t1 and kl_t2: sum p_teacher * (log p_teacher - log p_student) over the positions each scores;
    conf: the confidence head's BCE against the student's own probability of the gold t2."""
    student = conversion.build_student(base.model, SPEC)
    with torch.no_grad():  # adapters away from zero: the student is not the teacher
        for module in student.modules():
            if isinstance(module, conversion.LoRALinear):
                module.lora_b.normal_(0, 0.05)
    batch = _batch(tiny_tokenizer, rows=3)
    _, parts = conversion.conversion_loss(student, base.model, batch, hidden_weight=0.0)
    with torch.no_grad():
        hidden, mtp_hidden, confidence = conversion.student_forward(student, batch)
        teacher_logits = baseline_forward(base.model, batch["real_tokens"])
    for name, index_key, student_hidden in (("kl_t1", "next_index", hidden), ("kl_t2", "draft_index", mtp_hidden)):
        valid = batch[index_key] >= 0
        p = conversion._at(teacher_logits, batch[index_key] - 1)[valid].log_softmax(-1)
        q = student.lm_head(student_hidden[valid]).log_softmax(-1)
        assert parts[name] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4), name
    draft_valid = batch["draft_index"] >= 0
    p_gold = q.exp().gather(-1, batch["draft_target"][draft_valid][:, None]).squeeze(-1)
    expected = torch.nn.functional.binary_cross_entropy(confidence[draft_valid], p_gold)
    assert parts["conf"] == pytest.approx(expected.item(), rel=1e-4)
    assert abs(parts["kl_t1"] - parts["kl_t2"]) > 0.01  # t1 and t2 apart: a swapped split would show


def test_a_training_batchs_rows_share_one_reject_ratio(tiny_tokenizer, monkeypatch):
    """So that they are about as long as each other (a row split at every token is twice as many pairs)."""
    drawn = []
    monkeypatch.setattr(conversion, "draw_reject_ratio", lambda rng: drawn.append(1.0) or 1.0)
    stream = conversion.text_samples(tiny_tokenizer, "train", 0, 24)
    batch = conversion.conversion_batch([next(stream) for _ in range(3)], tiny_tokenizer.pad_id, random.Random(0))
    assert drawn == [1.0]
    assert (batch["pairs"][:, 1:, 1] == tiny_tokenizer.pad_id).all()  # every answer pair (t, PAD), in every row
    assert len(set((batch["next_token"] != -100).sum(1).tolist())) == 1  # as many scored pairs in every row


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_rows_gives_torchs_kl_and_its_gradient_across_chunks(dtype, compiled):
    """Eager, rows taken a chunk at a time (here 131 of a 1000-token vocabulary, so three chunks and a short
    one), or compiled as one expression: each row's KL, the student's log-sum-exp and the gradient as torch's
    kl_div over whole rows; the logits themselves left as they were; zero rows; the same refusals."""
    kl_function = conversion.compile_kl_rows() if compiled else conversion.kl_rows
    torch.manual_seed(0)
    rows, vocab = 300, 1000
    assert conversion._rows_per_chunk(torch.empty(rows, vocab)) < rows
    teacher = (3 * torch.randn(rows, vocab)).to(dtype)
    student = (3 * torch.randn(rows, vocab)).to(dtype).requires_grad_(True)
    weights = torch.rand(rows)
    teacher_before, student_before = teacher.clone(), student.detach().clone()
    kl, lse = kl_function(teacher, student)
    (kl * weights).sum().backward()
    reference_student = student.detach().clone().requires_grad_(True)
    expected = torch.nn.functional.kl_div(reference_student.float().log_softmax(-1),
                                          teacher.float().log_softmax(-1), log_target=True, reduction="none").sum(-1)
    (expected * weights).sum().backward()
    assert kl.dtype == lse.dtype == torch.float32 and not lse.requires_grad
    assert torch.allclose(kl, expected, rtol=1e-4, atol=1e-4)
    assert torch.allclose(lse, torch.logsumexp(student.detach().float(), -1), rtol=1e-5)
    assert torch.allclose(student.grad.float(), reference_student.grad.float(),
                          atol=1e-6 if dtype == torch.float32 else 2e-3)
    assert student.grad.abs().max() > 1e-3  # the gradient is not vanishingly small, so the check above bites
    assert torch.equal(teacher, teacher_before) and torch.equal(student.detach(), student_before)
    empty = torch.zeros(0, vocab, dtype=dtype, requires_grad=True)
    kl, lse = kl_function(torch.zeros(0, vocab, dtype=dtype), empty)
    kl.sum().backward()
    assert kl.shape == lse.shape == (0,) and empty.grad.shape == (0, vocab)
    with pytest.raises(ValueError, match="teacher"):
        kl_function(teacher.clone().requires_grad_(True), student)
    with pytest.raises(ValueError, match="against the student's"):
        kl_function(teacher[:1], student)  # a shape the expression would broadcast


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_frozen_linears_stored_in_bf16_give_the_same_loss_and_gradients_under_autocast(base, tiny_tokenizer, lora_rank):
    """What autocast would cast them to at each use, stored once: the products are the same; the weights
    that train stay fp32."""
    spec = conversion.ConversionSpec(lora_rank=lora_rank, lora_alpha=8.0, frozen_layers=1)
    torch.manual_seed(0)
    student = conversion.build_student(base.model, spec)
    teacher = copy.deepcopy(base.model)
    batch = _batch(tiny_tokenizer, rows=3)

    def loss_and_grads(student, teacher):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = conversion.conversion_loss(student, teacher, batch)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in student.named_parameters() if p.requires_grad}

    expected_loss, expected_grads = loss_and_grads(copy.deepcopy(student), teacher)
    conversion.frozen_linears_in(torch.bfloat16, teacher, student)
    loss, grads = loss_and_grads(student, teacher)
    assert loss == expected_loss
    assert grads.keys() == expected_grads.keys() and all(torch.equal(grads[n], expected_grads[n]) for n in grads)
    frozen = [m.weight for m in [*student.modules(), *teacher.modules()]
              if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    assert frozen and all(w.dtype == torch.bfloat16 for w in frozen)
    assert all(p.dtype == torch.float32 for p in student.parameters() if p.requires_grad)


def test_the_compiled_blocks_and_kl_give_the_eager_loss_and_gradients(base, tiny_tokenizer):
    """torch.compile changes how the step runs, not what it computes: the same loss and gradients (fp32,
    up to the order of float sums; under bf16 autocast the same loss up to bf16's roundings), on batches of
    two lengths, and the parameters keep their names."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    student = conversion.build_student(base.model, conversion.ConversionSpec(lora_rank=0))
    with torch.no_grad():  # the compressor away from its start, so the student is not near the teacher
        for p in student.compressor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    teacher, compiled = copy.deepcopy(base.model), copy.deepcopy(student)
    conversion.compile_blocks(teacher, compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in student.named_parameters()]

    def loss_and_grads(student, teacher, batch, kl):
        student.zero_grad(set_to_none=True)
        loss, _ = conversion.conversion_loss(student, teacher, batch, kl=kl)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in student.named_parameters() if p.requires_grad}

    for tokens in (24, 40):
        batch = _batch(tiny_tokenizer, rows=3, tokens=tokens)
        expected_loss, expected = loss_and_grads(student, base.model, batch, conversion.kl_rows)
        loss, grads = loss_and_grads(compiled, teacher, batch, conversion.compile_kl_rows())
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert grads.keys() == expected.keys()
        for name in grads:
            assert torch.allclose(grads[name], expected[name], rtol=1e-3, atol=1e-6), name
    assert max(g.abs().max() for g in expected.values()) > 1e-3  # gradients that the comparison can tell apart
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, _ = loss_and_grads(student, base.model, batch, conversion.kl_rows)
        loss, _ = loss_and_grads(compiled, teacher, batch, conversion.compile_kl_rows())
    assert loss == pytest.approx(expected_loss, rel=1e-2)
    assert counters["stats"]["unique_graphs"] > 0  # compiled graphs ran, not eager code alone


def test_convert_compiled_trains_as_the_eager_run_and_resumes_without_compiling(base, tmp_path):
    base.save(tmp_path / "base")
    options = ["convert", "--baseline", str(tmp_path / "base"), "--lora-rank", "4", "--batch-size", "2",
               "--seq-tokens", "32", "--eval-rows", "2", "--eval-every", "1", "--chat-prompts", "0",
               "--autocast", "none"]
    train.main([*options, "--run", str(tmp_path / "eager"), "--steps", "2"])
    train.main([*options, "--run", str(tmp_path / "compiled"), "--steps", "2", "--compile"])
    train.main([*options, "--run", str(tmp_path / "compiled"), "--steps", "3"])
    eager, compiled = ([json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
                       for run in ("eager", "compiled"))
    assert [r["step"] for r in eager] == [0, 1, 2] and [r["step"] for r in compiled] == [0, 1, 2, 3]
    for before, after in zip(eager, compiled[:3]):  # the same batches, losses and held-out figures
        for key in ("loss", "kl_t1", "kl_t2", "nll_t1", "nll_t2") if before["step"] else ("nll_t1", "nll_t2"):
            assert after[key] == pytest.approx(before[key], rel=1e-4, abs=1e-4), (before["step"], key)
    _, meta = conversion.load_adapters(tmp_path / "compiled" / "adapters")
    assert meta["recipe"]["compile"] is False  # the last invocation's: resumed without compiling


def test_convert_compiles_each_block_whole_under_bf16_autocast(base, tmp_path):
    """Frozen linears in bf16 and autocast, its first pass the held-out evaluation under no_grad, then the
    compiled teacher making its cache: the blocks compile without a graph break (Tensor.unflatten once
    broke each in four)."""
    from torch._dynamo.utils import counters

    base.save(tmp_path / "base")
    torch._dynamo.reset()
    counters.clear()
    train.main(["convert", "--baseline", str(tmp_path / "base"), "--run", str(tmp_path / "run"), "--lora-rank", "0",
                "--batch-size", "2", "--seq-tokens", "32", "--eval-rows", "2", "--chat-prompts", "0",
                "--autocast", "bf16", "--teacher-cache", "3", "--steps", "2", "--compile"])
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 2] and all(math.isfinite(r["loss"]) for r in log[1:])
