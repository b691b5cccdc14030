"""Training samples, batches and losses for the baseline and the dual-end model."""
from __future__ import annotations

import multiprocessing
import random
from dataclasses import dataclass
from queue import Empty, Full
from typing import Iterator

import torch
import torch.nn.functional as F

from dualend.engine.decode import pad_prompt
from dualend.engine.model import LanguageModel
from dualend.engine.tokenizer import TextTokenizer

from .data import (
    FAMILIES,
    Example,
    after_solved,
    examples,
    lookup_context,
    lookup_entries,
    shot_pool,
    sized_examples,
    stdlib_chunks,
)

IGNORE = -100
MAX_COMPLETION_TOKENS = 64  # room left after a long prompt for its answer
TRAIN_MIX = "math=2,lookup=2,code=2"  # families drawn with these weights
LONG_TEXT_FRACTION = 0.25  # at least this share of long rows is text, whatever the short mix
# A training lookup row asks up to this many more keys of the same context, each value carrying loss.
LOOKUP_EXTRA_QUERIES = 8
# This share of training lookups is instead a copy of the context after itself, loss on every token:
# dense practice in finding earlier tokens and copying what followed them, which lookup needs.
LOOKUP_COPY_FRACTION = 0.5
# This share of short math and code rows follows one or two solved examples: the format of long
# prompts in short rows, and prompts of both lengths' parities (a math question alone always
# tokenizes to an even length, so without them the PAD after BOS would never be met in math).
SHORT_SHOTS_FRACTION = 0.5


@dataclass
class Sample:
    prompt: list[int]      # starts with BOS
    completion: list[int]  # ends with EOS; the only part that carries loss ...
    silent: frozenset[int] = frozenset()  # ... but for these completion indices, shown without loss


def task_sample(tokenizer: TextTokenizer, example: Example, rng: random.Random) -> Sample:
    """A task example; a lookup also asks up to LOOKUP_EXTRA_QUERIES more keys of its context, or
    becomes a copy of its context (LOOKUP_COPY_FRACTION)."""
    if example.family == "lookup" and rng.random() < LOOKUP_COPY_FRACTION:
        return copy_sample(tokenizer, lookup_context(example))
    if example.family == "lookup" and LOOKUP_EXTRA_QUERIES:
        return lookup_sample(tokenizer, example, more_queries(example, rng, rng.randint(0, LOOKUP_EXTRA_QUERIES)))
    return Sample(tokenizer.encode_prompt(example.prompt),
                  tokenizer.encode(example.completion) + [tokenizer.eos_id])


def more_queries(example: Example, rng: random.Random, count: int) -> list[tuple[str, str]]:
    """`count` (key, value) entries of a lookup's context, drawn with replacement."""
    entries = lookup_entries(example)
    return [rng.choice(entries) for _ in range(count)]


def lookup_sample(tokenizer: TextTokenizer, example: Example, queries: list[tuple[str, str]]) -> Sample:
    """A lookup whose completion goes on to ask more keys of the same context, in the format of the
    first question, so one row teaches several retrievals: every value carries loss, the further
    questions (`\nget key:`) are shown without loss, and EOS follows the last value only. So the
    model never learns to go on after a value: asked one key, it answers it and stops."""
    completion, silent = tokenizer.encode(example.completion), set()
    for key, value in queries:
        question = tokenizer.encode(f"\nget {key}:")
        silent.update(range(len(completion), len(completion) + len(question)))
        completion += question + tokenizer.encode(value)
    return Sample(tokenizer.encode_prompt(example.prompt), completion + [tokenizer.eos_id], frozenset(silent))


def copy_sample(tokenizer: TextTokenizer, context: str) -> Sample:
    """The context, then a newline and the context again, as far as MAX_COMPLETION_TOKENS allows;
    the copy carries loss, the EOS after a cut copy does not (it is not where the copy ends)."""
    copy = tokenizer.encode("\n" + context)
    cut = copy[:MAX_COMPLETION_TOKENS - 1]
    silent = frozenset() if len(cut) == len(copy) else frozenset({len(cut)})
    return Sample(tokenizer.encode_prompt(context), cut + [tokenizer.eos_id], silent)


def text_sample(tokenizer: TextTokenizer, chunk: str, tokens: int) -> Sample:
    """A text chunk cut to `tokens` tokens, BOS and EOS included; all of it carries loss."""
    return Sample([tokenizer.bos_id], tokenizer.encode(chunk)[: tokens - 2] + [tokenizer.eos_id])


