"""One API key floods the gRPC route while another asks: the other's time to first token, idle and under
the flood, and how many of the flooding key's requests the front let run at once. Prints figures.

    python -m benchmarks.key_fairness --grpc 127.0.0.1:8001 --metrics http://127.0.0.1:8002/metrics \
        --model smollm2 --flood-key KEY1 --other-key KEY2

The flooding key keeps `--outstanding` requests on one gRPC stream (each refused one is sent again), so
it asks for far more than its cap (max_requests); the other key sends `--requests` requests one after
another, first with nothing else running, then under the flood. The server's live sequences are read
from its metrics while the flood runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from client.api import _grpc_inputs, auth_headers, median_and_spread, metric_value, request_body, stream_grpc

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def ttfts(args, count: int) -> list[float]:
    found = []
    for _ in range(count):
        result = stream_grpc(args.grpc, args.model, PROMPT, args.max_tokens, api_key=args.other_key)
        found.append((result.arrivals[0][0] - result.sent_at) * 1000)
    return found


class Flood:
    """`outstanding` requests at all times on one gRPC stream of the flooding key."""

    def __init__(self, args):
        import tritonclient.grpc as grpcclient

        self.args, self.grpcclient = args, grpcclient
        self.client = grpcclient.InferenceServerClient(args.grpc)
        self.lock = threading.Condition()
        self.open, self.refused, self.finished, self.sent, self.tokens = 0, 0, 0, 0, 0
        self.stopping = False

    def on_response(self, result, error) -> None:
        with self.lock:
            if error is not None:
                self.open -= 1
                self.refused += "too_many_requests_for_key" in str(error)
            else:
                emitted = result.as_numpy("num_output_tokens")
                self.tokens += 0 if emitted is None else int(emitted[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    self.open -= 1
                    self.finished += 1
            self.lock.notify()

    def run(self) -> None:
        self.client.start_stream(callback=self.on_response, headers=auth_headers(self.args.flood_key))
        body = request_body(PROMPT, self.args.flood_max_tokens, True, ignore_eos=True)
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.open < self.args.outstanding or self.stopping)
                if self.stopping:
                    break
                self.open += 1
                self.sent += 1
            self.client.async_stream_infer(self.args.model, _grpc_inputs(self.grpcclient, body),
                                           enable_empty_final_response=True)
            if self.sent % self.args.outstanding == 0:
                time.sleep(0.05)  # refused requests come back at once: resend them a little later
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc", required=True, help="the gateway's gRPC host:port")
    parser.add_argument("--metrics", required=True, help="tritonserver's metrics URL")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--backbone", help="the deployment's backbone model, whose live sequences are read "
                                           "(default: MODEL_v1_backbone)")
    parser.add_argument("--flood-key", required=True)
    parser.add_argument("--other-key", required=True)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--flood-max-tokens", type=int, default=256)
    parser.add_argument("--outstanding", type=int, default=64)
    args = parser.parse_args(argv)

    ttfts(args, 2)  # warm-up
    idle = ttfts(args, args.requests)
    flood = Flood(args)
    flooding = threading.Thread(target=flood.run, daemon=True)
    flooding.start()
    live = []
    watching = True

    def watch():
        while watching:
            value = metric_value(args.metrics, "dualend_kv_live_sequences", args.backbone or f"{args.model}_v1_backbone")
            live.append(value)
            time.sleep(0.2)

    time.sleep(3)  # the flood at its cap
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    tokens_before, started = flood.tokens, time.perf_counter()
    loaded = ttfts(args, args.requests)
    flood_rate = (flood.tokens - tokens_before) / (time.perf_counter() - started)
    watching = False
    with flood.lock:
        flood.stopping = True
        flood.lock.notify()
    flooding.join(30)
    watcher.join(5)
    seen = [v for v in live if v is not None]
    print(f"model {args.model}, {args.requests} requests of the other key ({args.max_tokens} tokens), the flooding key "
          f"keeping {args.outstanding} requests of {args.flood_max_tokens} tokens on one gRPC stream")
    for name, values in (("idle", idle), ("flood", loaded)):
        median, low, high = median_and_spread(values)
        print(f"  TTFT {name:5s} median {median:7.1f} ms  p10 {low:7.1f}  p90 {high:7.1f}")
    print(f"  ratio flood / idle (medians): {statistics.median(loaded) / statistics.median(idle):.2f}")
    print(f"  flooding key: {flood.sent} sent, {flood.finished} finished, {flood.refused} refused by its cap; "
          f"{flood_rate:.1f} output tokens/s while the other key asked")
    print(f"  live sequences while flooding (the flood plus the other key's one): max {max(seen) if seen else 'n/a'}, "
          f"median {statistics.median(seen) if seen else 'n/a'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
