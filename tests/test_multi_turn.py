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
