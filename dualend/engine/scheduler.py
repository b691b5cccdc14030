"""Which sequences the batched decode loop runs next, and how much of their prompts it prefills.

Engine-free and clock-injected, so it is tested without a server, as vLLM keeps its scheduler:
- admission: at most `max_running` sequences hold a place and their KV blocks; up to `max_queue`
  more wait for one, in arrival order, each for at most `wait_s`; a request is refused only when
  the queue is full or its wait runs out, and the message says which;
- chunked prefill: each iteration prefills at most `prefill_chunk` prompt latents, spread over the
  sequences still prefilling in arrival order, so a long prompt never stalls the decoding ones;
- decode: every sequence past its prefill takes one step in every iteration.
A sequence takes its KV blocks from the scheduler's `kv_blocks.KVBlockManager` when it is admitted
and gives them back in `finish`: the one account of KV blocks. The caches (`kv_pool.KVCache`) hold
the storage and only do what they are told, so a sequence admitted here is never refused there.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from .decode import CapacityError, InvalidRequest
from .kv_blocks import KVBlockManager


class Schedulable(Protocol):
    num_latents: int    # prompt latents to prefill
    reserve_slots: int  # KV slots the whole sequence may use: prompt latents + max new tokens
    prefilled: int      # prompt latents already in the cache


@dataclass
class PrefillChunk:
    sequence: Schedulable
    start: int
    stop: int

    @property
    def completes_prompt(self) -> bool:
        return self.stop == self.sequence.num_latents


@dataclass
class Plan:
    decode: list[Schedulable] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, max_running: int, max_queue: int, wait_s: float, prefill_chunk: int,
                 kv_blocks: int, kv_block_size: int, clock=time.monotonic):
        self.max_running, self.max_queue, self.wait_s = max_running, max_queue, wait_s
        self.prefill_chunk, self.kv_blocks, self.kv_block_size = prefill_chunk, kv_blocks, kv_block_size
        self.clock = clock
        self.kv = KVBlockManager(kv_blocks, kv_block_size)
        self.waiting: deque[tuple[Schedulable, float]] = deque()  # (sequence, arrival time)
        self.running: list[Schedulable] = []

    def blocks(self, sequence: Schedulable) -> int:
        return self.kv.blocks_for(sequence.reserve_slots)

    @property
    def used_blocks(self) -> int:
        return self.kv.used_blocks

    def submit(self, sequence: Schedulable) -> None:
        """Runs the sequence now if it fits and nobody waits before it, queues it otherwise;
        refuses it when the queue is full or it could never fit."""
        if self.blocks(sequence) > self.kv_blocks:
            raise InvalidRequest(f"the request needs {sequence.reserve_slots} KV slots, more than the whole cache "
                                 f"holds ({self.kv_blocks} blocks of {self.kv_block_size}); lower max_tokens")
        if not self.waiting and self._fits(sequence):
            self._run(sequence)
            return
        if len(self.waiting) >= self.max_queue:
            raise CapacityError(f"server busy: {len(self.running)} requests running and {len(self.waiting)} "
                                f"waiting, the queue (max_queue_size {self.max_queue}) is full; retry later")
        self.waiting.append((sequence, self.clock()))

    def admit(self) -> tuple[list[Schedulable], list[tuple[Schedulable, CapacityError]]]:
        """Moves waiting sequences, in arrival order, into free places; returns (admitted, expired)."""
        admitted, expired = [], []
        while self.waiting and self._fits(self.waiting[0][0]):
            sequence, _ = self.waiting.popleft()
            self._run(sequence)
            admitted.append(sequence)
        now = self.clock()
        while self.waiting and now - self.waiting[0][1] >= self.wait_s:
            sequence, _ = self.waiting.popleft()
            expired.append((sequence, CapacityError(
                f"server busy: waited {self.wait_s:g} s in the queue (queue_wait_s) for a place "
                f"({len(self.running)} of {self.max_running} taken) and room in the KV cache (it needs "
                f"{self.blocks(sequence)} blocks, {self.kv.free_blocks} of {self.kv_blocks} are free); "
                f"retry later or lower max_tokens")))
        return admitted, expired

    def _fits(self, sequence: Schedulable) -> bool:
        return len(self.running) < self.max_running and self.kv.fits(sequence.reserve_slots)

    def _run(self, sequence: Schedulable) -> None:
        self.kv.allocate(sequence, sequence.reserve_slots)
        self.running.append(sequence)

    def plan(self) -> Plan:
        plan, budget = Plan(), self.prefill_chunk
        for sequence in self.running:
            if sequence.prefilled == sequence.num_latents:
                plan.decode.append(sequence)
            elif budget > 0:
                stop = min(sequence.num_latents, sequence.prefilled + budget)
                plan.prefill.append(PrefillChunk(sequence, sequence.prefilled, stop))
                budget -= stop - sequence.prefilled
        return plan

    def finish(self, sequence: Schedulable) -> bool:
        """Frees the sequence's place and blocks, or takes it out of the queue; True when it held
        blocks (only then may the caches hold anything of it), and only the first time."""
        if sequence in self.running:
            self.running.remove(sequence)
            return self.kv.free(sequence)
        self.waiting = deque(item for item in self.waiting if item[0] is not sequence)
        return False

    def __contains__(self, sequence: Schedulable) -> bool:
        return sequence in self.running or any(item[0] is sequence for item in self.waiting)
