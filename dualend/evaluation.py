"""Exact-match evaluation on the held-out split: pass@1 (greedy), pass@k (sampled), speed stats."""
from __future__ import annotations

from dataclasses import dataclass

from .data import FAMILIES, Example, eval_set, extract_answer
from .decode import Components, SamplingParams, generate_text
from .model import LanguageModel
from .reference import TorchComponents
from .tokenizer import TextTokenizer

MAX_ANSWER_TOKENS = 48


@dataclass
class FamilyResult:
    correct: int = 0
    total: int = 0
    tokens: int = 0  # generated tokens, EOS included: a step that emits EOS did a token's work
    steps: int = 0
    drafts: int = 0
    accepted: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.total)


def run_examples(components: Components, tokenizer: TextTokenizer, examples: list[Example],
                 threshold: float, samples: int = 1, temperature: float = 0.0,
                 seed: int = 0) -> FamilyResult:
    """An example passes when any of its `samples` generations has the exact answer."""
    result = FamilyResult()
    for index, example in enumerate(examples):
        passed = False
        for k in range(samples):
            params = SamplingParams(max_tokens=MAX_ANSWER_TOKENS, temperature=temperature,
                                    seed=seed * 100003 + index * 101 + k)
            out = generate_text(components, tokenizer, example.prompt, params, threshold)
            passed |= extract_answer(example.family, out.text) == example.answer
            result.tokens += len(out.tokens) + (out.finish_reason == "eos")
            result.steps += out.steps
            result.drafts += out.drafts
            result.accepted += out.accepted
        result.correct += passed
        result.total += 1
    return result


def evaluate_pass1(model: LanguageModel, tokenizer: TextTokenizer, count: int, seed: int,
                   threshold: float = 0.5) -> dict[str, float]:
    components = TorchComponents(model)
    return {f: run_examples(components, tokenizer, eval_set(f, count, seed), threshold).accuracy
            for f in FAMILIES}
