"""The KV cache of every live sequence: preallocated rows, written in place, read without a copy.

Each layer's keys (and values) are one array [rows, heads, T, Dh], the layout the engine's
attention reads. A live sequence owns a row, and rows in use are kept dense (0..n-1), so the past
of every live sequence is the view [:n] of each array: contiguous, handed to the engine as it is.
A step writes only its new keys and values. T grows in buckets as the longest sequence grows (one
re-layout every `bucket` steps, not a copy every step) and shrinks back when the long ones leave;
a release moves the last row into the freed one. Every layout lives in one buffer per layer, laid
out virtually for `max_sequences` rows as wide as the widest reservation (`max_row_slots`): private
anonymous memory that the operating system gives page by page as slots are first written, and takes
back (`madvise(MADV_DONTNEED)`) when a release or a re-layout leaves pages holding no live slot. So
resident memory follows the slots the sequences have filled, not rows x the widest row, and the
block account can charge each sequence its own reservation. Slots past a row's length hold zeros or
stale finite values; the engine masks them. Without `max_row_slots` (the in-process engine) the
buffers grow as needed.

A sequence reserves, at its start, a row and the slots it may need (prompt pairs + max new
tokens). Whether it may is decided before, by the one account of KV blocks
(`kv_blocks.KVBlockManager`, the scheduler's): the cache keeps no budget of its own, and refuses
only what it physically cannot do (no row left, a step beyond a reservation), with a typed error.
Sequences idle past `idle_timeout_s` are evicted, a safety net for a caller that vanished (its
account went with it); a later step of one says it was evicted (`EvictedSequence`).

The prefix cache's rows (`keep`, `adopt`) are copies of ended sequences' keys and values, held
outside the rows (so a decode step, which runs over the rows in use, never computes them), until
a new sequence starts from one (copied into its row) or the caller releases it; a copy not taken
within `kept_timeout_s` is dropped, the same safety net.
"""
from __future__ import annotations

import math
import mmap
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .decode import CapacityError


class UnknownSequence(KeyError):
    """The sequence holds no cache here: released, lost in a model reload, or never started."""


class EvictedSequence(UnknownSequence):
    """The sequence's cache was evicted after idling."""


class PrefixGone(UnknownSequence):
    """The kept copy a starting sequence was to begin with is gone, or cannot serve it; it holds nothing."""


class AlreadyStarted(ValueError):
    """A reservation for a sequence that holds one."""


class NoRoom(CapacityError):
    """No row is left, or a step would go beyond the sequence's reservation."""


@dataclass
class _Sequence:
    row: int
    reserved_slots: int
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Past:
    keys: list[np.ndarray]    # per layer [n, heads, T, Dh], views of the cache
    values: list[np.ndarray]
    lengths: np.ndarray       # [n] filled slots per row
    copied: bool = False      # keys and values are a copy of the rows, not views of the cache

    @property
    def valid(self) -> np.ndarray:
        """[n, T] bool: the filled slots (what an engine reading the past as it is must mask)."""
        return np.arange(self.keys[0].shape[2])[None] < self.lengths[:, None]


