"""The model code covers the Llama family: grouped-query attention, head dim, RoPE base, norm eps,
tied or separate output matrix, Qwen2's q/k/v bias. Checked against transformers' own models, which
nobody here wrote, at the logits: in torch with and without a past, on ONNX Runtime after export,
and the shipped baseline as a LlamaForCausalLM."""
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from builder.export import export_checkpoint
from dualend.engine.checkpoint import Checkpoint, load_checkpoint
from dualend.engine.decode import SamplingParams
from dualend.engine.llama import config_from_hf, state_dict_from_hf
from dualend.engine.model import LanguageModel, ModelConfig
from dualend.engine.onnx_engine import OnnxComponents
from dualend.engine.reference import TorchBatch, TorchComponents, generate_batch, reference_text
from test_batch_loop import PROMPTS, make_loop, run_until_idle, submit

HF = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
CASES = {  # name: (model_type, tie_word_embeddings, head_dim)
    "llama_tied": ("llama", True, None), "llama_untied": ("llama", False, None),
    "llama_wide_heads": ("llama", False, 32), "qwen2_qkv_bias": ("qwen2", True, None)}


def hf_model(model_type: str, tie: bool, head_dim: int | None, vocab: int = 300, bos: int = 1, eos: int = 2,
             seed: int = 0):
    """A tiny random transformers model: hidden 64, 4 heads over 2 KV heads, 2 layers; norm weights
    and biases drawn too (transformers starts them at 1 and 0, which would hide a wrong mapping)."""
    torch.manual_seed(seed)
    config_class, model_class = HF[model_type]
    config = config_class(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=tie, bos_token_id=bos, eos_token_id=eos, initializer_range=0.1,
                          **({"head_dim": head_dim} if head_dim else {}))
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    return model


def imported(hf, pad_id: int = 0) -> LanguageModel:
    cfg = config_from_hf(hf.config.to_dict(), pad_id)
    model = LanguageModel(cfg)
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg))
    return model.eval()


@torch.no_grad()
def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    return hf(tokens).logits  # [B, S, V]


@torch.no_grad()
def hf_stepwise(hf, tokens: list[int], prefill: int) -> np.ndarray:
    """transformers' own cached decoding, the same shape as `stepwise`: a cached step and a full
    forward round differently (for the shipped baseline by 1.4e-4 at logits near 20), so a step is
    held to a step."""
    out = hf(torch.tensor([tokens[:prefill]]), use_cache=True)
    logits = [out.logits[0, -1]]
    for token in tokens[prefill:]:
        out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits).numpy()


@torch.no_grad()
def full_forward(model: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    # tokens: [B, S] -> logits [B, S, V], no past (the training path)
    batch, length = tokens.shape
    hidden, _, _ = model.backbone(model.latents(tokens[..., None]), torch.arange(length).repeat(batch, 1),
                                  torch.ones(batch, length, dtype=torch.bool))
    return model.lm_head(hidden)


def stepwise(components, tokens: list[int], prefill: int) -> np.ndarray:
    """Logits [S - prefill + 1, V]: the last of a prefill of `prefill` tokens, then one per step
    through the components' backbone session (its past)."""
    session = components.open_backbone()
    latents = components.compress(np.asarray(tokens, np.int64)[:, None])  # [S, D]
    try:
        logits = [session.prefill(latents[:prefill], reserve_slots=len(tokens)).logits]
        logits += [session.step(latent).logits for latent in latents[prefill:]]
    finally:
        session.close()
    return np.stack(logits)


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_without_and_with_a_past(case):
    hf = hf_model(*CASES[case])
    model = imported(hf)
    assert model.cfg.kv_heads == 2 and model.cfg.head_dim == (CASES[case][2] or 16)
    tokens = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(1))
    want = hf_logits(hf, tokens)
    assert (full_forward(model, tokens) - want).abs().max() <= 1e-4
    for row in tokens.tolist():
        got = stepwise(TorchComponents(model), row, prefill=5)
        assert np.abs(got - hf_stepwise(hf, row, prefill=5)).max() <= 1e-4
        assert np.abs(got - hf_logits(hf, torch.tensor([row]))[0, 4:].numpy()).max() <= 1e-4


def test_a_checkpoint_that_does_not_fit_is_refused_naming_each_tensor():
    hf = hf_model("llama", False, None)
    cfg = config_from_hf(hf.config.to_dict(), pad_id=0)
    tensors = dict(hf.state_dict())
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError) as error:
        state_dict_from_hf(tensors, cfg)
    message = str(error.value)
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in message
    assert "unknown tensor model.layers.0.self_attn.o_proj.bias" in message
    assert "model.layers.0.self_attn.k_proj.weight: shape (64, 64), expected (32, 64)" in message
    tied = config_from_hf({**hf.config.to_dict(), "tie_word_embeddings": True}, pad_id=0)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        state_dict_from_hf(dict(hf.state_dict()), tied)


