"""Converting a pretrained token-level model to pair-in/pair-out (PIPO's recipe) on a CPU budget.

The student is the base model, frozen, plus what the conversion adds to it:
- LoRA adapters on the linears of the backbone's blocks from `frozen_layers` up (fused q/k/v,
  attention output, fused gate/up, down) and of the MTP head's decoder layer, which starts as a
  copy of the base's last block (its final norm as the base's);
- the compressor, started as the mean of the pair's embeddings (or their sum, PIPO's); the MTP head's input projection
  (started reading the normed hidden state only) and norms; the confidence head.
Position stride 2: pair i's RoPE angle is the raw position of its second token, what the base knows.

The teacher is the frozen base reading the same text token by token. Losses at pair i (the pair's
last real token r, the teacher's state there predicting t1 = token r+1):
KL(teacher at r || student's t1), KL(teacher at r+1 || MTP head's t2), the student's final hidden
state against the teacher's at r (mean squared error relative to the teacher's mean square), and
BCE of the confidence head against the student's own p(gold t2), detached. PAD augmentation is
training.dualend_batch's: gated steps with a reject ratio drawn over the whole threshold range
(never, always, and uniform between), so rows with every pair `(t, PAD)` are seen; one ratio per batch
(`conversion_batch`).

What the conversion adds is saved on its own (`adapters.safetensors` + `adapters.json` naming the
base's checkpoint id and source); `merge_adapters` folds it into the base and gives an ordinary
pair_size-2 LanguageModel, whose checkpoint id then covers both.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dualend.engine.checkpoint import Checkpoint
from dualend.engine.decode import SamplingParams
from dualend.engine.model import Block, LanguageModel, ModelConfig
from dualend.engine.reference import TorchBatch, generate_batch
from dualend.engine.tokenizer import TextTokenizer

from .data import FAMILIES, examples, stdlib_chunks
from .training import Sample, baseline_batch, baseline_forward, draw_reject_ratio, dualend_batch

ADAPTERS, ADAPTERS_CONFIG = "adapters.safetensors", "adapters.json"
LORA_TARGETS = (("attn", "qkv"), ("attn", "out"), ("ffn", "gate_up"), ("ffn", "down"))
COMPRESSOR_STARTS = ("mean", "sum")


@dataclass
class ConversionSpec:
    lora_rank: int = 16  # 0: the blocks' own weights train (a full fine-tune; embeddings and LM head stay frozen)
    lora_alpha: float = 32.0
    frozen_layers: int = 0  # the lowest blocks keep the base's weights exactly (no adapters)
    compressor_init: str = "mean"  # the compressor's start: "mean" or "sum" (PIPO's) of the pair's embeddings
    mtp_layer_full: bool = False  # the MTP head's block trains its own weights, the backbone's blocks adapters


class LoRALinear(nn.Module):
    """base(x) + scale * B(A(x)), B [out, r] starting at zero: the layer starts as the base."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))   # [r, in]
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # [out, r]
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the scale multiplies the r-wide activations: cheaper than the out-wide result
        return self.base(x) + F.linear(F.linear(x, self.lora_a) * self.scale, self.lora_b)

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        linear = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None)
        linear.weight.copy_(self.base.weight + self.scale * (self.lora_b @ self.lora_a))
        if self.base.bias is not None:
            linear.bias.copy_(self.base.bias)
        return linear


def _add_lora(block: Block, spec: ConversionSpec) -> None:
    for owner_name, name in LORA_TARGETS:
        owner = getattr(block, owner_name)
        setattr(owner, name, LoRALinear(getattr(owner, name), spec.lora_rank, spec.lora_alpha))


