"""The gateway in front of tritonserver: nginx (Debian's package), the only listener clients reach.

It bounds request bodies (tritonserver 2.51 crashes on an 8 MB JSON body and has no flag to bound
it), checks the JSON of generate requests against the public inputs (`gateway_request.js`, njs:
tritonserver answers a wrong type with a 500 naming no field), checks per-client API keys and
rate limits, exposes only the public routes of the two ensembles, and splits `llm` requests between
the dual-end and baseline deployments by weight (a canary), naming the deployment that answered in
the `X-Dualend-Deployment` header:

    POST /v2/models/{dualend,baseline,llm}/generate[_stream]   key required; `llm` = canary split
    GET  /v2/models/{dualend,baseline}                          key required (metadata)
    GET  /v2/models/{dualend,baseline}/ready, /v2/health/{live,ready}   open, for health probes
    GET  /dualend/gateway-identity          open: this start's random identity (the launcher's start probe)
    GET  /v1/models, POST /v1/completions, /v1/chat/completions   key required: the OpenAI-compatible
                                                                service (dualend.ops.openai_api)
    gRPC inference.GRPCInferenceService/{ModelStreamInfer,ModelInfer,ModelMetadata,...}   key required

Everything else (repository and model control, internal models over HTTP, statistics, traces)
answers 404. While the launcher's watchdog restores a failed component of a deployment (a file
`<prefix>/down/<deployment>`), that deployment's HTTP routes and readiness answer 503 (gRPC carries
no model name nginx can read). Keys come from a file of `name key [max_requests=N] [daily_tokens=N]` lines
(`dualend.ops.api_keys`); clients send `Authorization: Bearer <key>` (over gRPC, the `authorization`
metadata), matched exactly against the keys' sha256 hashes (njs; no file the gateway writes holds a
key). `max_requests` also caps the requests one key has open at once, one count across every route
(a /v1 or HTTP request, or a gRPC stream, each counts one: nginx cannot see the requests inside a
stream). Changing the canary weight rewrites the config and
reloads nginx gracefully: requests in flight finish on the old workers, none is dropped.

    python -m dualend.ops.gateway weight --baseline-percent 0 --prefix build/gateway
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dualend.serving.model_config import ModelConfigError, read_model_config
from dualend.serving.repository import CANARY_MODEL, CANARY_PAIR, PUBLIC_DEPLOYMENTS, served_deployments

from .api_keys import ApiKey, KeysFile, KeysFileError, OncePerProblem
from .host import client_host
from .openai_api.translation import RETRY_AFTER_S
from .watchdog import STUCK_MARK

DEFAULT_PREFIX = Path(__file__).resolve().parents[2] / "build" / "gateway"
REQUEST_CHECK = Path(__file__).resolve().parent / "gateway_request.js"
NJS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")
GRPC_METHODS = ("ModelStreamInfer", "ModelInfer", "ModelMetadata", "ModelReady", "ServerLive", "ServerReady",
                "ServerMetadata")


LOG_MAX_BYTES = 64 * 2**20  # each nginx log, before the launcher moves it aside (Gateway.rotate_logs)


class GatewayError(RuntimeError):
    pass


IDENTITY_ROUTE = "/dualend/gateway-identity"  # answers the running gateway's identity (not a secret)
IDENTITY_FILE = "identity"  # in the prefix: that identity, for a reload from another process


@dataclass
class GatewaySettings:
    triton_http: str                  # host:port of tritonserver's HTTP endpoint
    triton_grpc: str
    model_repository: Path | None = None  # the public inputs come from its ensembles' configs
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    keys_file: Path | None = None     # `name key` per line; None: no key check
    baseline_percent: float = 10.0    # share of `llm` requests that go to the baseline
    max_body: str = "1m"              # a prompt inside raw_context_limit is a few KB
    # nginx bounds a gRPC stream's whole body, every request sent on it, so long-lived streams need
    # more than one body's worth; but what reaches a Python stub grows its shared memory for good (a
    # 256 MB tensor kept 288 MB pinned), so it is kept to what a stub may be made to hold. Each
    # request's prompt is bounded by preprocessing.
    grpc_max_stream: str = "64m"
    rate_per_s: int = 50              # per client (API key), with a burst of `burst`
    burst: int = 100
    # host:port of the OpenAI-compatible service: /v1, and Triton's generate routes through it (which
    # then caps each key's requests across routes); None: no /v1 routes, generate goes to tritonserver
    openai_api: str | None = None
    front_grpc: str | None = None     # host:port of that service's gRPC front; None: gRPC goes to tritonserver


def first_served_deployment(model_repository: Path) -> str | None:
    """A public deployment the repository serves, else a variant (a repository built with variants
    alone): its ensemble tells the public inputs, and the gateway's /v2/health/ready follows it."""
    public = next((d for d in PUBLIC_DEPLOYMENTS if (model_repository / d / "config.pbtxt").exists()), None)
    if public is not None:
        return public
    try:
        variants = served_deployments(model_repository)
    except ModelConfigError as error:
        raise GatewayError(f"the gateway reads the public inputs from {error}") from None
    return variants[0] if variants else None


