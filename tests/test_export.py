"""Export parity (torch vs ONNX Runtime), manifests and version lock, and the KV pool."""
import json
import shutil

import numpy as np
import pytest
import torch

from builder.export import export_checkpoint
from dualend.checkpoint import Checkpoint
from dualend.decode import CapacityError, SamplingParams, generate_text
from dualend.kv_pool import KVPool, UnknownSequence, gather_past
from dualend.manifest import ManifestError
from dualend.onnx_engine import ExportedModel, OnnxComponents
from dualend.reference import TorchComponents

PROMPTS = ["Q: 1+2+3\nA:", "get ab\nA:", "def f(x):\n    return x + 1\nprint(f(2))\n# output:"]


@pytest.mark.parametrize("name", ["baseline", "dualend"])
def test_onnx_logits_match_torch(exported, name):
    checkpoint, directory = exported[name]
    engine, reference = OnnxComponents(directory), TorchComponents(checkpoint.model)
    pair = checkpoint.config.pair_size
    tokens = np.arange(3, 3 + 14 * pair).reshape(-1, pair) % checkpoint.config.vocab_size
    latents = engine.compress(tokens)
    np.testing.assert_allclose(latents, reference.compress(tokens), atol=1e-5)
    a, b = engine.open_backbone(), reference.open_backbone()
    outputs = [(a.prefill(latents[:9], 20), b.prefill(latents[:9]))]
    outputs += [(a.step(x), b.step(x)) for x in latents[9:]]
    for onnx_out, torch_out in outputs:
        np.testing.assert_allclose(onnx_out.logits, torch_out.logits, atol=1e-4)
        np.testing.assert_allclose(onnx_out.hidden, torch_out.hidden, atol=1e-4)


@pytest.mark.parametrize("name, threshold", [("baseline", 1.0), ("dualend", 0.5), ("dualend", -1.0),
                                             ("dualend", 1.0)])
def test_onnx_greedy_generation_equals_torch(exported, tiny_tokenizer, name, threshold):
    checkpoint, directory = exported[name]
    engine, reference = OnnxComponents(directory), TorchComponents(checkpoint.model)
    params = SamplingParams(max_tokens=24)
    for prompt in PROMPTS:
        ours = generate_text(engine, tiny_tokenizer, prompt, params, threshold)
        theirs = generate_text(reference, tiny_tokenizer, prompt, params, threshold)
        assert ours.tokens == theirs.tokens and ours.accepted == theirs.accepted
        assert len(ours.tokens) > 0


def test_batched_steps_match_single_steps(exported):
    checkpoint, directory = exported["dualend"]
    engine = OnnxComponents(directory)
    runner = engine.backbone
    latents = engine.compress(np.arange(3, 3 + 40).reshape(-1, 2))
    singles = {}
    for seq_id, length in ((1, 5), (2, 9), (3, 2)):
        runner.prefill(seq_id, latents[:length], 16)
        singles[seq_id] = runner.step([seq_id], latents[length][None])[0]
    for seq_id, length in ((11, 5), (12, 9), (13, 2)):
        runner.prefill(seq_id, latents[:length], 16)
    batched = runner.step([11, 12, 13], latents[[5, 9, 2]])
    for single, together in zip(singles.values(), batched):
        np.testing.assert_allclose(single.logits, together.logits, atol=1e-4)


def test_flipped_byte_is_refused_naming_the_file(exported, tmp_path):
    _, directory = exported["dualend"]
    copy = tmp_path / "dualend"
    shutil.copytree(directory, copy)
    path = copy / "backbone" / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="backbone.*model.onnx.*sha256"):
        OnnxComponents(copy)


def test_components_from_two_checkpoints_are_refused(exported, tmp_path):
    _, directory = exported["dualend"]
    copy = tmp_path / "mixed"
    shutil.copytree(directory, copy)
    manifest = json.loads((copy / "mtp" / "manifest.json").read_text())
    other = exported["dualend"][0].model
    with torch.no_grad():
        other.mtp.proj.weight[0, 0] += 1
    export_checkpoint(Checkpoint(other, exported["dualend"][0].tokenizer), tmp_path / "other")
    with torch.no_grad():
        other.mtp.proj.weight[0, 0] -= 1
    shutil.rmtree(copy / "mtp")
    shutil.copytree(tmp_path / "other" / "mtp", copy / "mtp")
    with pytest.raises(ManifestError, match="checkpoint mismatch.*mtp"):
        ExportedModel.open(copy)
    assert manifest["checkpoint_id"] != json.loads((copy / "mtp" / "manifest.json").read_text())["checkpoint_id"]


def test_kv_pool_reserves_refuses_and_frees():
    pool = KVPool((1, 1, 2), block_size=4, capacity_blocks=3)
    pool.reserve(1, 8)  # 2 blocks
    with pytest.raises(CapacityError, match="KV cache full.*2 blocks.*1 of 3 are free"):
        pool.reserve(2, 5)
    pool.reserve(3, 2)
    assert pool.free_blocks == 0
    pool.append(1, np.ones((3, 1, 1, 2)), np.ones((3, 1, 1, 2)))
    keys, _ = pool.past(1)
    assert keys.shape == (3, 1, 1, 2)
    assert pool.release(1) and pool.free_blocks == 2
    with pytest.raises(UnknownSequence):
        pool.past(1)


def test_kv_pool_evicts_idle_sequences():
    now = [0.0]
    pool = KVPool((1, 1, 2), block_size=4, capacity_blocks=2, idle_timeout_s=10, clock=lambda: now[0])
    pool.reserve(1, 8)
    now[0] = 11.0
    pool.reserve(2, 8)  # the idle one is evicted to make room
    assert 1 not in pool.sequences and pool.evicted_total == 1


def test_gather_past_pads_to_the_longest():
    pool = KVPool((1, 1, 1), block_size=4)
    for seq_id, length in ((1, 2), (2, 3)):
        pool.reserve(seq_id, 4)
        pool.append(seq_id, np.full((length, 1, 1, 1), seq_id), np.zeros((length, 1, 1, 1)))
    keys, _, valid, lengths = gather_past(pool, [1, 2])
    assert keys.shape == (2, 3, 1, 1, 1) and lengths.tolist() == [2, 3]
    assert valid.tolist() == [[True, True, False], [True, True, True]]
    assert keys[0, :, 0, 0, 0].tolist() == [1, 1, 0]