def build_student(base: LanguageModel, spec: ConversionSpec) -> LanguageModel:
    """The base's weights (frozen) with LoRA adapters and fresh pair-in/pair-out parts (trainable).
    Every weight that is not trainable comes from the base, so the trainable ones and `spec`
    rebuild the student exactly (`merge_adapters`)."""
    if base.cfg.is_dualend:
        raise ValueError("the base of a conversion is a token-level model (pair_size 1)")
    if not 0 <= spec.frozen_layers <= base.cfg.n_layers:
        raise ValueError(f"frozen_layers {spec.frozen_layers} outside 0..{base.cfg.n_layers}")
    if spec.compressor_init not in COMPRESSOR_STARTS:
        raise ValueError(f"compressor_init {spec.compressor_init!r}: expected one of {', '.join(COMPRESSOR_STARTS)}")
    cfg = ModelConfig(**{**base.cfg.to_dict(), "pair_size": 2, "compressor_init": spec.compressor_init,
                         "position_stride": 2})
    student = LanguageModel(cfg)
    missing, unexpected = student.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(n.split(".")[0] in ("compressor", "mtp", "confidence") for n in missing)
    student.mtp.layer.load_state_dict(base.backbone.layers[-1].state_dict())
    student.mtp.norm.load_state_dict(base.backbone.norm.state_dict())
    with torch.no_grad():  # starts reading RMSNorm(h) only, at twice the scale the base's last block reads
        scale = 2 * _last_block_input_rms(base)
        student.mtp.proj.weight.copy_(torch.cat([torch.zeros(cfg.d_model, cfg.d_model),
                                                 scale * torch.eye(cfg.d_model)], 1))
    student.requires_grad_(False)
    for module in (student.compressor, student.mtp, student.confidence):
        module.requires_grad_(True)
    student.mtp.layer.requires_grad_(spec.mtp_layer_full)  # or its weights stay the base's; adapters, norms train
    for norm in (student.mtp.layer.attn_norm, student.mtp.layer.ffn_norm):
        norm.requires_grad_(True)
    adapted = list(student.backbone.layers[spec.frozen_layers:]) + ([] if spec.mtp_layer_full else [student.mtp.layer])
    for block in adapted:
        if spec.lora_rank:
            _add_lora(block, spec)
        else:
            block.requires_grad_(True)
    return student


@torch.no_grad()
def _last_block_input_rms(base: LanguageModel, tokens: int = 64) -> float:
    """RMS of the residual stream entering the base's last block, over a fixed token sequence.
    (Measured on SmolLM2, an MTP head started this way scores held-out t2 at NLL ~10.8, near
    uniform; reading the sum of both normed inputs at scale 1, as the MTP head's first layer
    might, gave 31.)"""
    seen = []
    hook = base.backbone.layers[-1].register_forward_hook(lambda module, args, out: seen.append(args[0]))
    try:
        teacher_hidden(base, (torch.arange(tokens) % base.cfg.vocab_size)[None])
    finally:
        hook.remove()
    return seen[0].pow(2).mean(-1).sqrt().mean().item()


def frozen_linears_in(dtype: torch.dtype, *models: nn.Module) -> None:
    """Store the frozen linears' weights in `dtype`, for training under autocast to it (which otherwise
    casts them at every use: it keeps its casts only of weights that train); the same products."""
    for model in models:
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.requires_grad:
                module.to(dtype)


def trainable_state(student: LanguageModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in student.named_parameters() if p.requires_grad}


