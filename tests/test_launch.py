"""End-to-end: the launcher starts the real tritonserver, serves a Python-backend model, stops."""
import os
import socket
import subprocess
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dualend.ops import hidden_argument
from dualend.ops.host import free_ports
from dualend.ops.launch import ServerStartError, TritonServer
from dualend.ops.repository_api import ADMIN_HEADER

pytestmark = pytest.mark.server

IDENTITY_CONFIG = textwrap.dedent(
    """\
    name: "identity"
    backend: "python"
    max_batch_size: 0
    input [{ name: "INPUT0", data_type: TYPE_INT32, dims: [ -1 ] }]
    output [{ name: "OUTPUT0", data_type: TYPE_INT32, dims: [ -1 ] }]
    instance_group [{ kind: KIND_CPU, count: 1 }]
    """
)

IDENTITY_MODEL = textwrap.dedent(
    """\
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
                )
                for r in requests
            ]
    """
)


@pytest.fixture
def identity_repository(tmp_path):
    model_dir = tmp_path / "repository" / "identity"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(IDENTITY_CONFIG)
    (model_dir / "1" / "model.py").write_text(IDENTITY_MODEL)
    return tmp_path / "repository"


def process_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_is_free(host, port):
    """Nothing listens there any more (SO_REUSEADDR: the client's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def test_serves_identity_model_and_stops_cleanly(identity_repository, tmp_path):
    import tritonclient.http as httpclient

    server = TritonServer(
        identity_repository,
        model_control_mode="explicit",
        load_models=["identity"],
        log_file=tmp_path / "tritonserver.log",
        startup_timeout=60,
    )
    with server:
        assert server.is_ready()
        assert server.http_url.startswith("127.0.0.1:")
        pid, http_port = server.pid, server.http_port

        client = httpclient.InferenceServerClient(url=server.http_url)
        assert client.is_model_ready("identity")
        tokens = np.array([3, 1, 4, 1, 5], dtype=np.int32)  # [T]
        request_input = httpclient.InferInput("INPUT0", list(tokens.shape), "INT32")
        request_input.set_data_from_numpy(tokens)
        result = client.infer("identity", [request_input])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), tokens)
        client.close()

    assert not server.is_ready()
    assert not process_exists(pid)
    assert port_is_free("127.0.0.1", http_port)


def process_tree(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid] + [p for child in children for p in process_tree(int(child))]


def repository_index_status(server: TritonServer, headers: dict[str, str]) -> int:
    request = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", b"{}", headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_admin_key_is_in_no_command_line_environment_or_log(identity_repository, tmp_path, caplog):
    """tritonserver 2.51 takes the admin key only as an argument; the launcher preloads
    dualend/ops/hidden_argument.c, so tritonserver gets it while `ps`, /proc and the logs never show it."""
    key = "k" * 32
    server = TritonServer(identity_repository, model_control_mode="explicit", load_models=["identity"],
                          log_file=tmp_path / "tritonserver.log", startup_timeout=60, admin_key=key)
    with caplog.at_level("INFO", logger="dualend.ops.launch"), server:
        assert repository_index_status(server, {}) == 403
        assert repository_index_status(server, {ADMIN_HEADER: key}) == 200  # the key reached tritonserver
        assert repository_index_status(server, {ADMIN_HEADER: "k" * 31 + "j"}) == 403
        shown = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
        assert "tritonserver" in shown and key not in shown
        tree = process_tree(server.pid)
        assert len(tree) >= 2  # tritonserver and the identity model's stub
        for pid in tree:
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("starting ")]
    assert started and key not in started[0] and hidden_argument.MARKER in started[0]
    assert key not in (tmp_path / "tritonserver.log").read_text()


def test_whether_the_shim_ran_in_a_process_is_read_from_its_starting_environment(tmp_path):
    built = hidden_argument.library(tmp_path)
    if not built:
        pytest.skip("no C compiler (cc, gcc or $CC) to build dualend/ops/hidden_argument.c")
    secret = "s" * 32
    shimmed = subprocess.Popen(["sleep", "10"], env=os.environ | hidden_argument.environment(built, secret))
    plain = subprocess.Popen(["sleep", "10"], env=os.environ | {hidden_argument.VARIABLE: secret})
    try:
        time.sleep(0.3)
        assert hidden_argument.took_effect(shimmed.pid, secret) and not hidden_argument.took_effect(plain.pid, secret)
    finally:
        for process in (shimmed, plain):
            process.kill()
            process.wait()


def test_start_failure_reports_log_tail(identity_repository, tmp_path):
    server = TritonServer(
        identity_repository,
        model_control_mode="explicit",
        load_models=["no_such_model"],
        log_file=tmp_path / "tritonserver.log",
        startup_timeout=60,
    )
    with pytest.raises(ServerStartError, match="no_such_model"):
        server.start()
    assert server.pid is None


@pytest.mark.parametrize("extra, serves", [([], True), (["--allow-metrics=false"], False),
                                           (["--allow-metrics", "False"], False), (["--allow-metrics=0"], False),
                                           (["--allow-metrics=true"], True), (["--log-verbose=1"], True)])
def test_readiness_waits_for_metrics_only_when_tritonserver_serves_them(tmp_path, extra, serves):
    assert TritonServer(tmp_path, extra_args=extra).serves_metrics is serves


def test_behind_the_gateway_tritonserver_listens_on_loopback_but_serves_its_metrics_at_the_public_host(tmp_path):
    """Prometheus (compose, the pod's annotations) scrapes port 8002 of the service's host; the gateway fronts
    only the inference and health ports."""
    from dualend.ops.launch import parse_args, triton_server
    behind = triton_server(parse_args(["--host", "0.0.0.0", "--model-repository", str(tmp_path)]), None)
    command = behind.command(tmp_path)
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=0.0.0.0"} <= set(command)
    alone = triton_server(parse_args(["--host", "0.0.0.0", "--no-gateway", "--model-repository", str(tmp_path)]), None)
    assert {"--http-address=0.0.0.0", "--metrics-address=0.0.0.0"} <= set(alone.command(tmp_path))


def test_a_repository_built_from_other_adapter_sources_is_refused(tmp_path):
    import shutil

    from dualend.ops.launch import ADAPTER_SOURCES, RepositoryMissingError, check_repository

    for model, step in (("dualend_v3_mtp_verify", "mtp_verify"), ("dualend_v3_compressor", "compressor")):
        (tmp_path / model / "1").mkdir(parents=True)
        shutil.copy(ADAPTER_SOURCES / step / "model.py", tmp_path / model / "1" / "model.py")
    assert check_repository(tmp_path) == tmp_path  # this checkout's adapters
    (tmp_path / "dualend_v3_mtp_verify" / "1" / "model.py").write_text("# an older adapter\n")
    with pytest.raises(RepositoryMissingError, match=r"dualend_v3_mtp_verify: model.py differs .* Rebuild it: rm -rf"):
        check_repository(tmp_path)
    with pytest.raises(RepositoryMissingError, match=r"does not exist; build it with `python -m builder.assemble`"):
        check_repository(tmp_path / "missing")


def test_a_repository_whose_ensemble_config_tritonserver_cannot_read_is_refused_before_the_start(tmp_path):
    """The watchdog and the API list the ensembles from their configs: a variant's broken config.pbtxt
    stops the launcher with its path, before tritonserver starts, not with a traceback once it runs."""
    from dualend.ops.launch import RepositoryMissingError, check_repository

    (tmp_path / "dualend_int4").mkdir()
    (tmp_path / "dualend_int4" / "config.pbtxt").write_text('platform: "ensemble"\nensemble_scheduling { step [ {\n')
    with pytest.raises(RepositoryMissingError, match=r"cannot read, .*dualend_int4/config.pbtxt.*mend or remove"):
        check_repository(tmp_path)
    (tmp_path / "dualend_int4" / "config.pbtxt").write_text(
        'platform: "ensemble"\nensemble_scheduling { step [ { model_name: "dualend_int4_v2_preprocessing" '
        'model_version: -1 } ] }\n')
    assert check_repository(tmp_path) == tmp_path


def test_the_watchdog_marks_the_server_not_live_after_repeated_failed_restores_and_clears_it_after(tmp_path):
    from types import SimpleNamespace

    from dualend.ops.watchdog import STUCK_AFTER, STUCK_MARK, Watchdog

    watchdog = Watchdog(SimpleNamespace(grpc_url="127.0.0.1:1", admin_key=None), tmp_path / "down")
    watchdog.failures = {"dualend_v1_compressor": STUCK_AFTER - 1}
    watchdog.report_stuck()
    assert not (tmp_path / "down" / STUCK_MARK).exists()  # not yet: a restore may fail once or twice
    watchdog.failures["dualend_v1_compressor"] += 1
    watchdog.report_stuck()
    assert (tmp_path / "down" / STUCK_MARK).read_text() == "dualend_v1_compressor"
    watchdog.failures.clear()  # restored after all
    watchdog.report_stuck()
    assert not (tmp_path / "down" / STUCK_MARK).exists()
    (tmp_path / "down" / STUCK_MARK).write_text("an operator's")
    watchdog.report_stuck()
    assert (tmp_path / "down" / STUCK_MARK).exists()  # not the watchdog's to lift


def test_a_restore_cut_short_by_a_server_restart_leaves_no_down_mark_once_the_model_is_ready(tmp_path, monkeypatch):
    """The CI failure of 2026-12-05: tritonserver aborted while the watchdog reloaded a dead stub's model,
    the launcher started it again with every stub new, and `dualend` stayed marked down for good."""
    from types import SimpleNamespace

    from dualend.ops import watchdog as watchdog_module

    class Repository:
        ready = ["dualend", "dualend_v1_backbone", "dualend_v1_mtp_verify"]
        up = True

        def ready_models(self):
            if not self.up:
                raise ConnectionError("failed to connect to all addresses")
            return self.ready

        def serving_pipeline(self, deployment):
            return "dualend_v1"

        def replace(self, model):
            self.up = False  # tritonserver aborts under the reload
            raise ConnectionError("socket closed")

    stubs = {}
    monkeypatch.setattr(watchdog_module, "stub_processes", lambda server_pid: stubs)
    monkeypatch.setattr(watchdog_module, "is_stopped", lambda pid: False)
    watchdog = watchdog_module.Watchdog(SimpleNamespace(grpc_url="127.0.0.1:1", admin_key=None, pid=1), tmp_path / "down")
    watchdog.repository = repository = Repository()
    (tmp_path / "down").mkdir()
    (tmp_path / "down" / "baseline").touch()  # an operator's mark: not the watchdog's to lift
    stubs.update({"dualend_v1_backbone": (10, "")})  # the decode loop's stub is gone
    watchdog.check_once()
    assert (tmp_path / "down" / "dualend").exists() and watchdog.failures == {"dualend_v1_mtp_verify": 1}
    watchdog.check_once()  # the server is down: the mark stays
    assert (tmp_path / "down" / "dualend").exists()
    repository.up = True  # started again by the launcher, every stub new
    stubs.update({"dualend_v1_backbone": (20, ""), "dualend_v1_mtp_verify": (21, "")})
    watchdog.check_once()
    assert not (tmp_path / "down" / "dualend").exists() and watchdog.failures == {}
    assert (tmp_path / "down" / "baseline").exists()

    (tmp_path / "down" / "dualend").write_text("an operator's")  # the same restore under an operator's mark
    stubs.pop("dualend_v1_mtp_verify")
    watchdog.repository.replace = lambda model: None  # restored this time
    watchdog.check_once()
    assert watchdog.failures == {} and (tmp_path / "down" / "dualend").read_text() == "an operator's"


def test_the_watchdog_restores_the_variants_a_repository_serves_beside_the_public_deployments(tmp_path):
    from dualend.ops.launch import watched_deployments
    from dualend.serving.repository import PUBLIC_DEPLOYMENTS

    assert watched_deployments(tmp_path) == PUBLIC_DEPLOYMENTS  # one may be loaded later
    (tmp_path / "smollm2_int4").mkdir()  # a variant (builder.assemble --variant smollm2_int4=smollm2)
    (tmp_path / "smollm2_int4" / "config.pbtxt").write_text(
        'name: "smollm2_int4"\nplatform: "ensemble"\n'
        'ensemble_scheduling { step [ { model_name: "smollm2_int4_v1_preprocessing" model_version: -1 } ] }\n')
    assert watched_deployments(tmp_path) == PUBLIC_DEPLOYMENTS + ("smollm2_int4",)


def test_a_negative_restart_budget_is_refused_saying_why(capsys):
    from dualend.ops.launch import parse_args

    assert parse_args(["--server-restarts", "0"]).server_restarts == 0
    with pytest.raises(SystemExit):
        parse_args(["--server-restarts", "-1"])
    assert "--server-restarts: -1: expected 0 or more" in capsys.readouterr().err


def test_the_launcher_serves_where_the_builder_builds_and_keeps_its_files_under_build():
    from builder.assemble import DEFAULTS
    from dualend.ops.gateway import DEFAULT_PREFIX
    from dualend.ops.launch import ADAPTER_SOURCES, DEFAULT_ADMIN_KEY_FILE, DEFAULT_REPOSITORY

    assert DEFAULT_REPOSITORY == DEFAULTS["out"]
    assert ADAPTER_SOURCES == DEFAULTS["out"].parent.parent / "model_repository"
    assert (ADAPTER_SOURCES / "mtp_verify" / "model.py").is_file()
    assert DEFAULT_ADMIN_KEY_FILE.parent == DEFAULT_PREFIX == DEFAULTS["out"].parent / "gateway"


def test_generations_no_ensemble_serves_are_pruned_before_the_source_check(tmp_path):
    """A repository rebuilt over an older one: generation 1 (older adapters) is no longer served, so it
    goes before the check, which then passes on generation 2 (this checkout's adapters)."""
    import shutil

    from dualend.ops.launch import ADAPTER_SOURCES, check_repository, prune_unserved_generations

    for generation, source in ((1, "# an older adapter\n"), (2, None)):
        folder = tmp_path / f"dualend_v{generation}_mtp_verify" / "1"
        folder.mkdir(parents=True)
        if source is None:
            shutil.copy(ADAPTER_SOURCES / "mtp_verify" / "model.py", folder / "model.py")
        else:
            (folder / "model.py").write_text(source)
    (tmp_path / "dualend").mkdir()
    (tmp_path / "dualend" / "config.pbtxt").write_text('ensemble_scheduling { step [ { model_name: "dualend_v2_preprocessing" } ] }')
    assert prune_unserved_generations(tmp_path) == ["dualend_v1"]
    assert not (tmp_path / "dualend_v1_mtp_verify").exists()
    assert check_repository(tmp_path) == tmp_path


def test_a_tritonserver_restarted_by_the_launcher_starts_as_a_start_does_from_the_repository_as_it_is(tmp_path):
    """A crash between `builder.assemble` (generation 2 named by the ensemble) and `client.reload`: the
    restart does not load generation 1 beside it."""
    from dualend.ops.launch import parse_args, restart_server

    for generation in (1, 2):
        (tmp_path / f"dualend_v{generation}_mtp_verify" / "1").mkdir(parents=True)
    (tmp_path / "dualend").mkdir()
    named = 'ensemble_scheduling { step [ { model_name: "dualend_v2_preprocessing" } ] }'
    (tmp_path / "dualend" / "config.pbtxt").write_text(named)
    calls = []

    class Server:
        def stop(self, **options):
            calls.append("stop")

        def start(self):
            calls.append(("start", sorted(p.name for p in tmp_path.iterdir())))

    restart_server(Server(), parse_args(["--model-repository", str(tmp_path), "--no-source-check"]))
    assert calls == ["stop", ("start", ["dualend", "dualend_v2_mtp_verify"])]


def test_loading_a_deployment_loads_its_backbone_which_its_ensemble_does_not_name(tmp_path):
    from dualend.ops.launch import models_to_load

    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.pbtxt").write_text('ensemble_scheduling { step [ { model_name: "smollm2_v3_preprocessing" } ] }')
    assert models_to_load(tmp_path, ["smollm2", "other_model"]) == ["smollm2", "smollm2_v3_backbone", "other_model"]
    assert models_to_load(tmp_path, ["*"]) == ["*"]
    assert models_to_load(tmp_path, ["smollm2", "smollm2_v3_backbone"]) == ["smollm2", "smollm2_v3_backbone"]


def test_a_port_another_server_listens_on_is_refused_before_tritonserver_starts(identity_repository, tmp_path):
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        server = TritonServer(identity_repository, host="127.0.0.1", http_port=port, log_file=tmp_path / "t.log")
        with pytest.raises(ServerStartError, match=f"port in use: http {port} on 127.0.0.1"):
            server.start()
        assert server.pid is None


def test_a_front_whose_restart_timed_out_is_started_again_until_stopped(tmp_path):
    """The watchdog's `ensure_running` retries a start that failed by timeout (it gave up on it for good);
    once stopped by the launcher, nothing starts it."""
    import sys

    from dualend.ops.openai_api.app import ServiceSettings
    from dualend.ops.openai_api.process import ApiService, ServiceStartError

    class Mute(ApiService):  # never answers /health
        starts = 0

        def command(self):
            Mute.starts += 1
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    service = Mute(ServiceSettings("127.0.0.1:1", tmp_path, port=free_ports("127.0.0.1", 1)[0]), "127.0.0.1", None,
                   startup_timeout_s=0.3)
    with pytest.raises(ServiceStartError, match="did not answer"):
        service.start()
    assert service.process is None
    with pytest.raises(ServiceStartError, match="did not answer"):
        service.ensure_running()
    assert Mute.starts == 2
    service.stop()
    service.ensure_running()
    assert Mute.starts == 2
