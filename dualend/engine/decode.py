"""The one decode loop: prefill, then backbone step -> t1 -> MTP draft t2 -> confidence gate.

It talks to the model through `Components` (compressor, a backbone session, an MTP session), so
the same loop runs on the torch reference, the ONNX Runtime engine, the Triton backbone over BLS
and a scripted fake in unit tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import numpy as np

from .tokenizer import TextTokenizer


class InvalidRequest(ValueError):
    """A request the caller got wrong; the message says what and how to fix it."""


class CapacityError(RuntimeError):
    """The server cannot take the request now (KV pool full); the caller may retry."""


MAX_STOP_WORDS = 32
MAX_STOP_WORD_CHARS = 256  # a stop word also holds back as many characters of the stream, less one


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    acceptance_threshold: float | None = None
    stop_words: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always decode max_tokens tokens

    def validate(self, max_tokens_limit: int) -> None:
        if not 1 <= self.max_tokens <= max_tokens_limit:
            raise InvalidRequest(f"max_tokens must be between 1 and {max_tokens_limit}, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequest(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.acceptance_threshold is not None and not math.isfinite(self.acceptance_threshold):
            raise InvalidRequest(f"acceptance_threshold must be a finite number, got {self.acceptance_threshold}")
        if self.acceptance_threshold is not None and not -1 <= self.acceptance_threshold <= 1:
            raise InvalidRequest(f"acceptance_threshold must be from -1 (every draft accepted) to 1 (drafting off), "
                                 f"got {self.acceptance_threshold:g}")
        if any(not w for w in self.stop_words):
            raise InvalidRequest("stop_words must not contain an empty string")
        longest = max((len(w) for w in self.stop_words), default=0)
        if longest > MAX_STOP_WORD_CHARS:
            raise InvalidRequest(f"a stop word is {longest} characters long, at most {MAX_STOP_WORD_CHARS}")


class Sampler:
    """Greedy at temperature 0; otherwise temperature, top-k, top-p from a seeded generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        # logits: [V]
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < scaled.size:
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if p.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, p.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return int(self.rng.choice(probs.size, p=probs))


@dataclass
class BackboneOutput:
    logits: np.ndarray  # [V] at the last position
    hidden: np.ndarray  # [D] final-normed hidden state at the last position


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


@dataclass
class Step:
    tokens: list[int]              # emitted this step: 0, 1 or 2 real tokens, never PAD
    drafted: bool = False          # the MTP head proposed a second token
    accepted: bool = False         # ... and the gate let it through
    finish_reason: str | None = None  # "eos" | "length" | None while running


def pad_prompt(prompt: Sequence[int], pair_size: int, pad_id: int) -> list[int]:
    """An odd prompt gets one PAD, right after its BOS, so its last token completes a pair: pairs
    are aligned to the end of the prompt, and the text just before the answer (the question) is
    paired the same way whatever comes before it. (With the PAD at the end, the v4 dual-end model
    solved long math prompts of odd length 0.52 on calibration against 0.98 for even ones.)"""
    prompt = list(prompt)
    return prompt[:1] + [pad_id] * (-len(prompt) % pair_size) + prompt[1:]


def gate(confidence: float, threshold: float) -> bool:
    """Accept the draft when its estimated chance of being right reaches the threshold."""
    return threshold < 0 or confidence >= threshold


def drafting_enabled(threshold: float) -> bool:
    return threshold < 1


class SequenceDecoder:
    """One sequence's decisions in the decode loop, engine-free, so a loop over one sequence and a
    loop over a batch of them decide identically: sample t1 from the backbone's logits, ask for a
    draft when one may follow, sample and gate it, count, finish, and name the next pair to feed.
    """

    def __init__(self, pair_size: int, pad_id: int, eos_id: int, bos_id: int, params: SamplingParams,
                 threshold: float, prompt_pairs: int, sampler=None):
        self.pair_size, self.pad_id, self.eos_id = pair_size, pad_id, eos_id
        self.params, self.threshold = params, threshold
        self.sampler = sampler or Sampler(params)
        self.use_mtp = pair_size == 2 and drafting_enabled(threshold)
        self.banned = [pad_id, bos_id] + ([eos_id] if params.ignore_eos else [])
        self.position = prompt_pairs - 1  # pair index of the hidden state the next step reads
        self.produced = 0
        self.next_pair: list[int] = []

    def first_token(self, logits: np.ndarray) -> int:
        # logits: [V], the backbone's at the last pair
        return self.sampler(_masked(logits, self.banned))

    def wants_draft(self, t1: int) -> bool:
        return self.use_mtp and t1 != self.eos_id and self.produced + 1 < self.params.max_tokens

    def complete(self, t1: int, draft_logits: np.ndarray | None = None, confidence: float = 0.0) -> Step:
        """The step's emitted tokens; afterwards `next_pair` is what the backbone reads next."""
        if t1 == self.eos_id:
            return Step([], finish_reason="eos")
        step, draft = Step([t1]), self.pad_id
        if draft_logits is not None:
            draft = self.sampler(_masked(draft_logits, self.banned))
            step.drafted, step.accepted = True, gate(confidence, self.threshold)
            if not step.accepted:
                draft = self.pad_id
            elif draft == self.eos_id:
                step.finish_reason, draft = "eos", self.pad_id
            else:
                step.tokens.append(draft)
        self.produced += len(step.tokens)
        if step.finish_reason is None and self.produced >= self.params.max_tokens:
            step.finish_reason = "length"
        self.next_pair = [t1, draft] if self.pair_size == 2 else [t1]
        self.position += 1
        return step


