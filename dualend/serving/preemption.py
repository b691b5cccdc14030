"""How the decode loop gives up the backbone step in flight when the backbone runs in another process
(the deployment's backbone model, called over BLS): a datagram on a Linux abstract Unix socket whose
name comes from the backbone model's name and the pipeline's secret, carrying the step's id and its
HMAC under that secret. The backbone model's listener hands the id to `BackboneRunner.preempt`; a
datagram without the right HMAC is dropped. Abstract names leave nothing on disk; the secret is
never sent."""
from __future__ import annotations

import hashlib
import hmac
import socket
import threading

RETRY_BIND_S = 1.0  # a reloaded backbone waits for the one it replaces to let go of the name


def preempt_address(model_name: str, secret: str) -> bytes:
    digest = hashlib.sha256(f"preempt\0{model_name}\0{secret}".encode()).hexdigest()[:32]
    return b"\0dualend-preempt-" + digest.encode()


def _signature(secret: str, preempt_id: int) -> bytes:
    return hmac.new(secret.encode(), b"preempt\0%d" % preempt_id, hashlib.sha256).hexdigest().encode()


class PreemptSender:
    """The loop's side: asks the backbone model to give up step `preempt_id` (never blocks)."""

    def __init__(self, model_name: str, secret: str):
        self.address, self.secret = preempt_address(model_name, secret), secret
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.setblocking(False)

    def preempt(self, preempt_id: int) -> None:
        try:
            self.socket.sendto(b"%d " % preempt_id + _signature(self.secret, preempt_id), self.address)
        except OSError:
            pass  # nobody listens (yet): the step runs to its end, as it would without preemption

    def close(self) -> None:
        self.socket.close()


class PreemptListener:
    """The backbone model's side: a thread that hands each signed step id to `on_preempt`."""

    def __init__(self, model_name: str, secret: str, on_preempt, on_error=None):
        self.address, self.secret, self.on_preempt = preempt_address(model_name, secret), secret, on_preempt
        self.on_error = on_error  # (message) -> None, told once when the name is taken
        self.bound = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preempt-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
            told = False
            while not self._stopping.is_set():
                try:
                    listener.bind(self.address)
                    break
                except OSError as error:
                    if not told and self.on_error is not None:
                        self.on_error(f"preemption waits for its socket ({error}); steps run to their end meanwhile")
                        told = True
                    self._stopping.wait(RETRY_BIND_S)
            listener.settimeout(0.5)
            self.bound.set()
            while not self._stopping.is_set():
                try:
                    message = listener.recv(256)
                except (TimeoutError, socket.timeout):
                    continue
                except OSError:
                    return
                step, _, signature = message.partition(b" ")
                if step.isdigit() and hmac.compare_digest(signature, _signature(self.secret, int(step))):
                    self.on_preempt(int(step))

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(2.0)
