"""Engine benchmark: dual-end vs baseline in-process, interleaved in one run, no server.

    python -m benchmarks.bench_engine --lengths 256 512 960 --repeats 5 --new-tokens 64
    python -m benchmarks.bench_engine --batch-sizes 1 4 16 32 --lengths 256 --repeats 3
    python -m benchmarks.bench_engine --batch-sizes 1 16 --synthetic-acceptance 0.9

Prompts are held-out standard-library source cut to each length in raw tokens; generation is
greedy at the calibrated threshold with EOS ignored, so every run decodes `--new-tokens` tokens.
TTFT = first step's tokens ready minus call; TPOT = (last - first) / (tokens - 1). Prints median
and 10th-90th percentile spread of each, the dual-end / baseline speedups, and the per-step cost
of ONNX Runtime against the torch reference. `--batch-sizes` instead measures the batched decode
loop in-process (the served loop without a server: `serving.loop.DecodeLoop` on the same engines):
that many requests of the first prompt length submitted at once, output tokens/s from submission
to the last token; the ceiling for served throughput at that concurrency. `--synthetic-acceptance
RATE` (benchmark only) has the dual-end model's drafts accepted by a seeded draw at RATE instead of
its confidence gate (every forward pass still runs), as a deployment assembled with it does; the
figures are headed SYNTHETIC ACCEPTANCE.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from builder.assemble import DEFAULTS as ASSEMBLE_DEFAULTS
from builder import serving_settings
from builder.assemble import SERVING_SETTINGS, up_to_date_export
from client.api import median_and_spread
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.decode import SamplingParams, pad_prompt
from dualend.engine.onnx_engine import OnnxComponents
from dualend.engine.reference import TorchComponents
from dualend.engine.scheduler import Scheduler
from dualend.serving.contract import PreparedRequest
from dualend.serving.loop import DecodeLoop, Executor
from dualend.serving.offline import stream
from dualend.train.data import stdlib_chunks

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(lengths=[256, 512, 960], repeats=5, new_tokens=64, threads=2, threshold=None,
                synthetic_acceptance=None)


class _Counter:
    """A request's output in the batched benchmark: only its token count matters."""

    def __init__(self):
        self.tokens, self.done, self.error = 0, False, None

    def send(self, response):
        self.tokens += response.counters["num_output_tokens"]
        self.done = response.finish_reason is not None

    def fail(self, message):
        self.error, self.done = message, True

    def end(self):
        self.done = True

    def is_cancelled(self):
        return False


def synthetic_for(components: OnnxComponents, rate: float | None) -> float | None:
    """The synthetic acceptance rate for an engine: only a dual-end one drafts."""
    return rate if components.pair_size == 2 else None


def batched_throughput(components: OnnxComponents, prompt: list[int], params: SamplingParams, threshold: float,
                       batch: int, synthetic_acceptance: float | None = None) -> float:
    """Output tokens/s of `batch` requests submitted together to the in-process batched loop."""
    loop = DecodeLoop(Executor.in_process(components), components.exported.tokenizer(),
                      Scheduler(max_running=batch, max_queue=0, wait_s=60, prefill_chunk=128, kv_blocks=10 ** 6,
                                kv_block_size=16), threshold,
                      synthetic_acceptance=synthetic_for(components, synthetic_acceptance))
    pairs = np.asarray(pad_prompt(prompt, components.pair_size, components.pad_id)).reshape(-1, components.pair_size)
    request = PreparedRequest(list(prompt), params, True, True)
    started = time.perf_counter()
    outputs = []
    for seq_id in range(batch):
        outputs.append(_Counter())
        loop.submit(seq_id + 1, request, components.compress(pairs), outputs[-1])
    while loop.run_once():
        pass
    elapsed = time.perf_counter() - started
    assert all(o.done and o.error is None for o in outputs), [o.error for o in outputs if o.error]
    return sum(o.tokens for o in outputs) / elapsed


def long_prompt(tokenizer, length: int) -> list[int]:
    ids: list[int] = []
    for chunk in stdlib_chunks("report", 4000, seed=1):
        ids += tokenizer.encode(chunk)
        if len(ids) >= length:
            return [tokenizer.bos_id] + ids[: length - 1]
    raise AssertionError("unreachable")


