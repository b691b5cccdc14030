"""Triton adapter: the stateful backbone engine, called once per decode-loop iteration.

A request is one iteration of its deployment's mtp_verify loop, a `BackboneBatch` as tensors
(`serving.triton.backbone_batch`); the answer is its `BackboneResult` (logits and hidden state at each
segment's last latent, and at the one before when the batch verifies drafts; a per-sequence status and
message). The KV cache here holds storage only:
mtp_verify's scheduler owns the block account and sends only what fits. Its caller must carry the
pipeline key of this checkpoint, so a step of another checkpoint is refused. The loop may give up a
decode step in flight for another client's first token (`serving.preemption`: a signed datagram,
heard here on a thread of its own).
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.engines import open_engine, open_verify_engine
from dualend.engine.onnx_engine import BackboneBatch, BackboneRunner, kv_cache
from dualend.serving.keys import PipelineGuard
from dualend.serving.metrics import PoolMetrics
from dualend.serving.outcomes import Outcome
from dualend.serving.preemption import PreemptListener
from dualend.serving.repository import DeploymentConfig, version_components
from dualend.serving.triton import (BACKBONE_INPUTS, backbone_batch, backbone_response_arrays, error_response,
                                    input_arrays, tensors)


class TritonPythonModel:
    def initialize(self, args):
        config = DeploymentConfig.from_args(args)
        exported = version_components(args, ("backbone",))
        settings = exported.settings
        self.pool = kv_cache(settings, settings["n_layers"], config.max_concurrent_requests + 1,  # + warm-up
                             **config.kv_cache_options())
        engine = open_engine(exported, "backbone", config.engine, config.engine_threads)
        verify = open_verify_engine(exported, config.engine, config.engine_threads)
        self.runner = BackboneRunner(engine, self.pool, settings["vocab_size"], settings["d_model"], verify)
        self.guard = PipelineGuard(args, exported.checkpoint_id, config.deployment)
        self._warm_up(settings["d_model"])
        self.preemption = PreemptListener(args["model_name"], self.guard.secret, self.runner.preempt,
                                          pb_utils.Logger.log_warn)
        block_size, capacity = config.kv_block_size, config.kv_capacity_blocks
        self.metrics = PoolMetrics(_family, {"model": args["model_name"], "deployment": config.deployment},
                                   self.pool, block_size, capacity)
        pb_utils.Logger.log_info(f"{args['model_name']}: backbone of checkpoint {exported.checkpoint_id} on "
                                 f"{config.engine}, KV pool {capacity} blocks of {block_size} pair slots")

    def _warm_up(self, d_model):
        latents = np.zeros((11, d_model), np.float32)
        for batch in (BackboneBatch([-1], latents[:8], [8], [11], []), BackboneBatch([-1], latents[:1], [1], [0], []),
                      BackboneBatch([-1], latents[:2], [2], [0], [], verify=True)):
            result = self.runner.run_batch(batch)
            if result.failed(0):
                raise RuntimeError(f"backbone warm-up failed: {result.status[0].name}: {result.messages[0]}")
        self.pool.release(-1)

    def execute(self, requests):
        self.pool.evict_idle()
        responses = []
        for request in requests:
            inputs = input_arrays(pb_utils, request, (*BACKBONE_INPUTS, "pipeline_key"))
            refusal = self.guard.refuses(inputs["pipeline_key"])
            if refusal:
                responses.append(error_response(pb_utils, Outcome.NOT_ALLOWED, refusal))
                continue
            try:
                result = self.runner.run_batch(backbone_batch(inputs))
            except Exception as error:  # noqa: BLE001 - a malformed batch fails alone
                responses.append(error_response(pb_utils, Outcome.STEP_FAILED, str(error)))
                continue
            responses.append(pb_utils.InferenceResponse(tensors(pb_utils, backbone_response_arrays(result))))
        self.metrics.update()
        return responses

    def finalize(self):
        self.preemption.close()


def _family(name, description, kind):
    return pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind.upper()))
