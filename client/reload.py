"""Hot-reload a deployment on a running tritonserver started with model control mode "explicit".

    .venv/bin/python -m builder.assemble                     # new checkpoint -> build/model_repository
    .venv/bin/python -m client.reload --deployment dualend   # swap it in, nothing restarted

First it checks the deployment's components in the repository (every manifest's sha256 and one
checkpoint id across them) and leaves the server alone if they do not agree. Then it asks Triton to
load the backbone and the ensemble, which reloads the ensemble's changed steps. Triton builds a new
copy of each model beside the old one and swaps it in when ready; a copy that fails to load leaves
the old one serving. Last, it checks that the deployment now serves the repository's checkpoint.

While the backbone and the MTP head serve different checkpoints (the seconds between the two
loads), requests end with "checkpoint mismatch ... a model reload is under way, retry", and a
stream that was running when the backbone was swapped ends with an error that names the lost
sequence: never with text mixed from two checkpoints.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dualend.launch import DEFAULT_REPOSITORY
from dualend.manifest import MANIFEST, ManifestError, verify_component, verify_siblings


class ReloadError(RuntimeError):
    """The reload was refused or did not take; the message says which model and why."""


def repository_checkpoint(repository: Path, deployment: str) -> str:
    """The one checkpoint id of the deployment's components on disk; ManifestError if they disagree."""
    model_dirs = [d for d in sorted(repository.iterdir()) if d.name == deployment or d.name.startswith(f"{deployment}_")]
    manifests = [verify_component(m.parent) for d in model_dirs for m in sorted(d.glob(f"*/*/{MANIFEST}"))]
    if not manifests:
        raise ManifestError(f"{repository} holds no components of deployment {deployment!r}")
    return verify_siblings(manifests)


def served_checkpoint(client, deployment: str) -> str:
    config = client.get_model_config(deployment)
    return config.get("parameters", {}).get("checkpoint_id", {}).get("string_value", "")


def reload(http_url: str, deployment: str, repository: Path) -> str:
    """Loads the deployment's new copy; returns the checkpoint id it serves afterwards."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    try:
        expected = repository_checkpoint(repository, deployment)
    except ManifestError as error:
        raise ReloadError(f"not reloading {deployment}: the repository is inconsistent: {error}") from None
    client = httpclient.InferenceServerClient(http_url)
    try:
        for model in (f"{deployment}_backbone", deployment):
            try:
                client.load_model(model)
            except InferenceServerException as error:
                raise ReloadError(f"loading {model} failed; Triton keeps serving its previous copy: "
                                  f"{error.message()}") from None
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
    parser.add_argument("--url", default="127.0.0.1:8000", help="Triton's HTTP endpoint")
    parser.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY,
                        help="the repository the server runs from (to check it before loading)")
    args = parser.parse_args(argv)
    try:
        checkpoint = reload(args.url, args.deployment, args.repository)
    except ReloadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.deployment}: serving checkpoint {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
