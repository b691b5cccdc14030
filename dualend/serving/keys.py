"""Pipeline keys: how the steps of one deployment know that a request comes from their own
pipeline (the same server start and checkpoint), not from a client calling an internal step."""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import numpy as np

PIPELINE_SECRET_ENV = "DUALEND_PIPELINE_SECRET"


PIPELINE_SECRET_FILE = "pipeline_secret"  # in the repository root, written by builder.assemble


NOT_FROM_PIPELINE = ("refused: {model} is an internal step of the {deployment} pipeline (or this request comes "
                     "from a step of another checkpoint); send requests to the `{deployment}` model")


def pipeline_secret(args: dict, checkpoint_id: str) -> str:
    """What the models of one pipeline share and clients do not: the launcher's per-start secret
    ($DUALEND_PIPELINE_SECRET), else the one builder.assemble wrote into the repository, bound to
    the checkpoint, so a step also refuses requests from a step of another checkpoint."""
    secret = os.environ.get(PIPELINE_SECRET_ENV)
    if secret:
        return pipeline_key(secret, checkpoint_id)
    path = Path(args["model_repository"]).parent / PIPELINE_SECRET_FILE
    if not path.exists():
        raise RuntimeError(f"no pipeline secret: set ${PIPELINE_SECRET_ENV} or assemble the repository again "
                           f"(python -m builder.assemble writes {PIPELINE_SECRET_FILE})")
    return pipeline_key(path.read_text().strip(), checkpoint_id)


def pipeline_key(secret: str, checkpoint_id: str) -> str:
    return f"{secret}:{checkpoint_id}"


def request_token(secret: str, request_params: bytes) -> str:
    """The `pipeline_key` preprocessing hands the compressor with a request: an HMAC of the request
    parameters it wrote. Preprocessing answers clients too (it is the ensemble's first step), so it
    never hands out the secret itself; a client that calls it gets a token for parameters
    preprocessing wrote, which the compressor takes only with that prompt's tokens."""
    return hmac.new(secret.encode(), b"request\0" + request_params, hashlib.sha256).hexdigest()


def latents_token(secret: str, request_params: bytes, latents: np.ndarray) -> str:
    """The `pipeline_key` the compressor hands mtp_verify: an HMAC of the parameters and of the prompt
    latents it computed from their prompt, so mtp_verify decodes no latents a client made up."""
    latents = np.ascontiguousarray(latents, dtype=np.float32)
    message = b"latents\0%d\0%s\0" % (len(request_params), ",".join(map(str, latents.shape)).encode())
    return hmac.new(secret.encode(), message + request_params + latents.tobytes(), hashlib.sha256).hexdigest()


def response_token(secret: str, request_id: int, output_ids: np.ndarray) -> str:
    """The `pipeline_key` mtp_verify hands postprocessing with each response: an HMAC of the request
    id and the token ids, so postprocessing detokenizes (and relays a cancel for) only what the
    pipeline's own decode loop sent; clients never see it (the ensemble does not output it)."""
    ids = np.ascontiguousarray(output_ids, dtype=np.int64)
    return hmac.new(secret.encode(), b"response\0%d\0" % request_id + ids.tobytes(), hashlib.sha256).hexdigest()


class PipelineGuard:
    """An internal step's check that a request comes from its own pipeline: the same server start
    and the same checkpoint. Steps calling each other (mtp_verify -> backbone, postprocessing's
    cancel, the launcher's drain) present the secret; along the ensemble each step presents the
    token its predecessor made for the very data it passes on (`request_token`, `latents_token`,
    `response_token`)."""

    def __init__(self, args: dict, checkpoint_id: str, deployment: str):
        self.secret = pipeline_secret(args, checkpoint_id)
        self.refusal = NOT_FROM_PIPELINE.format(model=args["model_name"], deployment=deployment)

    def refuses(self, key, token: str | None = None) -> str | None:
        """The refusal message for a request whose `pipeline_key` input (None when absent) is neither
        the pipeline's secret nor `token`, the token this step expects for the data it was given;
        None for one from the pipeline."""
        given = _key_bytes(key)
        if given is not None and (hmac.compare_digest(given, self.secret.encode())
                                  or token is not None and hmac.compare_digest(given, token.encode())):
            return None
        return self.refusal


def _key_bytes(key) -> bytes | None:
    """A `pipeline_key` input's one value as bytes; None when absent or not one value."""
    if key is None:
        return None
    value = np.asarray(key, dtype=object).reshape(-1)
    if value.size != 1:
        return None
    return value[0].encode() if isinstance(value[0], str) else bytes(value[0])
