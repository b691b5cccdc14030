"""Seeded task generators with exact-match answers, plus Python standard-library text.

Three task families, each an (prompt, completion, answer) triple:
  math   multi-step arithmetic with worked steps        "Q: 7+5-3\\nA:" -> " 7+5=12 12-3=9 #9"
  lookup key/value retrieval inside a long context      " ab:12 nq:37 ...\\nget nq:" -> "37"
  code   output of a small Python function (really run) "def f(x): ...\\n# output:" -> " 7"

A lookup query ends with the key and its colon exactly as the context writes them (" nq:", leading
space included), so the answer is the value that followed the same tokens earlier in the prompt.
Long prompts: lookups with more entries, math and code questions after solved examples of the same
family and split (`sized_examples`).

The split (train, calibration, report) is a pure function of the question (a hash bucket), so
the three are disjoint by construction whatever the seeds.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import random
import string
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

FAMILIES = ("math", "lookup", "code")
SPLITS = ("train", "calibration", "report")
HELD_OUT_PERCENT = 5  # each of calibration and report
SHORT_LOOKUP_ENTRIES = (4, 12)
SHOT_POOL = 256  # solved examples that long math and code prompts draw from


@dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    completion: str
    answer: str


def split_of(family: str, prompt: str) -> str:
    digest = hashlib.sha256(f"{family}\x00{prompt}".encode()).digest()
    bucket = int.from_bytes(digest[:4], "little") % 100
    if bucket < HELD_OUT_PERCENT:
        return "calibration"
    return "report" if bucket < 2 * HELD_OUT_PERCENT else "train"


def extract_answer(family: str, completion: str) -> str:
    """The part of a completion that exact match compares."""
    if family == "math":
        return completion.rsplit("#", 1)[-1].strip() if "#" in completion else ""
    return completion.strip()


def _math(rng: random.Random) -> Example:
    while True:
        operands = [rng.randint(1, 9) for _ in range(rng.randint(3, 4))]
        ops = [rng.choice("+-") for _ in operands[1:]]
        total, steps = operands[0], []
        for op, value in zip(ops, operands[1:]):
            new_total = total + value if op == "+" else total - value
            steps.append(f"{total}{op}{value}={new_total}")
            total = new_total
            if total < 0:
                break
        if total >= 0 and len(steps) == len(ops):
            break
    expr = str(operands[0]) + "".join(f"{op}{v}" for op, v in zip(ops, operands[1:]))
    return Example("math", f"Q: {expr}\nA:", " " + " ".join(steps) + f" #{total}", str(total))


def _lookup(rng: random.Random, entries: tuple[int, int] = SHORT_LOOKUP_ENTRIES) -> Example:
    n = rng.randint(*entries)
    keys = rng.sample(_LOOKUP_KEYS, n)
    values = [f"{rng.randint(0, 99):02d}" for _ in keys]
    target = rng.randrange(n)
    context = "".join(f" {k}:{v}" for k, v in zip(keys, values))
    return Example("lookup", f"{context}\nget {keys[target]}:", values[target], values[target])


_LOOKUP_KEYS = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]


def lookup_context(example: Example) -> str:
    """A lookup prompt's key/value entries (" ab:12 nq:37 ..."), without the query."""
    return example.prompt.split("\nget ")[0]


def lookup_entries(example: Example) -> list[tuple[str, str]]:
    """A lookup prompt's (key, value) entries, in context order."""
    return [tuple(entry.split(":")) for entry in lookup_context(example).split()]


def _code_source(rng: random.Random) -> str:
    a, b, c, i = rng.randint(0, 9), rng.randint(1, 9), rng.randint(1, 9), rng.randint(0, 2)
    op = rng.choice("+-*")
    templates = [
        f"def f(x):\n    return x {op} {b}\nprint(f({a}))",
        f"def f(x):\n    if x > {b}:\n        return x - {b}\n    return x + {c}\nprint(f({a}))",
        f"def f(xs):\n    return [x {op} {b} for x in xs]\nprint(f([{a}, {c}, {b}]))",
        f"def f(xs):\n    return xs[{i}] {op} {c}\nprint(f([{a}, {b}, {c}]))",
        f"def f(x, y):\n    return max(x, y) {op} {c}\nprint(f({a}, {b}))",
    ]
    return rng.choice(templates)


