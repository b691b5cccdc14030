"""The gateway (nginx) in front of a real tritonserver and the service that fronts its routes, as the
launcher runs them, and tritonserver's own closed doors: API keys, public routes only, a bounded body,
rate limits, the canary split, the admin key."""
import secrets
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import malformed_bodies, wait_for

from builder.assemble import DEFAULTS
from builder.assemble import main as assemble_main
from client.api import RequestError, generate_http, stream_grpc, stream_http
from dualend.ops.api_keys import write_new_keys
from dualend.ops.gateway import Gateway, GatewaySettings
from dualend.ops.host import free_ports
from dualend.ops.launch import ADMIN_HEADER, TritonServer
from dualend.ops.openai_api.app import ServiceSettings
from dualend.ops.openai_api.process import ApiService

pytestmark = pytest.mark.server
PROMPT = "Q: 3+4-2\nA:"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    repository = assemble_main(["--checkpoints", str(DEFAULTS["checkpoints"]), "--out", str(root / "repository"),
                                "--export-dir", str(root / "export"), "--raw-context-limit", "512",
                                "--max-new-tokens", "256", "--deployments", "dualend", "baseline"])
    admin = secrets.token_hex(16)
    key = write_new_keys(root / "keys")  # named "default", as the launcher's first key: a keyword of nginx's map
    with TritonServer(repository, admin_key=admin, log_file=root / "server.log") as triton:
        http_port, grpc_port, front_port, front_grpc_port = free_ports("127.0.0.1", 4)  # after the server took its own
        front = ApiService(ServiceSettings(triton.grpc_url, repository, port=front_port, keys_file=root / "keys",
                                           gateway_prefix=root / "nginx", triton_http=triton.http_url,
                                           grpc_port=front_grpc_port), "127.0.0.1", None, root / "front.log").start()
        gateway = Gateway(GatewaySettings(triton.http_url, triton.grpc_url, repository, http_port=http_port, grpc_port=grpc_port,
                                          keys_file=root / "keys", baseline_percent=10, rate_per_s=2000, burst=2000,
                                          openai_api=front.url, front_grpc=front.grpc_url),
                          root / "nginx")
        with gateway:
            gateway.key, gateway.admin, gateway.triton, gateway.root = key, admin, triton, root
            gateway.repository = repository
            try:
                yield gateway
            finally:
                front.stop()


