"""Start a real Triton Inference Server (tritonserver 2.51.0, shipped in the nvidia-pytriton wheel).

The wheel's server tree is copied once into a writable cache (default
`~/.cache/dualend/tritonserver-2.51.0`, or `$DUALEND_TRITON_HOME`) together with the Python backend
stub for the running Python, and started with this virtualenv's packages visible to the stub.

Example:
    python -m dualend.ops.launch                      # build/model_repository, built first if missing
    python -m dualend.ops.launch --load-model dualend     # only this deployment (its backbone included)

By default clients reach only the gateway (`dualend.ops.gateway`, nginx) on --http-port and
--grpc-port, with the API keys in --api-keys (a new key is written there if the file is missing);
tritonserver listens on 127.0.0.1:18000 (HTTP) and :18001 (gRPC) behind it (--triton-http-port,
--triton-grpc-port), with its repository, shared-memory,
trace and logging APIs closed unless the request carries the admin key (`$DUALEND_ADMIN_KEY`, or a
new one written to build/gateway/admin_key; `client.reload` reads both). `--no-gateway` serves
tritonserver itself on those ports. Metrics stay on --metrics-port. Behind the gateway, the
OpenAI-compatible service (`dualend.ops.openai_api`: /v1/models, /v1/completions,
/v1/chat/completions, same keys) runs on 127.0.0.1:--openai-port, and serves the tokens counted per API
key name (Prometheus) on --usage-metrics-port (8003). Ctrl-C or SIGTERM stops it.
"""
from __future__ import annotations

import argparse
import atexit
import filecmp
import importlib.metadata
import importlib.util
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from dualend.engine.manifest import verify_component
from dualend.serving.control import drain_request
from dualend.serving.keys import PIPELINE_SECRET_ENV, pipeline_key
from dualend.serving.model_config import ModelConfigError
from dualend.serving.repository import (
    PUBLIC_DEPLOYMENTS,
    pipeline_name,
    prune_generations,
    served_benchmark_notices,
    served_deployments,
    served_generation,
)

from . import hidden_argument
from .host import client_host, free_ports, port_taken, write_private_file
from .repository_api import ADMIN_HEADER

PYTRITON_VERSION = "0.7.0"  # the nvidia-pytriton release that ships tritonserver 2.51.0
TRITON_VERSION = "2.51.0"
TRITON_HOME_ENV = "DUALEND_TRITON_HOME"
DEFAULT_TRITON_HOME = Path.home() / ".cache" / "dualend" / f"tritonserver-{TRITON_VERSION}"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002
INTERNAL_HTTP_PORT, INTERNAL_GRPC_PORT = 18000, 18001  # tritonserver's own, on 127.0.0.1 behind the gateway
INTERNAL_OPENAI_PORT = 18080  # the OpenAI-compatible service, on 127.0.0.1 behind the gateway
INTERNAL_FRONT_GRPC_PORT = 18081  # its front of Triton's gRPC InferenceService
SERVER_RESTARTS, SERVER_RESTART_WINDOW_S = 3, 600.0  # a tritonserver that exits is started again, this often
DEFAULT_USAGE_METRICS_PORT = 8003  # its counters of tokens per API key name
MODEL_CONTROL_MODES = ("none", "explicit", "poll")
DEFAULT_MODEL_CONTROL_MODE = "none"
DEFAULT_STARTUP_TIMEOUT_S = 120.0
# tritonserver waits this long for in-flight requests on SIGTERM; stop() waits a little longer,
# then kills the whole process group (server and Python backend stubs).
EXIT_TIMEOUT_S = 10
DEFAULT_STOP_TIMEOUT_S = EXIT_TIMEOUT_S + 5.0
LOG_TAIL_LINES = 40
BUILD_COMMAND = "python -m builder.assemble"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = PROJECT_ROOT / "build" / "model_repository"
ADMIN_KEY_ENV = "DUALEND_ADMIN_KEY"
DEFAULT_ADMIN_KEY_FILE = PROJECT_ROOT / "build" / "gateway" / "admin_key"
RESTRICTED_APIS = "model-repository,shared-memory,trace,logging"  # tritonserver API groups behind the admin key
LOG_CHECK_S = 10.0  # how often the gateway's logs are checked for rotation

