"""Turn perf_analyzer profile exports into TTFT, inter-token latency and throughput.

    python -m benchmarks.perf_report build/perf/<run>/*.json [--json summary.json]

perf_analyzer's console summary times only a decoupled model's first response; its
`--profile-export-file` keeps every response's timestamp and outputs, which this reads:
  TTFT                first response minus send
  inter-token latency the gap since the last response that carried tokens, divided over the
                      tokens this one carries (`num_output_tokens`; a dual-end response may carry
                      two), one value per token (`api.token_gaps`, as the Python clients count it)
  output tokens/s     tokens of responses inside the measurement windows / their duration
  requests/s          requests completed inside the windows / their duration
with p50, p90 and p99 over requests (TTFT, latency) or tokens (inter-token).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from client.api import token_gaps

PERCENTILES = (50, 90, 99)


def _percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in PERCENTILES}
    return {f"p{p}": round(float(np.percentile(values, p)) * scale, 3) for p in PERCENTILES}


def experiment_figures(experiment: dict) -> dict:
    """Figures of one perf_analyzer experiment (one concurrency); times in ms."""
    windows = experiment["window_boundaries"]
    start, end = windows[0], windows[-1]
    ttft, inter_token, latency = [], [], []
    tokens_in_window, completed = 0, 0
    for request in experiment["requests"]:
        sent, stamps = request["timestamp"], request["response_timestamps"]
        counts = [int(out.get("num_output_tokens", 1)) for out in request["response_outputs"]]
        if not stamps:
            continue
        ttft.append((stamps[0] - sent) / 1e9)
        latency.append((stamps[-1] - sent) / 1e9)
        inter_token += token_gaps([(stamp / 1e9, count) for stamp, count in zip(stamps, counts)])
        tokens_in_window += sum(c for s, c in zip(stamps, counts) if start <= s <= end)
        completed += start <= stamps[-1] <= end
    seconds = (end - start) / 1e9
    return {"concurrency": experiment["experiment"]["value"], "requests": len(experiment["requests"]),
            "ttft_ms": _percentiles(ttft), "inter_token_ms": _percentiles(inter_token),
            "latency_ms": _percentiles(latency),
            "output_tokens_per_s": round(tokens_in_window / seconds, 2) if seconds else float("nan"),
            "requests_per_s": round(completed / seconds, 3) if seconds else float("nan")}


def read_export(path: Path) -> list[dict]:
    return [experiment_figures(e) for e in json.loads(path.read_text(encoding="utf-8"))["experiments"]]


def table(rows: list[dict]) -> str:
    lines = ["| run | concurrency | TTFT p50/p90/p99 ms | inter-token p50/p90/p99 ms | output tok/s | req/s |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        t, i = row["ttft_ms"], row["inter_token_ms"]
        lines.append(f"| {row['run']} | {row['concurrency']} | {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} | "
                     f"{i['p50']:.2f} / {i['p90']:.2f} / {i['p99']:.2f} | {row['output_tokens_per_s']:.1f} | "
                     f"{row['requests_per_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exports", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows = [{"run": path.stem, **figures} for path in args.exports for figures in read_export(path)]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
