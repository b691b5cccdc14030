"""The backbone graph written node by node for ONNX Runtime, with its fused operators.

`torch.onnx.export` of the backbone gives a portable graph (the reference, and TensorRT's input), but
much of it is shape arithmetic that a dynamic batch and length keep alive, and at one sequence a
step's time goes as much to running nodes as to reading weights. This graph computes the same
function with one RotaryEmbedding for the queries and one for the keys, FusedMatMul (a scaled product
by a transposed operand, no copy of the past), SkipSimplifiedLayerNormalization (the residual add and
the next RMSNorm in one), shapes that are constants, and the attention mask built once per call:
SmolLM2's has 1,019 nodes after ONNX Runtime's optimizations against the portable graph's 2,141 (int4:
1,499 against 2,621; reports/fused_backbone/).

Same inputs and outputs as the portable graph (`dualend.engine.onnx_engine.backbone_inputs`,
`BACKBONE_OUTPUTS`), so the engine runs either. Only ONNX Runtime runs it (com.microsoft operators);
quantized exports, which only ONNX Runtime runs anyway, use it.

Grouped-query attention as the model code does it: each key/value head's queries as one longer
query [B, kv_heads, groups * S, Dh], so the past is read as it is, never repeated.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from dualend.engine.model import LanguageModel, rotary
from dualend.engine.onnx_engine import OUTPUT_POSITIONS, backbone_inputs

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

    def activation(self, name: str, width: int) -> str:
        self.shapes.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "new", width]))
        return name

    def linear(self, source: str, weight: np.ndarray, name: str, bias: np.ndarray | None = None) -> str:
        """source [B, S, K] @ weight.T, weight [N, K] as torch stores it."""
        out = self.node("MatMul", [source, self.weight(f"{name}.weight", weight.T)],
                        [self.activation(name if bias is None else f"{name}_unbiased", weight.shape[0])])
        if bias is not None:
            out = self.node("Add", [out, self.weight(f"{name}.bias", bias)], [self.activation(name, weight.shape[0])])
        return out


def _attention_bias(g: _Graph, groups: int) -> tuple[str, str]:
    """The additive mask [B, 1, groups * S, T + S] of `model.attention_mask` (query s sees valid past
    slots and valid new slots <= s, and itself), each query row repeated per group; and the split
    sizes [T, S] of a row of scores into past and new."""
    one, zero = g.weight("one", np.array(1, np.int64)), g.weight("zero", np.array(0, np.int64))
    axis0, axis1 = g.weight("axis0", np.array([0], np.int64)), g.weight("axis1", np.array([1], np.int64))
    new = g.node("Gather", [g.node("Shape", ["new_valid"], ["new_shape"]), one], ["new_len"], axis=0)
    past = g.node("Gather", [g.node("Shape", ["past_valid"], ["past_shape"]), one], ["past_len"], axis=0)
    index = g.node("Range", [zero, new, one], ["new_index"])
    column, row = (g.node("Unsqueeze", [index, axis1], ["new_index_column"]),
                   g.node("Unsqueeze", [index, axis0], ["new_index_row"]))
    causal = g.node("And", [g.node("GreaterOrEqual", [column, row], ["causal"]),
                            g.node("Unsqueeze", ["new_valid", axis1], ["new_valid_row"])], ["causal_valid"])
    new_part = g.node("Or", [causal, g.node("Equal", [column, row], ["own"])], ["new_part"])  # [B, S, S]
    batch_new = g.node("Slice", [g.node("Shape", [new_part], ["new_part_shape"]), axis0,
                                 g.weight("two", np.array([2], np.int64)), axis0], ["batch_new"])
    past_1 = g.node("Unsqueeze", [past, axis0], ["past_len_1"])
    past_part = g.node("Expand", [g.node("Unsqueeze", ["past_valid", axis1], ["past_valid_row"]),
                                  g.node("Concat", [batch_new, past_1], ["past_part_shape"], axis=0)], ["past_part"])
    mask = g.node("Tile", [g.node("Concat", [past_part, new_part], ["mask"], axis=-1),
                           g.weight("group_tiles", np.array([1, groups, 1], np.int64))], ["grouped_mask"])
    bias = g.node("Where", [mask, g.weight("visible", np.array(0, np.float32)),
                            g.weight("hidden_slot", np.array(-np.inf, np.float32))], ["bias_3d"])
    split = g.node("Concat", [past_1, g.node("Unsqueeze", [new, axis0], ["new_len_1"])], ["past_new_split"], axis=0)
    return g.node("Unsqueeze", [bias, axis1], ["attention_bias"]), split


def _rms_norm(g: _Graph, source: str, weight: np.ndarray, eps: float, name: str) -> str:
    """x / sqrt(mean(x^2) + eps) * w, in the form ONNX Runtime fuses into SimplifiedLayerNormalization."""
    squared = g.node("Pow", [source, g.weight("square", np.array(2, np.float32))], [f"{name}_squared"])
    mean = g.node("ReduceMean", [squared], [f"{name}_mean"], axes=[-1], keepdims=1)
    root = g.node("Sqrt", [g.node("Add", [mean, g.weight(f"{name}_eps", np.array(eps, np.float32))],
                                  [f"{name}_plus_eps"])], [f"{name}_root"])
    normed = g.node("Div", [source, root], [f"{name}_normed"])
    return g.node("Mul", [normed, g.weight(f"{name}.weight", weight)], [g.activation(name, len(weight))])


def write_backbone_graph(model: LanguageModel, path: Path) -> None:
    """The backbone of `model` (its LM head included) as a graph for ONNX Runtime at `path`."""
    cfg = model.cfg
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    dim, heads, kv_heads, head_dim, layers = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.n_layers
    groups, names = heads // kv_heads, backbone_inputs(cfg.n_layers)
    g = _Graph()
    with torch.no_grad():  # model.rotary's angles for every position index: [1, 1, positions, Dh/2]
        cos, sin = rotary(torch.arange(ROTARY_POSITIONS)[None], cfg)
    g.weight("cos_table", cos[0, 0].numpy())
    g.weight("sin_table", sin[0, 0].numpy())
    bias, past_new_split = _attention_bias(g, groups)
    q_shape, kv_shape = (g.weight("q_heads", np.array([0, 0, heads, head_dim], np.int64)),
                         g.weight("kv_heads", np.array([0, 0, kv_heads, head_dim], np.int64)))
    grouped, ungrouped = (g.weight("grouped", np.array([0, kv_heads, -1, head_dim], np.int64)),
                          g.weight("ungrouped", np.array([0, heads, -1, head_dim], np.int64)))
    flat = g.weight("flat_heads", np.array([0, 0, heads * head_dim], np.int64))
    qkv_split = g.weight("qkv_split", np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))
    ffn_split = g.weight("ffn_split", np.array([cfg.ffn_hidden, cfg.ffn_hidden], np.int64))
    axis0, axis1 = g.weight("axis0", np.array([0], np.int64)), g.weight("axis1", np.array([1], np.int64))
    scale = float(head_dim ** -0.5)

    stream = "latents"  # the residual stream between layers
    normed = _rms_norm(g, stream, state["backbone.layers.0.attn_norm.weight"], cfg.norm_eps, "layer0_attn_norm")
    keys, values = [], []
    for i in range(layers):
        p, n = f"backbone.layers.{i}.", f"layer{i}"
        qkv = g.linear(normed, state[p + "attn.qkv.weight"], f"{n}_qkv", state.get(p + "attn.qkv.bias"))
        q, k, v = g.node("Split", [qkv, qkv_split], [f"{n}_q", f"{n}_k", f"{n}_v"], axis=-1)
        q = g.node("RotaryEmbedding", [q, "positions", "cos_table", "sin_table"], [f"{n}_q_rotated"],
                   domain="com.microsoft", num_heads=heads, interleaved=0)
        k = g.node("RotaryEmbedding", [k, "positions", "cos_table", "sin_table"], [f"{n}_k_rotated"],
                   domain="com.microsoft", num_heads=kv_heads, interleaved=0)
        q = g.node("Reshape", [g.node("Transpose", [g.node("Reshape", [q, q_shape], [f"{n}_q_heads"])],
                                      [f"{n}_q_bnsh"], perm=[0, 2, 1, 3]), grouped], [f"{n}_q_grouped"])
        k, v = (g.node("Transpose", [g.node("Reshape", [x, kv_shape], [f"{n}_{kind}_heads"])], [f"{n}_present_{kind}"],
                       perm=[0, 2, 1, 3]) for x, kind in ((k, "k"), (v, "v")))
        keys.append(k)
        values.append(v)
        scores = g.node("Concat", [
            g.node("FusedMatMul", [q, keys_in], [f"{n}_{part}_scores"], domain="com.microsoft", transB=1, alpha=scale)
            for keys_in, part in ((names[4 + i], "past"), (k, "new"))],
            [f"{n}_scores"], axis=-1)
        probs = g.node("Softmax", [g.node("Add", [scores, bias], [f"{n}_masked_scores"])], [f"{n}_probs"], axis=-1)
        past_probs, new_probs = g.node("Split", [probs, past_new_split], [f"{n}_past_probs", f"{n}_new_probs"], axis=-1)
        attended = g.node("Add", [g.node("MatMul", [past_probs, names[4 + layers + i]], [f"{n}_from_past"]),
                                  g.node("MatMul", [new_probs, v], [f"{n}_from_new"])], [f"{n}_attended"])
        attended = g.node("Transpose", [g.node("Reshape", [attended, ungrouped], [f"{n}_attended_heads"])],
                          [f"{n}_attended_bshd"], perm=[0, 2, 1, 3])
        attended = g.node("Reshape", [attended, flat], [g.activation(f"{n}_attention", heads * head_dim)])
        out = g.linear(attended, state[p + "attn.out.weight"], f"{n}_attn_out")
        ffn_in, mid = g.activation(f"{n}_ffn_norm", dim), g.activation(f"{n}_mid", dim)  # mid: stream + attention
        ffn_norm = g.weight(f"{n}_ffn_norm.weight", state[p + "ffn_norm.weight"])
        g.node("SkipSimplifiedLayerNormalization", [out, stream, ffn_norm], [ffn_in, "", "", mid],
               domain="com.microsoft", epsilon=cfg.norm_eps)
        gate, up = g.node("Split", [g.linear(ffn_in, state[p + "ffn.gate_up.weight"], f"{n}_gate_up"), ffn_split],
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
    g.node("Slice", [normed, g.weight("last_positions", np.array([-OUTPUT_POSITIONS], np.int64)),
                     g.weight("to_the_end", np.array([np.iinfo(np.int64).max], np.int64)), axis1],
           [g.activation("hidden", dim)])
    head = state["embedding.weight"] if cfg.tie_embeddings else state["output.weight"]
    g.node("MatMul", ["hidden", g.weight("lm_head.weight", head.T)], ["logits"])
    g.node("Concat", [g.node("Unsqueeze", [k, axis0], [f"{k}_stacked"]) for k in keys], ["present_keys"], axis=0)
    g.node("Concat", [g.node("Unsqueeze", [v, axis0], [f"{v}_stacked"]) for v in values], ["present_values"], axis=0)

    def tensor(name, kind, shape):
        return helper.make_tensor_value_info(name, kind, shape)
    inputs = [tensor("latents", TensorProto.FLOAT, ["batch", "new", dim]),
              tensor("positions", TensorProto.INT64, ["batch", "new"]),
              tensor("new_valid", TensorProto.BOOL, ["batch", "new"]),
              tensor("past_valid", TensorProto.BOOL, ["batch", "past"])]
    inputs += [tensor(name, TensorProto.FLOAT, ["batch", kv_heads, "past", head_dim]) for name in names[4:]]
    outputs = [tensor("logits", TensorProto.FLOAT, ["batch", "outputs", cfg.vocab_size]),
               tensor("hidden", TensorProto.FLOAT, ["batch", "outputs", dim]),
               tensor("present_keys", TensorProto.FLOAT, [layers, "batch", kv_heads, "new", head_dim]),
               tensor("present_values", TensorProto.FLOAT, [layers, "batch", kv_heads, "new", head_dim])]
    graph = helper.make_graph(g.nodes, "backbone", inputs, outputs, g.weights, value_info=g.shapes)
    model_proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                          helper.make_opsetid("com.microsoft", 1)])
    model_proto.ir_version = 8  # what ONNX Runtime 1.23 (the Triton container's) reads
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model_proto, str(path))
    onnx.checker.check_model(str(path))