def sample_stream(tokenizer: TextTokenizer, seed: int, text_fraction: float, max_tokens: int,
                  text_tokens: int = 96, families: tuple[str, ...] = FAMILIES) -> Iterator[Sample]:
    """Endless mix of short task examples and standard-library text (all text carries loss).

    Text chunks are kept near task length so a batch is not padded out by one long chunk.
    """
    rng = random.Random(seed)
    streams = {f: examples(f, "train", seed) for f in families}
    shots = {f: shot_pool(f, "train", seed) for f in set(families) & {"math", "code"}}
    text = stdlib_chunks("train", chunk_chars=4 * text_tokens, seed=seed)
    while True:
        if rng.random() < text_fraction:
            yield text_sample(tokenizer, next(text), text_tokens)
            continue
        example = next(streams[rng.choice(families)])
        if example.family in shots and rng.random() < SHORT_SHOTS_FRACTION:
            before = [rng.choice(shots[example.family]) for _ in range(rng.randint(1, 2))]
            if all(shot.prompt != example.prompt for shot in before):  # never the question with its answer
                example = after_solved(example, before)
        sample = task_sample(tokenizer, example, rng)
        if len(sample.prompt) + len(sample.completion) <= max_tokens:
            yield sample


def long_sample_stream(tokenizer: TextTokenizer, seed: int, text_fraction: float, min_tokens: int,
                       max_tokens: int, families: tuple[str, ...] = FAMILIES) -> Iterator[Sample]:
    """Endless samples min_tokens..max_tokens long: long lookups, math and code after solved
    examples, and text."""
    rng = random.Random(seed)
    budget = max_tokens - MAX_COMPLETION_TOKENS
    streams = {f: sized_examples(f, "train", seed, tokenizer.prompt_length, min_tokens, budget) for f in families}
    text = stdlib_chunks("train", chunk_chars=5 * max_tokens, seed=seed)
    while True:
        if rng.random() < text_fraction:
            sample = text_sample(tokenizer, next(text), rng.randint(min_tokens, max_tokens))
            if len(sample.completion) + 1 >= min_tokens:
                yield sample
            continue
        yield task_sample(tokenizer, next(streams[rng.choice(families)]), rng)


def family_draws(mix: str) -> tuple[str, ...]:
    """"math=2,lookup=3,code=1" -> each family repeated by its weight, for rng.choice."""
    draws = []
    for part in mix.split(","):
        family, _, weight = part.partition("=")
        if family not in FAMILIES or not weight.isdigit():
            raise ValueError(f"bad family mix {mix!r}: expected family=weight pairs of {FAMILIES}, e.g. {TRAIN_MIX}")
        draws += [family] * int(weight)
    if not draws:
        raise ValueError(f"family mix {mix!r} draws no family")
    return tuple(draws)


