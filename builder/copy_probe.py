"""How far a baseline checkpoint has learned to retrieve from its context: teacher-forced greedy
accuracy on held-out lookup contexts, as a copy of the context after itself and as a query.

    python -m builder.copy_probe checkpoints/baseline --contexts 32

Digits are the retrieval part (which value followed a key); everything else in a copy (colons,
spaces, the keys' order) can be read off the neighbouring tokens. Chance on a digit is 0.1.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from dualend.checkpoint import load_checkpoint
from dualend.data import examples, lookup_context
from dualend.training import IGNORE, baseline_batch, baseline_forward, copy_sample, lookup_sample


@torch.no_grad()
def accuracy(model, tokenizer, samples) -> dict[str, float]:
    batch = baseline_batch(samples, tokenizer.pad_id)
    labels = batch["labels"]
    right = baseline_forward(model, batch["tokens"]).argmax(-1) == labels
    digit = torch.tensor([[t != IGNORE and tokenizer.decode([int(t)]).isdigit() for t in row] for row in labels])
    return {"tokens": round(right[labels != IGNORE].float().mean().item(), 3),
            "digits": round(right[digit].float().mean().item(), 3)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--contexts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.checkpoint)
    if checkpoint.model.cfg.is_dualend:
        raise SystemExit(f"{args.checkpoint} is a dual-end checkpoint; the probe reads token-level baselines")
    model, tokenizer = checkpoint.model.eval(), checkpoint.tokenizer
    held_out = list(itertools.islice(examples("lookup", "calibration", 0), args.contexts))
    copies = [copy_sample(tokenizer, lookup_context(e)) for e in held_out]
    queries = [lookup_sample(tokenizer, e, []) for e in held_out]
    print(f"{args.checkpoint} ({checkpoint.id}), {args.contexts} held-out lookup contexts, greedy, teacher-forced")
    for name, samples in (("copy of the context", copies), ("query", queries)):
        figures = accuracy(model, tokenizer, samples)
        print(f"  {name:20s} tokens right {figures['tokens']:.3f}   digits right {figures['digits']:.3f}")


if __name__ == "__main__":
    main()
