"""Triton adapter: the stateful backbone engine behind a sequence batcher.

One request per sequence step, keyed by correlation id: START prefills the prompt latents
(reserving KV for `reserve_slots` pairs), END releases the sequence, anything else is one
decode step; the decode steps of one execute() call run as one batch. The prefill response names
the checkpoint this backbone serves, so a caller from another checkpoint (mid-reload) can refuse it;
a sequence then stays on this copy of the model or is lost with it.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engines import open_engine
from dualend.kv_pool import KVPool
from dualend.onnx_engine import BackboneRunner, kv_slot_shape
from dualend.serving import model_parameters, version_components

START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        exported = version_components(args, ("backbone",))
        settings = exported.settings
        self.pool = KVPool(kv_slot_shape(settings, settings["n_layers"]),
                           block_size=int(parameters["kv_block_size"]),
                           capacity_blocks=int(parameters["kv_capacity_blocks"]),
                           idle_timeout_s=float(parameters["idle_timeout_s"]))
        engine = open_engine(exported, "backbone", parameters["engine"], int(parameters["threads"]))
        self.runner = BackboneRunner(engine, self.pool)
        self.checkpoint_id = np.asarray([[exported.checkpoint_id.encode()]], dtype=object)
        self._warm_up(settings["d_model"])
        self.metrics = _PoolMetrics(args["model_name"], self.pool)
        pb_utils.Logger.log_info(f"{args['model_name']}: backbone of checkpoint {exported.checkpoint_id} on "
                                 f"{parameters['engine']}, KV pool {self.pool.capacity_blocks} blocks of "
                                 f"{self.pool.block_size} pair slots")

    def _warm_up(self, d_model):
        warm_id = -1
        self.runner.prefill(warm_id, np.zeros((8, d_model), np.float32), 9)
        self.runner.step([warm_id], np.zeros((1, d_model), np.float32))
        self.runner.release(warm_id)

    def execute(self, requests):
        self.pool.evict_idle()
        responses = [None] * len(requests)
        steps = []
        for index, request in enumerate(requests):
            seq_id, flags = request.correlation_id(), request.flags()
            latents = pb_utils.get_input_tensor_by_name(request, "latents").as_numpy()[0]  # [S, D]
            try:
                if flags & START:
                    reserve = int(pb_utils.get_input_tensor_by_name(request, "reserve_slots").as_numpy().item())
                    responses[index] = _outputs(self.runner.prefill(seq_id, latents, reserve), self.checkpoint_id)
                elif flags & END:
                    self.runner.release(seq_id)
                    responses[index] = _outputs(None)
                else:
                    self.pool.get(seq_id)  # an unknown sequence fails alone, not the whole batch
                    steps.append((index, seq_id, latents[-1]))
            except Exception as error:  # noqa: BLE001 - one request's failure is that request's error
                responses[index] = _error(error)
        if steps:
            try:
                outputs = self.runner.step([s for _, s, _ in steps], np.stack([x for _, _, x in steps]))
                for (index, _, _), out in zip(steps, outputs):
                    responses[index] = _outputs(out)
            except Exception as error:  # noqa: BLE001
                for index, _, _ in steps:
                    responses[index] = _error(error)
        self.metrics.update()
        return responses


def _outputs(out, checkpoint_id=None):
    if out is None:
        logits, hidden = np.zeros((1, 0), np.float32), np.zeros((1, 0), np.float32)
    else:
        logits, hidden = out.logits[None], out.hidden[None]
    tensors = [pb_utils.Tensor("logits", logits), pb_utils.Tensor("hidden", hidden)]
    if checkpoint_id is not None:
        tensors.append(pb_utils.Tensor("checkpoint_id", checkpoint_id))
    return pb_utils.InferenceResponse(tensors)


def _error(error):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error).strip("'\"")))


class _PoolMetrics:
    def __init__(self, model_name, pool):
        self.pool, labels = pool, {"model": model_name}
        self.families = [
            pb_utils.MetricFamily("dualend_kv_blocks_used", "KV cache blocks in use", pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("dualend_kv_blocks_free", "KV cache blocks free", pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("dualend_kv_live_sequences", "Sequences holding a KV cache",
                                  pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("dualend_sequences_evicted", "Sequences evicted after idling",
                                  pb_utils.MetricFamily.COUNTER),
        ]
        self.used, self.free, self.live, self.evicted = (f.Metric(labels=labels) for f in self.families)
        self.evicted_reported = 0
        self.update()

    def update(self):
        self.used.set(self.pool.used_blocks)
        self.free.set(self.pool.free_blocks)
        self.live.set(len(self.pool.sequences))
        self.evicted.increment(self.pool.evicted_total - self.evicted_reported)
        self.evicted_reported = self.pool.evicted_total
