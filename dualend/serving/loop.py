"""The batched decode loop: one per deployment, every live sequence in every iteration.

An iteration admits waiting requests (`scheduler.Scheduler`), makes one backbone call that carries
every decoding sequence's next latent and this iteration's prefill chunks, one batched MTP head +
confidence gate call for the sequences that may draft, and sends each sequence's tokens out through
its `Output`. Each sequence decides through its `decode.SequenceDecoder`, exactly as the step-by-step
test oracle (`reference.reference_generate`) does.

The loop runs on one thread; other threads only `submit` and `cancel`. It reaches the engines
through an `Executor`, so the same loop runs in-process (`offline`, tests, benchmarks) and inside mtp_verify,
where the backbone is a Triton model reached over BLS.
"""
from __future__ import annotations

import itertools
import queue
import secrets
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dualend.engine.decode import CapacityError, InvalidRequest, SequenceDecoder, TextStream, VerifyingDecoder
from dualend.engine.onnx_engine import BackboneBatch, BackboneResult, MTPComponent, OnnxComponents, SequenceStatus
from dualend.engine.scheduler import Scheduler
from dualend.engine.tokenizer import TextTokenizer

from .contract import PreparedRequest, Response, ResponseStream
from .metrics import PhaseMetrics
from .outcomes import Outcome


class BackboneStalled(RuntimeError):
    """The backbone did not answer a call in time, or an earlier call is still out."""


class Output(Protocol):
    """Where one request's responses go (a Triton response sender, or a list in tests)."""

    def send(self, response: Response) -> None: ...   # the last one has a finish_reason
    def fail(self, message: str, outcome: Outcome) -> None: ...  # an error, and the request is over
    def end(self) -> None: ...                        # over without a response (cancelled)
    def is_cancelled(self) -> bool: ...


class SendThread:
    """Delivers responses on one background thread, in the order they were queued.

    In Triton each send is a blocking round trip to the server process (it releases the GIL), so
    sending from here lets the loop's next backbone call overlap this iteration's sends. A full
    queue makes the loop wait: the sends pace the loop, they do not pile up."""

    def __init__(self, on_error, max_queued: int = 4096):
        self.on_error = on_error  # (message) -> None; a send to a client that is gone
        self._jobs: queue.Queue = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._run, name="response-sender", daemon=True)
        self._thread.start()

    def put(self, job, *args) -> None:
        self._jobs.put((job, args))

    def close(self, timeout_s: float) -> bool:
        """Sends what is queued, then stops; False when that took longer than timeout_s."""
        deadline = time.monotonic() + timeout_s
        try:
            self._jobs.put(None, timeout=timeout_s)
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, args = item
            try:
                job(*args)
            except Exception as error:  # noqa: BLE001 - one lost client must not stop everyone's sends
                try:
                    self.on_error(f"a response could not be sent: {error!r}")
                except Exception:  # noqa: BLE001 - nor may a failing report
                    pass


class QueuedOutput:
    """An `Output` whose send, fail and end go through a `SendThread`; is_cancelled asks at once, and
    says yes once a send failed, so the loop stops decoding for a client that is gone."""

    def __init__(self, output: Output, sends: SendThread):
        self.output, self.sends, self.send_failed = output, sends, False

    def send(self, response: Response) -> None:
        self.sends.put(self._guarded, self.output.send, response)

    def fail(self, message: str, outcome: Outcome) -> None:
        self.sends.put(self._guarded, self.output.fail, message, outcome)

    def end(self) -> None:
        self.sends.put(self._guarded, self.output.end)

    def is_cancelled(self) -> bool:
        return self.send_failed or self.output.is_cancelled()

    def _guarded(self, job, *args) -> None:
        try:
            job(*args)
        except Exception:
            self.send_failed = True
            raise


class Backbone(Protocol):
    def run_batch(self, batch: BackboneBatch) -> BackboneResult: ...
    def preempt(self, preempt_id: int) -> None: ...  # gives up that batch if it has not finished (any thread)


