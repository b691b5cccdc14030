"""mtp_verify's core: a deployment's one decode loop on its own thread, and what each request to
mtp_verify does with it (a generation is submitted, a control request cancels or drains), with no
Triton import.

Every request carries a `pipeline_key`: a generation the compressor's token for its parameters and
prompt latents (`keys.latents_token`), a control request the pipeline's secret alone
(`control.py`); anything else gets the pipeline's refusal and never reaches the loop.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from dualend.engine.decode import InvalidRequest
from dualend.engine.onnx_engine import ExportedModel, MTPComponent
from dualend.engine.prefix_cache import PrefixCache
from dualend.engine.scheduler import Scheduler

from .contract import PreparedRequest
from .control import CANCEL, DRAIN, read_control
from .keys import PipelineGuard, latents_token
from .loop import Backbone, DecodeLoop, Executor, Output, QueuedOutput, SendThread
from .metrics import PhaseMetrics
from .outcomes import Outcome
from .repository import DeploymentConfig

SHUTDOWN_MESSAGE = "the server is shutting down; the stream ends here, retry"
# A backbone call (one iteration: every decoding sequence, at most prefill_chunk_latents of prompt)
# that takes longer than this is a hung step: its requests end with a retryable error.
BACKBONE_CALL_TIMEOUT_S = 10.0
# A shorter shared prefix (a BOS, a chat template's first tokens) is prefilled rather than copied.
MIN_PREFIX_REUSE = 8
INPUTS = ("prompt_latents", "request_params", "pipeline_key", "control", "cancel_id")  # mtp_verify's


class DecodeService:
    def __init__(self, config: DeploymentConfig, exported: ExportedModel, backbone: Backbone, guard: PipelineGuard,
                 metrics: PhaseMetrics, log_warning):
        local = MTPComponent(exported, max_sequences=config.max_concurrent_requests, engine_threads=config.engine_threads,
                             **config.kv_cache_options())
        self.scheduler = Scheduler(
            max_running=config.max_concurrent_requests, max_queue=config.max_queue_size, wait_s=config.queue_wait_s,
            prefill_chunk=config.prefill_chunk_latents, kv_blocks=config.kv_capacity_blocks,
            kv_block_size=config.kv_block_size,
            fair_rows=config.fair_rows_per_client, fair_linger_s=config.fair_linger_s,
            prefix_cache=PrefixCache(config.prefix_cache_entries, config.prefix_cache_ttl_s, MIN_PREFIX_REUSE)
            if config.prefix_cache_entries else None)
        executor = Executor(backbone, local, exported.settings["d_model"], call_timeout_s=BACKBONE_CALL_TIMEOUT_S)
        metrics.synthetic_acceptance(config.synthetic_rate)
        self.loop = DecodeLoop(executor, exported.tokenizer(), self.scheduler, config.acceptance_threshold, metrics,
                               synthetic_acceptance=config.synthetic_rate, draft_max_batch=config.draft_max_batch,
                               draft_min_acceptance=config.draft_min_acceptance, log_error=log_warning)
        self.guard, self.sends = guard, SendThread(log_warning)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop.serve_forever, args=(self.stopping,), daemon=True)
        self.thread.start()

    def handle(self, request_id: int, inputs: dict[str, np.ndarray | None], output: Output) -> None:
        """One request's inputs (by name, None when absent; `INPUTS`); `request_id` is the new
        request's, and its backbone sequence id."""
        control = inputs["control"] is not None
        token = None
        if not control and inputs["prompt_latents"] is not None and inputs["request_params"] is not None:
            token = latents_token(self.guard.secret, _params(inputs), inputs["prompt_latents"])
        refusal = self.guard.refuses(inputs["pipeline_key"], token)
        if refusal:  # a control request takes the secret alone; a generation, the compressor's token
            output.fail(refusal, Outcome.NOT_ALLOWED)
            return
        try:
            if control:
                self._control(inputs)
                output.end()
                return
            if inputs["prompt_latents"] is None or inputs["request_params"] is None:
                raise InvalidRequest("a generation needs prompt_latents and request_params")
            prepared = PreparedRequest.from_json(_params(inputs))
        except (InvalidRequest, KeyError, TypeError, ValueError) as error:
            output.fail(f"malformed request: {error}", Outcome.BAD_REQUEST)
            return
        self.loop.submit(request_id, prepared, inputs["prompt_latents"], QueuedOutput(output, self.sends))

    def _control(self, inputs: dict) -> None:
        control = read_control(inputs["control"], inputs["cancel_id"])
        if control.action == CANCEL:
            self.loop.cancel(control.request_id)
        elif control.action == DRAIN:
            self.loop.drain(SHUTDOWN_MESSAGE)  # and every request after it

    def stop(self) -> bool:
        """Ends every request, then the loop; False when responses were still queued after 5 s."""
        self.loop.drain(SHUTDOWN_MESSAGE)  # the loop's own thread ends every request
        deadline = time.monotonic() + 10
        while self.loop.live and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stopping.set()
        self.thread.join(timeout=10)
        self.loop.executor.close()
        if not self.thread.is_alive():
            self.loop.close(SHUTDOWN_MESSAGE)  # what arrived after the drain
        return self.sends.close(timeout_s=5)


def _params(inputs: dict) -> bytes:
    return bytes(np.asarray(inputs["request_params"], dtype=object).reshape(-1)[0])
