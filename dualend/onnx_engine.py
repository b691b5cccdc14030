"""The exported components on ONNX Runtime: batched cached runners and the in-process engine.

The runners own nothing but an ONNX Runtime session and a KV pool; the Triton backbone model and
the in-process engine both drive the same runners, and the decode loop is `decode.generate`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .decode import BackboneOutput, CapacityError
from .kv_pool import KVPool, UnknownSequence, gather_past
from .manifest import Manifest, verify_component, verify_siblings
from .tokenizer import TextTokenizer

COMPONENTS_DUALEND = ("tokenizer", "compressor", "backbone", "mtp")
COMPONENTS_BASELINE = ("tokenizer", "compressor", "backbone")
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"

BACKBONE_INPUTS = ("latents", "positions", "new_valid", "past_keys", "past_values", "past_valid")
BACKBONE_OUTPUTS = ("logits", "hidden", "present_keys", "present_values")
MTP_INPUTS = ("t1", "hidden", "positions", "past_keys", "past_values", "past_valid")
MTP_OUTPUTS = ("logits", "confidence", "present_keys", "present_values")


def ort_session(path: Path, threads: int | None = None, spinning: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Several sessions take turns every step; threads spinning for work in an idle session would
    # steal the cores from the one running (measured: decode steps 2x slower on 2 cores).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


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
        return cls(directory, manifests, checkpoint_id)

    @property
    def settings(self) -> dict:
        return next(iter(self.manifests.values())).settings  # siblings agree (verified)

    def path(self, component: str) -> Path:
        return self.directory / component / (TOKENIZER_FILE if component == "tokenizer" else MODEL_FILE)

    def tokenizer(self) -> TextTokenizer:
        return TextTokenizer.from_json(self.path("tokenizer").read_text(encoding="utf-8"))


@dataclass
class BackboneBatch:
    """One call to the backbone: new latents of several sequences, one segment each.

    A segment with `reserve_slots` > 0 starts its sequence (its first prefill chunk); a decode
    step is a segment of one latent. `releases` are freed before anything runs.
    """
    sequence_ids: list[int]
    latents: np.ndarray          # [sum(counts), D], the segments one after the other
    counts: list[int]            # new latents per sequence
    reserve_slots: list[int]     # per sequence: KV slots to reserve at its start, else 0
    releases: list[int]


@dataclass
class BackboneResult:
    logits: np.ndarray           # [B, V] at each segment's last latent
    hidden: np.ndarray           # [B, D]
    errors: list[str]            # per sequence, "" when it ran


class BackboneRunner:
    """Prefill and batched decode steps over the backbone engine; KV lives in `pool`."""

    def __init__(self, session, pool: KVPool, vocab_size: int, d_model: int):
        self.session, self.pool = session, pool
        self.vocab_size, self.d_model = vocab_size, d_model

    def prefill(self, seq_id: int, latents: np.ndarray, reserve_slots: int) -> BackboneOutput:
        # latents: [n, D]
        self.pool.reserve(seq_id, max(reserve_slots, len(latents)))
        try:
            return self._run([seq_id], np.asarray(latents, np.float32)[None])[0]
        except BaseException:
            self.pool.release(seq_id)
            raise

    def step(self, seq_ids: list[int], latents: np.ndarray) -> list[BackboneOutput]:
        # latents: [B, D], one new pair per sequence
        return self._run(seq_ids, np.asarray(latents, np.float32)[:, None])

    def release(self, seq_id: int) -> bool:
        return self.pool.release(seq_id)

    def run_batch(self, batch: BackboneBatch) -> BackboneResult:
        """Every single-latent segment in one engine call; each longer prefill chunk in its own.
        A sequence that fails (cache full, unknown) fails alone, with its message in `errors`."""
        for seq_id in batch.releases:
            self.pool.release(seq_id)
        size = len(batch.sequence_ids)
        result = BackboneResult(np.zeros((size, self.vocab_size), np.float32),
                                np.zeros((size, self.d_model), np.float32), [""] * size)
        starts = np.concatenate([[0], np.cumsum(batch.counts)]).astype(int)
        singles, chunks, started = [], [], []
        for row, (seq_id, reserve) in enumerate(zip(batch.sequence_ids, batch.reserve_slots)):
            try:
                if reserve > 0:
                    self.pool.reserve(seq_id, max(reserve, batch.counts[row]))
                    started.append(row)
                else:
                    self.pool.get(seq_id)
            except (CapacityError, UnknownSequence, ValueError) as error:
                result.errors[row] = str(error).strip("'\"")
                continue
            (singles if batch.counts[row] == 1 else chunks).append(row)
        latents = np.asarray(batch.latents, np.float32)
        groups = ([singles] if singles else []) + [[row] for row in chunks]
        for rows in groups:
            segments = np.stack([latents[starts[r]:starts[r + 1]] for r in rows])  # [b, S, D]
            try:
                outputs = self._run([batch.sequence_ids[r] for r in rows], segments)
            except Exception as error:  # noqa: BLE001 - the group fails, the other groups run
                for row in rows:
                    result.errors[row] = f"backbone engine failed: {error}"
                continue
            for row, out in zip(rows, outputs):
                result.logits[row], result.hidden[row] = out.logits, out.hidden
        for row in started:  # a sequence whose first chunk failed holds nothing
            if result.errors[row]:
                self.pool.release(batch.sequence_ids[row])
        return result

    def _run(self, seq_ids: list[int], latents: np.ndarray) -> list[BackboneOutput]:
        # latents: [B, S, D]
        past_keys, past_values, past_valid, lengths = gather_past(self.pool, seq_ids)
        batch, new_len = latents.shape[:2]
        positions = lengths[:, None] + np.arange(new_len, dtype=np.int64)[None]
        feeds = dict(zip(BACKBONE_INPUTS, (latents, positions, np.ones((batch, new_len), bool),
                                           past_keys, past_values, past_valid)))
        logits, hidden, present_keys, present_values = self.session.run(BACKBONE_OUTPUTS, feeds)
        for row, seq_id in enumerate(seq_ids):
            self.pool.append(seq_id, present_keys[row], present_values[row])
        return [BackboneOutput(logits[row], hidden[row]) for row in range(batch)]


class MTPRunner:
    """MTP head steps, one or a batch of sequences per call; its own one-layer KV cache per
    sequence lives in `pool`."""

    def __init__(self, session, pool: KVPool):
        self.session, self.pool = session, pool

    def step(self, seq_id: int, t1: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        logits, confidence = self.step_batch([seq_id], np.array([t1]), np.asarray(hidden)[None], np.array([position]))
        return logits[0], float(confidence[0])

    def step_batch(self, seq_ids: list[int], t1: np.ndarray, hidden: np.ndarray,
                   positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # t1: [B]; hidden: [B, D]; positions: [B] -> logits [B, V], confidence [B]
        past_keys, past_values, past_valid, _ = gather_past(self.pool, seq_ids)
        feeds = dict(zip(MTP_INPUTS, (np.asarray(t1, np.int64)[:, None], np.asarray(hidden, np.float32)[:, None],
                                      np.asarray(positions, np.int64)[:, None], past_keys, past_values, past_valid)))
        logits, confidence, present_keys, present_values = self.session.run(MTP_OUTPUTS, feeds)
        for row, seq_id in enumerate(seq_ids):
            self.pool.append(seq_id, present_keys[row], present_values[row])
        return logits, confidence


def kv_slot_shape(settings: dict, layers: int) -> tuple[int, int, int]:
    return (layers, settings["n_heads"], settings["d_model"] // settings["n_heads"])


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
        runner.pool.reserve(seq_id, max_steps)

    def step(self, t1: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, float]:
        return self.runner.step(self.seq_id, t1, hidden, position)

    def close(self) -> None:
        self.runner.pool.release(self.seq_id)


class MTPComponent:
    """Compressor and MTP head in-process: what mtp_verify and the engine both hold.

    Both graphs are tiny (one pair, one layer), so they run on one thread without a pool.
    """

    def __init__(self, exported: ExportedModel):
        settings = exported.settings
        self.pair_size, self.pad_id = settings["pair_size"], settings["pad_id"]
        self.eos_id, self.bos_id = settings["eos_id"], settings["bos_id"]
        self.compressor = ort_session(exported.path("compressor"), threads=1)
        self.mtp = None
        if "mtp" in exported.manifests:
            self.mtp = MTPRunner(ort_session(exported.path("mtp"), threads=1),
                                 KVPool(kv_slot_shape(settings, 1)))
        self._ids = itertools.count(1)

    def compress(self, tokens: np.ndarray) -> np.ndarray:
        # tokens: [n, pair_size] -> [n, D]
        return self.compressor.run(None, {"tokens": np.asarray(tokens, np.int64)})[0]

    def open_mtp(self, max_steps: int) -> _MTPSession:
        return _MTPSession(self.mtp, next(self._ids), max_steps)

    def mtp_pool_sequences(self) -> int:
        return 0 if self.mtp is None else len(self.mtp.pool.sequences)


class OnnxComponents(MTPComponent):
    """The in-process engine: every component on ONNX Runtime, no server."""

    def __init__(self, directory: str | Path, threads: int | None = None, kv_capacity_blocks: int | None = None):
        exported = ExportedModel.open(directory)
        super().__init__(exported)
        self.exported = exported
        pool = KVPool(kv_slot_shape(exported.settings, exported.settings["n_layers"]),
                      capacity_blocks=kv_capacity_blocks)
        # The only multi-threaded session in this process, so its threads may spin between steps.
        self.backbone = BackboneRunner(ort_session(exported.path("backbone"), threads, spinning=True), pool,
                                       exported.settings["vocab_size"], exported.settings["d_model"])

    def open_backbone(self) -> _BackboneSession:
        return _BackboneSession(self.backbone, next(self._ids))
