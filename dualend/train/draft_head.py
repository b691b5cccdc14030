"""An MTP draft head for a frozen token-level model: trained by distillation, shipped on its own.

The head (`model.MTPHead`: one decoder block over [RMSNorm(emb(x[p+1])); RMSNorm(h[p])], the
model's tied LM head) drafts x[p+2]; the next decode step feeds the draft and the base checks it,
so the output is the base's whatever the head says and only its acceptance depends on training.
Its target at p is the base's own distribution at p+1 (what the check compares against): the
base runs once per batch without gradients, and only the head learns.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dualend.engine.checkpoint import Checkpoint
from dualend.engine.decode import Sampler, SamplingParams, never_generated
from dualend.engine.model import LanguageModel, ModelConfig
from dualend.engine.onnx_engine import OnnxBatch, OnnxComponents
from dualend.engine.reference import TorchBatch

from .conversion import _kl, teacher_hidden

HEAD_WEIGHTS, HEAD_CONFIG = "draft_head.safetensors", "draft_head.json"


def with_draft_head(base: LanguageModel, draft_vocab: int = 0) -> LanguageModel:
    """`base` (frozen) plus a draft head whose block starts as a copy of the base's last block."""
    if base.cfg.pair_size != 1:
        raise ValueError("a draft head is trained on a token-level model (pair_size 1)")
    model = LanguageModel(ModelConfig(**(base.cfg.to_dict() | {"draft_head": True, "draft_vocab": draft_vocab})))
    model.load_state_dict({k: v for k, v in base.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    model.mtp.layer.load_state_dict(base.backbone.layers[-1].state_dict())
    model.mtp.norm.load_state_dict(base.backbone.norm.state_dict())
    with torch.no_grad():  # [emb; h] -> h at the start: the block first sees what the last one did
        dim = base.cfg.d_model
        model.mtp.proj.weight.copy_(torch.cat([torch.zeros(dim, dim), torch.eye(dim)], 1)
                                    + 0.02 * torch.randn(dim, 2 * dim))
    model.requires_grad_(False)
    model.mtp.requires_grad_(True)
    return model


def frequent_tokens(token_lists, count: int, always=()) -> torch.Tensor:
    """The `count` tokens most frequent in `token_lists` (ties: lower id first; fewer when fewer occur),
    `always` among them: the draft vocabulary (as FR-Spec's frequency-ranked drafting), sorted by id."""
    counts = {}
    for tokens in token_lists:
        for token in tokens:
            counts[int(token)] = counts.get(int(token), 0) + 1
    for token in always:
        counts[int(token)] = float("inf")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:count]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def restricted(model: LanguageModel, ids: torch.Tensor) -> LanguageModel:
    """The same model whose drafts come from `ids` only (`ModelConfig.draft_vocab`)."""
    narrowed = with_draft_head(model, len(ids))
    narrowed.load_state_dict({k: v for k, v in model.state_dict().items() if k != "mtp.draft_ids"}, strict=False)
    narrowed.mtp.draft_ids.copy_(ids)
    return narrowed


def head_state(model: LanguageModel) -> dict[str, torch.Tensor]:
    return {f"mtp.{name}": t.detach().contiguous() for name, t in model.mtp.state_dict().items()}


def distillation_loss(target: torch.Tensor, drafted: torch.Tensor,
                      greedy_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, its KL part): KL(base || head) over rows [N, V] of logits, plus `greedy_weight` x the
    head's cross-entropy against the base's top token: a greedy request keeps a draft only when it is
    that token, which the KL alone weighs no more than the shape of the distribution's tail."""
    kl = _kl(target, drafted)
    if greedy_weight and len(target):
        return kl + greedy_weight * torch.nn.functional.cross_entropy(drafted.float(), target.argmax(-1)), kl
    return kl, kl


def draft_loss(model: LanguageModel, tokens: torch.Tensor, valid: torch.Tensor,
               start: torch.Tensor, greedy_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """tokens, valid: [B, T]; start: [B], each row's first drafting position (its prompt's last).

    The head at p reads (h[p], x[p+1]) and is scored against the base at p+1, from `start` on, as
    served: its attention sees the positions from `start` only (its cache begins with the first
    decode step). `distillation_loss` over positions whose p+1 and p+2 are real tokens of the row; the
    figures: its KL part and the head's top-1 agreement with the base's (the greedy acceptance)."""
    with torch.no_grad():
        hidden = teacher_hidden(model, tokens)  # [B, T, D]
    batch, length = tokens.shape
    positions = torch.arange(length - 1)[None].expand(batch, length - 1)
    drafting = valid[:, 1:] & valid[:, :-1] & (positions >= start[:, None])
    draft_logits, _, _, _ = model.mtp_forward(tokens[:, 1:], hidden[:, :-1], positions, drafting)
    keep = drafting & torch.cat([valid[:, 2:], torch.zeros(batch, 1, dtype=torch.bool)], 1)
    with torch.no_grad():
        target = model.lm_head(hidden[:, 1:][keep])
    drafted = draft_logits[keep]
    agree = (drafted.argmax(-1) == target.argmax(-1)).float().mean().item() if len(target) else 0.0
    loss, kl = distillation_loss(target, drafted, greedy_weight)
    return loss, {"kl": kl.item(), "top1": agree, "positions": int(keep.sum())}


# Teacher records: the base's continuations with the hidden states that gave them, so that
# training passes skip the base ------------------------------------------------------------------

@torch.no_grad()
def teacher_records(teacher: LanguageModel | OnnxComponents, prompts: list[list[int]], max_tokens: int,
                    temperature: float = 0.0, seed: int | list[int] = 0) -> list[dict]:
    """The base's continuation of each prompt as served (PAD and BOS never chosen; to EOS or
    `max_tokens`), decoded together on the torch model or on an exported engine (`OnnxBatch`: its
    weight precision's hidden states and choices): greedy, or sampled at `temperature` as a request is
    (each row its own `decode.Sampler`, seeded from `seed` and the row). `tokens` [n] and `hidden` [n, D]
    (fp16), hidden[i] the final hidden state whose LM head gave the distribution tokens[i] was chosen
    from; `position` is hidden[0]'s (the prompt's last)."""
    samplers = [Sampler(SamplingParams(temperature=temperature, seed=int(row_seed.generate_state(1)[0])))
                for row_seed in np.random.SeedSequence(seed).spawn(len(prompts))]
    if isinstance(teacher, OnnxComponents):
        batch, specials = OnnxBatch(teacher, prompts, max_tokens), teacher
    else:
        batch, specials = TorchBatch(teacher, prompts, max_tokens), teacher.cfg
    pad, bos, eos = specials.pad_id, specials.bos_id, specials.eos_id
    tokens, hiddens = [[] for _ in prompts], [[] for _ in prompts]
    running = set(range(len(prompts)))
    try:
        logits, hidden = batch.restart()
        while True:
            logits[:, never_generated(pad, bos, eos)] = -np.inf
            chosen = np.array([samplers[row](logits[row]) if row in running else eos for row in range(len(prompts))])
            for row in list(running):
                tokens[row].append(int(chosen[row]))
                hiddens[row].append(hidden[row])
                if chosen[row] == eos or len(tokens[row]) == max_tokens:
                    running.discard(row)
            if not running:
                break
            logits, hidden = batch.step(chosen[:, None])
    finally:
        batch.close()  # an engine's rows of its cache
    return [{"position": len(prompt) - 1, "tokens": torch.tensor(t), "hidden": torch.from_numpy(np.stack(h)).half()}
            for prompt, t, h in zip(prompts, tokens, hiddens)]


def record_rows(records: list[dict]) -> dict[str, torch.Tensor]:
    """Records -> the head's teacher-forced inputs, padded: at i it reads hidden[i] and tokens[i] (the
    token after hidden[i]'s position) and is scored against the base's distribution from hidden[i+1]
    and its choice tokens[i+1]. next_tokens, target_tokens, valid, positions: [B, n]; hidden,
    target_hidden: [B, n, D]; n = longest record - 1."""
    width = max(len(r["tokens"]) for r in records) - 1
    dim = records[0]["hidden"].shape[-1]
    rows = {"next_tokens": torch.zeros(len(records), width, dtype=torch.long),
            "target_tokens": torch.zeros(len(records), width, dtype=torch.long),
            "valid": torch.zeros(len(records), width, dtype=torch.bool),
            "positions": torch.zeros(len(records), width, dtype=torch.long),
            "hidden": torch.zeros(len(records), width, dim), "target_hidden": torch.zeros(len(records), width, dim)}
    for i, record in enumerate(records):
        n = len(record["tokens"]) - 1
        rows["next_tokens"][i, :n], rows["target_tokens"][i, :n] = record["tokens"][:n], record["tokens"][1:]
        rows["valid"][i, :n] = True
        rows["positions"][i, :n] = record["position"] + torch.arange(n)
        rows["hidden"][i, :n] = record["hidden"][:n].float()
        rows["target_hidden"][i, :n] = record["hidden"][1:n + 1].float()
    return rows


def record_loss(model: LanguageModel, rows: dict[str, torch.Tensor], draft_ids: torch.Tensor,
                greedy_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """`distillation_loss` over the `draft_ids` tokens (both distributions renormalised over them: what
    a head drafting from them can learn); the figures: its KL part and the share of positions where the
    head's draft is the base's recorded choice (greedy records: the greedy first-draft acceptance)."""
    valid = rows["valid"]
    mtp_hidden, _, _ = model.mtp(model.embedding(rows["next_tokens"]), rows["hidden"], rows["positions"], valid)
    output = model.output_weight[draft_ids]
    drafted = mtp_hidden[valid] @ output.T
    with torch.no_grad():
        target = rows["target_hidden"][valid] @ output.T
    agree = (draft_ids[drafted.argmax(-1)] == rows["target_tokens"][valid]).float().mean().item() if len(target) else 0.0
    loss, kl = distillation_loss(target, drafted, greedy_weight)
    return loss, {"kl": kl.item(), "top1": agree, "positions": int(valid.sum())}


def weights_sha256(directory: str | Path) -> str:
    return hashlib.sha256((Path(directory) / HEAD_WEIGHTS).read_bytes()).hexdigest()


def write_head(model: LanguageModel, base_id: str, recipe: dict, directory: str | Path,
               dtype: torch.dtype = torch.float32) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head_state(model).items()},
              str(directory / HEAD_WEIGHTS))
    meta = {"base": base_id, "model": model.cfg.to_dict(), "dtype": str(dtype).removeprefix("torch."), "recipe": recipe}
    (directory / HEAD_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_head(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    directory = Path(directory)
    meta = json.loads((directory / HEAD_CONFIG).read_text(encoding="utf-8"))
    return {k: v.float() if v.is_floating_point() else v
            for k, v in load_file(str(directory / HEAD_WEIGHTS)).items()}, meta


def checkpoint_with_head(base: Checkpoint, directory: str | Path) -> Checkpoint:
    """Base + a shipped draft head -> a token-level checkpoint with a draft head; refused
    (ValueError) for a head trained on another base."""
    weights, meta = load_head(directory)
    if meta["base"] != base.id:
        raise ValueError(f"{directory}: a draft head for base {meta['base']}; the base given is {base.id}")
    model = with_draft_head(base.model, meta["model"].get("draft_vocab", 0))
    model.load_state_dict(weights, strict=False)
    model.requires_grad_(True).eval()
    recipe = {**{k: base.recipe[k] for k in ("importer", "source", "context", "pad_rule") if k in base.recipe},
              "kind": "draft-head", "draft_head_on": base.id,
              "draft_head": {"sha256": weights_sha256(directory), **meta["recipe"]}}
    return Checkpoint(model, base.tokenizer, recipe)
