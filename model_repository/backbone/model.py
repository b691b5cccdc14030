"""Triton adapter: the stateful backbone engine, called once per decode-loop iteration.

A request is one iteration of its deployment's mtp_verify loop: the new latents of several
sequences, one segment each (`sequence_ids`, `new_latents`), with `reserve_slots` > 0 on a
sequence's first prefill chunk and `release_ids` to free first. It answers the logits and hidden
state at each segment's last latent and a per-sequence error ("" when it ran). Its caller must
carry the pipeline key of this checkpoint, so a step of another checkpoint is refused.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.engines import open_engine
from dualend.engine.onnx_engine import BackboneBatch, BackboneRunner, kv_cache
from dualend.serving.keys import PipelineGuard
from dualend.serving.repository import model_parameters, version_components


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        exported = version_components(args, ("backbone",))
        settings = exported.settings
        self.pool = kv_cache(settings, settings["n_layers"], int(parameters["max_sequences"]) + 1,  # + warm-up
                             block_size=int(parameters["kv_block_size"]),
                             capacity_blocks=int(parameters["kv_capacity_blocks"]),
                             idle_timeout_s=float(parameters["idle_timeout_s"]),
                             preallocate_slots=int(parameters["max_sequence_slots"]))
        engine = open_engine(exported, "backbone", parameters["engine"], int(parameters["threads"]))
        self.runner = BackboneRunner(engine, self.pool, settings["vocab_size"], settings["d_model"])
        self.guard = PipelineGuard(args, exported.checkpoint_id, parameters["deployment"])
        self._warm_up(settings["d_model"])
        self.metrics = _PoolMetrics({"model": args["model_name"], "deployment": parameters["deployment"]}, self.pool)
        pb_utils.Logger.log_info(f"{args['model_name']}: backbone of checkpoint {exported.checkpoint_id} on "
                                 f"{parameters['engine']}, KV pool {self.pool.capacity_blocks} blocks of "
                                 f"{self.pool.block_size} pair slots")

    def _warm_up(self, d_model):
        latents = np.zeros((9, d_model), np.float32)
        for batch in (BackboneBatch([-1], latents[:8], [8], [9], []), BackboneBatch([-1], latents[:1], [1], [0], [])):
            errors = [e for e in self.runner.run_batch(batch).errors if e]
            if errors:
                raise RuntimeError(f"backbone warm-up failed: {errors[0]}")
        self.pool.release(-1)

    def execute(self, requests):
        self.pool.evict_idle()
        responses = []
        for request in requests:
            refusal = self.guard.refuses(_input(request, "pipeline_key"))
            if refusal:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal)))
                continue
            inputs = {name: _input(request, name)
                      for name in ("latents", "sequence_ids", "new_latents", "reserve_slots", "release_ids")}
            try:
                result = self.runner.run_batch(BackboneBatch(
                    inputs["sequence_ids"].tolist(), inputs["latents"], inputs["new_latents"].tolist(),
                    inputs["reserve_slots"].tolist(),
                    [] if inputs["release_ids"] is None else inputs["release_ids"].tolist()))
            except Exception as error:  # noqa: BLE001 - a malformed batch fails alone
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("logits", result.logits), pb_utils.Tensor("hidden", result.hidden),
                pb_utils.Tensor("errors", np.asarray([e.encode() for e in result.errors], dtype=object))]))
        self.metrics.update()
        return responses


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class _PoolMetrics:
    def __init__(self, labels, pool):
        self.pool = pool
        self.families = [
            pb_utils.MetricFamily("dualend_kv_blocks_used", "KV cache blocks in use", pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("dualend_kv_blocks_free", "KV cache blocks free", pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("dualend_kv_live_sequences", "Sequences holding a KV cache",
                                  pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("dualend_sequences_evicted", "Sequences evicted after idling",
                                  pb_utils.MetricFamily.COUNTER),
        ]
        self.used, self.free, self.live, self.evicted = (f.Metric(labels=labels) for f in self.families)
        self.reported = (None, None, None, 0)
        self.update()

    def update(self):
        """Only what changed: each metric call is a round trip to the server process."""
        now = (self.pool.used_blocks, self.pool.free_blocks, len(self.pool.sequences), self.pool.evicted_total)
        for metric, before, value in zip((self.used, self.free, self.live), self.reported, now):
            if value != before:
                metric.set(value)
        if now[3] != self.reported[3]:
            self.evicted.increment(now[3] - self.reported[3])
        self.reported = now