@pytest.mark.parametrize("change, named", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_type llama3"),
    ({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gpt2"}, "not one of the Llama family")])
def test_a_config_the_model_code_does_not_implement_is_refused(change, named):
    config = hf_model("llama", True, None).config.to_dict()
    with pytest.raises(ValueError, match=named):
        config_from_hf({**config, **change}, pad_id=0)


@pytest.mark.parametrize("case", ["llama_untied", "llama_wide_heads", "qwen2_qkv_bias"])
def test_exported_onnx_logits_equal_transformers(case, tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    hf = hf_model(*CASES[case], vocab=tok.vocab_size, bos=tok.bos_id, eos=tok.eos_id)
    export_checkpoint(Checkpoint(imported(hf, tok.pad_id), tok), tmp_path)
    engine = OnnxComponents(tmp_path)
    assert (engine.backbone.cache.heads, engine.backbone.cache.head_dim) == (2, CASES[case][2] or 16)
    row = tok.encode_prompt("Q: 12+7-3\nA: 12+7=19, 19-3=16")
    got = stepwise(engine, row, prefill=len(row) - 6)
    want = hf_logits(hf, torch.tensor([row]))[0, len(row) - 7:].numpy()
    assert np.abs(got - want).max() <= 1e-3


def gqa_dualend(tokenizer) -> LanguageModel:
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id,
                      eos_id=tokenizer.eos_id, pair_size=2, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_size=32, ffn_hidden=96, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=False,
                      qkv_bias=True)
    model = LanguageModel(cfg)
    with torch.no_grad():
        for layer in [*model.backbone.layers, model.mtp.layer]:
            layer.attn.qkv.bias.normal_(0.0, 0.1)
    return model.eval()


def test_a_gqa_dual_end_model_saves_loads_exports_and_its_batched_loop_equals_the_oracle(tiny_tokenizer, tmp_path):
    model = gqa_dualend(tiny_tokenizer)
    checkpoint = Checkpoint(model, tiny_tokenizer)
    ckpt_id = checkpoint.save(tmp_path / "checkpoint")
    loaded = load_checkpoint(tmp_path / "checkpoint")
    assert loaded.id == ckpt_id and loaded.config == model.cfg
    assert model.mtp.layer.attn.qkv.weight.shape == (4 * 32 + 2 * 2 * 32, 64)

    params = SamplingParams(max_tokens=16)
    prompts = PROMPTS[:3]
    batch = TorchBatch(model, [tiny_tokenizer.encode_prompt(p) for p in prompts], max_steps=16)
    # threshold -1: every draft accepted, so the MTP head's own (grouped) KV is read at every step
    torch_oracle = [reference_text(TorchComponents(model), tiny_tokenizer, p, params, -1.0) for p in prompts]
    assert all(want.accepted > 0 for want in torch_oracle)
    for got, want in zip(generate_batch(batch, [params] * len(prompts), -1.0), torch_oracle):
        assert (got.tokens, got.steps, got.accepted) == (want.tokens, want.steps, want.accepted)

    export_checkpoint(loaded, tmp_path / "export")
    for threshold in (-1.0, 1.0):
        engine, loop = make_loop(tmp_path / "export", tiny_tokenizer, threshold)
        outputs = [submit(loop, engine, tiny_tokenizer, i + 1, p, max_tokens=16) for i, p in enumerate(prompts)]
        run_until_idle(loop)
        for prompt, output in zip(prompts, outputs):
            alone = reference_text(engine, tiny_tokenizer, prompt, params, threshold)
            assert output.tokens == alone.tokens and output.error is None
            if threshold == -1.0:
                assert alone.tokens == torch_oracle[prompts.index(prompt)].tokens


def hf_state_dict(model: LanguageModel) -> dict[str, torch.Tensor]:
    """Our multi-head tied baseline's weights in transformers' Llama names (the inverse mapping,
    written here so the test does not lean on the code it checks)."""
    cfg, state = model.cfg, model.state_dict()
    out = {"model.embed_tokens.weight": state["embedding.weight"], "lm_head.weight": state["embedding.weight"],
           "model.norm.weight": state["backbone.norm.weight"]}
    for i in range(cfg.n_layers):
        ours, hf = f"backbone.layers.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.qkv.weight"].chunk(3)
        gate, up = state[ours + "ffn.gate_up.weight"].chunk(2)
        out |= {hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k,
                hf + "self_attn.v_proj.weight": v, hf + "self_attn.o_proj.weight": state[ours + "attn.out.weight"],
                hf + "mlp.gate_proj.weight": gate, hf + "mlp.up_proj.weight": up,
                hf + "mlp.down_proj.weight": state[ours + "ffn.down.weight"],
                hf + "input_layernorm.weight": state[ours + "attn_norm.weight"],
                hf + "post_attention_layernorm.weight": state[ours + "ffn_norm.weight"]}
    return out


def test_the_shipped_baseline_is_a_llama():
    baseline = load_checkpoint("checkpoints/baseline")
    cfg = baseline.config
    assert (cfg.kv_heads, cfg.head_dim, cfg.norm_eps, cfg.tie_embeddings, cfg.qkv_bias) == (4, 64, 1e-6, True, False)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        rope_theta=cfg.rope_theta, rms_norm_eps=1e-6, tie_word_embeddings=True)).eval()
    hf.load_state_dict(hf_state_dict(baseline.model), strict=True)
    row = baseline.tokenizer.encode_prompt("Q: 17+25-8\nA: 17+25=42, 42-8=34\nQ: 9*3\nA:")
    want = hf_logits(hf, torch.tensor([row]))[0]
    assert (full_forward(baseline.model, torch.tensor([row]))[0] - want).abs().max() <= 1e-4
    got = stepwise(TorchComponents(baseline.model), row, prefill=8)
    assert np.abs(got - hf_stepwise(hf, row, prefill=8)).max() <= 1e-4
