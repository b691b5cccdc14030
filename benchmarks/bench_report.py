"""Benchmark report with pictures: perf_analyzer sweeps of both deployments plus the quality report.

    python -m benchmarks.bench_report                          # against tritonserver on 127.0.0.1:18001 (behind the gateway)
    python -m benchmarks.bench_report --sweep build/perf/run1  # re-plot sweeps already run

Runs `perf_analyzer_configs/run.sh` (dual-end and baseline back to back at every concurrency) for
the concurrency sweep on one workload and for TTFT at each fixed prompt length at concurrency 1,
then writes into --out a markdown report with the figures and PNG plots:
  ttft_vs_prompt.png        TTFT p50 by prompt length, concurrency 1
  latency_vs_concurrency.png inter-token latency p50 and p99 by concurrency
  throughput_vs_concurrency.png output tokens/s by concurrency
  quality_vs_threshold.png  dual-end pass@1 by acceptance threshold (calibration split), baseline lines
  tokens_per_step.png       tokens per step (without EOS) by threshold
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.perf_report import read_export, table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(url="127.0.0.1:18001", out=ROOT / "reports" / "bench", workload="fixed_256",
                concurrency="1 4 16 32", lengths="256 512 896", quality=ROOT / "reports" / "quality.json")
DEPLOYMENTS = ("dualend", "baseline")
COLORS = {"dualend": "tab:blue", "baseline": "tab:orange"}


def run_sweep(url: str, workload: str, concurrency: str, out: Path) -> Path:
    env = {**os.environ, "URL": url, "WORKLOAD": workload, "CONCURRENCY": concurrency, "OUT": str(out)}
    subprocess.run(["bash", str(ROOT / "perf_analyzer_configs" / "run.sh")], check=True, env=env)
    return out


def figures(folder: Path) -> dict[str, list[dict]]:
    """Per deployment, its rows sorted by concurrency."""
    rows: dict[str, list[dict]] = {name: [] for name in DEPLOYMENTS}
    for path in sorted(folder.glob("*_c*.json")):
        name = path.stem.rsplit("_c", 1)[0]
        rows.setdefault(name, []).extend({"run": path.stem, **row} for row in read_export(path))
    return {name: sorted(r, key=lambda row: row["concurrency"]) for name, r in rows.items() if r}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_concurrency(sweep: dict[str, list[dict]], out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in sweep.items():
        x = [r["concurrency"] for r in rows]
        ax.plot(x, [r["inter_token_ms"]["p50"] for r in rows], "o-", color=COLORS.get(name), label=f"{name} p50")
        ax.plot(x, [r["inter_token_ms"]["p99"] for r in rows], "x--", color=COLORS.get(name), label=f"{name} p99")
    ax.set(xscale="log", yscale="log", xlabel="concurrency (streams)", ylabel="inter-token latency (ms)",
           title="Inter-token latency vs concurrency")
    ax.legend()
    latency = _save(fig, out / "latency_vs_concurrency.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in sweep.items():
        ax.plot([r["concurrency"] for r in rows], [r["output_tokens_per_s"] for r in rows], "o-",
                color=COLORS.get(name), label=name)
    ax.set(xscale="log", xlabel="concurrency (streams)", ylabel="output tokens/s", title="Throughput vs concurrency")
    ax.legend()
    return [latency, _save(fig, out / "throughput_vs_concurrency.png")]


def plot_ttft(by_length: dict[int, dict[str, list[dict]]], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = sorted(by_length)
    for name in DEPLOYMENTS:
        ax.plot(lengths, [by_length[n][name][0]["ttft_ms"]["p50"] for n in lengths], "o-", color=COLORS[name],
                label=name)
    ax.set(xlabel="prompt tokens", ylabel="TTFT p50 (ms)", title="Time to first token, concurrency 1")
    ax.legend()
    return _save(fig, out / "ttft_vs_prompt.png")


def plot_quality(quality: dict, out: Path) -> list[Path]:
    """From the calibration split's sweep, the one that covers every threshold (the report split's
    starts at the chosen one)."""
    sweep = {float(t): row for t, row in quality["calibration_sweep"].items()}
    thresholds = sorted(sweep)
    fig, ax = plt.subplots(figsize=(7, 4))
    for index, cell in enumerate(sweep[thresholds[0]]["cells"]):
        rows = [sweep[t]["cells"][cell] for t in thresholds]
        ax.plot(thresholds, [r["pass"] for r in rows], "o-", color=f"C{index}", label=cell)
        ax.plot(thresholds, [r["pass"] - r["vs_baseline"]["diff"] for r in rows], ":", color=f"C{index}")
    ax.set(xlabel="acceptance threshold", ylabel="pass@1 (dotted: baseline)",
           title=f"Dual-end accuracy vs threshold (calibration split; chosen {quality['threshold']})")
    ax.legend(fontsize=7)
    accuracy = _save(fig, out / "quality_vs_threshold.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(thresholds, [sweep[t]["tokens_per_step_no_eos"] for t in thresholds], "o-")
    ax.set(xlabel="acceptance threshold", ylabel="tokens per decode step (no EOS)",
           title="Tokens per step vs threshold (calibration split)")
    return [accuracy, _save(fig, out / "tokens_per_step.png")]


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=str if isinstance(value, Path) else type(value), default=value)
    parser.add_argument("--sweep", type=Path, help="folder of an earlier concurrency sweep (no new run)")
    parser.add_argument("--ttft", type=Path, nargs="*", default=[], help="folders of earlier fixed-length runs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = ROOT / "build" / "perf" / time.strftime("%Y%m%d-%H%M%S")  # raw exports: large, not committed
    sweep_dir = args.sweep or run_sweep(args.url, args.workload, args.concurrency, runs / "sweep")
    ttft_dirs = args.ttft or [run_sweep(args.url, f"fixed_{n}", "1", runs / f"ttft_{n}") for n in args.lengths.split()]
    sweep = figures(sweep_dir)
    by_length = {int(d.name.rsplit("_", 1)[-1]): figures(d) for d in ttft_dirs}
    quality = json.loads(Path(args.quality).read_text(encoding="utf-8"))
    plots = [*plot_concurrency(sweep, out), plot_ttft(by_length, out), *plot_quality(quality, out)]
    rows = [row for name in sweep for row in sweep[name]]
    ttft_rows = [row for n in sorted(by_length) for name in DEPLOYMENTS for row in by_length[n][name]]
    lines = ["# Benchmark report\n",
             f"perf_analyzer 2.51.0 over gRPC streaming, `{args.workload}` workload (held-out text, "
             f"ignore_eos), dual-end and baseline back to back at each concurrency; figures from the profile "
             f"exports (`benchmarks/perf_report.py`).\n", "## Concurrency sweep\n", table(rows),
             "\n## Fixed prompt lengths, concurrency 1\n", table(ttft_rows),
             f"\n## Quality (from `{Path(args.quality).name}`, threshold {quality['threshold']})\n"]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    report = out / "README.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "figures.json").write_text(json.dumps({"sweep": sweep, "ttft": {str(n): f for n, f in by_length.items()}},
                                                 indent=1) + "\n", encoding="utf-8")
    print(f"{report} and {len(plots)} plots")
    return report


if __name__ == "__main__":
    main()
