"""What the Triton adapters share, without Triton: the control requests to the decode loop, the
typed deployment config, and the pb_utils glue, driven by a fake pb_utils."""
import json
from dataclasses import asdict

import numpy as np
import pytest

from dualend.engine.decode import InvalidRequest
from dualend.engine.onnx_engine import BackboneBatch, SequenceStatus
from dualend.serving.contract import Response
from dualend.serving.control import CANCEL, DRAIN, Control, cancel_request, drain_request, read_control
from dualend.serving.keys import PIPELINE_SECRET_ENV, PipelineGuard
from dualend.serving.outcomes import Outcome
from dualend.serving.repository import DeploymentConfig
from dualend.serving.triton import BLSBackbone, ResponseSenderOutput

CONFIG = DeploymentConfig(
    deployment="dualend", pipeline="dualend_v3", pair_size=2, acceptance_threshold=0.35, raw_context_limit=512,
    max_new_tokens=256, max_concurrent_requests=16, max_queue_size=64, queue_wait_s=30.0, prefill_chunk_latents=32,
    kv_block_size=16, kv_capacity_blocks=1024, idle_timeout_s=60.0, prefix_cache_entries=4, prefix_cache_ttl_s=600.0,
    engine="onnxruntime",
    engine_threads=2, compressor_engine="onnxruntime", compressor_threads=1)


