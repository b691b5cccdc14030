"""The OpenAI-compatible service as a child process of the launcher: started after tritonserver,
restarted by the watchdog if it dies, stopped before the server."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .app import ServiceSettings

log = logging.getLogger(__name__)


class ServiceStartError(RuntimeError):
    pass


class ApiService:
    def __init__(self, settings: ServiceSettings, metrics_host: str, metrics_port: int | None,
                 log_file: Path | None = None, startup_timeout_s: float = 30.0):
        self.settings, self.metrics_host, self.metrics_port = settings, metrics_host, metrics_port
        self.log_file, self.startup_timeout_s = log_file, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.wanted = False  # started and not stopped: the watchdog keeps it running (retrying failed starts)

    @property
    def url(self) -> str:
        return f"{self.settings.host}:{self.settings.port}"

    @property
    def grpc_url(self) -> str | None:
        return f"{self.settings.host}:{self.settings.grpc_port}" if self.settings.grpc_port else None

    def command(self) -> list[str]:
        s = self.settings
        args = [sys.executable, "-m", "dualend.ops.openai_api", "--triton-grpc", s.triton_grpc,
                "--model-repository", str(s.model_repository), "--host", s.host, "--port", str(s.port),
                "--baseline-percent", str(s.baseline_percent), "--stall-s", str(s.stall_s),
                "--hang-s", str(s.hang_s)]
        if s.keys_file:
            args += ["--api-keys", str(s.keys_file)]
        if s.gateway_prefix:
            args += ["--gateway-prefix", str(s.gateway_prefix)]
        if s.usage_db:
            args += ["--usage-db", str(s.usage_db)]
        if s.triton_http:
            args += ["--triton-http", s.triton_http]
        if s.grpc_port:
            args += ["--grpc-port", str(s.grpc_port)]
        if self.metrics_port:
            args += ["--metrics-host", self.metrics_host, "--metrics-port", str(self.metrics_port)]
        return args

    def start(self) -> "ApiService":
        self.wanted = True
        output = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=output,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServiceStartError(f"the OpenAI-compatible service exited with code {self.process.returncode} "
                                        f"at start; see {self.log_file}")
            try:
                urllib.request.urlopen(f"http://{self.url}/health", timeout=1).close()
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self._end_process()
        raise ServiceStartError(f"the OpenAI-compatible service did not answer on {self.url} within "
                                f"{self.startup_timeout_s:g} s")

    def ensure_running(self) -> None:
        """The watchdog's check: a service that died, or whose start failed, is started again."""
        if self.wanted and (self.process is None or self.process.poll() is not None):
            log.error("watchdog: the OpenAI-compatible service is not running (%s); starting it again",
                      "its start failed" if self.process is None else f"exit code {self.process.returncode}")
            self.start()

    def stop(self) -> None:
        self.wanted = False
        self._end_process()

    def _end_process(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
