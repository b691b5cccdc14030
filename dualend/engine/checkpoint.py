"""Self-describing checkpoints: safetensors weights, model config, tokenizer, training recipe.

An imported checkpoint (builder.import_model) also holds `tokenizer_config.json`, which names its
special tokens (the shipped ones find "<pad>", "<bos>", "<eos>" by name and have no such file).

The checkpoint id is a hash of the weights and the model config, so any change to either
gives a new id; every exported component carries it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .model import LanguageModel, ModelConfig
from .tokenizer import TextTokenizer

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def checkpoint_id(state: dict[str, torch.Tensor], config: dict) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(state):
        tensor = state[name].detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _weights(model: LanguageModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


@dataclass
class Checkpoint:
    model: LanguageModel
    tokenizer: TextTokenizer
    recipe: dict = field(default_factory=dict)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def id(self) -> str:
        return checkpoint_id(_weights(self.model), self.model.cfg.to_dict())

    def save(self, directory: str | Path) -> str:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights = _weights(self.model)
        ckpt_id = checkpoint_id(weights, self.model.cfg.to_dict())
        save_file(weights, str(directory / WEIGHTS))
        meta = {"checkpoint_id": ckpt_id, "model": self.model.cfg.to_dict(), "recipe": self.recipe}
        (directory / CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (directory / TOKENIZER).write_text(self.tokenizer.to_json(), encoding="utf-8")
        tokenizer_config = self.tokenizer.config_json()
        if tokenizer_config is not None:
            (directory / TOKENIZER_CONFIG).write_text(tokenizer_config, encoding="utf-8")
        elif (directory / TOKENIZER_CONFIG).exists():
            (directory / TOKENIZER_CONFIG).unlink()  # a stale one would rename the specials
        return ckpt_id


def load_checkpoint(directory: str | Path) -> Checkpoint:
    directory = Path(directory)
    meta = json.loads((directory / CONFIG).read_text(encoding="utf-8"))
    model = LanguageModel(ModelConfig(**meta["model"]))
    model.load_state_dict(load_file(str(directory / WEIGHTS)))
    model.eval()
    tokenizer_config = directory / TOKENIZER_CONFIG
    tokenizer = TextTokenizer.from_json((directory / TOKENIZER).read_text(encoding="utf-8"),
                                        tokenizer_config.read_text(encoding="utf-8") if tokenizer_config.exists() else None)
    # Verified against the config as written, so fields added to ModelConfig later (with defaults
    # that keep the old behaviour) do not invalidate older checkpoints; re-saving gives a new id.
    recomputed = checkpoint_id(_weights(model), meta["model"])
    if recomputed != meta["checkpoint_id"]:
        raise ValueError(f"{directory}: weights do not match checkpoint id {meta['checkpoint_id']} "
                         f"(recomputed {recomputed})")
    return Checkpoint(model, tokenizer, meta.get("recipe", {}))
