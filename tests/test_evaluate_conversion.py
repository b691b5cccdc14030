"""The converted model's quality gate (builder.evaluate_conversion) and its build-time merge
(builder.assemble's converted deployments), on a tiny random Llama converted with fresh adapters."""
import argparse
import json
import math

import pytest

from builder import assemble, evaluate_conversion
from builder.evaluate_conversion import (TASK_MARGIN, THRESHOLDS, answered_right, calibrate, generation_figures,
                                         prefix_agreement)
from dualend.engine.checkpoint import Checkpoint, load_checkpoint
from dualend.engine.decode import Generation
from dualend.engine.tokenizer import BOS, EOS, PAD, TextTokenizer
from dualend.train import conversion
from dualend.train.open_prompts import open_prompts
from test_conversion import SPEC, base  # noqa: F401  (the tiny base fixture)


def test_prefix_agreement_is_the_share_of_the_reference_reproduced_before_the_first_difference():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert prefix_agreement([1, 2], [1, 2, 3, 4]) == 0.5  # stopped early
    assert prefix_agreement([1, 2, 3, 4, 5], [1, 2, 3, 4]) == 1.0  # tokens alone: see generation_figures for EOS
    assert prefix_agreement([], []) == 1.0 and prefix_agreement([7], []) == 0.0


def test_an_answer_that_goes_on_where_the_reference_stopped_differs_from_it_there():
    eos = 2
    stopped = Generation(tokens=[5, 6, 7, 8], finish_reason="eos")
    went_on = Generation(tokens=[5, 6, 7, 8, 9, 9, 9, 9], finish_reason="length")
    same = Generation(tokens=[5, 6, 7, 8], finish_reason="eos")
    assert generation_figures([went_on], [stopped], eos)["agreement"] == 0.8  # 4 of the reference's 5, EOS too
    assert generation_figures([same], [stopped], eos)["agreement"] == 1.0
    # both cut by max_tokens: nothing ended, the tokens alone compare
    assert generation_figures([Generation(tokens=[5, 6], finish_reason="length")],
                              [Generation(tokens=[5, 6], finish_reason="length")], eos)["agreement"] == 1.0


def _table(agreement: dict, tokens_per_step: dict) -> dict:
    return {str(t): {"agreement": agreement[t], "tokens_per_step_no_eos": tokens_per_step[t], "acceptance_rate": 0.0}
            for t in THRESHOLDS}


def test_calibration_takes_the_fastest_threshold_whose_higher_ones_all_hold_the_gate():
    speed = {-1.0: 2.0, 0.1: 1.9, 0.2: 1.8, 0.3: 1.7, 0.5: 1.5, 0.7: 1.3, 0.9: 1.1, 1.0: 1.0}
    # 0.2 drops below drafting off's agreement by more than the gate: 0.3 is the lowest kept, and the fastest
    chat = _table({-1.0: 0.2, 0.1: 0.8, 0.2: 0.5, 0.3: 0.79, 0.5: 0.8, 0.7: 0.8, 0.9: 0.8, 1.0: 0.8}, speed)
    text = _table({t: 0.6 for t in THRESHOLDS}, speed)
    assert calibrate({"chat": chat, "text": text}, gate=0.02) == 0.3
    # a failing kind bounds it too
    text = _table({**{t: 0.6 for t in THRESHOLDS}, 0.5: 0.5}, speed)
    assert calibrate({"chat": chat, "text": text}, gate=0.02) == 0.7


def test_the_standard_error_is_the_spread_of_the_values_over_the_root_of_their_count():
    assert evaluate_conversion.standard_error([1.0, 3.0]) == 1.0  # sample std sqrt(2), over sqrt(2)
    assert evaluate_conversion.standard_error([0.5, 0.5, 0.5, 0.5]) == 0.0
    assert evaluate_conversion.standard_error([0.5]) is None


def test_no_threshold_is_kept_whose_chat_answers_fall_below_the_absolute_floor():
    speed = {t: 2.0 - i * 0.1 for i, t in enumerate(THRESHOLDS)}
    # within the gate of drafting off everywhere, but drafting off itself agrees only 0.3 with the base
    chat = _table({t: 0.3 for t in THRESHOLDS}, speed)
    text = _table({t: 0.9 for t in THRESHOLDS}, speed)
    assert calibrate({"chat": chat, "text": text}, gate=0.02) == -1.0
    assert calibrate({"chat": chat, "text": text}, gate=0.02, agreement_floor=0.5) == 1.0
    chat = _table({**{t: 0.3 for t in THRESHOLDS}, 0.7: 0.6, 0.9: 0.6, 1.0: 0.6}, speed)
    assert calibrate({"chat": chat, "text": text}, gate=0.02, agreement_floor=0.5) == 0.7