class Observer(Protocol):
    """What the loop reports, by phase (`metrics.PhaseMetrics` keeps it; the Triton adapter pushes it
    to Prometheus)."""

    def response(self, response: Response) -> None: ...                 # counters of a sent response
    def queued(self, seconds: float) -> None: ...                       # submit -> first prefill chunk
    def prefix_cache(self, latents: int, reused: int) -> None: ...      # a prompt's latents, how many were reused
    def prefilled(self, seconds: float) -> None: ...                    # first chunk -> prompt in cache
    def first_token(self, seconds: float) -> None: ...                  # submit -> first token released
    def inter_token(self, seconds: float, tokens: int) -> None: ...     # gap / tokens, counted per token
    def step(self, tokens: int) -> None: ...                            # tokens one decode step emitted
    def iteration(self, seconds: float) -> None: ...                     # one busy iteration
    def refused(self, outcome: Outcome) -> None: ...
    def cancelled(self) -> None: ...
    def preempted(self) -> None: ...                                    # a decode step given up in flight
    def flush(self, idle: bool, running: int, waiting: int, kv_usage: float, kept: int) -> None: ...  # every iteration


class Executor:
    """Runs the engines of one deployment: the backbone (in-process or over BLS), and the
    compressor and MTP head in-process, each batched over the sequences of an iteration.

    It holds no KV account: the scheduler's block manager frees a sequence's blocks, and the loop
    then tells `release` to free its storage, the MTP head's at once and the backbone's with the
    next backbone call (released there before anything is reserved), or at once when the loop idles.

    With `call_timeout_s`, each backbone call runs on a helper thread and the loop waits at most that
    long for it: a backbone that hangs (a stopped process, a stuck engine) fails the iteration's
    requests with `BackboneStalled`, and every call after it fails at once while the hung one is
    still out, so no request waits on it; a late answer is dropped."""

    def __init__(self, backbone: Backbone, local: MTPComponent, d_model: int, call_timeout_s: float | None = None):
        self.backbone, self.local, self.d_model = backbone, local, d_model
        self.releases: list[int] = []  # sequences whose backbone rows go with the next call
        self.keeps: list[int] = []     # ... and those whose rows the backbone keeps a copy of first
        self.call_timeout_s = call_timeout_s
        self._caller = ThreadPoolExecutor(1, thread_name_prefix="backbone-call") if call_timeout_s else None
        self._pending: tuple[Future, float] | None = None  # a call that did not answer in time, and its start

    @classmethod
    def in_process(cls, engine: OnnxComponents) -> "Executor":
        return cls(engine.backbone, engine, engine.exported.settings["d_model"])

    def run_backbone(self, batch: BackboneBatch) -> BackboneResult:
        batch.releases, self.releases = self.releases + batch.releases, []
        batch.keeps, self.keeps = self.keeps, []
        try:
            return self._call(batch)
        except Exception:
            # the call may not have got to them (releasing twice is harmless); rows not kept are released
            self.releases += batch.releases + batch.keeps
            raise

    def _call(self, batch: BackboneBatch) -> BackboneResult:
        if self._caller is None:
            return self.backbone.run_batch(batch)
        if self._pending is not None:
            pending, started = self._pending
            if not pending.done():
                raise BackboneStalled(f"the backbone has not answered a call for {time.monotonic() - started:.0f} s "
                                      f"(a hung step); the request ends here, retry later")
            self._pending = None
        started = time.monotonic()
        call = self._caller.submit(self.backbone.run_batch, batch)
        try:
            return call.result(timeout=self.call_timeout_s)
        except FutureTimeout:
            self._pending = (call, started)
            raise BackboneStalled(f"the backbone did not answer within {self.call_timeout_s:g} s (a hung step); "
                                  f"the stream ends here, retry") from None

    def close(self) -> None:
        """Stops the helper thread without waiting for a call that never returns."""
        if self._caller is not None:
            self._caller.shutdown(wait=False, cancel_futures=True)

    def release(self, seq_id: int, keep_backbone: bool = False) -> None:
        """Frees the sequence's MTP cache now and its backbone row with the next backbone call; with
        keep_backbone the backbone first keeps a copy for the prefix cache (released when evicted)."""
        if self.local.mtp is not None:
            self.local.mtp.cache.release(seq_id)
        (self.keeps if keep_backbone else self.releases).append(seq_id)

    def flush_releases(self) -> None:
        """Frees the queued backbone rows now (the loop is idle)."""
        if self.releases or self.keeps:
            releases, keeps, self.releases, self.keeps = self.releases, self.keeps, [], []
            try:
                self._call(BackboneBatch([], np.zeros((0, self.d_model), np.float32), [], [], releases, keeps))
            except Exception:  # noqa: BLE001 - released with a later call (rows left held would fill the cache)
                self.releases += releases + keeps

    def preempt(self, preempt_id: int) -> None:
        """Gives up the backbone call of `preempt_id` if it has not finished (any thread)."""
        self.backbone.preempt(preempt_id)

    def compress(self, pairs: np.ndarray) -> np.ndarray:
        # pairs: [B, pair_size] -> latents [B, D]
        return self.local.compress(pairs)

    def open_drafts(self, seq_id: int, max_steps: int) -> None:
        self.local.mtp.cache.reserve(seq_id, max_steps)

    def close_drafts(self, seq_id: int) -> None:
        self.local.mtp.cache.release(seq_id)

    def draft(self, seq_ids: list[int], inputs: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
        """inputs: per sequence (tokens [n], hidden [n, D], positions [n]), its new MTP entries; the
        sequences with the same n in one call. -> draft logits [B, V] and confidence [B] after each's last."""
        logits, confidence = [None] * len(seq_ids), [None] * len(seq_ids)
        groups: dict[int, list[int]] = {}
        for index, (tokens, _, _) in enumerate(inputs):
            groups.setdefault(len(tokens), []).append(index)
        for indices in groups.values():
            out_logits, out_confidence = self.local.mtp.step_batch(
                [seq_ids[i] for i in indices], np.array([inputs[i][0] for i in indices]),
                np.stack([inputs[i][1] for i in indices]), np.array([inputs[i][2] for i in indices]))
            for k, i in enumerate(indices):
                logits[i], confidence[i] = out_logits[k], out_confidence[k]
        return np.stack(logits), np.asarray(confidence)


@dataclass(eq=False)
class LiveSequence:
    request_id: int
    request: PreparedRequest
    prompt_latents: np.ndarray  # [n, D]
    decoder: SequenceDecoder
    text: TextStream
    responses: ResponseStream
    output: Output
    prompt_pairs: np.ndarray    # [n, pair_size] the prompt's token ids, one row per latent
    prefilled: int = 0          # prompt latents already in the backbone's cache
    reuse: tuple[int, int] | None = None  # (kept sequence, slots) it starts from, until its first chunk ran
    started: bool = False       # the backbone holds a row for it
    fed_pairs: list = field(default_factory=list)  # the pairs its decode steps fed the backbone
    drafting: bool = False      # the MTP head holds a cache for it
    submitted_at: float = 0.0
    started_at: float = 0.0      # its first prefill chunk ran
    first_token_at: float = 0.0  # its first released token was decoded (0: none yet)
    last_sent: float = 0.0       # its last response with tokens went out (0: none yet)
    next_cancel_check: float = 0.0

    @property
    def num_latents(self) -> int:
        return len(self.prompt_latents)

    @property
    def cache_salt(self) -> str:
        return self.request.cache_salt

    @property
    def client(self) -> str:
        return self.request.client

    @property
    def reserve_slots(self) -> int:
        # One slot per prompt pair and at most one per generated token.
        return self.num_latents + self.request.params.max_tokens


class PreemptionBudget:
    """Decode steps may be given up for newcomers only while, over the last `window_s`, fewer were
    given up than ran to their end: decoding keeps about half the steps however many newcomers come
    (a key sending one-token prompts cannot stall the others)."""

    def __init__(self, clock, window_s: float = 1.0):
        self.clock, self.window_s = clock, window_s
        self._completed: deque[float] = deque()
        self._given_up: deque[float] = deque()

    def completed(self) -> None:
        self._note(self._completed)

    def given_up(self) -> None:
        self._note(self._given_up)

    def allows(self) -> bool:
        self._forget()
        return len(self._given_up) < len(self._completed)

    def _note(self, times: deque) -> None:
        times.append(self.clock())
        self._forget()

    def _forget(self) -> None:
        since = self.clock() - self.window_s
        for times in (self._completed, self._given_up):
            while times and times[0] < since:
                times.popleft()


@dataclass
class _Inbox:
    submitted: list[LiveSequence] = field(default_factory=list)
    cancelled: set[int] = field(default_factory=set)
    drain: str | None = None


class DecodeLoop:
    def __init__(self, executor: Executor, tokenizer: TextTokenizer, scheduler: Scheduler, threshold: float,
                 observer: Observer | None = None, cancel_check_s: float = 0.5, clock=time.monotonic,
                 synthetic_acceptance: float | None = None, draft_max_batch: int = 0, draft_min_acceptance: float = 0.0,
                 log_error=None):
        self.executor, self.tokenizer, self.scheduler = executor, tokenizer, scheduler
        self.log_error = log_error or (lambda message: None)  # (message): an internal error, with its traceback
        self.draft_max_batch = draft_max_batch  # verified drafts only while at most this many decode (0: always)
        self.draft_min_acceptance = draft_min_acceptance  # each sequence's decode.DraftPacer
        self.threshold, self.observer = threshold, observer or PhaseMetrics()
        self.synthetic_acceptance = synthetic_acceptance  # benchmark only: decode.SyntheticAcceptance
        self.cancel_check_s, self.clock = cancel_check_s, clock
        local = executor.local
        self.pair_size, self.pad_id, self.eos_id, self.bos_id = local.pair_size, local.pad_id, local.eos_id, local.bos_id
        self.verifies = self.pair_size == 1 and local.mtp is not None  # a draft head: drafts checked by the next step
        self.live: dict[int, LiveSequence] = {}
        self._inbox = _Inbox()
        self._wake = threading.Condition()
        self._preempt_ids = itertools.count(secrets.randbits(62) + 1)  # no two loops' steps share an id
        self._in_flight: tuple[int, set[str]] | None = None  # a preemptible decode step running: (its id, its clients)
        self._preemptions = PreemptionBudget(clock)
        self._drained: str | None = None  # the message every request gets once the loop drained

    # --- any thread ---------------------------------------------------------------------------

    def submit(self, request_id: int, request: PreparedRequest, prompt_latents: np.ndarray, output: Output) -> None:
        """Queues a request; its `acceptance_threshold`, when it sets one, overrides the deployment's."""
        threshold = request.params.acceptance_threshold
        threshold = self.threshold if threshold is None else threshold
        decoder = (VerifyingDecoder(self.pad_id, self.eos_id, self.bos_id, request.params, threshold, len(prompt_latents),
                                    min_acceptance=self.draft_min_acceptance)
                   if self.verifies else
                   SequenceDecoder(self.pair_size, self.pad_id, self.eos_id, self.bos_id, request.params, threshold,
                                   len(prompt_latents), synthetic_acceptance=self.synthetic_acceptance,
                                   min_acceptance=self.draft_min_acceptance))
        sequence = LiveSequence(
            request_id, request, prompt_latents, decoder,
            TextStream(self.tokenizer, request.params.stop_words), ResponseStream(request, len(prompt_latents)),
            output, request.prompt_pairs(self.pair_size, self.pad_id))
        with self._wake:
            self._inbox.submitted.append(sequence)
            self._wake.notify()
            preempt_id = self._preempt_for(sequence)
        if preempt_id:
            self.executor.preempt(preempt_id)

    def _preempt_for(self, sequence: LiveSequence) -> int:
        """The shared decode step in flight that a new sequence's first token should not wait for (0: none):
        one of a client with nothing in it, whose prompt goes in with one chunk and would get a place at
        once (an iteration of its own follows; the scheduler decides that, this only foresees it; the
        loop's thread is in the backbone call meanwhile, so the scheduler holds still). Each step is given
        up at most once."""
        if self._in_flight is None:
            return 0
        preempt_id, clients = self._in_flight
        if (sequence.client in clients or sequence.num_latents > self.scheduler.prefill_chunk
                or len(self._inbox.submitted) > 1 or self._inbox.drain is not None or self._drained is not None
                or not self.scheduler.would_place(sequence)):
            return 0
        self._in_flight = None
        return preempt_id

    def cancel(self, request_id: int) -> None:
        with self._wake:
            self._inbox.cancelled.add(request_id)
            self._wake.notify()

    def drain(self, message: str) -> None:
        """Ends every request (running, queued or just submitted) with `message` at the next iteration,
        and every request submitted after that with the same message: a drained loop stays drained."""
        with self._wake:
            self._inbox.drain = message
            self._wake.notify()

    # --- the loop's thread --------------------------------------------------------------------

    def serve_forever(self, stopping: threading.Event, idle_wait_s: float = 0.05) -> None:
        while not stopping.is_set():
            if not self.run_once():
                with self._wake:
                    if not (self._inbox.submitted or self._inbox.cancelled or self._inbox.drain):
                        self._wake.wait(idle_wait_s)

    def run_once(self) -> bool:
        """One iteration; False when there was nothing to do. An unexpected error ends the requests
        in the loop with it (each gets its last word) and the loop goes on."""
        try:
            busy = self._iterate()
        except Exception as error:  # noqa: BLE001 - a dead loop would leave every stream hanging
            self.log_error(f"decode loop: an iteration failed, ending its {len(self.live)} requests:\n"
                           f"{traceback.format_exc()}")
            for sequence in list(self.live.values()):
                try:
                    self._end(sequence, error=f"internal error in the decode loop: {error!r}",
                              outcome=Outcome.STEP_FAILED)
                except Exception:  # noqa: BLE001 - its sender is gone; the others still get their word
                    self.live.pop(sequence.request_id, None)
            busy = False  # the loop waits a moment rather than spinning on a repeated error
        scheduler = self.scheduler
        self.observer.flush(not busy, len(scheduler.running), len(scheduler.waiting),
                            scheduler.used_blocks / scheduler.kv_blocks, len(scheduler.prefixes or ()))
        return busy

    def _iterate(self) -> bool:
        self._take_inbox()
        self._check_cancelled()
        _, expired = self.scheduler.admit()
        for sequence, error in expired:
            self._end(sequence, error=str(error), outcome=Outcome.QUEUE_TIMEOUT)
        for seq_id in self.scheduler.evicted_rows():
            self.executor.release(seq_id)
        plan = self.scheduler.plan()
        if not plan:
            self.executor.flush_releases()  # idle: free the rows now rather than with the next request
            return False
        rows = plan.decode + [chunk.sequence for chunk in plan.prefill]
        parts, fed = [], []
        if plan.decode:  # each its next pair; a verifying decoder its last token and maybe a draft
            fed = [np.asarray(s.decoder.next_pair, dtype=np.int64).reshape(-1, self.pair_size) for s in plan.decode]
            for sequence, pairs in zip(plan.decode, fed):
                sequence.fed_pairs.extend(pairs)
            parts.append(self.executor.compress(np.concatenate(fed)))
        parts += [chunk.sequence.prompt_latents[chunk.start:chunk.stop] for chunk in plan.prefill]
        starting = [c.sequence.reuse or (0, 0) for c in plan.prefill]
        batch = BackboneBatch(
            [s.request_id for s in rows], np.concatenate(parts), [len(pairs) for pairs in fed]
            + [c.stop - c.start for c in plan.prefill],
            [0] * len(plan.decode) + [0 if c.sequence.started else c.sequence.reserve_slots for c in plan.prefill], [])
        if any(s.decoder.discard for s in plan.decode):
            batch.discard = [s.decoder.discard for s in plan.decode] + [0] * len(plan.prefill)
        batch.verify = any(len(pairs) > 1 for pairs in fed)
        if any(slots for _, slots in starting):
            batch.reuse_ids = [0] * len(plan.decode) + [donor for donor, _ in starting]
            batch.reuse_slots = [0] * len(plan.decode) + [slots for _, slots in starting]
        if (self.scheduler.fair_rows and plan.decode and not plan.prefill and not batch.discard and not batch.verify
                and self._preemptions.allows()):
            batch.preempt_id = next(self._preempt_ids)
            with self._wake:
                self._in_flight = (batch.preempt_id, {s.client for s in plan.decode})
        started = self.clock()
        for chunk in plan.prefill:
            if not chunk.sequence.started:
                chunk.sequence.started_at = started
        try:
            result = self.executor.run_backbone(batch)
        except Exception as error:  # noqa: BLE001 - the iteration's sequences fail, the loop goes on
            for sequence in rows:  # each ends, so its rows are released (a first chunk's too, if it got that far)
                self._end(sequence, error=str(error), outcome=Outcome.STEP_FAILED)
            return True
        finally:
            if batch.preempt_id:
                with self._wake:
                    self._in_flight = None
        if batch.preempt_id and SequenceStatus.PREEMPTED in result.status:  # nothing ran: the same pairs go in again
            for sequence, pairs in zip(plan.decode, fed):
                del sequence.fed_pairs[-len(pairs):]
            self.scheduler.given_up(plan)
            self.observer.preempted()
            self._preemptions.given_up()
            return True
        if plan.decode:
            self._preemptions.completed()
        ready = []
        for row, sequence in enumerate(rows):
            if result.status[row] == SequenceStatus.PREFIX_GONE:  # its kept row went: prefill it all
                sequence.reuse, sequence.prefilled = None, 0
                continue
            if result.failed(row):
                self._end(sequence, error=_backbone_message(result.status[row], result.messages[row]),
                          outcome=Outcome.STEP_FAILED)
                continue
            if row >= len(plan.decode):
                chunk = plan.prefill[row - len(plan.decode)]
                if not sequence.started:  # its first chunk went in: where its prefill started is known
                    self.observer.queued(sequence.started_at - sequence.submitted_at)
                    self.observer.prefix_cache(sequence.num_latents, chunk.start)
                    sequence.responses.cached(int((sequence.prompt_pairs[:chunk.start] != self.pad_id).sum()))
                sequence.prefilled, sequence.started, sequence.reuse = chunk.stop, True, None
                if not chunk.completes_prompt:
                    continue
                self.observer.prefilled(self.clock() - sequence.started_at)
            ready.append((row, sequence))
        if ready:
            self._decode(ready, result)
        self.observer.iteration(self.clock() - started)
        return True

    def _decode(self, ready: list[tuple[int, LiveSequence]], result: BackboneResult) -> None:
        """One decode step of every sequence in `ready`; an error in one sequence's own work (its
        sampling, its text) ends that sequence alone, an error in the batched draft call the loop's."""
        decoded = []
        verify_logits, verify_hidden = result.verify_logits, result.verify_hidden
        for row, sequence in ready:
            try:
                tokens = sequence.decoder.settle(result.logits[row], None if verify_logits is None else verify_logits[row])
            except Exception as error:  # noqa: BLE001 - e.g. logits no sampler can use
                self._end_failed(sequence, error)
                continue
            if sequence.decoder.discard:  # the draft it fed is not the base's: the row drops it
                del sequence.fed_pairs[-sequence.decoder.discard:]
            decoded.append((row, sequence, tokens))
        drafting = [i for i, (_, s, tokens) in enumerate(decoded) if s.decoder.drafts_after(tokens)]
        if self.verifies and self.draft_max_batch and len(decoded) > self.draft_max_batch:
            drafting = []  # compute-bound: a fed draft would cost more than it gives
        drafts_now = set(drafting)
        for i, (_, sequence, _) in enumerate(decoded):
            if sequence.drafting and i not in drafts_now:  # its MTP entries would have gaps: it starts afresh
                self.executor.close_drafts(sequence.request_id)
                sequence.drafting = False
        draft_logits, confidence = {}, {}
        if drafting:
            for i in drafting:
                sequence = decoded[i][1]
                if not sequence.drafting:
                    self.executor.open_drafts(sequence.request_id, sequence.request.params.max_tokens)
                    sequence.drafting = True
            inputs = [decoded[i][1].decoder.mtp_inputs(decoded[i][2], result.hidden[decoded[i][0]],
                                                       None if verify_hidden is None else verify_hidden[decoded[i][0]])
                      for i in drafting]
            logits, conf = self.executor.draft([decoded[i][1].request_id for i in drafting], inputs)
            draft_logits = {i: logits[k] for k, i in enumerate(drafting)}
            confidence = {i: float(conf[k]) for k, i in enumerate(drafting)}
        now = self.clock()
        for i, (_, sequence, tokens) in enumerate(decoded):
            try:
                self._emit(sequence, tokens, draft_logits.get(i), confidence.get(i, 0.0), now)
            except Exception as error:  # noqa: BLE001 - this sequence's step failed, not the others'
                self._end_failed(sequence, error)

    def _emit(self, sequence: LiveSequence, tokens: list[int], draft_logits, confidence: float, now: float) -> None:
        step = sequence.decoder.finish(tokens, draft_logits, confidence)
        self.observer.step(len(step.tokens))
        chunk = sequence.text.chunk(step)
        if chunk.tokens and not sequence.first_token_at:  # streamed or not: when its first text was ready
            sequence.first_token_at = now
            self.observer.first_token(now - sequence.submitted_at)
        response = sequence.responses.add(chunk)
        if response is not None:
            sequence.output.send(response)
            self.observer.response(response)
            if chunk.tokens:
                if sequence.last_sent:
                    self.observer.inter_token((now - sequence.last_sent) / len(chunk.tokens), len(chunk.tokens))
                sequence.last_sent = now
        if chunk.finish_reason is not None:
            self._end(sequence)

    def _end_failed(self, sequence: LiveSequence, error: Exception) -> None:
        self.log_error(f"decode loop: request {sequence.request_id} failed:\n{traceback.format_exc()}")
        if sequence.request_id in self.live:
            self._end(sequence, error=f"internal error decoding this request: {error!r}",
                      outcome=Outcome.STEP_FAILED)

    def _take_inbox(self) -> None:
        with self._wake:
            submitted, self._inbox.submitted = self._inbox.submitted, []
            cancelled, self._inbox.cancelled = self._inbox.cancelled, set()
            drain, self._inbox.drain = self._inbox.drain, None
        if drain is not None:
            self._drained = drain
        now = self.clock()
        for sequence in submitted:
            try:
                refusal = self._admit(sequence)
            except Exception:  # noqa: BLE001 - one request's admission; the others are still taken in
                self.log_error(f"decode loop: admitting request {sequence.request_id} failed:\n"
                               f"{traceback.format_exc()}")
                self.live[sequence.request_id] = sequence  # so that its end frees what the scheduler gave it
                try:
                    self._end(sequence, error="internal error admitting this request", outcome=Outcome.STEP_FAILED)
                except Exception:  # noqa: BLE001 - the client is gone; the other submissions go on
                    self.live.pop(sequence.request_id, None)
                continue
            if refusal is not None:
                outcome, message = refusal
                self.observer.refused(outcome)
                try:
                    sequence.output.fail(message, outcome)
                except Exception:  # noqa: BLE001 - the client is gone; the other submissions go on
                    pass
                continue
            sequence.submitted_at = now
            sequence.next_cancel_check = now + self.cancel_check_s
            self.live[sequence.request_id] = sequence
        for request_id in cancelled:
            if request_id in self.live:
                self._end(self.live[request_id], cancelled=True)
        if drain is not None:
            for sequence in list(self.live.values()):
                self._end(sequence, error=drain, outcome=Outcome.SHUTTING_DOWN)
            self.scheduler.forget_kept()

    def _admit(self, sequence: LiveSequence) -> tuple[Outcome, str] | None:
        """Hands a new request to the scheduler; (outcome, message) when it is refused."""
        if self._drained is not None:
            return Outcome.SHUTTING_DOWN, self._drained
        try:
            self.scheduler.submit(sequence)
        except CapacityError as error:
            return Outcome.QUEUE_FULL, str(error)
        except InvalidRequest as error:
            return Outcome.TOO_LARGE, str(error)
        return None

    def _check_cancelled(self) -> None:
        """Asking the server costs a round trip, so each sequence is asked every cancel_check_s."""
        now = self.clock()
        for sequence in list(self.live.values()):
            if now >= sequence.next_cancel_check:
                sequence.next_cancel_check = now + self.cancel_check_s
                if sequence.output.is_cancelled():
                    self._end(sequence, cancelled=True)

    def _end(self, sequence: LiveSequence, error: str | None = None, cancelled: bool = False,
             outcome: Outcome = Outcome.STEP_FAILED) -> None:
        """Frees everything the sequence holds; a request that did not finish gets its last word."""
        if self.live.pop(sequence.request_id, None) is None:
            return
        if sequence.reuse:  # the kept copy it was to start from is nobody's now
            self.executor.release(sequence.reuse[0])
        if self.scheduler.finish(sequence):  # its blocks came back, once: now its storage goes too
            kept = error is None and sequence.started and self.scheduler.keep(
                sequence.request_id, _backbone_pairs(sequence), sequence.cache_salt)
            self.executor.release(sequence.request_id, keep_backbone=kept)
        if error is not None:
            self.observer.refused(outcome)
            sequence.output.fail(error, outcome)
        elif cancelled:
            self.observer.cancelled()
            sequence.output.end()

    def close(self, message: str) -> None:
        """Ends every request still here with `message`, at once (the loop's thread has stopped)."""
        self.drain(message)
        self._take_inbox()


def _backbone_pairs(sequence: LiveSequence) -> np.ndarray:
    """The pairs whose keys and values the sequence's backbone row holds, in order."""
    fed = np.asarray(sequence.fed_pairs, dtype=np.int64).reshape(-1, sequence.prompt_pairs.shape[1])
    return np.concatenate([sequence.prompt_pairs[:sequence.prefilled], fed])


def _backbone_message(status: SequenceStatus, message: str) -> str:
    if status in (SequenceStatus.UNKNOWN_SEQUENCE, SequenceStatus.EVICTED):
        return (f"the backbone lost this stream's sequence (the model was reloaded, or it evicted the sequence "
                f"after idling); the stream ends here, retry: {message}")
    return message
