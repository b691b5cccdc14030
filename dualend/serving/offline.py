"""Generation without a server, through the served decode loop.

Benchmarks, the builder's checks and the end-to-end tests' reference generate in-process with the
same batched `loop.DecodeLoop` the server runs, its engines in this process (`Executor.in_process`):
one decode driver. Each call builds a loop for one request and runs it until the request ends.

    engine = OnnxComponents("exports/dualend")
    result = generate_text(engine, engine.exported.tokenizer(), "Q: 4+3-2\\nA:", SamplingParams(max_tokens=32), 0.5)
"""
from __future__ import annotations

import itertools
import sys
from collections import deque
from typing import Iterator, Sequence

from dualend.engine.decode import Generation, SamplingParams
from dualend.engine.onnx_engine import OnnxComponents
from dualend.engine.scheduler import Scheduler
from dualend.engine.tokenizer import TextTokenizer

from .contract import PreparedRequest, Response
from .loop import DecodeLoop, Executor
from .outcomes import Outcome, tagged

PREFILL_CHUNK = 1 << 20  # latents per iteration: a whole prompt in one backbone call, as the reference prefills

_request_ids = itertools.count(1)


class GenerationFailed(RuntimeError):
    """The loop ended the request with an error; the message is the loop's."""


class _Collected:
    """An `Output` that keeps the responses until the caller takes them."""

    def __init__(self):
        self.responses: deque[Response] = deque()
        self.error: str | None = None
        self.done = False

    def send(self, response: Response) -> None:
        self.responses.append(response)
        self.done = response.finish_reason is not None

    def fail(self, message: str, outcome: Outcome) -> None:
        self.error, self.done = tagged(outcome, message), True

    def end(self) -> None:
        self.done = True

    def is_cancelled(self) -> bool:
        return False


def decode_loop(engine: OnnxComponents, tokenizer: TextTokenizer, threshold: float, **options) -> DecodeLoop:
    """A decode loop on the in-process engine, sized by its KV cache; `options` are the loop's
    (`synthetic_acceptance`, benchmark only: drafts accepted by a draw at that rate instead of the
    gate; `draft_min_acceptance`: each sequence's `decode.DraftPacer`)."""
    cache = engine.backbone.cache
    scheduler = Scheduler(max_running=cache.max_sequences, max_queue=0, wait_s=0.0, prefill_chunk=PREFILL_CHUNK,
                          kv_blocks=sys.maxsize, kv_block_size=1)  # one request: the cache's rows are the limit
    return DecodeLoop(Executor.in_process(engine), tokenizer, scheduler, threshold, **options)


def stream(engine: OnnxComponents, tokenizer: TextTokenizer, prompt_ids: Sequence[int], params: SamplingParams,
           threshold: float, **options) -> Iterator[Response]:
    """One request's streamed responses (prompt not echoed), as the loop sends them, the last with its
    finish_reason; closing the iterator early cancels the request. Every cache is free afterwards."""
    loop, output = decode_loop(engine, tokenizer, threshold, **options), _Collected()
    request_id = next(_request_ids)
    request = PreparedRequest(list(prompt_ids), params, stream=True, exclude_input_in_output=True)
    loop.submit(request_id, request, engine.compress(request.prompt_pairs(engine.pair_size, engine.pad_id)), output)
    try:
        while not output.done:
            busy = loop.run_once()
            while output.responses:
                yield output.responses.popleft()
            if not busy and not output.done:
                raise GenerationFailed("the decode loop went idle before the request ended")
        if output.error is not None:
            raise GenerationFailed(output.error)
    finally:
        if not output.done:
            loop.cancel(request_id)
        while loop.run_once():  # the loop frees what an ended request held once it is idle
            pass


def generate_text(engine: OnnxComponents, tokenizer: TextTokenizer, prompt: str, params: SamplingParams,
                  threshold: float, **options) -> Generation:
    """One whole generation as text, with its counters, as the server would answer it (`options`:
    the decode loop's, as in `decode_loop`)."""
    result = Generation()
    for response in stream(engine, tokenizer, tokenizer.encode_prompt(prompt), params, threshold, **options):
        counters = response.counters
        result.add(response.output_ids, counters["num_steps"], counters["num_drafts"],
                   counters["num_accepted_drafts"], response.finish_reason)
    result.text = tokenizer.decode(result.tokens)
    return result
