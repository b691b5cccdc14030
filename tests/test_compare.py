"""benchmarks.compare's pure parts: SSE reading, cell figures, per-round ratios, prompt cutting, and one
cell against a scripted SSE endpoint on localhost (no model server)."""
import asyncio
import json
import math
import statistics
import sys
import types
from pathlib import Path

import pytest

import benchmarks
from benchmarks.compare import (OpenAITarget, OrtGenAITarget, StreamedCompletion, chat_requests, completions_url,
                                cut_prompts, import_peers, parse_in_process, parse_openai, plan_prompts, pool_size, ratios,
                                rotated, settled_load, summarize)
from dualend.engine.tokenizer import TextTokenizer

SMOLLM2 = Path(__file__).resolve().parent.parent / "build" / "checkpoints" / "smollm2"


def sse(payload) -> str:
    return "data: " + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n"


def chunk(text, reason=None):
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": reason}],
            "usage": None}


def feed(completion: StreamedCompletion, lines: list[tuple[float, str]]) -> StreamedCompletion:
    for now, line in lines:
        completion.feed(line, now)
    return completion


def test_a_stream_with_two_token_chunks_takes_its_token_count_from_usage(tiny_tokenizer):
    completion = feed(StreamedCompletion(sent_at=10.0), [
        (10.5, sse(chunk(""))),        # first chunk, no text: not the first token
        (10.5, "\n"),
        (11.0, sse(chunk("ab"))),      # 2 tokens in one chunk (a dual-end step)
        (11.2, sse(chunk("c"))),
        (11.6, sse(chunk("de"))),
        (11.7, sse(chunk("", "length"))),
        (11.8, sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}})),
        (11.9, sse("[DONE]")),
    ])
    record = completion.record(tiny_tokenizer)
    assert record["error"] is None and record["tokens_from"] == "usage"
    assert record["completion_tokens"] == 5 and record["chunks"] == 3
    assert record["ttft_s"] == pytest.approx(1.0)
    assert record["tpot_s"] == pytest.approx((11.6 - 11.0) / 4)
    assert completion.text == "abcde"


def test_without_usage_the_tokens_are_counted_by_re_tokenizing(tiny_tokenizer):
    text = "Q: 3+4-2\nA: 3+4=7"
    record = feed(StreamedCompletion(0.0), [(1.0, sse(chunk(text[:6]))), (2.0, sse(chunk(text[6:]))),
                                            (2.0, sse("[DONE]"))]).record(tiny_tokenizer)
    expected = len(tiny_tokenizer.encode(text))
    assert record["tokens_from"] == "re-tokenized text" and record["completion_tokens"] == expected
    assert record["tpot_s"] == pytest.approx(1.0 / (expected - 1))


def test_chat_deltas_are_read_too(tiny_tokenizer):
    record = feed(StreamedCompletion(0.0), [
        (1.0, sse({"choices": [{"delta": {"role": "assistant", "content": "x"}}]})),
        (2.0, sse({"choices": [{"delta": {"content": "y"}}]})),
        (2.0, sse({"choices": [], "usage": {"completion_tokens": 2}})), (2.0, sse("[DONE]"))]).record(tiny_tokenizer)
    assert (record["ttft_s"], record["tpot_s"], record["completion_tokens"]) == (1.0, 1.0, 2)


def test_an_error_event_is_the_requests_error(tiny_tokenizer):
    record = feed(StreamedCompletion(0.0), [(1.0, sse(chunk("a"))),
                                            (2.0, sse({"error": {"message": "the server is shutting down"}})),
                                            (2.0, sse("[DONE]"))]).record(tiny_tokenizer)
    assert record["error"] == "the server is shutting down"


def test_a_stream_cut_before_done_is_an_error(tiny_tokenizer):
    record = feed(StreamedCompletion(0.0), [(1.0, sse(chunk("a")))]).record(tiny_tokenizer)
    assert "[DONE]" in record["error"]


def test_a_cell_summary_counts_only_requests_that_succeeded():
    records = [{"ttft_s": t, "tpot_s": t / 10, "completion_tokens": 10, "tokens_from": "usage", "error": None}
               for t in (0.1, 0.2, 0.3, 0.4, 1.0)]
    records += [{"completion_tokens": 0, "error": "HTTP 429: busy"}] * 2
    summary = summarize(records, wall_s=2.0)
    assert summary["tokens_per_s"] == 25.0  # 5 x 10 tokens in 2 s
    assert summary["ttft_p50_s"] == 0.3 and summary["ttft_p99_s"] == 1.0
    assert summary["tpot_p50_s"] == pytest.approx(0.03) and summary["tpot_p99_s"] == pytest.approx(0.1)
    assert summary["requests"] == 7 and summary["errors"] == 2
    assert summary["error_messages"] == {"HTTP 429: busy": 2}