def http(gateway, path, body=None, key=True, headers=None, url=None):
    request = urllib.request.Request(f"http://{url or gateway.http_url}{path}", data=body,
                                     method="POST" if body is not None else "GET", headers=headers or {})
    if key:
        request.add_header("Authorization", f"Bearer {gateway.key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_key_is_required_and_a_wrong_one_refused(stack):
    with pytest.raises(RequestError, match="missing or unknown API key"):
        generate_http(stack.http_url, "dualend", PROMPT, 4, api_key="x" * 32)
    with pytest.raises(RequestError, match="missing or unknown API key"):
        generate_http(stack.http_url, "dualend", PROMPT, 4)
    with pytest.raises(RequestError, match="(?i)unauthenticated|missing or unknown API key"):
        stream_grpc(stack.grpc_url, "dualend", PROMPT, 4)
    assert generate_http(stack.http_url, "dualend", PROMPT, 4, api_key=stack.key).output_tokens > 0
    assert stream_grpc(stack.grpc_url, "baseline", PROMPT, 4, api_key=stack.key).output_tokens > 0


@pytest.mark.parametrize("method, path", [
    ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/dualend/unload"),
    ("POST", "/v2/repository/models/evil/load"), ("POST", "/v2/models/dualend_v1_backbone/infer"),
    ("POST", "/v2/models/dualend_v1_mtp_verify/generate_stream"), ("POST", "/v2/models/dualend_v1_preprocessing/generate"),
    ("GET", "/v2/models/stats"), ("GET", "/v2/models/dualend_v1_backbone/config"), ("POST", "/v2/trace/setting"),
    ("POST", "/v2/logging"), ("GET", "/v2/models/dualend/config"), ("GET", "/metrics"),
])
def test_only_public_routes_are_reachable(stack, method, path):
    status, body = http(stack, path, b"{}" if method == "POST" else None)
    assert status == 404 and "not a public route" in body


def test_health_answers_anyone_and_metadata_needs_a_key(stack):
    assert http(stack, "/v2/health/ready", key=False)[0] == 200
    assert http(stack, "/v2/health/live", key=False)[0] == 200
    assert http(stack, "/v2/models/baseline/ready", key=False)[0] == 200
    status, body = http(stack, "/v2/models/dualend", key=False)
    assert status == 401 and "missing or unknown API key" in body
    status, body = http(stack, "/v2/models/dualend")
    assert status == 200 and '"name":"dualend"' in body


WRONG_JSON = [  # (case, body, what the 400 must say); tritonserver alone answers a 500 naming no field, or wraps
    ("body not JSON", b'{"text_input": "Q: 1+1', "the request body is not valid JSON"),
    ("body empty", b"", "the request body is not valid JSON"),
    ("body a JSON array", b'["Q: 1+1\\nA:", 4]', "the request body must be a JSON object of inputs"),
    ("body a JSON string", b'"Q: 1+1"', "the request body must be a JSON object of inputs"),
    ("text_input a number", {"text_input": 42}, "text_input must be a string, got 42"),
    ("text_input an object", {"text_input": {"a": 1}}, "text_input must be a string"),
    ("text_input null", {"text_input": None}, "text_input must be a string, got null"),
    ("max_tokens a string", {"max_tokens": "8"}, r'max_tokens must be an integer from -2147483648 to 2147483647 \(INT32\), got "8"'),
    ("max_tokens a fraction", {"max_tokens": 8.5}, r"max_tokens must be an integer .* got 8.5"),
    ("max_tokens past INT32", {"max_tokens": 10 ** 12}, r"max_tokens must be an integer .*\(INT32\), got 1000000000000"),
    ("max_tokens a boolean", {"max_tokens": True}, "max_tokens must be an integer .* got true"),
    ("temperature a string", {"temperature": "hot"}, 'temperature must be a number, got "hot"'),
    ("top_p a boolean", {"top_p": True}, "top_p must be a number, got true"),
    ("top_k a fraction", {"top_k": 2.5}, r"top_k must be an integer .*\(INT32\), got 2.5"),
    ("random_seed negative", {"random_seed": -1}, r"random_seed must be an integer from 0 .*\(UINT64\), got -1"),
    ("random_seed a string", {"random_seed": "42"}, r'random_seed must be an integer .* got "42"'),
    ("stop_words a number", {"stop_words": 5}, "stop_words must be a string, got 5"),
    ("stop_words with a number", {"stop_words": ["#", 3]}, "stop_words must be a string, got 3"),
    ("ignore_eos a string", {"ignore_eos": "yes"}, 'ignore_eos must be true or false, got "yes"'),
    ("exclude_input_in_output a number", {"exclude_input_in_output": 1}, "exclude_input_in_output must be true or false, got 1"),
    ("stream a string", {"stream": "true"}, 'stream must be true or false, got "true"'),
    ("acceptance_threshold a list", {"acceptance_threshold": [0.5, 0.9]}, "acceptance_threshold takes one value, got 2"),
    ("max_tokens written as 4.0", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4.0}',
     "max_tokens must be an integer written without a fraction or exponent"),
    ("max_tokens written as 4e0", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4e0}',
     "max_tokens must be an integer written without a fraction or exponent"),
    ("max_tokens twice", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": "x", "max_tokens": 4}',
     "max_tokens appears 2 times in the body; send it once"),
    ("max_tokens twice, once escaped", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "max_token\\u0073": 5}',
     r'field names must be written without escapes, got "max_token\\u0073"'),
    ("an escaped key holding a fraction", b'{"text_input": "Q: 1+1\\nA:", "max_tok\\u0065ns": 4.0}',
     "field names must be written without escapes"),
    ("a key named inside a text", b'{"text_input": "say \\"max_tokens\\": 2", "max_tokens": 4, "max_tokens": 3}',
     "max_tokens appears 2 times in the body"),
    ("random_seed past 2^64 - 1", {"random_seed": 2 ** 64}, r"random_seed must be an integer from 0 to "
     r"18446744073709551615 \(UINT64\), got 18446744073709551616"),
    ("random_seed far past 2^64", {"random_seed": 10 ** 30}, r"random_seed must be an integer from 0 to 18446744073709551615"),
    ("random_seed negative, range named", {"random_seed": -1}, r"from 0 to 18446744073709551615 \(UINT64\), got -1"),
    # numbers njs reads and tritonserver's parser does not (its 500)
    ("max_tokens with a leading zero", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 04}', "04 is not a JSON number"),
    ("temperature .5", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "temperature": .5}', r"\.5 is not a JSON number"),
    ("temperature 1.", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "temperature": 1.}', r"1\. is not a JSON number"),
    ("temperature 1.e3", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "temperature": 1.e3}', "is not a JSON number"),
    ("temperature 1e309", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "temperature": 1e309}', "1e309 is not a JSON number"),
    ("random_seed -00", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "random_seed": -00}', "-00 is not a JSON number"),
    ("field named like a JavaScript builtin", {"constructor": 1}, "unknown field 'constructor'"),
    ("field __proto__", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "__proto__": 1}', "unknown field '__proto__'"),
    ("misspelt field", {"temprature": 0.7}, "unknown field 'temprature'; the inputs are acceptance_threshold, .*, temperature, "),
    ("max_tokens missing", {"max_tokens": ...}, r"missing required field\(s\): max_tokens"),
    # tritonserver's parser answers these with a 500
    ("lone high surrogate", b'{"text_input": "\\ud83d hi", "max_tokens": 4}', r"unpaired UTF-16 surrogate escape \(\\ud83d\)"),
    ("high surrogate at the end", b'{"text_input": "hi \\uD83D", "max_tokens": 4}', r"unpaired UTF-16 surrogate escape \(\\uD83D\)"),
    ("two high surrogates", b'{"text_input": "\\ud83d\\ud83d\\ude00", "max_tokens": 4}', "unpaired UTF-16 surrogate"),
    ("lone low surrogate", b'{"text_input": "a\\udc00", "max_tokens": 4}', r"unpaired UTF-16 surrogate escape \(\\udc00\)"),
    ("lone surrogate in a stop word", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "stop_words": ["\\ud800"]}',
     "unpaired UTF-16 surrogate"),
]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
@pytest.mark.parametrize("case, body, message", WRONG_JSON, ids=[c[0] for c in WRONG_JSON])
def test_a_wrongly_typed_request_is_a_400_that_names_the_field(stack, endpoint, case, body, message):
    import json
    import re

    if isinstance(body, dict):
        good = {"text_input": "Q: 1+2\nA:", "max_tokens": 4}
        body = json.dumps({k: v for k, v in (good | body).items() if v is not ...}).encode()
    status, text = http(stack, f"/v2/models/dualend/{endpoint}", body)
    assert status == 400 and re.search(message, json.loads(text)["error"]), (status, text)


