"""Closed-loop load: N concurrent clients send held-out task prompts until M requests are done.

    python -m benchmarks.load --model dualend --concurrency 8 --requests 64

Prints throughput (requests/s, output tokens/s), TTFT and TPOT median and p90, tokens per step,
and every error by message. Bounded in count; talks only to the server it is given.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from client.api import RequestError, median_and_spread, stream_grpc, stream_http
from dualend.train.data import FAMILIES, eval_set

DEFAULTS = dict(url="127.0.0.1:8001", model="dualend", concurrency=8, requests=64, max_tokens=64)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    args = parser.parse_args(argv)
    prompts = itertools.cycle([e.prompt for f in FAMILIES for e in eval_set(f, 20, seed=3)])
    lock = threading.Lock()
    results, errors = [], collections.Counter()
    send = stream_grpc if args.protocol == "grpc" else stream_http

    def one(_):
        with lock:
            prompt = next(prompts)
        try:
            result = send(args.url, args.model, prompt, args.max_tokens, exclude_input_in_output=True)
            with lock:
                results.append(result)
        except RequestError as error:
            with lock:
                errors[str(error)[:160]] += 1

    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, range(args.requests)))
    elapsed = time.perf_counter() - started
    tokens = sum(r.output_tokens for r in results)
    ttft, tpot = median_and_spread([r.ttft_s for r in results]), median_and_spread([r.tpot_s for r in results])
    steps = sum(r.counters["num_steps"] for r in results)
    summary = {"requests_per_s": len(results) / elapsed, "tokens_per_s": tokens / elapsed,
               "ttft_ms": ttft[0] * 1e3, "ttft_p90_ms": ttft[2] * 1e3, "tpot_ms": tpot[0] * 1e3,
               "tpot_p90_ms": tpot[2] * 1e3, "tokens_per_step": tokens / max(1, steps), "errors": dict(errors)}
    print(f"{args.model}: {len(results)} ok, {sum(errors.values())} failed in {elapsed:.1f} s at concurrency "
          f"{args.concurrency}: {summary['requests_per_s']:.2f} req/s, {summary['tokens_per_s']:.1f} tok/s; "
          f"TTFT {summary['ttft_ms']:.1f} ms (p90 {summary['ttft_p90_ms']:.1f}); TPOT {summary['tpot_ms']:.2f} ms "
          f"(p90 {summary['tpot_p90_ms']:.2f}); {summary['tokens_per_step']:.2f} tokens/step")
    for message, count in errors.items():
        print(f"  {count} x {message}")
    return summary


if __name__ == "__main__":
    main()
