"""One sequence's decode decisions, sampling and text release, engine-free.

`SequenceDecoder` decides a step (sample t1, ask for a draft, sample and gate it, count, finish,
name the next pair); `TextStream` turns emitted tokens into released ones. The one decode driver
is the batched `serving.loop.DecodeLoop` (served, and in-process through `serving.offline`); the
step-by-step `reference.reference_generate` is the test oracle it is checked against.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .tokenizer import TextTokenizer


class InvalidRequest(ValueError):
    """A request the caller got wrong; the message says what and how to fix it."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt with max_tokens, does not fit the served context."""


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

    def validate(self) -> None:
        """The sampling parameters; max_tokens is the request contract's (`serving.contract`)."""
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
        probs = self.distribution(logits)
        return int(np.argmax(logits)) if probs is None else self.draw(probs)

    def distribution(self, logits: np.ndarray) -> np.ndarray | None:
        """The probabilities a token is drawn with (temperature, top-k, top-p); None when greedy."""
        p = self.params
        if p.temperature == 0:
            return None
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
        return probs

    def draw(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(probs.size, p=probs))


@dataclass
class BackboneOutput:
    logits: np.ndarray  # [V] at the last position
    hidden: np.ndarray  # [D] final-normed hidden state at the last position


@dataclass
class Step:
    tokens: list[int]              # emitted this step: 0, 1 or 2 real tokens, never PAD
    drafted: bool = False          # the MTP head proposed a second token
    accepted: bool = False         # ... and the gate let it through
    finish_reason: str | None = None  # "eos" | "length" | None while running


def pad_prompt(prompt: Sequence[int], pair_size: int, pad_id: int, turn_starts: Sequence[int] = ()) -> list[int]:
    """An odd prompt gets one PAD, right after its BOS, so its last token completes a pair: pairs
    are aligned to the end of the prompt, and the text just before the answer (the question) is
    paired the same way whatever comes before it. (With the PAD at the end, the v4 dual-end model
    solved long math prompts of odd length 0.52 on calibration against 0.98 for even ones.)

    A conversation's prompt is paired turn by turn: `turn_starts` (where each part after an
    assistant header begins, `TextTokenizer.turn_starts`) cut it into parts, each paired by the rule
    above on its own (an odd part: one PAD after its first token). So the pairs of one turn's prompt
    are a prefix of the next turn's, and a one-turn prompt is paired as before."""
    prompt, padded = list(prompt), []
    for start, stop in zip((0, *turn_starts), (*turn_starts, len(prompt))):
        part = prompt[start:stop]
        padded += part[:1] + [pad_id] * (-len(part) % pair_size) + part[1:]
    return padded


def gate(confidence: float, threshold: float) -> bool:
    """Accept the draft when its estimated chance of being right reaches the threshold."""
    return threshold < 0 or confidence >= threshold


def drafting_enabled(threshold: float) -> bool:
    return threshold < 1


class SyntheticAcceptance:
    """Benchmark only (the deployment's `synthetic_acceptance`, never a request's): accepts a draft
    by a draw at `rate` instead of the gate, as vLLM's synthetic rejection sampler does, so speed is
    measured apart from the draft's quality. Seeded per request from its seed, on a stream of its
    own, so the sampled tokens are those of the same request without it."""

    def __init__(self, rate: float, seed: int):
        if not 0 <= rate <= 1:
            raise ValueError(f"synthetic acceptance rate must be in [0, 1], got {rate}")
        self.rate = rate
        self.rng = np.random.default_rng([seed, 0x5E7A])  # not the sampler's stream

    def __call__(self) -> bool:
        return bool(self.rng.random() < self.rate)


