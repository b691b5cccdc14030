"""Triton adapter: hands each request to the deployment's one batched decode loop.

`execute` only parses a request and submits it; one thread runs `batch_loop.DecodeLoop`, which
batches every live sequence into one backbone call per iteration (over BLS, to this deployment's
backbone model), runs the MTP head and confidence gate in-process, and answers through each
request's response sender (from a `SendThread`, so the sends overlap the next backbone call):
exactly one FINAL response per request, also after an error or a cancellation.

Triton 2.51 does not pass a client's cancellation of an ensemble on to a step that is already
running; it marks the ensemble's next step requests (postprocessing) as cancelled instead. So
every response carries `request_id`, and postprocessing, on seeing a cancelled request, sends
this model a control request `{"cancel": request_id}` over BLS. The launcher, on SIGTERM, sends
`{"drain": true}`: every stream ends at once with SHUTDOWN_MESSAGE and new requests are refused.
Every request carries a `pipeline_key`: the compressor's token for its parameters and prompt latents,
or, for a control request, the pipeline's secret alone (`serving.PipelineGuard`); every response
carries postprocessing's token for its request id and token ids (`response_key`).
"""
import json
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.decode import InvalidRequest
from dualend.engine.manifest import verify_component, verify_siblings
from dualend.engine.onnx_engine import BackboneResult, MTPComponent
from dualend.engine.scheduler import Scheduler
from dualend.serving.contract import PreparedRequest
from dualend.serving.keys import PipelineGuard, latents_token, response_token
from dualend.serving.loop import DecodeLoop, Executor, QueuedOutput, SendThread
from dualend.serving.metrics import COUNTERS, GAUGES, HISTOGRAMS, REFUSAL_REASONS, REFUSALS, PhaseMetrics
from dualend.serving.repository import model_parameters, version_components

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SHUTDOWN_MESSAGE = "the server is shutting down; the stream ends here, retry"


class BLSBackbone:
    """The deployment's backbone model, one BLS request per loop iteration. The pipeline key names
    this checkpoint, so a backbone of another one refuses the call."""

    def __init__(self, model_name, secret):
        self.model_name = model_name
        self.pipeline_key = np.asarray([secret.encode()], dtype=object)

    def run_batch(self, batch):
        inputs = [pb_utils.Tensor("latents", np.ascontiguousarray(batch.latents, dtype=np.float32)),
                  pb_utils.Tensor("sequence_ids", np.asarray(batch.sequence_ids, dtype=np.int64)),
                  pb_utils.Tensor("new_latents", np.asarray(batch.counts, dtype=np.int32)),
                  pb_utils.Tensor("reserve_slots", np.asarray(batch.reserve_slots, dtype=np.int32)),
                  pb_utils.Tensor("pipeline_key", self.pipeline_key)]
        if batch.releases:
            inputs.append(pb_utils.Tensor("release_ids", np.asarray(batch.releases, dtype=np.int64)))
        response = pb_utils.InferenceRequest(
            model_name=self.model_name, inputs=inputs,
            requested_output_names=["logits", "hidden", "errors"]).exec()
        if response.has_error():
            raise RuntimeError(f"{self.model_name}: {response.error().message()}")
        out = {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy()
               for name in ("logits", "hidden", "errors")}
        return BackboneResult(out["logits"], out["hidden"], [e.decode() for e in out["errors"]])


