"""What the front owes every client besides translation: a fair share per API key, and an end to a
request whose deployment failed under it.

- `KeyCaps`: what one API key has running and waiting is capped (its `max_requests`); one more is
  refused at once with 429, so one client cannot take every decode slot and queue place.
- `DownMarks`: the watchdog's marks (`<gateway prefix>/down/<deployment>`, `_server` for all),
  polled; every time a deployment goes down its epoch counts up, so a request knows whether its
  deployment failed since it started, even once the mark is gone again (tritonserver 2.51 never ends
  the requests of a dead Python stub: the front must).
"""
from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from pathlib import Path

from ..api_keys import ApiKey
from ..watchdog import STUCK_MARK
from .translation import ApiError


class KeyCaps:
    def __init__(self):
        self.in_flight: dict[str, int] = {}

    @contextmanager
    def admit(self, client: ApiKey):
        held = self.in_flight.get(client.name, 0)
        if held >= client.max_requests:
            raise ApiError(429, f"this API key has {held} requests running or waiting, its cap (max_requests "
                                f"{client.max_requests}); wait for one to end", code="too_many_requests_for_key")
        self.in_flight[client.name] = held + 1
        try:
            yield
        finally:
            self.in_flight[client.name] -= 1


class DownMarks:
    """The deployments the watchdog marks down, polled every `interval_s`."""

    def __init__(self, down_dir: Path | None, deployments: tuple[str, ...], interval_s: float = 0.1):
        self.down_dir, self.deployments, self.interval_s = down_dir, deployments, interval_s
        self.down: set[str] = set()
        self.epochs = dict.fromkeys(deployments, 0)

    def poll(self) -> None:
        if self.down_dir is None:
            return
        everything = (self.down_dir / STUCK_MARK).exists()
        now_down = {d for d in self.deployments if everything or (self.down_dir / d).exists()}
        for deployment in now_down - self.down:
            self.epochs[deployment] += 1
        self.down = now_down

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.interval_s)

    def check_up(self, deployment: str) -> None:
        if deployment in self.down:
            raise ApiError(503, f"{deployment} is restoring a failed component; retry in a few seconds", code="retry")


class Progress:
    """One request's watch: ended with 503 "retry" when its deployment was marked down since it
    started and no response came for `stall_s`."""

    def __init__(self, marks: DownMarks, deployment: str, stall_s: float):
        self.marks, self.deployment, self.stall_s = marks, deployment, stall_s
        self.epoch = marks.epochs.get(deployment, 0)
        self.last = time.monotonic()

    def advanced(self) -> None:
        self.last = time.monotonic()

    def check(self) -> None:
        failed = self.deployment in self.marks.down or self.marks.epochs.get(self.deployment, 0) != self.epoch
        if failed and time.monotonic() - self.last > self.stall_s:
            raise ApiError(503, f"a component of {self.deployment} failed while serving this request and it made "
                                f"no progress for {self.stall_s:g} s; the request ends here, retry", code="retry")
