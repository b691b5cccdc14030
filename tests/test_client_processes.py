"""What the load tools read about server processes: which they are, CPU time from /proc, and its split by role."""
import os
import subprocess
import sys
import time

import pytest

from benchmarks.bench_served import cpu_by_role
from dualend.ops.processes import cpu_seconds, cpu_snapshot, cpu_used, server_role


def test_cpu_seconds_counts_this_process_work():
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - before == pytest.approx(0.3, abs=0.05)


def test_a_process_that_ended_drops_out_of_the_snapshot():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    snapshot = cpu_snapshot({"me": os.getpid(), "gone": child.pid})
    assert set(snapshot) == {"me"}
    assert cpu_used({"me": 1.0, "gone": 2.0}, {"me": 1.5}) == {"me": 0.5}


def test_cpu_by_role_splits_one_deployments_steps_from_the_rest():
    used = {"tritonserver": 0.4, "dualend_v2_backbone": 0.5, "dualend_v2_mtp_verify": 0.2,
            "dualend_v2_postprocessing": 0.1, "baseline_v1_backbone": 0.05, "nginx": 0.05, "client": 0.3}
    cpu = cpu_by_role("dualend", used, tokens=2000)
    assert cpu["tritonserver"] == pytest.approx(200)
    assert cpu["backbone"] == pytest.approx(250)
    assert cpu["mtp_verify"] == pytest.approx(100)
    assert cpu["postprocessing"] == pytest.approx(50)
    assert cpu["other"] == pytest.approx(50)  # the baseline's backbone and nginx
    assert cpu["client"] == pytest.approx(150)
    assert cpu["preprocessing"] == 0
    assert cpu["total"] == pytest.approx(800)


def test_the_server_processes_are_told_by_their_command_lines():
    from pathlib import Path

    from dualend.ops.openai_api.app import ServiceSettings
    from dualend.ops.openai_api.process import ApiService

    launched = ApiService(ServiceSettings("127.0.0.1:18001", Path("build/model_repository")), "127.0.0.1", None)
    assert server_role([arg.encode() for arg in launched.command()]) == "openai_api"  # as the launcher starts it
    assert server_role([b"/opt/tritonserver/bin/tritonserver", b"--model-repository", b"/r"]) == "tritonserver"
    nginx_master = b"nginx: master process /usr/sbin/nginx -p /srv/gateway -c /srv/gateway/nginx.conf"
    assert server_role([nginx_master, b""]) == "nginx"
    for other in ([b"nginx: worker process", b""], [b"grep", b"dualend.ops.openai_api"],
                  [b"python", b"-m", b"pytest", b"tests/test_openai_api.py"], [b""]):
        assert server_role(other) is None, other
