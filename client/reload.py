"""Redeploy (or roll back) a deployment on a running tritonserver, without refusing a request.

    .venv/bin/python -m builder.assemble                     # new checkpoint -> a new version in build/model_repository
    .venv/bin/python -m client.reload --deployment dualend   # swap it in, nothing restarted, nobody refused

`builder.assemble` writes the new checkpoint as a new generation of the internal models
(`dualend_v2_backbone`, `dualend_v2_mtp_verify`, ...), beside the generation the running ensemble
uses, and points the ensemble `dualend` at it on disk. This tool then:
1. checks the new generation on disk: every manifest's sha256, one checkpoint id across the five
   pipeline steps and the backbone, the ensemble naming that checkpoint; a bad repository is
   refused before anything is loaded;
2. loads the new backbone, then the ensemble (which loads its new steps): Triton swaps the
   ensemble only once the new one is ready, so new requests move to the new generation at once
   and none is refused, while running streams finish on the old one (every step checks that its
   caller is of its own pipeline and checkpoint);
3. checks health: the ensemble is ready, serves the new checkpoint and answers a generation;
4. waits until the old generation holds no request (`--drain-timeout-s`), then unloads its models
   and removes their folders. If requests are still running when the wait runs out, it leaves the
   old generation loaded and says so (exit 1); running it again loads nothing (the new generation
   is already served) and waits again.
A rollback is the same: assemble the previous checkpoint (it becomes the next generation) and run
this again. Needs the server in model control mode "explicit" and its admin key; it calls the
repository API over gRPC (`dualend.ops.repository_api` says why not HTTP).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from client.api import RequestError, metric_in, metrics_page, stream_grpc
from dualend.engine.manifest import MANIFEST, ManifestError, verify_component, verify_siblings
from dualend.ops.launch import DEFAULT_REPOSITORY, INTERNAL_GRPC_PORT, admin_key
from dualend.ops.repository_api import RepositoryAPI
from dualend.serving.model_config import ModelConfigError, config_checkpoint, ensemble_pipeline, read_model_config
from dualend.serving.repository import generation_of, pipeline_name, prune_generations

INTERNAL_STEPS = ("backbone", "mtp_verify", "compressor", "preprocessing", "postprocessing")


class ReloadError(RuntimeError):
    """The reload was refused or did not take; the message says which model and why."""


def repository_checkpoint(repository: Path, deployment: str) -> tuple[str, str, dict]:
    """(checkpoint id, pipeline, ensemble config) of what the deployment's ensemble uses on disk,
    read once; ManifestError if its components disagree."""
    try:
        config = read_model_config(repository / deployment / "config.pbtxt")
    except OSError:
        config = {}
    except ModelConfigError as error:
        raise ManifestError(str(error)) from None
    pipeline = ensemble_pipeline(config)
    if pipeline is None or generation_of(f"{pipeline}_backbone", deployment) is None:
        raise ManifestError(f"{repository} holds no ensemble {deployment!r}")
    manifests = [verify_component(m.parent) for step in INTERNAL_STEPS
                 for m in sorted((repository / f"{pipeline}_{step}" / "1").glob(f"*/{MANIFEST}"))]
    if not manifests:
        raise ManifestError(f"{repository} holds no components of {pipeline}")
    checkpoint = verify_siblings(manifests)
    named = config_checkpoint(config)
    if named != checkpoint:
        raise ManifestError(f"{deployment}'s ensemble names checkpoint {named}, its steps are {checkpoint}")
    return checkpoint, pipeline, config


def served_checkpoint(api: RepositoryAPI, deployment: str) -> str:
    return config_checkpoint(api.config(deployment)) or ""


def loaded_models(api: RepositoryAPI, deployment: str) -> dict[str, list[str]]:
    """{pipeline: its READY models} of the deployment, e.g. {"dualend_v1": ["dualend_v1_backbone", ...]}."""
    loaded: dict[str, list[str]] = {}
    for model in api.index():
        generation = generation_of(model["name"], deployment)
        if generation is not None and model.get("state") == "READY":
            loaded.setdefault(pipeline_name(deployment, generation), []).append(model["name"])
    return loaded


def loaded_pipelines(api: RepositoryAPI, deployment: str) -> list[str]:
    """The pipelines (one per generation) of the deployment with a model loaded, e.g. ["dualend_v1"]."""
    return sorted(loaded_models(api, deployment))


def busy(metrics_url: str, pipeline: str) -> bool:
    """Whether a generation still has a request: queued or decoding in its loop, or holding KV."""
    page = metrics_page(metrics_url)
    return any(metric_in(page, name, f"{pipeline}_{step}") for name, step in (
        ("dualend_kv_live_sequences", "backbone"), ("dualend_running_sequences", "mtp_verify"),
        ("dualend_waiting_requests", "mtp_verify")))


def load_beside(api: RepositoryAPI, deployment: str, pipeline: str, ensemble: dict, old: list[str]) -> None:
    """Loads the new generation's models one by one, then the ensemble with the config read at the
    start (an assemble meanwhile must not swap in a generation whose models were not loaded). If any
    fails, the new models are unloaded and the ensemble is put back as it was served: a bad
    generation changes nothing."""
    from tritonclient.utils import InferenceServerException

    try:
        served = api.config(deployment)
    except InferenceServerException:  # no ensemble loaded: nothing to put back
        served = None
    model = deployment
    try:
        for step in INTERNAL_STEPS:  # backbone first: mtp_verify's loop calls it
            model = f"{pipeline}_{step}"
            api.load(model)
        model = deployment
        api.load(deployment, ensemble)
    except InferenceServerException as error:
        if served is not None and model == deployment:
            api.load(deployment, served)
        for loaded in loaded_models(api, deployment).get(pipeline, []):
            api.unload(loaded)
        raise ReloadError(f"loading failed; {deployment} keeps serving {old}: {model}: {error.message()}") from None


def reload(grpc_url: str, metrics_url: str, deployment: str, repository: Path, drain_timeout_s: float = 60.0,
           key: str | None = None, force: bool = False) -> str:
    """Swaps in the generation the repository's ensemble uses; returns the checkpoint id it serves.
    `grpc_url`: tritonserver's own gRPC endpoint; `key`: its admin key (default: the launcher's, from
    $DUALEND_ADMIN_KEY or its file); `force`: unload the old generation even if it still holds
    requests after the drain (e.g. its decode loop died, so its gauges never fall)."""
    from tritonclient.utils import InferenceServerException

    try:
        expected, pipeline, ensemble = repository_checkpoint(repository, deployment)
    except (ManifestError, OSError) as error:
        raise ReloadError(f"not reloading {deployment}: the repository is inconsistent: {error}") from None
    api = RepositoryAPI(grpc_url, key or admin_key())

    def call(action, model, why):
        try:
            action(model)
        except InferenceServerException as error:
            raise ReloadError(f"{why}: {model}: {error.message()}") from None

    try:
        try:
            old = [p for p in loaded_pipelines(api, deployment) if p != pipeline]
        except InferenceServerException as error:
            raise ReloadError(f"the server refused the repository API: {error.message()} (it needs the admin "
                              f"key: set $DUALEND_ADMIN_KEY or pass --key)") from None
        swapped = (api.serving_pipeline(deployment) == pipeline
                   and f"{pipeline}_backbone" in loaded_models(api, deployment).get(pipeline, []))
        if not swapped:  # a repeated run (e.g. after a drain that ran out) loads nothing again
            load_beside(api, deployment, pipeline, ensemble, old)
        served = served_checkpoint(api, deployment)
        if served != expected or not api.is_ready(deployment):
            raise ReloadError(f"{deployment} serves checkpoint {served or '(unknown)'} after the reload, the "
                              f"repository holds {expected}")
        try:
            stream_grpc(grpc_url, deployment, "Q: 1+1\nA:", 1, stream=False, timeout_s=60)
        except RequestError as error:
            raise ReloadError(f"{deployment} loaded {pipeline} but does not answer: {error}") from None
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline and any(busy(metrics_url, p) for p in old):
            time.sleep(0.1)
        if (still := [p for p in old if busy(metrics_url, p)]) and not force:
            raise ReloadError(f"{deployment} serves {pipeline}, but {', '.join(still)} still holds requests after "
                              f"{drain_timeout_s:g} s (--drain-timeout-s), so it stays loaded; run client.reload "
                              f"again to unload it once they finish (--force: now, ending them)")
        for stale in old:
            for model in loaded_models(api, deployment).get(stale, []):
                call(api.unload, model, "unloading the old generation failed")
        prune_generations(repository, deployment, keep={pipeline},  # unloaded, or never loaded; not one
                          keep_newer_than=generation_of(f"{pipeline}_backbone", deployment))  # assembled meanwhile
        return served
    finally:
        api.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployment", required=True, help="dualend or baseline")
    parser.add_argument("--url", default=f"127.0.0.1:{INTERNAL_GRPC_PORT}",
                        help="tritonserver's own gRPC endpoint, behind the gateway (with --no-gateway: 127.0.0.1:8001)")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics", help="Triton's metrics endpoint")
    parser.add_argument("--drain-timeout-s", type=float, default=60.0,
                        help="how long requests on the old generation may take to finish before it is unloaded")
    parser.add_argument("--force", action="store_true",
                        help="unload the old generation even if requests still run on it after the drain (they "
                             "end with an error), e.g. when its decode loop died and its gauges stay up")
    parser.add_argument("--key", default=None, help="the server's admin key (default: $DUALEND_ADMIN_KEY, "
                        "else the launcher's build/gateway/admin_key)")
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY,
                        help="the repository the server runs from")
    args = parser.parse_args(argv)
    try:
        checkpoint = reload(args.url, args.metrics_url, args.deployment, args.repository, args.drain_timeout_s,
                            args.key, args.force)
    except ReloadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.deployment}: serving checkpoint {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
