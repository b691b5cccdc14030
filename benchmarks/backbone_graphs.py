"""The backbone's two graphs on the same weights: torch's portable export against builder.fused_backbone's.

    python -m benchmarks.backbone_graphs --checkpoint build/checkpoints/smollm2 --precisions int4 fp32

For each precision, writes both graphs of the checkpoint's backbone (quantized alike, as the export
does) into a scratch folder, counts their nodes after ONNX Runtime's own optimizations and times
decode steps as served (`ort_session` on `--threads`, threads spinning only
within a call): every row of the batch stepping one latent (a decode step) or two (a step verifying a
draft), after `--past` latents, the two graphs taking turns call by call so the machine's noise falls on
both alike. Prints the median and 10th-90th percentile spread in ms and the portable/fused ratio.
The inputs are random: what each graph costs, not what it says (tests/test_export.py checks the fused
graph against the model code; benchmarks.weight_precision measures a quantized export's NLL on text).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from builder.export import WEIGHT_BITS, quantize_graph, weight_settings, write_backbone
from client.api import median_and_spread
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.onnx_engine import BACKBONE_OUTPUTS, backbone_inputs, ort_session

GRAPHS = ("portable", "fused")


def optimized_nodes(path: Path, scratch: Path) -> int:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(scratch / f"{path.stem}.optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return len(onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)


def step_feeds(settings: dict, batch: int, new: int, past: int, rng) -> dict:
    layers, width = settings["n_layers"], past + 64
    lengths = np.full(batch, past)
    cache = [rng.standard_normal((batch, settings["kv_heads"], width, settings["head_dim"]), np.float32) * 0.5
             for _ in range(2 * layers)]
    values = (rng.standard_normal((batch, new, settings["d_model"]), np.float32) * 0.1,
              lengths[:, None] + np.arange(new)[None], np.ones((batch, new), bool),
              np.arange(width)[None] < lengths[:, None], *cache)
    return dict(zip(backbone_inputs(layers), values))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("build/checkpoints/smollm2"))
    parser.add_argument("--precisions", nargs="+", choices=list(WEIGHT_BITS), default=["int4"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--past", type=int, default=64, help="latents already in each row's cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    checkpoint = load_checkpoint(args.checkpoint)
    model, cfg = checkpoint.model.eval(), checkpoint.config
    settings = {"n_layers": cfg.n_layers, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "d_model": cfg.d_model}
    figures = {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        for precision in args.precisions:
            quantization = weight_settings(precision).get("weight_quantization")
            sessions, nodes = {}, {}
            for graph in GRAPHS:
                path = scratch / f"{precision}_{graph}.onnx"
                write_backbone(model, path, fused=graph == "fused")
                if quantization:
                    quantize_graph(path, quantization, cfg.vocab_size)
                nodes[graph] = optimized_nodes(path, scratch)
                sessions[graph] = ort_session(path, args.threads)
            print(f"\n{args.checkpoint} backbone, {precision} weights: nodes after ONNX Runtime's optimizations: "
                  f"portable {nodes['portable']}, fused {nodes['fused']}; ms per call, median (p10-p90) of "
                  f"{args.repeats}, past {args.past} latents, {args.threads} threads", flush=True)
            rng = np.random.default_rng(0)
            for batch in args.batch_sizes:
                for new in (1, 2):
                    feeds = step_feeds(settings, batch, new, args.past, rng)
                    times = {graph: [] for graph in GRAPHS}
                    for repeat in range(args.repeats + 2):  # two warm-up rounds
                        for graph in GRAPHS:
                            started = time.perf_counter()
                            sessions[graph].run(list(BACKBONE_OUTPUTS), feeds)
                            if repeat >= 2:
                                times[graph].append((time.perf_counter() - started) * 1e3)
                    medians = {graph: median_and_spread(times[graph]) for graph in GRAPHS}
                    ratio = medians["portable"][0] / medians["fused"][0]
                    kind = "decode step" if new == 1 else "verifying step"
                    print(f"  batch {batch:2d}, {kind:14s}  " + "  ".join(
                        f"{graph} {m:6.2f} ({lo:.2f}-{hi:.2f})" for graph, (m, lo, hi) in medians.items())
                        + f"  portable/fused {ratio:.2f}x", flush=True)
                    figures[(precision, batch, new)] = {"ratio": ratio, **{g: medians[g] for g in GRAPHS}}
    return figures


if __name__ == "__main__":
    main()
