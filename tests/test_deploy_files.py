"""The deployable package, checked offline (no Docker or cluster here): Kubernetes manifests
against the API schemas, the compose file, Prometheus and Grafana wiring against the metrics the
models export, and the images' recipes."""
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dualend.ops.api_keys import write_new_keys
from dualend.ops.gateway import NJS_MODULE, Gateway, GatewaySettings, render
from dualend.ops.host import free_ports
from dualend.ops.openai_api.translation import RETRY_AFTER_S
from dualend.serving.metrics import COUNTERS, GAUGES, HISTOGRAMS, POOL_COUNTERS, POOL_GAUGES, REFUSALS

ROOT = Path(__file__).resolve().parent.parent
DOCKER, K8S = ROOT / "docker", ROOT / "k8s"


def exported_metrics() -> set[str]:
    """Every metric name the Triton models register: the decode loop's and the backbone's."""
    return {*COUNTERS, *HISTOGRAMS, *GAUGES, REFUSALS[0], *POOL_GAUGES, *POOL_COUNTERS}


@pytest.mark.parametrize("manifest", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_manifests_are_valid_for_the_api(manifest):
    for document in yaml.safe_load_all(manifest.read_text()):
        kubernetes_validate.validate(document, "1.31", strict=True)


def test_probes_hit_routes_the_gateway_serves_and_the_hpa_metric_exists():
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    config = render(GatewaySettings("127.0.0.1:18000", "127.0.0.1:18001"), Path("/tmp/x"))
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert f"location = {container[probe]['httpGet']['path']} " in config
    hpa = yaml.safe_load((K8S / "hpa.yaml").read_text())
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in exported_metrics()
    service = yaml.safe_load((K8S / "service.yaml").read_text())
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {p["name"] for p in container["ports"]}


def test_compose_wires_the_server_prometheus_and_grafana():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"dualend", "prometheus", "grafana"}
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(services["dualend"]["ports"])
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["dualend:8002"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and "api_keys" not in source:
                assert (DOCKER / source).exists(), source
    assert (DOCKER / services["dualend"]["build"]["dockerfile"].removeprefix("docker/")).exists()


def test_every_dashboard_query_reads_a_metric_the_models_export():
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "dualend.json").read_text())
    exported = exported_metrics()
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"dualend_[a-z_]+", target["expr"]):
                used.add(re.sub(r"_(bucket|sum|count)$", "", name) if name not in exported else name)
    assert used and used <= exported, used - exported
    wanted = {"dualend_ttft_seconds", "dualend_inter_token_seconds", "dualend_queue_seconds",
              "dualend_prefill_seconds", "dualend_tokens_per_step", "dualend_spec_decode_num_accepted_tokens",
              "dualend_kv_blocks_used", "dualend_requests_refused", "dualend_waiting_requests"}
    assert wanted <= used


def test_images_build_on_the_triton_release_of_the_local_binary():
    cpu, gpu = ((DOCKER / name).read_text() for name in ("Dockerfile", "Dockerfile.gpu"))
    for recipe in (cpu, gpu):
        assert "FROM nvcr.io/nvidia/tritonserver:24.10-py3" in recipe and "nginx" in recipe
        assert '"dualend.ops.launch"' in recipe or "dualend-gpu-start" in recipe
    assert "tensorrt==" in gpu and "download.pytorch.org/whl/cpu" in cpu
    assert subprocess.run(["bash", "-n", str(DOCKER / "gpu-start.sh")]).returncode == 0


