"""The exported components on ONNX Runtime: batched cached runners and the in-process engine.

The runners own nothing but an engine session and a KV cache (`kv_pool.KVCache`); the Triton
backbone model and the in-process engine both drive the same runners. A step hands the engine
views of the cache rows (no copy) and writes back only its new keys and values; a backbone graph that
writes them into those views itself (`in_place_backbone_inputs`) leaves nothing to write back.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import numpy as np

from .decode import BackboneOutput, CapacityError
from .kv_pool import AlreadyStarted, EvictedSequence, KVCache, NoRoom, Past, PrefixGone, UnknownSequence
from .manifest import Manifest, ManifestError, verify_component, verify_siblings
from .tokenizer import TextTokenizer

COMPONENTS_DUALEND = ("tokenizer", "compressor", "backbone", "mtp")
COMPONENTS_BASELINE = ("tokenizer", "compressor", "backbone")
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # an imported model's specials and chat template; shipped: none

# 2: the past as one [B, heads, T, Dh] input per layer; 3: the same inputs and outputs, RoPE angles
# computed once per call and splits by constants (the backbone graph a third smaller; older exports are redone);
# 4: the past as [B, kv_heads, T, head_dim] (grouped-query attention), the settings name n_kv_heads and head_dim;
# 5: the backbone's logits and hidden at the last OUTPUT_POSITIONS positions, the MTP head over S new positions
EXPORT_FORMAT = 5
PREEMPTED_MESSAGE = "the step was given up for another client's first token"
OUTPUT_POSITIONS = 2  # a step that verifies a draft feeds [token, draft] and reads both positions
DEFAULT_MAX_SEQUENCES = 64  # KV cache rows of an in-process engine
# An MTP head carries its own output layer (d_model x vocab). From this many weights it runs on the
# backbone's threads: SmolLM2's (28M) steps in 6.4 ms on 2 threads vs 11.0 on one; the shipped
# pair's (0.26M) in 0.76 vs 0.71 (a step at batch 1, reports/bench_mtp_threads.txt).
MTP_THREADED_FROM_WEIGHTS = 4_000_000
BACKBONE_OUTPUTS = ("logits", "hidden", "present_keys", "present_values")
MTP_INPUTS = ("t1", "hidden", "positions", "past_valid", "past_keys", "past_values")
MTP_OUTPUTS = ("logits", "confidence", "present_keys", "present_values")


def backbone_inputs(layers: int) -> list[str]:
    return (["latents", "positions", "new_valid", "past_valid"] + [f"past_keys_{i}" for i in range(layers)]
            + [f"past_values_{i}" for i in range(layers)])


# The backbone graph that writes its new keys and values into the cache itself (builder.fused_backbone's,
# ONNX Runtime's GroupQueryAttention): each layer's past buffer [B, kv_heads, T, Dh] is bound as both its
# past input and its present output. Row b holds seqlens_k[b] + 1 - S filled slots before the call (S new
# latents a row, written after them), at positions counted from there; total_sequence_length is the
# longest row after the call.
def in_place_backbone_inputs(layers: int) -> list[str]:
    return (["latents", "seqlens_k", "total_sequence_length"] + [f"past_keys_{i}" for i in range(layers)]
            + [f"past_values_{i}" for i in range(layers)])


def in_place_backbone_outputs(layers: int) -> list[str]:
    return (["logits", "hidden"] + [f"present_keys_{i}" for i in range(layers)]
            + [f"present_values_{i}" for i in range(layers)])


# Beside it, the verifying graph (VERIFY_FILE, same inputs): two latents a row, each layer's attention one
# GroupQueryAttention a latent, the second reading what the first wrote, so every row's latent goes the
# way a one-latent step's goes (the same in the last bits) and any number of rows verify in one call.
# Its extra outputs, the buffers after the second attention, are bound to the same buffers.
VERIFY_FILE = "verify.onnx"
VERIFY_LATENTS = 2


def in_place_verify_outputs(layers: int) -> list[str]:
    return (in_place_backbone_outputs(layers) + [f"verified_keys_{i}" for i in range(layers)]
            + [f"verified_values_{i}" for i in range(layers)])


def ort_session(path: Path, threads: int | None = None, spin_between_runs: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Within a run the worker threads spin between the step's many small parallel sections (woken
    # from sleep each time, one served stream was ~8% slower in int4: reports/backbone_spinning/). After it they
    # stop at once unless `spin_between_runs`: several sessions and processes take turns every step,
    # and threads spinning in an idle one steal the cores from the one running (measured: decode
    # steps 2x slower on 2 cores). Only the in-process engine's backbone, alone, keeps spinning.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "0" if spin_between_runs else "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def verify_session(exported: "ExportedModel", threads: int | None = None):
    """ONNX Runtime's session of the export's verifying graph (VERIFY_FILE), or None where it has none."""
    path = exported.verify_path()
    return ort_session(path, threads) if path else None


@dataclass
class ExportedModel:
    """A verified set of exported components from one checkpoint."""
    directory: Path
    manifests: dict[str, Manifest]
    checkpoint_id: str

    @classmethod
    def open(cls, directory: str | Path, components: tuple[str, ...] | None = None) -> "ExportedModel":
        directory = Path(directory)
        if components is None:
            components = COMPONENTS_DUALEND if (directory / "mtp").exists() else COMPONENTS_BASELINE
        manifests = {name: verify_component(directory / name) for name in components}
        checkpoint_id = verify_siblings(list(manifests.values()))
        found = next(iter(manifests.values())).settings.get("export_format", 1)
        if found != EXPORT_FORMAT:
            raise ManifestError(f"{directory} was exported in format {found}, this code reads format {EXPORT_FORMAT}; "
                                f"export it again (python -m builder.assemble does)")
        return cls(directory, manifests, checkpoint_id)

    @property
    def settings(self) -> dict:
        return next(iter(self.manifests.values())).settings  # siblings agree (verified)

    @property
    def weight_precision(self) -> str:
        """How the backbone's weights are stored: fp32, int8, int4 or w8a8 (older exports: fp32); a quantized
        export's MTP head is at `weight_quantization["mtp_bits"]`."""
        return self.settings.get("weight_precision", "fp32")

    def path(self, component: str) -> Path:
        return self.directory / component / (TOKENIZER_FILE if component == "tokenizer" else MODEL_FILE)

    def verify_path(self) -> Path | None:
        """The backbone's verifying graph (VERIFY_FILE), where the export has one (verified with the rest)."""
        listed = "backbone" in self.manifests and VERIFY_FILE in self.manifests["backbone"].files
        return self.directory / "backbone" / VERIFY_FILE if listed else None

    def tokenizer(self) -> TextTokenizer:
        """With its tokenizer_config.json when the manifest lists one (so it was verified with the rest)."""
        config = self.directory / "tokenizer" / TOKENIZER_CONFIG_FILE
        listed = TOKENIZER_CONFIG_FILE in self.manifests["tokenizer"].files
        return TextTokenizer.from_json(self.path("tokenizer").read_text(encoding="utf-8"),
                                       config.read_text(encoding="utf-8") if listed else None)


