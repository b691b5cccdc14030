"""Quality gate of a converted model (builder.train convert): the dual-end model against the
token-level model it was converted from, threshold calibrated on one split and reported on another.

    python -m builder.evaluate_conversion                      # smollm2_dualend against smollm2
    python -m builder.evaluate_conversion --dualend build/checkpoints/smollm2_dualend \\
        --baseline build/checkpoints/smollm2 --name smollm2_dualend

Held-out material: chat prompts (the project's task questions under the checkpoint's chat
template) and standard-library text, from the data's `calibration` and `report` splits (disjoint
from training's), and open-ended requests (`open_prompts`' held-out topics, alternate ones to each
split). On each split, each at every threshold of the sweep:
  - chat answers, open answers and text continuations, greedy: tokens per step (EOS not counted), draft
    acceptance, and how much of the baseline's own greedy answer the dual-end answer reproduces
    (common prefix / baseline length: 1.0 = the same answer);
  - text, teacher-forced as the decode loop would read it (evaluation.teacher_forced_text): NLL per
    token and by position, against the baseline's;
  - on the report split, the baseline's greedy answers to the open requests, teacher-forced: the
    dual-end's NLL gap and top-token agreement there (greedy answers part within a few tokens, so
    this, not their agreement, tells models apart on what users ask while they are far apart).
The shipped threshold (calibration split) is the one with the most tokens per step such that it and
every higher threshold keep the answers' agreement with the baseline within --gate of drafting off
(threshold 1.0) and the chat answers' agreement at --agreement-floor or more (drafting off when none
does). The report split gives the figures at that threshold, the top-token agreement with the
baseline (teacher-forced, every position), and the targets: NLL within 0.10 nats/token, >= 1.6 tokens
per step on chat answers, the same top token at >= 90% of positions, and the task check: short
factual and arithmetic chat questions of its own (builder/data/chat_questions.json, never trained
on), the converted model right on all but at most TASK_MARGIN of those the baseline answers right.
A model that misses a target is built only when named; the report says `passed: false`.
Writes reports/quality_NAME.json and .md, and the serving settings builder.assemble ships (the
threshold and the verdict, builder.serving_settings) beside the adapters `--dualend` was merged from
(`--adapters`, checked by their sha256).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
import torch

from builder import serving_settings
from dualend.engine.checkpoint import Checkpoint, load_checkpoint
from dualend.engine.decode import Generation, SamplingParams
from dualend.engine.reference import TorchBatch, generate_batch
from dualend.train import conversion
from dualend.train.evaluation import loss_by_position, reliability, teacher_forced_text, tokens_per_step
from dualend.train.open_prompts import open_prompts

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(dualend=ROOT / "build" / "checkpoints" / "smollm2_dualend",
                baseline=ROOT / "build" / "checkpoints" / "smollm2", name="smollm2_dualend",
                adapters=ROOT / "checkpoints" / "smollm2_dualend",
                reports=ROOT / "reports", chat_prompts=16, open_prompts=16, text_prompts=16, prompt_tokens=96,
                answer_tokens=96, text_rows=64, text_tokens=256, gate=0.02, agreement_floor=0.5, task_tokens=48,
                questions=ROOT / "builder" / "data" / "chat_questions.json", threads=2)
THRESHOLDS = (-1.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
TARGETS = {"nll_gap": 0.10, "chat_tokens_per_step": 1.6, "top_token_agreement": 0.90}
TASK_MARGIN = 2  # the task check: right answers the converted model may miss among the baseline's


def prefix_agreement(answer: list[int], reference: list[int]) -> float:
    """The share of `reference` that `answer` reproduces before they first differ."""
    if not reference:
        return 1.0 if not answer else 0.0
    same = next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference)))
    return same / len(reference)


def ended(generation: Generation, eos_id: int) -> list[int]:
    """A generation's tokens with EOS at the end when it stopped there: stopping is part of the answer,
    so one that goes on where the reference stopped differs from it at that point."""
    return generation.tokens + [eos_id] * (generation.finish_reason == "eos")


def generation_figures(generations: list[Generation], references: list[Generation], eos_id: int) -> dict:
    tokens = sum(len([t for t in g.tokens if t != eos_id]) for g in generations)
    return {"tokens_per_step_no_eos": round(tokens / max(1, sum(g.steps for g in generations)), 4),
            "acceptance_rate": round(sum(g.accepted for g in generations) / max(1, sum(g.drafts for g in generations)), 4),
            "agreement": round(float(np.mean([prefix_agreement(ended(g, eos_id), ended(r, eos_id))
                                               for g, r in zip(generations, references)])), 4)}


def open_requests(split: str, args) -> list[str]:
    """The split's held-out open-ended requests: they alternate between the splits (calibration the even
    ones); none with --open-prompts 0."""
    return open_prompts("held_out")[int(split == "report")::2][:args.open_prompts]


def prompts(checkpoint: Checkpoint, split: str, args) -> dict[str, list[list[int]]]:
    """Task questions and open-ended requests under the template, and text windows' first `prompt_tokens`
    tokens."""
    tokenizer = checkpoint.tokenizer
    chat, open_ = ([tokenizer.encode_prompt(tokenizer.user_turn(p)) for p in questions]
                   for questions in (conversion.chat_prompts(split, args.chat_prompts, seed=0),
                                     open_requests(split, args)))
    text = conversion.text_samples(tokenizer, split, 0, args.prompt_tokens)
    return {"chat": chat, **({"open": open_} if open_ else {}),
            "text": [[*s.prompt, *s.completion] for _, s in zip(range(args.text_prompts), text)]}


def sweep(dualend: Checkpoint, baseline: Checkpoint, split: str, args) -> dict:
    """Per prompt kind, the baseline's greedy answers and the dual-end's at every threshold."""
    figures = {}
    for kind, encoded in prompts(baseline, split, args).items():
        params = [SamplingParams(max_tokens=args.answer_tokens, ignore_eos=kind == "text")] * len(encoded)
        references = generate_batch(TorchBatch(baseline.model, encoded, args.answer_tokens), params, threshold=1.0)
        batch = TorchBatch(dualend.model, encoded, args.answer_tokens)
        figures[kind] = {str(t): generation_figures(generate_batch(batch, params, t), references, dualend.config.eos_id)
                         for t in THRESHOLDS}
    return figures


def calibrate(figures: dict, gate: float, agreement_floor: float = 0.0) -> float:
    """The threshold with the most chat tokens per step whose agreement, and that of every higher
    threshold, stays within `gate` of drafting off on every prompt kind and, on chat answers, at
    `agreement_floor` or above; 1.0 (drafting off) when no threshold does."""
    floor = {kind: table["1.0"]["agreement"] - gate for kind, table in figures.items()}
    floor["chat"] = max(floor["chat"], agreement_floor)
    kept = []
    for threshold in sorted(THRESHOLDS, reverse=True):
        if any(figures[kind][str(threshold)]["agreement"] < floor[kind] for kind in figures):
            break
        kept.append(threshold)
    return max(kept, key=lambda t: figures["chat"][str(t)]["tokens_per_step_no_eos"]) if kept else 1.0


def answered_right(answer: str, accepted: list[str]) -> bool:
    """Whether `answer` holds one of the accepted strings as whole words (case-insensitive)."""
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", answer, re.IGNORECASE) for a in accepted)


def task_questions(path: str | Path = DEFAULTS["questions"]) -> list[tuple[str, list[str]]]:
    """The task check's (question, accepted answers)."""
    return [(q, accepted) for q, accepted in json.loads(Path(path).read_text(encoding="utf-8"))["questions"]]