def fold_lora(model: nn.Module) -> None:
    """Replaces every LoRALinear inside `model` by the plain Linear it amounts to."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())


def adapters_as(base: LanguageModel, adapters: dict[str, torch.Tensor], found: ConversionSpec,
                wanted: ConversionSpec) -> dict[str, torch.Tensor]:
    """Adapters of `found` as the start of a `wanted` student, the same model: with `mtp_layer_full` the MTP
    head's block's adapters folded into its weights; at a higher rank each adapter widened (the new directions'
    A drawn as a fresh adapter's, their B zero, the old B rescaled from `found`'s alpha / rank to `wanted`'s).
    ValueError for any other change (a lower rank, a full fine-tune, another start, an adapted block again)."""
    if found == wanted:
        return adapters
    if (replace(found, lora_rank=wanted.lora_rank, lora_alpha=wanted.lora_alpha, mtp_layer_full=wanted.mtp_layer_full)
            != wanted or not 0 < found.lora_rank <= wanted.lora_rank or found.mtp_layer_full > wanted.mtp_layer_full):
        raise ValueError(f"adapters of {asdict(found)} cannot start {asdict(wanted)}: only the MTP head's block "
                         "trained whole or a higher lora_rank starts as the same model")
    student = build_student(base, found)
    student.load_state_dict(adapters, strict=False)
    if wanted.mtp_layer_full and not found.mtp_layer_full:
        fold_lora(student.mtp.layer)
        student.mtp.layer.requires_grad_(True)
    grown = build_student(base, wanted)
    old, rank = dict(student.named_modules()), found.lora_rank
    with torch.no_grad():
        for name, module in grown.named_modules():
            if isinstance(module, LoRALinear):
                module.lora_a[:rank] = old[name].lora_a
                module.lora_b[:, :rank] = old[name].lora_b * (old[name].scale / module.scale)
    kept = {n: t for n, t in trainable_state(student).items() if ".lora_" not in n}
    return {**trainable_state(grown), **kept}


def merge_adapters(base: LanguageModel, adapters: dict[str, torch.Tensor], spec: ConversionSpec) -> LanguageModel:
    """The converted model as an ordinary pair_size-2 LanguageModel: base + adapters, folded."""
    student = build_student(base, spec)
    expected = set(trainable_state(student))
    if set(adapters) != expected:
        raise ValueError(f"adapters do not fit the base: missing {sorted(expected - set(adapters))[:5]}, "
                         f"unknown {sorted(set(adapters) - expected)[:5]}")
    student.load_state_dict(adapters, strict=False)
    fold_lora(student)
    return student.requires_grad_(True).eval()


def save_adapters(student: LanguageModel, spec: ConversionSpec, base: dict, recipe: dict,
                  directory: str | Path) -> None:
    """`base`: {"checkpoint_id", "source"} of the base checkpoint."""
    write_adapters(trainable_state(student), {"base": base, "spec": asdict(spec), "model": student.cfg.to_dict(),
                                              "recipe": recipe}, directory)


def write_adapters(adapters: dict[str, torch.Tensor], meta: dict, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapters, str(directory / ADAPTERS))
    (directory / ADAPTERS_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_adapters(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    directory = Path(directory)
    meta = json.loads((directory / ADAPTERS_CONFIG).read_text(encoding="utf-8"))
    return {name: t.float() for name, t in load_file(str(directory / ADAPTERS)).items()}, meta


def ship_adapters(source: str | Path, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """A run's adapters as they ship in git: in `dtype` (bf16 halves them; the merged model is
    evaluated from what ships, so its quality report covers the rounding)."""
    adapters, meta = load_adapters(source)
    write_adapters({name: t.to(dtype).contiguous() for name, t in adapters.items()},
                   {**meta, "dtype": str(dtype).removeprefix("torch.")}, directory)


def adapters_sha256(directory: str | Path) -> str:
    return hashlib.sha256((Path(directory) / ADAPTERS).read_bytes()).hexdigest()


def merged_checkpoint(base: Checkpoint, adapters_dir: str | Path) -> Checkpoint:
    """Base + adapters -> an ordinary dual-end checkpoint; its id covers both, its recipe names the
    base, the conversion and the adapters' sha256. Refused (ValueError) for adapters of another base."""
    adapters, meta = load_adapters(adapters_dir)
    if base.id != meta["base"]["checkpoint_id"]:
        raise ValueError(f"{adapters_dir} adapt base {meta['base']['checkpoint_id']} ({meta['base'].get('source')}); "
                         f"the base given is {base.id}")
    model = merge_adapters(base.model, adapters, ConversionSpec(**meta["spec"]))
    if model.cfg.to_dict() != meta["model"]:
        raise ValueError(f"{adapters_dir}: model config {meta['model']} differs from the merged {model.cfg.to_dict()}")
    recipe = {**{k: base.recipe[k] for k in ("importer", "source", "context", "pad_rule") if k in base.recipe},
              "kind": "dualend", "converted_from": base.id, "conversion": meta["spec"],
              "adapters": {"sha256": adapters_sha256(adapters_dir), **meta["recipe"]}}
    return Checkpoint(model, base.tokenizer, recipe)


# Data ------------------------------------------------------------------------------------------

def text_samples(tokenizer: TextTokenizer, split: str, seed: int | str, tokens: int) -> Iterator[Sample]:
    """Endless `tokens`-token windows of standard-library source; the first pair is the prompt,
    every later token carries loss."""
    for chunk in stdlib_chunks(split, chunk_chars=6 * tokens, seed=seed):
        ids = tokenizer.encode(chunk)[:tokens]
        if len(ids) == tokens:
            yield Sample(ids[:2], ids[2:])


