"""Hot-reload a deployment on a running tritonserver started with model control mode "explicit".

    .venv/bin/python -m builder.assemble                     # new checkpoint -> build/model_repository
    .venv/bin/python -m client.reload --deployment dualend   # swap it in, nothing restarted

First it checks the deployment's components in the repository (every manifest's sha256 and one
checkpoint id across them) and leaves the server alone if they do not agree. Then it drains: it
unloads the ensemble, so new requests are refused by Triton while the running streams finish, and
waits until the backbone holds no sequence (the backbone is never swapped under a live sequence).
Then it loads the backbone and the ensemble, which reloads the ensemble's changed steps. Last, it
checks that the deployment now serves the repository's checkpoint. The other deployment is not
touched.

Streams still running after `--drain-timeout-s` are cut by the swap, with an error that names the
lost sequence. The backbone names its checkpoint when a sequence starts and mtp_verify checks it,
so no response ever mixes two checkpoints.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dualend.launch import ADMIN_HEADER, DEFAULT_REPOSITORY, INTERNAL_HTTP_PORT, admin_key
from dualend.manifest import MANIFEST, ManifestError, verify_component, verify_siblings

from .api import metric_value


class ReloadError(RuntimeError):
    """The reload was refused or did not take; the message says which model and why."""


def repository_checkpoint(repository: Path, deployment: str) -> str:
    """The one checkpoint id of the deployment's components on disk; ManifestError if they disagree."""
    model_dirs = [d for d in sorted(repository.iterdir())
                  if d.name == deployment or d.name.startswith(f"{deployment}_")]
    manifests = [verify_component(m.parent) for d in model_dirs for m in sorted(d.glob(f"*/*/{MANIFEST}"))]
    if not manifests:
        raise ManifestError(f"{repository} holds no components of deployment {deployment!r}")
    return verify_siblings(manifests)


def live_sequences(metrics_url: str, deployment: str) -> int:
    value = metric_value(metrics_url, "dualend_kv_live_sequences", f"{deployment}_backbone")
    if value is None:
        raise ReloadError(f"{metrics_url} reports no dualend_kv_live_sequences for {deployment}_backbone")
    return int(value)


def served_checkpoint(client, deployment: str) -> str:
    config = client.get_model_config(deployment)
    return config.get("parameters", {}).get("checkpoint_id", {}).get("string_value", "")


def reload(http_url: str, metrics_url: str, deployment: str, repository: Path, drain_timeout_s: float = 60.0,
           key: str | None = None) -> str:
    """Drains the deployment and loads its new copy; returns the checkpoint id it serves afterwards.
    `key`: the server's admin key (default: the launcher's, from $DUALEND_ADMIN_KEY or its file)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    try:
        expected = repository_checkpoint(repository, deployment)
    except ManifestError as error:
        raise ReloadError(f"not reloading {deployment}: the repository is inconsistent: {error}") from None
    key = key or admin_key()
    headers = {ADMIN_HEADER: key} if key else None
    client = httpclient.InferenceServerClient(http_url, network_timeout=300.0)
    try:
        try:
            client.unload_model(deployment, headers=headers)
        except InferenceServerException as error:
            raise ReloadError(f"the server refused to unload {deployment}: {error.message()} (the repository API "
                              "needs the admin key: set $DUALEND_ADMIN_KEY or pass --key)") from None
        deadline = time.monotonic() + drain_timeout_s
        while (live := live_sequences(metrics_url, deployment)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if live:
            print(f"warning: {live} streams of {deployment} still running after {drain_timeout_s:.0f} s; "
                  "the swap cuts them", file=sys.stderr)
        for model in (f"{deployment}_backbone", deployment):
            try:
                client.load_model(model, headers=headers)
            except InferenceServerException as error:
                raise ReloadError(f"loading {model} failed, so {deployment} is not serving; fix the repository "
                                  f"and run the reload again: {error.message()}") from None
        served = served_checkpoint(client, deployment)
        if served != expected:
            raise ReloadError(f"{deployment} serves checkpoint {served or '(unknown)'} after the reload, "
                              f"the repository holds {expected}")
        return served
    finally:
        client.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployment", required=True, help="dualend or baseline")
    parser.add_argument("--url", default=f"127.0.0.1:{INTERNAL_HTTP_PORT}",
                        help="tritonserver's own HTTP endpoint, behind the gateway (with --no-gateway: 127.0.0.1:8000)")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics", help="Triton's metrics endpoint")
    parser.add_argument("--drain-timeout-s", type=float, default=60.0,
                        help="how long running streams may take to finish before the swap")
    parser.add_argument("--key", default=None, help="the server's admin key (default: $DUALEND_ADMIN_KEY, "
                        "else the launcher's build/gateway/admin_key)")
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY,
                        help="the repository the server runs from (to check it before loading)")
    args = parser.parse_args(argv)
    try:
        checkpoint = reload(args.url, args.metrics_url, args.deployment, args.repository, args.drain_timeout_s,
                            args.key)
    except ReloadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.deployment}: serving checkpoint {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
