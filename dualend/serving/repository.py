"""A Triton model's view of the repository: its deployment config, its version folder's
components, and the names of a deployment's generations."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from dualend.engine.onnx_engine import ExportedModel
from dualend.engine.tokenizer import TextTokenizer

from .contract import Limits
from .model_config import shared_model_config

# The deployments the builder assembles and the gateway serves by name: the shipped pair (the canary
# splits between them) and SmolLM2, imported from its package at build time, alone (8-bit), converted to
# pairs, with a draft head whose drafts are verified, and in fp32 (transformers' text).
PUBLIC_DEPLOYMENTS = ("dualend", "baseline", "smollm2", "smollm2_dualend", "smollm2_mtp", "smollm2_exact")
CANARY_MODEL = "llm"  # the gateway's and the front's name for the canary: one of its pair by the canary weight
CANARY_PAIR = ("dualend", "baseline")  # the baseline by the weight, else dualend


def max_sequence_latents(raw_context_limit: int, max_new_tokens: int, pair_size: int) -> int:
    """Most latents one sequence can hold: the prompt's pairs plus one per decode step (with every
    draft rejected, one per generated token), where prompt + max_tokens <= raw_context_limit."""
    if pair_size == 1:
        return raw_context_limit
    return raw_context_limit // pair_size + max_new_tokens // pair_size


@dataclass(frozen=True)
class DeploymentConfig:
    """One deployment's settings, rendered by the builder into the `parameters` of each of its
    Python models (one parameter per field) and parsed once, typed, in each model's initialize."""

    deployment: str
    pipeline: str                 # its generation's model name prefix, `dualend_v3`
    pair_size: int
    acceptance_threshold: float
    raw_context_limit: int        # prompt + generated tokens, as the user counts them
    max_new_tokens: int
    max_concurrent_requests: int
    max_queue_size: int
    queue_wait_s: float
    prefill_chunk_latents: int
    kv_block_size: int            # slots; also the step by which a cache's layout grows
    kv_capacity_blocks: int       # the KV memory budget, in blocks (each cache holds this many slots)
    idle_timeout_s: float
    prefix_cache_entries: int     # ended sequences whose KV is kept for the next turn (0: no prefix cache)
    prefix_cache_ttl_s: float     # ... for at most this long
    engine: str                   # the backbone's
    engine_threads: int
    compressor_engine: str
    compressor_threads: int
    # Benchmark only, so that no figure taken with them passes for a real one (named in the startup
    # log and the dualend_synthetic_acceptance_rate gauge): drafts accepted by a seeded draw at this
    # rate instead of the confidence gate (-1: off, the gate decides; dual-end only) ...
    synthetic_acceptance: float = -1.0
    weights: str = "trained"      # ... and "dummy": random weights (builder.import_model --dummy)
    # A draft head's drafts are fed only while at most this many sequences decode (0: however many):
    # beyond, a step is compute-bound and a draft costs more than it gives.
    draft_max_batch: int = 0
    # ... and a sequence whose recent drafts were kept less often than this pauses drafting (decode.DraftPacer).
    draft_min_acceptance: float = 0.0
    # While more than one client (API key) has requests running, or had one end within fair_linger_s,
    # each decodes at most this many of them per step (scheduler.Scheduler; 0: every row, always).
    fair_rows_per_client: int = 0
    fair_linger_s: float = 0.0

    def __post_init__(self):
        if self.synthetic_acceptance != -1.0 and not (self.pair_size == 2 and 0 <= self.synthetic_acceptance <= 1):
            raise ValueError(f"{self.deployment}: synthetic_acceptance {self.synthetic_acceptance:g}: a rate in "
                             f"[0, 1] for a dual-end deployment, or -1 (off)")
        if self.fair_rows_per_client < 0 or self.fair_linger_s < 0:
            raise ValueError(f"{self.deployment}: fair_rows_per_client {self.fair_rows_per_client} and fair_linger_s "
                             f"{self.fair_linger_s:g} must be >= 0 (0 rows: steps never shared)")
        if self.weights not in WEIGHTS:
            raise ValueError(f"{self.deployment}: weights {self.weights!r}, not one of {', '.join(WEIGHTS)}")

    @property
    def synthetic_rate(self) -> float | None:
        """The synthetic acceptance rate, None when the gate decides."""
        return None if self.synthetic_acceptance == -1.0 else self.synthetic_acceptance

    def benchmark_notices(self) -> list[str]:
        """What makes this deployment's figures a benchmark's only, each said in full (empty: none)."""
        notices = []
        if self.synthetic_rate is not None:
            notices.append(f"SYNTHETIC ACCEPTANCE {self.synthetic_rate:g}: benchmark only, drafts accepted by a "
                           f"draw, not by the gate")
        if self.weights == "dummy":
            notices.append("DUMMY WEIGHTS: random, benchmark only, its output is noise")
        return notices

    @classmethod
    def from_args(cls, args: dict) -> "DeploymentConfig":
        """From the args of a Triton model's initialize(); a missing or mistyped parameter names itself."""
        config = json.loads(args["model_config"])
        model = args.get("model_name", config.get("name", "model"))
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        values = {}
        for field in fields(cls):
            kind = _KINDS[field.type]
            if field.name not in parameters:
                raise KeyError(f"{model}: the model config has no parameter {field.name!r}: the repository was built "
                               f"by another version of dualend; rebuild it with `python -m builder.assemble`")
            try:
                values[field.name] = kind(parameters[field.name])
            except ValueError:
                raise ValueError(f"{model}: parameter {field.name!r} is {parameters[field.name]!r}, "
                                 f"not {kind.__name__}: rebuild the repository with `python -m builder.assemble`"
                                 ) from None
        return cls(**values)

    def limits(self) -> Limits:
        """What the request contract checks a request against."""
        return Limits(self.raw_context_limit, self.pair_size, self.max_new_tokens)

    @property
    def sequence_slots(self) -> int:
        return max_sequence_latents(self.raw_context_limit, self.max_new_tokens, self.pair_size)

    def kv_cache_options(self) -> dict:
        """A KV cache's layout from this config: rows as wide as one request can grow, laid out in
        steps of a block."""
        return {"max_row_slots": self.sequence_slots, "bucket": self.kv_block_size,
                "idle_timeout_s": self.idle_timeout_s,
                "kept_timeout_s": self.prefix_cache_ttl_s + 60}  # the loop releases them first

    def pbtxt(self) -> str:
        """The config.pbtxt `parameters` lines that `from_args` reads back."""
        return "\n".join(f'parameters {{ key: "{name}" value: {{ string_value: "{value}" }} }}'
                         for name, value in asdict(self).items())


