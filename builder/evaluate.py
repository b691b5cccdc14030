"""Quality gate: the dual-end model against the baseline, threshold calibrated on one split and
reported on another.

    python -m builder.evaluate --report-examples 400 --calibration-examples 200

Splits are disjoint by construction (`dualend.train.data.split_of`). Per family and length bucket
(short: prompt under 128 tokens; long: over half the trained context):
  1. calibration split: baseline greedy, dual-end greedy at every threshold of the sweep; the
     shipped threshold is the one with the most tokens per step (EOS not counted) such that it
     and every higher threshold up to 1.0 keep the gate on every family and bucket;
  2. report split: the same at the chosen threshold and every one above it, plus pass@k sampled,
     with paired dual-end minus baseline differences and 95% bootstrap intervals;
  3. held-out text, teacher-forced: loss by position bucket up to the trained context (baseline;
     dual-end with every draft accepted, at the chosen threshold, drafting off), and the
     confidence head's reliability table.
Writes reports/quality.json and quality.md, and the serving settings builder.assemble ships (the
threshold, builder.serving_settings) beside the dual-end checkpoint.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from builder import serving_settings
from dualend.engine.checkpoint import WEIGHTS as CHECKPOINT_WEIGHTS
from dualend.engine.checkpoint import load_checkpoint
from dualend.train.data import FAMILIES, stdlib_chunks
from dualend.train.evaluation import (
    BUCKETS,
    Setting,
    bucket_set,
    evaluate_settings,
    loss_by_position,
    paired_difference,
    reliability,
    summary,
    teacher_forced_text,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(dualend=ROOT / "checkpoints" / "dualend", baseline=ROOT / "checkpoints" / "baseline",
                reports=ROOT / "reports", report_examples=400, calibration_examples=200,
                samples=4, temperature=0.7, gate=0.02, interval_floor=0.05, text_chunks=40, seed=0, threads=2)
THRESHOLDS = (-1.0, 0.3, 0.5, 0.7, 0.9, 1.0)
CELLS = [(f, b) for f in FAMILIES for b in BUCKETS]


def _cell(family: str, bucket: str) -> str:
    return f"{family}/{bucket}"


def gate_holds(difference: dict, gate: float, floor: float) -> bool:
    return difference["diff"] >= -gate and difference["low"] >= -floor


def choose_threshold(sweep: dict[float, dict], gate: float, floor: float) -> tuple[float, bool]:
    """Most tokens per step among thresholds t where t and every higher one keep the gate on every
    cell (so raising the threshold is always safe); if even 1.0 fails, 1.0, reported as not met."""
    def holds(t):
        return all(gate_holds(sweep[t]["cells"][c]["vs_baseline"], gate, floor) for c in sweep[t]["cells"])

    ordered = sorted(sweep)
    safe = []
    for t in reversed(ordered):
        if not holds(t):
            break
        safe.append(t)
    if not safe:
        return ordered[-1], False
    return max(safe, key=lambda t: (sweep[t]["tokens_per_step_no_eos"], t)), True


def sweep_rows(outcomes: dict[str, dict], baseline: dict[str, list], thresholds) -> dict[float, dict]:
    rows = {}
    for t in thresholds:
        every = [o for c in outcomes for o in outcomes[c][t]]
        rows[t] = {**summary(every), "cells": {
            c: {**summary(outcomes[c][t]), "vs_baseline": paired_difference(outcomes[c][t], baseline[c])}
            for c in outcomes}}
    return rows


def run_split(name, models, sets, thresholds, samples, temperature, seed, with_pass_k_at=None):
    """Greedy baseline (and pass@k), greedy dual-end sweep; outcomes per cell and setting."""
    total = sum(len(s) for s in sets.values())
    baseline, dualend = {}, {}
    base_settings = {"greedy": Setting(1.0)}
    if with_pass_k_at is not None:
        base_settings["sampled"] = Setting(1.0, samples, temperature)
    dual_settings = {t: Setting(t) for t in thresholds}
    if with_pass_k_at is not None:
        dual_settings["sampled"] = Setting(with_pass_k_at, samples, temperature)
    for label, model, settings, into in (("baseline", models["baseline"], base_settings, baseline),
                                         ("dualend", models["dualend"], dual_settings, dualend)):
        with tqdm(total=total, desc=f"{name} {label}") as bar:
            for cell, examples_ in sets.items():
                into[cell] = evaluate_settings(model, models["tokenizer"], examples_, settings, seed, progress=bar)
    return baseline, dualend


def markdown(report: dict) -> str:
    chosen = report["threshold"]
    lines = [
        "# Quality report\n",
        f"Dual-end `{report['dualend_checkpoint']}` vs baseline `{report['baseline_checkpoint']}`, "
        f"trained context {report['trained_context']} tokens. Report split: {report['examples_per_family']} "
        f"examples per family and length bucket (short: prompt < 128 tokens; long: > "
        f"{report['trained_context'] // 2}); calibration split: {report['calibration_examples']}. "
        f"pass@{report['samples']} sampled at temperature {report['temperature']}.\n",
        f"Threshold chosen on the calibration split: **{report['threshold']}**. Gate (every family and "
        f"bucket, every threshold from the chosen one to 1.0, report split): dual-end minus baseline pass@1 "
        f">= -{report['gate']} and its 95% interval's lower end >= -{report['interval_floor']}: "
        f"**{'met' if report['gate_met'] else 'NOT met'}**.\n",
        "| family | bucket | baseline pass@1 | dual-end pass@1 | difference [95% CI] | baseline pass@k | "
        "dual-end pass@k | difference pass@k [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for cell, row in report["buckets"].items():
        family, bucket = cell.split("/")
        d1, dk = row["diff_pass1"], row["diff_pass4"]
        lines.append(f"| {family} | {bucket} | {row['baseline_pass1']:.3f} | {row['dualend_pass1']:.3f} | "
                     f"{d1['diff']:+.3f} [{d1['low']:+.3f}, {d1['high']:+.3f}] | {row['baseline_pass4']:.3f} | "
                     f"{row['dualend_pass4']:.3f} | {dk['diff']:+.3f} [{dk['low']:+.3f}, {dk['high']:+.3f}] |")
    lines += [f"\nAt {chosen}: {report['tokens_per_step_no_eos']:.3f} tokens per decode step without EOS "
              f"({report['tokens_per_step']:.3f} counting EOS as a token), acceptance rate "
              f"{report['acceptance_rate']:.3f}.\n"]
    for title, sweep in (("Report split", report["sweep"]), ("Calibration split", report["calibration_sweep"])):
        lines += [f"## {title}: dual-end pass@1 (minus baseline) by threshold\n",
                  "| threshold | " + " | ".join(_cell(f, b) for f, b in CELLS) + " | tokens/step (no EOS) | acceptance |",
                  "|---|" + "---|" * (len(CELLS) + 2)]
        for threshold, row in sweep.items():
            cells = [f"{row['cells'][_cell(f, b)]['pass']:.3f} ({row['cells'][_cell(f, b)]['vs_baseline']['diff']:+.3f})"
                     for f, b in CELLS]
            lines.append(f"| {threshold} | " + " | ".join(cells)
                         + f" | {row['tokens_per_step_no_eos']:.3f} | {row['acceptance_rate']:.3f} |")
        lines.append("")
    text = report["loss_by_position"]
    lines += [f"## Held-out text, teacher-forced: loss (nats/token) by position ({text['chunks']} chunks)\n",
              "| positions | baseline | dual-end all (-1) | backbone tokens (-1) | draft tokens (-1) | "
              f"dual-end all ({chosen}) | drafting off (1.0) |", "|---|---|---|---|---|---|---|"]
    for base, every, at, off in zip(text["baseline"], text["accept_all"], text["chosen"], text["drafting_off"]):
        lines.append(f"| {base['positions']} | {base['all']:.3f} | {every['all']:.3f} | {every['backbone_tokens']:.3f} | "
                     f"{every['draft_tokens']:.3f} | {at['all']:.3f} | {off['all']:.3f} |")
    calibration = report["confidence_calibration"]
    lines += [f"\n## Confidence head on held-out text (every draft, -1): ECE {calibration['ece']:.3f} over "
              f"{calibration['drafts']} drafts\n", "| confidence | drafts | mean confidence | draft right |",
              "|---|---|---|---|"]
    lines += [f"| {r['bin']} | {r['count']} | {r['mean_confidence']:.3f} | {r['accuracy']:.3f} |"
              for r in calibration["table"]]
    return "\n".join(lines) + "\n"


def text_losses(models: dict, context: int, chunks: int, threshold: float, seed: int) -> tuple[dict, dict]:
    tokenizer = models["tokenizer"]
    stream = stdlib_chunks("report", chunk_chars=6 * context, seed=seed)
    texts = []
    while len(texts) < chunks:
        ids = tokenizer.encode(next(stream))
        if len(ids) >= context - 1:
            texts.append(ids[:context - 1])
    bos = tokenizer.bos_id
    runs = {"baseline": (models["baseline"], 1.0), "accept_all": (models["dualend"], -1.0),
            "chosen": (models["dualend"], threshold), "drafting_off": (models["dualend"], 1.0)}
    losses = {name: teacher_forced_text(model, bos, texts, t) for name, (model, t) in tqdm(runs.items(), desc="text")}
    tables = {name: loss_by_position(loss, context - 1) for name, loss in losses.items()}
    every_draft = losses["accept_all"]
    return {**tables, "chunks": chunks}, reliability(every_draft.confidence, every_draft.draft_right)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=str if isinstance(value, Path) else type(value),
                            default=value)
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    dualend, baseline = load_checkpoint(args.dualend), load_checkpoint(args.baseline)
    context = dualend.recipe["context"]
    if baseline.recipe.get("context") != context:
        raise SystemExit(f"baseline trained at context {baseline.recipe.get('context')}, dual-end at {context}")
    models = {"dualend": dualend.model.eval(), "baseline": baseline.model.eval(), "tokenizer": dualend.tokenizer}

    def sets(split, count):
        return {_cell(f, b): bucket_set(f, b, split, count, dualend.tokenizer, context, args.seed) for f, b in CELLS}

    thresholds = sorted(set(args.thresholds) | {1.0})
    calib_base, calib_dual = run_split("calibration", models, sets("calibration", args.calibration_examples),
                                       thresholds, args.samples, args.temperature, args.seed)
    calib_base = {c: o["greedy"] for c, o in calib_base.items()}
    calibration_sweep = sweep_rows(calib_dual, calib_base, thresholds)
    threshold, _ = choose_threshold(calibration_sweep, args.gate, args.interval_floor)
    tqdm.write(f"chosen on calibration: {threshold}")

    reported = [t for t in thresholds if t >= threshold]
    report_base, report_dual = run_split("report", models, sets("report", args.report_examples), reported,
                                         args.samples, args.temperature, args.seed, with_pass_k_at=threshold)
    base_greedy = {c: o["greedy"] for c, o in report_base.items()}
    sweep = sweep_rows(report_dual, base_greedy, reported)
    gate_met = all(gate_holds(row["cells"][c]["vs_baseline"], args.gate, args.interval_floor)
                   for row in sweep.values() for c in row["cells"])
    buckets = {c: {"baseline_pass1": summary(base_greedy[c])["pass"],
                   "dualend_pass1": summary(report_dual[c][threshold])["pass"],
                   "baseline_pass4": summary(report_base[c]["sampled"])["pass"],
                   "dualend_pass4": summary(report_dual[c]["sampled"])["pass"],
                   "diff_pass1": paired_difference(report_dual[c][threshold], base_greedy[c]),
                   "diff_pass4": paired_difference(report_dual[c]["sampled"], report_base[c]["sampled"])}
               for c in base_greedy}
    families = {f: {key: round(sum(buckets[_cell(f, b)][key] for b in BUCKETS) / len(BUCKETS), 4)
                    for key in ("dualend_pass1", "baseline_pass1", "dualend_pass4", "baseline_pass4")}
                for f in FAMILIES}
    loss_table, calibration = text_losses(models, context, args.text_chunks, threshold, args.seed)
    chosen = sweep[threshold]
    report = {
        "threshold": threshold, "gate": args.gate, "interval_floor": args.interval_floor, "gate_met": gate_met,
        "families": families, "buckets": buckets,
        "tokens_per_step": chosen["tokens_per_step_with_eos"], "tokens_per_step_no_eos": chosen["tokens_per_step_no_eos"],
        "acceptance_rate": chosen["acceptance_rate"],
        "sweep": {str(t): row for t, row in sweep.items()},
        "calibration_sweep": {str(t): row for t, row in calibration_sweep.items()},
        "loss_by_position": loss_table, "confidence_calibration": calibration,
        "trained_context": context, "examples_per_family": args.report_examples,
        "calibration_examples": args.calibration_examples, "samples": args.samples, "temperature": args.temperature,
        "dualend_checkpoint": dualend.id, "baseline_checkpoint": baseline.id,
        "dualend_recipe": dualend.recipe, "baseline_recipe": baseline.recipe,
        "minutes": round((time.time() - started) / 60, 2),
    }
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "quality.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (reports / "quality.md").write_text(markdown(report), encoding="utf-8")
    serving_settings.write(Path(args.dualend), CHECKPOINT_WEIGHTS, threshold, bool(gate_met),
                           [] if gate_met else [f"tokens per step within the gate at {threshold:g}"],
                           reports / "quality.md")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