def public_inputs(model_repository: Path) -> dict[str, dict]:
    """The public ensembles' inputs: {name: {"type", "many" (a list of values), "required"}}. Every
    deployment's ensemble takes the same request contract, so the first one found tells."""
    deployment = first_served_deployment(model_repository)
    if deployment is None:
        raise GatewayError(f"{model_repository} holds no deployment's ensemble ({', '.join(PUBLIC_DEPLOYMENTS)} "
                           f"or a variant of one)")
    config = model_repository / deployment / "config.pbtxt"
    try:
        inputs = read_model_config(config).get("input", [])
    except ModelConfigError as error:
        raise GatewayError(f"the gateway reads the public inputs from {error}") from None
    if not inputs:
        raise GatewayError(f"{config}: the ensemble declares no input")
    return {i["name"]: {"type": i["data_type"], "many": i.get("dims") == ["-1"], "required": not i.get("optional")}
            for i in inputs}


def render(settings: GatewaySettings, prefix: Path, api_keys: dict[str, ApiKey] | None = None,
           identity: str = "") -> str:
    """nginx's config; `api_keys` those in force (None: no keys, anyone may call); `identity`: what
    IDENTITY_ROUTE answers, so that the launcher knows its own nginx from another server on the port."""
    keys = list((api_keys or {}).values())
    caps = sorted({key.max_requests for key in keys})  # without keys, no one to be fair between: no cap
    cap_maps = "\n".join(  # one zone per cap: a key counts in its own cap's zone only
        f'    map $client $cap_{cap} {{\n        default "";\n'
        # a leading backslash: a key named like a map keyword ("default", the launcher's first key) stays a name
        + "".join(f'        "\\{key.name}" "{key.name}";\n' for key in keys if key.max_requests == cap)
        + f"    }}\n    limit_conn_zone $cap_{cap} zone=cap_{cap}:1m;" for cap in caps)
    # a key's cap: counted per request across every route by the service in front, where there is one;
    # else per connection (a gRPC stream once) by nginx
    cap_limits = " ".join(f"limit_conn cap_{cap} {cap};" for cap in caps)
    http_caps = "" if settings.openai_api else cap_limits
    grpc_caps = "" if settings.front_grpc else cap_limits
    generate_upstream = "openai_api" if settings.openai_api else "triton_http"
    baseline, dualend = CANARY_PAIR[1], CANARY_PAIR[0]
    if settings.baseline_percent <= 0:
        split = f"* {dualend};"
    elif settings.baseline_percent >= 100:
        split = f"* {baseline};"
    else:
        split = f"{settings.baseline_percent:g}% {baseline};\n        * {dualend};"
    check = 'if ($client = "") { return 401 \'{"error":"missing or unknown API key: send Authorization: Bearer <key>"}\'; }' \
        if keys else ""
    grpc_check = ('if ($client = "") { add_header grpc-status 16; add_header grpc-message "missing or unknown API key"; '
                  'return 204; }') if keys else ""
    down_check = (f"if (-f {prefix}/down/$deployment) {{ return 503 '{{\"error\":\"$deployment is restoring a failed "
                  "component; retry in a few seconds\"}'; }")
    models = "|".join(PUBLIC_DEPLOYMENTS)
    followed = (first_served_deployment(settings.model_repository) if settings.model_repository else None) \
        or PUBLIC_DEPLOYMENTS[0]
    openai_error = ('{{"error":{{"message":"{message}","type":"{type}","param":null,"code":"{code}"}}}}')
    v1_check = ("if ($client = \"\") { return 401 '" + openai_error.format(
        message="missing or unknown API key: send Authorization: Bearer <key>", type="authentication_error",
        code="invalid_api_key") + "'; }") if keys else ""
    v1_location = f"""location /v1/ {{
            {v1_check}
            limit_req zone=per_client burst={settings.burst} nodelay;
            proxy_pass http://openai_api;
        }}""" if settings.openai_api else ""
    v1_upstream = f"upstream openai_api {{ server {settings.openai_api}; keepalive 32; }}" if settings.openai_api else ""

    def v1_error(status: int, message: str, type_: str, code: str) -> str:
        """The same refusal in OpenAI's error shape on the /v1 routes."""
        body = openai_error.format(message=message, type=type_, code=code)
        return f"if ($uri ~ ^/v1/) {{ return {status} '{body}'; }}"

    def retry_after(status: int) -> str:
        """Retry-After on a refusal worth retrying, as the OpenAI-compatible service sends it; a location's
        own add_header drops the server's, so the deployment header is repeated."""
        return (f"add_header Retry-After {RETRY_AFTER_S[status]} always; "
                "add_header X-Dualend-Deployment $deployment always;")

    def generate_location(model_pattern: str, deployment: str, triton_uri: str) -> str:
        """A generate route: key, method, down mark, rate, then the JSON check (which passes the
        request on to `triton_uri`)."""
        return f"""location ~ ^/v2/models/{model_pattern}/(generate|generate_stream)$ {{
            {check}
            limit_req zone=per_client burst={settings.burst} nodelay;
            {http_caps}
            set $deployment {deployment};
            if ($request_method != POST) {{
                add_header Allow POST always;
                add_header X-Dualend-Deployment $deployment always;
                return 405 '{{"error":"$request_method is not served here: send generate and generate_stream requests with POST"}}';
            }}
            {down_check}
            set $triton_uri {triton_uri};
            js_content request.check;
        }}"""

    def model_location(suffix: str, keyed: bool) -> str:
        """A model's metadata (behind the key) or readiness (open, for probes): GET or HEAD only."""
        return f"""location ~ ^/v2/models/({models}){suffix}$ {{
            {check if keyed else ""}
            set $deployment $1;
            if ($request_method !~ ^(GET|HEAD)$) {{
                add_header Allow "GET, HEAD" always;
                add_header X-Dualend-Deployment $deployment always;
                return 405 '{{"error":"$request_method is not served here: model metadata and readiness answer GET"}}';
            }}
            {down_check}
            proxy_pass http://triton_http;
        }}"""

    grpc_methods = "|".join(GRPC_METHODS)
    return f"""# written by dualend.ops.gateway; edits are overwritten
load_module {NJS_MODULE};
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format gateway '$remote_addr $client "$request" $status $body_bytes_sent $request_time $deployment';
    access_log {prefix}/access.log gateway;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    default_type application/json;
    map_hash_bucket_size 128;
    client_max_body_size {settings.max_body};
    client_body_buffer_size {settings.max_body};
    client_body_in_single_buffer on;
    js_import request from {prefix}/request_check.js;
    js_set $client request.client;
{cap_maps}
    limit_conn_status 429;
    split_clients "${{request_id}}" $canary {{
        {split}
    }}
    limit_req_zone $client zone=per_client:1m rate={settings.rate_per_s}r/s;
    limit_req_status 429;
    upstream triton_http {{ server {settings.triton_http}; keepalive 32; }}
    upstream triton_grpc {{ server {settings.triton_grpc}; keepalive 32; }}
    {f"upstream front_grpc {{ server {settings.front_grpc}; keepalive 32; }}" if settings.front_grpc else ""}
    {v1_upstream}
    error_page 413 = @too_large;
    error_page 429 = @too_many;
    error_page 502 504 = @unavailable;
    server {{
        listen {settings.host}:{settings.http_port};
        set $deployment "";
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
        proxy_read_timeout 300s;
        add_header X-Dualend-Deployment $deployment always;
        {generate_location(f"({models})", "$1", "$uri")}
        {generate_location(CANARY_MODEL, "$canary", "/v2/models/$canary/$1")}
        location @triton {{ proxy_pass http://{generate_upstream}$triton_uri; }}  # a checked generate request
        {v1_location}
        {model_location("", keyed=True)}
        {model_location("/ready", keyed=False)}
        location = {IDENTITY_ROUTE} {{ return 200 '{identity}'; }}
        location = /v2/health/live {{
            # the watchdog's mark: a failed component cannot be restored without a restart
            if (-f {prefix}/down/{STUCK_MARK}) {{ return 503 '{{"error":"a failed component cannot be restored; restart the server"}}'; }}
            proxy_pass http://triton_http;
        }}
        location = /v2/health/ready {{
            # ready when the first deployment served is, whatever another model's state; never while the
            # server waits to be restarted (every route refuses then: out of the Service before liveness acts)
            if (-f {prefix}/down/{STUCK_MARK}) {{ return 503 '{{"error":"a failed component cannot be restored; restart the server"}}'; }}
            if (-f {prefix}/down/{followed}) {{ return 503 '{{"error":"restoring a failed component"}}'; }}
            proxy_pass http://triton_http/v2/models/{followed}/ready;
        }}
        location @too_large {{
            {v1_error(413, f"request body over {settings.max_body}", "invalid_request_error", "too_large")}
            return 413 '{{"error":"request body over {settings.max_body}; a prompt inside raw_context_limit is far smaller"}}';
        }}
        location @unavailable {{
            {retry_after(503)}
            {v1_error(503, "the service behind the gateway is not answering; retry", "service_unavailable", "retry")}
            return 503 '{{"error":"the inference server behind the gateway is not answering"}}';
        }}
        location @too_many {{
            {retry_after(429)}
            {v1_error(429, f"rate limit: over {settings.rate_per_s} requests/s, or over its cap of open requests "
                           f"(max_requests) across every route, for this API key", "rate_limit_error",
                      "rate_limit_exceeded")}
            return 429 '{{"error":"rate limit: over {settings.rate_per_s} requests/s, or over its cap of open requests (max_requests), for this API key"}}';
        }}
        location / {{ return 404 '{{"error":"not a public route of this service"}}'; }}
    }}
    server {{
        listen {settings.host}:{settings.grpc_port} http2;
        default_type application/grpc;
        set $deployment "";
        client_max_body_size {settings.grpc_max_stream};
        client_body_timeout 300s;  # a stream's next request may come long after its last (nginx: 60 s)
        error_page 413 = @grpc_too_large;
        error_page 429 = @grpc_too_many;
        error_page 502 504 = @grpc_unavailable;
        location ~ ^/inference\\.GRPCInferenceService/({grpc_methods})$ {{
            {grpc_check}
            limit_req zone=per_client burst={settings.burst} nodelay;
            {grpc_caps}
            grpc_read_timeout 300s;
            grpc_pass grpc://{"front_grpc" if settings.front_grpc else "triton_grpc"};
        }}
        location @grpc_too_large {{
            add_header grpc-status 8;
            add_header grpc-message "this gRPC stream sent over {settings.grpc_max_stream}; open a new stream";
            return 204;
        }}
        location @grpc_too_many {{
            add_header grpc-status 8;
            add_header grpc-message "rate limit: over {settings.rate_per_s} requests/s, or over its cap of open streams (max_requests), for this API key (a stream counts once)";
            return 204;
        }}
        location @grpc_unavailable {{
            add_header grpc-status 14;
            add_header grpc-message "the inference server behind the gateway is not answering";
            return 204;
        }}
        location / {{ add_header grpc-status 12; add_header grpc-message "not a public method"; return 204; }}
    }}
}}
"""


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (nginx's workers, for its master)."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            children.add(int(stat.parent.name))
    return children


def _stopping(pid: int) -> bool:
    """Whether an nginx worker is gone or finishing its requests without taking new ones."""
    try:
        return b"shutting down" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return True


def hold_state(prefix: Path = DEFAULT_PREFIX):
    """Locks the gateway's state folder for this process's life (the lock goes with the process, however
    it ends): a second launcher of the same checkout would otherwise wipe the first's down marks and
    rewrite its nginx config. Returns the open lock file; GatewayError names the holder."""
    prefix.mkdir(parents=True, exist_ok=True)
    handle = open(prefix / "launcher.pid", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise GatewayError(f"another launcher (pid {holder}) serves from {prefix}: one launcher a checkout; "
                           f"stop it first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


class Gateway:
    """nginx with the rendered config, run in the foreground as a child process."""

    def __init__(self, settings: GatewaySettings, prefix: Path = DEFAULT_PREFIX):
        self.settings, self.prefix = settings, Path(prefix).resolve()
        self.process: subprocess.Popen | None = None
        def say(message: str) -> None:
            print(f"gateway: {message}", file=sys.stderr, flush=True)
        self.keys = KeysFile(settings.keys_file, say) if settings.keys_file else None  # says each problem once
        self.report = OncePerProblem(say)  # a reload that failed, retried at each look
        self.keys_in_force = self.keys.keys if self.keys else None  # those of the config nginx runs
        identity = self.prefix / IDENTITY_FILE  # a reload keeps the running start's identity
        self.identity = identity.read_text(encoding="utf-8") if identity.exists() else ""

    @property
    def config_path(self) -> Path:
        return self.prefix / "nginx.conf"

    @classmethod
    def running(cls, prefix: Path = DEFAULT_PREFIX) -> "Gateway":
        """The gateway whose config lives in `prefix` (started by the launcher), to change it."""
        raw = json.loads((Path(prefix) / "settings.json").read_text())
        for name in ("keys_file", "model_repository"):
            raw[name] = Path(raw[name]) if raw.get(name) else None
        return cls(GatewaySettings(**raw), prefix)

    @property
    def http_url(self) -> str:
        return f"{client_host(self.settings.host)}:{self.settings.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{client_host(self.settings.host)}:{self.settings.grpc_port}"

    def write_config(self) -> None:
        for folder in ("tmp/body", "tmp/proxy", "tmp/fastcgi", "tmp/uwsgi", "tmp/scgi"):
            (self.prefix / folder).mkdir(parents=True, exist_ok=True)
        if not NJS_MODULE.exists():
            raise GatewayError(f"the gateway needs nginx's njs module ({NJS_MODULE}): run `bash scripts/setup.sh` "
                               "(or `apt-get install -y libnginx-mod-http-js`)")
        if self.settings.model_repository is None:
            raise GatewayError("the gateway needs the model repository whose public inputs it checks")
        inputs = json.dumps(public_inputs(self.settings.model_repository))
        keys = self.keys.keys if self.keys else None
        clients = json.dumps({digest: key.name for digest, key in keys.items()} if keys else None)
        (self.prefix / "request_check.js").write_text(
            f"const INPUTS = {inputs};\nconst CLIENTS = {clients};\n\n{REQUEST_CHECK.read_text('utf-8')}")
        staged = self.config_path.with_suffix(".new")
        staged.write_text(render(self.settings, self.prefix, keys, self.identity))
        check = subprocess.run([nginx_binary(), "-t", "-q", "-p", str(self.prefix), "-c", str(staged)],
                               capture_output=True, text=True)
        if check.returncode:
            raise GatewayError(f"nginx refused the gateway config: {check.stderr.strip()}")
        os.replace(staged, self.config_path)
        raw = dataclasses.asdict(self.settings) | {name: str(getattr(self.settings, name) or "") or None
                                                   for name in ("keys_file", "model_repository")}
        staged = self.prefix / f"settings.json.{os.getpid()}"  # replaced whole: the front may read it at any time
        staged.write_text(json.dumps(raw, indent=1))
        os.replace(staged, self.prefix / "settings.json")

    def start(self) -> "Gateway":
        shutil.rmtree(self.prefix / "down", ignore_errors=True)  # marks left by a run that crashed
        self.identity = secrets.token_hex(8)  # new at each start: an nginx left by a crashed run is not this one
        self.prefix.mkdir(parents=True, exist_ok=True)
        (self.prefix / IDENTITY_FILE).write_text(self.identity, encoding="utf-8")
        self.write_config()
        self.process = subprocess.Popen(
            [nginx_binary(), "-p", str(self.prefix), "-c", str(self.config_path), "-g", "daemon off;"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(self.prefix / "nginx.out", "ab"),
            start_new_session=True)
        deadline, answered = time.monotonic() + 10, False
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise GatewayError(f"nginx exited at start: {(self.prefix / 'nginx.out').read_text()[-2000:]}")
            try:  # another server on the port answers too, until nginx gives up binding it
                with urllib.request.urlopen(f"http://{self.http_url}{IDENTITY_ROUTE}", timeout=1) as answer:
                    if answer.read(64).decode(errors="replace") == self.identity:
                        return self
                answered = True
            except (urllib.error.HTTPError, http.client.HTTPException):
                answered = True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise GatewayError(f"nginx did not listen on {self.http_url} within 10 s"
                           + ("; another server answers there" if answered else ""))

    def set_baseline_percent(self, percent: float, timeout_s: float = 10.0) -> None:
        """New canary weight, applied by a graceful reload."""
        self.settings.baseline_percent = percent
        self.reload(timeout_s)

    def follow_keys(self) -> bool:
        """Once the keys file holds other keys: the config rendered with them and reloaded gracefully, so
        that a key added or revoked counts at once (a change that does not read keeps the keys in force).
        True when it reloaded."""
        if self.keys is None:
            return False
        self.keys.changed()
        if self.keys.keys == self.keys_in_force:
            return False
        try:  # the split as it is now (`weight` may have changed it since the start)
            self.settings.baseline_percent = json.loads((self.prefix / "settings.json").read_text())["baseline_percent"]
            self.reload()
        except (OSError, ValueError, KeyError, GatewayError) as error:  # tried again at the next look
            self.report(f"the API keys' change is not in force yet: {error}")
            return False
        self.keys_in_force = self.keys.keys
        self.report.clear()
        return True

    def reload(self, timeout_s: float = 10.0) -> None:
        """The config written again and nginx reloaded gracefully: no request in flight is dropped.
        Returns once new workers serve it (the old ones stop taking connections as the new ones start)."""
        self.write_config()
        master = int((self.prefix / "nginx.pid").read_text())
        before = _children(master)
        os.kill(master, signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while not (_children(master) - before and all(_stopping(pid) for pid in before)):
            if time.monotonic() > deadline:
                raise GatewayError(f"nginx (pid {master}) did not switch its workers to the new config within "
                                   f"{timeout_s:g} s; see {self.prefix / 'error.log'}")
            time.sleep(0.02)

    def rotate_logs(self, max_bytes: int = LOG_MAX_BYTES) -> list[Path]:
        """Each of nginx's logs past `max_bytes` is copied to NAME.1 (the one there before is dropped)
        and emptied in place: nginx appends to it (O_APPEND) and needs no signal, which its worker could
        not act on where it may not open files under a private prefix (it runs as nobody). The logs
        stay under 2 x max_bytes each; lines written between the copy and the emptying are lost."""
        logs = [self.prefix / name for name in ("error.log", "access.log")]
        rotated = [path for path in logs if path.exists() and path.stat().st_size > max_bytes]
        for path in rotated:
            shutil.copyfile(path, path.with_name(path.name + ".1"))
            os.truncate(path, 0)
        return rotated

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGQUIT)  # graceful: workers finish their requests
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        raise GatewayError("nginx is not installed: run `bash scripts/setup.sh` (or `apt-get install -y nginx`)")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    weight = sub.add_parser("weight", help="change the canary split of a running gateway")
    weight.add_argument("--baseline-percent", type=float, required=True)
    weight.add_argument("--prefix", type=Path, default=DEFAULT_PREFIX)
    args = parser.parse_args(argv)
    try:
        Gateway.running(args.prefix).set_baseline_percent(args.baseline_percent)
    except (OSError, GatewayError, KeysFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"gateway: {args.baseline_percent:g}% of {CANARY_MODEL} requests now go to the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