log = logging.getLogger(__name__)


def models_to_load(repository: Path, names: Sequence[str]) -> list[str]:
    """The models named, each deployment with its backbone: mtp_verify calls that by BLS, so loading
    the ensemble (which loads the steps it names) leaves it out."""
    models = []
    for name in names:
        generation = served_generation(repository, name) if name != "*" else None
        models += [name] + ([f"{pipeline_name(name, generation)}_backbone"] if generation is not None else [])
    return list(dict.fromkeys(models))


class RepositoryMissingError(RuntimeError):
    """The model repository does not exist and could not be built."""


class ServerStartError(RuntimeError):
    """tritonserver exited or did not become ready; the message carries the tail of its log."""


def pytriton_site_packages() -> Path:
    """The site-packages folder that holds the installed `pytriton` package (not imported)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"nvidia-pytriton is not installed; pip install --no-deps nvidia-pytriton=={PYTRITON_VERSION} "
            "(see requirements-serving.txt)"
        )
    installed = importlib.metadata.version("nvidia-pytriton")
    if installed != PYTRITON_VERSION:
        raise RuntimeError(
            f"nvidia-pytriton {installed} is installed, but {PYTRITON_VERSION} (tritonserver "
            f"{TRITON_VERSION}) is required; pip install --no-deps nvidia-pytriton=={PYTRITON_VERSION}"
        )
    return Path(next(iter(spec.submodule_search_locations))).parent


def prepare_triton_home(home: Path | str | None = None) -> Path:
    """Copy the wheel's server tree into a writable cache once; install the stub for this Python.

    Idempotent and safe for concurrent callers: the tree is copied to a temporary folder and
    renamed into place, and the stub is replaced atomically only when it differs.
    """
    home = Path(home or os.environ.get(TRITON_HOME_ENV) or DEFAULT_TRITON_HOME).expanduser()
    if is_installed_server(home):  # the official container's /opt/tritonserver: use it as it is
        return home
    source = pytriton_site_packages() / "pytriton" / "tritonserver"
    if not (home / "bin" / "tritonserver").is_file():
        home.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=home.parent))
        try:
            shutil.copytree(
                source,
                staging / "tree",
                ignore=shutil.ignore_patterns("__pycache__", "python_backend_stubs"),
            )
            os.replace(staging / "tree", home)
            log.info("prepared tritonserver %s in %s", TRITON_VERSION, home)
        except OSError:
            if not (home / "bin" / "tritonserver").is_file():  # no concurrent caller won either
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub_source = source / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    if not stub_source.is_file():
        raise RuntimeError(f"nvidia-pytriton {PYTRITON_VERSION} has no Python {python_version} stub")
    stub = home / "backends" / "python" / "triton_python_backend_stub"
    if not stub.is_file() or not filecmp.cmp(stub_source, stub, shallow=False):
        fd, staged_stub = tempfile.mkstemp(prefix=f".{stub.name}-", dir=stub.parent)
        os.close(fd)
        shutil.copy2(stub_source, staged_stub)
        os.replace(staged_stub, stub)
        log.info("installed the Python %s backend stub in %s", python_version, stub.parent)
    return home




def is_installed_server(home: Path) -> bool:
    """A complete tritonserver install (binary and Python backend stub) that no wheel provided."""
    return (importlib.util.find_spec("pytriton") is None and (home / "bin" / "tritonserver").is_file()
            and (home / "backends" / "python" / "triton_python_backend_stub").is_file())


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stubs.

    The bundled shared libraries go on LD_LIBRARY_PATH; this virtualenv's bin goes first on PATH,
    so the stub (which embeds libpython) picks up the virtualenv's packages. (The stub's Python
    ignores PYTHONDONTWRITEBYTECODE, so `builder.assemble` compiles each model.py itself.)
    """
    env = dict(os.environ if base is None else base)
    if importlib.util.find_spec("pytriton") is not None:
        libs = pytriton_site_packages() / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in (venv_bin, env.get("PATH", "")) if p)
    return env


