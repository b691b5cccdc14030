"""Where one decode step's engine time goes, per component, in-process (no server).

    python -m benchmarks.step_profile build/export/smollm2_dualend build/export/dualend --batch-sizes 1 16

For each export: the backbone's step (its past 64 latents long, every row of the batch stepping) on
`--threads` threads with ONNX Runtime's threads spinning between calls (as the in-process engine
runs it; measured last and alone, as its threads take a core from any other session once it ran) and
within a call only (as the served backbone runs it), and, as served, a step verifying a
draft (two latents a row); the MTP head's step on one thread and on
`--threads`; the compressor folding one pair. The variants take turns in blocks of calls, so the
machine's noise falls on every one alike; prints the median and the 10th-90th percentile spread in ms.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from client.api import median_and_spread
from dualend.engine.onnx_engine import (
    BackboneBatch,
    BackboneRunner,
    ExportedModel,
    MTPRunner,
    kv_cache,
    ort_session,
    verify_session,
)

PAST_LATENTS = 64


def variants(exported: ExportedModel, batch: int, threads: int, spinning_on: bool) -> dict:
    """name -> a callable running one step of that variant: the one whose threads spin on between
    calls (`spinning_on`; once it has run, its threads take a core from any other), or the others."""
    settings = exported.settings
    width, rng = settings["d_model"], np.random.default_rng(0)
    calls = {}
    backbone = BackboneRunner(ort_session(exported.path("backbone"), threads, spinning_on),
                              kv_cache(settings, settings["n_layers"], batch), settings["vocab_size"], width,
                              None if spinning_on else verify_session(exported, threads))
    for seq_id in range(batch):
        backbone.prefill(seq_id, rng.standard_normal((PAST_LATENTS, width), np.float32) * 0.02, 4096)
    latents = rng.standard_normal((batch, width), np.float32) * 0.02

    def step():
        backbone.step(list(range(batch)), latents)
    if spinning_on:
        return {f"backbone, {threads} threads, spinning between calls": step}
    calls[f"backbone, {threads} threads"] = step
    # as served: a step that verifies a draft (on the verifying graph where the export has one): two
    # latents a row, both dropped again after
    verify = BackboneBatch(list(range(batch)), np.repeat(latents, 2, axis=0), [2] * batch, [0] * batch, [],
                           discard=[2] * batch, verify=True)
    calls[f"backbone verifying, {threads} threads"] = lambda: backbone.run_batch(verify)
    if "mtp" in exported.manifests:
        for mtp_threads in sorted({1, threads}):
            runner = MTPRunner(ort_session(exported.path("mtp"), mtp_threads), kv_cache(settings, 1, batch))
            for seq_id in range(batch):
                runner.cache.reserve(seq_id, 4096)
            position = [0]

            def mtp_step(runner=runner, position=position):
                position[0] += 1
                runner.step_batch(list(range(batch)), np.full(batch, 5), rng.standard_normal((batch, width), np.float32),
                                  np.full(batch, position[0]))
            calls[f"MTP head, {mtp_threads} thread{'s' if mtp_threads > 1 else ''}"] = mtp_step
    compressor = ort_session(exported.path("compressor"), 1)
    pairs = np.full((batch, settings["pair_size"]), 5, np.int64)
    calls["compressor, 1 thread"] = lambda: compressor.run(None, {"tokens": pairs})
    return calls


def measure(calls: dict, repeats: int, block: int = 4) -> dict:
    """name -> ms of `repeats` calls: the variants take turns in blocks of `block` consecutive calls
    (each block's first not counted: it meets the threads as the other variant left them)."""
    times = {name: [] for name in calls}
    for repeat in range(-(-repeats // (block - 1)) + 1):  # a warm-up round first
        for name, call in calls.items():
            for index in range(block):
                started = time.perf_counter()
                call()
                if repeat and index and len(times[name]) < repeats:
                    times[name].append((time.perf_counter() - started) * 1e3)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exports", type=Path, nargs="+", help="export folders (builder.assemble writes build/export/NAME)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    figures = {}
    for directory in args.exports:
        exported = ExportedModel.open(directory)
        for batch in args.batch_sizes:
            times = {}
            for spinning_on in (False, True):  # the variant spinning on last, alone: it would slow the others
                calls = variants(exported, batch, args.threads, spinning_on)
                times |= measure(calls, args.repeats)
            print(f"\n{directory} (weights {exported.weight_precision}), batch {batch}, past {PAST_LATENTS} latents; "
                  f"ms per step, median (p10-p90) of {args.repeats}")
            for name, values in times.items():
                median, low, high = median_and_spread(values)
                print(f"  {name:45} {median:8.2f} ({low:.2f}-{high:.2f})")
                figures[(str(directory), batch, name)] = median
    return figures


if __name__ == "__main__":
    main()
