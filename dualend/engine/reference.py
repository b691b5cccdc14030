"""References the batched decode loop (`serving.loop.DecodeLoop`) is checked against.

- `reference_generate`: the step-by-step test oracle, one sequence through `Components` sessions
  (the torch model here, ONNX Runtime in `onnx_engine`, a scripted fake in unit tests). Tests and
  export parity only: nothing serves through it.
- `TorchBatch` / `generate_batch`: the quality gate's torch driver (evaluation), many prompts of a
  training checkpoint prefilled once and decoded together for every threshold and sample. Its
  decisions are `SequenceDecoder`'s, and a test holds it equal to the oracle.
"""
from __future__ import annotations

from typing import Iterator, Protocol, Sequence

import numpy as np
import torch

from .decode import BackboneOutput, Generation, SamplingParams, SequenceDecoder, Step, TextStream, pad_prompt
from .model import LanguageModel
from .tokenizer import TextTokenizer


class BackboneSession(Protocol):
    def prefill(self, latents: np.ndarray, reserve_slots: int) -> BackboneOutput: ...  # [n, D]
    def step(self, latent: np.ndarray) -> BackboneOutput: ...       # latent: [D]
    def close(self) -> None: ...


class MTPSession(Protocol):
    def step(self, t1: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, float]: ...
    def close(self) -> None: ...


class Components(Protocol):
    pair_size: int
    pad_id: int
    eos_id: int
    bos_id: int

    def compress(self, tokens: np.ndarray) -> np.ndarray: ...  # [n, pair_size] -> [n, D]
    def open_backbone(self) -> BackboneSession: ...
    def open_mtp(self, max_steps: int) -> MTPSession: ...


def reference_generate(components: Components, prompt_ids: Sequence[int], params: SamplingParams,
                       threshold: float) -> Iterator[Step]:
    """The test oracle: one sequence, one backbone call per step, the whole prompt prefilled at
    once. Yields one Step per backbone step; closing the iterator releases every cache."""
    pair_size, pad = components.pair_size, components.pad_id
    prompt = pad_prompt(prompt_ids, pair_size, pad)
    prompt_latents = components.compress(np.asarray(prompt, dtype=np.int64).reshape(-1, pair_size))
    decoder = SequenceDecoder(pair_size, pad, components.eos_id, components.bos_id, params, threshold,
                              len(prompt_latents))
    backbone = components.open_backbone()
    mtp = None
    try:
        # One slot per prompt pair and at most one per generated token.
        out = backbone.prefill(prompt_latents, reserve_slots=len(prompt_latents) + params.max_tokens)
        mtp = components.open_mtp(max_steps=params.max_tokens) if decoder.use_mtp else None
        while True:
            t1 = decoder.first_token(out.logits)
            draft = mtp.step(t1, out.hidden, decoder.position) if decoder.wants_draft(t1) else ()
            step = decoder.complete(t1, *draft)
            yield step
            if step.finish_reason is not None:
                return
            out = backbone.step(components.compress(np.asarray([decoder.next_pair], dtype=np.int64))[0])
    finally:
        try:
            backbone.close()
        finally:
            if mtp is not None:
                mtp.close()


def reference_text(components: Components, tokenizer: TextTokenizer, prompt: str, params: SamplingParams,
                   threshold: float) -> Generation:
    """The oracle's whole generation, released through `TextStream` as the decode loop releases it."""
    result, text = Generation(), TextStream(tokenizer, params.stop_words)
    steps = reference_generate(components, tokenizer.encode_prompt(prompt), params, threshold)
    try:
        for step in steps:
            chunk = text.chunk(step)
            result.add(chunk.tokens, chunk.steps, chunk.drafts, chunk.accepted, chunk.finish_reason)
            if chunk.finish_reason is not None:
                break
    finally:
        steps.close()
    result.text = tokenizer.decode(result.tokens)
    return result


class TorchBackboneSession:
    def __init__(self, model: LanguageModel):
        self.model = model
        self.past_k = self.past_v = None  # [L, 1, kv_heads, T, Dh]

    @torch.no_grad()
    def _run(self, latents: np.ndarray) -> BackboneOutput:
        # latents: [S, D]
        start = 0 if self.past_k is None else self.past_k.shape[3]
        x = torch.from_numpy(np.ascontiguousarray(latents, dtype=np.float32))[None]
        positions = torch.arange(start, start + x.shape[1])[None]
        valid = torch.ones(1, x.shape[1], dtype=torch.bool)
        past_valid = None if self.past_k is None else torch.ones(1, start, dtype=torch.bool)
        hidden, k, v = self.model.backbone(x, positions, valid, self.past_k, self.past_v,
                                           past_valid, last=1)
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
        self.past_k = self.past_v = None  # [1, kv_heads, T, Dh]

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