def generate(components: Components, prompt_ids: Sequence[int], params: SamplingParams,
             threshold: float, prompt_latents: np.ndarray | None = None) -> Iterator[Step]:
    """Yields one Step per backbone step; closing the iterator releases every cache.

    `prompt_latents` [n, D], when the caller already compressed the prompt, skips that step.
    """
    pair_size, pad = components.pair_size, components.pad_id
    if prompt_latents is None:
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


def _masked(logits: np.ndarray, banned: list[int]) -> np.ndarray:
    logits = np.array(logits, dtype=np.float32, copy=True)
    logits[banned] = -np.inf
    return logits


class TextStream:
    """Releases generated tokens as text becomes final: whole UTF-8 characters only, and held
    back while the text may still turn into a stop word.

    It releases token ids, not text, so whoever decodes the released groups one by one (the
    postprocessing model) gets exactly the text of the whole. A stop word ends the text at the
    last token boundary before it.
    """

    def __init__(self, tokenizer: TextTokenizer, stop_words: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop_words = list(stop_words)
        self.holdback = max((len(w) for w in self.stop_words), default=1) - 1
        self.pending: list[int] = []
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> list[int]:
        if self.stopped:
            return []
        self.pending += tokens
        text = self.tokenizer.decode(self.pending)
        hits = [i for i in (text.find(w) for w in self.stop_words) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(limit=min(hits), final=True)
        return self._take(limit=len(text) - self.holdback, final=False)

    def finish(self) -> list[int]:
        released, self.pending = ([] if self.stopped else self.pending), []
        return released

    def chunk(self, step: "Step") -> "Chunk":
        """What one decode step shows the user; the last chunk (finished, or a stop word) carries
        everything still held back."""
        chunk = Chunk(self.push(step.tokens), 1, int(step.drafted), int(step.accepted),
                      "stop" if self.stopped else step.finish_reason)
        if chunk.finish_reason is not None:
            chunk.tokens += self.finish()
        return chunk

    def _take(self, limit: int, final: bool) -> list[int]:
        """Releases the longest prefix of pending tokens whose text fits in `limit` characters."""
        count = 0
        for n in range(1, len(self.pending) + 1):
            text = self.tokenizer.decode(self.pending[:n])
            if len(text) > limit:
                break
            if not text.endswith("\ufffd"):
                count = n
        released = self.pending[:count]
        self.pending = [] if final else self.pending[count:]
        return released


@dataclass
class Chunk:
    tokens: list[int]               # released token ids, ready to show
    steps: int = 0
    drafts: int = 0
    accepted: int = 0
    finish_reason: str | None = None  # "eos" | "length" | "stop" on the last chunk


def stream_chunks(components: Components, tokenizer: TextTokenizer, prompt_ids: Sequence[int],
                  params: SamplingParams, threshold: float,
                  prompt_latents: np.ndarray | None = None) -> Iterator[Chunk]:
    """One chunk per decode step, the last with its finish reason; closing it frees the caches."""
    text = TextStream(tokenizer, params.stop_words)
    steps = generate(components, prompt_ids, params, threshold, prompt_latents)
    try:
        for step in steps:
            chunk = text.chunk(step)
            yield chunk
            if chunk.finish_reason is not None:
                return
    finally:
        steps.close()


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    drafts: int = 0
    accepted: int = 0
    finish_reason: str = ""

    def add(self, tokens: list[int], steps: int, drafts: int, accepted: int, finish_reason: str | None) -> None:
        self.tokens += tokens
        self.steps += steps
        self.drafts += drafts
        self.accepted += accepted
        self.finish_reason = finish_reason or self.finish_reason


def generate_text(components: Components, tokenizer: TextTokenizer, prompt: str,
                  params: SamplingParams, threshold: float) -> Generation:
    """Whole generation as text, for evaluation, tests and offline checks."""
    result = Generation()
    for chunk in stream_chunks(components, tokenizer, tokenizer.encode_prompt(prompt), params, threshold):
        result.add(chunk.tokens, chunk.steps, chunk.drafts, chunk.accepted, chunk.finish_reason)
    result.text = tokenizer.decode(result.tokens)
    return result