def test_p50_of_an_even_count_is_the_median_and_p99_the_nearest_rank():
    records = [{"ttft_s": t, "completion_tokens": 1, "tokens_from": "usage", "error": None} for t in range(1, 101)]
    summary = summarize(records, wall_s=1.0)
    assert summary["ttft_p50_s"] == 50.5 and summary["ttft_p99_s"] == 100
    assert math.isnan(summary["tpot_p50_s"])


def cell(r, target, value, workload="decode-heavy", c=4):
    return {"round": r, "workload": workload, "concurrency": c, "target": target,
            "summary": {"tokens_per_s": value}}


def test_ratios_are_taken_within_each_round_then_summarized():
    reference, other = [100.0, 200.0, 300.0], [150.0, 200.0, 150.0]
    cells = [cell(r, "ref", v) for r, v in enumerate(reference)] + [cell(r, "x", v) for r, v in enumerate(other)]
    median, low, high = ratios(cells, "ref", "tokens_per_s")[("x", "decode-heavy", 4)]
    assert (median, low, high) == (1.0, 0.5, 1.5)  # 1.5, 1.0, 0.5 per round
    assert median != statistics.median(other) / statistics.median(reference)  # not a ratio of medians
    assert ratios(cells, "ref", "tokens_per_s")[("ref", "decode-heavy", 4)] == (1.0, 1.0, 1.0)


def test_a_round_without_a_reference_figure_gives_no_ratio():
    cells = [cell(0, "ref", float("nan")), cell(0, "x", 5.0), cell(1, "ref", 10.0), cell(1, "x", 5.0)]
    assert ratios(cells, "ref", "tokens_per_s")[("x", "decode-heavy", 4)] == (0.5, 0.5, 0.5)


def fake_clock():
    now = [0.0]
    return now, (lambda: now[0]), (lambda seconds: now.__setitem__(0, now[0] + seconds))


def test_a_run_waits_for_the_load_to_settle_and_gives_up_after_its_wait():
    now, clock, sleep = fake_clock()
    readings = iter([1.4, 0.9, 0.45, 0.2])
    assert settled_load(0.5, 300, load=lambda: next(readings), clock=clock, sleep=sleep, poll_s=5) == 0.45
    assert now[0] == 10
    now, clock, sleep = fake_clock()
    assert settled_load(0.5, 60, load=lambda: 2.4, clock=clock, sleep=sleep, poll_s=5) == 2.4
    assert now[0] == 60