class DraftPacer:
    """Drafting steered by how often one sequence's recent drafts paid off. Every draft costs (an MTP
    head call; verified, a wider backbone step too) and gives a token only when kept, so once the
    share kept of the last ~`window` drafts (an exponential average, starting at `start`) falls below
    `min_acceptance`, the sequence stops drafting for `pause` steps, twice as long each time it falls
    again (at most `max_pause`), and tries afresh after; a pause that ends on a kept share back at
    `start` or above returns to `pause`. `min_acceptance` 0: never paused."""

    def __init__(self, min_acceptance: float, window: int = 8, start: float = 0.5, pause: int = 8,
                 max_pause: int = 128):
        if not 0 <= min_acceptance < start:
            raise ValueError(f"min_acceptance {min_acceptance:g}: a share in [0, {start:g})")
        self.min_acceptance, self.alpha, self.start = min_acceptance, 1 / window, start
        self.first_pause, self.max_pause = pause, max_pause
        self.kept_share, self.next_pause, self.paused_for = start, pause, 0
        self.pauses = 0

    def may_draft(self) -> bool:
        """Whether this step may draft; a paused step counts down its pause."""
        if self.paused_for:
            self.paused_for -= 1
            return False
        return True

    def record(self, kept: bool) -> None:
        self.kept_share += self.alpha * (kept - self.kept_share)
        if self.kept_share >= self.start:
            self.next_pause = self.first_pause
        elif self.kept_share < self.min_acceptance:
            self.paused_for, self.kept_share = self.next_pause, self.start
            self.next_pause = min(2 * self.next_pause, self.max_pause)
            self.pauses += 1


class SequenceDecoder:
    """One sequence's decisions in the decode loop, engine-free, so a loop over one sequence and a
    loop over a batch of them decide identically: sample t1 from the backbone's logits, ask for a
    draft when one may follow, sample and gate it, count, finish, and name the next pair to feed.

    With `synthetic_acceptance` (a rate; benchmark only) every step drafts, whatever the threshold,
    and a draw replaces the gate's decision; the draft is still the MTP head's sample, and a
    rejected one becomes PAD as a gate rejection does.
    """

    def __init__(self, pair_size: int, pad_id: int, eos_id: int, bos_id: int, params: SamplingParams,
                 threshold: float, prompt_pairs: int, sampler=None, synthetic_acceptance: float | None = None,
                 min_acceptance: float = 0.0):
        self.pair_size, self.pad_id, self.eos_id = pair_size, pad_id, eos_id
        self.pacer = DraftPacer(min_acceptance if synthetic_acceptance is None else 0.0)
        self.params, self.threshold = params, threshold
        self.sampler = sampler or Sampler(params)
        self.synthetic = (None if synthetic_acceptance is None
                          else SyntheticAcceptance(synthetic_acceptance, params.seed))
        self.use_mtp = pair_size == 2 and (self.synthetic is not None or drafting_enabled(threshold))
        self.banned = never_generated(pad_id, bos_id, eos_id, params.ignore_eos)
        self.position = prompt_pairs - 1  # pair index of the hidden state the next step reads
        self.produced = 0
        self.next_pair: list[int] = []

    def first_token(self, logits: np.ndarray) -> int:
        # logits: [V], the backbone's at the last pair
        return self.sampler(_masked(logits, self.banned))

    # The decode loop's view of a step: `settle` the tokens the backbone's outputs decide, run the
    # MTP head on `mtp_inputs` when `drafts_after` says so, then `finish` the step.
    discard = 0  # slots the backbone drops from the row before the next segment (a rejected draft's)

    def settle(self, logits: np.ndarray, verify_logits: np.ndarray | None = None) -> list[int]:
        return [self.first_token(logits)]

    def drafts_after(self, tokens: list[int]) -> bool:
        return self.wants_draft(tokens[0]) and self.pacer.may_draft()

    def mtp_inputs(self, tokens: list[int], hidden: np.ndarray,
                   verify_hidden: np.ndarray | None = None) -> tuple[list[int], np.ndarray, np.ndarray]:
        """(tokens, hidden [n, D], positions [n]) the MTP head reads this step; the draft follows the last."""
        return tokens, hidden[None], np.array([self.position])

    def finish(self, tokens: list[int], draft_logits: np.ndarray | None = None, confidence: float = 0.0) -> Step:
        return self.complete(tokens[0], draft_logits, confidence)

    def wants_draft(self, t1: int) -> bool:
        return self.use_mtp and t1 != self.eos_id and self.produced + 1 < self.params.max_tokens

    def complete(self, t1: int, draft_logits: np.ndarray | None = None, confidence: float = 0.0) -> Step:
        """The step's emitted tokens; afterwards `next_pair` is what the backbone reads next."""
        if t1 == self.eos_id:
            return Step([], finish_reason="eos")
        step, draft = Step([t1]), self.pad_id
        if draft_logits is not None:
            draft = self.sampler(_masked(draft_logits, self.banned))
            step.drafted = True
            step.accepted = self.synthetic() if self.synthetic is not None else gate(confidence, self.threshold)
            self.pacer.record(step.accepted)
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