def run_python(source: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<task>", "exec"), {})  # noqa: S102 - our own generated source
    return out.getvalue().strip()


def _code(rng: random.Random) -> Example:
    source = _code_source(rng)
    output = run_python(source)
    return Example("code", f"{source}\n# output:", f" {output}", output)


GENERATORS = {"math": _math, "lookup": _lookup, "code": _code}


def examples(family: str, split: str, seed: int) -> Iterator[Example]:
    """Endless stream of one family's short examples that fall into `split`."""
    rng = random.Random(f"{family}-{split}-{seed}")
    generate = GENERATORS[family]
    while True:
        example = generate(rng)
        if split_of(family, example.prompt) == split:
            yield example


def sized_examples(family: str, split: str, seed: int, count_tokens: Callable[[str], int],
                   min_tokens: int, max_tokens: int) -> Iterator[Example]:
    """Endless examples of `split` whose prompt is min_tokens..max_tokens long (count_tokens).

    A lookup gets as many entries as that takes; a math or code question comes after solved
    examples of the same family and split, added until the prompt is long enough.
    """
    rng = random.Random(f"{family}-{split}-{seed}-{min_tokens}-{max_tokens}")
    if family == "lookup":
        tokens_per_entry = 5.0
        while True:
            target = rng.randint(min_tokens, max_tokens)
            n = max(1, min(len(_LOOKUP_KEYS), round(target / tokens_per_entry)))
            example = _lookup(rng, (n, n))
            if split_of(family, example.prompt) != split:
                continue
            length = count_tokens(example.prompt)
            tokens_per_entry = 0.9 * tokens_per_entry + 0.1 * length / n
            if min_tokens <= length <= max_tokens:
                yield example
    questions = examples(family, split, seed)
    shots = shot_pool(family, split, seed)
    while True:
        target = rng.randint(min_tokens, max_tokens)
        query = next(questions)
        before, estimate = [], count_tokens(query.prompt)
        while estimate < target:  # the sum of the parts' lengths, checked whole below
            shot = rng.choice(shots)
            if shot.prompt == query.prompt:  # never show the question with its answer
                continue
            before.insert(0, shot)
            estimate += count_tokens(solved(shot)) - 1
        example = after_solved(query, before)
        if min_tokens <= count_tokens(example.prompt) <= max_tokens:
            yield example


def solved(example: Example) -> str:
    """A solved example as it precedes a question."""
    return f"{example.prompt}{example.completion}\n\n"


def after_solved(query: Example, shots: list[Example]) -> Example:
    """`query` asked after the solved `shots` (none may be the query itself)."""
    return Example(query.family, "".join(map(solved, shots)) + query.prompt, query.completion, query.answer)


def shot_pool(family: str, split: str, seed: int) -> list[Example]:
    """The solved examples that questions of `family` in `split` draw from."""
    return list(itertools.islice(examples(family, split, seed + 1), SHOT_POOL))


def eval_set(family: str, count: int, seed: int = 0, split: str = "calibration") -> list[Example]:
    """The first `count` distinct short examples of a family in a held-out split."""
    return distinct(examples(family, split, seed), count)


def question(example: Example) -> str:
    """What a prompt asks: after any solved examples, the last paragraph."""
    return example.prompt.rsplit("\n\n", 1)[-1]


def distinct(stream: Iterator[Example], count: int) -> list[Example]:
    """The first `count` examples that ask distinct questions (solved examples before them aside)."""
    seen: dict[str, Example] = {}
    for example in stream:
        seen.setdefault(question(example), example)
        if len(seen) == count:
            return list(seen.values())
    raise AssertionError("unreachable")


def stdlib_files(split: str) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    return [p for p in files if split_of("text", p.name) == split]


def stdlib_chunks(split: str, chunk_chars: int, seed: int | str) -> Iterator[str]:
    """Endless random chunks of standard-library source."""
    rng = random.Random(f"text-{split}-{seed}")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(split)]
    texts = [t for t in texts if len(t) > chunk_chars]
    while True:
        text = rng.choice(texts)
        start = rng.randrange(len(text) - chunk_chars)
        yield text[start:start + chunk_chars]
