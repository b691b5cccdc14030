"""Serve the OpenAI-compatible API on its own (the launcher starts it behind the gateway).

    python -m dualend.ops.openai_api --triton-grpc 127.0.0.1:18001 --model-repository build/model_repository \
        --api-keys build/gateway/api_keys --gateway-prefix build/gateway --port 18080
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .app import Service, ServiceSettings

DEFAULTS = ServiceSettings("127.0.0.1:18001", Path("build/model_repository"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-grpc", default=DEFAULTS.triton_grpc, help="tritonserver's gRPC host:port")
    parser.add_argument("--model-repository", type=Path, default=DEFAULTS.model_repository)
    parser.add_argument("--host", default=DEFAULTS.host)
    parser.add_argument("--port", type=int, default=DEFAULTS.port)
    parser.add_argument("--api-keys", type=Path, help="`name key [max_requests=N] [daily_tokens=N]` lines; none: no key check")
    parser.add_argument("--gateway-prefix", type=Path, help="the gateway's folder: down marks, canary weight")
    parser.add_argument("--baseline-percent", type=float, default=DEFAULTS.baseline_percent)
    parser.add_argument("--metrics-host", default=DEFAULTS.host)
    parser.add_argument("--metrics-port", type=int,
                        help="also serve /metrics (tokens by API key name) on this port, for Prometheus")
    parser.add_argument("--usage-db", type=Path, help="tokens per key and day, kept in this SQLite file "
                                                     "(dualend.ops.usage); with it, daily_tokens quotas apply")
    parser.add_argument("--stall-s", type=float, default=DEFAULTS.stall_s,
                        help="a request of a failed deployment without a response this long ends with 503")
    parser.add_argument("--hang-s", type=float, default=DEFAULTS.hang_s,
                        help="a streamed request without a response this long ends with 503 (a hung step); longer "
                             "than a queue wait and a long prompt's prefill")
    parser.add_argument("--triton-http", help="tritonserver's HTTP host:port: its generate routes are served here too")
    parser.add_argument("--grpc-port", type=int, help="front Triton's gRPC InferenceService on this port")
    args = parser.parse_args(argv)
    import uvicorn

    service = Service(ServiceSettings(args.triton_grpc, args.model_repository.resolve(), args.host, args.port,
                                      args.api_keys, args.gateway_prefix, args.baseline_percent, args.stall_s,
                                      hang_s=args.hang_s, usage_db=args.usage_db, triton_http=args.triton_http,
                                      grpc_port=args.grpc_port))
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, args.metrics_host, registry=service.registry)
    uvicorn.run(service.app(), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
