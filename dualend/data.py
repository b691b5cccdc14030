"""Seeded task generators with exact-match answers, plus Python standard-library text.

Three task families, each an (prompt, completion, answer) triple:
  math   multi-step arithmetic with worked steps        "Q: 7+5-3\\nA:" -> " 7+5=12 12-3=9 #9"
  lookup key/value retrieval inside a long context      "... nq:37 ...\\nget nq\\nA:" -> " 37"
  code   output of a small Python function (really run) "def f(x): ...\\n# output:" -> " 7"

Train and evaluation splits are a pure function of the prompt (a hash bucket), so they are
disjoint by construction whatever the seeds.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import random
import string
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

FAMILIES = ("math", "lookup", "code")
EVAL_PERCENT = 10


@dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    completion: str
    answer: str


def split_of(family: str, prompt: str) -> str:
    digest = hashlib.sha256(f"{family}\x00{prompt}".encode()).digest()
    return "eval" if int.from_bytes(digest[:4], "little") % 100 < EVAL_PERCENT else "train"


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


def _lookup(rng: random.Random, min_pairs: int = 4, max_pairs: int = 12) -> Example:
    n = rng.randint(min_pairs, max_pairs)
    keys: list[str] = []
    while len(keys) < n:
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(2))
        if key not in keys:
            keys.append(key)
    values = [f"{rng.randint(0, 99):02d}" for _ in keys]
    target = rng.randrange(n)
    context = " ".join(f"{k}:{v}" for k, v in zip(keys, values))
    return Example("lookup", f"{context}\nget {keys[target]}\nA:", f" {values[target]}", values[target])


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
    """Endless stream of one family's examples that fall into `split`."""
    rng = random.Random(f"{family}-{split}-{seed}")
    generate = GENERATORS[family]
    while True:
        example = generate(rng)
        if split_of(family, example.prompt) == split:
            yield example


def eval_set(family: str, count: int, seed: int = 0) -> list[Example]:
    """The first `count` distinct evaluation examples of a family."""
    seen: dict[str, Example] = {}
    for example in examples(family, "eval", seed):
        seen.setdefault(example.prompt, example)
        if len(seen) == count:
            return list(seen.values())
    raise AssertionError("unreachable")


def stdlib_files(split: str) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    return [p for p in files if split_of("text", p.name) == split]


def stdlib_chunks(split: str, chunk_chars: int, seed: int) -> Iterator[str]:
    """Endless random chunks of standard-library source."""
    rng = random.Random(f"text-{split}-{seed}")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(split)]
    texts = [t for t in texts if len(t) > chunk_chars]
    while True:
        text = rng.choice(texts)
        start = rng.randrange(len(text) - chunk_chars)
        yield text[start:start + chunk_chars]
