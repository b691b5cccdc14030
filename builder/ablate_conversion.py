"""Short conversion trials: which starting point lets a converted baseline recover fastest.

    python -m builder.ablate_conversion --baseline runs/baseline/best --steps 120

Each variant (compressor initialisation, position stride, distillation weight) trains from the
same baseline on the same batches for `--steps` steps; prints the mean backbone (next-token) and
MTP (draft) hard-label cross-entropies over the last 20 steps. Losses, not accuracy: trials this short do not move
exact-match accuracy off zero.
"""
from __future__ import annotations

import argparse
import random

import torch
from tqdm import tqdm

from builder.train import convert_baseline
from dualend.engine.checkpoint import load_checkpoint
from dualend.train.training import dualend_batch, dualend_loss, sample_stream

VARIANTS = {
    "sum, pair-index positions": dict(compressor_init="sum", position_stride=1, distill_weight=0.0),
    "sum, token-aligned positions": dict(compressor_init="sum", position_stride=2, distill_weight=0.0),
    "second token, token-aligned positions": dict(compressor_init="second", position_stride=2, distill_weight=0.0),
    "random init, pair-index positions": dict(compressor_init="random", position_stride=1, distill_weight=0.0),
    "sum, pair-index positions, distillation 0.5": dict(compressor_init="sum", position_stride=1, distill_weight=0.5),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    teacher_ckpt = load_checkpoint(args.baseline)
    teacher, tokenizer = teacher_ckpt.model, teacher_ckpt.tokenizer
    stream = sample_stream(tokenizer, seed=77, text_fraction=0.1, max_tokens=192)
    batches = [[next(stream) for _ in range(args.batch_size)] for _ in range(args.steps)]
    results = {}
    for name in args.variants:
        variant = VARIANTS[name]
        torch.manual_seed(0)
        model = convert_baseline(teacher, variant["compressor_init"], variant["position_stride"]).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
        rng, history = random.Random(0), []
        for samples in tqdm(batches, desc=name, mininterval=30):
            loss, parts = dualend_loss(model, dualend_batch(samples, tokenizer.pad_id, rng),
                                       teacher if variant["distill_weight"] else None, variant["distill_weight"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            history.append(parts)
        tail = history[-20:]
        results[name] = {k: sum(h[k] for h in tail) / len(tail) for k in ("next", "draft")}
        print(f"{name}: last-20 mean next-token loss {results[name]['next']:.3f}, draft loss {results[name]['draft']:.3f}",
              flush=True)
    return results


if __name__ == "__main__":
    main()
