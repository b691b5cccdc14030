"""Triton adapter: owns a request from prefill to release and streams its tokens.

Decoupled: each request runs in its own thread; at most max_concurrent_requests run, up to
max_queue_size more wait (queue_wait_s at most) for a place. A running request drives
the backbone model over BLS (sequence START / steps / END under one correlation id), runs the
MTP head and the confidence gate in-process, and sends exactly one FINAL response per request,
also after an error or a cancellation.

Triton 2.51 does not pass a client's cancellation of an ensemble on to a step that is already
running; it marks the ensemble's next step requests (postprocessing) as cancelled instead. So
every response carries `request_id`, and postprocessing, on seeing a cancelled request, sends
this model a control request `{"cancel": request_id}` over BLS; the decode loop checks for it
at every step.
"""
import itertools
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.decode import BackboneOutput, CapacityError, InvalidRequest, stream_chunks
from dualend.manifest import verify_component, verify_siblings
from dualend.onnx_engine import MTPComponent
from dualend.serving import (Admission, Cancelled, PreparedRequest, model_parameters, resolve_threshold, responses,
                             version_components)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
CAPACITY_MARK = "KV cache full"


class BackboneChanged(RuntimeError):
    """The backbone serves another checkpoint, or lost this sequence (reloaded, or evicted after
    idling): the request ends with this message and the caller may retry."""


SEQUENCE_LOST_MARKS = ("holds no KV cache", "must specify the START flag")


class BLSBackboneSession:
    """The decode loop's backbone, reached over BLS; one correlation id per request."""

    def __init__(self, model_name, correlation_id, d_model, capacity_wait_s, is_cancelled, checkpoint_id):
        self.model_name, self.correlation_id, self.d_model = model_name, correlation_id, d_model
        self.checkpoint_id = checkpoint_id
        self.capacity_wait_s, self.is_cancelled = capacity_wait_s, is_cancelled
        self.start_sent = False

    def _call(self, latents, flags, reserve=0):
        outputs = ["logits", "hidden", "checkpoint_id"] if flags & START else ["logits", "hidden"]
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, requested_output_names=outputs,
            inputs=[pb_utils.Tensor("latents", np.ascontiguousarray(latents[None], dtype=np.float32)),
                    pb_utils.Tensor("reserve_slots", np.asarray([[reserve]], dtype=np.int32))],
            correlation_id=self.correlation_id, flags=flags)
        response = request.exec()
        if response.has_error():
            message = response.error().message()
            raise (CapacityError if CAPACITY_MARK in message else RuntimeError)(message)
        if flags & START:
            served = pb_utils.get_output_tensor_by_name(response, "checkpoint_id").as_numpy()[0][0].decode()
            if served != self.checkpoint_id:
                raise BackboneChanged(
                    f"checkpoint mismatch: {self.model_name} serves checkpoint {served}, this deployment's "
                    f"MTP head and compressor are {self.checkpoint_id}; a model reload is under way, retry")
        logits, hidden = (pb_utils.get_output_tensor_by_name(response, n).as_numpy()[0] for n in ("logits", "hidden"))
        return BackboneOutput(logits, hidden)

    def prefill(self, latents, reserve_slots):
        deadline = time.monotonic() + self.capacity_wait_s
        while True:
            try:
                self.start_sent = True
                return self._call(latents, START, reserve_slots)
            except CapacityError:
                if time.monotonic() > deadline:
                    raise
                if self.is_cancelled():
                    raise Cancelled() from None
                time.sleep(0.05)

    def step(self, latent):
        if self.is_cancelled():
            raise Cancelled()
        try:
            return self._call(latent[None], 0)
        except RuntimeError as error:
            if any(mark in str(error) for mark in SEQUENCE_LOST_MARKS):
                raise BackboneChanged(f"{self.model_name} lost this stream's sequence (the model was reloaded, "
                                      f"or it evicted the sequence after idling); the stream ends here, "
                                      f"retry: {error}") from None
            raise

    def close(self):
        # Also after a refused START: END frees the sequence batcher's slot (release of an unknown
        # sequence is a no-op in the backbone).
        if self.start_sent:
            self.start_sent = False
            try:
                self._call(np.zeros((1, self.d_model), np.float32), END)
            except Exception as error:  # noqa: BLE001 - the request's own outcome matters more; idle eviction frees it
                pb_utils.Logger.log_warn(f"releasing sequence {self.correlation_id} failed: {error}")


