"""The one implementation of the backbone, compressor, MTP head and confidence head.

A baseline is a `LanguageModel` with pair_size 1 (latent = embedding of one token); a dual-end
model has pair_size 2, a compressor, an MTP head and a confidence head. Every attention layer
takes its past keys/values as tensors and returns the keys/values of the new positions only, so
the same code serves training (no past), the reference generator and the ONNX export.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    pair_size: int = 2
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 688
    rope_theta: float = 10000.0
    compressor_init: str = "sum"  # "sum": emb(a) + emb(b); "mean": half that; "second": emb(b); "random"
    # RoPE angle of pair i is that of token position stride*i + stride-1 (stride 1: the pair index;
    # stride 2: the raw position of the pair's second token, what a converted baseline knows).
    position_stride: int = 1
    # The Llama family. Later fields: `to_dict` leaves them out at their defaults, so a config
    # written before they existed hashes (checkpoint id) as it did.
    n_kv_heads: int = 0         # grouped-query attention; 0: n_heads
    head_size: int = 0          # 0: d_model // n_heads
    norm_eps: float = 1e-6
    tie_embeddings: bool = True  # False: a separate `output` matrix is the LM head
    qkv_bias: bool = False       # Qwen2-style bias on q, k, v (not on the output projection)
    # A token-level model with an MTP head whose drafts the next step verifies (no compressor, no
    # confidence head: a draft's confidence is its own top probability).
    draft_head: bool = False
    # ... whose drafts come from the `draft_vocab` tokens it names (`MTPHead.draft_ids`; 0: every token):
    # its output layer is that much smaller (a draft outside them would rarely be kept).
    draft_vocab: int = 0

    def __post_init__(self):
        if self.draft_vocab and not self.draft_head:
            raise ValueError("draft_vocab names the tokens of a draft head's drafts: set draft_head too")
        if self.draft_head and self.pair_size != 1:
            raise ValueError("draft_head is for token-level models (pair_size 1); a pair model always has its MTP head")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} is odd; RoPE rotates halves")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def is_dualend(self) -> bool:
        return self.pair_size == 2

    @property
    def has_mtp(self) -> bool:
        return self.is_dualend or self.draft_head

    def to_dict(self) -> dict:
        values = asdict(self)
        defaults = {f.name: f.default for f in fields(self) if f.name in _LATER_FIELDS}
        return {k: v for k, v in values.items() if k not in defaults or v != defaults[k]}


_LATER_FIELDS = ("n_kv_heads", "head_size", "norm_eps", "tie_embeddings", "qkv_bias", "draft_head", "draft_vocab")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(positions: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, S, Dh/2] of the RoPE angles of `positions` [B, S] (pair indices); computed
    once per forward and shared by every layer. Frequencies base^(-2i/Dh), as Llama's."""
    positions = positions * cfg.position_stride + (cfg.position_stride - 1)
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # [B, 1, S, half]
    return angles.cos(), angles.sin()


def rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], half: int) -> torch.Tensor:
    # x: [B, heads, S, 2 * half]; `half` a Python int, so the export splits by a constant.
    # Rotates the two halves against each other (Llama's rotate_half), not interleaved pairs.
    cos, sin = cos_sin
    x1, x2 = x.split(half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_mask(past_valid: torch.Tensor | None, new_valid: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, S, T+S]: query s sees valid past slots and valid new slots <= s.

    Every query also sees itself, so a padded query row stays finite (its output is unused).
    """
    batch, new_len = new_valid.shape
    index = torch.arange(new_len, device=new_valid.device)
    causal, own = index[:, None] >= index[None], index[:, None] == index[None]
    new_part = (causal[None] & new_valid[:, None, :]) | own[None]  # [B, S, S]
    if past_valid is None:
        return new_part[:, None]
    past_part = past_valid[:, None, :].expand(batch, new_len, past_valid.shape[1])
    return torch.cat([past_part, new_part], dim=-1)[:, None]


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads, kv_heads key/value heads, each key/value head
    serving n_heads / kv_heads consecutive query heads (Llama's repeat_kv order)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        # rows: q [n_heads * Dh], then k, then v [kv_heads * Dh each]
        self.qkv = nn.Linear(cfg.d_model, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.out = nn.Linear(q_size, cfg.d_model, bias=False)

    def forward(self, x, cos_sin, mask, past_k=None, past_v=None, last=0):
        # x: [B, S, D]; cos_sin: rotary(); past_k/v: [B, kv_heads, T, Dh]; mask: [B, 1, S, T+S];
        # last > 0: only the last `last` positions query (their outputs alone come back)
        heads, kv_heads, head_dim = self.cfg.n_heads, self.cfg.kv_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        # torch.unflatten, not Tensor.unflatten: torch.compile cannot trace the method's super() call
        q = torch.unflatten(q, -1, (heads, head_dim)).transpose(1, 2)     # [B, heads, S, Dh]
        k = torch.unflatten(k, -1, (kv_heads, head_dim)).transpose(1, 2)  # [B, kv_heads, S, Dh]
        v = torch.unflatten(v, -1, (kv_heads, head_dim)).transpose(1, 2)
        half = head_dim // 2
        q, k = rope(q, cos_sin, half), rope(k, cos_sin, half)
        if last:
            q, mask = q[:, :, -last:], mask[:, :, -last:]
        groups, queries = heads // kv_heads, q.shape[2]
        if groups > 1:
            # Each key/value head's query heads as one longer query: [B, kv_heads, groups * S, Dh],
            # so the keys and values are read as they are, never repeated.
            q = q.reshape(q.shape[0], kv_heads, -1, head_dim)
            mask = mask.repeat(1, 1, groups, 1)  # [B, 1, groups * S, T+S]
        if past_k is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = _attend_past_and_new(q, past_k, past_v, k, v, mask, head_dim ** -0.5)
        if groups > 1:
            y = y.reshape(y.shape[0], heads, queries, head_dim)  # [B, heads, S, Dh]
        y = y.transpose(1, 2).flatten(2)
        return self.out(y), k, v


def _attend_past_and_new(q, past_k, past_v, k, v, mask, scale: float):
    """Attention over past and new keys without concatenating them: a step reads the past once
    and copies none of it (only the [S, T+S] scores are joined).

    q: [B, kv_heads, S, Dh] (grouped queries); past_k/v: [B, kv_heads, T, Dh]; k/v: [B, kv_heads, S', Dh];
    mask [B, 1, S, T+S'];
    scale: Dh ** -0.5, a Python float (a constant in the export)
    """
    scores = torch.cat([q @ past_k.transpose(-1, -2), q @ k.transpose(-1, -2)], dim=-1) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    past_len = past_k.shape[2]
    return probs[..., :past_len] @ past_v + probs[..., past_len:] @ v


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden = cfg.ffn_hidden
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn, self.ffn = Attention(cfg), FeedForward(cfg)

    def forward(self, x, cos_sin, mask, past_k=None, past_v=None, last=0):
        attn_out, k, v = self.attn(self.attn_norm(x), cos_sin, mask, past_k, past_v, last)
        x = (x[:, -last:] if last else x) + attn_out
        return x + self.ffn(self.ffn_norm(x)), k, v


class Backbone(nn.Module):
    """Decoder stack over latents; positions are pair indices (token indices for a baseline)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x, positions, new_valid, past_k=None, past_v=None, past_valid=None, last=0):
        # x: [B, S, D]; past_k/v: [L, B, kv_heads, T, Dh]; returns hidden [B, S, D] (last > 0: at the
        # last min(S, last) positions only), present_k/v: [L, B, kv_heads, S, Dh]
        mask, cos_sin = attention_mask(past_valid, new_valid), rotary(positions, self.cfg)
        present_k, present_v = [], []
        for index, layer in enumerate(self.layers):
            only = last if index == len(self.layers) - 1 else 0
            pk = None if past_k is None else past_k[index]
            pv = None if past_v is None else past_v[index]
            x, k, v = layer(x, cos_sin, mask, pk, pv, last=only)
            present_k.append(k)
            present_v.append(v)
        return self.norm(x), torch.stack(present_k), torch.stack(present_v)


class Compressor(nn.Module):
    """latent = W2 SiLU(W1 [emb(a); emb(b)]), 2H -> 2H -> H."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.d_model
        self.up = nn.Linear(2 * dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    @torch.no_grad()
    def init_linear(self, first: float, second: float) -> None:
        """Starts as exactly first * emb(a) + second * emb(b)."""
        dim = self.down.out_features
        # SiLU(s) - SiLU(-s) = s, so [s; -s] through SiLU and then [I, -I] gives exactly s.
        eye = torch.eye(dim)
        mix = torch.cat([first * eye, second * eye], 1)
        self.up.weight.copy_(torch.cat([mix, -mix], 0))
        self.down.weight.copy_(torch.cat([eye, -eye], 1))
        self.up.bias.zero_()
        self.down.bias.zero_()

    def forward(self, pair_embeddings: torch.Tensor) -> torch.Tensor:
        # pair_embeddings: [..., 2, D] -> [..., D]
        flat = pair_embeddings.flatten(-2)
        return self.down(F.silu(self.up(flat)))


class MTPHead(nn.Module):
    """Predicts the token after t1 from [RMSNorm(emb(t1)); RMSNorm(h)] with one decoder layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.token_norm, self.hidden_norm = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.layer = Block(cfg)  # the backbone's layer shape: its KV is [B, kv_heads, T, Dh]
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.draft_vocab:
            self.register_buffer("draft_ids", torch.zeros(cfg.draft_vocab, dtype=torch.long))

    def forward(self, t1_embedding, hidden, positions, new_valid, past_k=None, past_v=None,
                past_valid=None):
        # t1_embedding, hidden: [B, S, D]; past_k/v: [B, kv_heads, T, Dh]
        x = self.proj(torch.cat([self.token_norm(t1_embedding), self.hidden_norm(hidden)], -1))
        mask = attention_mask(past_valid, new_valid)
        x, k, v = self.layer(x, rotary(positions, self.cfg), mask, past_k, past_v)
        return self.norm(x), k, v


class ConfidenceHead(nn.Module):
    """Estimated probability that the MTP draft is right, from [h ; mtp_hidden]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.net = nn.Sequential(
            RMSNorm(2 * cfg.d_model, cfg.norm_eps), nn.Linear(2 * cfg.d_model, cfg.d_model), nn.SiLU(),
            nn.Linear(cfg.d_model, 1),
        )

    def forward(self, hidden, mtp_hidden):
        logit = self.net(torch.cat([hidden, mtp_hidden], -1)).squeeze(-1)
        # under bf16 autocast in fp32: bf16 rounds a sigmoid above ~0.998 to exactly 1, where the BCE's
        # gradient is zero (an fp32 export records no cast)
        return torch.sigmoid(logit if logit.dtype == torch.float32 else logit.float())


COMPRESSOR_INITS = {"sum": (1.0, 1.0), "mean": (0.5, 0.5), "second": (0.0, 1.0)}  # "random": the default initialisation


class LanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.backbone = Backbone(cfg)
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # registered in this order so that a seed draws a pair model's weights as it always has
        if cfg.is_dualend:
            self.compressor = Compressor(cfg)
        if cfg.has_mtp:
            self.mtp = MTPHead(cfg)
        if cfg.is_dualend:
            self.confidence = ConfidenceHead(cfg)
        self.apply(self._init_weights)
        if cfg.is_dualend and cfg.compressor_init in COMPRESSOR_INITS:
            self.compressor.init_linear(*COMPRESSOR_INITS[cfg.compressor_init])

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, D]: the output layer's weight (the embedding's, where they are tied)."""
        return self.embedding.weight if self.cfg.tie_embeddings else self.output.weight

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.cfg.tie_embeddings:
            return self.output(hidden)
        return hidden @ self.embedding.weight.T

    def latents(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [..., pair_size] -> [..., D]
        embeddings = self.embedding(tokens)
        if not self.cfg.is_dualend:
            return embeddings.squeeze(-2)
        return self.compressor(embeddings)

    def mtp_forward(self, t1, hidden, positions, new_valid, past_k=None, past_v=None,
                    past_valid=None, last=0):
        """Returns draft logits, confidence, and the MTP layer's new keys/values; with `last`, the
        logits and confidence of the last `last` positions only."""
        mtp_hidden, k, v = self.mtp(self.embedding(t1), hidden, positions, new_valid, past_k,
                                    past_v, past_valid)
        if last:
            hidden, mtp_hidden = hidden[:, -last:], mtp_hidden[:, -last:]
        if self.cfg.draft_vocab:  # the draft's tokens only; every other one impossible
            ids = self.mtp.draft_ids
            logits = torch.full((*mtp_hidden.shape[:-1], self.cfg.vocab_size), float("-inf"), dtype=mtp_hidden.dtype)
            logits = logits.scatter(-1, ids.expand(*mtp_hidden.shape[:-1], len(ids)),
                                    mtp_hidden @ self.output_weight[ids].T)
        else:
            logits = self.lm_head(mtp_hidden)
        if not self.cfg.is_dualend:  # a verified draft: its own top probability
            return logits, logits.detach().float().softmax(-1).amax(-1), k, v
        confidence = self.confidence(hidden.detach(), mtp_hidden.detach())
        return logits, confidence, k, v


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def default_ffn_hidden(d_model: int) -> int:
    return int(math.ceil(8 * d_model / 3 / 16) * 16)
