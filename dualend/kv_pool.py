"""A bounded pool of per-sequence KV caches, one slot per pair, accounted in blocks.

A sequence reserves, at prefill, the slots it may need (prompt pairs + max new tokens), so a
request is admitted or refused up front and never runs out of cache halfway. Sequences idle past
`idle_timeout_s` are evicted, so a caller that vanished cannot hold the pool forever.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .decode import CapacityError


@dataclass
class SequenceCache:
    keys: np.ndarray     # [reserved_slots, L, H, Dh]
    values: np.ndarray   # [reserved_slots, L, H, Dh]
    blocks: int
    length: int = 0
    last_used: float = field(default_factory=time.monotonic)


class UnknownSequence(KeyError):
    pass


class KVPool:
    def __init__(self, slot_shape: tuple[int, int, int], block_size: int = 16,
                 capacity_blocks: int | None = None, idle_timeout_s: float = 60.0, clock=time.monotonic):
        self.slot_shape = slot_shape
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sequences: dict[int, SequenceCache] = {}
        self.evicted_total = 0
        self._lock = threading.Lock()

    @property
    def used_blocks(self) -> int:
        return sum(s.blocks for s in self.sequences.values())

    @property
    def free_blocks(self) -> int | None:
        return None if self.capacity_blocks is None else self.capacity_blocks - self.used_blocks

    def reserve(self, seq_id: int, slots: int) -> None:
        blocks = max(1, math.ceil(slots / self.block_size))
        with self._lock:
            if seq_id in self.sequences:
                raise ValueError(f"sequence {seq_id} already holds a cache")
            self._evict_idle_locked()
            free = self.free_blocks
            if free is not None and blocks > free:
                raise CapacityError(
                    f"KV cache full: the request needs {blocks} blocks of {self.block_size} pair slots, "
                    f"{free} of {self.capacity_blocks} are free; retry later or lower max_tokens")
            shape = (blocks * self.block_size, *self.slot_shape)
            self.sequences[seq_id] = SequenceCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                                                   blocks, last_used=self.clock())

    def get(self, seq_id: int) -> SequenceCache:
        cache = self.sequences.get(seq_id)
        if cache is None:
            raise UnknownSequence(f"sequence {seq_id} holds no KV cache (released, evicted after "
                                  f"{self.idle_timeout_s:.0f} s idle, lost in a model reload, or never started)")
        cache.last_used = self.clock()
        return cache

    def past(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Contiguous views [T, L, H, Dh] of the filled slots."""
        cache = self.get(seq_id)
        return cache.keys[: cache.length], cache.values[: cache.length]

    def append(self, seq_id: int, keys: np.ndarray, values: np.ndarray) -> None:
        # keys, values: [S, L, H, Dh]
        cache = self.get(seq_id)
        end = cache.length + len(keys)
        if end > len(cache.keys):
            raise CapacityError(f"sequence {seq_id} outgrew its reservation of {len(cache.keys)} pair slots")
        cache.keys[cache.length:end] = keys
        cache.values[cache.length:end] = values
        cache.length = end

    def release(self, seq_id: int) -> bool:
        with self._lock:
            return self.sequences.pop(seq_id, None) is not None

    def evict_idle(self) -> list[int]:
        with self._lock:
            return self._evict_idle_locked()

    def _evict_idle_locked(self) -> list[int]:
        now = self.clock()
        idle = [k for k, s in self.sequences.items() if now - s.last_used > self.idle_timeout_s]
        for seq_id in idle:
            del self.sequences[seq_id]
        self.evicted_total += len(idle)
        return idle


def gather_past(pool: KVPool, seq_ids: list[int]):
    """Batched past for the engine: keys/values [B, T, L, H, Dh], valid [B, T], lengths [B].

    One sequence is passed without a copy; several are right-padded to the longest.
    """
    pasts = [pool.past(s) for s in seq_ids]
    lengths = np.array([len(k) for k, _ in pasts], dtype=np.int64)
    if len(pasts) == 1:
        keys, values = pasts[0]
        return keys[None], values[None], np.ones((1, len(keys)), dtype=bool), lengths
    longest = int(lengths.max())
    shape = (len(pasts), longest, *pool.slot_shape)
    keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    valid = np.zeros((len(pasts), longest), dtype=bool)
    for row, (k, v) in enumerate(pasts):
        keys[row, : len(k)], values[row, : len(v)], valid[row, : len(k)] = k, v, True
    return keys, values, valid, lengths
