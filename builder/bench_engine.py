"""Engine benchmark: dual-end vs baseline in-process, interleaved in one run, no server.

    python -m builder.bench_engine --lengths 256 512 960 --repeats 5 --new-tokens 64

Prompts are held-out standard-library source cut to each length in raw tokens; generation is
greedy at the calibrated threshold with EOS ignored, so every run decodes `--new-tokens` tokens.
TTFT = first step's tokens ready minus call; TPOT = (last - first) / (tokens - 1). Prints median
and 10th-90th percentile spread of each, the dual-end / baseline speedups, and the per-step cost
of ONNX Runtime against the torch reference.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from client.api import median_and_spread
from dualend.checkpoint import load_checkpoint
from dualend.data import stdlib_chunks
from dualend.decode import SamplingParams, generate
from dualend.onnx_engine import OnnxComponents
from dualend.reference import TorchComponents

from .assemble import DEFAULTS as ASSEMBLE_DEFAULTS, calibrated_threshold, up_to_date_export

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(lengths=[256, 512, 960], repeats=5, new_tokens=64, threads=2, threshold=None)


def long_prompt(tokenizer, length: int) -> list[int]:
    ids: list[int] = []
    for chunk in stdlib_chunks("report", 4000, seed=1):
        ids += tokenizer.encode(chunk)
        if len(ids) >= length:
            return [tokenizer.bos_id] + ids[: length - 1]
    raise AssertionError("unreachable")


def timed_generation(components, prompt: list[int], params: SamplingParams, threshold: float) -> dict:
    started = time.perf_counter()
    stamps, tokens, steps = [], 0, 0
    for step in generate(components, prompt, params, threshold):
        if step.tokens:
            stamps.append(time.perf_counter())
            tokens += len(step.tokens)
        steps += 1
    return {"ttft": stamps[0] - started, "tpot": (stamps[-1] - stamps[0]) / max(1, tokens - 1),
            "tokens_per_step": tokens / steps}


def step_cost(components, prompt: list[int], steps: int = 24) -> float:
    """Median seconds of one backbone decode step after a prefill of `prompt`."""
    pair = components.pair_size
    tokens = prompt + [components.pad_id] * (-len(prompt) % pair)
    import numpy as np

    latents = components.compress(np.asarray(tokens).reshape(-1, pair))
    session = components.open_backbone()
    session.prefill(latents, len(latents) + steps)
    times = []
    for latent in itertools.islice(itertools.cycle(latents[:8]), steps):
        started = time.perf_counter()
        session.step(latent)
        times.append(time.perf_counter() - started)
    session.close()
    return median_and_spread(times)[0]


def fmt(values: list[float], scale: float = 1e3) -> str:
    median, low, high = median_and_spread(values)
    return f"{median * scale:8.2f} ({low * scale:.2f}-{high * scale:.2f})"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULTS["lengths"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    parser.add_argument("--new-tokens", type=int, default=DEFAULTS["new_tokens"])
    parser.add_argument("--threads", type=int, default=DEFAULTS["threads"])
    parser.add_argument("--threshold", type=float, default=None, help="default: the calibrated one")
    parser.add_argument("--json", type=str, default=None, help="also write the raw figures here")
    parser.add_argument("--checkpoints", default=str(ASSEMBLE_DEFAULTS["checkpoints"]))
    parser.add_argument("--export-dir", default=str(ASSEMBLE_DEFAULTS["export_dir"]))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    threshold = args.threshold if args.threshold is not None else calibrated_threshold(
        Path(ASSEMBLE_DEFAULTS["quality_report"]))
    checkpoints, exports = Path(args.checkpoints), Path(args.export_dir)
    engines, references = {}, {}
    for name in ("dualend", "baseline"):
        exported = up_to_date_export(checkpoints / name, exports / name)
        engines[name] = OnnxComponents(exported.directory, threads=args.threads)
        references[name] = TorchComponents(load_checkpoint(checkpoints / name).model)
    tokenizer = load_checkpoint(checkpoints / "dualend").tokenizer
    prompts = {length: long_prompt(tokenizer, length) for length in args.lengths}
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    figures = {(n, L): {"ttft": [], "tpot": [], "tokens_per_step": []} for n in engines for L in args.lengths}
    for name, length in itertools.product(engines, args.lengths):  # warm-up, not measured
        timed_generation(engines[name], prompts[length], SamplingParams(max_tokens=4, ignore_eos=True), threshold)
    runs = [(r, L, n) for r in range(args.repeats) for L in args.lengths for n in engines]
    for _, length, name in tqdm(runs, desc="interleaved runs"):
        result = timed_generation(engines[name], prompts[length], params, threshold)
        for key, value in result.items():
            figures[(name, length)][key].append(value)

    print(f"\nIn-process ONNX Runtime engine, {args.threads} threads, threshold {threshold}, "
          f"{args.new_tokens} new tokens, {args.repeats} interleaved repeats; ms, median (p10-p90)")
    print(f"{'prompt':>7} | {'model':8} | {'TTFT':>22} | {'TPOT':>20} | tokens/step")
    summary = {}
    for length in args.lengths:
        for name in engines:
            f = figures[(name, length)]
            print(f"{length:>7} | {name:8} | {fmt(f['ttft'])} | {fmt(f['tpot'])} | "
                  f"{median_and_spread(f['tokens_per_step'])[0]:.2f}")
        dual, base = figures[("dualend", length)], figures[("baseline", length)]
        ttft_ratio = median_and_spread(base["ttft"])[0] / median_and_spread(dual["ttft"])[0]
        tpot_ratio = median_and_spread(base["tpot"])[0] / median_and_spread(dual["tpot"])[0]
        paired_ttft = [b / d for b, d in zip(base["ttft"], dual["ttft"])]
        paired_tpot = [b / d for b, d in zip(base["tpot"], dual["tpot"])]
        print(f"{length:>7} | speedup  | TTFT x{ttft_ratio:.2f} (paired {fmt(paired_ttft, 1)}) | "
              f"TPOT x{tpot_ratio:.2f} (paired {fmt(paired_tpot, 1)})")
        summary[length] = {"ttft_speedup": ttft_ratio, "tpot_speedup": tpot_ratio,
                           "tokens_per_step": median_and_spread(dual["tokens_per_step"])[0]}

    longest = max(args.lengths)
    print(f"\nPer decode step after a {longest}-token prompt, ms (median of 24): ONNX Runtime vs torch reference")
    step_costs = {}
    for name in engines:
        prompt = prompts[longest]
        onnx_ms, torch_ms = step_cost(engines[name], prompt) * 1e3, step_cost(references[name], prompt) * 1e3
        step_costs[name] = {"onnxruntime_ms": onnx_ms, "torch_ms": torch_ms}
        print(f"  {name:8}: onnxruntime {onnx_ms:.2f}  torch {torch_ms:.2f}  -> "
              f"{'onnxruntime' if onnx_ms <= torch_ms else 'torch'} is faster")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "step_costs": step_costs,
                                               "raw": {f"{n}@{L}": v for (n, L), v in figures.items()}}, indent=2))
    return summary


if __name__ == "__main__":
    main()