def chat_prompts(split: str, count: int, seed: int) -> list[str]:
    """The project's task questions, the families in turn."""
    streams = [examples(family, split, seed) for family in FAMILIES]
    return [next(streams[i % len(streams)]).prompt for i in range(count)]


def teacher_chat_samples(teacher: LanguageModel, tokenizer: TextTokenizer, prompts: list[str],
                         max_tokens: int) -> list[Sample]:
    """Each prompt as a user turn under the chat template, answered by the teacher's greedy
    decoding (ended by EOS when it stopped there): the token-level model's own outputs."""
    encoded = [tokenizer.encode_prompt(tokenizer.user_turn(p)) for p in prompts]
    answers = greedy_answers(teacher, encoded, max_tokens, tokenizer.eos_id)
    return [Sample(prompt, answer) for prompt, answer in zip(encoded, answers) if answer]


@torch.no_grad()
def greedy_answers(model: LanguageModel, prompts: list[list[int]], max_tokens: int, eos_id: int,
                   rows: int = 64) -> list[list[int]]:
    """`model`'s greedy continuation of each encoded prompt (a dual-end model's drafting off, as it
    serves), ended by EOS where it stopped there; `rows` prompts at a time (on two CPU cores 64 rows
    answered SmolLM2's 64 open requests in 18.9 s against 35.9 s 16 at a time, the same answers)."""
    answers = []
    for start in range(0, len(prompts), rows):
        chunk = prompts[start:start + rows]
        generations = generate_batch(TorchBatch(model, chunk, max_tokens),
                                     [SamplingParams(max_tokens=max_tokens)] * len(chunk), threshold=1.0)
        answers += [[int(t) for t in g.tokens] + ([eos_id] if g.finish_reason == "eos" else []) for g in generations]
    return answers


def conversion_batch(samples: list[Sample], pad_id: int, rng: random.Random) -> dict[str, torch.Tensor]:
    """A training batch whose rows share one reject ratio (drawn as `dualend_batch` draws one per row), so
    that they are about as many pairs long: with a ratio per row, a row split at every token set the
    batch's width for rows of half as many pairs (at batches of 4 of convert's stream, 18% more pair
    positions per token; reports/conversion_recipes/cache_and_targets/)."""
    return dualend_batch(samples, pad_id, rng, reject_ratio=draw_reject_ratio(rng))


def batch_stream(tokenizer: TextTokenizer, seed: int | str, tokens: int, chat: list[Sample], chat_fraction: float,
                 rows: int) -> Iterator[list[Sample]]:
    """Batches of `rows` samples: chat answers with probability `chat_fraction`, else text windows, never
    both, since a batch is as wide as its longest row and a chat row beside `tokens`-token text windows
    was mostly padding (reports/conversion_recipes/short_answers/)."""
    rng = random.Random(seed)
    text = text_samples(tokenizer, "train", seed, tokens)
    while True:
        chat_batch = chat and rng.random() < chat_fraction
        yield [rng.choice(chat) if chat_batch else next(text) for _ in range(rows)]


# The teacher's outputs cached ------------------------------------------------------------------

@dataclass
class TaughtSample:
    """A training sample with the teacher's final hidden state at each of its tokens (prompt then
    completion) [T, D], fp16: the teacher's distributions are its LM head of them, so a pass over
    the sample skips the teacher's blocks."""
    sample: Sample
    hidden: torch.Tensor
    chat: bool = False  # a chat answer, not a text window


@torch.no_grad()
def taught_samples(teacher: LanguageModel, samples: list[Sample], pad_id: int, chat: list[Sample] = (),
                   rows: int = 8) -> list[TaughtSample]:
    """`samples` with the teacher's hidden states; those that are rows of `chat` marked so."""
    taught, device, chat_rows = [], teacher.output_weight.device, {id(s) for s in chat}
    for start in range(0, len(samples), rows):
        chunk = samples[start:start + rows]
        hidden = teacher_hidden(teacher, baseline_batch(chunk, pad_id)["tokens"].to(device)).half().cpu()
        taught += [TaughtSample(s, hidden[i, :len(s.prompt) + len(s.completion)].clone(), id(s) in chat_rows)
                   for i, s in enumerate(chunk)]
    return taught


