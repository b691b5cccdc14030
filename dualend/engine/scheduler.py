"""Which sequences the batched decode loop runs next, and how much of their prompts it prefills.

Engine-free and clock-injected, so it is tested without a server, as vLLM keeps its scheduler:
- admission: at most `max_running` sequences hold a place and their KV blocks; up to `max_queue`
  more wait for one, in arrival order, each for at most `wait_s`; a request is refused only when
  the queue is full or its wait runs out, and the message says which;
- chunked prefill: each iteration prefills at most `prefill_chunk` prompt latents, spread over the
  sequences still prefilling in arrival order, so a long prompt never stalls the decoding ones;
- decode: every sequence past its prefill takes one step in every iteration, except while the steps
  are shared (`fair_rows`): when more than one client has requests running, or had one end within
  `fair_linger_s`, each client decodes at most `fair_rows` of its sequences per iteration (those that
  waited longest), and a prompt's last chunk of a client with nothing decoding yet runs in an iteration
  of its own (never two such iterations in a row). A client that floods the loop then slows the step,
  and another client's first token, only as far as `fair_rows` sequences do (prefill chunks are not
  shared by client: a flood of long prompts still takes the chunk budget); alone, it gets every row,
  once the linger of the last other client has passed. With `fair_rows`, a decode step may be given up
  in flight when another client's prompt arrives (the loop's preemption, `given_up`), so that prompt's
  first token does not wait for it.
A sequence takes its KV blocks from the scheduler's `kv_blocks.KVBlockManager` when it is admitted
and gives them back in `finish`: the one account of KV blocks. With a `prefix_cache.PrefixCache`, an
ended sequence's row may be kept (`keep`, charged to the account at its length); an admitted
sequence whose prompt begins with a kept row's pairs takes that row over (`reuse`, `prefilled` set to
the slots it reuses), and kept rows are evicted, oldest first, whenever a sequence needs their room:
the loop releases the rows `evicted_rows` hands it. The caches (`kv_pool.KVCache`) hold
the storage and only do what they are told, so a sequence admitted here is never refused there.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .decode import CapacityError, InvalidRequest
from .kv_blocks import KVBlockManager
from .prefix_cache import PrefixCache


class Schedulable(Protocol):
    num_latents: int    # prompt latents to prefill
    reserve_slots: int  # KV slots the whole sequence may use: prompt latents + max new tokens
    prefilled: int      # prompt latents already in the cache
    prompt_pairs: np.ndarray             # [num_latents, pair_size] token ids, what the prefix cache matches
    cache_salt: str                      # ... among the kept rows of the same salt
    client: str                          # whom it is for: decode rows are shared by client
    reuse: tuple[int, int] | None        # set at admission: (kept sequence, slots) whose row it takes over


def _kept(seq_id: int) -> tuple[str, int]:
    """A kept row's holder in the KV account."""
    return ("kept", seq_id)


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
                 kv_blocks: int, kv_block_size: int, clock=time.monotonic, prefix_cache: PrefixCache | None = None,
                 fair_rows: int = 0, fair_linger_s: float = 0.0):
        self.max_running, self.max_queue, self.wait_s = max_running, max_queue, wait_s
        self.fair_rows, self.fair_linger_s = fair_rows, fair_linger_s
        self._iterations = 0
        self._solo_last = False  # the last iteration ran new clients' last prompt chunks alone
        self._last_decoded: dict[int, int] = {}    # id(sequence) -> the iteration it last decoded in
        self._recent_clients: dict[str, float] = {}  # client -> when its last sequence ended
        self.prefill_chunk, self.kv_blocks, self.kv_block_size = prefill_chunk, kv_blocks, kv_block_size
        self.clock = clock
        self.kv = KVBlockManager(kv_blocks, kv_block_size)
        self.waiting: deque[tuple[Schedulable, float]] = deque()  # (sequence, arrival time)
        self.running: list[Schedulable] = []
        self.prefixes = prefix_cache
        self._evicted_rows: list[int] = []  # kept rows taken out of the account, for the loop to release

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
        if not self.waiting and self._place(sequence):
            return
        if len(self.waiting) >= self.max_queue:
            raise CapacityError(f"server busy: {len(self.running)} requests running and {len(self.waiting)} "
                                f"waiting, the queue (max_queue_size {self.max_queue}) is full; retry later")
        self.waiting.append((sequence, self.clock()))

    def would_place(self, sequence: Schedulable) -> bool:
        """Whether `submit` would run the sequence at once (a place, its blocks, nobody waiting); changes nothing."""
        if self.waiting or len(self.running) >= self.max_running:
            return False
        kept = [] if self.prefixes is None else self.prefixes.kept()
        return self.kv.fits(sequence.reserve_slots, freeing={_kept(k) for k in kept})

    def admit(self) -> tuple[list[Schedulable], list[tuple[Schedulable, CapacityError]]]:
        """Moves waiting sequences, in arrival order, into free places; returns (admitted, expired)."""
        admitted, expired = [], []
        while self.waiting and self._place(self.waiting[0][0]):
            admitted.append(self.waiting.popleft()[0])
        now = self.clock()
        while self.waiting and now - self.waiting[0][1] >= self.wait_s:
            sequence, _ = self.waiting.popleft()
            expired.append((sequence, CapacityError(
                f"server busy: waited {self.wait_s:g} s in the queue (queue_wait_s) for a place "
                f"({len(self.running)} of {self.max_running} taken) and room in the KV cache (it needs "
                f"{self.blocks(sequence)} blocks, {self.kv.free_blocks} of {self.kv_blocks} are free); "
                f"retry later or lower max_tokens")))
        return admitted, expired

    def _place(self, sequence: Schedulable) -> bool:
        """Runs the sequence if it has a place and its blocks fit, evicting kept rows (oldest first)
        as far as it needs; with a prefix hit it takes that kept row over."""
        if len(self.running) >= self.max_running:
            return False
        kept = [] if self.prefixes is None else self.prefixes.kept()
        if not self.kv.fits(sequence.reserve_slots, freeing={_kept(k) for k in kept}):
            return False
        match = None if self.prefixes is None else self.prefixes.match(sequence.prompt_pairs, sequence.cache_salt)
        donor = None if match is None else match[0]
        while not self.kv.fits(sequence.reserve_slots, freeing={_kept(donor)} if match else ()):
            self._evict(self.prefixes.oldest(sparing=donor))
        if match is not None:
            self.prefixes.take(donor)
            self.kv.free(_kept(donor))
            sequence.reuse, sequence.prefilled = match, match[1]
        self.kv.allocate(sequence, sequence.reserve_slots)
        self.running.append(sequence)
        return True

    def keep(self, seq_id: int, pairs: np.ndarray, salt: str = "") -> bool:
        """Keeps the row of a sequence that ended (after `finish`) for its prefix; False when it is
        not kept (no prefix cache, too short, or no room), and its row is to be released."""
        if self.prefixes is None or not self.prefixes.worth_keeping(pairs):
            return False
        prefixes = self.prefixes  # the newest is the likeliest next turn: older ones make way
        while len(prefixes) and (len(prefixes) >= prefixes.max_entries or not self.kv.fits_copy(len(pairs))):
            self._evict(prefixes.oldest())
        if not self.kv.fits_copy(len(pairs)):
            return False
        prefixes.keep(seq_id, pairs, salt)
        self.kv.allocate_copy(_kept(seq_id), len(pairs))
        return True

    def evicted_rows(self) -> list[int]:
        """Kept rows taken out since the last call (evicted for room, or kept past their time): the
        loop releases them."""
        if self.prefixes is not None:
            for seq_id in self.prefixes.expired():
                self.kv.free(_kept(seq_id))
                self._evicted_rows.append(seq_id)
        rows, self._evicted_rows = self._evicted_rows, []
        return rows

    def forget_kept(self) -> None:
        """Evicts every kept row (a drained loop serves nothing more)."""
        while self.prefixes is not None and len(self.prefixes):
            self._evict(self.prefixes.oldest())

    def _evict(self, seq_id: int) -> None:
        self.prefixes.take(seq_id)
        self.kv.free(_kept(seq_id))
        self._evicted_rows.append(seq_id)

    def plan(self) -> Plan:
        plan, budget = Plan(), self.prefill_chunk
        decoding = [s for s in self.running if s.prefilled == s.num_latents]
        prefilling = [s for s in self.running if s.prefilled < s.num_latents]
        solo = False
        if decoding and self._shared():
            first = [] if self._solo_last else self._first_tokens(prefilling, {s.client for s in decoding}, budget)
            if first:  # their first tokens come out of this iteration: nobody else's rows slow it
                decoding, prefilling, solo = [], first, True
            else:
                decoding = self._fair_share(decoding)
        self._solo_last = solo  # never two such iterations in a row: the others' decoding goes on
        plan.decode = decoding
        for sequence in prefilling:
            if budget <= 0:
                break
            stop = min(sequence.num_latents, sequence.prefilled + budget)
            plan.prefill.append(PrefillChunk(sequence, sequence.prefilled, stop))
            budget -= stop - sequence.prefilled
        self._iterations += 1
        for sequence in plan.decode:
            self._last_decoded[id(sequence)] = self._iterations
        return plan

    def _shared(self) -> bool:
        """Whether the steps are shared between clients now: more than one has a sequence running or
        had one end within fair_linger_s (a chat user's next turn comes soon)."""
        if not self.fair_rows:
            return False
        now = self.clock()
        self._recent_clients = {c: t for c, t in self._recent_clients.items() if now - t < self.fair_linger_s}
        return len({s.client for s in self.running} | set(self._recent_clients)) > 1

    @staticmethod
    def _first_tokens(prefilling: list[Schedulable], busy: set[str], budget: int) -> list[Schedulable]:
        """The sequences of clients with nothing decoding whose whole remaining prompts fit the budget together."""
        chosen = []
        for sequence in prefilling:
            rest = sequence.num_latents - sequence.prefilled
            if sequence.client not in busy and rest <= budget:
                chosen.append(sequence)
                budget -= rest
        return chosen

    def _fair_share(self, decoding: list[Schedulable]) -> list[Schedulable]:
        """At most fair_rows sequences of each client, those that decoded least recently, in running order."""
        by_client: dict[str, list[Schedulable]] = {}
        for sequence in decoding:
            by_client.setdefault(sequence.client, []).append(sequence)
        chosen = set()
        for sequences in by_client.values():
            ranked = sorted(sequences, key=lambda s: self._last_decoded.get(id(s), 0))
            chosen.update(id(s) for s in ranked[:self.fair_rows])
        return [s for s in decoding if id(s) in chosen]

    def given_up(self, plan: Plan) -> None:
        """The plan's decode steps did not run (preempted): their sequences go first at the next share."""
        for sequence in plan.decode:
            self._last_decoded.pop(id(sequence), None)

    def finish(self, sequence: Schedulable) -> bool:
        """Frees the sequence's place and blocks, or takes it out of the queue; True when it held
        blocks (only then may the caches hold anything of it), and only the first time."""
        if sequence in self.running:
            self.running.remove(sequence)
            self._last_decoded.pop(id(sequence), None)
            if self.fair_rows:
                self._recent_clients[sequence.client] = self.clock()
            return self.kv.free(sequence)
        self.waiting = deque(item for item in self.waiting if item[0] is not sequence)
        return False

    def __contains__(self, sequence: Schedulable) -> bool:
        return sequence in self.running or any(item[0] is sequence for item in self.waiting)
