"""What the front owes every client besides translation: a fair share per API key, and an end to a
request whose deployment failed under it.

- `KeyCaps`: what one API key has running and waiting is capped (its `max_requests`); one more is
  refused at once with 429, so one client cannot take every decode slot and queue place.
- `DownMarks`: the watchdog's marks (`<gateway prefix>/down/<deployment>`, `_server` for all),
  polled; every time a deployment goes down its epoch counts up, so a request knows whether its
  deployment failed since it started, even once the mark is gone again (tritonserver 2.51 never ends
  the requests of a dead Python stub: the front must).
- `DisconnectAwareStream`: a streamed answer that learns at once that its client left;
  `unless_gone`: the same before an answer starts (a request waiting in the queue for its first token).
- `Readiness`: whether tritonserver has a deployment loaded and ready, asked at most once a second, so
  /v1/models names only what is served and a request for an unloaded deployment is refused at once.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from pathlib import Path

import anyio
from starlette.responses import StreamingResponse

from dualend.serving.outcomes import Outcome

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
            raise ApiError.of(Outcome.KEY_CAP, f"this API key has {held} requests running or waiting on this "
                                                f"service's routes, its cap (max_requests {client.max_requests}); "
                                                "wait for one to end")
        self.in_flight[client.name] = held + 1
        try:
            yield
        finally:
            self.in_flight[client.name] -= 1


class DownMarks:
    """The deployments the watchdog marks down, polled every `interval_s`."""

    def __init__(self, down_dir: Path | None, interval_s: float = 0.1):
        self.down_dir, self.interval_s = down_dir, interval_s
        self.down: set[str] = set()      # deployment names; STUCK_MARK stands for all
        self.epochs: dict[str, int] = {}

    def poll(self) -> None:
        if self.down_dir is None:
            return
        try:
            now_down = {mark.name for mark in self.down_dir.iterdir()}
        except FileNotFoundError:
            now_down = set()
        for deployment in now_down - self.down:
            self.epochs[deployment] = self.epochs.get(deployment, 0) + 1
        self.down = now_down

    def is_down(self, deployment: str) -> bool:
        return deployment in self.down or STUCK_MARK in self.down

    def epoch(self, deployment: str) -> tuple[int, int]:
        return self.epochs.get(deployment, 0), self.epochs.get(STUCK_MARK, 0)

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.interval_s)

    def check_up(self, deployment: str) -> None:
        if self.is_down(deployment):
            raise ApiError.of(Outcome.STEP_FAILED, f"{deployment} is restoring a failed or stopped component; retry "
                                                   "in a few seconds")


class Progress:
    """One request's watch: ended with 503 "retry" when its deployment was marked down since it
    started and no response came for `stall_s`, or, for a request answered in a stream, when no response
    came for `hang_s` whatever the marks say (a step that hangs without dying or being stopped)."""

    def __init__(self, marks: DownMarks, deployment: str, stall_s: float, hang_s: float | None = None,
                 clock=time.monotonic):
        self.marks, self.deployment, self.stall_s, self.hang_s, self.clock = marks, deployment, stall_s, hang_s, clock
        self.epoch = marks.epoch(deployment)
        self.last = clock()

    def advanced(self) -> None:
        self.last = self.clock()

    def check(self) -> None:
        silent = self.clock() - self.last
        failed = self.marks.is_down(self.deployment) or self.marks.epoch(self.deployment) != self.epoch
        if failed and silent > self.stall_s:
            raise ApiError.of(Outcome.STEP_FAILED, f"a component of {self.deployment} failed while serving this "
                                                   f"request and it made no progress for {self.stall_s:g} s; the "
                                                   "request ends here, retry")
        if self.hang_s and silent > self.hang_s:  # None or 0: not watched
            raise ApiError.of(Outcome.STEP_FAILED, f"{self.deployment} sent nothing for this request for "
                                                   f"{self.hang_s:g} s (a step is hung); the request ends here, retry")


class Readiness:
    """Whether tritonserver has a deployment's ensemble loaded and ready. `probe(name)` asks the server
    (ModelReady over gRPC, which needs no admin key); its answer is reused for `ttl_s`, and the callers
    that come while it is asked wait for the same answer, so the models list and every request stay cheap.
    A server that does not answer is a 503 "retry", also reused for `ttl_s`."""

    def __init__(self, probe, ttl_s: float = 1.0, clock=time.monotonic):
        self.probe, self.ttl_s, self.clock = probe, ttl_s, clock
        self.answers: dict[str, tuple[float, asyncio.Future]] = {}  # deployment -> (asked at, answer)

    async def is_ready(self, deployment: str) -> bool:
        asked = self.answers.get(deployment)
        if asked is None or self.clock() - asked[0] >= self.ttl_s:
            asked = self.answers[deployment] = (self.clock(), asyncio.ensure_future(self.ask(deployment)))
        return await asyncio.shield(asked[1])  # a caller that leaves does not cancel the others' answer

    async def ask(self, deployment: str) -> bool:
        try:
            return bool(await self.probe(deployment))
        except Exception as error:  # noqa: BLE001 - unreachable or timed out: whatever it is, retry later
            raise ApiError(503, f"the inference server does not answer whether `{deployment}` is ready ({error}); "
                                "retry", code="retry") from None


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def unless_gone(receive, awaitable):
    """The awaitable's result, or ClientGone (the awaitable cancelled) once the client disconnects
    first; `receive` is the request's (its body already read, the next message is the disconnect)."""
    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # its cleanup done (an async generator it ran is closed by then)
    raise ClientGone


class DisconnectAwareStream(StreamingResponse):
    """A streaming response that always listens for the client's disconnect, so a client gone while
    no token comes still cancels its request (Starlette on ASGI 2.4 learns it only from a failed send);
    `close` runs however the response ends."""

    def __init__(self, content, close, **options):
        super().__init__(content, **options)
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def respond():
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    group.cancel_scope.cancel()

                group.start_soon(respond)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()