def test_the_usage_counters_port_is_published_and_scraped():
    """The OpenAI-compatible service's tokens per API key name (launcher --usage-metrics-port 8003)."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert "8003:8003" in compose["services"]["dualend"]["ports"]
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert ["dualend:8003"] in [c["static_configs"][0]["targets"] for c in scrape["scrape_configs"]]
    container = yaml.safe_load((K8S / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "usage-metrics", "containerPort": 8003} in container["ports"]
    for recipe in ("Dockerfile", "Dockerfile.gpu"):
        assert "EXPOSE 8000 8001 8002 8003" in (DOCKER / recipe).read_text()


def test_the_gateway_routes_v1_to_the_openai_service_behind_the_key():
    config = render(GatewaySettings("127.0.0.1:18000", "127.0.0.1:18001", openai_api="127.0.0.1:18080"), Path("/tmp/x"))
    assert "upstream openai_api { server 127.0.0.1:18080;" in config and "location /v1/ {" in config
    assert "location /v1/" not in render(GatewaySettings("127.0.0.1:18000", "127.0.0.1:18001"), Path("/tmp/x"))


@pytest.mark.skipif(not (shutil.which("nginx") or Path("/usr/sbin/nginx").exists()) or not NJS_MODULE.exists(),
                    reason="nginx with its njs module is not installed (scripts/setup.sh)")
def test_the_gateways_retry_later_refusals_carry_retry_after(tmp_path):
    """nginx alone, nothing behind it: a /v1 request whose service does not answer is a 503, the next
    ones over the rate (1/s, burst 1) a 429, on /v1 in OpenAI's shape and on the Triton routes in theirs; each says
    when to retry, as the OpenAI-compatible service's own refusals do, and keeps the deployment header."""
    (tmp_path / "repository" / "dualend").mkdir(parents=True)
    (tmp_path / "repository" / "dualend" / "config.pbtxt").write_text(
        'input [\n  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },\n'
        '  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }\n]\noutput [\n]\n')
    key = write_new_keys(tmp_path / "keys")
    triton_http, triton_grpc, openai_api, http_port, grpc_port = free_ports("127.0.0.1", 5)  # none listens behind
    gateway = Gateway(GatewaySettings(f"127.0.0.1:{triton_http}", f"127.0.0.1:{triton_grpc}", tmp_path / "repository",
                                      http_port=http_port, grpc_port=grpc_port, keys_file=tmp_path / "keys",
                                      rate_per_s=1, burst=1, openai_api=f"127.0.0.1:{openai_api}"),
                      tmp_path / "nginx")

    def refusal(path, body=None):
        request = urllib.request.Request(f"http://{gateway.http_url}{path}", data=body,
                                         headers={"Authorization": f"Bearer {key}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        return refused.value.code, refused.value.headers, json.loads(refused.value.read())

    with gateway:
        unavailable, _, too_many = refusal("/v1/models"), refusal("/v1/models"), refusal("/v1/models")  # burst 1
        triton_too_many = refusal("/v2/models/dualend/generate", b'{"text_input": "x", "max_tokens": 1}')
    status, headers, body = unavailable
    assert (status, headers["Retry-After"], body["error"]["code"]) == (503, str(RETRY_AFTER_S[503]), "retry")
    status, headers, body = too_many
    assert (status, headers["Retry-After"], body["error"]["type"]) == (429, str(RETRY_AFTER_S[429]), "rate_limit_error")
    status, headers, body = triton_too_many
    assert (status, headers["Retry-After"], body["error"].split(":")[0]) == (429, str(RETRY_AFTER_S[429]), "rate limit")
    assert headers["X-Dualend-Deployment"] == "dualend"  # kept beside the location's own header


def test_the_gateway_says_each_bad_keys_edit_once_and_again_after_a_good_one(tmp_path, capsys):
    keys = tmp_path / "keys"
    write_new_keys(keys)
    good = keys.read_text()
    gateway = Gateway(GatewaySettings("127.0.0.1:1", "127.0.0.1:2", keys_file=keys), tmp_path / "prefix")
    for text in ("default short\n", "default  short\n", good, "default short\n"):  # bad, the same bad, good, bad
        keys.write_text(text)
        gateway.keys.changed()
        gateway.keys.changed()  # the same file looked at again says nothing more
    said = [line for line in capsys.readouterr().err.splitlines() if "API keys not reread" in line]
    assert len(said) == 2 and said[0] == said[1]
