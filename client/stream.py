"""Stream a completion from the server and print it as it arrives, then a summary line.

    python -m client.stream "Q: 7+5-3\nA:" --model dualend --protocol grpc
    python -m client.stream " ab:12 cd:34 ef:56\nget cd:" --protocol http --url 127.0.0.1:8000 --no-stream
    python -m client.stream "What is the capital of France?" --model smollm2 --chat

The summary: TTFT, TPOT (per token, not per response), tokens, steps, acceptance of drafts.
`--chat` sends the text as one user message rendered with the deployment's chat template, read
from the served repository's tokenizer component (`--repository`, on this machine).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from client.api import RequestError, generate_http, stream_grpc, stream_http
from dualend.engine.manifest import ManifestError
from dualend.serving.repository import served_tokenizer

DEFAULTS = dict(grpc_url="127.0.0.1:8001", http_url="127.0.0.1:8000", model="dualend", max_tokens=64,
                repository=Path(__file__).resolve().parent.parent / "build" / "model_repository")


def chat_prompt(repository: Path, deployment: str, text: str) -> str:
    """`text` as one user message under the deployment's chat template."""
    try:
        return served_tokenizer(repository, deployment).user_turn(text)
    except (FileNotFoundError, ManifestError, ValueError) as error:
        raise SystemExit(f"--chat: {deployment}: {error}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the text; \\n is read as a newline")
    parser.add_argument("--model", default=DEFAULTS["model"],
                        help="deployment: dualend, baseline, smollm2 (smollm2_mtp, smollm2_exact where built), or llm (the "
                             "canary between the first two)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--url", default=None, help="host:port (default 8001 for gRPC, 8000 for HTTP)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"])
    parser.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, dest="random_seed")
    parser.add_argument("--stop", action="append", dest="stop_words")
    parser.add_argument("--acceptance-threshold", type=float)
    parser.add_argument("--chat", action="store_true", help="render the text as a user message with the "
                        "deployment's chat template (models that have one: smollm2)")
    parser.add_argument("--repository", type=Path, default=DEFAULTS["repository"],
                        help="the served model repository --chat reads the template from (default: %(default)s)")
    args = parser.parse_args(argv)
    prompt = args.prompt.replace("\\n", "\n")
    if args.chat:
        prompt = chat_prompt(args.repository, args.model, prompt)
    params = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "random_seed", "stop_words",
                                            "acceptance_threshold")}
    params["exclude_input_in_output"] = True
    url = args.url or DEFAULTS["grpc_url" if args.protocol == "grpc" else "http_url"]
    show = lambda text: (sys.stdout.write(text), sys.stdout.flush())  # noqa: E731
    try:
        if args.no_stream and args.protocol == "http":
            result = generate_http(url, args.model, prompt, args.max_tokens, **params)
            show(result.text)
        elif args.protocol == "http":
            result = stream_http(url, args.model, prompt, args.max_tokens, on_text=show, **params)
        else:
            result = stream_grpc(url, args.model, prompt, args.max_tokens, stream=not args.no_stream,
                                 on_text=show, **params)
    except RequestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"\n-- {result.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