class VerifyingDecoder(SequenceDecoder):
    """A token-level model with a draft head (`ModelConfig.draft_head`): a step feeds the last token
    and, when the head drafted one, the draft; the backbone's output at the last token checks it.

    Greedy: the draft is kept when it is the base's own choice there; sampling: kept with probability
    min(1, p/q), else replaced by a token drawn from max(0, p - q) (speculative sampling), so the
    output is distributed as the base's alone. A kept draft's own position gives one more token.
    `threshold`: the least top probability a draft needs to be fed (0: every draft; 1: drafting off).
    """

    def __init__(self, pad_id: int, eos_id: int, bos_id: int, params: SamplingParams, threshold: float,
                 prompt_tokens: int, sampler=None, min_acceptance: float = 0.0):
        super().__init__(1, pad_id, eos_id, bos_id, params, threshold, prompt_tokens, sampler,
                         min_acceptance=min_acceptance)
        self.use_mtp = drafting_enabled(threshold)  # `position`: the last token fed and kept, the MTP head's next entry
        self.draft: int | None = None            # fed last step, checked by this one
        self.draft_probs: np.ndarray | None = None  # the distribution it was drawn from (sampling)
        self.checked = self.kept = False          # this step checked a draft / kept it

    def settle(self, logits: np.ndarray, verify_logits: np.ndarray | None = None) -> list[int]:
        """[draft, next] when the draft holds, [the base's token instead] when not, [next] when no
        draft was fed. logits: [V] at the last position fed; verify_logits: [V] at the one before."""
        self.discard, self.checked, self.kept = 0, self.draft is not None, False
        if self.draft is None:
            return [self.first_token(logits)]
        draft, q = self.draft, self.draft_probs
        self.draft = self.draft_probs = None
        target = _masked(verify_logits, self.banned)
        p = self.sampler.distribution(target)
        chosen = int(np.argmax(target)) if p is None else None  # greedy: the base's token there
        self.kept = chosen == draft if p is None else self.sampler.rng.random() * q[draft] < p[draft]
        self.pacer.record(self.kept)
        if self.kept:
            return [draft, self.first_token(logits)]
        self.discard = 1
        if p is None:
            return [chosen]
        residual = np.maximum(p - q, 0.0)
        return [self.sampler.draw(residual / residual.sum() if residual.sum() > 0 else p)]

    def drafts_after(self, tokens: list[int]) -> bool:
        return (self.use_mtp and self.eos_id not in tokens
                and self.produced + len(tokens) + 2 <= self.params.max_tokens and self.pacer.may_draft())

    def mtp_inputs(self, tokens, hidden, verify_hidden=None):
        # the MTP head's entry at position p reads (h[p], token p+1): one per token settled
        hiddens = np.stack([verify_hidden, hidden])[:len(tokens)] if self.checked else hidden[None]
        return tokens, hiddens, self.position + np.arange(len(tokens))

    def finish(self, tokens: list[int], draft_logits: np.ndarray | None = None, confidence: float = 0.0) -> Step:
        step = Step([], drafted=self.checked, accepted=self.kept)
        for token in tokens:
            if token == self.eos_id:
                step.finish_reason = "eos"
                break
            step.tokens.append(token)
        step.tokens = step.tokens[:self.params.max_tokens - self.produced]
        self.produced += len(step.tokens)
        if step.finish_reason is None and self.produced >= self.params.max_tokens:
            step.finish_reason = "length"
        self.position += len(tokens)
        self.next_pair = [tokens[-1]]
        if step.finish_reason is None and draft_logits is not None and gate(confidence, self.threshold):
            masked = _masked(draft_logits, self.banned)
            self.draft_probs = self.sampler.distribution(masked)
            self.draft = int(np.argmax(masked)) if self.draft_probs is None else self.sampler.draw(self.draft_probs)
            self.next_pair = [tokens[-1], self.draft]
        return step


