"""The one account of KV cache blocks, owned by the scheduler (as vLLM v1's scheduler owns its KV
cache manager): a sequence is given its blocks when it is admitted and gives them back exactly
once, when it ends, however it ends.

Only this account decides whether a sequence fits. The caches themselves (`kv_pool.KVCache`, the
backbone's in its own process, the MTP head's in the decode loop's) hold storage and do what they
are told: reserve a row for a sequence this account admitted, release it when the account freed it.

The capacity is a memory budget (`builder.assemble --kv-cache-mb`), in blocks of `block_size` slots.
Each sequence is charged its own reservation (its prompt and max_tokens, never the context's maximum)
and each kept copy its own size: the caches' memory follows the slots written (`kv_pool`), so one
long request takes its own blocks and nothing from the short ones beside it.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Hashable


def blocks_for(slots: int, block_size: int) -> int:
    """Blocks a reservation of `slots` pair slots takes (at least one)."""
    return max(1, math.ceil(slots / block_size))


class KVBlockManager:
    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity_blocks, self.block_size = capacity_blocks, block_size
        self._held: dict[Hashable, int] = {}  # sequence -> its blocks
        self._copies: dict[Hashable, int] = {}  # a copy kept outside the rows (the prefix cache's) -> its blocks

    def blocks_for(self, slots: int) -> int:
        return blocks_for(slots, self.block_size)

    @property
    def used_blocks(self) -> int:
        """The running sequences' reservations and the kept copies."""
        return sum(self._held.values()) + sum(self._copies.values())

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    def fits(self, slots: int, freeing: Collection[Hashable] = ()) -> bool:
        """Whether `slots` more fit, once the holders in `freeing` gave theirs back."""
        freed = sum(blocks for holders in (self._held, self._copies)
                    for holder, blocks in holders.items() if holder in freeing)
        return self.used_blocks - freed + self.blocks_for(slots) <= self.capacity_blocks

    def fits_copy(self, slots: int) -> bool:
        return self.used_blocks + self.blocks_for(slots) <= self.capacity_blocks

    def allocate_copy(self, holder: Hashable, slots: int) -> None:
        """Charges a copy of `slots` kept outside the rows; the caller checked `fits_copy`."""
        self._copies[holder] = self.blocks_for(slots)

    def allocate(self, sequence: Hashable, slots: int) -> None:
        """Gives `sequence` the blocks for `slots` slots; the caller checked `fits`."""
        if sequence in self._held:
            raise ValueError(f"{sequence!r} already holds {self._held[sequence]} KV blocks")
        if not self.fits(slots):
            raise ValueError(f"{self.blocks_for(slots)} KV blocks asked for, {self.free_blocks} free")
        self._held[sequence] = self.blocks_for(slots)

    def free(self, sequence: Hashable) -> bool:
        """Takes the sequence's (or copy's) blocks back; True the one time it held some."""
        return self._held.pop(sequence, None) is not None or self._copies.pop(sequence, None) is not None

    def __contains__(self, sequence: Hashable) -> bool:
        return sequence in self._held

    def __len__(self) -> int:
        return len(self._held)