def test_escapes_that_are_characters_pass(stack):
    body = b'{"text_input": "Q: 1+1 \\ud83d\\ude00 \\\\ud83d \\u00e9\\nA:", "max_tokens": 2}'  # a pair, an escaped backslash
    status, text = http(stack, "/v2/models/dualend/generate", body)
    assert status == 200 and '"text_output"' in text, (status, text)


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v2/models/dualend/generate", "POST"), ("PUT", "/v2/models/baseline/generate_stream", "POST"),
    ("DELETE", "/v2/models/llm/generate", "POST"), ("POST", "/v2/models/dualend", "GET"),
    ("PUT", "/v2/models/dualend/ready", "GET"),
])
def test_a_wrong_method_is_a_405_that_says_which_one(stack, method, path, allowed):
    import json

    request = urllib.request.Request(f"http://{stack.http_url}{path}", method=method,
                                     data=b"{}" if method != "GET" else None,
                                     headers={"Authorization": f"Bearer {stack.key}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(refused.value.read().decode())["error"]
    assert refused.value.code == 405 and method in error and allowed in error
    assert allowed in refused.value.headers["Allow"]


def grpc_stream_requests(gateway, bodies, timeout_s=30):
    """Sends the (text_input, max_tokens) requests one after another on one gRPC stream through the
    gateway; returns each one's (error message or None, seconds from its send to its answer), in order."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put(error),
                        headers={"authorization": f"Bearer {gateway.key}"})
    outcome = []
    try:
        for text, max_tokens in bodies:
            inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("max_tokens", [1], "INT32")]
            inputs[0].set_data_from_numpy(np.array([text], dtype=object))
            inputs[1].set_data_from_numpy(np.array([max_tokens], np.int32))
            sent = time.perf_counter()
            client.async_stream_infer("dualend", inputs)
            error = answers.get(timeout=timeout_s)
            outcome.append((None if error is None else str(error), time.perf_counter() - sent))
    finally:
        client.stop_stream()
        client.close()
    return outcome


def test_a_grpc_stream_may_carry_more_than_the_http_body_bound(stack):
    """nginx bounds a gRPC stream's whole body: one stream carrying many requests must not be cut
    at the 1 MB that bounds an HTTP body. Each 300 KB prompt is refused by its own byte bound."""
    big = b"x" * (300 << 10)
    outcome = [error for error, _ in grpc_stream_requests(stack, [(big, 4)] * 6 + [(PROMPT.encode(), 4)])]
    assert all("prompt is 307200 bytes" in error for error in outcome[:6]), outcome[:1]
    assert outcome[6] is None  # the stream is still open after 1.8 MB


def test_a_huge_grpc_request_is_refused_at_once_and_nobody_notices(stack):
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_http, stack.http_url, "dualend", PROMPT, 64, api_key=stack.key,
                              ignore_eos=True, exclude_input_in_output=True)
        (error, seconds), = grpc_stream_requests(stack, [(b"a" * (8 << 20), 4)])
        assert "prompt is 8388608 bytes" in error and seconds < 1.0
        (error, seconds), = grpc_stream_requests(stack, [(b"a" * (100 << 20), 4)])  # never reaches a stub
        assert "this gRPC stream sent over 64m; open a new stream" in error and seconds < 5.0
        assert running.result().output_tokens == 64


def test_a_key_added_or_revoked_counts_without_a_restart_and_a_bad_edit_keeps_the_keys_in_force(stack):
    """What the launcher does every half second (`follow_keys`) puts the keys file's change in force at
    nginx, keeping the canary weight `weight` set since the start; the service in front rereads the file
    by itself, at each request of an open gRPC stream too."""
    import json

    keys_file, before = stack.root / "keys", (stack.root / "keys").read_text()
    added = secrets.token_hex(24)

    def answers(key):  # nginx's generate route, and the front's /v1
        sent = json.dumps({"model": "dualend", "prompt": PROMPT, "max_tokens": 2}).encode()
        status, _ = http(stack, "/v2/models/dualend/generate", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 2}',
                         key=False, headers={"Authorization": f"Bearer {key}"})
        v1, _ = http(stack, "/v1/completions", sent, key=False, headers={"Authorization": f"Bearer {key}"})
        return status, v1

    answered = threading.Event()

    def revoked_mid_stream():  # once the stream was let in and answered its first request
        yield raw_grpc_request("dualend", "before").SerializeToString()
        answered.wait(60)
        keys_file.write_text(before)
        yield raw_grpc_request("dualend", "after").SerializeToString()
    try:
        Gateway.running(stack.root / "nginx").set_baseline_percent(50)  # as `gateway weight` does, apart
        assert answers(added) == (401, 401)
        keys_file.write_text(before + f"second {added}\n")
        assert stack.follow_keys() and answers(added) == (200, 200) and answers(stack.key) == (200, 200)
        assert "50% baseline" in (stack.root / "nginx" / "nginx.conf").read_text()
        keys_file.write_text(f"second {added}\n")  # the first key revoked
        assert stack.follow_keys() and answers(stack.key) == (401, 401) and answers(added) == (200, 200)
        keys_file.write_text(f"second {added} max_requests=lots\n")  # a bad edit: the keys before stay
        assert not stack.follow_keys() and answers(added) == (200, 200)
        keys_file.write_text(f"second {added}\n")
        errors = {a.infer_response.id: a.error_message
                  for a in raw_grpc_stream(stack, revoked_mid_stream(), added, answered)}
        assert errors["before"] == "" and "missing or unknown API key" in errors["after"]
    finally:
        keys_file.write_text(before)
        stack.follow_keys()
        Gateway.running(stack.root / "nginx").set_baseline_percent(10)
    assert answers(stack.key) == (200, 200) and answers(added) == (401, 401)


def raw_grpc_request(model: str, request_id: str, max_tokens: int = 4):
    """A ModelInferRequest of PROMPT, its inputs in raw contents, as a client library lays them out."""
    import numpy as np
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, datatype, raw in (("text_input", "BYTES", len(PROMPT).to_bytes(4, "little") + PROMPT.encode()),
                                ("max_tokens", "INT32", np.int32(max_tokens).tobytes())):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    return request


def raw_grpc_stream(stack, sent, key: str | None = None, answered: threading.Event | None = None) -> list:
    """The ModelStreamInferResponses of one ModelStreamInfer stream that carries `sent` (serialized requests);
    `answered` is set at the first response."""
    import grpc
    from tritonclient.grpc import service_pb2

    with grpc.insecure_channel(stack.grpc_url) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = []
        for raw in call(iter(sent), timeout=60, metadata=[("authorization", f"Bearer {key or stack.key}")]):
            answers.append(service_pb2.ModelStreamInferResponse.FromString(raw))
            if answered is not None:
                answered.set()
        return answers


def test_a_malformed_grpc_request_is_refused_by_name_and_its_stream_serves_the_next(stack):
    """Bytes that are no ModelInferRequest, and one whose raw contents are not one per input, each get
    their error on the stream; the next request on that stream is answered."""
    mixed = raw_grpc_request("dualend", "mixed")
    del mixed.raw_input_contents[1]
    answers = raw_grpc_stream(stack, [b"\xff\xff\xff", mixed.SerializeToString(),
                                      raw_grpc_request("dualend", "good").SerializeToString()])
    assert [(a.infer_response.id, bool(a.error_message)) for a in answers] == [("", True), ("mixed", True),
                                                                                ("good", False)]
    assert "does not decode" in answers[0].error_message
    assert "raw_input_contents holds 1 entries for 2 inputs" in answers[1].error_message
    assert [o.name for o in answers[2].infer_response.outputs] and answers[2].infer_response.raw_output_contents


def test_the_canary_splits_grpc_streams_too_and_answers_name_the_deployment(stack):
    answers = raw_grpc_stream(stack, [raw_grpc_request("llm", str(i)).SerializeToString() for i in range(8)])
    assert sorted(a.infer_response.id for a in answers) == [str(i) for i in range(8)]
    assert not any(a.error_message for a in answers)
    assert {a.infer_response.model_name for a in answers} <= {"dualend", "baseline"}


def test_stream_true_on_the_generate_route_is_a_400_and_on_generate_stream_it_streams(stack):
    import json

    body = b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "stream": true}'
    for model, sent in (("dualend", body), ("llm", body), ("dualend", body.replace(b"true", b"[true]"))):
        status, text = http(stack, f"/v2/models/{model}/generate", sent)
        assert status == 400 and "streams only on the generate_stream route" in json.loads(text)["error"]
    status, text = http(stack, "/v2/models/dualend/generate_stream", body)
    assert status == 200 and text.startswith("data:")


def test_the_canary_route_checks_requests_too_and_good_ones_pass_every_route(stack):
    status, text = http(stack, "/v2/models/llm/generate", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": "4"}')
    assert status == 400 and "max_tokens must be an integer" in text
    for model in ("dualend", "baseline", "llm"):
        status, text = http(stack, f"/v2/models/{model}/generate", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, '
                             b'"temperature": 0, "top_k": 1, "stop_words": ["#"], "ignore_eos": false, "random_seed": 7}')
        assert status == 200 and "text_output" in text, (model, status, text)
    for seed in (b"18446744073709551615", b"9007199254740993"):  # UINT64's largest; past 2^53, odd
        body = b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 4, "temperature": 0.7, "random_seed": ' + seed + b"}"
        answers = [http(stack, "/v2/models/dualend/generate", body) for _ in range(2)]
        assert answers[0][0] == 200 and answers[0] == answers[1], answers  # the same seed, the same text
    assert stream_http(stack.http_url, "dualend", PROMPT, 8, api_key=stack.key, stop_words=["#"]).output_tokens > 0


@pytest.mark.parametrize("megabytes", [8, 20])
def test_huge_bodies_are_refused_at_once_and_nobody_notices(stack, megabytes):
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_http, stack.http_url, "dualend", PROMPT, 64, api_key=stack.key,
                              ignore_eos=True, exclude_input_in_output=True)
        started = time.perf_counter()
        status, body = http(stack, "/v2/models/dualend/generate", b'{"text_input": "' + b"a" * (megabytes << 20) + b'"}')
        assert status == 413 and "request body over 1m" in body and time.perf_counter() - started < 1.0
        assert running.result().output_tokens == 64
    assert stack.triton.is_ready()


def test_the_canary_sends_its_share_to_the_baseline_and_a_new_weight_drops_nothing(stack):
    def one(_):
        return generate_http(stack.http_url, "llm", PROMPT, 1, api_key=stack.key).deployment

    with ThreadPoolExecutor(8) as pool:
        chosen = list(pool.map(one, range(1000)))
    share = chosen.count("baseline") / len(chosen)
    assert set(chosen) == {"dualend", "baseline"} and 0.06 <= share <= 0.14, share  # 10% +- 4.2 sigma
    try:
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream_http, stack.http_url, "llm", PROMPT, 48, api_key=stack.key,
                                   ignore_eos=True) for _ in range(16)]
            time.sleep(0.2)
            stack.set_baseline_percent(0)
            assert all(s.result().output_tokens == 48 for s in streams)  # none dropped by the reload
            after = list(pool.map(one, range(100)))
        assert set(after) == {"dualend"}
    finally:
        stack.set_baseline_percent(10)  # the split the other tests expect


def test_malformed_bodies_on_the_triton_http_routes_are_4xx_and_the_next_request_is_served(stack):
    """The bodies the /v1 fuzz test sends, with `text_input` for `prompt`, on both generate routes through
    the gateway (tritonserver alone answers some of them with a 500, an empty body among them): none
    gets a 5xx, every unusable one a 4xx, and a valid request right after each one is served."""
    bodies = malformed_bodies(model="", prompt_field="text_input")
    assert len(bodies) >= 200
    for what, body, unusable in bodies:
        for route in ("generate", "generate_stream"):
            status, answer = http(stack, f"/v2/models/baseline/{route}", body)
            assert status < 500 and (400 <= status or not unusable), (what, route, status, answer[:200])
        status, answer = http(stack, "/v2/models/baseline/generate", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 2}')
        assert status == 200 and "text_output" in answer, (what, status, answer[:200])


def test_a_log_past_its_bound_is_copied_aside_and_emptied_and_nginx_writes_on(stack):
    """Each request marked (a query string nginx logs with it): other tests' requests may still be
    logged while this runs."""
    access, marker = stack.prefix / "access.log", secrets.token_hex(4)
    before, after = f"/v2/models/baseline/generate?before={marker}", f"/v2/models/baseline/generate?after={marker}"
    assert http(stack, before, b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 1}')[0] == 200
    # nginx logs a request after its response went out: rotated before that, the line would land after
    assert wait_for(lambda: before in access.read_text(), 5)
    assert access in stack.rotate_logs(max_bytes=1) and before in (stack.prefix / "access.log.1").read_text()
    assert http(stack, after, b'{"text_input": "Q: 2+2\\nA:", "max_tokens": 1}')[0] == 200
    assert wait_for(lambda: after in access.read_text(), 5)  # nginx writes on into the emptied file
    assert before not in access.read_text()
    assert stack.rotate_logs(max_bytes=1 << 30) == []  # under the bound: left alone


def test_a_gateway_whose_port_another_server_holds_refuses_to_start(stack):
    """Before: tritonserver on the gateway's port answered the start probe, so the launcher said the
    gateway served while nginx had exited and clients reached tritonserver without keys."""
    from dualend.ops.gateway import IDENTITY_ROUTE, GatewayError

    assert http(stack, IDENTITY_ROUTE, key=False) == (200, stack.identity)
    assert Gateway.running(stack.prefix).identity == stack.identity  # a reload renders the same one
    held = int(stack.triton.http_url.rsplit(":", 1)[1])
    second = Gateway(GatewaySettings(stack.triton.http_url, stack.triton.grpc_url, stack.repository,
                                     http_port=held, grpc_port=free_ports("127.0.0.1", 1)[0]), stack.root / "second")
    try:
        with pytest.raises(GatewayError, match="(?s)nginx exited at start: .*Address already in use"):
            second.start()
    finally:
        second.stop()
    assert http(stack, "/v2/health/live", key=False)[0] == 200  # the running gateway is untouched


def test_a_client_over_its_rate_is_refused_with_429(stack):
    ports = free_ports("127.0.0.1", 2)
    strict = Gateway(GatewaySettings(stack.triton.http_url, stack.triton.grpc_url, stack.repository,
                                     http_port=ports[0], grpc_port=ports[1], keys_file=stack.root / "keys",
                                     rate_per_s=2, burst=2),
                     stack.root / "strict")
    with strict:
        statuses = [http(stack, "/v2/models/dualend/generate", b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 1}',
                         url=strict.http_url) for _ in range(8)]
        grpc_statuses = []
        for _ in range(8):
            try:
                stream_grpc(strict.grpc_url, "dualend", PROMPT, 1, api_key=stack.key)
                grpc_statuses.append(None)
            except RequestError as error:
                grpc_statuses.append(str(error))
    assert [s for s, _ in statuses].count(429) >= 3 and statuses[0][0] == 200
    assert "rate limit" in next(body for s, body in statuses if s == 429)
    refused = [e for e in grpc_statuses if e is not None]
    assert len(refused) >= 3 and all("rate limit: over 2 requests/s" in e for e in refused), grpc_statuses


def test_keys_match_exactly_and_no_file_of_the_gateway_holds_one(stack):
    body = b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 1}'
    for header in (f"BEARER {stack.key}", f"bearer {stack.key}", f"Bearer {stack.key.upper()}", f"Bearer  {stack.key}",
                   f"Bearer {stack.key}x"):
        assert http(stack, "/v2/models/dualend/generate", body, key=False, headers={"Authorization": header})[0] == 401
    with pytest.raises(RequestError, match="missing or unknown API key"):
        stream_grpc(stack.grpc_url, "dualend", PROMPT, 1, api_key=stack.key.upper())
    assert http(stack, "/v2/models/dualend/generate", body)[0] == 200
    written = [p for p in stack.prefix.rglob("*") if p.is_file()]
    assert written and not [p for p in written if stack.key in p.read_text(errors="replace")]


def test_a_key_over_its_cap_of_open_requests_is_refused_and_another_key_passes(stack, tmp_path):
    """max_requests=1: while one key holds a gRPC stream open, its next request (HTTP, or another gRPC
    stream) is refused with 429 / RESOURCE_EXHAUSTED; another key's passes; once it closes, it passes."""
    import tritonclient.grpc as grpcclient

    other = "c3" * 16
    (tmp_path / "keys").write_text(f"capped {stack.key} max_requests=1\nother {other}\n")
    ports = free_ports("127.0.0.1", 2)
    capped = Gateway(GatewaySettings(stack.triton.http_url, stack.triton.grpc_url, stack.repository,
                                     http_port=ports[0], grpc_port=ports[1], keys_file=tmp_path / "keys"),
                     tmp_path / "nginx")
    body = b'{"text_input": "Q: 1+1\\nA:", "max_tokens": 1}'
    with capped:
        holder = grpcclient.InferenceServerClient(capped.grpc_url)
        holder.start_stream(callback=lambda result, error: None, headers={"authorization": f"Bearer {stack.key}"})
        try:
            time.sleep(0.3)
            status, answer = http(stack, "/v2/models/dualend/generate", body, url=capped.http_url)
            assert status == 429 and "max_requests" in answer
            with pytest.raises(RequestError, match="max_requests"):
                stream_grpc(capped.grpc_url, "dualend", PROMPT, 1, api_key=stack.key)
            assert generate_http(capped.http_url, "dualend", PROMPT, 1, api_key=other).output_tokens == 1
        finally:
            holder.stop_stream()
            holder.close()
        assert http(stack, "/v2/models/dualend/generate", body, url=capped.http_url)[0] == 200


def test_tritonservers_repository_api_needs_the_admin_key(stack):
    direct = stack.triton.http_url
    status, body = http(stack, "/v2/repository/index", b"{}", key=False, url=direct)
    assert status == 403 and ADMIN_HEADER in body
    status, body = http(stack, "/v2/repository/index", b"{}", key=False, url=direct, headers={ADMIN_HEADER: stack.admin})
    assert status == 200 and "dualend_v1_backbone" in body


def test_the_public_inputs_are_read_from_the_served_ensemble_in_any_layout_and_a_broken_one_is_refused(stack, tmp_path):
    from dualend.ops.gateway import GatewayError, public_inputs
    from dualend.serving.contract import REQUEST_INPUTS

    inputs = public_inputs(stack.repository)
    assert inputs["text_input"] == {"type": "TYPE_STRING", "many": False, "required": True}
    assert inputs["stop_words"] == {"type": "TYPE_STRING", "many": True, "required": False}
    assert inputs["random_seed"]["type"] == "TYPE_UINT64" and list(inputs) == list(REQUEST_INPUTS)
    (tmp_path / "dualend").mkdir()
    config = (stack.repository / "dualend" / "config.pbtxt").read_text()
    (tmp_path / "dualend" / "config.pbtxt").write_text(config.replace('dims: [ 1 ] },', 'dims: [1]\n },', 1))
    assert public_inputs(tmp_path) == inputs  # read as tritonserver reads it, not by its line layout
    (tmp_path / "dualend" / "config.pbtxt").write_text(config.replace("input [", "input [ {", 1))
    with pytest.raises(GatewayError, match="the gateway reads the public inputs from .*config.pbtxt"):
        public_inputs(tmp_path)
    variants = tmp_path / "variants"  # built with variants alone (builder.assemble --variant ...)
    (variants / "dualend_int4_v1_backbone").mkdir(parents=True)
    (variants / "dualend_int4_v1_backbone" / "config.pbtxt").write_text('backend: "python"\n')
    with pytest.raises(GatewayError, match="holds no deployment's ensemble"):
        public_inputs(variants)
    (variants / "dualend_int4").mkdir()
    (variants / "dualend_int4" / "config.pbtxt").write_text(config.replace("dualend_v", "dualend_int4_v"))
    assert public_inputs(variants) == inputs


def test_the_gateways_readiness_follows_a_variant_where_the_repository_holds_variants_alone(stack, tmp_path):
    """/v2/health/ready follows `dualend` where it is served, else the first variant (before: `dualend`
    always, so a repository of variants alone was never ready behind the gateway)."""
    from dualend.ops.gateway import GatewaySettings, render

    def followed(repository):
        nginx = render(GatewaySettings("127.0.0.1:1", "127.0.0.1:2", repository), tmp_path / "prefix")
        ready = nginx[nginx.index("location = /v2/health/ready"):]
        proxied = ready[ready.index("proxy_pass"):]
        return proxied[:proxied.index(";")]

    assert followed(stack.repository) == "proxy_pass http://triton_http/v2/models/dualend/ready"
    config = (stack.repository / "dualend" / "config.pbtxt").read_text()
    (tmp_path / "variants" / "smollm2_int4").mkdir(parents=True)
    (tmp_path / "variants" / "smollm2_int4" / "config.pbtxt").write_text(config.replace("dualend_v", "smollm2_int4_v"))
    assert followed(tmp_path / "variants") == "proxy_pass http://triton_http/v2/models/smollm2_int4/ready"