@dataclass
class BackboneBatch:
    """One call to the backbone: new latents of several sequences, one segment each.

    A segment with `reserve_slots` > 0 starts its sequence (its first prefill chunk); a decode
    step is a segment of one latent, or of two when it verifies a draft (`verify`: the result then
    holds the outputs at each segment's latent before its last too). `discard` (empty: none): per
    sequence, slots dropped from the end of its row before its segment goes in (a rejected draft's).
    `releases`: sequences whose blocks the caller's account (`kv_blocks.KVBlockManager`) freed; their rows are released before anything runs.
    A batch with a `preempt_id` holds decode steps only, and may come back PREEMPTED, with nothing run
    and nothing written: the caller feeds the same steps again later.
    `keeps`: sequences that ended whose keys and values the cache keeps for the prefix cache
    (`KVCache.keep`), before the releases. `reuse_ids` / `reuse_slots` (empty: none): per sequence,
    a starting one may begin with that many slots of a kept sequence's copy (its id, 0: none; a
    prefix-cache hit); its segment then continues from there.
    """
    sequence_ids: list[int]
    latents: np.ndarray          # [sum(counts), D], the segments one after the other
    counts: list[int]            # new latents per sequence
    reserve_slots: list[int]     # per sequence: KV slots to reserve at its start, else 0
    releases: list[int]
    keeps: list[int] = field(default_factory=list)
    reuse_ids: list[int] = field(default_factory=list)
    reuse_slots: list[int] = field(default_factory=list)
    discard: list[int] = field(default_factory=list)
    verify: bool = False
    preempt_id: int = 0  # not 0: a decode step the caller may give up while it runs (`BackboneRunner.preempt`)

    def reuse(self, index: int) -> tuple[int, int]:
        """(kept sequence, slots of it to reuse) for sequence `index`; (0, 0) when it reuses nothing."""
        if not self.reuse_slots or not self.reuse_slots[index]:
            return 0, 0
        return self.reuse_ids[index], self.reuse_slots[index]