def _lazy_zeros(count: int) -> tuple[mmap.mmap, np.ndarray]:
    """`count` float32 zeros in private anonymous memory, resident only once written."""
    region = mmap.mmap(-1, max(1, count) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, np.frombuffer(region, np.float32, count)


def _give_back(region: mmap.mmap, start: int, stop: int) -> None:
    """Returns the whole pages inside floats [start, stop) of the region to the operating system;
    they read as zeros after."""
    first = -(-start * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
    last = stop * 4 // mmap.PAGESIZE * mmap.PAGESIZE
    if first < last:
        region.madvise(mmap.MADV_DONTNEED, first, last - first)


class KVCache:
    bucket_default = 64

    remembered_evictions = 1024  # evicted sequence ids kept, so their next step says so

    def __init__(self, layers: int, heads: int, head_dim: int, max_sequences: int, idle_timeout_s: float = 60.0,
                 bucket: int = bucket_default, max_row_slots: int | None = None, clock=time.monotonic,
                 kept_timeout_s: float = 600.0):
        self.layers, self.heads, self.head_dim, self.max_sequences = layers, heads, head_dim, max_sequences
        self.idle_timeout_s, self.bucket, self.clock = idle_timeout_s, bucket, clock
        self.kept_timeout_s = kept_timeout_s
        self.kept: dict[int, tuple[list[np.ndarray], list[np.ndarray], float]] = {}  # seq -> keys, values, kept at
        self.sequences: dict[int, _Sequence] = {}
        self.evicted: OrderedDict[int, None] = OrderedDict()
        self.row_owner: list[int] = []  # sequence id of each row in use
        self.lengths = np.zeros(max_sequences, np.int64)
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        widest = self._bucketed(max_row_slots) if max_row_slots else bucket
        self._regions, self._buffers = self._lazy_buffers(max_sequences * widest * heads * head_dim)
        self._allocate(bucket)
        self.evicted_total = 0
        self._lock = threading.Lock()

    @property
    def width(self) -> int:
        """T, the slots every row is laid out with now."""
        return self.keys[0].shape[2]

    @property
    def bytes(self) -> int:
        """The buffers' size: address space, resident only where slots were written."""
        return sum(buffer.nbytes for buffer in self._buffers)

    def reserve(self, seq_id: int, slots: int) -> int:
        """Gives the sequence a row and `slots` slots; returns its row."""
        with self._lock:
            if seq_id in self.sequences:
                raise AlreadyStarted(f"sequence {seq_id} already holds a cache")
            self._evict_idle_locked()
            if len(self.row_owner) == len(self.keys[0]):
                raise NoRoom(f"KV cache full: all {len(self.keys[0])} sequence rows are taken; retry later")
            row = len(self.row_owner)
            self.row_owner.append(seq_id)
            self.lengths[row] = 0
            self.sequences[seq_id] = _Sequence(row, slots, last_used=self.clock())
            self.evicted.pop(seq_id, None)
            return row

    def keep(self, seq_id: int) -> bool:
        """Releases the sequence's row but keeps a copy of its keys and values (the prefix cache's),
        outside the rows the engine reads, until `adopt` or `release` takes it; False when the
        sequence holds no row."""
        with self._lock:
            sequence = self.sequences.get(seq_id)
            if sequence is None:
                return False
            length = int(self.lengths[sequence.row])
            self.kept[seq_id] = ([k[sequence.row, :, :length].copy() for k in self.keys],
                                 [v[sequence.row, :, :length].copy() for v in self.values], self.clock())
            return self._release_locked(seq_id)

    def adopt(self, seq_id: int, donor_id: int, keep: int, slots: int) -> int:
        """Gives the sequence a row and `slots` slots whose first `keep` hold the kept copy of
        `donor_id` (`keep`); the copy is gone after. Returns the row."""
        with self._lock:
            kept = self.kept.pop(donor_id, None)
        if kept is None:
            raise PrefixGone(f"the kept prefix of sequence {donor_id} is gone (released, or kept "
                             f"longer than {self.kept_timeout_s:.0f} s)")
        if not 0 < keep <= min(kept[0][0].shape[1], slots):
            raise PrefixGone(f"cannot reuse {keep} slots of sequence {donor_id} ({kept[0][0].shape[1]} kept) in a "
                             f"reservation of {slots}; the copy is dropped")
        row = None
        try:
            row = self.reserve(seq_id, slots)
            self.make_room([row], keep)
        except Exception:
            with self._lock:
                self.kept[donor_id] = kept  # the caller may still release it
            if row is not None:
                self.release(seq_id)
            raise
        for arrays, copies in ((self.keys, kept[0]), (self.values, kept[1])):
            for array, copy in zip(arrays, copies):
                array[row, :, :keep] = copy[:, :keep]
        self.lengths[row] = keep
        return row

    def row(self, seq_id: int) -> int:
        sequence = self.sequences.get(seq_id)
        if sequence is None:
            lost = EvictedSequence if seq_id in self.evicted else UnknownSequence
            raise lost(f"sequence {seq_id} holds no KV cache (released, evicted after "
                       f"{self.idle_timeout_s:.0f} s idle, lost in a model reload, or never started)")
        sequence.last_used = self.clock()
        return sequence.row

    def length(self, seq_id: int) -> int:
        return int(self.lengths[self.row(seq_id)])

    def make_room(self, rows: list[int], new_slots: int) -> None:
        """Before `rows` get `new_slots` more slots each: checks their reservations and grows T
        to the next bucket when the longest would not fit."""
        for row in rows:
            self.check_room(row, new_slots)
        self._fit(int(max(self.lengths[row] for row in rows)) + new_slots)

    def fit_every_row(self, new_slots: int) -> None:
        """Grows T so that `new_slots` more fit after every row in use, reservation or not: for an
        engine that writes a step's keys into every row it reads, the rows not stepping included
        (past their lengths, where nothing live is)."""
        self._fit(int(self.lengths[:len(self.row_owner)].max(initial=0)) + new_slots)

    def _fit(self, slots: int) -> None:
        if slots > self.width:
            self._allocate(self._bucketed(slots))

    def advance(self, rows: list[int], new_slots: int) -> None:
        """Counts `new_slots` more filled slots in each of `rows`: an engine wrote them in place."""
        self.lengths[np.asarray(rows, np.int64)] += new_slots

    def discard(self, row: int, slots: int) -> None:
        """Drops the row's last `slots` slots (a rejected draft's); the next write goes there."""
        with self._lock:
            self.lengths[row] = max(0, int(self.lengths[row]) - slots)

    def check_room(self, row: int, new_slots: int) -> None:
        """Raises NoRoom when `new_slots` more would take the row beyond its reservation."""
        sequence = self.sequences[self.row_owner[row]]
        if self.lengths[row] + new_slots > sequence.reserved_slots:
            raise NoRoom(f"sequence {self.row_owner[row]} outgrew its reservation of "
                         f"{sequence.reserved_slots} pair slots")

    def past(self, one: int | None = None, rows: list[int] | None = None) -> Past:
        """The past of every row in use, or of row `one` alone: views, no copy; or of `rows`, in
        their order: a copy of theirs unless they are consecutive."""
        if rows is not None and not rows:
            raise ValueError("the past of no rows")
        if rows is not None and list(rows) != list(range(rows[0], rows[0] + len(rows))):
            span = np.asarray(rows)
        elif rows is not None:
            span = slice(rows[0], rows[0] + len(rows))
        else:
            span = slice(0, len(self.row_owner)) if one is None else slice(one, one + 1)
        lengths = self.lengths[span]
        return Past([k[span] for k in self.keys], [v[span] for v in self.values], lengths,
                    copied=not isinstance(span, slice))

    def compact(self) -> None:
        """Shrinks T back to the bucket that holds the longest sequence, once the long ones left."""
        longest = int(self.lengths[:len(self.row_owner)].max()) if self.row_owner else 0
        width = max(self.bucket, self._bucketed(longest))
        if width + 2 * self.bucket <= self.width:  # well below, so sizes do not flap at an edge
            self._allocate(width)

    def write(self, rows: list[int], keys: np.ndarray, values: np.ndarray) -> None:
        # keys, values: [L, B, heads, S, Dh], row i of the batch goes to cache row rows[i]
        new, rows_at = keys.shape[3], np.asarray(rows)
        if new == 1:  # a decode step: every row's slot at once, per layer
            slots = self.lengths[rows_at]
            for layer in range(self.layers):
                self.keys[layer][rows_at, :, slots] = keys[layer, :, :, 0]     # [B, heads, Dh]
                self.values[layer][rows_at, :, slots] = values[layer, :, :, 0]
        else:
            for index, row in enumerate(rows):
                start = int(self.lengths[row])
                for layer in range(self.layers):
                    self.keys[layer][row, :, start:start + new] = keys[layer, index]
                    self.values[layer][row, :, start:start + new] = values[layer, index]
        self.advance(rows, new)

    def release(self, seq_id: int) -> bool:
        with self._lock:
            if self.kept.pop(seq_id, None) is not None:
                return True
            return self._release_locked(seq_id)

    def evict_idle(self) -> list[int]:
        with self._lock:
            return self._evict_idle_locked()

    def _release_locked(self, seq_id: int) -> bool:
        sequence = self.sequences.pop(seq_id, None)
        if sequence is None:
            return False
        last = len(self.row_owner) - 1
        if sequence.row != last:  # keep rows dense: the last row moves into the freed one
            moved = self.row_owner[last]
            length = int(self.lengths[last])
            for arrays in (self.keys, self.values):
                for array in arrays:
                    array[sequence.row, :, :length] = array[last, :, :length]
            self.lengths[sequence.row] = length
            self.row_owner[sequence.row] = moved
            self.sequences[moved].row = sequence.row
        self.row_owner.pop()
        self.lengths[last] = 0
        self._give_back_unused([sequence.row] if sequence.row != last else [], last)
        return True

    def _evict_idle_locked(self) -> list[int]:
        now = self.clock()
        for seq_id in [k for k, (_, _, at) in self.kept.items() if now - at > self.kept_timeout_s]:
            del self.kept[seq_id]  # its owner, the loop's prefix cache, would have used or released it by now
        idle = [k for k, s in self.sequences.items() if now - s.last_used > self.idle_timeout_s]
        for seq_id in idle:
            self._release_locked(seq_id)
            self.evicted[seq_id] = None
        while len(self.evicted) > self.remembered_evictions:
            self.evicted.popitem(last=False)
        self.evicted_total += len(idle)
        return idle

    def _bucketed(self, slots: int) -> int:
        return self.bucket * math.ceil(slots / self.bucket)

    def _lazy_buffers(self, floats: int) -> tuple[list[mmap.mmap], list[np.ndarray]]:
        pairs = [_lazy_zeros(floats) for _ in range(2 * self.layers)]
        return [region for region, _ in pairs], [buffer for _, buffer in pairs]

    def _allocate(self, width: int) -> None:
        """Lays the rows out `width` slots wide, in place in the buffers (which grow, copied, only
        when a layout does not fit them), then gives back the pages that hold no live slot.

        In place, a row's new place may overlap where other rows are now: growing moves rows from
        the last one down, shrinking from the first one up, so no row is overwritten before it moved.
        """
        shape = (self.max_sequences, self.heads, width, self.head_dim)
        size = math.prod(shape)
        rows, old = len(self.row_owner), self.keys + self.values
        regions, buffers = self._regions, self._buffers
        if size > buffers[0].size:
            regions, buffers = self._lazy_buffers(size)
        layouts = [buffer[:size].reshape(shape) for buffer in buffers]
        order = range(rows - 1, -1, -1) if not old or width > old[0].shape[2] else range(rows)
        for new, before in zip(layouts, old):
            for row in order:
                length = int(self.lengths[row])
                new[row, :, :length] = before[row, :, :length]  # numpy copies through a buffer where they overlap
        self._regions, self._buffers = regions, buffers
        self.keys, self.values = layouts[:self.layers], layouts[self.layers:]
        self._give_back_unused(range(rows), rows)

    def _give_back_unused(self, rows, unused_from: int) -> None:
        """Gives the operating system back the pages of `rows` past their lengths, head by head,
        and every page from row `unused_from` on."""
        head_floats = self.width * self.head_dim
        for region in self._regions:
            for row in rows:
                for head in range(self.heads):
                    start = (row * self.heads + head) * head_floats
                    _give_back(region, start + int(self.lengths[row]) * self.head_dim, start + head_floats)
            _give_back(region, unused_from * self.heads * head_floats, len(region) // 4)
