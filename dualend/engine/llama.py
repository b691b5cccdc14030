"""Llama-family checkpoints (Llama, SmolLM, Qwen2) in Hugging Face naming -> `ModelConfig` and our
state dict; importers read their format into these names and call these two functions.

    cfg = config_from_hf(json.loads(Path("config.json").read_text()), pad_id=0)
    model = LanguageModel(cfg)
    model.load_state_dict(state_dict_from_hf(tensors, cfg))

What the model code does not implement (biased output or MLP projections, scaled or partial RoPE,
sliding windows, another activation) is refused here, by name, rather than loaded and run wrong.
"""
from __future__ import annotations

import torch

from .model import ModelConfig

ARCHITECTURES = {"llama": False, "qwen2": True}  # model_type -> q/k/v carry a bias
_LAYER_PREFIX = "model.layers."


def config_from_hf(hf_config: dict, pad_id: int) -> ModelConfig:
    """A token-level `ModelConfig` (pair_size 1) from a Hugging Face config.json dict; `pad_id` is
    the id our PAD gets (Llama checkpoints have none of their own)."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not one of the Llama family ({', '.join(ARCHITECTURES)})")
    refused = {"hidden_act": hf_config.get("hidden_act", "silu") != "silu",
               "attention_bias": bool(hf_config.get("attention_bias")),
               "mlp_bias": bool(hf_config.get("mlp_bias")),
               "use_sliding_window": bool(hf_config.get("use_sliding_window"))}
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    refused[f"rope_type {rope_type}"] = rope_type != "default"
    refused["partial_rotary_factor"] = rope.get("partial_rotary_factor", 1.0) != 1.0
    unsupported = [name for name, bad in refused.items() if bad]
    if unsupported:
        raise ValueError(f"{model_type} checkpoint uses what the model code does not implement: "
                         f"{', '.join(unsupported)}")
    bos, eos = hf_config.get("bos_token_id"), hf_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if bos is None or eos is None:
        raise ValueError(f"the config names no {'bos_token_id' if bos is None else 'eos_token_id'}")
    d_model, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or d_model // heads
    return ModelConfig(
        vocab_size=hf_config["vocab_size"], pad_id=pad_id, bos_id=bos, eos_id=eos, pair_size=1,
        d_model=d_model, n_layers=hf_config["num_hidden_layers"], n_heads=heads,
        ffn_hidden=hf_config["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))),
        n_kv_heads=0 if kv_heads == heads else kv_heads,
        head_size=0 if head_dim == d_model // heads else head_dim,
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=ARCHITECTURES[model_type])


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` holds, in Hugging Face names."""
    dim, q_size, kv_size = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, dim), "model.norm.weight": (dim,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, dim)
    for i in range(cfg.n_layers):
        p = f"{_LAYER_PREFIX}{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q_size, dim), p + "self_attn.k_proj.weight": (kv_size, dim),
                   p + "self_attn.v_proj.weight": (kv_size, dim), p + "self_attn.o_proj.weight": (dim, q_size),
                   p + "mlp.gate_proj.weight": (cfg.ffn_hidden, dim), p + "mlp.up_proj.weight": (cfg.ffn_hidden, dim),
                   p + "mlp.down_proj.weight": (dim, cfg.ffn_hidden),
                   p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,)}
        if cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_size,), p + "self_attn.k_proj.bias": (kv_size,),
                       p + "self_attn.v_proj.bias": (kv_size,)}
    return shapes


def state_dict_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our names (embedding, backbone, output) from Hugging Face Llama names, in float32.

    Fails naming every unknown, missing or wrongly shaped tensor. A tied checkpoint may still carry
    `lm_head.weight` (Hugging Face's state_dict() does), but only as a copy of the embedding. For a
    dual-end `cfg` the compressor, MTP and confidence heads are not in the result.
    """
    expected = _expected_shapes(cfg)
    tensors = {name: t for name, t in tensors.items() if not name.endswith("rotary_emb.inv_freq")}
    tied_copy = cfg.tie_embeddings and "lm_head.weight" in tensors
    embedding = tensors.get("model.embed_tokens.weight")
    if tied_copy and embedding is not None and not torch.equal(tensors["lm_head.weight"], embedding):
        raise ValueError("lm_head.weight differs from model.embed_tokens.weight, but the config ties them "
                         "(tie_word_embeddings)")
    problems = [f"unknown tensor {name}" for name in tensors
                if name not in expected and not (tied_copy and name == "lm_head.weight")]
    problems += [f"missing tensor {name}" for name in expected if name not in tensors]
    problems += [f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}"
                 for name, shape in expected.items() if name in tensors and tuple(tensors[name].shape) != shape]
    if problems:
        raise ValueError("checkpoint does not fit the config: " + "; ".join(problems))

    def get(name: str) -> torch.Tensor:
        return tensors[name].to(torch.float32)

    state = {"embedding.weight": get("model.embed_tokens.weight"), "backbone.norm.weight": get("model.norm.weight")}
    if not cfg.tie_embeddings:
        state["output.weight"] = get("lm_head.weight")
    for i in range(cfg.n_layers):
        hf, ours = f"{_LAYER_PREFIX}{i}.", f"backbone.layers.{i}."
        attn = [hf + f"self_attn.{proj}_proj" for proj in "qkv"]
        state[ours + "attn.qkv.weight"] = torch.cat([get(name + ".weight") for name in attn])  # rows: q, k, v
        if cfg.qkv_bias:
            state[ours + "attn.qkv.bias"] = torch.cat([get(name + ".bias") for name in attn])
        state[ours + "attn.out.weight"] = get(hf + "self_attn.o_proj.weight")
        state[ours + "ffn.gate_up.weight"] = torch.cat([get(hf + "mlp.gate_proj.weight"),
                                                        get(hf + "mlp.up_proj.weight")])  # rows: gate, up
        state[ours + "ffn.down.weight"] = get(hf + "mlp.down_proj.weight")
        state[ours + "attn_norm.weight"] = get(hf + "input_layernorm.weight")
        state[ours + "ffn_norm.weight"] = get(hf + "post_attention_layernorm.weight")
    return state
