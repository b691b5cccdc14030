"""benchmarks.conversion_recipes on hand-written run folders: gaps to the teacher, the table, the plot."""
import json

import pytest

from benchmarks.conversion_recipes import main


def run_folder(root, name, records, lora_rank=16, lr=5e-4, **recipe):
    folder = root / name
    (folder / "adapters").mkdir(parents=True)
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "adapters" / "adapters.json").write_text(json.dumps(
        {"spec": {"lora_rank": lora_rank}, "recipe": {"lr": lr, "hidden_weight": 0.0, "autocast": "none",
                                                      "batch_size": 4, "seq_tokens": 256, **recipe}}))
    return folder


def record(step, tokens, minutes, nll_t1, nll_t2, agree, speed=None):
    return {"step": step, "tokens": tokens, "minutes": minutes, "tokens_per_s": speed, "nll_t1": nll_t1,
            "nll_t2": nll_t2, "teacher_nll_t1": 2.0, "teacher_nll_t2": 2.5, "agree_t1": agree, "agree_t2": agree / 2}


def test_each_run_is_reported_by_its_gap_to_the_teacher_and_plotted(tmp_path, capsys):
    lora = run_folder(tmp_path, "lora", [record(0, 0, 0.0, 6.0, 9.0, 0.2), record(10, 10240, 5.0, 4.0, 6.5, 0.4, 34.0)])
    full = run_folder(tmp_path, "full", [record(0, 0, 0.0, 6.0, 9.0, 0.2), record(8, 8192, 5.0, 3.5, 6.0, 0.45, 27.0)],
                      lora_rank=0, lr=1e-4)
    main([str(lora), str(full), "--out", str(tmp_path / "report")])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| lora | lora_rank 16, lr 0.0005" in report and "| 2.000 (from 4.000) | 4.000 (from 6.500) |" in report
    assert "| full | lora_rank 0, lr 0.0001" in report and "| 1.500 (from 4.000) | 3.500 (from 6.500) |" in report
    assert report.count("compressor_init mean |") == 2  # adapters from before the choice started from the mean
    assert (tmp_path / "report" / "curves.png").stat().st_size > 10_000
    assert "| 8 | 8192 | 5.0 | 27 |" in capsys.readouterr().out


def test_a_run_with_a_teacher_cache_a_fading_hidden_target_or_compiled_says_so(tmp_path):
    cached = run_folder(tmp_path, "cached", [record(0, 0, 0.0, 6.0, 9.0, 0.2)], teacher_cache=256,
                        hidden_fade_minutes=0.0, compile=False)
    compiled = run_folder(tmp_path, "compiled", [record(0, 0, 0.0, 6.0, 9.0, 0.2)], compile=True)
    main([str(cached), str(compiled), "--out", str(tmp_path / "report")])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "compressor_init mean, teacher_cache 256 |" in report and "compressor_init mean, compile True |" in report


def test_a_run_evaluated_on_open_requests_shows_their_gap_and_one_without_a_dash(tmp_path):
    opened = [record(0, 0, 0.0, 6.0, 9.0, 0.2) | {"open_nll_t1": 4.0, "open_teacher_nll_t1": 1.0},
              record(5, 5120, 2.0, 5.0, 8.0, 0.3) | {"open_nll_t1": 3.0, "open_teacher_nll_t1": 1.0}]
    resumed = [record(0, 0, 0.0, 6.0, 9.0, 0.2)] + opened  # its first records from before open_ figures
    main([str(run_folder(tmp_path, "open", opened, open_prompts=1024)),
          str(run_folder(tmp_path, "text", [record(0, 0, 0.0, 6.0, 9.0, 0.2)])),
          str(run_folder(tmp_path, "resumed", resumed)), "--out", str(tmp_path / "report")])
    rows = (tmp_path / "report" / "report.md").read_text().splitlines()[4:7]
    assert "open_prompts 1024 |" in rows[0] and rows[0].endswith("| 2.000 (from 3.000) |")
    assert rows[1].endswith("| - |") and rows[2].endswith("| 2.000 (from 3.000) |")


def test_runs_resumed_from_one_state_are_compared_from_a_step_with_minutes_counted_from_there(tmp_path):
    common = [record(0, 0, 0.0, 6.0, 9.0, 0.2), record(10, 10240, 50.0, 4.0, 6.5, 0.4)]  # speeds: each run its own
    slow = run_folder(tmp_path, "slow", common + [record(20, 20480, 80.0, 3.0, 6.0, 0.5, 30.0)])
    fast = run_folder(tmp_path, "fast", common + [record(20, 20480, 60.0, 3.5, 6.2, 0.45, 60.0)])
    main([str(slow), str(fast), "--out", str(tmp_path / "report"), "--from-step", "10"])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| 20 | 20480 | 30.0 | 30 | 1.000 (from 2.000) |" in report
    assert "| 20 | 20480 | 10.0 | 60 | 1.500 (from 2.000) |" in report
    curves = json.loads((tmp_path / "report" / "curves.json").read_text())
    assert [r["minutes"] for r in curves["slow"]] == [0.0, 30.0] and [r["step"] for r in curves["fast"]] == [10, 20]
    with pytest.raises(SystemExit, match="no record from step 21"):  # not an empty report
        main([str(slow), "--out", str(tmp_path / "report"), "--from-step", "21"])
