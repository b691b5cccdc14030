"""Restores a model whose Python backend stub died; tritonserver 2.51 does neither.

A killed stub is not restarted by Triton, and its model and the server keep answering "ready". The
launcher runs this watchdog: every `interval_s` it compares the stubs alive with the models Triton
lists as READY. A READY model without a stub has failed: its deployment is marked down at the gateway
(routes and readiness answer 503 with a message that says so), a new instance of the model is
loaded through the repository API and takes over (`RepositoryAPI.replace`: the model never goes away,
so its ensemble keeps serving), and the mark is removed once its stub is back. A stub that is stopped
(kill -STOP) marks its deployment down at once, and is killed once stopped for `STOPPED_KILL_AFTER_S`,
then restored as a dead one: tritonserver 2.51 soon finds it "not healthy", and aborts (the whole
server, on a boost::interprocess::lock_exception) when such a stub runs again. Only the generation the loaded ensemble runs is restored:
a redeploy's old generation, draining or unloaded, is left alone. A model whose restores keep failing
(`STUCK_AFTER` in a row) makes the gateway's liveness answer 503, so an orchestrator restarts the server. Streams that were using a dead
backbone end with the decode loop's error; streams inside a dead mtp_verify get no end (tritonserver
2.51's Python backend never sends it) from tritonserver: the service in front of every route (the
OpenAI-compatible service, which also fronts Triton's HTTP and gRPC routes) ends them when it sees the mark. That service, a process of its own, is started again
if it exits (`services`).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from dualend.serving.repository import PUBLIC_DEPLOYMENTS, generation_of, pipeline_name

from .processes import is_stopped, stub_processes
from .repository_api import RepositoryAPI

log = logging.getLogger(__name__)

STUCK_MARK = "_server"  # in down_dir: the gateway's liveness answers 503, so an orchestrator restarts the server
STOPPED_KILL_AFTER_S = 3.0  # a stub stopped this long is killed and restored
STUCK_AFTER = 3  # failed restores of one model in a row (a load can hang in tritonserver, e.g. a stub killed
                 # while its replacement starts leaves the model LOADING for good)


class Watchdog:
    def __init__(self, server, down_dir: Path | None, deployments: tuple[str, ...] = PUBLIC_DEPLOYMENTS,
                 interval_s: float = 1.0, services: tuple = ()):
        self.server, self.down_dir, self.deployments, self.interval_s = server, down_dir, deployments, interval_s
        self.services = services  # each with ensure_running(): started again if it exited
        self.stopping = threading.Event()
        self.repository = RepositoryAPI(server.grpc_url, server.admin_key, timeout_s=60.0)
        self.failures: dict[str, int] = {}  # model -> restores failed in a row; retried each round
        self.stopped: set[str] = set()      # deployments marked down because a stub of theirs is stopped
        self.stopped_since: dict[int, float] = {}  # stub pid -> when it was first seen stopped
        self.marked: set[str] = set()       # the marks this watchdog wrote (an operator's it leaves alone)

    def failed_models(self, ready: list[str]) -> list[str]:
        """Of the READY models, the Python models of our deployments whose stub is gone."""
        alive = stub_processes(self.server.pid)
        return [name for name in ready if name.startswith(tuple(f"{d}_v" for d in self.deployments))
                and name not in alive]

    def mark_stopped(self) -> None:
        """Marks down the deployments a stopped stub belongs to (their requests make no progress, so the
        front ends them and refuses new ones); `settle_marks` lifts the mark once no stub of theirs is
        stopped and none waits to be restored (a stub killed after 3 s is restored first)."""
        prefixes = tuple(f"{d}_v" for d in self.deployments)
        stopped_stubs = {model: pid for model, (pid, _) in stub_processes(self.server.pid).items()
                         if model.startswith(prefixes) and is_stopped(pid)}
        now = time.monotonic()
        self.stopped_since = {pid: self.stopped_since.get(pid, now) for pid in stopped_stubs.values()}
        for model, pid in stopped_stubs.items():
            if now - self.stopped_since[pid] >= STOPPED_KILL_AFTER_S:
                log.error("watchdog: the stub of %s has been stopped for %.0f s; killed, to be restored", model,
                          now - self.stopped_since[pid])
                os.kill(pid, signal.SIGKILL)
        stopped = {self.deployment_of(model) for model in stopped_stubs}
        for deployment in sorted(stopped - self.stopped):
            log.error("watchdog: a stub of %s is stopped; %s is marked down while it stays so", deployment, deployment)
            self.mark_down(deployment)
        for deployment in sorted(self.stopped - stopped):
            log.warning("watchdog: no stub of %s is stopped now", deployment)
        self.stopped = stopped

    def deployment_of(self, model: str) -> str:
        return next(d for d in self.deployments if model.startswith(f"{d}_v"))

    def mark_down(self, name: str, text: str = "") -> None:
        """A deployment's mark, or STUCK_MARK's (the whole server). A mark already there that the
        watchdog did not write is an operator's: left as it is, and never lifted by the watchdog."""
        if self.down_dir:
            self.down_dir.mkdir(parents=True, exist_ok=True)
            try:
                with open(self.down_dir / name, "w" if name in self.marked else "x") as mark:
                    mark.write(text)
            except FileExistsError:
                return
        self.marked.add(name)

    def lift(self, name: str) -> None:
        if name in self.marked:
            self.marked.discard(name)
            if self.down_dir:
                (self.down_dir / name).unlink(missing_ok=True)

    def settle_marks(self) -> None:
        """Keeps a deployment marked down by the watchdog exactly while a stub of it is stopped or a model
        of it waits to be restored. A restore cut short (tritonserver aborting under it, then started again
        by the launcher with every stub new) keeps its mark until the next check finds the model ready.
        (STUCK_MARK is report_stuck's.)"""
        down = self.stopped | {self.deployment_of(model) for model in self.failures} | {STUCK_MARK}
        for name in sorted(self.marked - down):
            self.lift(name)

    def restore(self, model: str) -> None:
        """Replaces `model` (after its backbone, if it is a decode loop: the backbone still holds the
        dead loop's sequences) while its deployment is marked down; the mark stays if that fails."""
        deployment = self.deployment_of(model)
        pipeline = pipeline_name(deployment, generation_of(model, deployment))
        log.error("watchdog: the stub of %s died; %s is marked down while it reloads", model, deployment)
        self.mark_down(deployment)
        models = [f"{pipeline}_backbone", model] if model.endswith("_mtp_verify") else [model]
        for name in models:
            if self.stopping.is_set():
                return
            self.repository.replace(name)  # over gRPC: an HTTP load loses HTTP streams' events
        log.warning("watchdog: %s restored", model)

    def served(self, model: str) -> bool:
        """Whether the loaded ensemble runs this model's generation (after a redeploy's swap, the old
        generation only drains; an assembled generation not yet swapped in changes nothing)."""
        deployment = self.deployment_of(model)
        generation = generation_of(model, deployment)
        return generation is not None and self.repository.serving_pipeline(deployment) == pipeline_name(
            deployment, generation)

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.check_once()

    def check_once(self) -> None:
        """One round: services started again, stopped stubs marked (and killed), dead stubs restored."""
        for service in self.services:
            try:
                service.ensure_running()
            except Exception as error:  # noqa: BLE001 - retried next round
                log.warning("watchdog: restarting a service failed (retried next round): %s", error)
        try:
            self.mark_stopped()
            ready = self.repository.ready_models()
            failed = set(self.failed_models(ready))
            if failed:  # again, just before acting: a redeploy may be unloading models right now
                time.sleep(0.2)
                ready = self.repository.ready_models()
                failed &= set(self.failed_models(ready))
            for model in set(ready) - failed:  # a late load that did finish, or a server started again
                self.failures.pop(model, None)
        except Exception as error:  # noqa: BLE001 - the watchdog must outlive one bad check
            log.warning("watchdog: check failed: %s", error)
            return
        for model in sorted(failed | set(self.failures)):  # the failures are retried
            try:
                if not self.served(model):
                    self.failures.pop(model, None)  # its generation was swapped out: nothing to restore
                    continue
                self.restore(model)
                self.failures.pop(model, None)
            except Exception as error:  # noqa: BLE001 - one model's failure does not stop the others
                self.failures[model] = self.failures.get(model, 0) + 1
                log.warning("watchdog: restoring %s failed (retried next round): %s", model, error)
        if self.stopping.is_set():  # a restore cut short by the stop: its mark stays to the end
            return
        self.settle_marks()
        self.report_stuck()

    def report_stuck(self) -> None:
        """Marks the server not live while a model's restores keep failing; clears its mark after."""
        stuck = sorted(m for m, n in self.failures.items() if n >= STUCK_AFTER)
        if stuck:
            log.error("watchdog: %s cannot be restored (%d tries); restart the server", ", ".join(stuck), STUCK_AFTER)
            self.mark_down(STUCK_MARK, ", ".join(stuck))
        else:
            self.lift(STUCK_MARK)

    def start(self) -> "Watchdog":
        self.thread = threading.Thread(target=self.run, daemon=True, name="watchdog")
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stops watching, and waits for a restore in progress to stop at its next step."""
        self.stopping.set()
        self.thread.join(timeout=65)