class CachedBatches:
    """Batches of cached samples of one kind each, as `batch_stream` draws them: chat answers with probability
    `chat_fraction`, else text windows. A kind with fewer than `rows` samples is not drawn; where neither has
    that many, a batch takes any rows."""

    def __init__(self, cache: list[TaughtSample], rows: int, chat_fraction: float):
        self.rows, self.chat_fraction, self.cache = rows, chat_fraction, cache
        self.chat, self.text = [t for t in cache if t.chat], [t for t in cache if not t.chat]

    def draw(self, rng: random.Random) -> list[TaughtSample]:
        chat, text = len(self.chat) >= self.rows, len(self.text) >= self.rows
        if chat and text:
            pool = self.chat if rng.random() < self.chat_fraction else self.text
        else:
            pool = self.chat if chat else self.text if text else self.cache
        return rng.sample(pool, self.rows)


def taught_batch(taught: list[TaughtSample], pad_id: int, rng: random.Random) -> dict[str, torch.Tensor]:
    """`conversion_batch` of the samples, with their teacher hidden states along its real tokens."""
    batch = conversion_batch([t.sample for t in taught], pad_id, rng)
    hidden = torch.zeros(*batch["real_tokens"].shape, taught[0].hidden.shape[-1])
    for row, t in enumerate(taught):
        hidden[row, :len(t.hidden)] = t.hidden.float()
    return batch | {"teacher_hidden": hidden}


def save_taught(taught: list[TaughtSample], meta: dict, path: Path) -> None:
    rows = [{"prompt": t.sample.prompt, "completion": t.sample.completion, "silent": sorted(t.sample.silent),
             "hidden": t.hidden, "chat": t.chat} for t in taught]
    torch.save({"meta": meta, "rows": rows}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)


def load_taught(path: Path) -> tuple[list[TaughtSample], dict]:
    saved = torch.load(path, weights_only=True)
    return [TaughtSample(Sample(r["prompt"], r["completion"], frozenset(r["silent"])), r["hidden"],
                         r.get("chat", False))  # a cache made before rows kept their kind: its meta says so
            for r in saved["rows"]], saved["meta"]


# Losses and evaluation -------------------------------------------------------------------------

def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, T, ...] at index [B, n] (clamped to >= 0) -> [B, n, ...]."""
    gather_at = index.clamp(min=0)
    return torch.gather(values, 1, gather_at.view(*gather_at.shape, *[1] * (values.dim() - 2))
                        .expand(*gather_at.shape, *values.shape[2:]))


def teacher_hidden(teacher: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states [B, T, D] of a token-level model."""
    batch, length = tokens.shape
    hidden, _, _ = teacher.backbone(teacher.latents(tokens[..., None]), torch.arange(length)[None].expand(batch, length),
                                    torch.ones_like(tokens, dtype=torch.bool))
    return hidden


def student_forward(student: LanguageModel, batch: dict[str, torch.Tensor]):
    """Teacher-forced: hidden [B, n, D], the MTP head's hidden [B, n, D] and confidence [B, n]; the t1
    and t2 logits are the LM head of these hidden states, for a caller to take only at the positions it
    scores (each row of logits is the whole vocabulary)."""
    pairs = batch["pairs"]
    n_batch, n_pairs, _ = pairs.shape
    positions = torch.arange(n_pairs)[None].expand(n_batch, n_pairs)
    hidden, _, _ = student.backbone(student.latents(pairs), positions, torch.ones(n_batch, n_pairs, dtype=torch.bool))
    mtp_hidden, _, _ = student.mtp(student.embedding(batch["mtp_input"]), hidden, positions, batch["mtp_valid"])
    return hidden, mtp_hidden, student.confidence(hidden.detach(), mtp_hidden.detach())


def _mean(values: torch.Tensor) -> torch.Tensor:
    return values.mean() if len(values) else values.sum() * 0.0


