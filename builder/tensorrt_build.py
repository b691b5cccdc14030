"""Compile the exported backbone to TensorRT (the compressor and MTP head stay on ONNX Runtime).

    python -m builder.tensorrt_build --export-dir build/export --fp16

FP16 with two optimisation profiles: prefill chunks (batch 1, up to a chunk of latents) and decode
(up to `--max-batch` cache rows, one new latent), both with a past as wide as the KV cache can
grow under the repository's limits (dualend.serving.repository.max_sequence_latents, rounded up to the
cache's bucket). Checks parity against ONNX Runtime (logits on random inputs and whole greedy
generations) and records the plan in the component's manifest. Without an NVIDIA GPU and
`tensorrt` it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from builder.assemble import DEFAULTS as ASSEMBLE
from builder.assemble import trained_context
from dualend.engine.decode import SamplingParams
from dualend.engine.kv_pool import KVCache
from dualend.engine.manifest import Manifest, write_manifest
from dualend.engine.onnx_engine import OUTPUT_POSITIONS, ExportedModel, OnnxComponents, backbone_inputs, ort_session
from dualend.engine.tensorrt_engine import PLAN_FILE, TensorRTSession, gpu_available
from dualend.serving.offline import generate_text
from dualend.serving.repository import max_sequence_latents

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(export_dir=ROOT / "build" / "export", max_batch=ASSEMBLE["max_concurrent_requests"] + 1)
NO_GPU = "TensorRT needs an NVIDIA GPU with CUDA, and none is visible here; the ONNX Runtime engine is the CPU path"


def build_backbone_plan(onnx_path: Path, settings: dict, max_chunk: int, max_latents: int, max_batch: int,
                        fp16: bool) -> bytes:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    dim, layers = settings["d_model"], settings["n_layers"]
    kv_heads, head_dim = settings["n_kv_heads"], settings["head_dim"]

    width = KVCache.bucket_default * -(-max_latents // KVCache.bucket_default)

    def shapes(batch, new, past):
        caches = {name: (batch, kv_heads, past, head_dim) for name in backbone_inputs(layers)[4:]}
        return {"latents": (batch, new, dim), "positions": (batch, new), "new_valid": (batch, new),
                "past_valid": (batch, past)} | caches

    for low, best, high in (((1, 1, 1), (1, max_chunk // 2, width // 2), (1, max_chunk, width)),          # prefill
                            ((1, 1, 1), (max_batch // 2, 1, width // 2), (max_batch, OUTPUT_POSITIONS, width))):  # decode
        profile = builder.create_optimization_profile()
        lo, mid, hi = shapes(*low), shapes(*best), shapes(*high)
        for name in lo:
            profile.set_shape(name, lo[name], mid[name], hi[name])
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT build failed; see the log above")
    return bytes(plan)


def check_parity(directory: Path, session: TensorRTSession) -> dict:
    reference = ort_session(directory / "backbone" / "model.onnx")
    rng = np.random.default_rng(0)
    exported = ExportedModel.open(directory)
    s = exported.settings
    feeds = {"latents": rng.standard_normal((2, 1, s["d_model"]), dtype=np.float32),
             "positions": np.array([[7], [7]], np.int64), "new_valid": np.ones((2, 1), bool),
             "past_valid": np.arange(64)[None].repeat(2, 0) < 7}
    feeds |= {name: rng.standard_normal((2, s["n_kv_heads"], 64, s["head_dim"]), dtype=np.float32)
              for name in backbone_inputs(s["n_layers"])[4:]}
    ours, theirs = session.run(["logits"], feeds)[0], reference.run(["logits"], feeds)[0]
    engine = OnnxComponents(directory)
    onnx_tokens = _greedy(engine, exported)
    engine.backbone.session = session
    trt_tokens = _greedy(engine, exported)
    return {"max_abs_logit_diff": float(np.abs(ours - theirs).max()),
            "same_argmax": bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
            "greedy_tokens_equal": onnx_tokens == trt_tokens}


def _greedy(engine, exported) -> list[int]:
    threshold = 0.5 if engine.mtp is not None else 1.0
    return generate_text(engine, exported.tokenizer(), "Q: 4+3-2\nA:", SamplingParams(max_tokens=32), threshold).tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export-dir", default=str(DEFAULTS["export_dir"]))
    parser.add_argument("--deployments", nargs="+", default=["dualend", "baseline"])
    parser.add_argument("--raw-context-limit", type=int, default=ASSEMBLE["raw_context_limit"])
    parser.add_argument("--max-new-tokens", type=int, default=ASSEMBLE["max_new_tokens"])
    parser.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"], help="KV cache rows in one step")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=ASSEMBLE["prefill_chunk_tokens"])
    parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    if not gpu_available():
        print(f"error: {NO_GPU}", file=sys.stderr)
        return 2
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        print("error: the `tensorrt` package is not installed (pip install tensorrt)", file=sys.stderr)
        return 2
    for name in args.deployments:
        directory = Path(args.export_dir) / name
        exported = ExportedModel.open(directory)
        if exported.weight_precision != "fp32":
            print(f"error: {name}: {directory} holds {exported.weight_precision} weights (ONNX Runtime's "
                  f"MatMulNBits); TensorRT builds from an fp32 export", file=sys.stderr)
            return 2
        pair_size = exported.settings["pair_size"]
        limit = args.raw_context_limit or trained_context(ASSEMBLE["checkpoints"] / name)
        plan = build_backbone_plan(directory / "backbone" / "model.onnx", exported.settings,
                                   max(1, args.prefill_chunk_tokens // pair_size),
                                   max_sequence_latents(limit, args.max_new_tokens or limit, pair_size),
                                   args.max_batch, args.fp16)
        parity = check_parity(directory, TensorRTSession(plan))
        print(f"{name}: backbone plan {len(plan) / 1e6:.1f} MB; parity vs ONNX Runtime: {parity}")
        if not (parity["same_argmax"] and parity["greedy_tokens_equal"]):
            print(f"error: {name}: TensorRT output differs from ONNX Runtime; plan not written", file=sys.stderr)
            return 1
        (directory / "backbone" / PLAN_FILE).write_bytes(plan)
        manifest: Manifest = exported.manifests["backbone"]
        write_manifest(directory / "backbone", manifest.checkpoint_id, "backbone", "onnx+tensorrt", manifest.settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