class SequenceStatus(IntEnum):
    """How one sequence's part of a backbone call went (an INT32 over BLS)."""
    OK = 0
    UNKNOWN_SEQUENCE = 1  # it holds no cache: released, lost in a model reload, or never started
    EVICTED = 2           # its cache was evicted after idling
    NO_ROOM = 3           # no cache row left, or a step beyond its reservation
    ALREADY_STARTED = 4   # a first chunk for a sequence that holds a cache
    ENGINE_FAILED = 5     # the engine call it was in raised
    PREFIX_GONE = 6       # the kept prefix it was to reuse is gone: nothing was reserved, start it afresh
    PREEMPTED = 7         # its step was given up for another's (`BackboneRunner.preempt`): nothing ran, feed it again


_KV_ERRORS = ((EvictedSequence, SequenceStatus.EVICTED), (UnknownSequence, SequenceStatus.UNKNOWN_SEQUENCE),
              (NoRoom, SequenceStatus.NO_ROOM), (AlreadyStarted, SequenceStatus.ALREADY_STARTED))


@dataclass
class BackboneResult:
    logits: np.ndarray             # [B, V] at each segment's last latent
    hidden: np.ndarray             # [B, D]
    status: list[SequenceStatus]   # per sequence
    messages: list[str]            # per sequence, for humans: "" when OK
    verify_logits: np.ndarray | None = None  # [B, V] at each segment's latent before its last (batch.verify)
    verify_hidden: np.ndarray | None = None  # [B, D]

    def failed(self, index: int) -> bool:
        return self.status[index] != SequenceStatus.OK

    def fail(self, index: int, status: SequenceStatus, message: str) -> None:
        self.status[index], self.messages[index] = status, message