_KINDS = {"str": str, "int": int, "float": float}
WEIGHTS = ("trained", "dummy")


def version_components(args: dict, names: tuple[str, ...]) -> ExportedModel:
    """The verified components that sit in a Triton model's version folder."""
    return ExportedModel.open(Path(args["model_repository"]) / args["model_version"], names)


def pipeline_name(deployment: str, generation: int) -> str:
    return f"{deployment}_v{generation}"


def generation_of(model: str, deployment: str) -> int | None:
    """The generation of one of the deployment's internal models (`dualend_v3_backbone` -> 3), None
    for any other name (the ensemble itself, another deployment's models)."""
    match = re.fullmatch(rf"{re.escape(deployment)}_v(\d+)_\w+", model)
    return int(match.group(1)) if match else None


def served_generation(repository: Path, deployment: str) -> int | None:
    """The generation of internal models the deployment's ensemble uses, None if there is none."""
    config = repository / deployment / "config.pbtxt"
    steps = shared_model_config(config).get("ensemble_scheduling", {}).get("step", []) if config.exists() else []
    return generation_of(steps[0]["model_name"], deployment) if steps else None


def served_deployments(repository: Path) -> list[str]:
    """The deployments whose ensemble the repository holds (public ones and variants), by name."""
    return sorted(d.name for d in repository.iterdir() if served_generation(repository, d.name) is not None) \
        if repository.is_dir() else []


def served_tokenizer(repository: Path, deployment: str) -> TextTokenizer:
    """The tokenizer (with its config: specials, chat template) of the generation the deployment's
    ensemble serves, verified against its manifest."""
    generation = served_generation(repository, deployment)
    if generation is None:
        raise FileNotFoundError(f"{repository} serves no deployment {deployment!r}")
    folder = repository / f"{pipeline_name(deployment, generation)}_preprocessing" / "1"
    return ExportedModel.open(folder, ("tokenizer",)).tokenizer()


def served_config(repository: Path, deployment: str) -> DeploymentConfig | None:
    """The DeploymentConfig of the generation the deployment's ensemble serves, read from its
    mtp_verify's config.pbtxt (None when it serves none)."""
    generation = served_generation(repository, deployment)
    if generation is None:
        return None
    model = f"{pipeline_name(deployment, generation)}_mtp_verify"
    config = repository / model / "config.pbtxt"
    if not config.exists():
        return None
    return DeploymentConfig.from_args({"model_name": model, "model_config": json.dumps(shared_model_config(config))})


def served_benchmark_notices(repository: Path, deployment: str) -> list[str]:
    """`DeploymentConfig.benchmark_notices` of the generation the deployment's ensemble serves (empty
    when it serves none)."""
    config = served_config(repository, deployment)
    return config.benchmark_notices() if config else []


def generations(repository: Path, deployment: str) -> list[int]:
    return sorted({g for p in repository.glob(f"{deployment}_v*_*")
                   if (g := generation_of(p.name, deployment)) is not None})


def prune_generations(repository: Path, deployment: str, keep: set[str], keep_newer_than: int | None = None
                      ) -> list[str]:
    """Removes the folders of the deployment's generations not in `keep` (pipeline names) and, with
    `keep_newer_than`, not newer than that generation (one assembled meanwhile stays); returns the
    pipelines removed. Only for generations no server has loaded."""
    removed = []
    for generation in generations(repository, deployment):
        pipeline = pipeline_name(deployment, generation)
        if pipeline not in keep and (keep_newer_than is None or generation <= keep_newer_than):
            for folder in repository.glob(f"{pipeline}_*"):
                shutil.rmtree(folder, ignore_errors=True)
            removed.append(pipeline)
    return removed
