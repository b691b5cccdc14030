"""Benchmark-only modes: synthetic acceptance (a seeded draw replaces the confidence gate's decision,
set by the deployment, never by a request) and dummy weights (`builder.import_model --dummy`)."""
import json
import math
import re
from dataclasses import asdict, fields, replace

import numpy as np
import pytest
import torch

from builder.assemble import deployment_synthetic_rate, dummy_weights, synthetic_rate, synthetic_rates
from builder.import_model import dummy_model
from builder.import_model import main as import_main
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.decode import SamplingParams, SequenceDecoder
from dualend.engine.onnx_engine import OnnxComponents
from dualend.engine.reference import TorchComponents
from dualend.serving.contract import REQUEST_INPUTS, PreparedRequest
from dualend.serving.metrics import PhaseMetrics
from dualend.serving.offline import generate_text
from dualend.serving.repository import DeploymentConfig, served_benchmark_notices

from test_control_and_config import CONFIG, model_args, rendered_parameters

PAD, BOS, EOS = 0, 1, 2
VOCAB = 8


def decoder(seed=0, threshold=0.99, synthetic=None, max_tokens=10**6):
    return SequenceDecoder(2, PAD, EOS, BOS, SamplingParams(max_tokens=max_tokens, seed=seed), threshold, 1,
                           synthetic_acceptance=synthetic)


def draft_logits(token=5):
    logits = np.zeros(VOCAB, np.float32)
    logits[token] = 10.0
    return logits


def accepts(d: SequenceDecoder, steps: int, confidence: float = 0.0) -> list[bool]:
    out = []
    for _ in range(steps):
        assert d.wants_draft(3)
        out.append(d.complete(3, draft_logits(), confidence).accepted)
    return out


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 0.9, 1.0])
def test_the_draw_accepts_at_the_set_rate_whatever_the_gate_says(rate):
    steps = 4000
    accepted = sum(accepts(decoder(synthetic=rate), steps, confidence=0.0))  # the gate would reject all
    bound = 5 * math.sqrt(steps * rate * (1 - rate)) + 1e-9  # 5 sigma of a binomial
    assert abs(accepted - rate * steps) <= bound


def test_the_draw_is_reproducible_for_a_seed_and_differs_across_seeds():
    assert accepts(decoder(seed=7, synthetic=0.5), 200) == accepts(decoder(seed=7, synthetic=0.5), 200)
    assert accepts(decoder(seed=7, synthetic=0.5), 200) != accepts(decoder(seed=8, synthetic=0.5), 200)


def test_a_rejected_draft_becomes_pad_and_an_accepted_one_is_the_mtp_heads_sample():
    rejected = decoder(synthetic=0.0)
    step = rejected.complete(3, draft_logits(5), 1.0)  # the gate would accept it
    assert step.drafted and not step.accepted and step.tokens == [3] and rejected.next_pair == [3, PAD]
    accepted = decoder(synthetic=1.0)
    step = accepted.complete(3, draft_logits(6), 0.0)  # the gate would reject it
    assert step.accepted and step.tokens == [3, 6] and accepted.next_pair == [3, 6]


def test_without_the_setting_the_gate_decides():
    assert not any(accepts(decoder(threshold=0.5), 50, confidence=0.4))
    assert all(accepts(decoder(threshold=0.5), 50, confidence=0.6))
    off = decoder(threshold=1.0)  # drafting off: no draft is asked for
    assert not off.wants_draft(3)


def test_synthetic_acceptance_drafts_even_where_the_threshold_turns_drafting_off():
    assert decoder(threshold=1.0, synthetic=0.5).wants_draft(3)


def test_a_request_cannot_switch_it_on():
    assert not [name for name in REQUEST_INPUTS if "synthetic" in name]
    assert "synthetic_acceptance" not in {f.name for f in fields(SamplingParams)}
    raw = {"prompt_ids": [1, 5], "params": asdict(SamplingParams()) | {"synthetic_acceptance": 1.0},
           "stream": True, "exclude_input_in_output": True}
    with pytest.raises(TypeError, match="synthetic_acceptance"):
        PreparedRequest.from_json(json.dumps(raw))


