"""How a request ended other than by finishing, as a value: the one enum every layer passes on, and
the one table that maps it to what each kind of client is told (the HTTP status and OpenAI code of
/v1, Retry-After, and Triton's INVALID_ARG; Triton's own routes carry the code in the message).

On Triton's routes an error response carries only a message (a decoupled stream's error has no
status), so the code travels at the head of it: `[queue_full] server busy: ...`. `outcome_of` reads
that code back exactly; an error whose message has none is tritonserver's own (a model not loaded,
a step's process gone), never ours.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Outcome(str, Enum):
    BAD_REQUEST = "bad_request"                          # a field or the prompt is wrong; the message names it
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over raw_context_limit
    TOO_LARGE = "too_large"                              # needs more KV than the deployment's whole cache
    QUEUE_FULL = "queue_full"                            # the queue is full: retry later
    QUEUE_TIMEOUT = "queue_timeout"                      # waited longer than queue_wait_s for room
    SHUTTING_DOWN = "shutting_down"                      # the deployment drains for a redeploy or a stop
    STEP_FAILED = "step_failed"                          # a step failed or lost the sequence: retry
    NOT_ALLOWED = "not_allowed"                          # an internal model called without the pipeline key
    KEY_CAP = "too_many_requests_for_key"                # the API key has its max_requests running or waiting
    QUOTA_EXCEEDED = "quota_exceeded"                    # the API key used its daily_tokens today (UTC)


@dataclass(frozen=True)
class Disposition:
    http_status: int
    openai_code: str | None     # the OpenAI error body's `code`
    retry_after_s: int | None   # Retry-After, on the refusals a client retries
    invalid_argument: bool      # Triton's INVALID_ARG on the error response


DISPOSITIONS = {
    Outcome.BAD_REQUEST: Disposition(400, None, None, True),
    Outcome.CONTEXT_LENGTH_EXCEEDED: Disposition(400, "context_length_exceeded", None, True),
    Outcome.TOO_LARGE: Disposition(400, "too_large", None, True),
    Outcome.QUEUE_FULL: Disposition(429, "server_busy", 1, False),
    Outcome.QUEUE_TIMEOUT: Disposition(503, "retry", 2, False),
    Outcome.SHUTTING_DOWN: Disposition(503, "retry", 2, False),
    Outcome.STEP_FAILED: Disposition(503, "retry", 2, False),
    Outcome.NOT_ALLOWED: Disposition(403, "not_allowed", None, False),
    Outcome.KEY_CAP: Disposition(429, "too_many_requests_for_key", 1, False),
    Outcome.QUOTA_EXCEEDED: Disposition(429, "quota_exceeded", None, False),  # Retry-After: to the next day
}
# tritonserver's own errors (no code of ours): a model being restored or a step's process gone
UNTAGGED = Disposition(503, "retry", 2, False)
# what the decode loop counts as refused (metric label `reason`)
REFUSALS = (Outcome.QUEUE_FULL, Outcome.QUEUE_TIMEOUT, Outcome.TOO_LARGE, Outcome.SHUTTING_DOWN, Outcome.STEP_FAILED)

_TAG = re.compile(r"\[([a-z_]+)\] ")  # matched at a position: the code heads the message


def tagged(outcome: Outcome, message: str) -> str:
    return f"[{outcome.value}] {message}"


def outcome_of(message: str) -> tuple[Outcome | None, str]:
    """(the outcome a message carries, the message without it); (None, message) for an untagged one.
    The code may sit behind the prefix tritonserver adds to an ensemble step's error ("in ensemble
    'x', ..."), so it is looked for at the head of the message or right after such a prefix."""
    for start in (0, message.find(", ") + 2 if message.startswith("in ensemble") else -1):
        match = _TAG.match(message, start) if start >= 0 else None
        if match and match.group(1) in Outcome._value2member_map_:
            return Outcome(match.group(1)), message[:start] + message[match.end():]
    return None, message


def disposition(message: str) -> tuple[Outcome | None, Disposition, str]:
    outcome, text = outcome_of(message)
    return outcome, DISPOSITIONS[outcome] if outcome else UNTAGGED, text
