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
    """An untrained baseline and dual-end model, exported: {name: (checkpoint, directory)}."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, pair_size in (("baseline", 1), ("dualend", 2)):
        checkpoint = Checkpoint(tiny_model(tiny_tokenizer, pair_size, seed=pair_size), tiny_tokenizer)
        export_checkpoint(checkpoint, root / name)
        out[name] = (checkpoint, root / name)
    return out


def wait_for(condition, timeout_s=10.0, poll_s=0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()
