"""Soak test: many closed-loop streams for a long time, against a running server; prints errors by
kind, latency percentiles and the memory (RSS) of every server process over time.

    python -m benchmarks.soak --streams 64 --passes 2 --pass-s 300            # the production check
    python -m benchmarks.soak --url 127.0.0.1:18001 --streams 16 --passes 2 --pass-s 60
    python -m benchmarks.soak --deployments smollm2 --streams 64 --passes 2 --pass-s 300
    python -m benchmarks.soak --openai http://127.0.0.1:8000/v1 --streams 32 --passes 2 --pass-s 300
    python -m benchmarks.soak --openai http://127.0.0.1:8000/v1 --chat --deployments smollm2 --streams 32

Each pass runs `--streams` clients that send requests back to back (prompts of the three task
families, 16-128 new tokens, half of them with EOS ignored, the deployments alternating) for
`--pass-s` seconds: streamed gRPC requests to `--url`, or with `--openai` streamed /v1/completions
requests to the OpenAI-compatible service at that base URL (`--chat`: /v1/chat/completions, the
prompt as one user message; the deployment needs a chat template). After each pass it samples the RSS
of tritonserver, its Python backend stubs (named by model), nginx and the OpenAI-compatible service
(openai_api), so a process whose memory grows from pass to pass shows up; it ends with each process's
growth from pass 1 to the last pass.

Errors are counted by kind: over gRPC the start of the server's message; over /v1 the HTTP status and
OpenAI error code (`HTTP 429 server_busy`), `error event <code>` for an error after the first chunk,
or the client's own failure (`cut`, `ConnectionRefusedError`). TTFT is the first token's arrival
(over /v1 the first chunk with text) less the request's start. A /v1 chunk does not say how many
tokens it carries, so for the inter-token gaps each request's completion tokens (its usage) are
spread evenly over its text chunks: exact where every chunk carries as many (the baseline's one
token), an average over the request where they differ (a dual-end step's pair, or more with a draft
accepted); over gRPC each response's own count is used.

Through the gateway, streams past the key's `max_requests` (16 by default) are refused with 429: soak
with a key of its own, e.g. a line `soak KEY max_requests=64` in build/gateway/api_keys (read when the
launcher starts).
"""
from __future__ import annotations

import argparse
import collections
import functools
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse

from benchmarks.compare import StreamedCompletion, completions_url, error_message
from client.api import RequestError, Result, auth_headers, percentile, stream_grpc
from dualend.ops.processes import rss_mb, server_processes
from dualend.train.data import FAMILIES, eval_set

DEPLOYMENTS = ["dualend", "baseline"]
TIMEOUT_S = 120.0  # one request's; over /v1, the longest wait for its next line


def stream_openai(base_url: str, model: str, prompt: str, max_tokens: int, api_key: str | None = None,
                  chat: bool = False, ignore_eos: bool = False, timeout_s: float = TIMEOUT_S) -> Result:
    """One streamed /v1/completions (or /v1/chat/completions) request, each SSE line timed as it
    arrives; a refusal, an error event or a failed connection raises RequestError."""
    url = urllib.parse.urlsplit(completions_url(base_url, chat))
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout_s)
    completion = StreamedCompletion(time.perf_counter())
    try:
        connection.request("POST", url.path, body=json.dumps(body),
                           headers={"Content-Type": "application/json"} | auth_headers(api_key))
        response = connection.getresponse()
        if response.status != 200:
            raise RequestError(error_message(response.status, response.read().decode(errors="replace")))
        for line in response:
            completion.feed(line.decode(), time.perf_counter())
    except (OSError, http.client.HTTPException, ValueError) as error:  # ValueError: a line not UTF-8 or JSON
        raise RequestError(f"{type(error).__name__}: {error}") from None
    finally:
        connection.close()
    return streamed_result(completion)


def streamed_result(completion: StreamedCompletion) -> Result:
    """A /v1 stream read to its end as a Result: an arrival per text chunk, the usage's completion
    tokens spread over them as evenly as whole tokens go; an error event or a stream cut before
    `data: [DONE]` raises RequestError."""
    if completion.error is not None:
        code = f" {completion.error_code}" if completion.error_code else ""
        raise RequestError(f"error event{code}: {completion.error}")
    if not completion.done:
        raise RequestError("cut: the stream ended without data: [DONE]")
    times = completion.chunk_times
    tokens = len(times) if completion.usage_tokens is None else completion.usage_tokens
    result = Result(text=completion.text, sent_at=completion.sent_at)
    result.arrivals = [(t, (i + 1) * tokens // len(times) - i * tokens // len(times)) for i, t in enumerate(times)]
    result.counters["num_output_tokens"] = tokens
    return result


def error_kind(error: RequestError) -> str:
    """What a failed request is counted under: its message up to the first colon."""
    return str(error).split(":")[0][:80]


def one_pass(send, streams: int, seconds: float, seed: int, deployments: list[str]) -> dict:
    """`streams` clients, each calling `send(deployment, prompt, max_tokens, ignore_eos=...) -> Result`
    back to back for `seconds`: requests, errors by kind, output tokens/s, TTFT and inter-token p50/p99."""
    prompts = [e.prompt for family in FAMILIES for e in eval_set(family, 20, seed=seed, split="report")]
    stop, lock = threading.Event(), threading.Lock()
    errors, ttfts, gaps, tokens = collections.Counter(), [], [], [0]

    def client(index):
        rng = random.Random(seed * 1000 + index)
        while not stop.is_set():
            try:
                deployment = deployments[index % len(deployments)]
                result = send(deployment, rng.choice(prompts), rng.randint(16, 128), ignore_eos=rng.random() < 0.5)
                with lock:
                    ttfts.append(result.ttft_s)
                    gaps.extend(result.inter_token_s)
                    tokens[0] += result.output_tokens
            except RequestError as error:
                with lock:
                    errors[error_kind(error)] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(TIMEOUT_S + 60)
    elapsed = time.monotonic() - started
    return {"requests": len(ttfts), "errors": dict(errors), "tokens_per_s": tokens[0] / elapsed,
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p99": percentile(ttfts, 0.99),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint (the gateway by default)")
    parser.add_argument("--openai", metavar="BASE_URL",
                        help="soak the /v1 routes at this base URL instead (the gateway's: http://127.0.0.1:8000/v1)")
    parser.add_argument("--chat", action="store_true", help="with --openai: /v1/chat/completions, not /v1/completions")
    parser.add_argument("--api-key", default=None, help="default: $DUALEND_API_KEY")
    parser.add_argument("--deployments", nargs="+", default=DEPLOYMENTS)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--pass-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.chat and not args.openai:
        parser.error("--chat needs --openai")
    if args.openai:
        send = functools.partial(stream_openai, args.openai, api_key=args.api_key, chat=args.chat)
    else:
        send = functools.partial(stream_grpc, args.url, api_key=args.api_key, timeout_s=TIMEOUT_S)
    target = args.openai or args.url
    try:  # a soak that every request fails (no key, wrong port) should say so at once, not after its passes
        send(args.deployments[0], "Q: 1+1\nA:", 1)
    except RequestError as error:
        sys.exit(f"soak: the first request to {target} failed, nothing was run: {error}")
    history = []
    for number in range(1, args.passes + 1):
        figures = one_pass(send, args.streams, args.pass_s, seed=number, deployments=args.deployments)
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
