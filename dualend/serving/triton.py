"""What the Triton adapters hand to Triton, with no Triton import: each class takes the python
backend's `pb_utils` module as an argument (only the adapters import `triton_python_backend_utils`),
so tests drive them with a fake."""
from __future__ import annotations

import time

import numpy as np

from dualend.engine.onnx_engine import BackboneBatch, BackboneResult, SequenceStatus

from .contract import Response
from .keys import response_token
from .metrics import COUNTERS, GAUGES, HISTOGRAMS, REFUSAL_REASONS, REFUSALS, PhaseMetrics
from .outcomes import DISPOSITIONS, Outcome, outcome_of, tagged
from .preemption import PreemptSender


def input_arrays(pb_utils, request, names) -> dict:
    """A request's inputs by name as numpy arrays, None for one it does not carry."""
    tensors = {name: pb_utils.get_input_tensor_by_name(request, name) for name in names}
    return {name: None if tensor is None else tensor.as_numpy() for name, tensor in tensors.items()}


def tensors(pb_utils, arrays: dict) -> list:
    return [pb_utils.Tensor(name, array) for name, array in arrays.items()]


def error_response(pb_utils, outcome: Outcome, message: str):
    """An error response whose message leads with the outcome's code (outcomes.tagged)."""
    code = (pb_utils.TritonError.INVALID_ARG,) if DISPOSITIONS[outcome].invalid_argument else ()
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(tagged(outcome, message), *code))


# One backbone call over BLS: the request's tensors (their order is the model config's) and the answer's.
BACKBONE_INPUTS = ("latents", "sequence_ids", "new_latents", "reserve_slots", "release_ids", "keep_ids", "reuse_ids",
                   "reuse_slots", "discard_slots", "verify", "preempt_id")
BACKBONE_OUTPUTS = ("logits", "hidden", "status", "messages", "verify_logits", "verify_hidden")
_BATCH_LISTS = {"sequence_ids": ("sequence_ids", np.int64), "new_latents": ("counts", np.int32),
                "reserve_slots": ("reserve_slots", np.int32), "release_ids": ("releases", np.int64),
                "keep_ids": ("keeps", np.int64), "reuse_ids": ("reuse_ids", np.int64),
                "reuse_slots": ("reuse_slots", np.int32), "discard_slots": ("discard", np.int32)}
_ALWAYS_SENT = ("sequence_ids", "new_latents", "reserve_slots")  # the others only when they hold something


def backbone_request_arrays(batch: BackboneBatch) -> dict[str, np.ndarray]:
    """A batch as the backbone model's input tensors."""
    arrays = {"latents": np.ascontiguousarray(batch.latents, dtype=np.float32)}   # [n, D]
    for name, (field, dtype) in _BATCH_LISTS.items():
        values = getattr(batch, field)
        if values or name in _ALWAYS_SENT:
            arrays[name] = np.asarray(values, dtype=dtype)
    if batch.verify:
        arrays["verify"] = np.asarray([True])
    if batch.preempt_id:
        arrays["preempt_id"] = np.asarray([batch.preempt_id], dtype=np.int64)
    return arrays


def backbone_batch(arrays: dict[str, np.ndarray | None]) -> BackboneBatch:
    """The backbone model's input tensors (None where absent) as a batch."""
    lists = {field: [] if arrays[name] is None else arrays[name].tolist()
             for name, (field, _) in _BATCH_LISTS.items()}
    verify, preempt_id = arrays.get("verify"), arrays.get("preempt_id")
    return BackboneBatch(latents=arrays["latents"], verify=verify is not None and bool(verify.any()),
                         preempt_id=0 if preempt_id is None else int(preempt_id[0]), **lists)


def backbone_response_arrays(result: BackboneResult) -> dict[str, np.ndarray]:
    """Without verify outputs (a batch that did not ask), those two are empty: [0, V] and [0, D]."""
    verify = result.verify_logits is not None
    return {"logits": result.logits, "hidden": result.hidden, "status": np.asarray(result.status, np.int32),
            "messages": np.asarray([m.encode() for m in result.messages], dtype=object),
            "verify_logits": result.verify_logits if verify else result.logits[:0],
            "verify_hidden": result.verify_hidden if verify else result.hidden[:0]}


def backbone_result(arrays: dict[str, np.ndarray]) -> BackboneResult:
    verify = len(arrays["verify_logits"]) == len(arrays["logits"]) and len(arrays["logits"]) > 0
    return BackboneResult(arrays["logits"], arrays["hidden"], [SequenceStatus(s) for s in arrays["status"].tolist()],
                          [m.decode() for m in arrays["messages"]],
                          arrays["verify_logits"] if verify else None, arrays["verify_hidden"] if verify else None)


class BLSBackbone:
    """The deployment's backbone model, one BLS request per loop iteration. The pipeline key names
    this checkpoint, so a backbone of another one refuses the call. `preempt` gives up a step in
    flight (`serving.preemption`)."""

    def __init__(self, pb_utils, model_name: str, secret: str):
        self.pb_utils, self.model_name = pb_utils, model_name
        self.pipeline_key = np.asarray([secret.encode()], dtype=object)
        self.preempter = PreemptSender(model_name, secret)

    def preempt(self, preempt_id: int) -> None:
        self.preempter.preempt(preempt_id)

    def run_batch(self, batch):
        pb = self.pb_utils
        inputs = backbone_request_arrays(batch) | {"pipeline_key": self.pipeline_key}
        response = pb.InferenceRequest(model_name=self.model_name, inputs=tensors(pb, inputs),
                                       requested_output_names=list(BACKBONE_OUTPUTS)).exec()
        if response.has_error():
            raise RuntimeError(f"{self.model_name}: {outcome_of(response.error().message())[1]}")
        return backbone_result({name: pb.get_output_tensor_by_name(response, name).as_numpy()
                                for name in BACKBONE_OUTPUTS})


class ResponseSenderOutput:
    """One request's answers through its Triton response sender (a `loop.Output`), each with
    postprocessing's token for its request id and token ids."""

    def __init__(self, pb_utils, sender, request_id: int, secret: str):
        self.pb_utils, self.sender, self.secret, self.id = pb_utils, sender, secret, request_id
        self.request_id = np.asarray([request_id], dtype=np.uint64)
        self.final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def send(self, response: Response) -> None:
        arrays = response.arrays()
        token = response_token(self.secret, self.id, arrays["output_ids"])
        arrays |= {"request_id": self.request_id, "response_key": np.asarray([token.encode()], dtype=object)}
        self.sender.send(self.pb_utils.InferenceResponse(tensors(self.pb_utils, arrays)),
                         flags=self.final if response.finish_reason else 0)

    def fail(self, message: str, outcome: Outcome) -> None:
        self.sender.send(error_response(self.pb_utils, outcome, message), flags=self.final)

    def end(self) -> None:
        self.sender.send(flags=self.final)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class TritonMetrics(PhaseMetrics):
    """The loop's metrics pushed to Triton (`pb_utils.MetricFamily`) at most every PUSH_EVERY_S, and
    when the loop goes idle: one call per changed counter, bucket and gauge, however many tokens went
    out in between."""

    PUSH_EVERY_S = 0.5

    def __init__(self, pb_utils, labels: dict[str, str]):
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

    def flush(self, idle: bool, running: int, waiting: int, kv_usage: float = 0.0, kept: int = 0) -> None:
        super().flush(idle, running, waiting, kv_usage, kept)
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
