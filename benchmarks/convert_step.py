"""Where a `builder.train convert` step's time goes, in-process: the teacher's blocks, the student's
forward with the losses, the backward, clipping with the optimizer; and tokens/s.

    python -m benchmarks.convert_step --baseline build/checkpoints/smollm2 --lora-rank 0 --threads 1

Each step is convert's own (`conversion.conversion_loss` on a batch of the text stream, the same
optimizer, bf16 autocast where the CPU multiplies bf16 natively), after one warm-up step (three with
--compile); prints each part's median over --steps steps and tokens/s over all of them. With
--teacher-cache the teacher's hidden states come with the batch, as in a run with a cache (its part is
then 0).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from builder.train import native_bf16
from dualend.engine.checkpoint import load_checkpoint
from dualend.train import conversion

PARTS = ("teacher", "student forward + losses", "backward", "clip + optimizer")


def timed_step(student, teacher, optimizer, batch, autocast: dict, cached: bool, kl=conversion.kl_rows) -> list[float]:
    trainable = [p for p in student.parameters() if p.requires_grad]
    marks = [time.perf_counter()]
    with torch.autocast(**autocast):
        if not cached:
            with torch.no_grad():
                batch = batch | {"teacher_hidden": conversion.teacher_hidden(teacher, batch["real_tokens"])}
        marks.append(time.perf_counter())
        loss, _ = conversion.conversion_loss(student, teacher, batch, hidden_weight=0.0, kl=kl)
    marks.append(time.perf_counter())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    marks.append(time.perf_counter())
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:])]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the token-level checkpoint (the teacher)")
    parser.add_argument("--lora-rank", type=int, default=16, help="0: a full fine-tune of the blocks")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-tokens", type=int, default=256)
    parser.add_argument("--teacher-cache", action="store_true")
    parser.add_argument("--compile", action="store_true", help="as convert --compile (three warm-up steps, not one)")
    parser.add_argument("--frozen-fp32", action="store_true",
                        help="frozen linears kept in fp32 (cast at each use), as convert did before 81ec0f8")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = load_checkpoint(args.baseline)
    teacher, pad = base.model.eval().requires_grad_(False), base.model.cfg.pad_id
    student = conversion.build_student(teacher, conversion.ConversionSpec(args.lora_rank, compressor_init="sum"))
    optimizer = conversion.optimizer([p for p in student.parameters() if p.requires_grad], lr=1e-5)
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=native_bf16(torch.device("cpu")))
    if autocast["enabled"] and not args.frozen_fp32:
        conversion.frozen_linears_in(torch.bfloat16, teacher, student)
    kl = conversion.compile_step(teacher, student) if args.compile else conversion.kl_rows
    warmup = 3 if args.compile else 1  # graphs for each mode and argument pattern the blocks see
    stream, rng = conversion.text_samples(base.tokenizer, "train", 0, args.seq_tokens), random.Random(0)
    batches = [conversion.conversion_batch([next(stream) for _ in range(args.batch_size)], pad, rng)
               for _ in range(args.steps + warmup)]
    if args.teacher_cache:
        with torch.autocast(**autocast), torch.no_grad():
            batches = [b | {"teacher_hidden": conversion.teacher_hidden(teacher, b["real_tokens"])} for b in batches]
    timings = [timed_step(student.train(), teacher, optimizer, b, autocast, args.teacher_cache, kl) for b in batches]
    timings = timings[warmup:]
    tokens = sum(conversion.real_tokens(b, pad) for b in batches[warmup:])
    print(f"lora_rank {args.lora_rank}, {args.threads} thread(s), autocast {'bf16' if autocast['enabled'] else 'none'}"
          f"{', teacher cached' if args.teacher_cache else ''}{', frozen linears fp32' if args.frozen_fp32 else ''}"
          f"{', compiled' if args.compile else ''}: "
          f"{tokens / sum(map(sum, timings)):.0f} tokens/s; "
          + ", ".join(f"{name} {1000 * statistics.median(t[i] for t in timings):.1f} ms"
                      for i, name in enumerate(PARTS)))


if __name__ == "__main__":
    main()
