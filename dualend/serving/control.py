"""Control requests to a deployment's decode loop (mtp_verify), built and read here only.

A control request carries mtp_verify's optional `control` input (the action) and, for a cancel,
`cancel_id` (the `request_id` mtp_verify put on that request's responses), with the pipeline's secret as
`pipeline_key`: a control request takes the secret alone, never a token of the ensemble's steps.
- cancel: postprocessing, when Triton marks a request's next step as cancelled (Triton 2.51 does
  not pass a client's cancellation on to a running decoupled step);
- drain: the launcher, before it stops the server: every stream ends at once with an error that
  says why, and the loop refuses every request after it.
The builders return numpy inputs by name, for BLS (`pb_utils.Tensor`) and tritonclient callers alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dualend.engine.decode import InvalidRequest

CANCEL, DRAIN = "cancel", "drain"


def cancel_request(request_id: int, secret: str) -> dict[str, np.ndarray]:
    return _request(CANCEL, secret) | {"cancel_id": np.asarray([request_id], dtype=np.uint64)}


def drain_request(secret: str) -> dict[str, np.ndarray]:
    return _request(DRAIN, secret)


def _request(action: str, secret: str) -> dict[str, np.ndarray]:
    return {"control": np.asarray([action.encode()], dtype=object),
            "pipeline_key": np.asarray([secret.encode()], dtype=object)}


@dataclass(frozen=True)
class Control:
    action: str           # CANCEL or DRAIN
    request_id: int = 0   # the request a cancel ends


def read_control(control: np.ndarray, cancel_id: np.ndarray | None) -> Control:
    """A control request's inputs (numpy; `cancel_id` None when absent) -> Control."""
    actions = np.asarray(control, dtype=object).reshape(-1)
    action = actions[0] if actions.size == 1 else b""
    action = action if isinstance(action, str) else bytes(action).decode(errors="replace")
    if action == DRAIN:
        return Control(DRAIN)
    if action != CANCEL:
        raise InvalidRequest(f"control must be {CANCEL!r} or {DRAIN!r}, got {action!r}")
    ids = np.asarray([] if cancel_id is None else cancel_id).reshape(-1)
    if ids.size != 1:
        raise InvalidRequest(f"a cancel names one cancel_id, got {ids.size}")
    return Control(CANCEL, int(ids[0]))
