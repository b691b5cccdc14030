"""The quality gate's threshold choice, and the evaluation report end to end on tiny models."""
import json

from conftest import tiny_model

from builder import evaluate
from dualend.engine.checkpoint import Checkpoint


def _sweep(gaps: dict[float, float], tokens: dict[float, float]) -> dict:
    return {t: {"tokens_per_step_no_eos": tokens[t],
                "cells": {"math/short": {"vs_baseline": {"diff": gap, "low": gap - 0.01, "high": gap + 0.01}}}}
            for t, gap in gaps.items()}


def test_chosen_threshold_keeps_the_gate_at_every_higher_threshold():
    tokens = {-1.0: 1.9, 0.5: 1.7, 0.9: 1.3, 1.0: 1.0}
    # -1 passes but 0.5 does not: raising the threshold from -1 would lose quality, so 0.9 is chosen
    chosen, met = evaluate.choose_threshold(_sweep({-1.0: 0.0, 0.5: -0.04, 0.9: 0.0, 1.0: -0.01}, tokens),
                                            gate=0.02, floor=0.05)
    assert (chosen, met) == (0.9, True)
    chosen, met = evaluate.choose_threshold(_sweep({-1.0: 0.01, 0.5: 0.0, 0.9: 0.0, 1.0: 0.0}, tokens),
                                            gate=0.02, floor=0.05)
    assert (chosen, met) == (-1.0, True)


def test_a_wide_interval_fails_the_gate_even_with_a_small_point_difference():
    sweep = _sweep({0.9: -0.01, 1.0: -0.01}, {0.9: 1.2, 1.0: 1.0})
    sweep[1.0]["cells"]["math/short"]["vs_baseline"]["low"] = -0.08
    assert evaluate.choose_threshold(sweep, gate=0.02, floor=0.05) == (1.0, False)


def test_report_has_every_cell_the_sweep_from_the_chosen_threshold_and_the_text_tables(tmp_path, tiny_tokenizer):
    context = 160
    for name, pair_size in (("baseline", 1), ("dualend", 2)):
        Checkpoint(tiny_model(tiny_tokenizer, pair_size), tiny_tokenizer,
                   {"kind": name, "context": context}).save(tmp_path / name)
    report = evaluate.main(["--dualend", str(tmp_path / "dualend"), "--baseline", str(tmp_path / "baseline"),
                            "--reports", str(tmp_path / "reports"), "--report-examples", "3",
                            "--calibration-examples", "2", "--samples", "2", "--text-chunks", "2",
                            "--thresholds", "-1", "0.5"])
    saved = json.loads((tmp_path / "reports" / "quality.json").read_text())
    assert saved["threshold"] == report["threshold"] and saved["trained_context"] == context
    assert set(saved["buckets"]) == {f"{f}/{b}" for f in ("math", "lookup", "code") for b in ("short", "long")}
    assert min(map(float, saved["sweep"])) == report["threshold"] and "1.0" in saved["sweep"]
    assert set(saved["calibration_sweep"]) == {"-1.0", "0.5", "1.0"}
    assert [row["positions"] for row in saved["loss_by_position"]["baseline"]] == ["0-95", "96-127", "128-158"]
    assert saved["confidence_calibration"]["drafts"] > 0
    for row in saved["buckets"].values():
        assert row["diff_pass1"]["low"] <= row["diff_pass1"]["diff"] <= row["diff_pass1"]["high"]
    assert (tmp_path / "reports" / "quality.md").read_text().startswith("# Quality report")
