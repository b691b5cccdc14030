"""The prefix cache: sequences that ended keep their backbone KV rows for a while, so that a new
request whose pairs begin with theirs (the next turn of a chat re-sends the whole conversation)
takes over one of those rows and prefills only the rest, as llama.cpp's slots keep their prompt
(`cache_prompt`) and vLLM reuses prefix blocks.

Engine-free: it knows each kept sequence's pairs (the token ids of every latent its row holds, in
order) and when it was kept. Matching is by pairs, never by latents, so it is exact: a row is reused
only up to the first pair that differs, and never for a request's last prompt pair (whose logits the
request needs). The scheduler (`scheduler.Scheduler`) charges kept rows to its KV account and evicts
them, oldest first, whenever running work needs their room: a kept row never delays an admission.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np


class PrefixCache:
    def __init__(self, max_entries: int, ttl_s: float, min_reuse: int = 1, clock=time.monotonic):
        self.max_entries, self.ttl_s, self.min_reuse, self.clock = max_entries, ttl_s, min_reuse, clock
        self._entries: OrderedDict[int, tuple[np.ndarray, str, float]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._entries

    def worth_keeping(self, pairs: np.ndarray) -> bool:
        """Whether a row holding `pairs` could ever be reused (a request reuses all but its last pair)."""
        return self.max_entries > 0 and len(pairs) > self.min_reuse

    def keep(self, seq_id: int, pairs: np.ndarray, salt: str = "") -> None:
        """Keeps the ended sequence's row, whose slots hold `pairs` ([n, pair_size] token ids), for
        requests of the same `salt` (a tenant's: nobody else can reuse it, nor learn it is there).
        The scheduler makes room first: at most max_entries, the oldest going first."""
        self._entries[seq_id] = (np.array(pairs, dtype=np.int64), salt, self.clock())

    def match(self, pairs: np.ndarray, salt: str = "") -> tuple[int, int] | None:
        """The kept sequence of the same salt sharing the longest prefix with `pairs`, and how many of
        its slots a request with these prompt pairs can reuse (at most all but its last pair); None
        below min_reuse."""
        pairs = np.asarray(pairs, dtype=np.int64)
        best = None
        for seq_id, (kept, kept_salt, _) in self._entries.items():
            span = min(len(kept), len(pairs) - 1)
            if kept_salt != salt or span < self.min_reuse:
                continue
            differs = np.flatnonzero((kept[:span] != pairs[:span]).any(axis=1))
            shared = int(differs[0]) if len(differs) else span
            if shared >= self.min_reuse and (best is None or shared > best[1]):
                best = (seq_id, shared)
        return best

    def take(self, seq_id: int) -> None:
        """The kept sequence's row goes to a new request (or is released): no longer kept."""
        del self._entries[seq_id]

    def kept(self) -> list[int]:
        return list(self._entries)

    def oldest(self, sparing: int | None = None) -> int | None:
        return next((seq_id for seq_id in self._entries if seq_id != sparing), None)

    def expired(self) -> list[int]:
        """Takes out the entries kept longer than ttl_s; returns them (their rows are to be released)."""
        now = self.clock()
        gone = [seq_id for seq_id, (_, _, kept_at) in self._entries.items() if now - kept_at > self.ttl_s]
        for seq_id in gone:
            del self._entries[seq_id]
        return gone