def batch_stream(tokenizer: TextTokenizer, seed: int, *, batch_size: int, text_fraction: float,
                 short_tokens: int, context: int, long_fraction: float, mix: str = TRAIN_MIX,
                 long_buckets: int = 4) -> Iterator[list[Sample]]:
    """Batches of short samples, and with probability `long_fraction` a batch from one of
    `long_buckets` length ranges between short_tokens and context, sized to about as many tokens
    as a short batch holds, so rows of one batch are of similar length. Task families are drawn
    by the weights of `mix`."""
    rng = random.Random(seed)
    families = family_draws(mix)
    short = sample_stream(tokenizer, seed, text_fraction, short_tokens, families=families)
    edges = [short_tokens + (context - short_tokens) * i // long_buckets for i in range(long_buckets + 1)]
    long = [long_sample_stream(tokenizer, seed + i, max(text_fraction, LONG_TEXT_FRACTION), edges[i] + 1, edges[i + 1],
                               families)
            for i in range(long_buckets)] if context > short_tokens else []
    while True:
        if long and rng.random() < long_fraction:
            bucket = rng.randrange(long_buckets)
            rows = max(1, batch_size * short_tokens // (2 * edges[bucket + 1]))
            yield [next(long[bucket]) for _ in range(rows)]
        else:
            yield [next(short) for _ in range(batch_size)]


def _produce_batches(queue, tokenizer: TextTokenizer, seed: int, settings: dict) -> None:
    parent = multiprocessing.parent_process()
    for batch in batch_stream(tokenizer, seed, **settings):
        while True:  # a full queue waits for the trainer, but not for a trainer that died
            try:
                queue.put(batch, timeout=1.0)
                break
            except Full:
                if not parent.is_alive():
                    return


def batch_stream_in_workers(tokenizer: TextTokenizer, seed: int, workers: int, **settings) -> Iterator[list[Sample]]:
    """batch_stream drawn by `workers` processes with seeds of their own, for a trainer (on a GPU)
    that consumes batches faster than one Python process builds them. The order between workers
    is not reproducible; each worker's batches are. A worker that dies stops the stream with its
    exit code; closing the stream ends the workers."""
    context = multiprocessing.get_context("forkserver")  # workers never share the trainer's threads or CUDA
    queue = context.Queue(maxsize=8 * workers)
    processes = [context.Process(target=_produce_batches, args=(queue, tokenizer, seed * 1000 + worker, settings),
                                 daemon=True) for worker in range(workers)]
    for process in processes:
        process.start()
    try:
        while True:
            try:
                yield queue.get(timeout=5.0)
            except Empty:
                dead = [p.exitcode for p in processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{len(dead)} of {workers} batch workers died (exit codes {dead})") from None
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(5)


def gated_pairs(completion: list[int], reject_ratio: float, pad_id: int,
                rng: random.Random) -> list[int]:
    """The completion as the decode loop would feed it back if the gate rejected each draft with
    probability `reject_ratio`: every step is a pair (t1, t2), or (t1, PAD) on a rejection, and
    the next step starts at the token after the last one emitted. So a rejection shifts the pair
    boundaries of everything after it by one token, exactly as at serving time.
    """
    out: list[int] = []
    position = 0
    while position < len(completion):
        rest = completion[position:position + 2]
        if len(rest) == 1 or rng.random() < reject_ratio:
            out += [rest[0], pad_id]
            position += 1
        else:
            out += rest
            position += 2
    return out


def split_pairs(completion: list[int], reject_ratio: float, pad_id: int,
                rng: random.Random) -> list[int]:
    """The earlier augmentation, kept for the ablation: each pair (a, b) becomes (a, PAD), (b, PAD)
    with probability `reject_ratio`, so pair boundaries never shift (unlike serving)."""
    out: list[int] = []
    for start in range(0, len(completion), 2):
        pair = completion[start:start + 2]
        if len(pair) == 2 and rng.random() >= reject_ratio:
            out += pair
        else:
            out += [token for t in pair for token in (t, pad_id)]
    return out


AUGMENTATIONS = {"gated-steps": gated_pairs, "split-pairs": split_pairs}


def draw_reject_ratio(rng: random.Random) -> float:
    """Covers the whole threshold range: never reject, always reject, and everything between."""
    u = rng.random()
    if u < 0.3:
        return 0.0
    if u < 0.5:
        return 1.0
    return rng.random()


@dataclass
class DualEndRow:
    pairs: list[int]         # [2n] tokens, read as n pairs
    next_token: list[int]    # [n] backbone target at pair i (first token of pair i+1), IGNORE where no loss
    mtp_input: list[int]     # [n] what the MTP head reads at pair i: that same token, also where it
                             # carries no loss (PAD before the prompt's last pair and past the end)
    draft_target: list[int]  # [n] MTP target: the real token after next_token
    real_tokens: list[int]   # the sequence without any PAD, what the baseline teacher reads
    next_index: list[int]    # [n] index in real_tokens of next_token, or -1
    draft_index: list[int]   # [n] index in real_tokens of draft_target, or -1
    mtp_start: int           # first pair whose MTP state is inside the decode window


def dualend_row(sample: Sample, pad_id: int, reject_ratio: float, rng: random.Random,
                augment=gated_pairs) -> DualEndRow:
    prompt = pad_prompt(sample.prompt, 2, pad_id)
    answer = augment(sample.completion, reject_ratio, pad_id, rng)
    sequence = prompt + answer
    real_tokens = sample.prompt + sample.completion
    # real index of every non-PAD slot of `sequence`
    real_index, counter = [], 0
    for token in sequence:
        real_index.append(counter if token != pad_id else -1)
        counter += token != pad_id
    n_pairs, n_prompt_pairs = len(sequence) // 2, len(prompt) // 2
    next_token, mtp_input, draft_target, next_index, draft_index = [], [], [], [], []
    for i in range(n_pairs):
        slot = 2 * (i + 1)
        if i < n_prompt_pairs - 1 or slot >= len(sequence):
            next_token.append(IGNORE), draft_target.append(IGNORE), mtp_input.append(pad_id)
            next_index.append(-1), draft_index.append(-1)
            continue
        mtp_input.append(sequence[slot])
        r = real_index[slot]
        trained = r - len(sample.prompt) not in sample.silent
        next_token.append(sequence[slot] if trained else IGNORE)
        next_index.append(r if trained else -1)
        has_draft = r + 1 < len(real_tokens) and r + 1 - len(sample.prompt) not in sample.silent
        draft_target.append(real_tokens[r + 1] if has_draft else IGNORE)
        draft_index.append(r + 1 if has_draft else -1)
    return DualEndRow(sequence, next_token, mtp_input, draft_target, real_tokens, next_index, draft_index,
                      n_prompt_pairs - 1)


def _pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def baseline_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    tokens = [s.prompt + s.completion for s in samples]
    labels = [[IGNORE] * (len(s.prompt) - 1) + [IGNORE if i in s.silent else t for i, t in enumerate(s.completion)]
              + [IGNORE] for s in samples]
    return {"tokens": _pad_rows(tokens, pad_id), "labels": _pad_rows(labels, IGNORE)}


def dualend_batch(samples: list[Sample], pad_id: int, rng: random.Random,
                  reject_ratio: float | None = None, augment=gated_pairs) -> dict[str, torch.Tensor]:
    rows = [dualend_row(s, pad_id, draw_reject_ratio(rng) if reject_ratio is None else reject_ratio, rng,
                        augment) for s in samples]
    n = max(len(r.next_token) for r in rows)
    pair_index = torch.arange(n)[None]
    return {
        "pairs": _pad_rows([r.pairs for r in rows], pad_id).view(len(rows), -1, 2),
        "next_token": _pad_rows([r.next_token for r in rows], IGNORE),
        "mtp_input": _pad_rows([r.mtp_input for r in rows], pad_id),
        "draft_target": _pad_rows([r.draft_target for r in rows], IGNORE),
        "real_tokens": _pad_rows([r.real_tokens for r in rows], pad_id),
        "next_index": _pad_rows([r.next_index for r in rows], -1),
        "draft_index": _pad_rows([r.draft_index for r in rows], -1),
        "mtp_valid": pair_index >= torch.tensor([r.mtp_start for r in rows])[:, None],
    }


def _positions(batch: int, length: int) -> torch.Tensor:
    return torch.arange(length)[None].expand(batch, length)


def baseline_forward(model: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of a token-level model over whole sequences."""
    batch, length = tokens.shape
    hidden, _, _ = model.backbone(model.latents(tokens[..., None]), _positions(batch, length),
                                  torch.ones_like(tokens, dtype=torch.bool))
    return model.lm_head(hidden)


def baseline_loss(model: LanguageModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    logits = baseline_forward(model, batch["tokens"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
    return loss, {"ce": loss.item()}


def teacher_targets(teacher_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Teacher distribution that predicted real token `index` (logits at index - 1)."""
    gather_at = (index - 1).clamp(min=0)
    picked = torch.gather(teacher_logits, 1, gather_at[..., None].expand(-1, -1, teacher_logits.shape[-1]))
    return picked.softmax(-1)


def _ce_with_soft(logits, hard, soft, distill_weight):
    """(training loss, hard-label cross-entropy); the second is what logs report."""
    valid = hard != IGNORE
    if not valid.any():
        zero = logits.sum() * 0.0
        return zero, zero
    ce = F.cross_entropy(logits[valid], hard[valid])
    if soft is None or distill_weight == 0:
        return ce, ce
    soft_ce = -(soft[valid] * logits[valid].log_softmax(-1)).sum(-1).mean()
    return (1 - distill_weight) * ce + distill_weight * soft_ce, ce


def dualend_loss(model: LanguageModel, batch: dict[str, torch.Tensor],
                 teacher: LanguageModel | None = None, distill_weight: float = 0.0,
                 confidence_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    pairs, next_token, draft_target = batch["pairs"], batch["next_token"], batch["draft_target"]
    n_batch, n_pairs, _ = pairs.shape
    positions = _positions(n_batch, n_pairs)
    hidden, _, _ = model.backbone(model.latents(pairs), positions,
                                  torch.ones(n_batch, n_pairs, dtype=torch.bool))
    next_logits = model.lm_head(hidden)  # [B, n, V]
    # teacher forcing: the MTP head reads the gold first token, also where that token carries no loss
    draft_logits, confidence, _, _ = model.mtp_forward(batch["mtp_input"], hidden, positions, batch["mtp_valid"])

    next_soft = draft_soft = None
    if teacher is not None and distill_weight > 0:
        with torch.no_grad():
            teacher_logits = baseline_forward(teacher, batch["real_tokens"])
        next_soft = teacher_targets(teacher_logits, batch["next_index"])
        draft_soft = teacher_targets(teacher_logits, batch["draft_index"])
    next_loss, next_ce = _ce_with_soft(next_logits, next_token, next_soft, distill_weight)
    draft_loss, draft_ce = _ce_with_soft(draft_logits, draft_target, draft_soft, distill_weight)

    valid = draft_target != IGNORE
    with torch.no_grad():
        p_gold = draft_logits.softmax(-1).gather(-1, draft_target.clamp(min=0)[..., None]).squeeze(-1)
    confidence_loss = F.binary_cross_entropy(confidence[valid], p_gold[valid]) if valid.any() \
        else confidence.sum() * 0.0
    loss = next_loss + draft_loss + confidence_weight * confidence_loss
    return loss, {"next": next_ce.item(), "draft": draft_ce.item(), "conf": confidence_loss.item()}