def test_the_target_order_rotates_each_round():
    assert [rotated(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                              ["a", "b", "c"]]


def test_every_prompt_is_used_by_one_cell_and_one_client():
    pool = [f"p{i}" for i in range(pool_size([1, 4], requests=2, rounds=2))]
    plan = plan_prompts(pool, [1, 4], requests=2, rounds=2)
    assert set(plan) == {(0, 1), (0, 4), (1, 1), (1, 4)}
    assert all(len(clients) == c and all(len(p) == 3 for p in clients) for (_, c), clients in plan.items())
    used = [p for clients in plan.values() for prompts in clients for p in prompts]
    assert sorted(used) == sorted(pool)


def check_cut(tokenizer: TextTokenizer, texts: list[str], length: int) -> None:
    prompts = cut_prompts(tokenizer, texts, length, count=5)
    assert len(prompts) == 5 and len(set(prompts)) == 5
    for prompt in prompts:
        assert len(tokenizer.encode_prompt(prompt)) == length
        assert any(text.startswith(prompt) for text in texts)


def test_prompts_are_cut_to_exact_token_counts_with_bos(tiny_tokenizer):
    texts = [f"Q: {i}+{i * 7}-3\nA: {i}+{i * 7}={i * 8} {i * 8}-3={i * 8 - 3} #{i * 8 - 3}\n" * 4 for i in range(1, 9)]
    assert tiny_tokenizer.add_bos
    check_cut(tiny_tokenizer, texts, 20)


def test_prompts_are_cut_to_exact_smollm2_token_counts():
    """On SmolLM2's own tokenizer, imported from the installed package into the builder's folder as
    builder.assemble does (reused when there)."""
    from builder.assemble import imported_checkpoint, packaged_source
    from dualend.train.data import stdlib_chunks

    imported_checkpoint(packaged_source("smollm2"), SMOLLM2)
    tokenizer = TextTokenizer.from_json((SMOLLM2 / "tokenizer.json").read_text(),
                                        (SMOLLM2 / "tokenizer_config.json").read_text())
    chunks = stdlib_chunks("report", 800, seed=3)
    check_cut(tokenizer, [next(chunks) for _ in range(8)], 60)


def test_chat_requests_are_held_out_topics_under_the_chat_template_each_once():
    """The chat workload asks about topics the draft head's records never held (the served benchmarks'
    own questions among them), rendered by SmolLM2's template."""
    from builder.assemble import imported_checkpoint, packaged_source
    from dualend.train.open_prompts import TOPICS, open_prompts, topic_split

    imported_checkpoint(packaged_source("smollm2"), SMOLLM2)
    tokenizer = TextTokenizer.from_json((SMOLLM2 / "tokenizer.json").read_text(),
                                        (SMOLLM2 / "tokenizer_config.json").read_text())
    requests = chat_requests(tokenizer, 40, seed=0)
    assert len(set(requests)) == 40 and all(r.endswith("<|im_start|>assistant\n") for r in requests)
    trained = set(open_prompts("train", seed=0))
    assert not any(q in r for r in requests for q in trained)
    held = [t for topics in TOPICS.values() for t in topics if topic_split(t) == "held_out"]
    assert 0.1 < len(held) / sum(map(len, TOPICS.values())) < 0.3
    with pytest.raises(ValueError, match="held-out requests"):
        chat_requests(tokenizer, 10_000, seed=0)


def test_a_text_too_short_for_the_length_is_skipped(tiny_tokenizer):
    with pytest.raises(ValueError, match="only 1 of 2"):
        cut_prompts(tiny_tokenizer, ["ab", "Q: 1+2\nA: 3 " * 10], 10, count=2)


def test_target_specs():
    assert parse_openai("smollm2=http://127.0.0.1:8000/v1@smollm2") == ("smollm2", "http://127.0.0.1:8000/v1",
                                                                        "smollm2")
    assert parse_in_process("engine=build/export/smollm2@synthetic=0.9") == (
        "engine", Path("build/export/smollm2"), {"synthetic": 0.9})
    assert completions_url("http://h:1/v1/") == completions_url("http://h:1") == "http://h:1/v1/completions"


def fake_peers(monkeypatch, peers) -> None:
    """`from benchmarks import peers` gives `peers` (None: the import fails)."""
    monkeypatch.setitem(sys.modules, "benchmarks.peers", peers)
    monkeypatch.delattr(benchmarks, "peers", raising=False)


def test_missing_peers_name_the_install_script(monkeypatch):
    fake_peers(monkeypatch, None)
    with pytest.raises(SystemExit, match="bash scripts/install_peers.sh"):
        import_peers()


def test_ortgenai_runs_each_request_of_every_client_as_one_batch(monkeypatch, tiny_tokenizer):
    calls = []

    class FakeOrtGenAI:
        def generate(self, prompts, max_new_tokens):
            calls.append([tiny_tokenizer.decode(p) for p in prompts])
            return [[0.5 + 0.1 * k for k in range(max_new_tokens)] for _ in prompts]

    fake_peers(monkeypatch, types.SimpleNamespace(OrtGenAI=FakeOrtGenAI))
    records, _ = OrtGenAITarget(tiny_tokenizer).run_cell([["w0", "a0", "b0"], ["w1", "a1", "b1"]], max_tokens=4)
    assert calls == [["w0", "w1"], ["a0", "a1"], ["b0", "b1"]]  # the warm-up batch first, not counted
    assert len(records) == 4
    assert all(r["ttft_s"] == 0.5 and r["tpot_s"] == pytest.approx(0.1) and r["completion_tokens"] == 4
               for r in records)


def test_a_cell_against_a_scripted_sse_endpoint(tiny_tokenizer):
    """Warm-up requests are sent but not counted; every measured request is one streamed POST."""
    web = pytest.importorskip("aiohttp.web")
    from aiohttp.test_utils import TestServer

    bodies = []

    async def completions(request):
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("ab", "c"):
            await response.write(sse(chunk(text)).encode() + b"\n")
        await response.write(sse({"choices": [], "usage": {"completion_tokens": 3}}).encode() + b"\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with TestServer(app) as server:
            target = OpenAITarget("fake", str(server.make_url("/v1")), "m", "key", tiny_tokenizer, 10.0)
            return await target._cell([["w0", "a", "b"], ["w1", "c", "d"]], max_tokens=3)

    records, wall = asyncio.run(run())
    assert sorted(b["prompt"] for b in bodies) == ["a", "b", "c", "d", "w0", "w1"]
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 and b["max_tokens"] == 3
               and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert len(records) == 4 and {r["client"] for r in records} == {0, 1}
    assert all(r["error"] is None and r["completion_tokens"] == 3 for r in records)
    assert summarize(records, wall)["output_tokens"] == 12
