"""benchmarks.soak without a server: a /v1 stream read into per-token timings, errors counted by kind,
one pass over scripted clients, and streamed requests against a scripted SSE endpoint on localhost."""
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.compare import StreamedCompletion, error_message
from benchmarks.soak import error_kind, one_pass, stream_openai, streamed_result
from client.api import RequestError, Result
from dualend.ops.host import free_ports


def sse(payload) -> str:
    return "data: " + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n"


def text_chunk(text):
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}


def usage_chunk(tokens):
    return {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}}


def streamed(lines: list[tuple[float, str]], sent_at: float = 10.0) -> StreamedCompletion:
    completion = StreamedCompletion(sent_at)
    for now, line in lines:
        completion.feed(line, now)
    return completion


def test_a_dual_end_streams_pairs_count_two_tokens_each_and_its_gaps_are_halved():
    result = streamed_result(streamed([
        (10.3, sse(text_chunk("ab"))), (10.5, sse(text_chunk("cd"))), (10.9, sse(text_chunk("ef"))),
        (10.9, sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})),
        (11.0, sse(usage_chunk(6))), (11.0, sse("[DONE]"))]))
    assert result.text == "abcdef" and result.output_tokens == 6
    assert result.ttft_s == pytest.approx(0.3)
    assert result.inter_token_s == pytest.approx([0.1, 0.1, 0.2, 0.2])


def test_tokens_that_do_not_divide_evenly_are_spread_in_whole_tokens():
    result = streamed_result(streamed([(11.0, sse(text_chunk("a"))), (12.0, sse(text_chunk("bc"))),
                                       (13.0, sse(text_chunk("de"))), (13.0, sse(usage_chunk(5))),
                                       (13.0, sse("[DONE]"))]))
    assert [tokens for _, tokens in result.arrivals] == [1, 2, 2]
    assert result.ttft_s == 1.0 and len(result.inter_token_s) == 4


def test_without_usage_each_chunk_counts_one_token():
    result = streamed_result(streamed([(11.0, sse(text_chunk("a"))), (11.5, sse(text_chunk("b"))),
                                       (11.5, sse("[DONE]"))]))
    assert result.output_tokens == 2 and result.inter_token_s == [0.5]


@pytest.mark.parametrize("status, body, kind", [
    (429, json.dumps({"error": {"message": "server busy: the queue is full; retry later", "type": "rate_limit_error",
                                "param": None, "code": "server_busy"}}), "HTTP 429 server_busy"),
    (429, '{"error":{"message":"rate limit: over 50 requests/s for this API key","type":"rate_limit_error",'
          '"param":null,"code":"rate_limit_exceeded"}}', "HTTP 429 rate_limit_exceeded"),  # the gateway's, on /v1
    (401, '{"error":"missing or unknown API key"}', "HTTP 401"),  # the gateway's shape on the Triton routes
    (502, "<html><body>Bad Gateway</body></html>", "HTTP 502"),
])
def test_a_refusal_is_counted_by_its_status_and_code(status, body, kind):
    assert error_kind(RequestError(error_message(status, body))) == kind


def test_an_error_event_is_counted_by_its_code_and_a_cut_stream_as_cut():
    with pytest.raises(RequestError) as failed:
        streamed_result(streamed([(11.0, sse(text_chunk("a"))), (11.5, sse({"error": {
            "message": "a component of dualend failed; the request ends here, retry", "code": "retry"}})),
            (11.5, sse("[DONE]"))]))
    assert error_kind(failed.value) == "error event retry"
    with pytest.raises(RequestError) as cut:
        streamed_result(streamed([(11.0, sse(text_chunk("a")))]))
    assert error_kind(cut.value) == "cut"


def test_one_pass_counts_every_request_of_every_client_and_each_keeps_its_deployment():
    calls, lock = [], threading.Lock()

    def send(deployment, prompt, max_tokens, ignore_eos):
        time.sleep(0.005)
        with lock:
            calls.append(deployment)
            number = len(calls)
        if deployment == "baseline" and number % 2:
            raise RequestError("HTTP 429 server_busy: retry later")
        now = time.perf_counter()
        return Result(sent_at=now - 0.02, arrivals=[(now - 0.01, 1), (now, 2)],
                      counters={"num_output_tokens": 3})

    figures = one_pass(send, streams=4, seconds=0.3, seed=1, deployments=["dualend", "baseline"])
    failed = figures["errors"].get("HTTP 429 server_busy", 0)
    assert set(figures["errors"]) <= {"HTTP 429 server_busy"} and failed > 0
    assert figures["requests"] + failed == len(calls)
    assert calls.count("dualend") > 0 and calls.count("baseline") > 0
    assert figures["ttft_p50"] == pytest.approx(0.01, abs=1e-3)
    assert figures["itl_p50"] == pytest.approx(0.005, abs=1e-3)  # 0.01 s for 2 tokens
    assert figures["tokens_per_s"] > 0


class ScriptedV1(BaseHTTPRequestHandler):
    """Answers by model: `ok` streams two chunks 0.2 s apart, `busy` is a 429 in OpenAI's shape."""
    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ScriptedV1.seen.append((self.path, self.headers["Authorization"], body))
        if body["model"] == "busy":
            answer = json.dumps({"error": {"message": "server busy", "type": "rate_limit_error", "param": None,
                                           "code": "server_busy"}}).encode()
            self.send_response(429)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in (text_chunk("ab"), "pause", text_chunk("cd"), usage_chunk(4), "[DONE]"):
            if event == "pause":
                time.sleep(0.2)
                continue
            self.wfile.write((sse(event) + "\n").encode())
            self.wfile.flush()

    def log_message(self, *args):
        pass


@contextmanager
def scripted_v1():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedV1)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_a_streamed_request_is_timed_chunk_by_chunk_and_a_refusal_raises_its_kind():
    ScriptedV1.seen.clear()
    with scripted_v1() as base_url:
        result = stream_openai(base_url, "ok", "Q: 1+1\nA:", 8, api_key="k" * 16, ignore_eos=True)
        chat = stream_openai(base_url, "ok", "hi", 8, chat=True)
        with pytest.raises(RequestError) as refused:
            stream_openai(base_url, "busy", "x", 8)
    assert result.text == "abcd" and result.output_tokens == 4
    assert result.inter_token_s == pytest.approx([0.1, 0.1], abs=0.05)  # the pause, not the whole answer at once
    assert chat.text == "abcd"
    (path, key, body), (chat_path, _, chat_body) = ScriptedV1.seen[:2]
    assert (path, key) == ("/v1/completions", "Bearer " + "k" * 16)
    assert body["prompt"] == "Q: 1+1\nA:" and body["stream"] and body["ignore_eos"] and body["max_tokens"] == 8
    assert body["stream_options"] == {"include_usage": True}
    assert chat_path == "/v1/chat/completions" and chat_body["messages"] == [{"role": "user", "content": "hi"}]
    assert error_kind(refused.value) == "HTTP 429 server_busy"


def test_nobody_listening_is_a_connection_error_not_a_crash():
    port = free_ports("127.0.0.1", 1)[0]
    with pytest.raises(RequestError) as refused:
        stream_openai(f"http://127.0.0.1:{port}/v1", "ok", "x", 8)
    assert error_kind(refused.value) == "ConnectionRefusedError"
