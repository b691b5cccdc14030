"""A small Python API over Triton's own clients: gRPC streaming, HTTP SSE and HTTP /generate.

    from client.api import stream_grpc
    result = stream_grpc("127.0.0.1:8001", "dualend", "Q: 3+4-2\\nA:", max_tokens=32)
    print(result.text, result.ttft_s, result.tpot_s)

Behind the gateway, pass `api_key` or set $DUALEND_API_KEY. Every call returns a `Result` with the text, the per-response timings (TTFT, TPOT counted in
tokens, not responses) and the server's counters; a server-side error raises `RequestError`
with the server's message.
"""
from __future__ import annotations

import http.client
import json
import os
import queue
import re
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from dualend.serving.contract import COUNTERS, REQUEST_INPUT_TYPES, merge_counters
from dualend.serving.outcomes import Outcome, outcome_of

API_KEY_ENV = "DUALEND_API_KEY"
NUMPY_TYPES = {"FP32": np.float32, "INT32": np.int32, "UINT64": np.uint64, "BOOL": np.bool_, "BYTES": np.object_}
PARAM_TYPES = {name: (kind, NUMPY_TYPES[kind]) for name, (kind, dims, _) in REQUEST_INPUT_TYPES.items()
               if dims == (1,) and name not in ("text_input", "max_tokens")}  # the optional scalar parameters


class RequestError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""

    @property
    def outcome(self) -> Outcome | None:
        """The outcome code the message leads with; None for tritonserver's own errors."""
        return outcome_of(str(self))[0]


@dataclass
class Result:
    text: str = ""
    sent_at: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, output tokens in response)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    finish_reason: str = ""
    deployment: str = ""  # the gateway's X-Dualend-Deployment header, over HTTP
    on_text: object = None  # called with each piece of text as it arrives

    def add(self, text: str, counters: dict[str, int], finish_reason: str) -> None:
        self.text += text
        if self.on_text is not None and text:
            self.on_text(text)
        self.arrivals.append((time.perf_counter(), counters.get("num_output_tokens", 0)))
        merge_counters(self.counters, counters)
        self.finish_reason = finish_reason or self.finish_reason

    @property
    def output_tokens(self) -> int:
        return self.counters["num_output_tokens"]

    @property
    def ttft_s(self) -> float:
        first = next((t for t, n in self.arrivals if n > 0), None)
        return float("nan") if first is None else first - self.sent_at

    @property
    def tpot_s(self) -> float:
        with_tokens = [t for t, n in self.arrivals if n > 0]
        if self.output_tokens < 2 or len(with_tokens) < 2:
            return float("nan")
        return (with_tokens[-1] - with_tokens[0]) / (self.output_tokens - 1)

    @property
    def inter_token_s(self) -> list[float]:
        return token_gaps(self.arrivals)

    @property
    def acceptance_rate(self) -> float:
        drafts = self.counters["num_drafts"]
        return self.counters["num_accepted_drafts"] / drafts if drafts else 0.0

    @property
    def tokens_per_step(self) -> float:
        steps = self.counters["num_steps"]
        return self.output_tokens / steps if steps else 0.0

    def summary(self) -> str:
        return (f"TTFT {self.ttft_s * 1e3:.1f} ms | TPOT {self.tpot_s * 1e3:.2f} ms | "
                f"{self.output_tokens} tokens in {self.counters['num_steps']} steps "
                f"({self.tokens_per_step:.2f}/step) | acceptance {self.acceptance_rate:.0%} | "
                f"prompt {self.counters['num_prompt_tokens']} tokens -> {self.counters['num_prompt_latents']} latents"
                f" | finish {self.finish_reason}")


def request_body(prompt: str, max_tokens: int, stream: bool, **params) -> dict:
    body = {"text_input": prompt, "max_tokens": max_tokens, "stream": stream}
    body.update({k: v for k, v in params.items() if v is not None})
    return body


def _grpc_inputs(grpcclient, body: dict):
    inputs = []

    def add(name, array, dtype):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)

    add("text_input", np.array([body["text_input"].encode() if isinstance(body["text_input"], str)
                                else body["text_input"]], dtype=object), "BYTES")
    add("max_tokens", np.array([body["max_tokens"]], dtype=np.int32), "INT32")
    if body.get("stop_words"):
        add("stop_words", np.array([w.encode() for w in body["stop_words"]], dtype=object), "BYTES")
    for name, (triton_type, np_type) in PARAM_TYPES.items():
        if name in body:
            add(name, np.array([body[name]], dtype=np_type), triton_type)
    return inputs


