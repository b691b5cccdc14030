"""Write perf_analyzer input files: held-out text prompts of known token lengths.

    python -m benchmarks.perf_inputs                     # -> perf_analyzer_configs/*.json

Every workload streams, ignores EOS (so each request decodes exactly max_tokens tokens) and stays
inside the trained context (prompt + max_tokens <= raw_context_limit):
  fixed_<N>          prompts of exactly N tokens (BOS included), 64 output tokens
  prompt_heavy       prompts of 768-960 tokens, 16 output tokens
  generation_heavy   prompts of 32-96 tokens, 256 output tokens
Prompts come from the report split of the standard-library text, never seen in training.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from dualend.engine.checkpoint import load_checkpoint
from dualend.train.data import stdlib_chunks

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(checkpoint=ROOT / "checkpoints" / "dualend", out=ROOT / "perf_analyzer_configs", prompts=32, seed=0)
FIXED_LENGTHS = (256, 512, 896)
FIXED_OUTPUT = 64
MIXES = {"prompt_heavy": ((768, 960), 16), "generation_heavy": ((32, 96), 256)}


def prompts_of_length(tokenizer, lengths: list[int], seed: int) -> list[str]:
    """Texts whose encoding with BOS has exactly the given lengths, each cut at a token boundary."""
    texts, chunks = [], stdlib_chunks("report", chunk_chars=8 * max(lengths), seed=seed)
    for length in lengths:
        ids = tokenizer.encode(next(chunks))
        while True:
            text = tokenizer.decode(ids[: length - 1])
            if tokenizer.prompt_length(text) == length:
                texts.append(text)
                break
            ids = ids[1:]  # a cut that re-tokenizes differently: try one token later
    return texts


def request(text: str, max_tokens: int) -> dict:
    return {"text_input": [text], "max_tokens": [max_tokens], "stream": [True], "ignore_eos": [True],
            "exclude_input_in_output": [True]}


def main(argv=None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=str if isinstance(value, Path) else type(value), default=value)
    args = parser.parse_args(argv)
    checkpoint = load_checkpoint(args.checkpoint)
    context = checkpoint.recipe.get("context", 1024)
    rng = random.Random(args.seed)
    workloads = {f"fixed_{n}": ([n] * args.prompts, FIXED_OUTPUT) for n in FIXED_LENGTHS if n + FIXED_OUTPUT <= context}
    for name, ((low, high), output) in MIXES.items():
        high = min(high, context - output)
        workloads[name] = ([rng.randint(low, high) for _ in range(args.prompts)], output)
    written = {}
    for name, (lengths, output) in workloads.items():
        texts = prompts_of_length(checkpoint.tokenizer, lengths, args.seed)
        path = Path(args.out) / f"{name}.json"
        path.write_text(json.dumps({"data": [request(t, output) for t in texts]}, indent=1) + "\n", encoding="utf-8")
        written[name] = path
        print(f"{path}: {len(texts)} prompts of {min(lengths)}-{max(lengths)} tokens, {output} output tokens")
    return written


if __name__ == "__main__":
    main()
