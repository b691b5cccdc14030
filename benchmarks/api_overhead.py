"""What the OpenAI-compatible front costs: the same chat turns over /v1/chat/completions and over
Triton's gRPC stream, against one running server, interleaved.

    python -m benchmarks.api_overhead --model smollm2 --requests 60 --concurrency 16 --pass-s 30
    python -m benchmarks.api_overhead --model dualend     # no chat template: /v1/completions
    python -m benchmarks.api_overhead --direct-grpc 127.0.0.1:18001   # the front on Triton's gRPC route

With `--direct-grpc` (tritonserver's own gRPC endpoint, behind the gateway) the comparison is instead
gRPC through the gateway and the service in front against gRPC straight to tritonserver: what the front
costs Triton's route.

Both paths go through the gateway, as clients reach it (`--openai` base URL, `--grpc` host:port; the
key from --api-key or $DUALEND_API_KEY). Over gRPC the prompt is the chat turn rendered by the
deployment's chat template, as the service renders it, so both paths serve the same tokens; both ask
for `--max-tokens` tokens with EOS ignored. A deployment without a chat template (the shipped pair) is
sent the question as a prompt to /v1/completions.

- TTFT (to the first text) at concurrency 1: `--requests` pairs, the two paths alternating and the order flipped every
  pair; medians, 10th-90th percentiles and the median of the paired differences (/v1 less gRPC).
- Output tokens/s at `--concurrency`: that many closed-loop clients for `--pass-s` seconds on one
  path, then the other, then back (ABBA); the ratio /v1 over gRPC of each half and of the whole.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import threading
import time
from pathlib import Path

from benchmarks.soak import stream_openai
from client.api import RequestError, Result, median_and_spread, stream_grpc
from dualend.ops.openai_api.app import load_deployment
from dualend.train.data import FAMILIES, eval_set

DEFAULTS = dict(openai="http://127.0.0.1:8000/v1", grpc="127.0.0.1:8001", model="smollm2",
                model_repository=Path("build/model_repository"), requests=60, concurrency=16, pass_s=30.0,
                max_tokens=32)


class Paths:
    """One chat turn sent either way; each call returns the client-side Result."""

    def __init__(self, args):
        deployment = load_deployment(args.model_repository, args.model)
        if deployment is None:
            raise SystemExit(f"{args.model}: not in {args.model_repository}")
        self.args, self.chat = args, deployment.tokenizer is not None
        self.route = "/v1/chat/completions" if self.chat else "/v1/completions"
        self.render = deployment.render_chat

    def openai(self, question: str) -> tuple[Result, float]:
        """The request's Result and its time to the first text (its arrivals are the chunks with text)."""
        result = stream_openai(self.args.openai, self.args.model, question, self.args.max_tokens, self.args.api_key,
                               chat=self.chat, ignore_eos=True)
        return result, result.ttft_s

    def grpc(self, question: str, url: str | None = None) -> tuple[Result, float]:
        """As over /v1, the time to the first response with text (a response's tokens can be held back
        a step, e.g. an incomplete UTF-8 character)."""
        prompt = self.render([{"role": "user", "content": question}]) if self.chat else question
        first_text = []

        def on_text(_):
            if not first_text:
                first_text.append(time.perf_counter())
        result = stream_grpc(url or self.args.grpc, self.args.model, prompt, self.args.max_tokens,
                             api_key=self.args.api_key, exclude_input_in_output=True, ignore_eos=True, on_text=on_text)
        return result, first_text[0] - result.sent_at if first_text else float("nan")

    def direct(self, question: str) -> tuple[Result, float]:
        """gRPC straight to tritonserver (`--direct-grpc`), past the gateway and the front."""
        return self.grpc(question, self.args.direct_grpc)


def ttft_pairs(paths: Paths, questions, pairs: int, names: tuple[str, str]) -> dict[str, list[float]]:
    ttft = {name: [] for name in names}
    for index in range(pairs):
        question = next(questions)
        for name in (names if index % 2 else names[::-1]):
            ttft[name].append(getattr(paths, name)(question)[1])
    return ttft


def throughput(send, questions, clients: int, seconds: float) -> tuple[float, int]:
    """Output tokens/s of `clients` closed-loop clients for `seconds`; and the failed requests."""
    lock, stop = threading.Lock(), threading.Event()
    tokens, failed = [0], [0]

    def client():
        while not stop.is_set():
            with lock:
                question = next(questions)
            try:
                result, _ = send(question)
            except RequestError:
                with lock:
                    failed[0] += 1
                continue
            if not stop.is_set():
                with lock:
                    tokens[0] += result.output_tokens
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    elapsed = time.perf_counter() - started  # requests running at the end are not counted
    for thread in threads:
        thread.join()
    return tokens[0] / elapsed, failed[0]


def ms(values: list[float]) -> str:
    median, low, high = median_and_spread(values)
    return f"{median * 1e3:7.1f} ms ({low * 1e3:.1f}-{high * 1e3:.1f})"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--api-key", default=os.environ.get("DUALEND_API_KEY"))
    parser.add_argument("--direct-grpc", help="tritonserver's own gRPC host:port: compare the gateway's gRPC route "
                                              "with it instead of /v1 with the gateway's gRPC route")
    args = parser.parse_args(argv)
    paths = Paths(args)
    tested, reference = ("grpc", "direct") if args.direct_grpc else ("openai", "grpc")
    labels = {"openai": paths.route, "grpc": "gRPC, gateway", "direct": "gRPC, tritonserver"}
    questions = itertools.cycle([e.prompt for family in FAMILIES for e in eval_set(family, 20, seed=5)])
    for _ in range(3):  # warm-up
        getattr(paths, tested)(next(questions)), getattr(paths, reference)(next(questions))

    ttft = ttft_pairs(paths, questions, args.requests, (tested, reference))
    differences = [a - b for a, b in zip(ttft[tested], ttft[reference])]
    print(f"{args.model}, {args.max_tokens} tokens per request, EOS ignored; {labels[tested]} against "
          f"{labels[reference]} ({args.openai if tested == 'openai' else args.grpc} against "
          f"{args.grpc if reference == 'grpc' else args.direct_grpc})")
    print(f"TTFT at concurrency 1, {args.requests} interleaved pairs: median (p10-p90)")
    print(f"  {labels[tested]:20} {ms(ttft[tested])}\n  {labels[reference]:20} {ms(ttft[reference])}")
    print(f"  {labels[tested]} less {labels[reference]}, paired {ms(differences)}")

    rates = {tested: [], reference: []}
    failures = 0
    for name in (reference, tested, tested, reference):
        rate, failed = throughput(getattr(paths, name), questions, args.concurrency, args.pass_s / 2)
        rates[name].append(rate)
        failures += failed
    halves = [a / b for a, b in zip(rates[tested], rates[reference])]  # (B, A) then (A, B)
    ratio = sum(rates[tested]) / sum(rates[reference])
    print(f"Output tokens/s at concurrency {args.concurrency}, {args.pass_s:g} s per path (ABBA halves):")
    print(f"  {labels[tested]} {statistics.mean(rates[tested]):.1f}, {labels[reference]} "
          f"{statistics.mean(rates[reference]):.1f}: ratio {ratio:.2f}x (halves {', '.join(f'{h:.2f}' for h in halves)}); "
          f"{failures} failed")
    return {"ttft_tested_s": median_and_spread(ttft[tested])[0], "ttft_reference_s": median_and_spread(ttft[reference])[0],
            "ttft_difference_s": median_and_spread(differences)[0], "throughput_ratio": ratio, "failed": failures}


if __name__ == "__main__":
    main()