ADAPTER_SOURCES = PROJECT_ROOT / "model_repository"


def stale_adapters(model_repository: Path) -> list[str]:
    """The built models whose Triton adapter (`1/model.py`) differs from this checkout's source, e.g.
    a repository assembled before an update: it would serve the old code."""
    stale = []
    for built in sorted(model_repository.glob("*_v*_*/1/model.py")):
        model = built.parent.parent.name
        source = ADAPTER_SOURCES / re.fullmatch(r"\w+?_v\d+_(\w+)", model).group(1) / "model.py"
        if source.exists() and source.read_bytes() != built.read_bytes():
            stale.append(model)
    return stale


def prune_unserved_generations(repository: Path) -> list[str]:
    """Before a start nothing is loaded: the generations no ensemble names (assembled but never swapped
    in, or replaced by a newer one) can go, so neither the source check nor the server reads them."""
    removed = []
    for name in sorted(p.name for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else []:
        served = served_generation(repository, name)
        if served is not None:
            removed += prune_generations(repository, name, {pipeline_name(name, served)})
    return removed


def benchmark_notices(repository: Path) -> list[str]:
    """One line per thing that makes a served deployment's figures a benchmark's only (synthetic
    acceptance, dummy weights), so no one reads them as real; a config the loader will refuse (built
    by another version) says nothing here, its load says why."""
    lines = []
    for name in sorted(p.name for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else []:
        try:
            lines += [f"{name}: {notice}" for notice in served_benchmark_notices(repository, name)]
        except (KeyError, ValueError):
            continue
    return lines


def watched_deployments(repository: Path) -> tuple[str, ...]:
    """The deployments the watchdog restores: every public one (one may be loaded later) and the variants
    the repository serves at start."""
    return tuple(dict.fromkeys(PUBLIC_DEPLOYMENTS + tuple(served_deployments(repository))))


def check_repository(model_repository: Path | str) -> Path:
    """The model repository, refused when missing or when its adapters are not this checkout's."""
    model_repository = Path(model_repository)
    if not model_repository.exists():
        raise RepositoryMissingError(
            f"model repository {model_repository} does not exist; build it with `{BUILD_COMMAND}` from the "
            f"project root (bash scripts/serve.sh builds it and serves)")
    stale = stale_adapters(model_repository)
    if stale:
        raise RepositoryMissingError(
            f"model repository {model_repository} was built from other sources than this checkout "
            f"({', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''}: model.py differs from model_repository/); "
            f"serving it would run the old code. Rebuild it: rm -rf {model_repository} build/export && "
            f"{BUILD_COMMAND} (with the flags you built it with)")
    try:  # the watchdog and the API read every ensemble's config: a broken one is refused before anything starts
        served_deployments(model_repository)
    except ModelConfigError as error:
        raise RepositoryMissingError(f"model repository {model_repository} holds a model config tritonserver "
                                     f"cannot read, {error}; mend or remove that folder") from None
    return model_repository


def _answers(url: str) -> bool:
    """Whether GET `url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(no log: {err})"
    return "\n".join(text.splitlines()[-lines:])


class TritonServer:
    """A tritonserver process: `with TritonServer(repo) as server: ...` starts it and stops it.

    Ports given as 0 or None are picked free at start. `http_url` and `grpc_url` are `host:port`,
    the form that tritonclient.http / tritonclient.grpc, perf_analyzer -u and genai-perf -u take;
    `metrics_url` is the full Prometheus URL.
    """

    def __init__(
        self,
        model_repository: Path | str,
        *,
        host: str = DEFAULT_HOST,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        model_control_mode: str = DEFAULT_MODEL_CONTROL_MODE,
        load_models: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        log_file: Path | str | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT_S,
        triton_home: Path | str | None = None,
        admin_key: str | None = None,
    ):
        if model_control_mode not in MODEL_CONTROL_MODES:
            raise ValueError(
                f"model_control_mode must be one of {MODEL_CONTROL_MODES}, got {model_control_mode!r}"
            )
        if load_models and model_control_mode != "explicit":
            raise ValueError("load_models needs model_control_mode='explicit'")
        self.model_repository = Path(model_repository).resolve()
        self.host = host
        self.http_port = http_port or None
        self.grpc_port = grpc_port or None
        self.metrics_port = metrics_port or None
        self.metrics_host = host if metrics_host is None else metrics_host  # behind the gateway: the public host
        self.model_control_mode = model_control_mode
        self.load_models = list(load_models)
        self.extra_args = list(extra_args)
        self.log_file = Path(log_file) if log_file else None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.triton_home = triton_home
        self.admin_key = admin_key
        # Shared by the models of each pipeline, unknown to clients: internal models refuse calls without it.
        self.pipeline_secret = os.environ.get(PIPELINE_SECRET_ENV) or secrets.token_hex(24)
        # Every stub's shared memory is named with this prefix, so a stop also finds the regions of
        # stubs that were killed (and restored) while the server ran.
        self.shm_prefix = f"dualend_{secrets.token_hex(6)}"
        self._process: subprocess.Popen | None = None
        self._owns_log_file = False
        self._hiding_library: Path | None | bool = None  # False: none could be built

    # endpoints

    @property
    def client_host(self) -> str:
        return client_host(self.host)

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{client_host(self.metrics_host)}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def poll(self) -> int | None:
        """The server's exit code once it has exited by itself, None while it runs (or before start)."""
        return self._process.poll() if self._process is not None else None

    def command(self, home: Path) -> list[str]:
        args = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={home / 'backends'}",
            f"--cache-directory={home / 'caches'}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.metrics_host}",
            f"--metrics-port={self.metrics_port}",
            f"--model-control-mode={self.model_control_mode}",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        args += [f"--load-model={name}" for name in models_to_load(self.model_repository, self.load_models)]
        if self.admin_key:
            key = hidden_argument.MARKER if self._hiding_library else self.admin_key
            restriction = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={key}"
            args += [f"--http-restricted-api={restriction}", f"--grpc-restricted-protocol={restriction}"]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = server_environment() | {PIPELINE_SECRET_ENV: self.pipeline_secret}
        if self.admin_key and self._hiding_library:
            env |= hidden_argument.environment(self._hiding_library, self.admin_key)
        return env

    def printable(self, command: list[str]) -> list[str]:
        """`command` as the log shows it: the admin key replaced (it is in the command itself only where
        no C compiler could build dualend/ops/hidden_argument.c)."""
        if not self.admin_key:
            return command
        return [part.replace(self.admin_key, "<admin key>") for part in command]

    # lifecycle

    def start(self) -> "TritonServer":
        if self._process is not None:
            raise RuntimeError(f"tritonserver already running (pid {self._process.pid})")
        if not self.model_repository.is_dir():
            raise RepositoryMissingError(
                f"model repository {self.model_repository} is not a directory; "
                f"build it with `{BUILD_COMMAND}`"
            )
        home = prepare_triton_home(self.triton_home)
        bound = {"http_port": self.host or "0.0.0.0", "grpc_port": self.host or "0.0.0.0",
                 "metrics_port": self.metrics_host or "0.0.0.0"}
        missing = [n for n in bound if not getattr(self, n)]
        # a port free on the wildcard address is free on each: the choice when the hosts differ
        choose_on = bound["http_port"] if len(set(bound.values())) == 1 else "0.0.0.0"
        for name, port in zip(missing, free_ports(choose_on, len(missing))):
            setattr(self, name, port)
        listening = ("http_port", "grpc_port") + (("metrics_port",) if self.serves_metrics else ())
        taken = [f"{name.split('_')[0]} {port} on {bound[name]}" for name in listening
                 if name not in missing and port_taken(bound[name], port := getattr(self, name))]
        if taken:  # else its health check would find the other server ready, and this one would die unseen
            raise ServerStartError(f"port in use: {', '.join(taken)} (another server running?); stop it or choose "
                                   "other ports")
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_file, self._owns_log_file = Path(name), True
        self.log_file.parent.mkdir(parents=True, exist_ok=True)

        if self.admin_key and self._hiding_library is None:
            self._hiding_library = hidden_argument.library()
            if not self._hiding_library:
                log.warning("%s could not be built here (no C compiler, or it failed; build it with `python -m "
                            "dualend.ops.hidden_argument`): the admin key is on tritonserver's command line, "
                            "where `ps` shows it to every local user", hidden_argument.SOURCE.name)
        command = self.command(home)
        log.info("starting %s", " ".join(self.printable(command)))
        with open(self.log_file, "ab") as log_handle:
            # Own session: a terminal's Ctrl-C reaches only us, and stop() can kill the whole
            # group (server and Python stubs) if the server does not exit by itself.
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        atexit.register(self.stop)
        try:
            self._wait_until_ready()
            if self.admin_key and self._hiding_library and not hidden_argument.took_effect(self._process.pid,
                                                                                            self.admin_key):
                raise ServerStartError(f"{self._hiding_library} was not preloaded into tritonserver, whose admin key "
                                       f"would then be the public marker; not serving so")
        except BaseException:
            self.stop(keep_log=True)
            raise
        log.info(
            "tritonserver ready (pid %d): http %s, grpc %s, metrics %s",
            self._process.pid, self.http_url, self.grpc_url, self.metrics_url,
        )
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerStartError(
                    f"tritonserver exited with code {self._process.returncode} before it was "
                    f"ready; last lines of {self.log_file}:\n{_tail(self.log_file)}"
                )
            if self.is_ready() and (not self.serves_metrics or _answers(self.metrics_url)):
                return  # (tritonserver starts its metrics endpoint after the health endpoints)
            time.sleep(0.1)
        raise ServerStartError(
            f"tritonserver not ready after {self.startup_timeout:.0f} s; last lines of "
            f"{self.log_file}:\n{_tail(self.log_file)}"
        )

    @property
    def serves_metrics(self) -> bool:
        """False when the extra flags turn tritonserver's metrics off (`--allow-metrics=false`, `0`, ...)."""
        flags = " ".join(self.extra_args).replace("=", " ").split()
        values = [flags[i + 1].lower() for i, flag in enumerate(flags[:-1]) if flag == "--allow-metrics"]
        return not values or values[-1] not in ("false", "0", "no", "off")

    def is_ready(self) -> bool:
        """True when GET /v2/health/ready answers 200 (server and every loaded model ready)."""
        if self._process is None or self._process.poll() is not None:
            return False
        return _answers(f"http://{self.http_url}/v2/health/ready")

    def drain(self, timeout_s: float = 5.0) -> int:
        """Ends every running stream at once with a clear error (each deployment's decode loop is told
        to drain, and refuses new requests), so a stop does not wait for them; returns how many loops."""
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient
        from tritonclient.utils import np_to_triton_dtype

        drained = 0
        http = httpclient.InferenceServerClient(self.http_url)
        for model in sorted(d.name for d in self.model_repository.iterdir() if d.name.endswith("_mtp_verify")):
            try:
                if not http.is_model_ready(model):
                    continue
            except Exception:  # noqa: BLE001 - not loaded, or the server is already going
                continue
            checkpoint = verify_component(self.model_repository / model / "1" / "compressor").checkpoint_id
            inputs = []
            for name, array in drain_request(pipeline_key(self.pipeline_secret, checkpoint)).items():
                inputs.append(grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
                inputs[-1].set_data_from_numpy(array)
            done = threading.Event()
            client = grpcclient.InferenceServerClient(self.grpc_url)
            try:
                client.start_stream(callback=lambda result, error: done.set())
                client.async_stream_infer(model, inputs, enable_empty_final_response=True)
                drained += done.wait(timeout_s)
            except Exception as error:  # noqa: BLE001 - draining is best effort; the stop goes on
                log.warning("could not drain %s: %s", model, error)
            finally:
                client.stop_stream()
                client.close()
        http.close()
        return drained

    def stop(self, keep_log: bool = False, drain: bool = True) -> None:
        """Drain the decode loops (unless the caller already did), SIGTERM, wait up to `stop_timeout`,
        then SIGKILL the server's whole process group and remove the stubs' shared memory."""
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        try:
            if process.poll() is None:
                if drain:
                    self.drain()
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "tritonserver (pid %d) still running %.0f s after SIGTERM; killing it",
                        process.pid, self.stop_timeout,
                    )
        finally:
            # The group id is the server's pid (own session); it outlives the server while any
            # stub is left, so this also catches orphaned stubs after a clean exit.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
            for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):  # a killed stub leaves its region
                region.unlink(missing_ok=True)
        log.info("tritonserver (pid %d) stopped with code %s", process.pid, process.returncode)
        if self._owns_log_file and not keep_log:
            self.log_file.unlink(missing_ok=True)
            self.log_file, self._owns_log_file = None, False

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def admin_key(path: Path = DEFAULT_ADMIN_KEY_FILE, create: bool = False) -> str | None:
    """The admin key: $DUALEND_ADMIN_KEY, else the one in `path` (written first when `create`)."""
    if os.environ.get(ADMIN_KEY_ENV):
        return os.environ[ADMIN_KEY_ENV]
    if not path.exists() and create:
        write_private_file(path, secrets.token_hex(24) + "\n")
    return path.read_text().strip() if path.exists() else None




def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: expected 0 or more")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dualend.ops.launch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY,
                        help="built by `python -m builder.assemble` (default %(default)s)")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default %(default)s)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="0 = any free port")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="0 = any free port")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="0 = any free port")
    parser.add_argument(
        "--model-control-mode", choices=MODEL_CONTROL_MODES, default="explicit",
        help="explicit (default): every model is loaded at start (unless --load-model says which), "
             "client.reload can redeploy and the watchdog can restore a failed model",
    )
    parser.add_argument(
        "--load-model", action="append", default=[], metavar="NAME",
        help="model to load at start (explicit mode; repeat for several; default: all)",
    )
    parser.add_argument("--no-watchdog", action="store_true",
                        help="do not restore models whose Python stub died (explicit mode only)")
    parser.add_argument("--no-gateway", action="store_true",
                        help="serve tritonserver itself on --http-port/--grpc-port, no nginx in front")
    parser.add_argument("--triton-http-port", type=int, default=INTERNAL_HTTP_PORT,
                        help="tritonserver's own HTTP port on 127.0.0.1, behind the gateway")
    parser.add_argument("--triton-grpc-port", type=int, default=INTERNAL_GRPC_PORT)
    parser.add_argument("--openai-port", type=int, default=INTERNAL_OPENAI_PORT,
                        help="the OpenAI-compatible service's port on 127.0.0.1, behind the gateway's /v1/")
    parser.add_argument("--front-grpc-port", type=int, default=INTERNAL_FRONT_GRPC_PORT,
                        help="the same service's front of Triton's gRPC routes, on 127.0.0.1 behind the gateway")
    parser.add_argument("--usage-metrics-port", type=int, default=DEFAULT_USAGE_METRICS_PORT,
                        help="tokens per API key name (Prometheus), served by the OpenAI-compatible service")
    parser.add_argument("--no-openai-api", action="store_true",
                        help="no /v1/ routes, and Triton's routes go from the gateway to tritonserver itself "
                             "(each key's cap then counts connections, and usage is not recorded)")
    parser.add_argument("--api-keys", type=Path, default=None,
                        help="gateway API keys, `name key [max_requests=N] [daily_tokens=N]` per line (default build/gateway/api_keys, "
                             "created with one new key when missing)")
    parser.add_argument("--baseline-percent", type=float, default=10.0,
                        help="share of the gateway's `llm` requests sent to the baseline (canary)")
    parser.add_argument("--hang-s", type=float, default=60.0,
                        help="a streamed request that gets no response this long ends with a retryable error (a hung "
                             "step; default: %(default)s, beyond a queue wait and a long prompt's prefill)")
    parser.add_argument("--log-file", type=Path, help="server log (default: a temporary file)")
    parser.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S)
    parser.add_argument("--server-restarts", type=_count, default=SERVER_RESTARTS,
                        help=f"a tritonserver that exits is started again up to this often in "
                             f"{SERVER_RESTART_WINDOW_S / 60:.0f} minutes; once more and the launcher exits, for its "
                             f"supervisor to act (default %(default)s)")
    parser.add_argument(
        "--no-source-check", action="store_true",
        help="serve the repository without checking that its adapters are this checkout's (containers)",
    )
    parser.add_argument(
        "extra_args", nargs="*", metavar="-- TRITON_ARG",
        help="further tritonserver flags after `--`, e.g. -- --log-verbose=1",
    )
    return parser.parse_args(argv)