class TritonComponents:
    """In-process compressor and MTP head, backbone over BLS: what the decode loop needs."""

    def __init__(self, local, open_backbone):
        self.local, self.open_backbone = local, open_backbone
        self.pair_size, self.pad_id = local.pair_size, local.pad_id
        self.eos_id, self.bos_id = local.eos_id, local.bos_id

    def compress(self, tokens):
        return self.local.compress(tokens)

    def open_mtp(self, max_steps):
        return self.local.open_mtp(max_steps)


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        deployment = parameters["deployment"]
        self.pair_size = int(parameters["pair_size"])
        names = ("tokenizer", "compressor", "mtp") if self.pair_size == 2 else ("tokenizer", "compressor")
        exported = version_components(args, names)
        backbone_dir = Path(args["model_repository"]).parent / f"{deployment}_backbone"
        backbone_manifest = verify_component(_latest_version(backbone_dir) / "backbone")
        self.checkpoint_id = verify_siblings([*exported.manifests.values(), backbone_manifest])
        self.local = MTPComponent(exported)
        self.tokenizer = exported.tokenizer()
        self.d_model = exported.settings["d_model"]
        self.threshold = float(parameters["acceptance_threshold"])
        self.backbone_model = f"{deployment}_backbone"
        self.capacity_wait_s = float(parameters["capacity_wait_s"])
        self.admission = Admission(int(parameters["max_concurrent_requests"]), int(parameters["max_queue_size"]),
                                   float(parameters["queue_wait_s"]))
        self.ids = itertools.count(((os.getpid() & 0xFFFF) << 32) + 1)  # also the backbone correlation ids
        self.cancelled_ids, self.in_flight = set(), set()
        self.stopping = threading.Event()
        self.metrics = _DecodeMetrics(args["model_name"])
        self._warm_up()
        mode = (f"dual-end: compressor + MTP head, acceptance_threshold {self.threshold}"
                if self.pair_size == 2 else "token-level baseline, one token per step")
        pb_utils.Logger.log_info(
            f"{args['model_name']}: checkpoint {self.checkpoint_id}; {mode}; components "
            + ", ".join(f"{m.component} ({m.format})" for m in [*exported.manifests.values(), backbone_manifest]))

    def _warm_up(self):
        latents = self.local.compress(np.full((1, self.pair_size), self.local.bos_id, np.int64))
        if self.local.mtp is not None:
            session = self.local.open_mtp(1)
            session.step(self.local.bos_id, latents[0], 0)
            session.close()

    def execute(self, requests):
        for request in requests:
            control = json.loads(pb_utils.get_input_tensor_by_name(request, "request_params").as_numpy()[0])
            if "cancel" in control:
                if int(control["cancel"]) in self.in_flight:
                    self.cancelled_ids.add(int(control["cancel"]))
                request.get_response_sender().send(flags=FINAL)
                continue
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        request_id = next(self.ids)
        self.in_flight.add(request_id)
        chunks, final_sent, admitted = None, False, False

        def is_cancelled():
            return request_id in self.cancelled_ids or self.stopping.is_set() or sender.is_cancelled()
        try:
            self.admission.acquire(is_cancelled)
            admitted = True
            prepared = PreparedRequest.from_json(
                pb_utils.get_input_tensor_by_name(request, "request_params").as_numpy()[0].decode())
            prompt_latents = pb_utils.get_input_tensor_by_name(request, "prompt_latents").as_numpy()
            threshold = resolve_threshold(prepared.params.acceptance_threshold, self.threshold)
            components = TritonComponents(self.local, lambda: BLSBackboneSession(
                self.backbone_model, request_id, self.d_model, self.capacity_wait_s, is_cancelled,
                self.checkpoint_id))
            started = time.monotonic()
            chunks = stream_chunks(components, self.tokenizer, prepared.prompt_ids, prepared.params, threshold,
                                   prompt_latents=prompt_latents)
            for response in responses(chunks, prepared, len(prompt_latents)):
                self.metrics.record(response, time.monotonic() - started)
                started = time.monotonic()
                final = response.finish_reason is not None
                outputs = [pb_utils.Tensor(k, v) for k, v in response.arrays().items()]
                outputs.append(pb_utils.Tensor("request_id", np.asarray([request_id], dtype=np.uint64)))
                sender.send(pb_utils.InferenceResponse(outputs), flags=FINAL if final else 0)
                final_sent = final
        except Cancelled:
            self.metrics.cancel()
        except (InvalidRequest, CapacityError, BackboneChanged) as error:
            sender.send(_error(str(error)), flags=FINAL)
            final_sent = True
        except Exception as error:  # noqa: BLE001 - every request must end with a FINAL response
            pb_utils.Logger.log_error(f"request failed: {error!r}")
            sender.send(_error(f"internal error: {error}"), flags=FINAL)
            final_sent = True
        finally:
            try:
                if chunks is not None:
                    chunks.close()
                if not final_sent:
                    sender.send(flags=FINAL)
            finally:
                self.in_flight.discard(request_id)
                self.cancelled_ids.discard(request_id)
                if admitted:
                    self.admission.release()

    def finalize(self):
        self.stopping.set()  # in-flight requests stop at their next step and send their FINAL
        deadline = time.monotonic() + 10
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)


