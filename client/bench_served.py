"""Served vs in-process, dual-end vs baseline: TTFT and TPOT at concurrency 1, interleaved.

    python -m client.bench_served --lengths 256 960 --repeats 5 --new-tokens 64

Starts a real tritonserver on the assembled repository (or uses --grpc-url), then for each
repeat, prompt length and deployment runs the same prompt over gRPC streaming and through the
in-process ONNX Runtime engine, back to back. Prints medians with the 10th-90th percentile
spread, served/engine overhead ratios and served dual-end/baseline speedups, and, from Triton's
statistics, where the served time goes (queue and compute per execution of each model).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
from pathlib import Path

from tqdm import tqdm

from builder.assemble import DEFAULTS as ASSEMBLE, calibrated_threshold, main as assemble_main
from builder.bench_engine import long_prompt, timed_generation
from dualend.decode import SamplingParams
from dualend.launch import TritonServer
from dualend.onnx_engine import OnnxComponents

from .api import median_and_spread, stream_grpc

DEPLOYMENTS = ("dualend", "baseline")


def med(values):
    return median_and_spread(values)[0]


def print_time_breakdown(http_url: str) -> None:
    """Mean queue and compute time per execution of every model, from Triton's statistics."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    print("\nWhere the served time goes (Triton statistics since start; ms per execution):")
    print(f"{'model':26} | {'executions':>10} | {'queue':>7} | {'compute':>7}")
    for stats in client.get_inference_statistics()["model_stats"]:
        executions = int(stats.get("execution_count", 0))
        if not executions:
            continue
        s = stats["inference_stats"]
        queue = int(s["queue"]["ns"]) / executions / 1e6
        compute = sum(int(s[k]["ns"]) for k in ("compute_input", "compute_infer", "compute_output")) / executions / 1e6
        print(f"{stats['name']:26} | {executions:>10} | {queue:7.3f} | {compute:7.3f}")
    client.close()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 960])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--grpc-url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--http-url", default=None, help="its HTTP endpoint, for the time breakdown")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    repository = Path(ASSEMBLE["out"])
    if not repository.exists():
        assemble_main([])
    threshold = calibrated_threshold(Path(ASSEMBLE["quality_report"]))
    engines = {name: OnnxComponents(Path(ASSEMBLE["export_dir"]) / name, threads=args.threads)
               for name in DEPLOYMENTS}
    tokenizer = engines["dualend"].exported.tokenizer()
    prompts = {n: tokenizer.decode(long_prompt(tokenizer, n)) for n in args.lengths}
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    thresholds = {"dualend": threshold, "baseline": 1.0}
    figures = {key: {"ttft": [], "tpot": []} for key in itertools.product(DEPLOYMENTS, args.lengths, ("served", "engine"))}
    server = contextlib.nullcontext() if args.grpc_url else TritonServer(repository)
    with server as triton:
        url = args.grpc_url or triton.grpc_url
        for name, length in itertools.product(DEPLOYMENTS, args.lengths):  # warm-up
            stream_grpc(url, name, prompts[length], 4, ignore_eos=True)
        runs = list(itertools.product(range(args.repeats), args.lengths, DEPLOYMENTS))
        for _, length, name in tqdm(runs, desc="interleaved runs"):
            served = stream_grpc(url, name, prompts[length], args.new_tokens, ignore_eos=True,
                                 exclude_input_in_output=True)
            figures[(name, length, "served")]["ttft"].append(served.ttft_s)
            figures[(name, length, "served")]["tpot"].append(served.tpot_s)
            engine = timed_generation(engines[name], tokenizer.encode_prompt(prompts[length]), params, thresholds[name])
            figures[(name, length, "engine")]["ttft"].append(engine["ttft"])
            figures[(name, length, "engine")]["tpot"].append(engine["tpot"])
        http_url = args.http_url or (None if args.grpc_url else triton.http_url)
        if http_url:
            print_time_breakdown(http_url)

    def fmt(values):
        m, lo, hi = median_and_spread(values)
        return f"{m * 1e3:7.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f})"

    print(f"\nConcurrency 1, {args.new_tokens} new tokens, threshold {threshold}, {args.repeats} interleaved repeats; "
          "ms, median (p10-p90)")
    print(f"{'prompt':>6} | {'model':8} | {'path':6} | {'TTFT':>22} | {'TPOT':>20}")
    summary = {}
    for length in args.lengths:
        for name in DEPLOYMENTS:
            for path in ("served", "engine"):
                f = figures[(name, length, path)]
                print(f"{length:>6} | {name:8} | {path:6} | {fmt(f['ttft'])} | {fmt(f['tpot'])}")
            served, engine = figures[(name, length, "served")], figures[(name, length, "engine")]
            overhead = med(served["tpot"]) / med(engine["tpot"])
            summary[f"{name}@{length}_served_over_engine_tpot"] = overhead
            print(f"{length:>6} | {name:8} | served/engine TPOT x{overhead:.2f}, TTFT x{med(served['ttft']) / med(engine['ttft']):.2f}")
        dual, base = figures[("dualend", length, "served")], figures[("baseline", length, "served")]
        summary[f"served_speedup@{length}"] = {"ttft": med(base["ttft"]) / med(dual["ttft"]),
                                               "tpot": med(base["tpot"]) / med(dual["tpot"])}
        print(f"{length:>6} | served dual-end speedup over baseline: TTFT x{summary[f'served_speedup@{length}']['ttft']:.2f}, "
              f"TPOT x{summary[f'served_speedup@{length}']['tpot']:.2f}")
    return summary


if __name__ == "__main__":
    main()
