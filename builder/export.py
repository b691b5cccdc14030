"""Export one checkpoint's serving components to ONNX, each with a manifest.

    python -m builder.export --checkpoint checkpoints/dualend --out build/export/dualend

    python -m builder.export --checkpoint build/checkpoints/smollm2 --out build/export/smollm2-int4 \
        --weight-precision int4

Writes <out>/{tokenizer,compressor,backbone[,mtp]}/ with model.onnx (the compressor's weights in
model.onnx.data beside it, mapped rather than copied by ONNX Runtime; for the tokenizer:
tokenizer.json, and tokenizer_config.json when the checkpoint has one: an imported model's PAD/BOS/EOS
and chat template) and manifest.json. Every graph passes onnx.checker.

`--weight-precision int8|int4` (default fp32, the reference) stores the backbone's and the MTP head's
weight matrices quantized: every MatMul by a constant weight (the projections and the LM head, the
tied embedding's transpose included) becomes ONNX Runtime's MatMulNBits, blockwise along the input
dimension in blocks of QUANT_BLOCK_SIZE, by GGUF's rules (builder.quantize: int4 as Q4_1, int8 and
every LM head as Q8_0), so weights imported from such blocks keep their values; the MTP head, trained
here on no such grid, always at 8 bits (MTP_BITS). Such an export runs
on ONNX Runtime only, so its backbone is written for it (builder.fused_backbone, with its fused
operators); an fp32 export's backbone is torch's portable graph, the reference and TensorRT's input.
The compressor (for a baseline: the embedding lookup) stays fp32. Every manifest's settings name the precision
("weight_precision") and, when quantized, the quantizer's settings ("weight_quantization").
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from builder.fused_backbone import write_backbone_graph
from builder.quantize import LM_HEAD_BITS, PER_CHANNEL_RULE, quantize_per_channel, quantize_weights, weight_key
from builder.quantize import RULES as QUANT_RULES
from dualend.engine.checkpoint import Checkpoint, load_checkpoint
from dualend.engine.manifest import write_manifest
from dualend.engine.model import LanguageModel
from dualend.engine.onnx_engine import (
    BACKBONE_OUTPUTS,
    EXPORT_FORMAT,
    MODEL_FILE,
    MTP_INPUTS,
    MTP_OUTPUTS,
    OUTPUT_POSITIONS,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    VERIFY_FILE,
    ExportedModel,
    backbone_inputs,
)
from dualend.train.data import stdlib_chunks

OPSET = 17  # ONNX Runtime 1.23 (Python 3.10, the Triton 24.10 container) runs it
WEIGHT_BITS = {"fp32": None, "int8": 8, "int4": 4, "w8a8": 8}  # weight_precision -> bits of a quantized weight
# w8a8: every weight at 8 bits per output column and activations at 8 bits per row, on ONNX's MatMulInteger
# (builder.quantize.quantize_per_channel); the others store GGUF's blocks for MatMulNBits
PER_CHANNEL_PRECISION = "w8a8"
# Its backbone's activations are smoothed (builder.quantize.smoothing) by the largest input of each product
# over this calibration text, the train split's (benchmarks.weight_precision scores the report split's).
CALIBRATION_SPLIT = "train"
CALIBRATION = {"text": f"stdlib {CALIBRATION_SPLIT} split", "chunks": 8, "tokens": 256, "seed": 0, "strength": 0.6}
QUANT_BLOCK_SIZE = 32  # weights along the input dimension that share one scale (GGUF's Q4_x and Q8_0 blocks)
# MatMulNBits accuracy_level 4: activations are quantized to int8 per block at run time, so the CPU
# multiplies on its integer dot-product units; ONNX Runtime's CPU kernels have no fast path on fp32
# activations for these weights (reports/weight_precision_nll.txt).
QUANT_ACCURACY_LEVEL = 4
# The MTP head's weights at 8 bits whatever the backbone's: they were trained here, on no 4-bit grid, and
# 4-bit blocks cost SmolLM2's draft head 0.032 of its kept drafts (0.469 -> 0.437) for no time its
# step could show (~1.0 ms either way; reports/draft_head_records/).
MTP_BITS = 8
# settings' backbone_graph of an export whose backbone is builder.fused_backbone's (its keys written in place)
# with its verifying graph beside it; "onnxruntime-kv-in-place" had no verifying graph, and "onnxruntime-fused",
# the graph before it, took the portable graph's tensors: such exports are redone)
FUSED_GRAPH = "onnxruntime-kv-in-place-with-verify"
FUSED_HEAD_MULTIPLE = 16  # ONNX Runtime's GroupQueryAttention (its rotary) takes heads of a multiple of 16; else the portable graph


class CompressorGraph(nn.Module):
    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        # tokens: [N, pair_size] -> latents [N, D]
        return self.model.latents(tokens)


class BackboneGraph(nn.Module):
    """Prefill chunks (S > 1) and decode steps (S >= 1) in one graph; logits and hidden states at the
    last min(S, OUTPUT_POSITIONS) positions only (a step that verifies a draft reads the position
    before the last too).

    The past comes as one keys and one values input per layer, [B, kv_heads, T, Dh], the layout
    attention reads, so the engine gets views of the KV cache and copies none of it.
    """

    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(self, latents, positions, new_valid, past_valid, *past):
        # latents: [B, S, D]; past: L keys then L values, each [B, kv_heads, T, Dh]
        layers = len(past) // 2
        hidden, keys, values = self.model.backbone(latents, positions, new_valid, list(past[:layers]),
                                                   list(past[layers:]), past_valid, last=OUTPUT_POSITIONS)
        # logits [B, n, V], hidden [B, n, D]; present: [L, B, kv_heads, S, Dh]
        return self.model.lm_head(hidden), hidden, keys, values


class MTPGraph(nn.Module):
    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(self, t1, hidden, positions, past_valid, past_keys, past_values):
        # t1: [B, S]; hidden: [B, S, D]; past_keys/values: [B, kv_heads, T, Dh]; S new positions (a
        # verified step adds one per accepted token), the draft from the last
        new_valid = torch.ones_like(t1, dtype=torch.bool)
        logits, confidence, keys, values = self.model.mtp_forward(
            t1, hidden, positions, new_valid, past_keys, past_values, past_valid, last=1)
        # present: [B, kv_heads, S, Dh] -> [1, B, kv_heads, S, Dh], the cache's [L, B, kv_heads, S, Dh]
        return logits[:, -1], confidence[:, -1], keys[None], values[None]


def _export(graph: nn.Module, args: tuple, path: Path, inputs, outputs, dynamic: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(graph.eval(), args, str(path), input_names=list(inputs),
                          output_names=list(outputs), dynamic_axes=dynamic, opset_version=OPSET,
                          dynamo=False)
    onnx.checker.check_model(str(path))


def _weights_beside(path: Path) -> None:
    """Moves the model's weights into `<file>.data` beside it. ONNX Runtime maps such a file into
    memory rather than copying it, so the compressor's embedding table (SmolLM2's: 113 MB, held by
    the compressor and by mtp_verify) is resident only for the pages its lookups read, and those
    pages are the kernel's to reclaim. Not the backbone's: every step reads all of its weights, and
    pre-packing copies them."""
    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    weights = path.with_name(path.name + ".data")
    if weights.exists():
        weights.chmod(path.stat().st_mode & 0o777)  # onnx creates it readable by its owner alone
    onnx.checker.check_model(str(path))


def weight_settings(weight_precision: str, head_dim: int) -> dict:
    """The settings that say how an export's backbone and MTP weights are stored, and which backbone
    graph holds them."""
    if weight_precision not in WEIGHT_BITS:
        raise ValueError(f"weight_precision {weight_precision!r}: expected one of {', '.join(WEIGHT_BITS)}")
    if weight_precision == "fp32":
        return {"weight_precision": weight_precision}
    graph = {"backbone_graph": FUSED_GRAPH} if head_dim % FUSED_HEAD_MULTIPLE == 0 else {}
    if weight_precision == PER_CHANNEL_PRECISION:
        return {"weight_precision": weight_precision, **graph,
                "weight_quantization": {"op": "MatMulInteger", "bits": 8, "rule": PER_CHANNEL_RULE,
                                        "lm_head_bits": 8, "mtp_bits": 8, "calibration": CALIBRATION}}
    return {"weight_precision": weight_precision, **graph,
            "weight_quantization": {"op": "MatMulNBits", "bits": WEIGHT_BITS[weight_precision],
                                    "block_size": QUANT_BLOCK_SIZE, "rule": QUANT_RULES[WEIGHT_BITS[weight_precision]],
                                    "lm_head_bits": LM_HEAD_BITS, "mtp_bits": MTP_BITS,
                                    "accuracy_level": QUANT_ACCURACY_LEVEL}}


def calibration_rows(checkpoint: Checkpoint, calibration: dict) -> torch.Tensor:
    """[chunks, tokens] token ids of the calibration text, BOS first, `tokens` a multiple of the pair size."""
    tokenizer, tokens = checkpoint.tokenizer, calibration["tokens"] - calibration["tokens"] % checkpoint.config.pair_size
    stream, rows = stdlib_chunks(CALIBRATION_SPLIT, chunk_chars=6 * tokens, seed=calibration["seed"]), []
    while len(rows) < calibration["chunks"]:
        ids = tokenizer.encode(next(stream))
        if len(ids) >= tokens - 1:
            rows.append([tokenizer.bos_id, *ids[:tokens - 1]])
    return torch.tensor(rows)


@torch.no_grad()
def input_peaks(model: LanguageModel, rows: torch.Tensor) -> dict[str, np.ndarray]:
    """builder.quantize.weight_key of each backbone product's weight, as the graphs store it ([K, N]), LM
    head included -> the largest |input| of each of its K inputs while the backbone reads `rows`."""
    peaks: dict[str, np.ndarray] = {}

    def record(weight: torch.Tensor, inputs: torch.Tensor) -> None:
        key = weight_key(weight.T.float().numpy())
        seen = inputs.abs().reshape(-1, inputs.shape[-1]).amax(0).float().numpy()
        peaks[key] = np.maximum(peaks[key], seen) if key in peaks else seen

    linears = [module for module in model.backbone.modules() if isinstance(module, nn.Linear)]
    hooks = [module.register_forward_pre_hook(lambda module, args: record(module.weight, args[0])) for module in linears]
    try:
        pair = model.cfg.pair_size
        latents = model.latents(rows.reshape(len(rows), -1, pair))
        positions = torch.arange(latents.shape[1]).repeat(len(rows), 1)
        hidden, _, _ = model.backbone(latents, positions, torch.ones(positions.shape, dtype=torch.bool))
        record(model.output_weight, hidden)
    finally:
        for hook in hooks:
            hook.remove()
    return peaks


def quantize_graph(path: Path, quantization: dict, vocab_size: int, bits: int | None = None,
                   peaks: dict[str, np.ndarray] | None = None) -> None:
    """The graph at `path` with its weights stored as `quantization` (an export's settings) says, at
    `bits` where given; `peaks` (input_peaks) smooth a per-channel rule's activations."""
    if quantization["op"] == "MatMulInteger":
        quantize_per_channel(path, peaks, quantization["calibration"]["strength"])
        return
    quantize_weights(path, bits or quantization["bits"], quantization["block_size"], quantization["accuracy_level"],
                     lm_head_outputs=vocab_size)


def settings_of(checkpoint: Checkpoint, weight_precision: str = "fp32") -> dict:
    cfg = checkpoint.config
    return {"d_model": cfg.d_model, "vocab_size": cfg.vocab_size, "pair_size": cfg.pair_size,
            "pad_id": cfg.pad_id, "bos_id": cfg.bos_id, "eos_id": cfg.eos_id,
            "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "export_format": EXPORT_FORMAT} | weight_settings(weight_precision, cfg.head_dim)


def export_matches(exported: ExportedModel, checkpoint: Checkpoint, weight_precision: str = "fp32") -> bool:
    """Whether `exported` is what export_checkpoint(checkpoint, ..., weight_precision) would write:
    the checkpoint id covers weights and config; the tokenizer config travels beside them; the weight
    settings say how the weights were stored (an export from before they existed is fp32)."""
    settings = {"weight_precision": "fp32"} | exported.settings
    wanted = weight_settings(weight_precision, checkpoint.config.head_dim)
    return (exported.checkpoint_id == checkpoint.id and exported.tokenizer().config == checkpoint.tokenizer.config
            and all(settings.get(key) == wanted.get(key) for key in {*wanted, "backbone_graph"}))


def write_backbone(model: LanguageModel, path: Path, fused: bool) -> None:
    """The backbone, its LM head included, at `path`: builder.fused_backbone's graph for ONNX Runtime
    (`fused`: its keys and values written into the cache in place), else torch's portable one."""
    if fused:
        write_backbone_graph(model, path)
        return
    cfg = model.cfg
    batch, new, past = 2, 3, 4
    cache = torch.randn(batch, cfg.kv_heads, past, cfg.head_dim)
    example = (torch.randn(batch, new, cfg.d_model), torch.arange(past, past + new).repeat(batch, 1),
               torch.ones(batch, new, dtype=torch.bool), torch.ones(batch, past, dtype=torch.bool),
               *[cache.clone() for _ in range(2 * cfg.n_layers)])
    inputs = backbone_inputs(cfg.n_layers)
    dynamic = {name: {0: "batch", 1: "new"} for name in inputs[:3]}
    dynamic |= {"past_valid": {0: "batch", 1: "past"}} | {name: {0: "batch", 2: "past"} for name in inputs[4:]}
    dynamic |= {"logits": {0: "batch", 1: "outputs"}, "hidden": {0: "batch", 1: "outputs"},
                "present_keys": {1: "batch", 3: "new"}, "present_values": {1: "batch", 3: "new"}}
    _export(BackboneGraph(model), example, path, inputs, BACKBONE_OUTPUTS, dynamic)


def export_checkpoint(checkpoint: Checkpoint, out: Path, weight_precision: str = "fp32") -> str:
    model, cfg = checkpoint.model.eval(), checkpoint.config
    ckpt_id, settings = checkpoint.id, settings_of(checkpoint, weight_precision)
    if out.exists():
        shutil.rmtree(out)
    kv_heads, head_dim, dim = cfg.kv_heads, cfg.head_dim, cfg.d_model

    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / TOKENIZER_FILE).write_text(checkpoint.tokenizer.to_json(), encoding="utf-8")
    tokenizer_config = checkpoint.tokenizer.config_json()
    if tokenizer_config is not None:  # hashed by the manifest with tokenizer.json
        (out / "tokenizer" / TOKENIZER_CONFIG_FILE).write_text(tokenizer_config, encoding="utf-8")
    write_manifest(out / "tokenizer", ckpt_id, "tokenizer", "tokenizers-json", settings)

    tokens = torch.randint(3, cfg.vocab_size, (5, cfg.pair_size))
    _export(CompressorGraph(model), (tokens,), out / "compressor" / MODEL_FILE, ["tokens"], ["latents"],
            {"tokens": {0: "pairs"}, "latents": {0: "pairs"}})
    _weights_beside(out / "compressor" / MODEL_FILE)
    write_manifest(out / "compressor", ckpt_id, "compressor", "onnx", settings)

    quantization, fused = settings.get("weight_quantization"), settings.get("backbone_graph") == FUSED_GRAPH
    backbone_graphs = [out / "backbone" / MODEL_FILE] + ([out / "backbone" / VERIFY_FILE] if fused else [])
    write_backbone(model, backbone_graphs[0], fused=fused)
    if fused:
        write_backbone_graph(model, backbone_graphs[1], verify=True)
    if quantization:
        peaks = (input_peaks(model, calibration_rows(checkpoint, quantization["calibration"]))
                 if "calibration" in quantization else None)
        for path in backbone_graphs:
            quantize_graph(path, quantization, cfg.vocab_size, peaks=peaks)
    write_manifest(out / "backbone", ckpt_id, "backbone", "onnx", settings)

    if cfg.has_mtp:
        batch, past = 2, 4
        cache = torch.randn(batch, kv_heads, past, head_dim)
        example = (torch.randint(3, cfg.vocab_size, (batch, 2)), torch.randn(batch, 2, dim),
                   torch.arange(past, past + 2).repeat(batch, 1), torch.ones(batch, past, dtype=torch.bool), cache,
                   cache.clone())
        dynamic = {"t1": {0: "batch", 1: "new"}, "hidden": {0: "batch", 1: "new"}, "positions": {0: "batch", 1: "new"},
                   "past_valid": {0: "batch", 1: "past"}, "past_keys": {0: "batch", 2: "past"},
                   "past_values": {0: "batch", 2: "past"}, "logits": {0: "batch"}, "confidence": {0: "batch"},
                   "present_keys": {1: "batch", 3: "new"}, "present_values": {1: "batch", 3: "new"}}
        _export(MTPGraph(model), example, out / "mtp" / MODEL_FILE, MTP_INPUTS, MTP_OUTPUTS, dynamic)
        if quantization:
            quantize_graph(out / "mtp" / MODEL_FILE, quantization, cfg.vocab_size, bits=quantization["mtp_bits"])
        write_manifest(out / "mtp", ckpt_id, "mtp", "onnx", settings)
    return ckpt_id


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--weight-precision", choices=list(WEIGHT_BITS), default="fp32")
    args = parser.parse_args(argv)
    ckpt_id = export_checkpoint(load_checkpoint(args.checkpoint), Path(args.out), args.weight_precision)
    print(f"exported checkpoint {ckpt_id} ({args.weight_precision} weights) -> {args.out}")


if __name__ == "__main__":
    main()
