"""Soak test: many closed-loop streams for a long time, against a running server; prints errors by
kind, latency percentiles and the memory (RSS) of every server process over time.

    python -m benchmarks.soak --streams 64 --passes 2 --pass-s 300            # the production check
    python -m benchmarks.soak --url 127.0.0.1:18001 --streams 16 --passes 2 --pass-s 60
    python -m benchmarks.soak --deployments smollm2 --streams 64 --passes 2 --pass-s 300

Each pass runs `--streams` clients that send requests back to back (prompts of the three task
families, 16-128 new tokens, the deployments alternating) for `--pass-s` seconds. After each pass
it samples the RSS of tritonserver, its Python backend stubs (named by model) and nginx, so a
process whose memory grows from pass to pass shows up; it ends with each process's growth from
pass 1 to the last pass.
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import threading
import time

from client.api import RequestError, percentile, stream_grpc
from dualend.ops.processes import rss_mb, server_processes
from dualend.train.data import FAMILIES, eval_set

DEPLOYMENTS = ["dualend", "baseline"]


def one_pass(url: str, streams: int, seconds: float, api_key: str | None, seed: int,
             deployments: list[str]) -> dict:
    prompts = [e.prompt for family in FAMILIES for e in eval_set(family, 20, seed=seed, split="report")]
    stop, lock = threading.Event(), threading.Lock()
    errors, ttfts, gaps, tokens = collections.Counter(), [], [], [0]

    def client(index):
        rng = random.Random(seed * 1000 + index)
        while not stop.is_set():
            try:
                deployment = deployments[index % len(deployments)]
                result = stream_grpc(url, deployment, rng.choice(prompts), rng.randint(16, 128),
                                     api_key=api_key, ignore_eos=rng.random() < 0.5, timeout_s=120)
                with lock:
                    ttfts.append(result.ttft_s)
                    gaps.extend(result.inter_token_s)
                    tokens[0] += result.output_tokens
            except RequestError as error:
                with lock:
                    errors[str(error).split(":")[0][:80]] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(180)
    elapsed = time.monotonic() - started
    return {"requests": len(ttfts), "errors": dict(errors), "tokens_per_s": tokens[0] / elapsed,
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p99": percentile(ttfts, 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint (the gateway by default)")
    parser.add_argument("--api-key", default=None, help="default: $DUALEND_API_KEY")
    parser.add_argument("--deployments", nargs="+", default=DEPLOYMENTS)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--pass-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    try:  # a soak that every request fails (no key, wrong port) should say so at once, not after its passes
        stream_grpc(args.url, args.deployments[0], "Q: 1+1\nA:", 1, api_key=args.api_key)
    except RequestError as error:
        sys.exit(f"soak: the first request to {args.url} failed, nothing was run: {error}")
    history = []
    for number in range(1, args.passes + 1):
        figures = one_pass(args.url, args.streams, args.pass_s, args.api_key, seed=number,
                           deployments=args.deployments)
        memory = {name: rss_mb(pid) for name, pid in sorted(server_processes().items())}
        history.append(memory)
        print(f"pass {number}: {figures['requests']} requests, errors {figures['errors'] or 'none'}, "
              f"{figures['tokens_per_s']:.0f} tokens/s, TTFT p50/p99 {figures['ttft_p50'] * 1e3:.0f}/"
              f"{figures['ttft_p99'] * 1e3:.0f} ms, inter-token p50/p99 {figures['itl_p50'] * 1e3:.1f}/"
              f"{figures['itl_p99'] * 1e3:.1f} ms", flush=True)
        print("  RSS MB: " + ", ".join(f"{name} {mb:.0f}" for name, mb in memory.items()), flush=True)
    if len(history) > 1:
        print("RSS growth, pass 1 -> pass %d:" % len(history))
        for name, first in history[0].items():
            last = history[-1].get(name, float("nan"))
            print(f"  {name:32} {first:7.0f} -> {last:7.0f} MB ({(last / first - 1) * 100:+.1f}%)")
    return {"history": history}


if __name__ == "__main__":
    main()
