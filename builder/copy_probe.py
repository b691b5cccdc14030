"""How far a baseline checkpoint has learned to retrieve from its context: teacher-forced greedy
accuracy on held-out lookup contexts, as a copy of the context after itself and as a query.

    python -m builder.copy_probe checkpoints/baseline --contexts 32

Digits are the retrieval part (which value followed a key); everything else in a copy (colons,
spaces, the keys' order) can be read off the neighbouring tokens. Chance on a digit is 0.1.
For a query's wrong first digit it also counts where that digit could have been read: the nearest
entry (in entries before or after the queried one) whose value starts with it, beside the same
count for a reader that takes a random other entry's value (nearest-match alone piles counts at
-1/+1). More misreads at -1/+1 than that reader's would mean the model finds the right region of
the context but not the exact entry.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import random

import torch

from dualend.engine.checkpoint import load_checkpoint
from dualend.train.data import Example, examples, lookup_context, lookup_entries
from dualend.train.training import IGNORE, baseline_batch, baseline_forward, copy_sample, lookup_sample


@torch.no_grad()
def accuracy(model, tokenizer, samples) -> dict[str, float]:
    batch = baseline_batch(samples, tokenizer.pad_id)
    labels = batch["labels"]
    right = baseline_forward(model, batch["tokens"]).argmax(-1) == labels
    digit = torch.tensor([[t != IGNORE and tokenizer.decode([int(t)]).isdigit() for t in row] for row in labels])
    return {"tokens": round(right[labels != IGNORE].float().mean().item(), 3),
            "digits": round(right[digit].float().mean().item(), 3)}


def misread_offset(example: Example, first_digit: str) -> int | str:
    """"right", or the offset (in entries) from the queried entry to the nearest entry whose value
    starts with `first_digit`, or "none" when no value in the context does."""
    if first_digit == example.answer[0]:
        return "right"
    if not first_digit:  # PAD, BOS or EOS: no value starts with it
        return "none"
    entries = lookup_entries(example)
    target = [key for key, _ in entries].index(example.prompt.rsplit("\nget ", 1)[1].rstrip(":"))
    offsets = [i - target for i, (_, value) in enumerate(entries) if value.startswith(first_digit)]
    return min(offsets, key=lambda offset: (abs(offset), offset)) if offsets else "none"


def random_reader_offsets(held_out: list[Example], draws: int = 10, seed: int = 0) -> collections.Counter:
    """misread_offset counts, per context on average, for first digits read off a random entry other
    than the queried one."""
    rng, counts = random.Random(seed), collections.Counter()
    for example in held_out:
        query = example.prompt.rsplit("\nget ", 1)[1].rstrip(":")
        others = [value for key, value in lookup_entries(example) if key != query]
        counts.update(misread_offset(example, rng.choice(others)[0]) for _ in range(draws))
    return collections.Counter({key: count / draws for key, count in counts.items()})


@torch.no_grad()
def misread_offsets(model, tokenizer, held_out: list[Example]) -> collections.Counter:
    batch = baseline_batch([lookup_sample(tokenizer, e, []) for e in held_out], tokenizer.pad_id)
    predicted = baseline_forward(model, batch["tokens"]).argmax(-1)
    first = (batch["labels"] != IGNORE).int().argmax(-1)  # each row's first answer position
    return collections.Counter(misread_offset(e, tokenizer.decode([int(predicted[row, first[row]])]))
                               for row, e in enumerate(held_out))


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
    print("  a query's first digit, where it could have been read (an offset: that many entries after (+) or "
          "before (-) the queried one):")
    for name, counts in (("model", misread_offsets(model, tokenizer, held_out)),
                         ("random other entry", random_reader_offsets(held_out))):
        wrong = sum(count for key, count in counts.items() if key != "right")
        near = counts[-1] + counts[1]
        print(f"    {name:19s} right {counts['right']:5.1f}  wrong {wrong:5.1f}, of which at -1/+1 {near:5.1f} "
              f"({near / max(wrong, 1):.0%}), at -2/+2 {counts[-2] + counts[2]:5.1f}, no such value {counts['none']:4.1f}")


if __name__ == "__main__":
    main()
