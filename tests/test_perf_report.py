"""perf_analyzer profile exports -> TTFT, token-weighted inter-token latency, throughput."""
from benchmarks.perf_report import experiment_figures

MS = 1_000_000  # nanoseconds


def _request(sent_ms, stamps_ms, tokens):
    return {"timestamp": sent_ms * MS, "response_timestamps": [s * MS for s in stamps_ms],
            "response_outputs": [{"num_output_tokens": t} for t in tokens]}


def test_figures_of_a_hand_built_experiment():
    # Request A: first response at +10 ms, then a 2-token response 8 ms later (4 ms per token) and a
    # 1-token one 6 ms later. Request B: first at +20 ms, one more 1-token response 2 ms later.
    experiment = {"experiment": {"mode": "concurrency", "value": 2},
                  "window_boundaries": [0, 100 * MS],
                  "requests": [_request(0, [10, 18, 24], [2, 2, 1]), _request(50, [70, 72], [1, 1])]}
    figures = experiment_figures(experiment)
    assert figures["concurrency"] == 2 and figures["requests"] == 2
    assert figures["ttft_ms"]["p50"] == 15.0  # median of 10 and 20
    # per-token gaps: 4, 4 (A's pair), 6 (A), 2 (B) -> median 4
    assert figures["inter_token_ms"]["p50"] == 4.0
    assert figures["latency_ms"]["p50"] == 23.0  # median of 24 and 22
    assert figures["output_tokens_per_s"] == 70.0  # 7 tokens in 0.1 s
    assert figures["requests_per_s"] == 20.0


def test_a_response_without_tokens_does_not_shorten_the_next_gap():
    # tokens at +10 ms, nothing at +14 ms (text held back), two tokens at +20 ms: 10 ms over 2 tokens
    experiment = {"experiment": {"mode": "concurrency", "value": 1}, "window_boundaries": [0, 100 * MS],
                  "requests": [_request(0, [10, 14, 20], [1, 0, 2])]}
    assert experiment_figures(experiment)["inter_token_ms"] == {"p50": 5.0, "p90": 5.0, "p99": 5.0}


def test_responses_outside_the_window_are_not_counted_as_throughput():
    experiment = {"experiment": {"mode": "concurrency", "value": 1}, "window_boundaries": [0, 50 * MS],
                  "requests": [_request(0, [10, 60], [1, 3])]}
    figures = experiment_figures(experiment)
    assert figures["output_tokens_per_s"] == 20.0 and figures["requests_per_s"] == 0.0


def test_bench_report_writes_its_table_and_plots_from_earlier_runs(tmp_path):
    import json

    from benchmarks.bench_report import main as bench_report

    def export(folder, name, concurrency, first_ms):
        folder.mkdir(parents=True, exist_ok=True)
        experiment = {"experiment": {"mode": "concurrency", "value": concurrency},
                      "window_boundaries": [0, 100 * MS],
                      "requests": [_request(0, [first_ms, first_ms + 4], [1, 2])]}
        (folder / f"{name}_c{concurrency}.json").write_text(json.dumps({"experiments": [experiment]}))

    for concurrency in (1, 16):
        export(tmp_path / "sweep", "dualend", concurrency, 10)
        export(tmp_path / "sweep", "baseline", concurrency, 20)
    for length in (256, 896):
        export(tmp_path / f"ttft_{length}", "dualend", 1, length // 20)
        export(tmp_path / f"ttft_{length}", "baseline", 1, length // 10)
    cell = {"pass": 0.5, "vs_baseline": {"diff": -0.1}}
    quality = {"threshold": 0.5, "calibration_sweep": {
        str(t): {"tokens_per_step_no_eos": 2 - t, "cells": {"math/short": cell}} for t in (-1.0, 0.5, 1.0)}}
    (tmp_path / "quality.json").write_text(json.dumps(quality))
    report = bench_report(["--out", str(tmp_path / "report"), "--sweep", str(tmp_path / "sweep"),
                           "--ttft", str(tmp_path / "ttft_256"), str(tmp_path / "ttft_896"),
                           "--quality", str(tmp_path / "quality.json")])
    text = report.read_text()
    assert "| dualend_c16 | 16 |" in text and "| baseline_c1 | 1 | 20.0" in text
    plots = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert plots == ["latency_vs_concurrency.png", "quality_vs_threshold.png", "throughput_vs_concurrency.png",
                     "tokens_per_step.png", "ttft_vs_prompt.png"]
    assert all((tmp_path / "report" / p).read_bytes()[:4] == b"\x89PNG" for p in plots)
