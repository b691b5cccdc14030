"""Evaluate the dual-end model against the baseline on the held-out split and calibrate the gate.

    python -m builder.evaluate --examples 100

Per family: pass@1 (greedy) and pass@k (k sampled answers) for the baseline and for the dual-end
model; the dual-end model is swept over acceptance thresholds (pass@1, tokens per decode step,
acceptance rate). The chosen threshold is the one with the most tokens per step whose pass@1
stays within `--gate` of the baseline on every family. Writes builder/reports/quality.json and
quality.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from dualend.checkpoint import load_checkpoint
from dualend.data import FAMILIES, eval_set
from dualend.evaluation import FamilyResult, run_examples
from dualend.onnx_engine import OnnxComponents
from dualend.reference import TorchComponents

from .assemble import up_to_date_export

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(dualend=ROOT / "checkpoints" / "dualend", baseline=ROOT / "checkpoints" / "baseline",
                reports=ROOT / "builder" / "reports", export_dir=ROOT / "build" / "eval_export", examples=100,
                samples=4, temperature=0.7, gate=0.02, seed=0, engine="onnxruntime")
THRESHOLDS = (-1.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99, 1.0)


def _family_stats(results: dict[str, FamilyResult]) -> dict:
    tokens = sum(r.tokens for r in results.values())
    steps = sum(r.steps for r in results.values())
    drafts = sum(r.drafts for r in results.values())
    accepted = sum(r.accepted for r in results.values())
    return {"pass1": {f: round(r.accuracy, 4) for f, r in results.items()},
            "tokens_per_step": round(tokens / max(1, steps), 4),
            "acceptance_rate": round(accepted / max(1, drafts), 4)}


def choose_threshold(sweep: dict[float, dict], baseline_pass1: dict[str, float], gate: float) -> tuple[float, bool]:
    """Most tokens per step within the gate on every family; else the smallest worst-case gap."""
    def worst_gap(threshold):
        return max(baseline_pass1[f] - sweep[threshold]["pass1"][f] for f in baseline_pass1)
    passing = [t for t in sweep if worst_gap(t) <= gate]
    if passing:
        return max(passing, key=lambda t: (sweep[t]["tokens_per_step"], -t)), True
    return min(sweep, key=lambda t: (worst_gap(t), -sweep[t]["tokens_per_step"])), False


def markdown(report: dict) -> str:
    lines = ["# Quality report\n", f"Held-out examples per family: {report['examples_per_family']}; "
             f"pass@{report['samples']} sampled at temperature {report['temperature']}. "
             f"Dual-end checkpoint `{report['dualend_checkpoint']}`, baseline `{report['baseline_checkpoint']}`.\n",
             f"Chosen acceptance_threshold: **{report['threshold']}** (quality gate "
             f"{'met' if report['gate_met'] else 'NOT met'}: dual-end pass@1 >= baseline pass@1 - {report['gate']}).\n",
             "| family | baseline pass@1 | dual-end pass@1 | baseline pass@k | dual-end pass@k |",
             "|---|---|---|---|---|"]
    for family, row in report["families"].items():
        lines.append(f"| {family} | {row['baseline_pass1']:.3f} | {row['dualend_pass1']:.3f} | "
                     f"{row['baseline_pass4']:.3f} | {row['dualend_pass4']:.3f} |")
    lines += [f"\nAt the chosen threshold: {report['tokens_per_step']:.3f} tokens per decode step, "
              f"acceptance rate {report['acceptance_rate']:.3f}.\n", "## Threshold sweep (pass@1, greedy)\n",
              "| threshold | " + " | ".join(FAMILIES) + " | tokens/step | acceptance |",
              "|---|" + "---|" * (len(FAMILIES) + 2)]
    for threshold, row in report["sweep"].items():
        lines.append(f"| {threshold} | " + " | ".join(f"{row['pass1'][f]:.3f}" for f in FAMILIES)
                     + f" | {row['tokens_per_step']:.3f} | {row['acceptance_rate']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=str if isinstance(value, Path) else type(value),
                            default=value, choices=("onnxruntime", "torch") if key == "engine" else None)
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    args = parser.parse_args(argv)
    started = time.time()
    dualend, baseline = load_checkpoint(args.dualend), load_checkpoint(args.baseline)
    tokenizer = dualend.tokenizer
    sets = {f: eval_set(f, args.examples, seed=args.seed) for f in FAMILIES}
    if args.engine == "torch":
        base_components, dual_components = TorchComponents(baseline.model), TorchComponents(dualend.model)
    else:  # same tokens as torch (tests/test_export.py), several times faster per step
        base_components, dual_components = (
            OnnxComponents(up_to_date_export(Path(path), Path(args.export_dir) / name).directory)
            for name, path in (("baseline", args.baseline), ("dualend", args.dualend)))

    def run(components, threshold, samples=1, temperature=0.0):
        return {f: run_examples(components, tokenizer, sets[f], threshold, samples, temperature, args.seed)
                for f in FAMILIES}

    progress = tqdm(total=len(args.thresholds) + 4, desc="evaluate")
    base1 = _family_stats(run(base_components, 1.0))["pass1"]
    progress.update()
    base_k = _family_stats(run(base_components, 1.0, args.samples, args.temperature))["pass1"]
    progress.update()
    sweep = {}
    for threshold in args.thresholds:
        sweep[threshold] = _family_stats(run(dual_components, threshold))
        progress.update()
        progress.write(f"threshold {threshold}: {json.dumps(sweep[threshold])}")
    threshold, gate_met = choose_threshold(sweep, base1, args.gate)
    dual_k = _family_stats(run(dual_components, threshold, args.samples, args.temperature))["pass1"]
    progress.update(2)
    progress.close()
    chosen = sweep[threshold]
    report = {
        "threshold": threshold, "gate": args.gate, "gate_met": gate_met,
        "families": {f: {"dualend_pass1": chosen["pass1"][f], "baseline_pass1": base1[f],
                         "dualend_pass4": dual_k[f], "baseline_pass4": base_k[f]} for f in FAMILIES},
        "tokens_per_step": chosen["tokens_per_step"], "acceptance_rate": chosen["acceptance_rate"],
        "sweep": {str(t): row for t, row in sweep.items()},
        "examples_per_family": args.examples, "samples": args.samples, "temperature": args.temperature,
        "dualend_checkpoint": dualend.id, "baseline_checkpoint": baseline.id,
        "dualend_recipe": dualend.recipe, "baseline_recipe": baseline.recipe,
        "minutes": round((time.time() - started) / 60, 2),
    }
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "quality.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (reports / "quality.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