def prepare_repository(args: argparse.Namespace) -> None:
    """Before tritonserver starts: the generations no ensemble serves removed, the adapters checked against
    this checkout, the benchmark-only deployments named."""
    for pipeline in prune_unserved_generations(Path(args.model_repository)):
        print(f"removed {pipeline}_*: assembled but never swapped in, or replaced", flush=True)
    if not args.no_source_check:
        check_repository(args.model_repository)
    for line in benchmark_notices(Path(args.model_repository)):
        print(line, flush=True)


def restart_server(server: TritonServer, args: argparse.Namespace) -> None:
    """tritonserver started again as a start starts it, from the repository as it is now: after a crash
    between `builder.assemble` and `client.reload` it serves the generation the ensemble names (as a
    restart of the launcher would), checked, and the older one is not loaded beside it."""
    server.stop(keep_log=True, drain=False)
    prepare_repository(args)
    server.start()


def triton_server(args: argparse.Namespace, key: str | None) -> TritonServer:
    """The tritonserver `args` ask for: behind the gateway on loopback ports, but for its metrics, which
    Prometheus scrapes at the public host."""
    behind = not args.no_gateway
    return TritonServer(
        args.model_repository,
        host=DEFAULT_HOST if behind else args.host,
        http_port=args.triton_http_port if behind else args.http_port,
        grpc_port=args.triton_grpc_port if behind else args.grpc_port,
        metrics_port=args.metrics_port,
        metrics_host=args.host,
        model_control_mode=args.model_control_mode,
        load_models=args.load_model or (["*"] if args.model_control_mode == "explicit" else []),
        extra_args=args.extra_args,
        log_file=args.log_file,
        startup_timeout=args.startup_timeout,
        admin_key=key,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from .api_keys import KeysFileError, write_new_keys
    from .gateway import DEFAULT_PREFIX, Gateway, GatewayError, GatewaySettings, hold_state
    from .openai_api.app import ServiceSettings
    from .openai_api.process import ApiService, ServiceStartError
    from .watchdog import Watchdog

    gateway, watching, api = None, None, None
    try:
        behind = not args.no_gateway
        state = hold_state() if behind else None  # held until the end below
        prepare_repository(args)
        server = triton_server(args, admin_key(create=True))
        if behind:
            keys = args.api_keys or DEFAULT_PREFIX / "api_keys"
            if not keys.exists():
                print(f"gateway: new API key for client `default`: {write_new_keys(keys)} (in {keys})")
            gateway = Gateway(GatewaySettings("", "", Path(args.model_repository).resolve(), host=args.host,
                                              http_port=args.http_port, grpc_port=args.grpc_port, keys_file=keys,
                                              baseline_percent=args.baseline_percent))
    except (RepositoryMissingError, ValueError, GatewayError, KeysFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        server.start()
        print(f"tritonserver {TRITON_VERSION} ready (pid {server.pid})")
        if gateway is not None and not args.no_openai_api:
            api = ApiService(ServiceSettings(server.grpc_url, Path(args.model_repository).resolve(), DEFAULT_HOST,
                                             args.openai_port, gateway.settings.keys_file, gateway.prefix,
                                             args.baseline_percent, hang_s=args.hang_s,
                                             usage_db=gateway.prefix / "usage.sqlite",
                                             triton_http=server.http_url, grpc_port=args.front_grpc_port),
                             args.host, args.usage_metrics_port, server.log_file.with_suffix(".openai.log")).start()
            gateway.settings.openai_api, gateway.settings.front_grpc = api.url, api.grpc_url
        if gateway is not None:
            gateway.settings.triton_http, gateway.settings.triton_grpc = server.http_url, server.grpc_url
            gateway.start()
            print(f"  gateway  HTTP {gateway.http_url}, gRPC {gateway.grpc_url} (nginx; keys in "
                  f"{gateway.settings.keys_file}); tritonserver itself on {server.http_url}, {server.grpc_url}")
        else:
            print(f"  HTTP     {server.http_url}")
            print(f"  gRPC     {server.grpc_url}")
        print(f"  metrics  {server.metrics_url}")
        if api is not None:
            print(f"  /v1      OpenAI-compatible, through the gateway (service on {api.url}, log "
                  f"{api.log_file}); tokens per API key: http://{client_host(args.host)}:{args.usage_metrics_port}/metrics")
        print(f"  log      {server.log_file}")
        if args.model_control_mode == "explicit" and not args.no_watchdog:
            watching = Watchdog(server, gateway.prefix / "down" if gateway else None,
                                watched_deployments(Path(args.model_repository)), services=(api,) if api else ()).start()
        print("Ctrl-C or SIGTERM stops it.", flush=True)
        next_rotation = time.monotonic()
        restarts: list[float] = []
        while True:
            while server.poll() is None:
                if gateway is not None and time.monotonic() >= next_rotation:
                    gateway.rotate_logs()
                    next_rotation += LOG_CHECK_S
                if gateway is not None and gateway.follow_keys():  # the front rereads the file by itself
                    print(f"gateway: API keys reread from {gateway.settings.keys_file}", flush=True)
                time.sleep(0.5)
            restarts = [at for at in restarts if time.monotonic() - at < SERVER_RESTART_WINDOW_S]
            print(f"error: tritonserver exited with code {server.poll()}; last lines of "
                  f"{server.log_file}:\n{_tail(server.log_file)}", file=sys.stderr, flush=True)
            if len(restarts) >= args.server_restarts:
                return 1
            # tritonserver 2.51 aborts (boost::interprocess::lock_exception) when a Python stub dies
            # holding a lock it shares with the server: started again, as a supervisor would
            restarts.append(time.monotonic())
            restart_server(server, args)
            print(f"tritonserver started again (pid {server.pid}; {len(restarts)} of {args.server_restarts} restarts "
                  f"in {SERVER_RESTART_WINDOW_S / 60:.0f} minutes)", flush=True)
    except KeyboardInterrupt:
        print("stopping tritonserver", flush=True)
    except RepositoryMissingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (ServerStartError, GatewayError, ServiceStartError, KeysFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not orphan it
            signal.signal(signum, signal.SIG_IGN)
        if watching is not None:
            watching.stop()
        if server.poll() is None and server.pid is not None:
            server.drain()  # every stream ends now, with an error that says why
        if gateway is not None:
            gateway.stop()  # before the server: its idle upstream connections would hold tritonserver
        if api is not None:
            api.stop()
        server.stop(keep_log=True, drain=False)  # drained above, before the gateway went
        if state is not None:
            state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