def stream_grpc(url: str, model: str, prompt: str | bytes, max_tokens: int, stream: bool = True,
                timeout_s: float = 120.0, cancel_after_responses: int | None = None, on_text=None,
                api_key: str | None = None, **params) -> Result:
    """One request over a gRPC bidirectional stream; `cancel_after_responses` cancels it early."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    result = Result(on_text=on_text)
    finished = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            headers=auth_headers(api_key) or None)
        result.sent_at = time.perf_counter()
        try:
            client.async_stream_infer(model, _grpc_inputs(grpcclient, request_body(prompt, max_tokens, stream, **params)),
                                      enable_empty_final_response=True)
        except InferenceServerException as error:  # the stream was refused at once; the reason is in the callback
            try:
                error = responses.get(timeout=5)[1] or error
            except queue.Empty:
                pass
            finished = True
            raise RequestError(error.message() if hasattr(error, "message") else str(error)) from None
        while True:
            try:
                response, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise RequestError(f"no response from {model} within {timeout_s:.0f} s; request cancelled") from None
            if error is not None:
                finished = True
                raise RequestError(error.message() if hasattr(error, "message") else str(error))
            final = response.get_response().parameters["triton_final_response"].bool_param
            text = response.as_numpy("text_output")
            if text is not None:
                counters = {name: int(response.as_numpy(name)[0]) for name in COUNTERS}
                reason = response.as_numpy("finish_reason")[0].decode()
                result.add(text[0].decode(), counters, reason)
            if final:
                finished = True
                return result
            if cancel_after_responses is not None and len(result.arrivals) >= cancel_after_responses:
                result.finish_reason = "cancelled"
                return result
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The gateway's key header: `api_key`, else $DUALEND_API_KEY, else none."""
    key = api_key or os.environ.get(API_KEY_ENV)
    return {"authorization": f"Bearer {key}"} if key else {}


def _http_post(url: str, path: str, body: dict, timeout_s: float, api_key: str | None):
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    connection.request("POST", path, body=json.dumps(body),
                       headers={"Content-Type": "application/json"} | auth_headers(api_key))
    return connection, connection.getresponse()


def _error_of(body: bytes, status: int) -> str:
    """The server's message from an error body: plain JSON, or one server-sent event."""
    text = body.decode(errors="replace").strip()
    text = text[5:] if text.startswith("data:") else text
    try:
        return json.loads(text).get("error", f"HTTP {status}")
    except ValueError:
        return f"HTTP {status}: {text[:200]}"


def _add_json(result: Result, payload: dict) -> None:
    if "error" in payload:
        raise RequestError(payload["error"])
    result.add(payload.get("text_output", ""), {n: int(payload.get(n, 0)) for n in COUNTERS},
               payload.get("finish_reason", ""))


def stream_http(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 120.0, on_text=None,
                api_key: str | None = None, **params) -> Result:
    """One request over HTTP /generate_stream (server-sent events)."""
    result = Result(sent_at=time.perf_counter(), on_text=on_text)
    connection, response = _http_post(url, f"/v2/models/{model}/generate_stream",
                                      request_body(prompt, max_tokens, True, **params), timeout_s, api_key)
    result.deployment = response.getheader("X-Dualend-Deployment", "")
    try:
        if response.status != 200:
            raise RequestError(_error_of(response.read(), response.status))
        for line in response:
            line = line.strip()
            if line.startswith(b"data:"):
                _add_json(result, json.loads(line[5:]))
        return result
    finally:
        connection.close()


def generate_http(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 120.0,
                  api_key: str | None = None, **params) -> Result:
    """One request over HTTP /generate: the whole text in one response."""
    result = Result(sent_at=time.perf_counter())
    connection, response = _http_post(url, f"/v2/models/{model}/generate",
                                      request_body(prompt, max_tokens, False, **params), timeout_s, api_key)
    result.deployment = response.getheader("X-Dualend-Deployment", "")
    try:
        body = response.read()
        if response.status != 200:
            raise RequestError(_error_of(body, response.status))
        _add_json(result, json.loads(body))
        return result
    finally:
        connection.close()


def metric_value(metrics_url: str, name: str, model: str, **labels) -> float | None:
    """A Prometheus metric summed over one model's series (all its versions, unless `labels`
    narrows them, e.g. version="2"); None if it has none."""
    return metric_in(metrics_page(metrics_url), name, model, **labels)


def metrics_page(metrics_url: str) -> str:
    return urllib.request.urlopen(metrics_url, timeout=5).read().decode()


def metric_in(text: str, name: str, model: str, **labels) -> float | None:
    """`metric_value` on a page already fetched, so several metrics cost one request."""
    values = []
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        series = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if series.get("model") == model and all(series.get(k) == str(v) for k, v in labels.items()):
            values.append(float(match.group(2)))
    return sum(values) if values else None


def token_gaps(arrivals: list[tuple[float, int]]) -> list[float]:
    """Token-weighted inter-token latencies from (time, tokens) per response: a response carrying
    n tokens after a gap counts n tokens of gap / n each (a dual-end response may carry two);
    responses without tokens are skipped."""
    with_tokens = [(t, n) for t, n in arrivals if n > 0]
    gaps = []
    for (before, _), (after, n) in zip(with_tokens, with_tokens[1:]):
        gaps += [(after - before) / n] * n
    return gaps


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 1], ignoring NaN; NaN when there is nothing."""
    clean = sorted(v for v in values if v == v)
    return clean[min(len(clean) - 1, int(q * len(clean)))] if clean else float("nan")


def median_and_spread(values: list[float]) -> tuple[float, float, float]:
    """Median and the 10th/90th percentiles (nearest rank), ignoring NaN."""
    clean = [v for v in values if v == v]
    median = statistics.median(clean) if clean else float("nan")
    return median, percentile(clean, 0.1), percentile(clean, 0.9)
