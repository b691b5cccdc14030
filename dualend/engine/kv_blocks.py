"""The one account of KV cache blocks, owned by the scheduler (as vLLM v1's scheduler owns its KV
cache manager): a sequence is given its blocks when it is admitted and gives them back exactly
once, when it ends, however it ends.

Only this account decides whether a sequence fits. The caches themselves (`kv_pool.KVCache`, the
backbone's in its own process, the MTP head's in the decode loop's) hold storage and do what they
are told: reserve a row for a sequence this account admitted, release it when the account freed it.
"""
from __future__ import annotations

import math
from collections.abc import Hashable


def blocks_for(slots: int, block_size: int) -> int:
    """Blocks a reservation of `slots` pair slots takes (at least one)."""
    return max(1, math.ceil(slots / block_size))


class KVBlockManager:
    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity_blocks, self.block_size = capacity_blocks, block_size
        self._held: dict[Hashable, int] = {}  # sequence -> its blocks

    def blocks_for(self, slots: int) -> int:
        return blocks_for(slots, self.block_size)

    @property
    def used_blocks(self) -> int:
        return sum(self._held.values())

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    def fits(self, slots: int) -> bool:
        return self.blocks_for(slots) <= self.free_blocks

    def allocate(self, sequence: Hashable, slots: int) -> None:
        """Gives `sequence` the blocks for `slots` slots; the caller checked `fits`."""
        blocks = self.blocks_for(slots)
        if sequence in self._held:
            raise ValueError(f"{sequence!r} already holds {self._held[sequence]} KV blocks")
        if blocks > self.free_blocks:
            raise ValueError(f"{blocks} KV blocks asked for, {self.free_blocks} free")
        self._held[sequence] = blocks

    def free(self, sequence: Hashable) -> bool:
        """Takes the sequence's blocks back; True the one time it held some."""
        return self._held.pop(sequence, None) is not None

    def __contains__(self, sequence: Hashable) -> bool:
        return sequence in self._held

    def __len__(self) -> int:
        return len(self._held)
