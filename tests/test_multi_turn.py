"""benchmarks.multi_turn's arithmetic on hand-built records (the run itself needs a server)."""
import pytest

from benchmarks.multi_turn import report, soak_report, summarize


def record(ttft, text="a", cached=0, prompt=10):
    return {"ttft_s": ttft, "text": text, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 3}


def test_the_ratio_is_taken_per_round_and_differing_answers_are_counted():
    rounds = [{"on": [[record(1.0), record(0.2, cached=9)], [record(1.0), record(0.4, cached=9)]],
               "off": [[record(1.0), record(2.0)], [record(1.0), record(2.0, text="b")]]},
              {"on": [[record(1.0), record(0.5, cached=9)], [record(1.0), record(0.5, cached=9)]],
               "off": [[record(1.0), record(1.0)], [record(1.0), {"error": "HTTP 503"}]]}]
    summary = summarize(rounds, ("on", "off"), 2)
    first, second = summary["turns"]
    assert first["ratio"] == (1.0, 1.0, 1.0) and first["answers_differ"] == 0
    assert second["ratio"] == pytest.approx((0.325, 0.15, 0.5))  # median of round 1's 0.3 / 2.0 and round 2's 0.5 / 1.0
    assert second["answers_differ"] == 2  # a different text, and an error against an answer
    assert second["on"]["cached_tokens"] == 9 and summary["errors"] == {"on": [], "off": ["HTTP 503"]}
    settings = {"command": ["python", "-m", "benchmarks.multi_turn"], "started": "now",
                "load_average_at_start": (0.1, 0.1, 0.1), "git_commit": "abc", "git_dirty": False}
    assert "| 2 | 10 | 9 | 0.450 | 2.000 | 0.33 [0.15-0.50] | 2 |" in report(summary, ("on", "off"), settings, True)
    assert report(summary, ("on", "off"), settings, False).startswith("**NOT VALID")


def test_the_soak_report_counts_answers_cancellations_and_failures_by_turn():
    records = [record(0.1) | {"turn": 1}, record(0.3, cached=40) | {"turn": 2}, record(0.5, cached=60) | {"turn": 2},
               {"cancelled": True, "ttft_s": 0.2, "turn": 1}, {"error": "HTTP 503: x", "turn": 3}]
    text = soak_report(records, 300, 16)
    assert "5 requests, 3 answered, 1 cancelled at their first text, 1 failed ([('HTTP 503: x', 1)])" in text
    assert "turn 2: 2 answers, TTFT p50 0.400 s, p99 0.500 s, cached tokens p50 50" in text
    assert "turn 3" not in text


class CannedChat:
    """A local HTTP server answering every POST with one canned SSE stream (or an error status)."""

    def __init__(self, lines: list[str], status: int = 200):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(status)
                self.end_headers()
                self.wfile.write("".join(f"{line}\n\n" for line in lines).encode())

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/chat/completions"


def ask(url, cancel=False):
    import asyncio

    import aiohttp

    from benchmarks.multi_turn import turn_request

    async def one():
        async with aiohttp.ClientSession() as session:
            return await turn_request(session, url, "m", [{"role": "user", "content": "x"}], 8, cancel)
    return asyncio.run(one())


def test_a_turn_reads_text_first_text_time_and_usage_and_a_cancelled_one_stops_at_its_first_text():
    import json

    chunks = [{"choices": [{"delta": {"content": piece}}]} for piece in ("He", "llo")]
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                                      "prompt_tokens_details": {"cached_tokens": 6}}}
    chat = CannedChat([f"data: {json.dumps(c)}" for c in (*chunks, usage)] + ["data: [DONE]"])
    answer = ask(chat.url)
    assert (answer["text"], answer["prompt_tokens"], answer["cached_tokens"], answer["completion_tokens"]) == \
        ("Hello", 9, 6, 2) and answer["ttft_s"] > 0
    cancelled = ask(chat.url, cancel=True)
    assert cancelled["cancelled"] and "text" not in cancelled
    refused = ask(CannedChat(['{"error": {"message": "busy", "code": "server_busy"}}'], status=429).url)
    assert refused["error"].startswith("HTTP 429")
    assert "no text or no usage" in ask(CannedChat(["data: [DONE]"]).url)["error"]
    chat.server.shutdown()
