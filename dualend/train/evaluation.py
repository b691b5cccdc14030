"""Exact-match evaluation on held-out splits, and teacher-forced loss on held-out text.

Task examples are generated in batches on the torch model (`reference.TorchBatch`), one prefill
per batch shared by every setting (threshold, samples), so a threshold sweep costs decode steps
only. Every figure is kept per example, so two models can be compared pairwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dualend.engine.decode import Generation, SamplingParams, gate
from dualend.engine.model import LanguageModel
from dualend.engine.reference import TorchBatch, generate_batch
from dualend.engine.tokenizer import TextTokenizer

from .data import FAMILIES, Example, distinct, examples, extract_answer, sized_examples

MAX_ANSWER_TOKENS = 48
SHORT_PROMPT_TOKENS = 128  # the short bucket: prompts under this many tokens (BOS included)
BUCKETS = ("short", "long")  # long: prompts over half the trained context
POSITION_BUCKETS = ((0, 96), (96, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096))


@dataclass(frozen=True)
class Setting:
    threshold: float
    samples: int = 1          # pass@samples: any of them right
    temperature: float = 0.0


@dataclass
class Outcome:
    """One example under one setting, summed over its samples."""
    passed: bool
    tokens: int    # generated tokens, EOS not counted
    eos: int       # generations that ended on EOS (EOS is a token's work, not a token's text)
    steps: int
    drafts: int
    accepted: int


def outcome(example: Example, tokenizer: TextTokenizer, generations: list[Generation]) -> Outcome:
    def right(g: Generation) -> bool:
        return extract_answer(example.family, tokenizer.decode(g.tokens)) == example.answer

    return Outcome(any(right(g) for g in generations), sum(len(g.tokens) for g in generations),
                   sum(g.finish_reason == "eos" for g in generations), sum(g.steps for g in generations),
                   sum(g.drafts for g in generations), sum(g.accepted for g in generations))


def bucket_set(family: str, bucket: str, split: str, count: int, tokenizer: TextTokenizer,
               context: int, seed: int = 0) -> list[Example]:
    """`count` distinct examples of a held-out split whose prompts fall in a length bucket."""
    if bucket == "short":
        stream = (e for e in examples(family, split, seed) if tokenizer.prompt_length(e.prompt) < SHORT_PROMPT_TOKENS)
    else:
        stream = sized_examples(family, split, seed, tokenizer.prompt_length, context // 2 + 1,
                                context - MAX_ANSWER_TOKENS)
    return distinct(stream, count)


def evaluate_settings(model: LanguageModel, tokenizer: TextTokenizer, examples_: list[Example],
                      settings: dict[str, Setting], seed: int = 0, batch_size: int = 32,
                      progress=None) -> dict[str, list[Outcome]]:
    """Every example under every setting; outcomes in the order of `examples_`."""
    order = sorted(range(len(examples_)), key=lambda i: len(examples_[i].prompt))
    results: dict[str, list[Outcome | None]] = {name: [None] * len(examples_) for name in settings}
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = TorchBatch(model, [tokenizer.encode_prompt(examples_[i].prompt) for i in rows], MAX_ANSWER_TOKENS)
        for name, setting in settings.items():
            generations = [generate_batch(batch, [SamplingParams(MAX_ANSWER_TOKENS, setting.temperature,
                                                                 seed=seed * 100003 + i * 101 + k) for i in rows],
                                          setting.threshold) for k in range(setting.samples)]
            for column, i in enumerate(rows):
                results[name][i] = outcome(examples_[i], tokenizer, [g[column] for g in generations])
        if progress is not None:
            progress.update(len(rows))
    return results


def summary(outcomes: list[Outcome]) -> dict:
    tokens, eos = sum(o.tokens for o in outcomes), sum(o.eos for o in outcomes)
    steps, drafts = sum(o.steps for o in outcomes), sum(o.drafts for o in outcomes)
    return {"pass": round(sum(o.passed for o in outcomes) / max(1, len(outcomes)), 4),
            "tokens_per_step_no_eos": round(tokens / max(1, steps), 4),
            "tokens_per_step_with_eos": round((tokens + eos) / max(1, steps), 4),
            "acceptance_rate": round(sum(o.accepted for o in outcomes) / max(1, drafts), 4)}


def paired_difference(treated: list[Outcome], control: list[Outcome], draws: int = 4000,
                      seed: int = 0) -> dict:
    """Mean of treated - control pass (same examples), with a 95% paired bootstrap interval."""
    if not treated:
        return {"diff": float("nan"), "low": float("nan"), "high": float("nan")}
    diff = np.array([t.passed for t in treated], float) - np.array([c.passed for c in control], float)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(draws, len(diff)))].mean(1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"diff": round(float(diff.mean()), 4), "low": round(float(low), 4), "high": round(float(high), 4)}


def evaluate_pass1(model: LanguageModel, tokenizer: TextTokenizer, count: int, context: int, seed: int,
                   threshold: float = 0.5) -> dict[str, float]:
    """Greedy accuracy per family and length bucket on the calibration split (training's pick)."""
    accuracy = {}
    for family in FAMILIES:
        for bucket in BUCKETS:
            examples_ = bucket_set(family, bucket, "calibration", count, tokenizer, context, seed)
            outcomes = evaluate_settings(model, tokenizer, examples_, {"greedy": Setting(threshold)})["greedy"]
            accuracy[f"{family}/{bucket}"] = summary(outcomes)["pass"]
    return accuracy


# ---- general text, teacher-forced ------------------------------------------------------------

@dataclass
class TextLoss:
    """Per gold token of each chunk: the NLL of whoever emitted it, and which head that was."""
    nll: np.ndarray          # [rows, tokens]
    by_draft: np.ndarray     # [rows, tokens] bool: an accepted draft emitted it
    confidence: list[float]  # every draft the MTP head proposed ...
    draft_right: list[bool]  # ... and whether its greedy token was the gold one


@torch.no_grad()
def teacher_forced_text(model: LanguageModel, bos_id: int, chunks: list[list[int]], threshold: float) -> TextLoss:
    """Feeds each chunk as the decode loop would if it generated exactly that text: the backbone
    predicts the next gold token, the MTP head drafts the one after, the gate decides, and the next
    pair is (t1, t2) or (t1, PAD) as at serving time. A baseline predicts every token itself."""
    cfg = model.cfg
    rows, length = len(chunks), min(len(c) for c in chunks)
    gold = np.array([c[:length] for c in chunks])  # [rows, tokens]
    batch = TorchBatch(model, [[bos_id]] * rows, max_steps=length)
    logits, _ = batch.restart()
    nll, by_draft = np.zeros(gold.shape), np.zeros(gold.shape, bool)
    confidence, draft_right = [], []
    pointer, steps = np.zeros(rows, int), 0
    drafting = cfg.is_dualend and threshold < 1
    while (pointer < length).any() and steps < length:
        index = np.minimum(pointer, length - 1)
        t1 = gold[np.arange(rows), index]
        log_probs = torch.from_numpy(logits).log_softmax(-1).numpy()
        nll[np.arange(rows), index] = np.where(pointer < length, -log_probs[np.arange(rows), t1],
                                               nll[np.arange(rows), index])
        pairs = np.stack([t1, np.full(rows, cfg.pad_id)], 1) if cfg.is_dualend else t1[:, None]
        advance = np.ones(rows, int)
        if drafting:
            draft_logits, conf = batch.draft(t1)
            draft_log_probs = torch.from_numpy(draft_logits).log_softmax(-1).numpy()
            for row in np.flatnonzero(pointer + 1 < length):
                t2 = gold[row, pointer[row] + 1]
                confidence.append(float(conf[row]))
                draft_right.append(int(draft_logits[row].argmax()) == t2)
                if gate(float(conf[row]), threshold):
                    nll[row, pointer[row] + 1] = -draft_log_probs[row, t2]
                    by_draft[row, pointer[row] + 1] = True
                    pairs[row, 1], advance[row] = t2, 2
        pointer += advance
        steps += 1
        if (pointer < length).any():
            logits, _ = batch.step(pairs)
    return TextLoss(nll, by_draft, confidence, draft_right)


def tokens_per_step(loss: TextLoss) -> float:
    """Tokens per decode step over all rows: each row takes a step for every token its backbone emits
    (a drafted one rides along), however long the others take."""
    return loss.nll.size / max(1, int((~loss.by_draft).sum()))


def loss_by_position(loss: TextLoss, length: int) -> list[dict]:
    table = []
    for low, high in POSITION_BUCKETS:
        if low >= length:
            break
        part = slice(low, min(high, length))
        nll, draft = loss.nll[:, part], loss.by_draft[:, part]
        table.append({"positions": f"{low}-{min(high, length) - 1}", "all": round(float(nll.mean()), 4),
                      "backbone_tokens": round(float(nll[~draft].mean()), 4) if (~draft).any() else None,
                      "draft_tokens": round(float(nll[draft].mean()), 4) if draft.any() else None})
    return table


def reliability(confidence: list[float], right: list[bool], bins: int = 10) -> dict:
    """Reliability table and expected calibration error of the confidence head."""
    confidence_, right_ = np.asarray(confidence), np.asarray(right, float)
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(confidence_, edges) - 1, 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            mean_conf, accuracy = float(confidence_[mask].mean()), float(right_[mask].mean())
            ece += mask.mean() * abs(mean_conf - accuracy)
            table.append({"bin": f"{edges[b]:.1f}-{edges[b + 1]:.1f}", "count": int(mask.sum()),
                          "mean_confidence": round(mean_conf, 4), "accuracy": round(accuracy, 4)})
    return {"table": table, "ece": round(float(ece), 4), "drafts": len(confidence_)}
