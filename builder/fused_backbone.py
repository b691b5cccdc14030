"""The backbone graph written node by node for ONNX Runtime, with its fused operators.

`torch.onnx.export` of the backbone gives a portable graph (the reference, and TensorRT's input), but
much of it is shape arithmetic that a dynamic batch and length keep alive, and at one sequence a
step's time goes as much to running nodes as to reading weights. This graph computes the same
function with one GroupQueryAttention a layer (RoPE, grouped-query attention over the past and the
causal mask in one operator, reading the past where it is and writing the new keys and values into
the same buffer: the cache is updated in place, `dualend.engine.onnx_engine.in_place_backbone_inputs`),
SkipSimplifiedLayerNormalization (the residual add and the next RMSNorm in one) and every latent of
the batch a row of its own between the attentions ([B * S, width]: the quantizer's 4-bit corrections
are one Gemm each). SmolLM2's int4 backbone runs 609 nodes after ONNX Runtime's optimizations
against the portable graph's 2,501 (reports/fused_backbone/).

Only ONNX Runtime runs it (com.microsoft operators); quantized exports, which only ONNX Runtime runs
anyway, use it where GroupQueryAttention takes the head size (builder.export.FUSED_HEAD_MULTIPLE).
GroupQueryAttention takes several new latents after a past for one sequence a call only, and rounds
the first of two latents otherwise than a one-latent call does; the verifying graph (`verify=True`, beside
the export's backbone as VERIFY_FILE) therefore runs one GroupQueryAttention a latent, the second reading
what the first wrote, for any number of rows (`BackboneRunner` uses it for every two-latent call).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from dualend.engine.model import LanguageModel, rotary
from dualend.engine.onnx_engine import (
    OUTPUT_POSITIONS,
    VERIFY_LATENTS,
    in_place_backbone_inputs,
    in_place_backbone_outputs,
    in_place_verify_outputs,
)

# RoPE angles are a table indexed by position (pair index): this many rows (8 MB for SmolLM2's head
# size). A deployment whose sequences could go further is refused when assembled.
ROTARY_POSITIONS = 32768
OPSET = 17


class _Graph:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self.names: set[str] = set()
        self.shapes: list[onnx.ValueInfoProto] = []  # the projections' inputs: the quantizer reads their rank

    def weight(self, name: str, array: np.ndarray) -> str:
        """A stored tensor; a name already given is that tensor."""
        if name not in self.names:
            self.names.add(name)
            self.weights.append(numpy_helper.from_array(np.require(array, requirements="C"), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], **attributes) -> str | list[str]:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=f"{op}_{len(self.nodes)}", **attributes))
        return outputs[0] if len(outputs) == 1 else outputs

    def activation(self, name: str, width: int, rows: tuple[str, ...] = ("tokens",)) -> str:
        """A value's name, with its shape recorded: [tokens, width] (every latent of the batch a row)
        unless `rows` says otherwise."""
        self.shapes.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [*rows, width]))
        return name

    def linear(self, source: str, weight: np.ndarray, name: str, bias: np.ndarray | None = None) -> str:
        """source [B, S, K] @ weight.T, weight [N, K] as torch stores it."""
        out = self.node("MatMul", [source, self.weight(f"{name}.weight", weight.T)],
                        [self.activation(name if bias is None else f"{name}_unbiased", weight.shape[0])])
        if bias is not None:
            out = self.node("Add", [out, self.weight(f"{name}.bias", bias)], [self.activation(name, weight.shape[0])])
        return out


def _rms_norm(g: _Graph, source: str, weight: np.ndarray, eps: float, name: str) -> str:
    """x / sqrt(mean(x^2) + eps) * w, in the form ONNX Runtime fuses into SimplifiedLayerNormalization."""
    squared = g.node("Pow", [source, g.weight("square", np.array(2, np.float32))], [f"{name}_squared"])
    mean = g.node("ReduceMean", [squared], [f"{name}_mean"], axes=[-1], keepdims=1)
    root = g.node("Sqrt", [g.node("Add", [mean, g.weight(f"{name}_eps", np.array(eps, np.float32))],
                                  [f"{name}_plus_eps"])], [f"{name}_root"])
    normed = g.node("Div", [source, root], [f"{name}_normed"])
    return g.node("Mul", [normed, g.weight(f"{name}.weight", weight)], [g.activation(name, len(weight))])


def write_backbone_graph(model: LanguageModel, path: Path, verify: bool = False) -> None:
    """The backbone of `model` (its LM head included) as a graph for ONNX Runtime at `path`, with the
    inputs and outputs of `dualend.engine.onnx_engine.in_place_backbone_inputs` / `_outputs`; with
    `verify`, the verifying graph (VERIFY_LATENTS latents a row, `in_place_verify_outputs`)."""
    cfg = model.cfg
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    dim, heads, kv_heads, head_dim, layers = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.n_layers
    inputs = in_place_backbone_inputs(layers)
    outputs = in_place_verify_outputs(layers) if verify else in_place_backbone_outputs(layers)
    past_keys, past_values = inputs[3:3 + layers], inputs[3 + layers:]
    present_keys, present_values = outputs[2:2 + layers], outputs[2 + layers:2 + 2 * layers]
    verified_keys, verified_values = outputs[2 + 2 * layers:2 + 3 * layers], outputs[2 + 3 * layers:]
    g = _Graph()
    with torch.no_grad():  # model.rotary's angles for every position index: [1, 1, positions, Dh/2]
        cos, sin = rotary(torch.arange(ROTARY_POSITIONS)[None], cfg)
    g.weight("cos_table", cos[0, 0].numpy())
    g.weight("sin_table", sin[0, 0].numpy())

    # Between the attentions every latent is a row of its own: [B * S, width] (2-D products; the
    # quantizer's 4-bit corrections are then one Gemm each). The attention reads [B, S, width].
    rows = g.weight("token_rows", np.array([-1, dim], np.int64))
    batch_new = g.node("Slice", [g.node("Shape", ["latents"], ["latents_shape"]), g.weight("zero_1", np.array([0], np.int64)),
                                 g.weight("two_1", np.array([2], np.int64))], ["batch_new"])
    qkv_width = (heads + 2 * kv_heads) * head_dim
    per_sequence = g.node("Concat", [batch_new, g.weight("qkv_width", np.array([qkv_width], np.int64))],
                          ["qkv_sequence_shape"], axis=0)
    attention_rows = g.weight("attention_rows", np.array([-1, heads * head_dim], np.int64))
    stream = g.node("Reshape", ["latents", rows], [g.activation("latent_rows", dim)])  # the residual stream between layers
    normed = _rms_norm(g, stream, state["backbone.layers.0.attn_norm.weight"], cfg.norm_eps, "layer0_attn_norm")
    def attention(qkv: str, past: tuple[str, str], present: tuple[str, str], seqlens: str, total: str, name: str) -> str:
        return g.node("GroupQueryAttention", [qkv, "", "", *past, seqlens, total, "cos_table", "sin_table"],
                      [name, *present], domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads,
                      do_rotary=1, rotary_interleaved=0, scale=float(head_dim ** -0.5))[0]

    if verify:  # the first latent's attention: one slot less in every row, the longest row one shorter
        one = g.weight("one_int32", np.array(1, np.int32))
        first_seqlens = g.node("Sub", ["seqlens_k", one], ["first_seqlens_k"])
        first_total = g.node("Sub", ["total_sequence_length", one], ["first_total_sequence_length"])
    for i in range(layers):
        p, n = f"backbone.layers.{i}.", f"layer{i}"
        qkv = g.linear(normed, state[p + "attn.qkv.weight"], f"{n}_qkv", state.get(p + "attn.qkv.bias"))
        qkv = g.node("Reshape", [qkv, per_sequence], [g.activation(f"{n}_qkv_sequences", qkv_width, ("batch", "new"))])
        if verify:
            latent_qkv = g.node("Split", [qkv], [f"{n}_qkv_latent{j}" for j in range(VERIFY_LATENTS)], axis=1)
            first = attention(latent_qkv[0], (past_keys[i], past_values[i]), (present_keys[i], present_values[i]),
                              first_seqlens, first_total, f"{n}_attended_first")
            second = attention(latent_qkv[1], (present_keys[i], present_values[i]),
                               (verified_keys[i], verified_values[i]), "seqlens_k", "total_sequence_length",
                               f"{n}_attended_second")
            attended = g.node("Concat", [first, second], [f"{n}_attended"], axis=1)
        else:
            attended = attention(qkv, (past_keys[i], past_values[i]), (present_keys[i], present_values[i]),
                                 "seqlens_k", "total_sequence_length", f"{n}_attended")
        attended = g.node("Reshape", [attended, attention_rows], [g.activation(f"{n}_attention", heads * head_dim)])
        out = g.linear(attended, state[p + "attn.out.weight"], f"{n}_attn_out")
        ffn_in, mid = g.activation(f"{n}_ffn_norm", dim), g.activation(f"{n}_mid", dim)  # mid: stream + attention
        ffn_norm = g.weight(f"{n}_ffn_norm.weight", state[p + "ffn_norm.weight"])
        g.node("SkipSimplifiedLayerNormalization", [out, stream, ffn_norm], [ffn_in, "", "", mid],
               domain="com.microsoft", epsilon=cfg.norm_eps)
        gate, up = g.node("Split", [g.linear(ffn_in, state[p + "ffn.gate_up.weight"], f"{n}_gate_up"),
                                    g.weight("ffn_split", np.array([cfg.ffn_hidden, cfg.ffn_hidden], np.int64))],
                          [f"{n}_gate", f"{n}_up"], axis=-1)
        silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], [f"{n}_gate_sigmoid"])], [f"{n}_silu"])
        down = g.linear(g.node("Mul", [silu, up], [g.activation(f"{n}_ffn_hidden", cfg.ffn_hidden)]),
                        state[p + "ffn.down.weight"], f"{n}_down")
        last = i == layers - 1
        next_norm = state["backbone.norm.weight" if last else f"backbone.layers.{i + 1}.attn_norm.weight"]
        normed = g.activation("final_norm" if last else f"layer{i + 1}_attn_norm", dim)
        stream = g.activation(f"{n}_out", dim)
        g.node("SkipSimplifiedLayerNormalization", [down, mid, g.weight(f"{normed}.weight", next_norm)],
               [normed, "", "", stream], domain="com.microsoft", epsilon=cfg.norm_eps)
    sequences = g.node("Reshape", [normed, g.node("Concat", [batch_new, g.weight("width", np.array([dim], np.int64))],
                                                  ["sequence_shape"], axis=0)],
                       [g.activation("final_norm_sequences", dim, ("batch", "new"))])
    g.node("Slice", [sequences, g.weight("last_positions", np.array([-OUTPUT_POSITIONS], np.int64)),
                     g.weight("to_the_end", np.array([np.iinfo(np.int64).max], np.int64)),
                     g.weight("axis1", np.array([1], np.int64))],
           [g.activation("hidden", dim, ("batch", "outputs"))])
    head = state["embedding.weight"] if cfg.tie_embeddings else state["output.weight"]
    g.node("MatMul", ["hidden", g.weight("lm_head.weight", head.T)], ["logits"])

    def tensor(name, kind, shape):
        return helper.make_tensor_value_info(name, kind, shape)
    cache = ["batch", kv_heads, "slots", head_dim]  # past and present: one buffer, written in place
    graph_inputs = [tensor("latents", TensorProto.FLOAT, ["batch", "new", dim]),
                    tensor("seqlens_k", TensorProto.INT32, ["batch"]),
                    tensor("total_sequence_length", TensorProto.INT32, [])]
    graph_inputs += [tensor(name, TensorProto.FLOAT, cache) for name in past_keys + past_values]
    graph_outputs = [tensor("logits", TensorProto.FLOAT, ["batch", "outputs", cfg.vocab_size]),
                     tensor("hidden", TensorProto.FLOAT, ["batch", "outputs", dim])]
    graph_outputs += [tensor(name, TensorProto.FLOAT, cache)
                      for name in present_keys + present_values + verified_keys + verified_values]
    graph = helper.make_graph(g.nodes, "backbone", graph_inputs, graph_outputs, g.weights, value_info=g.shapes)
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                          helper.make_opsetid("com.microsoft", 1)])
    model_proto.ir_version = 8  # what ONNX Runtime 1.23 (the Triton container's) reads
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model_proto, str(path))
    onnx.checker.check_model(str(path))