class TorchBatch:
    """Many prompts prefilled together and then stepped together on the torch model: the
    evaluation's batch, driven by `generate_batch`.

    Prompts are left-padded to a common number of pairs, so every row writes its next pair at the
    same KV column; keys and values live in buffers allocated once and written in place. Every
    decode run starts again right after the prefill (`restart`), so one prefill serves several
    thresholds and samples.
    """

    @torch.no_grad()
    def __init__(self, model: LanguageModel, prompts: list[list[int]], max_steps: int):
        cfg = self.cfg = model.cfg
        self.model = model.eval()
        padded = [pad_prompt(p, cfg.pair_size, cfg.pad_id) for p in prompts]
        self.prompt_pairs = np.array([len(p) // cfg.pair_size for p in padded])
        rows, width = len(prompts), int(self.prompt_pairs.max())
        self.width, self.max_steps = width, max_steps
        valid = np.zeros((rows, width + max_steps), dtype=bool)
        valid[:, width:] = True
        # keys/values: [L, B, kv_heads, prompt pairs + steps, Dh]
        self.keys = torch.zeros(cfg.n_layers, rows, cfg.kv_heads, width + max_steps, cfg.head_dim)
        self.values = torch.zeros_like(self.keys)
        self.prefill_hidden = torch.zeros(rows, cfg.d_model)  # [B, D] at each row's last prompt pair
        for row, prompt in enumerate(padded):  # one row at a time: no padding, attention fits in cache
            n = int(self.prompt_pairs[row])
            pairs = torch.tensor(prompt, dtype=torch.long).view(1, n, cfg.pair_size)
            hidden, k, v = model.backbone(model.latents(pairs), torch.arange(n)[None],
                                          torch.ones(1, n, dtype=torch.bool), last=1)
            self.keys[:, row, :, width - n:width], self.values[:, row, :, width - n:width] = k[:, 0], v[:, 0]
            self.prefill_hidden[row] = hidden[0, -1]
            valid[row, width - n:width] = True
        self.valid = torch.from_numpy(valid)
        if cfg.is_dualend:
            self.mtp_keys = torch.zeros(rows, cfg.kv_heads, max_steps, cfg.head_dim)
            self.mtp_values = torch.zeros_like(self.mtp_keys)
        self.restart()

    def close(self) -> None:
        """Nothing to give back (its buffers go with it); `OnnxBatch` gives back its rows of an engine's cache."""

    @torch.no_grad()
    def restart(self) -> tuple[np.ndarray, np.ndarray]:
        """Back to the state right after the prefill; returns its logits [B, V] and hidden [B, D]."""
        self.steps = self.drafts = 0
        self.hidden = self.prefill_hidden
        return self.model.lm_head(self.hidden).numpy(), self.hidden.numpy()

    @torch.no_grad()
    def step(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # pairs: [B, pair_size], one new pair per row -> logits [B, V], hidden [B, D]
        if self.steps == self.max_steps:
            raise RuntimeError(f"TorchBatch holds {self.max_steps} decode steps")
        column = self.width + self.steps
        positions = torch.from_numpy(self.prompt_pairs + self.steps)[:, None]
        latents = self.model.latents(torch.from_numpy(np.asarray(pairs, np.int64))[:, None])
        hidden, k, v = self.model.backbone(latents, positions, torch.ones(len(pairs), 1, dtype=torch.bool),
                                           self.keys[..., :column, :], self.values[..., :column, :],
                                           self.valid[:, :column], last=1)
        self.keys[..., column:column + 1, :], self.values[..., column:column + 1, :] = k, v
        self.steps += 1
        self.hidden = hidden[:, -1]
        return self.model.lm_head(self.hidden).numpy(), self.hidden.numpy()

    @torch.no_grad()
    def draft(self, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The MTP head on each row's t1 [B] and last hidden state -> logits [B, V], confidence [B]."""
        column = self.drafts
        positions = torch.from_numpy(self.prompt_pairs - 1 + self.steps)[:, None]
        rows = len(t1)
        logits, confidence, k, v = self.model.mtp_forward(
            torch.from_numpy(np.asarray(t1, np.int64))[:, None], self.hidden[:, None], positions,
            torch.ones(rows, 1, dtype=torch.bool), self.mtp_keys[:, :, :column], self.mtp_values[:, :, :column],
            torch.ones(rows, column, dtype=torch.bool))
        self.mtp_keys[:, :, column:column + 1], self.mtp_values[:, :, column:column + 1] = k, v
        self.drafts += 1
        return logits[:, 0].numpy(), confidence[:, 0].numpy()


def generate_batch(batch: TorchBatch, params: list[SamplingParams], threshold: float) -> list[Generation]:
    """One generation per row of `batch`, each deciding through its `SequenceDecoder` as the decode
    loop does (so exactly as `reference_generate`; a test holds them equal)."""
    cfg = batch.cfg
    decoders = [SequenceDecoder(cfg.pair_size, cfg.pad_id, cfg.eos_id, cfg.bos_id, p, threshold, int(n))
                for p, n in zip(params, batch.prompt_pairs)]
    results = [Generation() for _ in decoders]
    running = set(range(len(decoders)))
    idle_pair = [cfg.pad_id] * cfg.pair_size
    logits, _ = batch.restart()
    while running:
        t1 = np.full(len(decoders), cfg.pad_id)
        for row in running:
            t1[row] = decoders[row].first_token(logits[row])
        wants = {row for row in running if decoders[row].wants_draft(t1[row])}
        draft_logits, confidence = batch.draft(t1) if wants else (None, None)
        for row in list(running):
            step = (decoders[row].complete(t1[row], draft_logits[row], float(confidence[row])) if row in wants
                    else decoders[row].complete(t1[row]))
            results[row].add(step.tokens, 1, step.drafted, step.accepted, step.finish_reason)
            if step.finish_reason is not None:
                running.discard(row)
        if running:
            logits, _ = batch.step(np.array([decoders[r].next_pair if r in running else idle_pair
                                             for r in range(len(decoders))]))
    return results
