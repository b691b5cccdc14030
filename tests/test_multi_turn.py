"""benchmarks.multi_turn's arithmetic on hand-built records (the run itself needs a server)."""
import pytest

from benchmarks.multi_turn import report, summarize


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