class BackboneRunner:
    """Prefill chunks and batched decode steps over the backbone engine; KV lives in `cache`. An export
    whose backbone writes its keys in place may bring its verifying graph (`verify_session`): every
    two-latent call then runs there, all its rows at once.

    A batch with a `preempt_id` may be given up from another thread (`preempt`) while it runs, on
    ONNX Runtime (its run is told to stop between two nodes) or before it starts; its sequences then
    come back PREEMPTED, their keys and values unwritten."""

    def __init__(self, session, cache: KVCache, vocab_size: int, d_model: int, verify_session=None):
        self.session, self.cache, self.verify_session = session, cache, verify_session
        self.vocab_size, self.d_model = vocab_size, d_model
        self.input_names = backbone_inputs(cache.layers)
        graph_inputs = {value.name for value in session.get_inputs()} if hasattr(session, "get_inputs") else set()
        self.writes_in_place = "seqlens_k" in graph_inputs  # see in_place_backbone_inputs
        self._bindings = {}  # _cache_binding's: per session, (binding, the buffers it binds)
        self._preempting = threading.Lock()
        self._running_id, self._run_options, self._given_up = 0, None, 0  # the preemptible run now, one given up early

    def preempt(self, preempt_id: int) -> None:
        """Gives up the batch of `preempt_id` if it runs now or has not started yet (any thread)."""
        with self._preempting:
            if self._running_id == preempt_id and self._run_options is not None:
                self._run_options.terminate = True
            elif self._running_id != preempt_id:
                self._given_up = max(self._given_up, preempt_id)  # its call has not reached the runner yet

    def prefill(self, seq_id: int, latents: np.ndarray, reserve_slots: int) -> BackboneOutput:
        # latents: [n, D]
        return self._single(self.run_batch(BackboneBatch([seq_id], latents, [len(latents)],
                                                         [max(reserve_slots, len(latents))], [])))

    def step(self, seq_ids: list[int], latents: np.ndarray) -> list[BackboneOutput]:
        # latents: [B, D], one new pair per sequence
        result = self.run_batch(BackboneBatch(seq_ids, latents, [1] * len(seq_ids), [0] * len(seq_ids), []))
        failed = [i for i in range(len(seq_ids)) if result.failed(i)]
        if failed:
            raise RuntimeError(result.messages[failed[0]])
        return [BackboneOutput(result.logits[i], result.hidden[i]) for i in range(len(seq_ids))]

    def release(self, seq_id: int) -> bool:
        return self.cache.release(seq_id)

    @staticmethod
    def _single(result: BackboneResult) -> BackboneOutput:
        if result.failed(0):
            raise (CapacityError if result.status[0] == SequenceStatus.NO_ROOM else RuntimeError)(result.messages[0])
        return BackboneOutput(result.logits[0], result.hidden[0])

    def run_batch(self, batch: BackboneBatch) -> BackboneResult:
        """Every single-latent segment in one engine call (over all cache rows, or over its own when
        they are at most half of them), or in the verifying call where drafts are verified beside
        them (`_ride_along`); each longer prefill chunk in its own. A sequence that fails (unknown,
        evicted, no room) fails alone, with its status and message."""
        for seq_id in batch.keeps:
            self.cache.keep(seq_id)
        for seq_id in batch.releases:
            self.cache.release(seq_id)
        self.cache.compact()
        size = len(batch.sequence_ids)
        result = BackboneResult(np.zeros((size, self.vocab_size), np.float32),
                                np.zeros((size, self.d_model), np.float32), [SequenceStatus.OK] * size, [""] * size)
        if not batch.preempt_id:
            return self._run_groups(batch, result, None)
        if any(count != 1 for count in batch.counts) or any(batch.reserve_slots) or batch.discard or batch.verify:
            raise ValueError("a preemptible batch holds one-latent decode steps only")
        options = _run_options(self.session)
        with self._preempting:
            given_up, self._given_up = self._given_up == batch.preempt_id, 0
            self._running_id, self._run_options = batch.preempt_id, options
        try:
            if not given_up:
                return self._run_groups(batch, result, options)
            for index in range(size):
                result.fail(index, SequenceStatus.PREEMPTED, PREEMPTED_MESSAGE)
            return result
        finally:
            with self._preempting:
                self._running_id, self._run_options = 0, None

    def _run_groups(self, batch: BackboneBatch, result: BackboneResult, run_options) -> BackboneResult:
        if batch.verify:
            result.verify_logits, result.verify_hidden = np.zeros_like(result.logits), np.zeros_like(result.hidden)
        starts = np.concatenate([[0], np.cumsum(batch.counts)]).astype(int)
        steps, chunks, started, rows = {}, [], [], {}
        for index, (seq_id, reserve) in enumerate(zip(batch.sequence_ids, batch.reserve_slots)):
            try:
                donor, keep = batch.reuse(index)
                if reserve > 0 and keep:
                    try:
                        rows[index] = self.cache.adopt(seq_id, donor, keep, max(reserve, keep + batch.counts[index]))
                    except PrefixGone as error:
                        result.fail(index, SequenceStatus.PREFIX_GONE, str(error).strip("'\""))
                        continue
                    started.append(index)
                elif reserve > 0:
                    rows[index] = self.cache.reserve(seq_id, max(reserve, batch.counts[index]))
                    started.append(index)
                else:
                    rows[index] = self.cache.row(seq_id)
                    if batch.discard and batch.discard[index]:
                        self.cache.discard(rows[index], batch.discard[index])
                self.cache.check_room(rows[index], batch.counts[index])
            except tuple(kind for kind, _ in _KV_ERRORS) as error:
                status = next(status for kind, status in _KV_ERRORS if isinstance(error, kind))
                result.fail(index, status, str(error).strip("'\""))
                continue
            if batch.counts[index] <= OUTPUT_POSITIONS:
                steps.setdefault(batch.counts[index], []).append(index)
            else:
                chunks.append(index)
        latents = np.asarray(batch.latents, np.float32)
        riding = self._ride_along(steps, rows)

        def segment(index: int) -> np.ndarray:
            own = latents[starts[index]:starts[index + 1]]
            return np.vstack([own, np.zeros_like(own)]) if index in riding else own  # a rider's dummy latent

        groups = [steps[count] for count in sorted(steps)] + [[index] for index in chunks]
        for indices in groups:
            try:
                segments = [segment(i) for i in indices]
                outputs = (self._decode([rows[i] for i in indices], segments, run_options)
                           if len(segments[0]) <= OUTPUT_POSITIONS else [self._chunk(rows[indices[0]], segments[0])])
            except Exception as error:  # noqa: BLE001 - the group fails, the other groups run
                preempted = run_options is not None and run_options.terminate
                for index in indices:
                    result.fail(index, *((SequenceStatus.PREEMPTED, PREEMPTED_MESSAGE) if preempted else
                                         (SequenceStatus.ENGINE_FAILED, f"backbone engine failed: {error}")))
                continue
            for index, (logits, hidden) in zip(indices, outputs):  # [n, V], [n, D]: the last n positions
                if index in riding:  # its own latent's outputs; the dummy's slot goes
                    result.logits[index], result.hidden[index] = logits[-2], hidden[-2]
                    self.cache.discard(rows[index], 1)
                    continue
                result.logits[index], result.hidden[index] = logits[-1], hidden[-1]
                if batch.verify and len(logits) > 1:
                    result.verify_logits[index], result.verify_hidden[index] = logits[-2], hidden[-2]
        for index in started:  # a sequence whose first chunk failed holds nothing
            if result.failed(index):
                self.cache.release(batch.sequence_ids[index])
        return result

    def _ride_along(self, steps: dict[int, list[int]], rows: dict[int, int]) -> set[int]:
        """Moves the one-latent steps of a batch that also runs two-latent ones (drafts verified, or a
        two-latent prompt's start) into their call on the verifying graph, each with a dummy second
        latent whose slot is dropped after: one engine call instead of two, and the same bits for them
        (the verifying graph's first latent is computed as a one-latent step's). A row with no room for
        the dummy's slot in its reservation steps apart. Returns the batch indices moved."""
        if not (self._verifies(VERIFY_LATENTS) and 1 in steps and VERIFY_LATENTS in steps):
            return set()
        riding = set()
        for index in steps[1]:
            try:
                self.cache.check_room(rows[index], VERIFY_LATENTS)
            except NoRoom:
                continue
            riding.add(index)
        steps[1] = [index for index in steps[1] if index not in riding]
        if not steps[1]:
            del steps[1]
        steps[VERIFY_LATENTS] = sorted(steps[VERIFY_LATENTS] + list(riding))
        return riding

    def _decode(self, rows: list[int], segments: list[np.ndarray], run_options=None):
        """S new latents (the same S, at most OUTPUT_POSITIONS) for each of `rows`, in one call over
        every row in use: the rows not stepping get dummy latents, and their outputs and keys are dropped;
        or, when at most half the rows in use step (steps shared between clients), over theirs alone,
        from a copy of their past unless they are consecutive rows: cheaper than the others' rows on the CPU."""
        cache, new = self.cache, len(segments[0])
        if self.writes_in_place and new > 1 and len(rows) > 1 and not self._verifies(new):  # GroupQueryAttention: S > 1 after a past for one row a call
            return [output for row, segment in zip(rows, segments) for output in self._decode([row], [segment], run_options)]
        cache.make_room(rows, new)
        if 2 * len(rows) <= len(cache.row_owner):
            past = cache.past(rows=rows)
            logits, hidden, keys, values = self._run(np.stack(segments), past, run_options)
            self._keep_new(rows, past, keys, values, new)
            return list(zip(logits, hidden))
        if self.writes_in_place:  # the dummy latents' keys land past their rows' lengths too
            cache.fit_every_row(new)
        past = cache.past()
        latents = np.zeros((len(past.lengths), new, self.d_model), np.float32)  # [n, S, D]
        latents[rows] = np.stack(segments)
        logits, hidden, keys, values = self._run(latents, past, run_options)
        if keys is not None:
            keys, values = keys[:, rows], values[:, rows]
        self._keep_new(rows, past, keys, values, new)
        return [(logits[row], hidden[row]) for row in rows]

    def _chunk(self, row: int, latents: np.ndarray):
        # latents: [S, D], the next chunk of one sequence's prompt
        self.cache.make_room([row], len(latents))
        past = self.cache.past(one=row)
        logits, hidden, keys, values = self._run(latents[None], past)
        self._keep_new([row], past, keys, values, len(latents))
        return logits[0], hidden[0]

    def _keep_new(self, rows: list[int], past: Past, keys, values, new: int) -> None:
        """The `new` slots of `rows` into the cache: the portable graph's keys and values [L, B, heads,
        S, Dh], or, from a graph that wrote them into `past` (keys None), nothing to copy unless `past`
        was a copy of the rows."""
        if keys is None and not past.copied:
            self.cache.advance(rows, new)
            return
        if keys is None:
            slots, picked = past.lengths[:, None] + np.arange(new)[None], np.arange(len(rows))[:, None]
            keys, values = (np.stack([layer[picked, :, slots].transpose(0, 2, 1, 3) for layer in arrays])
                            for arrays in (past.keys, past.values))
        self.cache.write(rows, keys, values)

    def _run(self, latents: np.ndarray, past: Past, run_options=None):
        """latents [B, S, D] after `past` (views of the cache rows, or a copy) -> logits and hidden at
        the last OUTPUT_POSITIONS positions, and the new keys and values [L, B, heads, S, Dh], or None
        for both where the graph wrote them into `past` itself."""
        new = latents.shape[1]
        if self.writes_in_place:
            logits, hidden = self._run_in_place(latents, past, run_options)
            return logits, hidden, None, None
        positions = past.lengths[:, None] + np.arange(new)[None]
        feeds = dict(zip(self.input_names, (latents, positions.astype(np.int64), np.ones(latents.shape[:2], bool),
                                            past.valid, *past.keys, *past.values)))
        if run_options is None:
            return self.session.run(BACKBONE_OUTPUTS, feeds)
        return self.session.run(BACKBONE_OUTPUTS, feeds, run_options)

    def _run_in_place(self, latents: np.ndarray, past: Past, run_options) -> tuple[np.ndarray, np.ndarray]:
        new = latents.shape[1]
        session = self.verify_session if self._verifies(new) else self.session
        binding = self._cache_binding(session, past)
        binding.bind_output("logits")  # again: a bound output keeps the first run's shape
        binding.bind_output("hidden")
        binding.bind_cpu_input("latents", latents)
        binding.bind_cpu_input("seqlens_k", (past.lengths + new - 1).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(past.lengths.max() + new, np.int32))
        session.run_with_iobinding(binding, run_options)
        logits, hidden = binding.get_outputs()[:2]
        return logits.numpy(), hidden.numpy()

    def _verifies(self, new: int) -> bool:
        """Whether a call of `new` latents a row runs on the verifying graph."""
        return self.verify_session is not None and new == VERIFY_LATENTS

    def _cache_binding(self, session, past: Past):
        """An IO binding of `session` with each layer's past buffer bound as its present too (and as the
        verifying graph's buffers after its second attention: ONNX Runtime reads and writes the memory
        itself), kept while the cache rows it binds stay where they are (binding 60 buffers costs ~0.5 ms,
        a tenth of a step)."""
        import onnxruntime as ort

        where = (past.keys[0].ctypes.data, past.keys[0].shape, past.values[-1].ctypes.data)
        kept = self._bindings.get(id(session))
        if not past.copied and kept is not None and kept[1] == where:
            return kept[0]
        binding = session.io_binding()
        binding.bind_output("logits")  # outputs come back in the order they were bound
        binding.bind_output("hidden")
        presents = ("present", "verified") if session is self.verify_session else ("present",)  # in_place_verify_outputs
        for kind, buffers in (("keys", past.keys), ("values", past.values)):
            for layer, buffer in enumerate(buffers):
                value = ort.OrtValue.ortvalue_from_numpy(buffer)  # the buffer's own memory, no copy
                binding.bind_ortvalue_input(f"past_{kind}_{layer}", value)
                for present in presents:
                    binding.bind_ortvalue_output(f"{present}_{kind}_{layer}", value)
        if not past.copied:
            self._bindings[id(session)] = binding, where
        return binding


