"""The decode loop's metrics by phase, accumulated in-process and handed out as deltas.

Each call into Triton's metric API is a round trip to the server process (about as much as a
streamed response), so the loop records here, for free, and the Triton adapter pushes what
changed a few times a second: one increment per counter and per histogram bucket, whatever the
traffic. Histograms are cumulative buckets as Prometheus has them (`_bucket{le=...}`, `_sum`,
`_count`). `PoolMetrics` reports the backbone's KV storage.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from dualend.engine.kv_blocks import blocks_for

from .outcomes import REFUSALS as REFUSALS_BY_OUTCOME
from .outcomes import Outcome

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REFUSAL_REASONS = tuple(outcome.value for outcome in REFUSALS_BY_OUTCOME)  # the `reason` label

COUNTERS = {"dualend_output_tokens": "Tokens streamed to clients",
            "dualend_decode_steps": "Backbone decode steps",
            # vLLM's speculative-decoding names. One draft token per step: a draft is one token, and its
            # position is 0 (vLLM's per-position counter has that one position here).
            "dualend_spec_decode_num_drafts": "MTP drafts proposed (a pair model's: seen by its confidence gate; "
                                              "a draft head's: fed to the backbone and checked by it)",
            "dualend_spec_decode_num_draft_tokens": "Tokens in those drafts",
            "dualend_spec_decode_num_accepted_tokens": "Draft tokens accepted (by the confidence gate, or by the "
                                                       "backbone agreeing with them)",
            "dualend_prompt_raw_tokens": "Prompt tokens as users count them",
            "dualend_prompt_latents": "Prompt latents the backbone held",
            "dualend_requests_cancelled": "Requests cancelled by the client",
            "dualend_decode_steps_preempted": "Decode steps given up in flight for another client's first token "
                                              "(steps shared by client), fed again after it",
            "dualend_prefix_cache_queries": "Prompt latents looked up in the prefix cache (as vLLM's prefix_cache_queries)",
            "dualend_prefix_cache_hits": "Prompt latents whose KV the prefix cache held (as vLLM's prefix_cache_hits)"}
HISTOGRAMS = {"dualend_queue_seconds": ("Wait from arrival to the first prefill chunk", LATENCY_BUCKETS),
              "dualend_prefill_seconds": ("First prefill chunk to prompt in the KV cache", LATENCY_BUCKETS),
              "dualend_ttft_seconds": ("Arrival to the first token decoded and released, streamed or not (server side)", LATENCY_BUCKETS),
              "dualend_inter_token_seconds": ("Gap between tokens sent, one observation per token",
                                              LATENCY_BUCKETS),
              "dualend_iteration_seconds": ("One decode-loop iteration (backbone, MTP head, responses)",
                                            LATENCY_BUCKETS),
              "dualend_tokens_per_step": ("Tokens one decode step emitted (0 at EOS, 2 with an accepted draft)",
                                          (0, 1, 2))}
GAUGES = {"dualend_running_sequences": "Sequences in the decode loop (prefilling or decoding)",
          "dualend_waiting_requests": "Requests waiting in the admission queue",
          "dualend_kv_cache_usage": "Share of the KV budget the running requests' reservations and the prefix "
                                    "cache's kept copies hold, 0 to 1 (as vLLM's kv_cache_usage_perc)",
          "dualend_prefix_cache_entries": "Ended requests whose KV the prefix cache keeps",
          "dualend_synthetic_acceptance_rate": "Benchmark only: the rate at which a draw, not the confidence gate, "
                                               "accepts drafts; -1 when the gate decides"}
REFUSALS = ("dualend_requests_refused", "Requests refused or ended with an error, by reason")


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, cumulative, then +Inf
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        for index in range(bisect.bisect_left(self.bounds, value), len(self.counts)):
            self.counts[index] += times
        self.total += value * times


@dataclass
class Delta:
    counters: dict[str, float]
    histograms: dict[str, Histogram]
    gauges: dict[str, float]         # only those that changed
    refusals: dict[str, int]


class PhaseMetrics:
    """The decode loop's observer (`batch_loop.Observer`), kept in memory until `take()`."""

    def __init__(self):
        self._reset()
        self.gauges = dict.fromkeys(GAUGES, 0.0)
        self.gauges["dualend_synthetic_acceptance_rate"] = -1.0
        self._reported = dict.fromkeys(GAUGES, None)

    def _reset(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0.0)
        self.histograms = {name: Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}
        self.refusals = dict.fromkeys(REFUSAL_REASONS, 0)

    def take(self) -> Delta:
        """What happened since the last take, and the gauges that changed since."""
        changed = {k: v for k, v in self.gauges.items() if self._reported[k] != v}
        self._reported.update(changed)
        delta = Delta(self.counters, self.histograms, changed, self.refusals)
        self._reset()
        return delta

    def response(self, response) -> None:
        c = response.counters
        for name, key in (("dualend_output_tokens", "num_output_tokens"), ("dualend_decode_steps", "num_steps"),
                          ("dualend_spec_decode_num_drafts", "num_drafts"),
                          ("dualend_spec_decode_num_draft_tokens", "num_drafts"),
                          ("dualend_spec_decode_num_accepted_tokens", "num_accepted_drafts")):
            self.counters[name] += c[key]
        if response.finish_reason is not None:
            self.counters["dualend_prompt_raw_tokens"] += c["num_prompt_tokens"]
            self.counters["dualend_prompt_latents"] += c["num_prompt_latents"]

    def prefix_cache(self, latents: int, reused: int) -> None:
        self.counters["dualend_prefix_cache_queries"] += latents
        self.counters["dualend_prefix_cache_hits"] += reused

    def queued(self, seconds: float) -> None:
        self.histograms["dualend_queue_seconds"].observe(seconds)

    def prefilled(self, seconds: float) -> None:
        self.histograms["dualend_prefill_seconds"].observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.histograms["dualend_ttft_seconds"].observe(seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        self.histograms["dualend_inter_token_seconds"].observe(seconds, tokens)

    def step(self, tokens: int) -> None:
        self.histograms["dualend_tokens_per_step"].observe(tokens)

    def iteration(self, seconds: float) -> None:
        self.histograms["dualend_iteration_seconds"].observe(seconds)

    def refused(self, outcome: Outcome) -> None:
        self.refusals[outcome.value if outcome.value in self.refusals else Outcome.STEP_FAILED.value] += 1

    def cancelled(self) -> None:
        self.counters["dualend_requests_cancelled"] += 1

    def preempted(self) -> None:
        self.counters["dualend_decode_steps_preempted"] += 1

    def synthetic_acceptance(self, rate: float | None) -> None:
        """The deployment's synthetic acceptance rate (None: off, the gate decides)."""
        self.gauges["dualend_synthetic_acceptance_rate"] = -1.0 if rate is None else rate

    def flush(self, idle: bool, running: int, waiting: int, kv_usage: float = 0.0, kept: int = 0) -> None:
        """Called after every loop iteration, busy or idle; an exporter pushes `take()` from here."""
        self.gauges["dualend_running_sequences"], self.gauges["dualend_waiting_requests"] = running, waiting
        self.gauges["dualend_kv_cache_usage"], self.gauges["dualend_prefix_cache_entries"] = kv_usage, kept


POOL_GAUGES = {"dualend_kv_blocks_used": "KV cache blocks in use",
               "dualend_kv_blocks_free": "KV cache blocks free",
               "dualend_kv_live_sequences": "Sequences holding a KV cache"}
POOL_COUNTERS = {"dualend_sequences_evicted": "Sequences evicted after idling"}


class PoolMetrics:
    """The backbone's KV storage as metrics: the rows it holds, their reservations in blocks of the
    deployment's size, and its idle evictions. It reports; the scheduler's block manager decides.

    `family(name, description, kind)` makes a metric family of kind "gauge" or "counter" whose
    `Metric(labels=...)` can `set` and `increment` (`pb_utils.MetricFamily` in Triton)."""

    def __init__(self, family, labels: dict[str, str], pool, block_size: int, capacity_blocks: int):
        self.pool, self.block_size, self.capacity_blocks = pool, block_size, capacity_blocks
        self.families = [family(name, description, "gauge") for name, description in POOL_GAUGES.items()]
        self.families += [family(name, description, "counter") for name, description in POOL_COUNTERS.items()]
        self.used, self.free, self.live, self.evicted = (f.Metric(labels=labels) for f in self.families)
        self.reported = (None, None, None, 0)
        self.update()

    def update(self) -> None:
        """Only what changed: each metric call is a round trip to the server process."""
        used = sum(blocks_for(s.reserved_slots, self.block_size) for s in self.pool.sequences.values())
        now = (used, self.capacity_blocks - used, len(self.pool.sequences), self.pool.evicted_total)
        for metric, before, value in zip((self.used, self.free, self.live), self.reported, now):
            if value != before:
                metric.set(value)
        if now[3] != self.reported[3]:
            self.evicted.increment(now[3] - self.reported[3])
        self.reported = now