def timed_generation(components: OnnxComponents, prompt: list[int], params: SamplingParams, threshold: float,
                     synthetic_acceptance: float | None = None) -> dict:
    """One request through the in-process decode loop; a step's tokens count once they are released."""
    started = time.perf_counter()
    stamps, tokens, steps = [], 0, 0
    for response in stream(components, components.exported.tokenizer(), prompt, params, threshold,
                           synthetic_for(components, synthetic_acceptance)):
        if response.output_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.output_ids)
        steps += response.counters["num_steps"]
    return {"ttft": stamps[0] - started, "tpot": (stamps[-1] - stamps[0]) / max(1, tokens - 1),
            "tokens_per_step": tokens / steps}


def step_cost(components, prompt: list[int], steps: int = 24) -> float:
    """Median seconds of one backbone decode step after a prefill of `prompt`."""
    pair = components.pair_size
    tokens = pad_prompt(prompt, pair, components.pad_id)
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
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="measure the batched decode loop's throughput at these batch sizes instead")
    parser.add_argument("--synthetic-acceptance", type=float, default=None, metavar="RATE",
                        help="benchmark only: the dual-end model's drafts accepted by a seeded draw at RATE, "
                             "not by its gate")
    args = parser.parse_args(argv)
    rate = args.synthetic_acceptance
    if rate is not None and not 0 <= rate <= 1:
        parser.error(f"--synthetic-acceptance must be in [0, 1], got {rate}")
    torch.set_num_threads(args.threads)
    threshold = args.threshold if args.threshold is not None else serving_settings.threshold(
        *SERVING_SETTINGS["dualend"])
    checkpoints, exports = Path(args.checkpoints), Path(args.export_dir)
    engines, references = {}, {}
    for name in ("dualend", "baseline"):
        exported = up_to_date_export(checkpoints / name, exports / name)
        engines[name] = OnnxComponents(exported.directory, threads=args.threads)
        references[name] = TorchComponents(load_checkpoint(checkpoints / name).model)
    tokenizer = load_checkpoint(checkpoints / "dualend").tokenizer
    prompts = {length: long_prompt(tokenizer, length) for length in args.lengths}
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    if args.batch_sizes:
        return batched_sweep(engines, prompts[args.lengths[0]], params, threshold, args.batch_sizes, args.repeats,
                             rate)

    figures = {(n, L): {"ttft": [], "tpot": [], "tokens_per_step": []} for n in engines for L in args.lengths}
    for name, length in itertools.product(engines, args.lengths):  # warm-up, not measured
        timed_generation(engines[name], prompts[length], SamplingParams(max_tokens=4, ignore_eos=True), threshold)
    runs = [(r, L, n) for r in range(args.repeats) for L in args.lengths for n in engines]
    for _, length, name in tqdm(runs, desc="interleaved runs"):
        result = timed_generation(engines[name], prompts[length], params, threshold, rate)
        for key, value in result.items():
            figures[(name, length)][key].append(value)

    print(f"\n{synthetic_notice(rate)}In-process ONNX Runtime engine, {args.threads} threads, "
          f"threshold {threshold}, "
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
        raw = {f"{n}@{L}": v for (n, L), v in figures.items()}
        Path(args.json).write_text(json.dumps({"synthetic_acceptance": rate, "summary": summary,
                                               "step_costs": step_costs, "raw": raw}, indent=2))
    return summary


def synthetic_notice(rate: float | None) -> str:
    return "" if rate is None else (f"SYNTHETIC ACCEPTANCE {rate:g}: benchmark only, dual-end drafts accepted by "
                                    f"a draw, not by the gate\n")


def batched_sweep(engines: dict, prompt: list[int], params: SamplingParams, threshold: float, sizes: list[int],
                  repeats: int, synthetic_acceptance: float | None = None) -> dict:
    rates = {(n, b): [] for n in engines for b in sizes}
    for name in engines:  # warm-up
        batched_throughput(engines[name], prompt, SamplingParams(max_tokens=4, ignore_eos=True), threshold, 2)
    for _, size, name in tqdm(list(itertools.product(range(repeats), sizes, engines)), desc="batched runs"):
        rates[(name, size)].append(batched_throughput(engines[name], prompt, params, threshold, size,
                                                      synthetic_acceptance))
    print(f"\n{synthetic_notice(synthetic_acceptance)}In-process batched decode loop, {len(prompt)}-token prompts, "
          f"{params.max_tokens} new tokens, threshold {threshold}; output tokens/s, median (p10-p90) of {repeats}")
    summary = {}
    for size in sizes:
        row = {name: median_and_spread(rates[(name, size)])[0] for name in engines}
        summary[size] = row
        print(f"batch {size:>3} | " + " | ".join(f"{n} {fmt(rates[(n, size)], 1)}" for n in engines)
              + f" | dual-end/baseline x{row['dualend'] / row['baseline']:.2f}")
    return summary


if __name__ == "__main__":
    main()
