"""Triton adapter: the stateful backbone engine, called once per decode-loop iteration.

A request is one iteration of its deployment's mtp_verify loop: the new latents of several
sequences, one segment each (`sequence_ids`, `new_latents`), with `reserve_slots` > 0 on a
sequence's first prefill chunk, `release_ids` to free first and, for a prefix-cache hit,
`keep_ids` (ended sequences whose keys and values to keep a copy of, the prefix cache's) and
`reuse_ids` / `reuse_slots` (a kept copy a starting sequence begins with, and how many of its slots). The KV cache here holds storage
only: mtp_verify's scheduler owns the block account and sends only what fits. It answers the
logits and hidden state at each segment's last latent, a per-sequence `status`
(`onnx_engine.SequenceStatus`) and a message for humans ("" when OK). Its caller must carry the
pipeline key of this checkpoint, so a step of another checkpoint is refused.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.engines import open_engine
from dualend.engine.onnx_engine import BackboneBatch, BackboneRunner, kv_cache
from dualend.serving.keys import PipelineGuard
from dualend.serving.metrics import PoolMetrics
from dualend.serving.outcomes import Outcome
from dualend.serving.repository import DeploymentConfig, version_components
from dualend.serving.triton import error_response

INPUTS = ("sequence_ids", "latents", "new_latents", "reserve_slots", "release_ids", "keep_ids", "reuse_ids",
          "reuse_slots")


class TritonPythonModel:
    def initialize(self, args):
        config = DeploymentConfig.from_args(args)
        exported = version_components(args, ("backbone",))
        settings = exported.settings
        self.pool = kv_cache(settings, settings["n_layers"], config.max_concurrent_requests + 1,  # + warm-up
                             **config.kv_cache_options())
        engine = open_engine(exported, "backbone", config.engine, config.engine_threads)
        self.runner = BackboneRunner(engine, self.pool, settings["vocab_size"], settings["d_model"])
        self.guard = PipelineGuard(args, exported.checkpoint_id, config.deployment)
        self._warm_up(settings["d_model"])
        block_size, capacity = config.kv_block_size, config.kv_capacity_blocks
        self.metrics = PoolMetrics(_family, {"model": args["model_name"], "deployment": config.deployment},
                                   self.pool, block_size, capacity)
        pb_utils.Logger.log_info(f"{args['model_name']}: backbone of checkpoint {exported.checkpoint_id} on "
                                 f"{config.engine}, KV pool {capacity} blocks of {block_size} pair slots")

    def _warm_up(self, d_model):
        latents = np.zeros((9, d_model), np.float32)
        for batch in (BackboneBatch([-1], latents[:8], [8], [9], []), BackboneBatch([-1], latents[:1], [1], [0], [])):
            result = self.runner.run_batch(batch)
            if result.failed(0):
                raise RuntimeError(f"backbone warm-up failed: {result.status[0].name}: {result.messages[0]}")
        self.pool.release(-1)

    def execute(self, requests):
        self.pool.evict_idle()
        responses = []
        for request in requests:
            refusal = self.guard.refuses(_input(request, "pipeline_key"))
            if refusal:
                responses.append(error_response(pb_utils, Outcome.NOT_ALLOWED, refusal))
                continue
            ids, latents, counts, reserves, releases, keeps, reuse_ids, reuse_slots = (_input(request, n)
                                                                                     for n in INPUTS)
            try:
                result = self.runner.run_batch(BackboneBatch(
                    ids.tolist(), latents, counts.tolist(), reserves.tolist(), _list(releases), _list(keeps),
                    _list(reuse_ids), _list(reuse_slots)))
            except Exception as error:  # noqa: BLE001 - a malformed batch fails alone
                responses.append(error_response(pb_utils, Outcome.STEP_FAILED, str(error)))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("logits", result.logits), pb_utils.Tensor("hidden", result.hidden),
                pb_utils.Tensor("status", np.asarray(result.status, np.int32)),
                pb_utils.Tensor("messages", np.asarray([m.encode() for m in result.messages], dtype=object))]))
        self.metrics.update()
        return responses


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _list(array) -> list:
    return [] if array is None else array.tolist()


def _family(name, description, kind):
    return pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind.upper()))
