"""The backbone's two graphs on the same weights: torch's portable export against builder.fused_backbone's.

    python -m benchmarks.backbone_graphs --checkpoint build/checkpoints/smollm2 --precisions int4 fp32

For each precision, writes both graphs of the checkpoint's backbone (quantized alike, as the export
does) into a scratch folder, counts their nodes after ONNX Runtime's own optimizations and times
steps as served (`BackboneRunner` over `ort_session` on `--threads`, threads spinning only within a
call; the portable graph's new keys copied into the cache, the fused one's written there in place):
every row of the batch stepping one latent (a decode step) or two (a step verifying a draft: the fused
graph's on its verifying graph, as exports hold it beside the backbone), after
`--past` latents, the two graphs taking turns in blocks of calls so the machine's noise falls on
both alike. Prints the median and 10th-90th percentile spread in ms and the portable/fused ratio.
`--ops` then profiles a decode step and a verifying step of each graph at the first of `--batch-sizes` with ONNX Runtime's
profiler: time and nodes a step per operator type (the profiler's own cost inflates small nodes' share).
The inputs are random: what each graph costs, not what it says (tests/test_export.py checks the fused
graph against the model code; benchmarks.weight_precision measures a quantized export's NLL on text).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from builder.export import WEIGHT_BITS, quantize_graph, weight_settings, write_backbone
from builder.fused_backbone import write_backbone_graph
from benchmarks.step_profile import measure
from client.api import median_and_spread
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.onnx_engine import BackboneBatch, BackboneRunner, kv_cache, ort_session

GRAPHS = ("portable", "fused")


def optimized_nodes(path: Path, scratch: Path) -> int:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(scratch / f"{path.stem}.optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return len(onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)


def operator_profile(path: Path, settings: dict, cfg, past: int, steps: int, threads: int, rng,
                     new: int = 1, batch: int = 1, verify_path: Path | None = None) -> tuple[Counter, Counter]:
    """Microseconds and nodes per step at `batch` rows (`new` latents: 1 a decode step, 2 a verifying one,
    on the graph at `verify_path` where given), by operator type (ONNX Runtime's profiler)."""
    import onnxruntime as ort

    profiled = verify_path if verify_path is not None and new == 2 else path
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.enable_profiling = True
    options.profile_file_prefix = str(profiled.with_suffix(""))
    options.log_severity_level = 3
    session = ort.InferenceSession(str(profiled), options, providers=["CPUExecutionProvider"])
    main, verify = (ort_session(path, threads), session) if profiled != path else (session, None)
    runner = BackboneRunner(main, kv_cache(settings, cfg.n_layers, batch), cfg.vocab_size, cfg.d_model, verify)
    for row in range(batch):
        runner.prefill(row, rng.standard_normal((past, cfg.d_model), np.float32) * 0.1, past + new * steps + new)
    call = step(runner, batch, new, rng)
    for _ in range(steps):
        call()
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((event["ts"], event["ts"] + event["dur"]) for event in events if event.get("name") == "model_run")
    first_step = runs[-steps][0]  # the prefills' runs before them are left out
    micros, nodes = Counter(), Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first_step:
            micros[event["args"]["op_name"]] += event["dur"] / steps
            nodes[event["args"]["op_name"]] += 1 / steps
    return micros, nodes


def step(runner: BackboneRunner, batch: int, new: int, rng):
    """A call stepping every row `new` latents (a verifying step's drafts are dropped again after)."""
    latents = rng.standard_normal((batch * new, runner.d_model), np.float32) * 0.1
    step = BackboneBatch(list(range(batch)), latents, [new] * batch, [0] * batch, [],
                         discard=[new] * batch if new > 1 else [], verify=new > 1)
    return lambda: runner.run_batch(step)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("build/checkpoints/smollm2"))
    parser.add_argument("--precisions", nargs="+", choices=list(WEIGHT_BITS), default=["int4"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--past", type=int, default=64, help="latents already in each row's cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--ops", action="store_true", help="also profile each graph's steps by operator type, at the first batch size")
    args = parser.parse_args(argv)
    checkpoint = load_checkpoint(args.checkpoint)
    model, cfg = checkpoint.model.eval(), checkpoint.config
    settings = {"n_layers": cfg.n_layers, "n_kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim}
    figures = {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        for precision in args.precisions:
            quantization = weight_settings(precision, cfg.head_dim).get("weight_quantization")
            paths, nodes, verify_paths = {}, {}, {"fused": scratch / f"{precision}_fused_verify.onnx"}
            write_backbone_graph(model, verify_paths["fused"], verify=True)  # as exports hold beside the fused graph
            for graph in GRAPHS:
                paths[graph] = scratch / f"{precision}_{graph}.onnx"
                write_backbone(model, paths[graph], fused=graph == "fused")
                if quantization:
                    for path in [paths[graph]] + ([verify_paths[graph]] if graph in verify_paths else []):
                        quantize_graph(path, quantization, cfg.vocab_size)
                nodes[graph] = optimized_nodes(paths[graph], scratch)
            print(f"\n{args.checkpoint} backbone, {precision} weights: nodes after ONNX Runtime's optimizations: "
                  f"portable {nodes['portable']}, fused {nodes['fused']}; ms per call, median (p10-p90) of "
                  f"{args.repeats}, past {args.past} latents, {args.threads} threads", flush=True)
            rng = np.random.default_rng(0)
            for batch in args.batch_sizes:
                runners = {}
                for graph in GRAPHS:
                    verify = ort_session(verify_paths[graph], args.threads) if graph in verify_paths else None
                    runners[graph] = BackboneRunner(ort_session(paths[graph], args.threads),
                                                    kv_cache(settings, cfg.n_layers, batch), cfg.vocab_size, cfg.d_model,
                                                    verify)
                    for row in range(batch):
                        runners[graph].prefill(row, rng.standard_normal((args.past, cfg.d_model), np.float32) * 0.1,
                                               args.past + 4 * args.repeats + 64)
                for new in (1, 2):
                    times = measure({graph: step(runners[graph], batch, new, rng) for graph in GRAPHS}, args.repeats)
                    medians = {graph: median_and_spread(times[graph]) for graph in GRAPHS}
                    ratio = medians["portable"][0] / medians["fused"][0]
                    kind = "decode step" if new == 1 else "verifying step"
                    print(f"  batch {batch:2d}, {kind:14s}  " + "  ".join(
                        f"{graph} {m:6.2f} ({lo:.2f}-{hi:.2f})" for graph, (m, lo, hi) in medians.items())
                        + f"  portable/fused {ratio:.2f}x", flush=True)
                    figures[(precision, batch, new)] = {"ratio": ratio, **{g: medians[g] for g in GRAPHS}}
            for new in (1, 2) if args.ops else ():
                profiles = {graph: operator_profile(paths[graph], settings, cfg, args.past, args.repeats, args.threads,
                                                    rng, new, args.batch_sizes[0], verify_paths.get(graph))
                            for graph in GRAPHS}
                kind = "a decode step" if new == 1 else "a verifying step (two latents a row)"
                print(f"  {kind} at batch {args.batch_sizes[0]} by operator type (ONNX Runtime's profiler, {args.repeats} steps): "
                      "us a step, nodes", flush=True)
                for graph, (micros, nodes) in profiles.items():
                    print(f"    {graph}: {sum(micros.values()):.0f} us in {sum(nodes.values()):.0f} nodes; " + ", ".join(
                        f"{op} {us:.0f} ({nodes[op]:.0f})" for op, us in micros.most_common()), flush=True)
    return figures


if __name__ == "__main__":
    main()
