"""Conversion recipes side by side: the held-out curves of `builder.train convert` runs.

    python -m benchmarks.conversion_recipes /work/runs/recipes/lora_hidden1 /work/runs/recipes/lora_kl \\
        --out reports/conversion_recipes

Each run folder's `log.jsonl` (one record per save) gives, against tokens trained and against CPU
minutes: the NLL gap of t1 and t2 to the teacher on the held-out text (student NLL - teacher NLL, the
same rows for every run started from the same base and --eval-rows), top-1 agreement with the teacher,
the t1 gap on held-out open-ended requests (where the log has it), and the run's tokens/s. Writes report.md
(the last record of each run and its recipe) and curves.png. Runs resumed from a copy of one run folder
(an A/B from a common state) share its earlier records: `--from-step N` keeps each run's records from step N
on, minutes counted from there.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# shown where a run set them
OPTIONAL_KEYS = ("hidden_fade_minutes", "decay_minutes", "teacher_cache", "compile", "open_prompts", "short_prompts",
                 "student_answers")
FIGURES = (("gap_t1", "t1 NLL gap (nats)"), ("gap_t2", "t2 NLL gap (nats)"), ("agree_t1", "t1 top-1 = teacher"),
           ("open_gap_t1", "open requests: t1 NLL gap"))


def curve(run: Path, from_step: int = 0) -> list[dict]:
    """The run's records from `from_step` on with the gaps computed: gap_t1, gap_t2 (student - teacher
    held-out NLL), and open_gap_t1 on held-out open-ended requests where a record has it; minutes counted
    from the first record kept."""
    records = [json.loads(line) for line in (run / "log.jsonl").read_text(encoding="utf-8").splitlines() if line]
    records = [r for r in records if r["step"] >= from_step]
    if not records:
        raise SystemExit(f"{run}: log.jsonl holds no record" + (f" from step {from_step}" if from_step else ""))
    start = records[0]["minutes"]
    return [record | {"minutes": round(record["minutes"] - start, 2),
                      "gap_t1": record["nll_t1"] - record["teacher_nll_t1"],
                      "gap_t2": record["nll_t2"] - record["teacher_nll_t2"]}
            | ({"open_gap_t1": record["open_nll_t1"] - record["open_teacher_nll_t1"]}
               if "open_nll_t1" in record else {})
            for record in records]


def recipe(run: Path) -> dict:
    meta = json.loads((run / "adapters" / "adapters.json").read_text(encoding="utf-8"))
    return {"lora_rank": meta["spec"]["lora_rank"],
            **{k: meta["recipe"].get(k) for k in ("lr", "hidden_weight", "autocast", "batch_size", "seq_tokens")},
            "compressor_init": meta["spec"].get("compressor_init", "mean"),
            **({"mtp_layer_full": True} if meta["spec"].get("mtp_layer_full") else {}),
            **{k: meta["recipe"][k] for k in OPTIONAL_KEYS if meta["recipe"].get(k)}}


def table(curves: dict[str, list[dict]], recipes: dict[str, dict]) -> str:
    lines = ["| run | recipe | steps | tokens | CPU min | tokens/s | t1 gap | t2 gap | t1 agree | t2 agree "
             "| open t1 gap |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, records in curves.items():
        last, speeds = records[-1], [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
        speed = f"{sorted(speeds)[len(speeds) // 2]:.0f}" if speeds else "-"
        shown = ", ".join(f"{k} {v}" for k, v in recipes[name].items())
        first_open = next((r for r in records if "open_gap_t1" in r), None)  # a run resumed across the change
        open_gap = (f"{last['open_gap_t1']:.3f} (from {first_open['open_gap_t1']:.3f})"
                    if "open_gap_t1" in last and first_open else "-")
        lines.append(f"| {name} | {shown} | {last['step']} | {last['tokens']} | {last['minutes']:.1f} | {speed} | "
                     f"{last['gap_t1']:.3f} (from {records[0]['gap_t1']:.3f}) | {last['gap_t2']:.3f} "
                     f"(from {records[0]['gap_t2']:.3f}) | {last['agree_t1']:.3f} | {last['agree_t2']:.3f} | "
                     f"{open_gap} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(FIGURES), 2, figsize=(11, 3.2 * len(FIGURES)), squeeze=False)
    for row, (key, label) in enumerate(FIGURES):
        for column, (x, x_label) in enumerate((("tokens", "tokens trained"), ("minutes", "CPU minutes"))):
            axis = axes[row][column]
            for name, records in curves.items():
                shown = [r for r in records if key in r]
                axis.plot([r[x] for r in shown], [r[key] for r in shown], marker=".", label=name)
            axis.set_xlabel(x_label)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders of builder.train convert")
    parser.add_argument("--out", type=Path, default=Path("reports/conversion_recipes"))
    parser.add_argument("--from-step", type=int, default=0,
                        help="each run's records from this step on (runs resumed from a common state)")
    args = parser.parse_args(argv)
    curves = {run.name: curve(run, args.from_step) for run in args.runs}
    recipes = {run.name: recipe(run) for run in args.runs}
    args.out.mkdir(parents=True, exist_ok=True)
    plot(curves, args.out / "curves.png")
    text = table(curves, recipes)
    (args.out / "report.md").write_text(f"# Conversion recipes\n\n{text}\n\n![curves](curves.png)\n", encoding="utf-8")
    (args.out / "curves.json").write_text(json.dumps(curves, indent=1) + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