def model_args(parameters: dict[str, str], name="dualend_v3_mtp_verify") -> dict:
    """What Triton hands a Python model's initialize()."""
    config = {"name": name, "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    return {"model_name": name, "model_config": json.dumps(config)}


def rendered_parameters(config: DeploymentConfig) -> dict[str, str]:
    """The parameters of a config.pbtxt as Triton reads them back from the builder's lines."""
    import re

    return dict(re.findall(r'parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', config.pbtxt()))


def test_the_deployment_config_reads_back_what_the_builder_rendered_typed():
    parameters = rendered_parameters(CONFIG)
    assert set(parameters) == set(asdict(CONFIG))
    assert parameters["acceptance_threshold"] == "0.35" and parameters["kv_capacity_blocks"] == "1024"
    config = DeploymentConfig.from_args(model_args(parameters))
    assert config == CONFIG
    assert isinstance(config.max_queue_size, int) and isinstance(config.queue_wait_s, float)


def test_a_parameter_missing_from_the_config_names_itself_and_the_fix():
    parameters = rendered_parameters(CONFIG)
    del parameters["kv_capacity_blocks"]
    with pytest.raises(KeyError, match="dualend_v3_mtp_verify: the model config has no parameter 'kv_capacity_blocks'"
                                       ".*rebuild it with `python -m builder.assemble`"):
        DeploymentConfig.from_args(model_args(parameters))


def test_a_parameter_of_the_wrong_type_names_itself():
    parameters = rendered_parameters(CONFIG) | {"kv_block_size": "16.5"}
    with pytest.raises(ValueError, match="dualend_v3_mtp_verify: parameter 'kv_block_size' is '16.5', not int"):
        DeploymentConfig.from_args(model_args(parameters))


def test_control_requests_carry_the_action_and_the_secret_alone():
    cancel = cancel_request(2**63 - 5, "secret:ckpt")
    assert set(cancel) == {"control", "cancel_id", "pipeline_key"}
    assert cancel["cancel_id"].dtype == np.uint64 and cancel["cancel_id"].tolist() == [2**63 - 5]
    assert cancel["pipeline_key"].tolist() == [b"secret:ckpt"] and cancel["control"].tolist() == [b"cancel"]
    drain = drain_request("secret:ckpt")
    assert set(drain) == {"control", "pipeline_key"} and drain["control"].tolist() == [b"drain"]
    assert read_control(cancel["control"], cancel["cancel_id"]) == Control(CANCEL, 2**63 - 5)
    assert read_control(drain["control"], None) == Control(DRAIN)


@pytest.mark.parametrize("control, cancel_id, message", [
    (np.array([b"reboot"], object), None, "control must be 'cancel' or 'drain', got 'reboot'"),
    (np.array([b"cancel"], object), None, "a cancel names one cancel_id, got 0"),
    (np.array([b"cancel"], object), np.array([1, 2], np.uint64), "a cancel names one cancel_id, got 2"),
])
def test_a_malformed_control_request_says_what_is_wrong(control, cancel_id, message):
    with pytest.raises(InvalidRequest, match=message):
        read_control(control, cancel_id)


def test_a_control_request_passes_the_guard_only_with_the_secret(monkeypatch):
    monkeypatch.setenv(PIPELINE_SECRET_ENV, "per-start")
    guard = PipelineGuard({"model_name": "dualend_v3_mtp_verify"}, "ckpt", "dualend")
    assert guard.refuses(drain_request(guard.secret)["pipeline_key"]) is None
    assert guard.refuses(drain_request("per-start:other-ckpt")["pipeline_key"]).startswith("refused:")


class FakePbUtils:
    """The few pb_utils names the glue uses, recording what it is asked to do."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self, outputs=None):
        self.requests, self.outputs = [], outputs or {}

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class TritonError:
        INVALID_ARG = 3

        def __init__(self, message, code=0):
            self.text, self.code = message, code

        def message(self):
            return self.text

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors, self.error_ = {t.name: t for t in output_tensors}, error

        def has_error(self):
            return self.error_ is not None

        def error(self):
            return self.error_

    def InferenceRequest(self, model_name, inputs, requested_output_names):  # noqa: N802 - pb_utils' name
        fake = self

        class Request:
            def exec(self):
                fake.requests.append((model_name, {t.name: t.array for t in inputs}))
                return fake.InferenceResponse([fake.Tensor(k, v) for k, v in fake.outputs.items()])
        return Request()

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return response.tensors.get(name)


def test_the_bls_backbone_sends_one_batch_with_the_secret_and_reads_the_answer():
    pb = FakePbUtils({"logits": np.zeros((2, 5), np.float32), "hidden": np.ones((2, 4), np.float32),
                      "status": np.array([SequenceStatus.OK, SequenceStatus.EVICTED], np.int32),
                      "messages": np.array([b"", b"evicted after idling"], object),
                      "verify_logits": np.zeros((0, 5), np.float32), "verify_hidden": np.zeros((0, 4), np.float32)})
    backbone = BLSBackbone(pb, "dualend_v3_backbone", "secret:ckpt")
    result = backbone.run_batch(BackboneBatch([7, 8], np.zeros((3, 4)), [1, 2], [0, 9], [5]))
    model, inputs = pb.requests[0]
    assert model == "dualend_v3_backbone" and inputs["pipeline_key"].tolist() == [b"secret:ckpt"]
    assert inputs["latents"].dtype == np.float32 and inputs["release_ids"].tolist() == [5]
    assert inputs["new_latents"].dtype == np.int32 and inputs["sequence_ids"].dtype == np.int64
    assert result.status == [SequenceStatus.OK, SequenceStatus.EVICTED] and result.hidden.shape == (2, 4)
    assert result.messages == ["", "evicted after idling"] and result.verify_logits is None
    backbone.run_batch(BackboneBatch([7], np.zeros((1, 4)), [1], [0], []))
    assert "release_ids" not in pb.requests[1][1]


def test_a_batch_reads_back_from_the_tensors_the_bls_call_sends_and_so_does_a_result():
    from dualend.engine.onnx_engine import BackboneResult
    from dualend.serving.triton import (BACKBONE_INPUTS, backbone_batch, backbone_request_arrays,
                                        backbone_response_arrays, backbone_result)

    batch = BackboneBatch([7, 8], np.arange(12, dtype=np.float32).reshape(3, 4), [1, 2], [0, 9], [5], [6],
                          [0, 3], [0, 2], [1, 0], verify=True, preempt_id=11)
    sent = backbone_request_arrays(batch)
    assert set(sent) == set(BACKBONE_INPUTS) and sent["reuse_slots"].dtype == np.int32
    received = backbone_batch({name: sent.get(name) for name in BACKBONE_INPUTS})
    np.testing.assert_array_equal(received.latents, batch.latents)
    assert (received.sequence_ids, received.counts, received.reserve_slots, received.releases, received.keeps,
            received.reuse_ids, received.reuse_slots, received.discard, received.verify, received.preempt_id) == (
        [7, 8], [1, 2], [0, 9], [5], [6], [0, 3], [0, 2], [1, 0], True, 11)
    plain = backbone_request_arrays(BackboneBatch([7], np.zeros((1, 4)), [1], [0], []))
    assert set(plain) == {"latents", "sequence_ids", "new_latents", "reserve_slots"}  # nothing empty is sent
    assert backbone_batch({name: plain.get(name) for name in BACKBONE_INPUTS}).reuse(0) == (0, 0)
    assert backbone_batch({name: plain.get(name) for name in BACKBONE_INPUTS}).preempt_id == 0
    result = BackboneResult(np.ones((1, 5), np.float32), np.zeros((1, 4), np.float32),
                            [SequenceStatus.PREFIX_GONE], ["gone"])
    back = backbone_result(backbone_response_arrays(result))
    assert back.status == [SequenceStatus.PREFIX_GONE] and back.messages == ["gone"] and back.logits.shape == (1, 5)
    assert back.verify_logits is None
    result.verify_logits, result.verify_hidden = np.full((1, 5), 2, np.float32), np.full((1, 4), 3, np.float32)
    back = backbone_result(backbone_response_arrays(result))
    assert back.verify_logits.tolist() == [[2] * 5] and back.verify_hidden.tolist() == [[3] * 4]


def test_each_response_carries_its_request_id_and_token_and_the_last_is_final():
    sent = []

    class Sender:
        def send(self, response=None, flags=0):
            sent.append((response, flags))

    pb = FakePbUtils()
    output = ResponseSenderOutput(pb, Sender(), 42, "secret:ckpt")
    output.send(Response([5, 6], {"num_output_tokens": 2}, None))
    output.send(Response([], {"num_output_tokens": 0}, "eos"))
    output.fail("queue full", Outcome.QUEUE_FULL)
    assert [flags for _, flags in sent] == [0, 1, 1]
    first = sent[0][0].tensors
    assert first["request_id"].array.tolist() == [42] and first["output_ids"].array.tolist() == [5, 6]
    assert len(first["response_key"].array[0]) == 64
    assert sent[2][0].error().message() == "[queue_full] queue full"


def test_a_draft_heads_pacing_floor_defaults_to_its_precisions_break_even_and_pair_models_are_not_paced():
    from argparse import Namespace

    from builder.assemble import DRAFT_BREAK_EVEN, draft_min_acceptance

    none_given = Namespace(draft_min_acceptance=[])
    assert draft_min_acceptance(none_given, "smollm2_mtp", "smollm2_mtp", "int4", True) == DRAFT_BREAK_EVEN["int4"]
    assert draft_min_acceptance(none_given, "mtp_fp32", "smollm2_mtp", "fp32", True) == DRAFT_BREAK_EVEN["fp32"]
    assert draft_min_acceptance(none_given, "dualend", "dualend", "fp32", False) == 0.0
    given = Namespace(draft_min_acceptance=[(None, 0.2), ("dualend", 0.1)])
    assert draft_min_acceptance(given, "smollm2_mtp", "smollm2_mtp", "int4", True) == 0.2
    assert draft_min_acceptance(given, "dualend", "dualend", "fp32", False) == 0.1


def test_drafts_are_verified_for_one_sequence_at_a_time_where_the_backbone_writes_its_keys_in_place():
    """There drafts at four streams, served, cost a little more than they gave (0.94-0.97x the base)."""
    from argparse import Namespace

    from builder.assemble import DRAFT_MAX_BATCH, draft_max_batch
    from builder.export import weight_settings

    none_given = Namespace(draft_max_batch=[])
    for precision in ("int4", "w8a8"):
        assert draft_max_batch(none_given, "smollm2_mtp", "smollm2_mtp", weight_settings(precision, 64)) == 1
    assert draft_max_batch(none_given, "smollm2_mtp", "smollm2_mtp", weight_settings("fp32", 64)) == DRAFT_MAX_BATCH == 4
    given = Namespace(draft_max_batch=[("smollm2_mtp", 3)])
    assert draft_max_batch(given, "smollm2_mtp", "smollm2_mtp", weight_settings("int4", 64)) == 3
    assert draft_max_batch(given, "smollm2_mtp_w8a8", "smollm2_mtp", weight_settings("w8a8", 64)) == 1  # named for itself
