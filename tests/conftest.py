import json
import threading
import time

import pytest
import torch

from builder.export import export_checkpoint
from dualend.engine.checkpoint import Checkpoint
from dualend.engine.model import LanguageModel, ModelConfig
from dualend.engine.tokenizer import TextTokenizer, train_tokenizer
from dualend.train.data import FAMILIES, eval_set


def pytest_configure(config):
    config.addinivalue_line("markers", "server: starts a real tritonserver")
    config.addinivalue_line("markers", "slow: loads a real model (SmolLM2, hundreds of MB) and its reference")
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> TextTokenizer:
    texts = [e.prompt + e.completion for f in FAMILIES for e in eval_set(f, 40)]
    return TextTokenizer(train_tokenizer(texts, vocab_size=300))


def tiny_model(tokenizer: TextTokenizer, pair_size: int, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id,
                      eos_id=tokenizer.eos_id, pair_size=pair_size, d_model=32, n_layers=2, n_heads=2,
                      ffn_hidden=64)
    return LanguageModel(cfg).eval()


@pytest.fixture(scope="session")
def exported(tiny_tokenizer, tmp_path_factory):
    """An untrained baseline and dual-end model, and the baseline with a draft head (its block the
    baseline's last, perturbed a little: its drafts kept; more: dropped), exported: {name: (checkpoint, directory)}."""
    from dualend.train.draft_head import with_draft_head

    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, pair_size in (("baseline", 1), ("dualend", 2)):
        checkpoint = Checkpoint(tiny_model(tiny_tokenizer, pair_size, seed=pair_size), tiny_tokenizer)
        export_checkpoint(checkpoint, root / name)
        out[name] = (checkpoint, root / name)
    for name, noise in (("baseline_mtp", 0.1), ("baseline_mtp_wrong", 0.3)):
        torch.manual_seed(5)
        drafting = with_draft_head(out["baseline"][0].model)
        with torch.no_grad():
            for weight in drafting.mtp.parameters():
                weight.add_(noise * torch.randn_like(weight))
        checkpoint = Checkpoint(drafting.eval(), tiny_tokenizer)
        export_checkpoint(checkpoint, root / name)
        out[name] = (checkpoint, root / name)
    return out


def until_launcher_serves(process) -> None:
    """Reads `python -m dualend.ops.launch`'s output up to its serving line (an AssertionError if it exits
    first), then on in a thread of its own to the end: a full pipe would block the launcher."""
    for line in process.stdout:
        if "Ctrl-C or SIGTERM stops it" in line:
            break
    else:
        raise AssertionError(f"the launcher exited before serving (code {process.wait()})")
    threading.Thread(target=process.stdout.read, daemon=True).start()


def wait_for(condition, timeout_s=10.0, poll_s=0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


def malformed_bodies(model: str, prompt_field: str) -> list[tuple[str, bytes, bool]]:
    """(what, body, unusable): what careless and hostile clients send, by syntax, encoding, size, nesting
    and type. `unusable`: no reading of it is a request (broken JSON or text, nested past the limit,
    over a limit); the type matrix mixes wrong values with odd but valid ones (`seed` 0, `stop` [])."""
    valid = ({"model": model} if model else {}) | {prompt_field: "Q: 1+1\nA:", "max_tokens": 2}
    field = prompt_field.encode()
    head = (b'{"model": "' + model.encode() + b'", ' if model else b"{") + b'"' + field + b'": '
    bodies = [("empty", b""), ("NUL bytes", b"\x00" * 8), ("open brace", b"{"), ("close brace", b"}"),
              ("null", b"null"), ("true", b"true"), ("a number", b"1"), ("a string", b'"x"'), ("a list", b"[]"),
              ("trailing comma", head + b'"x",}'), ("single quotes", b"{'" + field + b"': 'x'}"),
              ("a comment", head + b'"x" /* x */}'), ("NaN literal", head + b'"x", "temperature": NaN}'),
              ("bare word", b"{" + field + b": x}"), ("two objects", json.dumps(valid).encode() * 2),
              ("overlong UTF-8", head + b'"\xc0\xaf"}'),
              ("a lone continuation byte", head + b'"\x80"}'),
              ("cut mid-character", head + b'"\xe4\xb8"}'),
              ("a 1 MB prompt", json.dumps({**valid, prompt_field: "x" * (1 << 20)}).encode()),
              ("a 30k-token prompt", json.dumps({**valid, prompt_field: "x " * 30000}).encode()),
              ("a 1000-digit number", head + b'"x", "max_tokens": ' + b"9" * 1000 + b"}"),
              ("a 5000-digit number", head + b'"x", "seed": ' + b"9" * 5000 + b"}")]
    bodies = [(what, body, True) for what, body in bodies]
    for where in (prompt_field, "model", "stop", "key", "user"):
        for escape in ("\\ud800", "\\udfff", "a\\ud83d", "\\ude00b"):
            body = {**valid}
            if where == "key":
                text = json.dumps(body)[:-1] + f', "{escape}": 1}}'
            else:
                text = json.dumps({**body, where: "@"}).replace('"@"', f'"{escape}"')
            bodies.append((f"lone surrogate {escape} in {where}", text.encode(), True))
    for depth in (33, 100, 1000, 5000, 100000):
        bodies.append((f"arrays {depth} deep", b"[" * depth + b"]" * depth, True))
        bodies.append((f"objects {depth} deep in metadata",
                       head + b'"x", "metadata": ' + b'{"a": ' * depth + b"1" + b"}" * (depth + 1),
                       True))
        bodies.append((f"a prompt list {depth} deep",
                       head + b"[" * depth + b"]" * depth + b"}", True))
    wrong = [None, True, False, -1, 0, 2**63, 1e309, -1e309, 0.5, "", "x", "ü" * 3, [], [1], ["a", 1], {}, {"a": 1}]
    for field_name in ("model", prompt_field, "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                       "stop", "stream", "stream_options", "n", "logprobs"):
        for value in wrong:
            body = {**valid, field_name: value}
            if json.dumps(body, allow_nan=True) != json.dumps(valid):
                bodies.append((f"{field_name}={value!r}"[:60], json.dumps(body, allow_nan=True).encode(), False))
    return bodies


# Prompts of the SmolLM2 parity tests (against transformers, and served against the in-process engine)
SMOLLM2_PROMPTS = [
    "The capital of France is", "def quicksort(arr):\n", "Once upon a time, in a small village,",
    "The three primary colors are", "import numpy as np\n\n", "Water boils at a temperature of",
    "The first president of the United States was", "class Stack:\n    def __init__(self):\n",
    "Photosynthesis is the process by which", "The largest planet in our solar system is",
    "To make a cup of tea, first", "SELECT name FROM users WHERE", "The French word for cat is",
    "In 1969, Neil Armstrong", "A haiku about autumn:\n", "The sum of 17 and 25 is",
    "for (int i = 0; i < n; i++) {", "Machine learning is", "The Eiffel Tower is located in",
    "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
]