class _RowKL(torch.autograd.Function):
    """KL(teacher || student) of each row of [N, V] logits and the student's log-sum-exp [N], taken a
    few rows at a time so that each row's fp32 copies stay in cache; the backward recomputes both
    softmaxes from the logits and the saved log-sum-exps."""

    @staticmethod
    def forward(ctx, teacher_logits: torch.Tensor, student_logits: torch.Tensor):
        rows = len(student_logits)
        kl = student_logits.new_empty(rows, dtype=torch.float32)
        teacher_lse, student_lse = torch.empty_like(kl), torch.empty_like(kl)
        step = _rows_per_chunk(student_logits)
        for a in range(0, rows, step):
            b = a + step
            teacher, student = teacher_logits[a:b].float(), student_logits[a:b].float()
            teacher_lse[a:b] = torch.logsumexp(teacher, -1)
            student_lse[a:b] = torch.logsumexp(student, -1)
            teacher_p = (teacher - teacher_lse[a:b, None]).exp_()
            kl[a:b] = (teacher_p * (teacher - student)).sum(-1)
        kl += student_lse - teacher_lse
        ctx.save_for_backward(teacher_logits, student_logits, teacher_lse, student_lse)
        ctx.mark_non_differentiable(student_lse)
        return kl, student_lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl: torch.Tensor, _grad_lse):
        teacher_logits, student_logits, teacher_lse, student_lse = ctx.saved_tensors
        grad = torch.empty_like(student_logits)
        step = _rows_per_chunk(student_logits)
        for a in range(0, len(student_logits), step):
            b = a + step
            student_p = (student_logits[a:b].float() - student_lse[a:b, None]).exp_()
            teacher_p = (teacher_logits[a:b].float() - teacher_lse[a:b, None]).exp_()
            grad[a:b] = student_p.sub_(teacher_p).mul_(grad_kl[a:b, None])
        return None, grad


