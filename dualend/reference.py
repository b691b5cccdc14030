"""The torch reference engine: the decode loop's Components backed by the torch model."""
from __future__ import annotations

import numpy as np
import torch

from .decode import BackboneOutput
from .model import LanguageModel


class TorchBackboneSession:
    def __init__(self, model: LanguageModel):
        self.model = model
        self.past_k = self.past_v = None  # [L, 1, heads, T, Dh]

    @torch.no_grad()
    def _run(self, latents: np.ndarray) -> BackboneOutput:
        # latents: [S, D]
        start = 0 if self.past_k is None else self.past_k.shape[3]
        x = torch.from_numpy(np.ascontiguousarray(latents, dtype=np.float32))[None]
        positions = torch.arange(start, start + x.shape[1])[None]
        valid = torch.ones(1, x.shape[1], dtype=torch.bool)
        past_valid = None if self.past_k is None else torch.ones(1, start, dtype=torch.bool)
        hidden, k, v = self.model.backbone(x, positions, valid, self.past_k, self.past_v,
                                           past_valid, last_only=True)
        self.past_k = k if self.past_k is None else torch.cat([self.past_k, k], dim=3)
        self.past_v = v if self.past_v is None else torch.cat([self.past_v, v], dim=3)
        hidden = hidden[0, -1]
        return BackboneOutput(self.model.lm_head(hidden).numpy(), hidden.numpy())

    def prefill(self, latents: np.ndarray, reserve_slots: int = 0) -> BackboneOutput:
        return self._run(latents)

    def step(self, latent: np.ndarray) -> BackboneOutput:
        return self._run(latent[None])

    def close(self) -> None:
        self.past_k = self.past_v = None


class TorchMTPSession:
    def __init__(self, model: LanguageModel):
        self.model = model
        self.past_k = self.past_v = None  # [1, heads, T, Dh]

    @torch.no_grad()
    def step(self, t1: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        past_len = 0 if self.past_k is None else self.past_k.shape[2]
        past_valid = None if self.past_k is None else torch.ones(1, past_len, dtype=torch.bool)
        logits, confidence, k, v = self.model.mtp_forward(
            torch.tensor([[t1]]), torch.from_numpy(np.asarray(hidden, dtype=np.float32))[None, None],
            torch.tensor([[position]]), torch.ones(1, 1, dtype=torch.bool),
            self.past_k, self.past_v, past_valid)
        self.past_k = k if self.past_k is None else torch.cat([self.past_k, k], dim=2)
        self.past_v = v if self.past_v is None else torch.cat([self.past_v, v], dim=2)
        return logits[0, 0].numpy(), float(confidence[0, 0])

    def close(self) -> None:
        self.past_k = self.past_v = None


class TorchComponents:
    def __init__(self, model: LanguageModel):
        self.model = model.eval()
        cfg = model.cfg
        self.pair_size, self.pad_id, self.eos_id, self.bos_id = cfg.pair_size, cfg.pad_id, cfg.eos_id, cfg.bos_id

    @torch.no_grad()
    def compress(self, tokens: np.ndarray) -> np.ndarray:
        return self.model.latents(torch.from_numpy(np.asarray(tokens, dtype=np.int64))).numpy()

    def open_backbone(self) -> TorchBackboneSession:
        return TorchBackboneSession(self.model)

    def open_mtp(self, max_steps: int = 0) -> TorchMTPSession:
        return TorchMTPSession(self.model)