def _latest_version(model_dir):
    versions = sorted((p for p in model_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return versions[-1]


def _error(message):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


class _DecodeMetrics:
    def __init__(self, model_name):
        labels = {"model": model_name}
        spec = [("dualend_output_tokens", "Tokens streamed to clients"),
                ("dualend_decode_steps", "Backbone decode steps"),
                ("dualend_drafts_proposed", "MTP drafts proposed"),
                ("dualend_drafts_accepted", "MTP drafts accepted by the confidence gate"),
                ("dualend_prompt_raw_tokens", "Prompt tokens as users count them"),
                ("dualend_prompt_latents", "Prompt latents the backbone held"),
                ("dualend_generation_seconds", "Time spent producing responses (prefill + decode)")]
        self.families = [pb_utils.MetricFamily(n, d, pb_utils.MetricFamily.COUNTER) for n, d in spec]
        self.counters = {n: f.Metric(labels=labels) for (n, _), f in zip(spec, self.families)}
        self.families.append(pb_utils.MetricFamily("dualend_requests_cancelled", "Requests cancelled by the client",
                                                   pb_utils.MetricFamily.COUNTER))
        self.cancelled = self.families[-1].Metric(labels=labels)
        self.lock = threading.Lock()

    def record(self, response, seconds):
        with self.lock:  # the stub's metric calls are not thread-safe (concurrent calls crash the server)
            self._record(response, seconds)

    def cancel(self):
        with self.lock:
            self.cancelled.increment(1)

    def _record(self, response, seconds):
        c = response.counters
        for name, key in (("dualend_output_tokens", "num_output_tokens"), ("dualend_decode_steps", "num_steps"),
                          ("dualend_drafts_proposed", "num_drafts"),
                          ("dualend_drafts_accepted", "num_accepted_drafts")):
            self.counters[name].increment(c[key])
        if response.finish_reason is not None:
            self.counters["dualend_prompt_raw_tokens"].increment(c["num_prompt_tokens"])
            self.counters["dualend_prompt_latents"].increment(c["num_prompt_latents"])
        self.counters["dualend_generation_seconds"].increment(seconds)