def never_generated(pad_id: int, bos_id: int, eos_id: int, ignore_eos: bool = False) -> list[int]:
    """The tokens an answer never holds: PAD, BOS (unless it is EOS too, as GPT-2's one token for both:
    the answer must end on it), and EOS when it is ignored."""
    return [pad_id] + ([bos_id] if bos_id != eos_id else []) + ([eos_id] if ignore_eos else [])


def _masked(logits: np.ndarray, banned: list[int]) -> np.ndarray:
    logits = np.array(logits, dtype=np.float32, copy=True)
    logits[banned] = -np.inf
    return logits


MAX_INCOMPLETE_TOKENS = 8  # bytes that make no whole character after this many tokens are not UTF-8


class TextStream:
    """Releases generated tokens as text becomes final: whole UTF-8 characters only, and held
    back while the text may still turn into a stop word.

    It releases token ids, not text, so whoever decodes the released groups one by one (the
    postprocessing model) gets exactly the text of the whole. A stop word ends the text at the
    last token boundary before it.

    Decoding is incremental, so its work is linear in the output however long the stop words:
    the tokenizer is byte-level BPE (a token's text is its bytes), so the tokens since the last
    whole character are decoded on their own, and become text once they end on a whole
    character; a stop word is looked for only where the new text may complete it.
    """

    def __init__(self, tokenizer: TextTokenizer, stop_words: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop_words = list(stop_words)
        self.holdback = max((len(w) for w in self.stop_words), default=1) - 1
        self.pending: list[int] = []  # generated, not released; pending[:whole] decodes to `text`
        self.whole = 0
        self.text = ""
        self.released_tokens = self.released_chars = 0
        # (tokens, characters) since the start of the stream at each token that ends a whole character
        self.boundaries: deque[tuple[int, int]] = deque()
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> list[int]:
        if self.stopped:
            return []
        searched = len(self.text)
        for token in tokens:
            self.pending.append(token)
            self._decode_tail()
        hits = [i for i in (self.text.find(w, max(0, searched - len(w) + 1)) for w in self.stop_words) if i >= 0]
        if hits:
            self.stopped = True
            released, self.pending = self._take(limit=min(hits)), []
            return released
        return self._take(limit=len(self.text) - self.holdback)

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

    def _decode_tail(self) -> None:
        """Decodes the tokens after the last whole character; once they end on one, they are text."""
        tail = self.pending[self.whole:]
        piece = self.tokenizer.decode(tail)
        if piece.endswith("\ufffd") and len(tail) < MAX_INCOMPLETE_TOKENS:
            return  # a character split across tokens: wait for its last bytes
        self.text += piece
        self.whole = len(self.pending)
        self.boundaries.append((self.released_tokens + self.whole, self.released_chars + len(self.text)))

    def _take(self, limit: int) -> list[int]:
        """Releases the longest prefix of pending tokens that ends on a whole character within
        `limit` characters of pending text."""
        count = chars = 0
        while self.boundaries and self.boundaries[0][1] - self.released_chars <= limit:
            tokens, characters = self.boundaries.popleft()
            count, chars = tokens - self.released_tokens, characters - self.released_chars
        released, self.pending, self.text = self.pending[:count], self.pending[count:], self.text[chars:]
        self.whole -= count
        self.released_tokens += count
        self.released_chars += chars
        return released


@dataclass
class Chunk:
    tokens: list[int]               # released token ids, ready to show
    steps: int = 0
    drafts: int = 0
    accepted: int = 0
    finish_reason: str | None = None  # "eos" | "length" | "stop" on the last chunk


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
