"""Served vs in-process, dual-end vs baseline: TTFT and TPOT at concurrency 1, interleaved;
a concurrency sweep; and what a long prompt arriving does to running streams.

    python -m benchmarks.bench_served --lengths 256 960 --repeats 5 --new-tokens 64
    python -m benchmarks.bench_served --sweep 1 4 16 32 --lengths 256 --repeats 2
    python -m benchmarks.bench_served --interference --repeats 3

Starts a real tritonserver on the assembled repository (or uses --grpc-url). The default mode,
for each repeat, prompt length and deployment, runs the same prompt over gRPC streaming and
through the in-process ONNX Runtime engine, back to back; it prints medians with the 10th-90th
percentile spread, served/engine overhead ratios, served dual-end/baseline speedups and, from
Triton's statistics, where the served time goes. `--sweep` runs closed-loop clients (each sends its
next request when the last ends) at each concurrency, deployments alternating, and prints output
tokens/s, TTFT and token-weighted inter-token latency (p50, p99), errors, and where the time went.
`--interference` runs 8 decoding streams alone and then with 960-token prompts arriving back to back,
and prints their p99 inter-token latency in both.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from benchmarks.bench_engine import long_prompt, timed_generation
from builder.assemble import DEFAULTS as ASSEMBLE
from builder import serving_settings
from builder.assemble import SERVING_SETTINGS
from builder.assemble import main as assemble_main
from client.api import RequestError, median_and_spread, percentile, stream_grpc
from dualend.engine.decode import SamplingParams
from dualend.engine.onnx_engine import OnnxComponents
from dualend.ops.launch import TritonServer
from dualend.ops.processes import cpu_snapshot, cpu_used, server_processes, server_tree

DEPLOYMENTS = ("dualend", "baseline")
CPU_ROLES = ("tritonserver", "preprocessing", "compressor", "backbone", "mtp_verify", "postprocessing", "other",
             "client")


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


def closed_loop(url: str, model: str, prompt: str, new_tokens: int, clients: int, requests_per_client: int,
                **params) -> dict:
    """`clients` threads, each sending its next request as soon as its last one ends; `params` go
    with every request."""
    results, errors = [], []

    def client():
        for _ in range(requests_per_client):
            try:
                results.append(stream_grpc(url, model, prompt, new_tokens, ignore_eos=True,
                                           exclude_input_in_output=True, **params))
            except RequestError as error:
                errors.append(str(error))

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    elapsed = time.perf_counter() - started
    gaps = [g for r in results for g in r.inter_token_s]
    ttfts = [r.ttft_s for r in results]
    return {"tokens_per_s": sum(r.output_tokens for r in results) / elapsed,
            "output_tokens": sum(r.output_tokens for r in results),
            "requests_per_s": len(results) / elapsed, "errors": len(errors), "error_sample": errors[:1],
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p99": percentile(ttfts, 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


def sweep(url: str, prompt: str, levels: list[int], new_tokens: int, repeats: int,
          dualend_threshold: float | None = None, server_pid: int | None = None) -> dict:
    """`dualend_threshold`: the acceptance_threshold every dual-end request asks for (None: the
    deployment's own). CPU time is read from the tritonserver `server_pid` and its stubs, or, without
    it, from every tritonserver on this machine."""
    runs = {}
    dualend_params = {} if dualend_threshold is None else {"acceptance_threshold": dualend_threshold}
    processes = server_tree(server_pid) if server_pid else server_processes()
    for _, clients, name in tqdm(list(itertools.product(range(repeats), levels, DEPLOYMENTS)), desc="sweep"):
        before, client_before = cpu_snapshot(processes), time.process_time()
        run = closed_loop(url, name, prompt, new_tokens, clients, requests_per_client=max(2, 32 // clients),
                          **(dualend_params if name == "dualend" else {}))
        used = cpu_used(before, cpu_snapshot(processes)) | {"client": time.process_time() - client_before}
        run["cpu_ms_per_1k_tokens"] = cpu_by_role(name, used, run["output_tokens"])
        runs.setdefault((name, clients), []).append(run)
    asked = "the deployment's" if dualend_threshold is None else dualend_threshold
    print(f"\nClosed-loop clients, {new_tokens} new tokens (ignore_eos), median over {repeats} repeats; "
          f"ms for latencies; dual-end acceptance_threshold: {asked}")
    print(f"{'clients':>7} | {'model':8} | {'tokens/s':>8} | {'req/s':>6} | {'TTFT p50':>8} | {'TTFT p99':>8} | "
          f"{'ITL p50':>7} | {'ITL p99':>7} | errors")
    table = {}
    for clients in levels:
        for name in DEPLOYMENTS:
            rows = runs[(name, clients)]
            row = {k: med([r[k] for r in rows]) for k in rows[0] if k not in ("error_sample", "cpu_ms_per_1k_tokens")}
            row["cpu_ms_per_1k_tokens"] = {role: med([r["cpu_ms_per_1k_tokens"][role] for r in rows])
                                           for role in rows[0]["cpu_ms_per_1k_tokens"]}
            row["errors"] = sum(r["errors"] for r in rows)
            table[f"{name}@c{clients}"] = row
            print(f"{clients:>7} | {name:8} | {row['tokens_per_s']:8.1f} | {row['requests_per_s']:6.2f} | "
                  f"{row['ttft_p50'] * 1e3:8.1f} | {row['ttft_p99'] * 1e3:8.1f} | {row['itl_p50'] * 1e3:7.2f} | "
                  f"{row['itl_p99'] * 1e3:7.2f} | {row['errors']}"
                  + (f" ({rows[0]['error_sample'][0]})" if rows[0]["error_sample"] else ""))
        dual, base = table[f"dualend@c{clients}"], table[f"baseline@c{clients}"]
        print(f"{clients:>7} | dual-end/baseline tokens/s x{dual['tokens_per_s'] / base['tokens_per_s']:.2f}")
    for name in DEPLOYMENTS:
        if 1 in levels:
            top = max(levels)
            print(f"{name}: tokens/s at c{top} / c1 = "
                  f"x{table[f'{name}@c{top}']['tokens_per_s'] / table[f'{name}@c1']['tokens_per_s']:.2f}")
    if processes:
        print_cpu_table(table, levels)
    return table


def cpu_by_role(deployment: str, used: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU ms per 1000 output tokens, by role: tritonserver, each of `deployment`'s pipeline steps
    (any version), every other process of the server, this load-generating client, and in all."""
    roles = dict.fromkeys(CPU_ROLES, 0.0)
    for process, seconds in used.items():
        step = re.fullmatch(rf"{deployment}_v\d+_(\w+)", process)
        if step and step.group(1) in roles:
            roles[step.group(1)] += seconds
        elif process in ("tritonserver", "client"):
            roles[process] += seconds
        else:
            roles["other"] += seconds
    roles["total"] = sum(roles.values())
    return {role: 1e6 * seconds / max(tokens, 1) for role, seconds in roles.items()}


def print_cpu_table(table: dict, levels: list[int]) -> None:
    roles = [*CPU_ROLES, "total"]
    print("\nCPU time per 1000 output tokens, ms, by process (median over repeats; 'other': the idle "
          "deployment's steps and anything else of the server):")
    print(f"{'clients':>7} | {'model':8} | " + " | ".join(f"{role:>14}" for role in roles))
    for clients in levels:
        for name in DEPLOYMENTS:
            cpu = table[f"{name}@c{clients}"]["cpu_ms_per_1k_tokens"]
            print(f"{clients:>7} | {name:8} | " + " | ".join(f"{cpu[role]:14.0f}" for role in roles))


def interference(url: str, model: str, short_prompt: str, long_prompt: str, repeats: int,
                 streams: int = 8, new_tokens: int = 160) -> dict:
    """p99 inter-token latency of `streams` decoding streams, alone and with long prompts arriving."""
    alone, disturbed, arrivals = [], [], []
    for _ in tqdm(range(repeats), desc=f"interference {model}"):
        for gaps, disturb in ((alone, False), (disturbed, True)):
            stop = threading.Event()

            def newcomers():
                while not stop.is_set():
                    arrivals.append(stream_grpc(url, model, long_prompt, 16, ignore_eos=True).ttft_s)

            with ThreadPoolExecutor(streams + 1) as pool:
                jobs = [pool.submit(stream_grpc, url, model, short_prompt, new_tokens, ignore_eos=True)
                        for _ in range(streams)]
                if disturb:
                    time.sleep(0.3)
                    pool.submit(newcomers)
                for job in jobs:
                    gaps += job.result().inter_token_s
                stop.set()
    result = {"p99_alone": percentile(alone, 0.99), "p99_with_long_prompts": percentile(disturbed, 0.99),
              "p50_alone": percentile(alone, 0.5), "p50_with_long_prompts": percentile(disturbed, 0.5),
              "long_prompts": len(arrivals), "long_prompt_ttft_p50": percentile(arrivals, 0.5)}
    print(f"\n{model}: {streams} streams decoding {new_tokens} tokens; inter-token latency ms alone vs with "
          f"{len(long_prompt)}-character prompts arriving back to back ({result['long_prompts']} arrived, their TTFT "
          f"p50 {result['long_prompt_ttft_p50'] * 1e3:.0f} ms):")
    print(f"  p50 {result['p50_alone'] * 1e3:.2f} -> {result['p50_with_long_prompts'] * 1e3:.2f}; "
          f"p99 {result['p99_alone'] * 1e3:.2f} -> {result['p99_with_long_prompts'] * 1e3:.2f} "
          f"(x{result['p99_with_long_prompts'] / result['p99_alone']:.2f})")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 960])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--grpc-url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--http-url", default=None, help="its HTTP endpoint, for the time breakdown")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sweep", type=int, nargs="+", default=None, metavar="CLIENTS",
                        help="concurrency sweep at the first of --lengths instead of the concurrency-1 comparison")
    parser.add_argument("--dualend-threshold", type=float, default=None,
                        help="with --sweep: acceptance_threshold sent with every dual-end request "
                             "(default: the deployment's calibrated one)")
    parser.add_argument("--interference", action="store_true",
                        help="8 streams of 256-token prompts, alone and with 960-token prompts arriving")
    args = parser.parse_args(argv)
    repository = Path(ASSEMBLE["out"])
    if not repository.exists():
        assemble_main(["--deployments", *DEPLOYMENTS])
    threshold = serving_settings.threshold(*SERVING_SETTINGS["dualend"])
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
        http_url = args.http_url or (None if args.grpc_url else triton.http_url)
        if args.sweep:
            result = sweep(url, prompts[args.lengths[0]], args.sweep, args.new_tokens, args.repeats,
                           args.dualend_threshold, None if args.grpc_url else triton.pid)
            if http_url:
                print_time_breakdown(http_url)
            return result
        if args.interference:
            long = tokenizer.decode(long_prompt(tokenizer, 960))
            return {name: interference(url, name, prompts[args.lengths[0]], long, args.repeats) for name in DEPLOYMENTS}
        runs = list(itertools.product(range(args.repeats), args.lengths, DEPLOYMENTS))
        for _, length, name in tqdm(runs, desc="interleaved runs"):
            served = stream_grpc(url, name, prompts[length], args.new_tokens, ignore_eos=True,
                                 exclude_input_in_output=True)
            figures[(name, length, "served")]["ttft"].append(served.ttft_s)
            figures[(name, length, "served")]["tpot"].append(served.tpot_s)
            engine = timed_generation(engines[name], tokenizer.encode_prompt(prompts[length]), params, thresholds[name])
            figures[(name, length, "engine")]["ttft"].append(engine["ttft"])
            figures[(name, length, "engine")]["tpot"].append(engine["tpot"])
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