def test_in_process_generation_takes_the_rate(exported, tiny_tokenizer):
    engine = OnnxComponents(exported["dualend"][1])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    every = generate_text(engine, tiny_tokenizer, "Q: 1+2\nA:", params, 1.0, synthetic_acceptance=1.0)
    assert every.drafts > 0 and every.accepted == every.drafts and every.steps < len(every.tokens)
    none = generate_text(engine, tiny_tokenizer, "Q: 1+2\nA:", params, -1.0, synthetic_acceptance=0.0)
    assert none.drafts > 0 and none.accepted == 0 and none.steps == len(none.tokens)
    gated = generate_text(engine, tiny_tokenizer, "Q: 1+2\nA:", params, 1.0)  # the deployment's gate: off
    assert gated.drafts == 0


def test_the_config_round_trips_the_settings_and_names_them():
    config = replace(CONFIG, synthetic_acceptance=0.9, weights="dummy")
    assert DeploymentConfig.from_args(model_args(rendered_parameters(config))) == config
    assert config.synthetic_rate == 0.9 and CONFIG.synthetic_rate is None and CONFIG.benchmark_notices() == []
    assert config.benchmark_notices() == [
        "SYNTHETIC ACCEPTANCE 0.9: benchmark only, drafts accepted by a draw, not by the gate",
        "DUMMY WEIGHTS: random, benchmark only, its output is noise"]


def test_a_repository_built_before_the_setting_is_refused_by_name():
    parameters = rendered_parameters(CONFIG)
    del parameters["synthetic_acceptance"]
    with pytest.raises(KeyError, match="no parameter 'synthetic_acceptance'.*rebuild it"):
        DeploymentConfig.from_args(model_args(parameters))


@pytest.mark.parametrize("changes", [{"pair_size": 1, "synthetic_acceptance": 0.9}, {"synthetic_acceptance": 1.5},
                                     {"weights": "random"}])
def test_a_config_no_deployment_can_serve_is_refused_at_load(changes):
    with pytest.raises(ValueError, match="synthetic_acceptance|weights"):
        replace(CONFIG, **changes)


def test_the_metric_says_the_rate_and_minus_one_when_off():
    metrics = PhaseMetrics()
    metrics.flush(True, 0, 0)
    assert metrics.take().gauges["dualend_synthetic_acceptance_rate"] == -1.0
    metrics.synthetic_acceptance(0.7)
    metrics.flush(True, 0, 0)
    assert metrics.take().gauges == {"dualend_synthetic_acceptance_rate": 0.7}


def test_assemble_takes_a_rate_per_deployment_and_refuses_it_on_a_token_level_one():
    assert synthetic_rate("0.9") == (None, 0.9) and synthetic_rate("dualend=0.7") == ("dualend", 0.7)
    for bad in ("1.5", "dualend=x", "-0.1"):
        with pytest.raises(Exception, match="RATE from 0 to 1"):
            synthetic_rate(bad)
    rates = synthetic_rates([(None, 0.9), ("dualend", 0.7)], ["dualend", "baseline"])
    assert deployment_synthetic_rate(rates, "dualend", 2) == 0.7
    assert deployment_synthetic_rate({None: 0.9}, "other", 2) == 0.9
    assert deployment_synthetic_rate({None: 0.9}, "baseline", 1) == -1.0  # a bare RATE: the dual-end ones
    assert deployment_synthetic_rate({}, "dualend", 2) == -1.0  # off by default
    with pytest.raises(SystemExit, match="baseline is a token-level deployment"):
        deployment_synthetic_rate({"baseline": 0.9}, "baseline", 1)
    with pytest.raises(SystemExit, match="names nope, not among the deployments built"):
        synthetic_rates([("nope", 0.9)], ["dualend"])


SHAPE = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}