def _run_options(session):
    """ONNX Runtime's options for one run, whose `terminate` stops it between two nodes; None for
    engines that cannot be stopped (TensorRT: its steps are given up only before they start)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    return ort.RunOptions() if isinstance(session, ort.InferenceSession) else None


class MTPRunner:
    """MTP head steps for a batch of sequences per call; its one-layer KV cache per sequence
    lives in `cache`, read the same way as the backbone's."""

    def __init__(self, session, cache: KVCache):
        self.session, self.cache = session, cache

    def step(self, seq_id: int, t1: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        logits, confidence = self.step_batch([seq_id], np.array([t1]), np.asarray(hidden)[None], np.array([position]))
        return logits[0], float(confidence[0])

    def step_batch(self, seq_ids: list[int], t1: np.ndarray, hidden: np.ndarray,
                   positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # t1: [B] or [B, S]; hidden: [B, D] or [B, S, D]; positions like t1 -> the draft after each
        # row's last position: logits [B, V], confidence [B]
        t1, positions = np.asarray(t1).reshape(len(seq_ids), -1), np.asarray(positions).reshape(len(seq_ids), -1)
        hidden, new = np.asarray(hidden).reshape(len(seq_ids), -1, hidden.shape[-1]), t1.shape[1]
        cache = self.cache
        cache.compact()
        rows = [cache.row(s) for s in seq_ids]
        cache.make_room(rows, new)
        past = cache.past()
        n = len(past.lengths)
        t1_all, hidden_all = np.zeros((n, new), np.int64), np.zeros((n, new, hidden.shape[-1]), np.float32)
        positions_all = past.lengths[:, None] + np.arange(new)[None]
        t1_all[rows], hidden_all[rows], positions_all[rows] = t1, hidden, positions
        feeds = dict(zip(MTP_INPUTS, (t1_all, hidden_all, positions_all, past.valid, past.keys[0], past.values[0])))
        logits, confidence, keys, values = self.session.run(MTP_OUTPUTS, feeds)
        cache.write(rows, keys[:, rows], values[:, rows])
        return logits[rows], confidence[rows]


def kv_cache(settings: dict, layers: int, max_sequences: int, **options) -> KVCache:
    return KVCache(layers, settings["n_kv_heads"], settings["head_dim"], max_sequences, **options)


class _BackboneSession:
    def __init__(self, runner: BackboneRunner, seq_id: int):
        self.runner, self.seq_id = runner, seq_id

    def prefill(self, latents: np.ndarray, reserve_slots: int = 0) -> BackboneOutput:
        return self.runner.prefill(self.seq_id, latents, reserve_slots)

    def step(self, latent: np.ndarray) -> BackboneOutput:
        return self.runner.step([self.seq_id], latent[None])[0]

    def close(self) -> None:
        self.runner.release(self.seq_id)


class _MTPSession:
    def __init__(self, runner: MTPRunner, seq_id: int, max_steps: int):
        self.runner, self.seq_id = runner, seq_id
        runner.cache.reserve(seq_id, max_steps)

    def step(self, t1: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        return self.runner.step(self.seq_id, t1, hidden, position)

    def close(self) -> None:
        self.runner.cache.release(self.seq_id)


def mtp_threads(settings: dict, engine_threads: int | None) -> int | None:
    """Threads of the MTP head's session: the backbone's when its output layer is large, else one."""
    return engine_threads if settings["vocab_size"] * settings["d_model"] >= MTP_THREADED_FROM_WEIGHTS else 1


class MTPComponent:
    """Compressor and MTP head in-process: what mtp_verify and the engine both hold.

    The compressor reads one pair (one thread); the MTP head is one layer and an output layer, on
    `engine_threads` when that output layer is large (`mtp_threads`).
    """

    def __init__(self, exported: ExportedModel, max_sequences: int = DEFAULT_MAX_SEQUENCES,
                 engine_threads: int | None = None, **cache_options):
        settings = exported.settings
        self.pair_size, self.pad_id = settings["pair_size"], settings["pad_id"]
        self.eos_id, self.bos_id = settings["eos_id"], settings["bos_id"]
        self.compressor = ort_session(exported.path("compressor"), threads=1)
        self.mtp = None
        if "mtp" in exported.manifests:
            self.mtp = MTPRunner(ort_session(exported.path("mtp"), threads=mtp_threads(settings, engine_threads)),
                                 kv_cache(settings, 1, max_sequences, **cache_options))
        self._ids = itertools.count(1)

    def compress(self, tokens: np.ndarray) -> np.ndarray:
        # tokens: [n, pair_size] -> [n, D]
        return self.compressor.run(None, {"tokens": np.asarray(tokens, np.int64)})[0]

    def open_mtp(self, max_steps: int) -> _MTPSession:
        return _MTPSession(self.mtp, next(self._ids), max_steps)

    def mtp_pool_sequences(self) -> int:
        return 0 if self.mtp is None else len(self.mtp.cache.sequences)


class OnnxComponents(MTPComponent):
    """The in-process engine: every component on ONNX Runtime, no server."""

    def __init__(self, directory: str | Path, threads: int | None = None, max_sequences: int = DEFAULT_MAX_SEQUENCES):
        exported = ExportedModel.open(directory)
        super().__init__(exported, max_sequences, threads)
        self.exported = exported
        settings = exported.settings
        cache = kv_cache(settings, settings["n_layers"], max_sequences)
        # The only multi-threaded session in this process, so its threads may spin between steps; not
        # beside a verifying graph's session, whose steps alternate with its own.
        verify = verify_session(exported, threads)
        self.backbone = BackboneRunner(ort_session(exported.path("backbone"), threads, spin_between_runs=verify is None),
                                       cache, settings["vocab_size"], settings["d_model"], verify)

    def open_backbone(self) -> _BackboneSession:
        return _BackboneSession(self.backbone, next(self._ids))


class OnnxBatch:
    """Many prompts prefilled and then stepped together on the in-process engine: `reference.TorchBatch`'s
    `restart` / `step` on ONNX Runtime, with the export's own weights (int4 included), so what is
    recorded is what the served engine computes. Token-level exports only (one token a step); each
    prompt is a sequence of the engine's cache until `close`."""

    def __init__(self, engine: OnnxComponents, prompts: list[list[int]], max_steps: int):
        if engine.pair_size != 1:
            raise ValueError("OnnxBatch steps token-level exports only (pair_size 1)")
        self.engine, self.max_steps, self.steps = engine, max_steps, 0
        self.sessions: list[_BackboneSession] = []
        try:
            first = []
            for prompt in prompts:
                self.sessions.append(engine.open_backbone())
                tokens = np.asarray(prompt, np.int64)[:, None]
                first.append(self.sessions[-1].prefill(engine.compress(tokens), len(prompt) + max_steps))
        except BaseException:
            self.close()
            raise
        self.first = np.stack([o.logits for o in first]), np.stack([o.hidden for o in first])

    def restart(self) -> tuple[np.ndarray, np.ndarray]:
        """The logits [B, V] and hidden states [B, D] at each prompt's last token (copies); before the
        first step only (the cache keeps what the steps wrote)."""
        if self.steps:
            raise RuntimeError("an OnnxBatch restarts only before its first step")
        return self.first[0].copy(), self.first[1].copy()

    def step(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # tokens: [B, 1], one new token per row -> logits [B, V], hidden [B, D]
        if self.steps == self.max_steps:
            raise RuntimeError(f"OnnxBatch holds {self.max_steps} decode steps")
        outputs = self.engine.backbone.step([s.seq_id for s in self.sessions],
                                            self.engine.compress(np.asarray(tokens, np.int64)))
        self.steps += 1
        return np.stack([o.logits for o in outputs]), np.stack([o.hidden for o in outputs])

    def close(self) -> None:
        for session in self.sessions:
            session.close()
        self.sessions = []