def _rows_per_chunk(logits: torch.Tensor) -> int:
    """On a CPU a chunk's fp32 rows fit a core's cache (2^17 values: 2 rows of a 49k vocabulary); elsewhere
    few chunks, each a handful of kernel launches."""
    budget = 2 ** 17 if logits.device.type == "cpu" else 2 ** 26
    return max(1, budget // max(1, logits.shape[-1]))


def _refuse_unmatched(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> None:
    if teacher_logits.requires_grad:
        raise ValueError("the teacher's logits take no gradient in a distillation loss")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher logits {tuple(teacher_logits.shape)} against the student's "
                         f"{tuple(student_logits.shape)}")


def kl_rows(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(teacher || student) [N] of each row of [N, V] logits (fp32, from logits of any float dtype),
    and the student's log-sum-exp [N] (its log-probabilities are `student_logits - lse[:, None]`)."""
    _refuse_unmatched(teacher_logits, student_logits)
    return _RowKL.apply(teacher_logits, student_logits)


def _kl_expression(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kl_rows` as one expression, for torch.compile to fuse into passes over each row (run eagerly, it
    would keep several [N, V] fp32 tensors for the backward)."""
    teacher, student = teacher_logits.float(), student_logits.float()
    teacher_log_p = teacher - torch.logsumexp(teacher, -1, keepdim=True)
    student_lse = torch.logsumexp(student, -1, keepdim=True)
    kl = (teacher_log_p.exp() * (teacher_log_p - (student - student_lse))).sum(-1)
    return kl, student_lse.squeeze(-1).detach()


@functools.cache
def compile_kl_rows():
    """`kl_rows` compiled (inductor; made once): forward and backward each fused into passes over each row,
    in place of the eager chunks' separate operations (`benchmarks.convert_step --compile` times the step)."""
    compiled = torch.compile(_kl_expression, dynamic=True)

    def kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _refuse_unmatched(teacher_logits, student_logits)
        return compiled(teacher_logits, student_logits)
    return kl


def compile_blocks(*models: LanguageModel) -> None:
    """torch.compile (inductor) each transformer block of `models` in place: its norms, rotations, gate and
    casts fuse, one graph serves every block of a shape, and parameter names stay as they were."""
    for model in models:
        blocks = [*model.backbone.layers, *([model.mtp.layer] if model.cfg.is_dualend else [])]
        for block in blocks:
            block.compile(dynamic=True)


def compile_step(teacher: LanguageModel, student: LanguageModel):
    """What `convert --compile` compiles: both models' blocks, in place; returns the KL to pass to
    `conversion_loss` (`compile_kl_rows()`)."""
    compile_blocks(teacher, student)
    return compile_kl_rows()


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) over rows [N, V]."""
    return _mean(kl_rows(teacher_logits, student_logits)[0])


def conversion_loss(student: LanguageModel, teacher: LanguageModel, batch: dict[str, torch.Tensor],
                    hidden_weight: float = 1.0, confidence_weight: float = 1.0,
                    kl=kl_rows) -> tuple[torch.Tensor, dict]:
    """KL(teacher || student) of t1 and t2, the final hidden state's relative squared error, the
    confidence head's BCE. A batch of `taught_batch` brings the teacher's hidden states: then only
    its LM head runs. `kl`: `kl_rows` or what `compile_step` returns."""
    hidden, mtp_hidden, confidence = student_forward(student, batch)
    next_valid, draft_valid = batch["next_index"] >= 0, batch["draft_index"] >= 0  # [B, n]
    with torch.no_grad():
        target_hidden = batch["teacher_hidden"] if "teacher_hidden" in batch else \
            teacher_hidden(teacher, batch["real_tokens"])  # [B, T, D]
        next_hidden = _at(target_hidden, batch["next_index"] - 1)[next_valid]     # [N1, D]
        draft_hidden = _at(target_hidden, batch["draft_index"] - 1)[draft_valid]  # [N2, D]
        teacher_logits = teacher.lm_head(torch.cat([next_hidden, draft_hidden]))
    # t1 rows, then t2 rows: one pass of each LM head for both
    student_logits = student.lm_head(torch.cat([hidden[next_valid], mtp_hidden[draft_valid]]))
    kl_per_row, student_lse = kl(teacher_logits, student_logits)
    n1 = len(next_hidden)
    kl_t1, kl_t2 = _mean(kl_per_row[:n1]), _mean(kl_per_row[n1:])
    student_hidden = hidden[next_valid].float()
    target = next_hidden.float()
    hidden_loss = (student_hidden - target).pow(2).mean() / target.pow(2).mean().clamp(min=1e-6) \
        if len(target) else kl_t1 * 0.0
    gold_t2 = batch["draft_target"][draft_valid]
    with torch.no_grad():
        p_gold = (student_logits[n1:].gather(-1, gold_t2[:, None]).squeeze(-1).float() - student_lse[n1:]).exp()
    conf = confidence[draft_valid].float()
    with torch.autocast(conf.device.type, enabled=False):  # CUDA's autocast refuses BCE on probabilities
        confidence_loss = F.binary_cross_entropy(conf, p_gold) if len(conf) else kl_t1 * 0.0
    loss = kl_t1 + kl_t2 + hidden_weight * hidden_loss + confidence_weight * confidence_loss
    return loss, {"kl_t1": kl_t1.item(), "kl_t2": kl_t2.item(), "hidden": hidden_loss.item(),
                  "conf": confidence_loss.item()}


def optimizer(trainable: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """fused: one kernel over the parameters (a full fine-tune's step spent 0.4 s in foreach's, 0.2 s
    fused, on one core; benchmarks.convert_step)."""
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.95), fused=True)


def resume_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load a saved state (moments, step, hyperparameters), keeping this optimizer's implementation: a
    state saved before it was fused would otherwise bring the slower one back."""
    implementation = [{k: group[k] for k in ("fused", "foreach") if k in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, kept in zip(optimizer.param_groups, implementation):
        group.update(kept)


@dataclass
class HeldOut:
    """A fixed held-out set, teacher-forced, with the teacher's figures on it computed once."""
    batch: dict[str, torch.Tensor]        # pairs as served at threshold < 0 (no PAD in the answer)
    split_batch: dict[str, torch.Tensor]  # every answer pair split (t, PAD): drafting off
    teacher: dict[str, float]
    teacher_top1_t1: torch.Tensor         # [N1] the teacher's top token where t1 is scored
    teacher_top1_t2: torch.Tensor         # [N2]


@torch.no_grad()
def held_out(teacher: LanguageModel, samples: list[Sample], pad_id: int) -> HeldOut:
    rng = random.Random(0)
    batch = dualend_batch(samples, pad_id, rng, reject_ratio=0.0)
    split_batch = dualend_batch(samples, pad_id, rng, reject_ratio=1.0)
    logits = baseline_forward(teacher, batch["real_tokens"])  # [B, T, V]
    figures, top1 = {}, {}
    for name, index_key, target_key in (("t1", "next_index", "next_token"), ("t2", "draft_index", "draft_target")):
        valid = batch[index_key] >= 0
        at = _at(logits, batch[index_key] - 1)[valid]
        figures[f"nll_{name}"] = F.cross_entropy(at, batch[target_key][valid]).item()
        top1[name] = at.argmax(-1)
    valid = split_batch["next_index"] >= 0
    at = _at(logits, split_batch["next_index"] - 1)[valid]
    figures["nll_t1_split"] = F.cross_entropy(at, split_batch["next_token"][valid]).item()
    return HeldOut(batch, split_batch, figures, top1["t1"], top1["t2"])


def held_out_on(reference: HeldOut, device: torch.device) -> HeldOut:
    """The same held-out set with its tensors on `device`."""
    return replace(reference, batch={k: v.to(device) for k, v in reference.batch.items()},
                   split_batch={k: v.to(device) for k, v in reference.split_batch.items()},
                   teacher_top1_t1=reference.teacher_top1_t1.to(device),
                   teacher_top1_t2=reference.teacher_top1_t2.to(device))


def calibration(confidence: torch.Tensor, correct: torch.Tensor, bins: int = 10) -> dict:
    """Mean confidence against the drafts' accuracy, and the expected calibration error."""
    edges = torch.clamp((confidence * bins).long(), max=bins - 1)
    ece = sum((correct[edges == b].float().mean() - confidence[edges == b].mean()).abs().item() * (edges == b).sum().item()
              for b in range(bins) if (edges == b).any()) / max(1, len(confidence))
    return {"confidence": confidence.mean().item(), "draft_accuracy": correct.float().mean().item(), "ece": ece}


@torch.no_grad()
def evaluate(student: LanguageModel, reference: HeldOut) -> dict:
    """Student against gold and teacher on the held-out set: NLL of t1 and t2 (and of t1 with
    every pair split), top-1 agreement with the teacher, confidence calibration."""
    batch = reference.batch
    hidden, mtp_hidden, confidence = student_forward(student, batch)
    next_valid, draft_valid = batch["next_index"] >= 0, batch["draft_index"] >= 0
    next_at, draft_at = student.lm_head(hidden[next_valid]).float(), student.lm_head(mtp_hidden[draft_valid]).float()
    gold_t2 = batch["draft_target"][draft_valid]
    split = reference.split_batch
    split_hidden, _, _ = student_forward(student, split)
    split_valid = split["next_index"] >= 0
    figures = {
        "nll_t1": F.cross_entropy(next_at, batch["next_token"][next_valid]).item(),
        "nll_t2": F.cross_entropy(draft_at, gold_t2).item(),
        "nll_t1_split": F.cross_entropy(student.lm_head(split_hidden[split_valid]).float(),
                                        split["next_token"][split_valid]).item(),
        "agree_t1": (next_at.argmax(-1) == reference.teacher_top1_t1).float().mean().item(),
        "agree_t2": (draft_at.argmax(-1) == reference.teacher_top1_t2).float().mean().item(),
        **calibration(confidence[draft_valid].float(), draft_at.argmax(-1) == gold_t2),
    }
    return {k: round(v, 4) for k, v in figures.items()} | {f"teacher_{k}": round(v, 4)
                                                           for k, v in reference.teacher.items()}


def held_out_samples(tokenizer: TextTokenizer, rows: int, tokens: int) -> list[Sample]:
    """Text windows from the calibration split of the standard library (never trained on)."""
    stream = text_samples(tokenizer, "calibration", 0, tokens)
    return [next(stream) for _ in range(rows)]


def real_tokens(batch: dict[str, torch.Tensor], pad_id: int) -> int:
    return int((batch["real_tokens"] != pad_id).sum())