class ResponseSenderOutput:
    """One request's answers through its Triton response sender, each with postprocessing's token."""

    def __init__(self, sender, request_id, secret):
        self.sender, self.secret, self.id = sender, secret, request_id
        self.request_id = np.asarray([request_id], dtype=np.uint64)

    def send(self, response):
        arrays = response.arrays()
        outputs = [pb_utils.Tensor(k, v) for k, v in arrays.items()]
        token = response_token(self.secret, self.id, arrays["output_ids"])
        outputs += [pb_utils.Tensor("request_id", self.request_id),
                    pb_utils.Tensor("response_key", np.asarray([token.encode()], dtype=object))]
        self.sender.send(pb_utils.InferenceResponse(outputs), flags=FINAL if response.finish_reason else 0)

    def fail(self, message):
        self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    def end(self):
        self.sender.send(flags=FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        deployment = parameters["deployment"]
        pair_size = int(parameters["pair_size"])
        names = ("tokenizer", "compressor", "mtp") if pair_size == 2 else ("tokenizer", "compressor")
        exported = version_components(args, names)
        backbone = f"{parameters['pipeline']}_backbone"  # the backbone of this generation of the pipeline
        backbone_manifest = verify_component(Path(args["model_repository"]).parent / backbone / "1" / "backbone")
        checkpoint_id = verify_siblings([*exported.manifests.values(), backbone_manifest])
        local = MTPComponent(exported, max_sequences=int(parameters["max_concurrent_requests"]),
                             preallocate_slots=int(parameters["max_sequence_slots"]))
        self.threshold = float(parameters["acceptance_threshold"])
        self.guard = PipelineGuard(args, checkpoint_id, deployment)
        scheduler = Scheduler(
            max_running=int(parameters["max_concurrent_requests"]), max_queue=int(parameters["max_queue_size"]),
            wait_s=float(parameters["queue_wait_s"]), prefill_chunk=int(parameters["prefill_chunk_latents"]),
            kv_blocks=int(parameters["kv_capacity_blocks"]), kv_block_size=int(parameters["kv_block_size"]))
        self.metrics = _TritonMetrics({"model": args["model_name"], "deployment": deployment})
        executor = Executor(BLSBackbone(backbone, self.guard.secret), local,
                            exported.settings["d_model"])
        self.loop = DecodeLoop(executor, exported.tokenizer(), scheduler, self.threshold, self.metrics)
        self.sends = SendThread(pb_utils.Logger.log_warn)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop.serve_forever, args=(self.stopping,), daemon=True)
        self.thread.start()
        mode = (f"dual-end: compressor + MTP head, acceptance_threshold {self.threshold}"
                if pair_size == 2 else "token-level baseline, one token per step")
        pb_utils.Logger.log_info(
            f"{args['model_name']}: checkpoint {checkpoint_id}; {mode}; one batched decode loop for up to "
            f"{scheduler.max_running} sequences; components "
            + ", ".join(f"{m.component} ({m.format})" for m in [*exported.manifests.values(), backbone_manifest]))

    def execute(self, requests):
        for request in requests:
            raw_params = bytes(pb_utils.get_input_tensor_by_name(request, "request_params").as_numpy()[0])
            sender = request.get_response_sender()
            request_id = secrets.randbits(63)  # also the backbone's sequence id: not guessable
            output = ResponseSenderOutput(sender, request_id, self.guard.secret)
            key = pb_utils.get_input_tensor_by_name(request, "pipeline_key")
            prompt_latents = pb_utils.get_input_tensor_by_name(request, "prompt_latents").as_numpy()
            try:
                control = json.loads(raw_params)
            except ValueError:
                control = None
            is_control = isinstance(control, dict) and ("cancel" in control or "drain" in control)
            refusal = self.guard.refuses(None if key is None else key.as_numpy(), None if is_control else
                                         latents_token(self.guard.secret, raw_params, prompt_latents))
            if refusal:  # a control message takes the secret alone; a generation, the compressor's token
                output.fail(refusal)
                continue
            if is_control:
                self._control(control)
                sender.send(flags=FINAL)
                continue
            try:
                prepared = PreparedRequest.from_dict(control)  # parsed once, above
            except (InvalidRequest, KeyError, TypeError, ValueError) as error:
                output.fail(f"malformed request: {error}")
                continue
            self.loop.submit(request_id, prepared, prompt_latents, QueuedOutput(output, self.sends))
        return None

    def _control(self, control):
        if "cancel" in control:
            self.loop.cancel(int(control["cancel"]))
        if control.get("drain"):
            self.loop.drain(SHUTDOWN_MESSAGE)  # and every request after it

    def finalize(self):
        self.loop.drain(SHUTDOWN_MESSAGE)  # the loop's own thread ends every request
        deadline = time.monotonic() + 10
        while self.loop.live and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stopping.set()
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close(SHUTDOWN_MESSAGE)  # what arrived after the drain
        if not self.sends.close(timeout_s=5):
            pb_utils.Logger.log_warn("mtp_verify: responses still queued at shutdown after 5 s; they are lost")


class _TritonMetrics(PhaseMetrics):
    """The loop's metrics pushed to Triton at most every PUSH_EVERY_S, and when the loop goes idle:
    one call per changed counter, bucket and gauge, however many tokens went out in between."""

    PUSH_EVERY_S = 0.5

    def __init__(self, labels):
        super().__init__()
        kinds, self.families, self.metrics = pb_utils.MetricFamily, [], {}

        def family(name, description, kind):
            self.families.append(kinds(name, description, kind))  # referenced, or its metrics raise
            return self.families[-1]

        for name, description in COUNTERS.items():
            self.metrics[name] = family(name, description, kinds.COUNTER).Metric(labels=labels)
        for name, description in GAUGES.items():
            self.metrics[name] = family(name, description, kinds.GAUGE).Metric(labels=labels)
        for name, (description, bounds) in HISTOGRAMS.items():
            buckets = family(f"{name}_bucket", f"{description} (cumulative buckets)", kinds.COUNTER)
            self.metrics[name] = ([buckets.Metric(labels=labels | {"le": f"{b:g}"}) for b in bounds]
                                  + [buckets.Metric(labels=labels | {"le": "+Inf"})],
                                  family(f"{name}_sum", description, kinds.COUNTER).Metric(labels=labels),
                                  family(f"{name}_count", description, kinds.COUNTER).Metric(labels=labels))
        refusals = family(*REFUSALS, kinds.COUNTER)
        self.refusal_metrics = {r: refusals.Metric(labels=labels | {"reason": r}) for r in REFUSAL_REASONS}
        self.pushed = time.monotonic()

    def flush(self, idle, running, waiting):
        super().flush(idle, running, waiting)
        if not idle and time.monotonic() - self.pushed < self.PUSH_EVERY_S:
            return
        self.pushed = time.monotonic()
        delta = self.take()
        for name, value in delta.counters.items():
            if value:
                self.metrics[name].increment(value)
        for name, histogram in delta.histograms.items():
            if histogram.counts[-1]:
                buckets, total, count = self.metrics[name]
                for bucket, value in zip(buckets, histogram.counts):
                    if value:
                        bucket.increment(value)
                total.increment(histogram.total)
                count.increment(histogram.counts[-1])
        for name, value in delta.gauges.items():
            self.metrics[name].set(value)
        for reason, value in delta.refusals.items():
            if value:
                self.refusal_metrics[reason].increment(value)