def task_check(dualend: Checkpoint, baseline: Checkpoint, threshold: float, args) -> dict:
    """The questions under the chat template, greedy: the baseline drafting off, the converted model
    at `threshold`; which each answers right, and how many of the baseline's right ones it keeps."""
    questions = task_questions(args.questions)
    tokenizer = baseline.tokenizer
    encoded = [tokenizer.encode_prompt(tokenizer.user_turn(q)) for q, _ in questions]
    params = [SamplingParams(max_tokens=args.task_tokens)] * len(encoded)
    base = generate_batch(TorchBatch(baseline.model, encoded, args.task_tokens), params, threshold=1.0)
    dual = generate_batch(TorchBatch(dualend.model, encoded, args.task_tokens), params, threshold)
    answers = []
    for (question, accepted), b, d in zip(questions, base, dual):
        base_text, dual_text = tokenizer.decode(b.tokens), tokenizer.decode(d.tokens)
        answers.append({"question": question, "baseline": base_text, "dualend": dual_text,
                        "baseline_right": answered_right(base_text, accepted),
                        "dualend_right": answered_right(dual_text, accepted),
                        "baseline_stopped": b.finish_reason == "eos", "dualend_stopped": d.finish_reason == "eos"})
    return {"questions": len(answers), "baseline_right": sum(a["baseline_right"] for a in answers),
            "dualend_right": sum(a["dualend_right"] for a in answers),
            "dualend_right_of_baselines": sum(a["baseline_right"] and a["dualend_right"] for a in answers),
            "baseline_stopped": sum(a["baseline_stopped"] for a in answers),
            "dualend_stopped_of_baselines": sum(a["baseline_stopped"] and a["dualend_stopped"] for a in answers),
            "answers": answers}


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of `values` (None for fewer than two)."""
    return round(float(np.std(values, ddof=1) / np.sqrt(len(values))), 4) if len(values) > 1 else None


def text_figures(dualend: Checkpoint, baseline: Checkpoint, threshold: float, args) -> dict:
    samples = conversion.text_samples(baseline.tokenizer, "report", 1, args.text_tokens)
    chunks = [[*s.prompt, *s.completion] for _, s in zip(range(args.text_rows), samples)]
    bos = baseline.tokenizer.bos_id
    base_loss = teacher_forced_text(baseline.model, bos, chunks, 1.0)
    dual_loss = teacher_forced_text(dualend.model, bos, chunks, threshold)
    held = conversion.held_out(baseline.model, [s for _, s in zip(range(args.text_rows), conversion.text_samples(
        baseline.tokenizer, "report", 2, args.text_tokens))], baseline.config.pad_id)
    agreement = conversion.evaluate(dualend.model, held)
    row_gaps = dual_loss.nll.mean(1) - base_loss.nll.mean(1)
    return {"nll_baseline": round(float(base_loss.nll.mean()), 4), "nll_dualend": round(float(dual_loss.nll.mean()), 4),
            "nll_gap_by_row": [round(float(g), 4) for g in row_gaps],
            "tokens_per_step": round(tokens_per_step(dual_loss), 4),
            "by_position": {"baseline": loss_by_position(base_loss, args.text_tokens),
                            "dualend": loss_by_position(dual_loss, args.text_tokens)},
            "reliability": reliability(dual_loss.confidence, dual_loss.draft_right),
            "top_token_agreement": {k: agreement[k] for k in ("agree_t1", "agree_t2")},
            "teacher_forced_pairs": agreement}


def open_figures(dualend: Checkpoint, baseline: Checkpoint, args) -> dict | None:
    """The baseline's greedy answers to the report split's open requests, teacher-forced through the
    dual-end model: its NLL gap to the baseline and top-token agreement, t1 and t2 (None without requests)."""
    requests = open_requests("report", args)
    if not requests:
        return None
    answers = conversion.teacher_chat_samples(baseline.model, baseline.tokenizer, requests, args.answer_tokens)
    figures = conversion.evaluate(dualend.model, conversion.held_out(baseline.model, answers, baseline.config.pad_id))
    return {"requests": len(answers),
            **{f"nll_gap_{t}": round(figures[f"nll_{t}"] - figures[f"teacher_nll_{t}"], 4) for t in ("t1", "t2")},
            **{f"agree_{t}": figures[f"agree_{t}"] for t in ("t1", "t2")}}


def verdict(report: dict) -> dict:
    text, chat, task = report["text"], report["report"]["chat"][str(report["threshold"])], report["task"]
    agree = text["top_token_agreement"]
    targets = TARGETS | {"task_answers": task["baseline_right"] - TASK_MARGIN}
    measured = {"nll_gap": round(text["nll_dualend"] - text["nll_baseline"], 4),
                "chat_tokens_per_step": chat["tokens_per_step_no_eos"],
                "top_token_agreement": round((agree["agree_t1"] + agree["agree_t2"]) / 2, 4),
                "task_answers": task["dualend_right_of_baselines"]}
    met = {key: measured[key] <= wanted if key == "nll_gap" else measured[key] >= wanted
           for key, wanted in targets.items()}
    return {"measured": measured, "targets": targets, "met": met, "passed": all(met.values())}


def markdown(report: dict) -> str:
    lines = [f"# Quality: {report['name']} against {report['baseline']['checkpoint_id']} (its base)", "",
             f"Checkpoint {report['dualend']['checkpoint_id']}; threshold {report['threshold']:g} "
             f"(calibrated on the calibration split, gate {report['gate']}); "
             f"{'PASSED' if report['verdict']['passed'] else 'NOT PASSED'}.", "",
             "| target | measured | wanted | met |", "|---|---|---|---|"]
    verdict_ = report["verdict"]
    for key, wanted in verdict_["targets"].items():
        sign = "<=" if key == "nll_gap" else ">="
        lines.append(f"| {key} | {verdict_['measured'][key]} | {sign} {wanted} | {verdict_['met'][key]} |")
    for split in ("calibration", "report"):
        lines += ["", f"## {split} split: greedy answers by threshold", "",
                  "| kind | threshold | tokens/step (no EOS) | acceptance | agreement with baseline |", "|---|---|---|---|---|"]
        for kind, table in report[split].items():
            lines += [f"| {kind} | {t} | {row['tokens_per_step_no_eos']} | {row['acceptance_rate']} | {row['agreement']} |"
                      for t, row in table.items()]
    task = report["task"]
    lines += ["", f"## Task check: {task['questions']} short chat questions (builder/data/chat_questions.json)", "",
              f"The baseline answers {task['baseline_right']} right; the converted model {task['dualend_right']}, "
              f"{task['dualend_right_of_baselines']} of the baseline's (wanted: all but {TASK_MARGIN}). "
              f"The baseline's answer ends (EOS) within {report['settings']['task_tokens']} tokens on "
              f"{task['baseline_stopped']} questions, the converted model's on {task['dualend_stopped_of_baselines']} "
              "of those.", "",
              "| question | baseline | converted |", "|---|---|---|"]
    lines += [f"| {a['question']} | {'right' if a['baseline_right'] else 'wrong'}: {_cell(a['baseline'])} | "
              f"{'right' if a['dualend_right'] else 'wrong'}: {_cell(a['dualend'])} |" for a in task["answers"]]
    text = report["text"]
    lines += ["", "## report split: text, teacher-forced", "",
              f"NLL per token over {report['settings']['text_rows']} rows: baseline {text['nll_baseline']}, dual-end "
              f"{text['nll_dualend']} at the threshold ({text['tokens_per_step']} tokens per step; the gap's standard "
              f"error over rows {standard_error(text['nll_gap_by_row'])}); top token as the baseline's: t1 "
              f"{text['top_token_agreement']['agree_t1']}, t2 {text['top_token_agreement']['agree_t2']}; "
              f"confidence ECE {text['reliability']['ece']}.", "", "| positions | baseline | dual-end |", "|---|---|---|"]
    lines += [f"| {b['positions']} | {b['all']} | {d['all']} |"
              for b, d in zip(text["by_position"]["baseline"], text["by_position"]["dualend"])]
    if report.get("open"):
        found = report["open"]
        lines += ["", "## report split: open requests, teacher-forced", "",
                  f"The baseline's greedy answers to {found['requests']} held-out open-ended requests: the dual-end's "
                  f"NLL gap t1 {found['nll_gap_t1']}, t2 {found['nll_gap_t2']} nats/token; top token as the "
                  f"baseline's: t1 {found['agree_t1']}, t2 {found['agree_t2']}."]
    return "\n".join(lines) + "\n"


def _cell(text: str, width: int = 60) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=str if isinstance(value, Path) else type(value),
                            default=value)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)  # before the minutes of work whose report it holds
    dualend, baseline = load_checkpoint(args.dualend), load_checkpoint(args.baseline)
    if dualend.recipe.get("converted_from") != baseline.id:
        raise SystemExit(f"{args.dualend} was converted from {dualend.recipe.get('converted_from')}, "
                         f"not from {args.baseline} ({baseline.id})")
    report = {"name": args.name, "dualend": {"checkpoint_id": dualend.id, "adapters": dualend.recipe.get("adapters")},
              "baseline": {"checkpoint_id": baseline.id}, "gate": args.gate, "thresholds": list(THRESHOLDS),
              "settings": {k: v for k, v in vars(args).items() if k not in ("dualend", "baseline", "reports", "questions", "adapters")}}
    report["calibration"] = sweep(dualend, baseline, "calibration", args)
    report["threshold"] = calibrate(report["calibration"], args.gate, args.agreement_floor)
    report["report"] = sweep(dualend, baseline, "report", args)
    report["text"] = text_figures(dualend, baseline, report["threshold"], args)
    report["task"] = task_check(dualend, baseline, report["threshold"], args)
    report["open"] = open_figures(dualend, baseline, args)
    report["verdict"] = verdict(report)
    report["minutes"] = round((time.time() - started) / 60, 1)
    (reports / f"quality_{args.name}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (reports / f"quality_{args.name}.md").write_text(markdown(report), encoding="utf-8")
    adapters = Path(args.adapters)
    if (dualend.recipe.get("adapters") or {}).get("sha256") == conversion.adapters_sha256(adapters):
        found = report["verdict"]
        missed = [f"{k} {found['measured'][k]} (target {found['targets'][k]})" for k, met in found["met"].items()
                  if not met]
        serving_settings.write(adapters, conversion.ADAPTERS, report["threshold"], found["passed"], missed,
                               reports / f"quality_{args.name}.md")
    else:
        print(f"{args.dualend} was not merged from {adapters}: its serving settings are left as they are")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