def test_dummy_weights_have_the_requested_shape_load_run_and_get_an_id(exported, tmp_path, capsys):
    tokenizer_dir = tmp_path / "tok"
    exported["dualend"][0].save(tokenizer_dir)
    (tmp_path / "config.json").write_text(json.dumps(SHAPE))
    import_main(["--dummy", str(tmp_path / "config.json"), "--tokenizer", str(tokenizer_dir),
                 "--out", str(tmp_path / "dummy")])
    assert "DUMMY WEIGHTS" in capsys.readouterr().out
    checkpoint = load_checkpoint(tmp_path / "dummy")  # verifies its id
    cfg = checkpoint.config
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn_hidden, cfg.pair_size) == (48, 2, 4, 2, 96, 1)
    assert checkpoint.recipe["dummy"] is True and checkpoint.recipe["context"] == 128
    assert dummy_weights(tmp_path / "dummy")
    assert not dummy_weights(tokenizer_dir)
    state = checkpoint.model.state_dict()
    assert torch.all(state["backbone.norm.weight"] == 1)
    assert abs(float(state["embedding.weight"].std()) - 0.02) < 0.002
    assert checkpoint.tokenizer.pad_id == exported["dualend"][0].tokenizer.pad_id
    components = TorchComponents(checkpoint.model)
    output = components.open_backbone().prefill(components.compress(np.array([[1], [5], [6], [7]])), 8)
    assert output.logits.shape == (cfg.vocab_size,) and np.isfinite(output.logits).all()
    again = dummy_model(tmp_path / "config.json", tokenizer_dir)
    assert again.id == checkpoint.id  # seeded
    assert dummy_model(tmp_path / "config.json", tokenizer_dir, seed=1).id != checkpoint.id
    dual = dummy_model(tmp_path / "config.json", tokenizer_dir, dual_end=True)
    assert dual.config.pair_size == 2 and dual.model.mtp is not None


def test_dummy_refuses_a_tokenizer_larger_than_the_vocabulary(exported, tmp_path):
    tokenizer_dir = tmp_path / "tok"
    exported["dualend"][0].save(tokenizer_dir)
    (tmp_path / "config.json").write_text(json.dumps(SHAPE | {"vocab_size": 10}))
    with pytest.raises(ValueError, match="more than the config's vocab_size 10"):
        dummy_model(tmp_path / "config.json", tokenizer_dir)


def test_the_launcher_reads_the_notices_of_the_served_generation(tmp_path):
    config = replace(CONFIG, deployment="dualend", pipeline="dualend_v3", synthetic_acceptance=0.9)
    (tmp_path / "dualend").mkdir()
    (tmp_path / "dualend" / "config.pbtxt").write_text('ensemble_scheduling { step [ { model_name: "dualend_v3_preprocessing" } ] }')
    (tmp_path / "dualend_v3_mtp_verify").mkdir()
    (tmp_path / "dualend_v3_mtp_verify" / "config.pbtxt").write_text(config.pbtxt())
    assert served_benchmark_notices(tmp_path, "dualend") == config.benchmark_notices()
    assert served_benchmark_notices(tmp_path, "baseline") == []


def test_variants_are_built_from_their_source_with_their_own_precision_threads_and_synthetic_rate(tmp_path, capsys):
    from builder.assemble import DEFAULTS
    from builder.assemble import main as assemble_main
    from dualend.engine.onnx_engine import ExportedModel
    from dualend.serving.repository import pipeline_name, served_generation

    repository = assemble_main([
        "--checkpoints", str(DEFAULTS["checkpoints"]), "--out", str(tmp_path / "repository"),
        "--export-dir", str(tmp_path / "export"), "--hf-tokenizer", str(tmp_path / "tokenizer"),
        "--deployments", "dualend", "--variant", "fast=dualend", "--weight-precision", "fast=int8",
        "--synthetic-acceptance", "fast=0.9", "--engine-threads", "fast=1"])
    built = capsys.readouterr().out
    assert "fast: checkpoint" in built and "(a variant of dualend)" in built and "int8 weights" in built
    precision = {}
    for name in ("dualend", "fast"):
        backbone = repository / f"{pipeline_name(name, served_generation(repository, name))}_backbone" / "1"
        precision[name] = ExportedModel.open(backbone, ("backbone",)).weight_precision
    assert precision == {"dualend": "fp32", "fast": "int8"}
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["dualend", "dualend_int8"]
    rates = {name: float(re.search(r'key: "synthetic_acceptance" value: \{ string_value: "([^"]*)"',
                                   (repository / f"{pipeline_name(name, 1)}_mtp_verify" / "config.pbtxt").read_text())[1])
             for name in ("dualend", "fast")}
    assert rates == {"dualend": -1.0, "fast": 0.9}  # -1: off
    threads = {name: int(re.search(r'key: "engine_threads" value: \{ string_value: "([^"]*)"',
                                   (repository / f"{pipeline_name(name, 1)}_backbone" / "config.pbtxt").read_text())[1])
               for name in ("dualend", "fast")}
    assert threads == {"dualend": 2, "fast": 1}