@pytest.mark.parametrize("answer, right", [
    ("The capital of France is Paris.", True), ("paris, of course", True), ("Parisian food", False),
    ("It has 8 legs.", True), ("It has 18 legs.", False), ("eight", True), ("", False)])
def test_an_answer_is_right_when_it_holds_an_accepted_string_as_whole_words(answer, right):
    assert answered_right(answer, ["Paris", "8", "eight"]) == right


def test_the_task_questions_are_distinct_answerable_and_never_a_training_prompt():
    questions = json.loads(evaluate_conversion.DEFAULTS["questions"].read_text())["questions"]
    asked = [q for q, _ in questions]
    assert len(set(asked)) == len(asked) >= 150
    assert all(accepted and all(a.strip() for a in accepted) for _, accepted in questions)
    trained = set(open_prompts("train")) | set(conversion.chat_prompts("train", 2048, seed=13))
    assert not trained & set(asked)


@pytest.fixture(scope="module")
def converted(base, tmp_path_factory):  # noqa: F811
    """The tiny base with a chat template, and fresh adapters shipped (bf16) as the assembler finds them."""
    folder = tmp_path_factory.mktemp("converted")
    tokenizer = TextTokenizer(base.tokenizer.tokenizer, {
        "pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    Checkpoint(base.model, tokenizer, base.recipe).save(folder / "base")
    reloaded = load_checkpoint(folder / "base")
    student = conversion.build_student(reloaded.model, SPEC)
    conversion.save_adapters(student, SPEC, {"checkpoint_id": reloaded.id, "source": base.recipe["source"]},
                             {"steps": 0}, folder / "run_adapters")
    conversion.ship_adapters(folder / "run_adapters", folder / "adapters")
    return folder


def test_shipped_adapters_are_bf16_and_merge_at_build_time_once(converted, capsys):
    run_size = (converted / "run_adapters" / conversion.ADAPTERS).stat().st_size
    assert (converted / "adapters" / conversion.ADAPTERS).stat().st_size < 0.6 * run_size
    assert json.loads((converted / "adapters" / conversion.ADAPTERS_CONFIG).read_text())["dtype"] == "bfloat16"
    out = converted / "merged"
    assert assemble.derived_checkpoint(converted / "base", converted / "adapters", out, "adapters") == out
    merged = load_checkpoint(out)
    assert merged.config.is_dualend and merged.recipe["converted_from"] == load_checkpoint(converted / "base").id
    assert merged.recipe["adapters"]["sha256"] == conversion.adapters_sha256(converted / "adapters")
    assert "merging" in capsys.readouterr().out
    assemble.derived_checkpoint(converted / "base", converted / "adapters", out, "adapters")
    assert "merging" not in capsys.readouterr().out  # up to date: not merged again
    with pytest.raises(SystemExit, match="adapt base"):
        assemble.derived_checkpoint(converted / "merged", converted / "adapters", converted / "other", "adapters")


def test_the_quality_gate_runs_end_to_end_and_drafting_off_emits_one_token_a_step(converted, tmp_path):
    reports = tmp_path / "a" / "new" / "folder"  # made by the gate
    report = evaluate_conversion.main([
        "--dualend", str(converted / "merged"), "--baseline", str(converted / "base"), "--name", "tiny",
        "--reports", str(reports), "--chat-prompts", "2", "--open-prompts", "2", "--text-prompts", "2",
        "--prompt-tokens", "12", "--answer-tokens", "6", "--text-rows", "2", "--text-tokens", "24",
        "--task-tokens", "4"])
    assert report["threshold"] in THRESHOLDS
    assert all(set(report[split]) == {"chat", "open", "text"} for split in ("calibration", "report"))
    found = report["open"]  # the base's answers to the report split's 2 requests, teacher-forced
    assert found["requests"] == 2 and all(math.isfinite(found[f"nll_gap_{t}"]) for t in ("t1", "t2"))
    assert f"NLL gap t1 {found['nll_gap_t1']}, t2" in (reports / "quality_tiny.md").read_text()
    for split in ("calibration", "report"):
        text = report[split]["text"]
        assert text["1.0"]["tokens_per_step_no_eos"] == 1.0 and text["1.0"]["acceptance_rate"] == 0.0
        # every draft accepted, EOS ignored: 6 tokens in 3 steps per prompt
        assert text["-1.0"]["tokens_per_step_no_eos"] == 2.0 and text["-1.0"]["acceptance_rate"] == 1.0
        assert all(0.0 <= row["agreement"] <= 1.0 for kind in report[split].values() for row in kind.values())
    assert set(report["verdict"]["met"]) == set(evaluate_conversion.TARGETS) | {"task_answers"}
    gaps = report["text"]["nll_gap_by_row"]  # rows of equal length: their mean gap is the gate's
    assert len(gaps) == 2 and sum(gaps) / 2 == pytest.approx(report["verdict"]["measured"]["nll_gap"], abs=2e-4)
    assert (f"the gap's standard error over rows {evaluate_conversion.standard_error(gaps)})"
            in (reports / "quality_tiny.md").read_text())
    task = report["task"]
    assert task["questions"] == len(task["answers"]) >= 40
    assert report["verdict"]["targets"]["task_answers"] == task["baseline_right"] - TASK_MARGIN
    asked = [q for q, _ in json.loads(evaluate_conversion.DEFAULTS["questions"].read_text())["questions"]]
    assert [a["question"] for a in task["answers"]] == asked  # every question of the file, in its order
    assert task["dualend_right_of_baselines"] == sum(a["baseline_right"] and a["dualend_right"] for a in task["answers"])
    assert task["dualend_stopped_of_baselines"] == sum(a["baseline_stopped"] and a["dualend_stopped"]
                                                       for a in task["answers"]) <= task["baseline_stopped"]
    assert (f"within 4 tokens on {task['baseline_stopped']} questions, the converted model's on "
            f"{task['dualend_stopped_of_baselines']} of those") in (reports / "quality_tiny.md").read_text()
    assert report["verdict"]["passed"] == all(report["verdict"]["met"].values())
    assert json.loads((reports / "quality_tiny.json").read_text())["threshold"] == report["threshold"]
    assert "NOT PASSED" in (reports / "quality_tiny.md").read_text() or report["verdict"]["passed"]


def test_the_gates_open_requests_are_held_out_topics_alternating_between_calibration_and_report(converted):
    base = load_checkpoint(converted / "base")
    args = argparse.Namespace(chat_prompts=1, open_prompts=3, text_prompts=1, prompt_tokens=12)
    tokenizer, held_out = base.tokenizer, open_prompts("held_out")
    for split, first in (("calibration", 0), ("report", 1)):
        asked = evaluate_conversion.prompts(base, split, args)["open"]
        assert asked == [tokenizer.encode_prompt(tokenizer.user_turn(q)) for q in held_out[first:6:2]]
    args.open_prompts = 0  # none asked: no open kind (an empty one would fail its batch)
    assert set(evaluate_conversion.prompts(base, "report", args)) == {"chat", "text"}
    assert evaluate_conversion.open_figures(None, base, args) is None


def test_the_task_check_counts_the_baselines_answers_that_end_and_the_converted_ones_ending_with_them(
        converted, tmp_path, monkeypatch):
    """Which answers end (EOS) and which run out of tokens, from each model's generations: the baseline's
    answers 0 and 2 end, the converted model's 1 and 2."""
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps({"questions": [["Q0?", ["a"]], ["Q1?", ["b"]], ["Q2?", ["c"]]]}))
    base = load_checkpoint(converted / "base")
    dual = conversion.merged_checkpoint(base, converted / "adapters")
    finished = {id(base.model): ["eos", "length", "eos"], id(dual.model): ["length", "eos", "eos"]}
    monkeypatch.setattr(evaluate_conversion, "generate_batch", lambda batch, params, threshold: [
        Generation(tokens=[5], finish_reason=reason) for reason in finished[id(batch.model)]])
    task = evaluate_conversion.task_check(dual, base, 1.0, argparse.Namespace(questions=questions, task_tokens=4))
    assert [(a["baseline_stopped"], a["dualend_stopped"]) for a in task["answers"]] == [
        (True, False), (False, True), (True, True)]
    assert (task["baseline_stopped"], task["dualend_stopped_of_baselines"]) == (2, 1)


def test_the_gate_refuses_a_dual_end_model_converted_from_another_base(converted, tmp_path):
    with pytest.raises(SystemExit, match="was converted from"):
        evaluate_conversion.main(["--dualend", str(converted / "merged"), "--baseline", str(converted / "merged"),
                                  "--reports", str(tmp_path)])
