"""Export parity (torch vs ONNX Runtime), manifests and version lock, and the KV pool."""
import ctypes
import json
import mmap
import shutil
import sys

import numpy as np
import onnx
import pytest
import torch

from builder.export import export_checkpoint, export_matches, weight_settings
from builder.quantize import constant_weight_matmuls
from dualend.engine.checkpoint import Checkpoint
from dualend.engine.decode import CapacityError, SamplingParams
from dualend.engine.kv_pool import AlreadyStarted, EvictedSequence, KVCache, NoRoom, UnknownSequence
from dualend.engine.manifest import ManifestError
from dualend.engine.onnx_engine import (
    MTP_THREADED_FROM_WEIGHTS,
    BackboneBatch,
    ExportedModel,
    OnnxComponents,
    mtp_threads,
)
from dualend.engine.reference import TorchComponents, reference_text
from dualend.serving.offline import generate_text

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
        ours = generate_text(engine, tiny_tokenizer, prompt, params, threshold)  # the decode loop, in-process
        theirs = reference_text(reference, tiny_tokenizer, prompt, params, threshold)  # the step-by-step oracle
        assert ours.tokens == theirs.tokens and ours.accepted == theirs.accepted
        assert len(ours.tokens) > 0


def test_an_mtp_head_with_a_large_output_layer_runs_on_the_engines_threads_a_small_one_on_one():
    smollm2 = {"vocab_size": 49152, "d_model": 576}
    assert smollm2["vocab_size"] * smollm2["d_model"] >= MTP_THREADED_FROM_WEIGHTS
    assert mtp_threads(smollm2, 2) == 2 and mtp_threads(smollm2, None) is None  # None: ONNX Runtime's default
    assert mtp_threads({"vocab_size": 1024, "d_model": 256}, 2) == 1  # the shipped pair's


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


def test_an_imported_tokenizer_config_travels_with_the_export_and_its_manifest(exported, tmp_path):
    """PAD/BOS/EOS, add_bos and the chat template of an imported model reach the served tokenizer."""
    from builder.assemble import up_to_date_export, write_hf_tokenizer
    from dualend.engine.tokenizer import TextTokenizer

    checkpoint = exported["baseline"][0]
    config = {"pad_token": "<pad>", "bos_token": "<eos>", "eos_token": "<bos>", "add_bos_token": False,
              "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}
    tokenizer = TextTokenizer(checkpoint.tokenizer.tokenizer, config)
    Checkpoint(checkpoint.model, tokenizer).save(tmp_path / "checkpoint")
    before = up_to_date_export(tmp_path / "checkpoint", tmp_path / "export")
    assert "tokenizer_config.json" in before.manifests["tokenizer"].files
    served = before.tokenizer()
    assert (served.bos_id, served.eos_id, served.add_bos) == (tokenizer.bos_id, tokenizer.eos_id, False)
    assert served.render_chat([{"role": "user", "content": "hi"}]) == "[hi]"
    write_hf_tokenizer(before, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert (hf["bos_token"], hf["eos_token"], hf["add_bos_token"]) == ("<eos>", "<bos>", False)
    shipped = ExportedModel.open(exported["baseline"][1]).tokenizer()
    assert shipped.config is None and shipped.bos_id == checkpoint.tokenizer.bos_id

    # same weights, another tokenizer config: the export is redone (the checkpoint id covers weights only)
    Checkpoint(checkpoint.model, checkpoint.tokenizer).save(tmp_path / "checkpoint")
    again = up_to_date_export(tmp_path / "checkpoint", tmp_path / "export")
    assert again.checkpoint_id == before.checkpoint_id and again.tokenizer().config is None
    assert "tokenizer_config.json" not in again.manifests["tokenizer"].files


@pytest.fixture(scope="module")
def quantized(exported, tmp_path_factory):
    """The dual-end test model exported with fp32, int8, int4 and w8a8 weights: {precision: directory}."""
    root = tmp_path_factory.mktemp("quantized")
    for precision in ("fp32", "int8", "int4", "w8a8"):
        export_checkpoint(exported["dualend"][0], root / precision, weight_precision=precision)
    return {precision: root / precision for precision in ("fp32", "int8", "int4", "w8a8")}


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))


def test_quantized_backbone_and_mtp_logits_stay_near_fp32(quantized):
    """Measured on this model: relative RMS error of the backbone's logits 0.008 (int8), 0.03-0.08 (int4)
    and 0.008 (w8a8), of the MTP head's 0.011-0.012 (8 bits in all: mtp_bits), the same top token everywhere. The
    bounds leave a factor of two or more; the lower ones show the quantized weights are what ran."""
    engines = {precision: OnnxComponents(directory) for precision, directory in quantized.items()}
    latents = engines["fp32"].compress(np.arange(3, 3 + 60).reshape(-1, 2))
    logits, drafts, fp32_hidden = {}, {}, None
    for precision, engine in engines.items():  # fp32 first
        backbone, mtp = engine.open_backbone(), engine.open_mtp(32)
        outputs = [backbone.prefill(latents[:6], 30)] + [backbone.step(x) for x in latents[6:]]
        logits[precision] = np.stack([out.logits for out in outputs])  # [25, V]
        if fp32_hidden is None:
            fp32_hidden = [out.hidden for out in outputs]
        # the MTP head on fp32's hidden states, so only its own weights differ
        drafts[precision] = np.stack([mtp.step(5 + i, h, 2 * i + 12)[0] for i, h in enumerate(fp32_hidden)])
    errors = {}
    for precision, (low, high) in {"int8": (1e-3, 0.03), "int4": (0.01, 0.25), "w8a8": (1e-3, 0.03)}.items():
        errors[precision] = relative_rms(logits[precision], logits["fp32"])
        assert low < errors[precision] < high
        assert (logits[precision].argmax(-1) == logits["fp32"].argmax(-1)).mean() >= 0.9
    assert errors["int4"] > errors["int8"]
    assert 1e-3 < relative_rms(drafts["int8"], drafts["fp32"]) < 0.03
    assert 1e-3 < relative_rms(drafts["w8a8"], drafts["fp32"]) < 0.03
    np.testing.assert_array_equal(drafts["int4"], drafts["int8"])  # the same 8-bit head beside either backbone


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_every_constant_weight_matmul_of_backbone_and_mtp_is_quantized(exported, quantized, precision):
    vocab = exported["dualend"][0].config.vocab_size
    for component, count in (("backbone", 2 * 4 + 1), ("mtp", 8)):  # 4 per layer, the proj, 2 confidence, LM head
        bits = {"int8": 8, "int4": 4 if component == "backbone" else 8}[precision]  # the MTP head: 8 bits always
        model = onnx.load(str(quantized[precision] / component / "model.onnx"))
        assert constant_weight_matmuls(onnx.load(str(quantized["fp32"] / component / "model.onnx")))
        assert not constant_weight_matmuls(model)
        nbits = [node for node in model.graph.node if node.op_type == "MatMulNBits"]
        assert len(nbits) == count
        attributes = [{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} for node in nbits]
        head = [a for a in attributes if a["N"] == vocab]  # the LM head: the tied embedding's transpose
        assert len(head) == 1 and head[0]["bits"] == 8
        assert {(a["bits"], a["block_size"], a["accuracy_level"]) for a in attributes if a["N"] != vocab} == {(bits, 32, 4)}
        # A, codes, scales (symmetric); int4 adds zero points, its block minimums added beside it (Gemm, or MatMul + Add)
        assert sorted(len(node.input) for node in nbits) == sorted([3] + [3 if bits == 8 else 4] * (count - 1))


@pytest.mark.parametrize("precision", ["w8a8", "int4"])
def test_a_verifying_step_of_many_rows_computes_what_one_latent_steps_compute(quantized, precision):
    """The verifying graph: three sequences of different lengths verify in one call, and each row's two
    latents come out as two one-latent steps of the same rows compute them, keys and values included, to
    the last bit (each row's activations are quantized alone), so verified drafts keep the base's text."""
    engine = OnnxComponents(quantized[precision], max_sequences=8)
    runner = engine.backbone
    assert runner.verify_session is not None
    latents = engine.compress(np.arange(3, 3 + 40).reshape(-1, 2))  # 20 latents
    lengths, stepped, verified = [5, 9, 7], [1, 2, 3], [4, 5, 6]
    for seq_ids in (stepped, verified):
        for seq_id, length in zip(seq_ids, lengths):
            runner.prefill(seq_id, latents[:length], 16)
    new = np.stack([latents[length:length + 2] for length in lengths])  # [3, 2, D]
    first, second = runner.step(stepped, new[:, 0]), runner.step(stepped, new[:, 1])
    calls, run = [], runner.verify_session.run_with_iobinding
    runner.verify_session.run_with_iobinding = lambda *args: calls.append(args) or run(*args)
    result = runner.run_batch(BackboneBatch(verified, new.reshape(-1, new.shape[-1]), [2] * 3, [0] * 3, [], verify=True))
    assert not any(result.failed(i) for i in range(3)) and len(calls) == 1  # the three rows in one call
    compare = np.testing.assert_array_equal
    for index in range(3):
        compare(result.verify_logits[index], first[index].logits)
        compare(result.logits[index], second[index].logits)
    cache = runner.cache
    for stepped_id, verified_id, length in zip(stepped, verified, lengths):
        rows = cache.row(stepped_id), cache.row(verified_id)
        assert cache.length(stepped_id) == cache.length(verified_id) == length + 2
        for layer in cache.keys + cache.values:
            compare(layer[rows[1], :, :length + 2], layer[rows[0], :, :length + 2])


def test_one_latent_steps_ride_in_the_verifying_call_with_the_bits_of_a_step_alone(quantized):
    """Rows stepping one latent beside rows verifying a draft go into the verifying call with a dummy
    second latent: one call, outputs and keys to the last bit as their step alone computes them, the
    dummy's slot dropped. A row whose reservation has no room for the dummy steps in a call of its own."""
    engine = OnnxComponents(quantized["w8a8"], max_sequences=8)
    runner, cache = engine.backbone, engine.backbone.cache
    latents = engine.compress(np.arange(3, 3 + 40).reshape(-1, 2))  # 20 latents
    alone, verifying, riding, full = [1, 2], 3, [4, 5], 6
    for seq_id, length in zip(alone + [verifying] + riding, [5, 9, 7, 5, 9]):
        runner.prefill(seq_id, latents[:length], 16)
    runner.prefill(full, latents[:15], 16)  # one slot left: no room for a dummy
    new = latents[15:18]  # the two riding rows' latents, then the full row's
    reference = runner.step(alone, new[:2])
    calls, run = [], runner._run_in_place
    runner._run_in_place = lambda latents, *args: calls.append(latents.shape[:2]) or run(latents, *args)
    batch = BackboneBatch([riding[0], verifying, riding[1], full], np.vstack([new[:1], latents[7:9], new[1:]]),
                          [1, 2, 1, 1], [0] * 4, [], verify=True)
    result = runner.run_batch(batch)
    assert not any(result.failed(i) for i in range(4)), result.messages
    assert sorted(calls) == [(1, 1), (3, 2)]  # the riding rows with the verifying one; the full row apart
    for index, step in zip((0, 2), reference):
        np.testing.assert_array_equal(result.logits[index], step.logits)
        np.testing.assert_array_equal(result.hidden[index], step.hidden)
    for alone_id, riding_id, length in zip(alone, riding, [5, 9]):
        assert cache.length(riding_id) == cache.length(alone_id) == length + 1
        for layer in cache.keys + cache.values:
            np.testing.assert_array_equal(layer[cache.row(riding_id), :, :length + 1],
                                          layer[cache.row(alone_id), :, :length + 1])
    assert cache.length(verifying) == 9 and cache.length(full) == 16


def test_w8a8_multiplies_every_product_on_8_bit_codes_and_smooths_the_backbones(exported, quantized):
    for component, count in (("backbone", 2 * 4 + 1), ("mtp", 8)):
        model = onnx.load(str(quantized["w8a8"] / component / "model.onnx"))
        assert not constant_weight_matmuls(model) and not any(node.op_type == "MatMulNBits" for node in model.graph.node)
        products = [node for node in model.graph.node if node.op_type == "MatMulInteger"]
        weights = {tensor.name: tensor for tensor in model.graph.initializer}
        assert len(products) == count and all(weights[node.input[1]].data_type == onnx.TensorProto.INT8 for node in products)
        smoothed = [name for name in weights if name.endswith("_smoothing")]  # calibrated on the backbone's products
        assert len(smoothed) == (count if component == "backbone" else 0)
    w8a8 = ExportedModel.open(quantized["w8a8"])
    assert w8a8.settings["weight_quantization"]["op"] == "MatMulInteger"
    assert w8a8.settings["weight_quantization"]["calibration"]["text"] == "stdlib train split"
    assert export_matches(w8a8, exported["dualend"][0], "w8a8") and not export_matches(w8a8, exported["dualend"][0], "int8")


def test_the_manifests_name_the_weight_precision_and_an_export_matches_only_its_own(exported, quantized, tmp_path):
    checkpoint = exported["dualend"][0]
    int4, fp32 = ExportedModel.open(quantized["int4"]), ExportedModel.open(quantized["fp32"])
    assert int4.settings["weight_precision"] == int4.weight_precision == "int4"
    assert all(m.settings["weight_precision"] == "int4" for m in int4.manifests.values())
    assert fp32.weight_precision == "fp32"
    assert export_matches(int4, checkpoint, "int4") and not export_matches(int4, checkpoint, "fp32")
    assert export_matches(fp32, checkpoint) and not export_matches(fp32, checkpoint, "int4")
    assert int4.settings["weight_quantization"] == {"op": "MatMulNBits", "bits": 4, "block_size": 32,
                                                    "rule": "asymmetric, float block minimum",
                                                    "lm_head_bits": 8, "mtp_bits": 8, "accuracy_level": 4}
    assert int4.settings["backbone_graph"] == "onnxruntime-kv-in-place-with-verify" and "backbone_graph" not in fp32.settings
    assert int4.verify_path() is not None and fp32.verify_path() is None
    assert any(node.domain == "com.microsoft" and node.op_type == "GroupQueryAttention"
               for node in onnx.load(str(int4.path("backbone")), load_external_data=False).graph.node)
    assert "backbone_graph" not in weight_settings("int4", head_dim=24)  # GroupQueryAttention cannot: the portable graph
    # quantized exports from before the verifying graph, before the graph took its keys in place, or before
    # the fused graph: assemble exports them again
    for before in ("onnxruntime-kv-in-place", "onnxruntime-fused", None):
        int4 = ExportedModel.open(quantized["int4"])
        int4.manifests["tokenizer"].settings.pop("backbone_graph")
        if before:
            int4.manifests["tokenizer"].settings["backbone_graph"] = before
        assert not export_matches(int4, checkpoint, "int4")
    for setting, value in (("block_size", 128), ("mtp_bits", None)):  # made by other settings, or before the MTP
        int4 = ExportedModel.open(quantized["int4"])  # head's weights stayed at 8 bits
        int4.manifests["tokenizer"].settings["weight_quantization"][setting] = value
        assert not export_matches(int4, checkpoint, "int4")

    older = tmp_path / "older"  # exported before the setting existed: fp32
    shutil.copytree(quantized["fp32"], older)
    for component in ("tokenizer", "compressor", "backbone", "mtp"):
        path = older / component / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest["settings"]["weight_precision"]
        path.write_text(json.dumps(manifest))
    assert ExportedModel.open(older).weight_precision == "fp32"

    mixed = tmp_path / "mixed"
    shutil.copytree(quantized["fp32"], mixed)
    shutil.rmtree(mixed / "backbone")
    shutil.copytree(quantized["int4"] / "backbone", mixed / "backbone")
    with pytest.raises(ManifestError, match="weight_precision is fp32 in tokenizer but int4 in backbone"):
        ExportedModel.open(mixed)
    with pytest.raises(ValueError, match="weight_precision 'int2': expected one of fp32, int8, int4"):
        export_checkpoint(checkpoint, tmp_path / "int2", weight_precision="int2")


def cache(**options):
    settings = dict(layers=1, heads=1, head_dim=2, max_sequences=3, bucket=4)
    settings.update(options)
    return KVCache(**settings)


def filled(value, slots):
    return np.full((1, 1, 1, slots, 2), value, np.float32)  # [L, B, heads, S, Dh]


def test_kv_cache_reserves_what_it_is_told_and_refuses_only_a_step_past_a_reservation():
    """No block budget here (the scheduler's block manager keeps it): any reservation gets a row."""
    kv = cache()
    kv.reserve(1, 8)
    kv.reserve(2, 10_000)
    with pytest.raises(AlreadyStarted):
        kv.reserve(2, 8)
    kv.make_room([kv.row(1)], 3)
    kv.write([kv.row(1)], filled(1, 3), filled(1, 3))
    assert kv.length(1) == 3
    with pytest.raises(NoRoom, match="outgrew its reservation of 8"):
        kv.make_room([kv.row(1)], 6)
    assert kv.release(1) and not kv.release(1)
    with pytest.raises(UnknownSequence):
        kv.row(1)


def _rows_of_distinct_values(kv):
    """write(seq_id, start, count) fills slots with values that name the sequence, head and slot;
    expect(seq_id, length) checks them."""

    def write(seq_id, start, count):
        slots = np.arange(start, start + count, dtype=np.float32) + 100 * seq_id
        block = np.zeros((1, 1, 2, count, 2), np.float32)  # [L, B, heads, S, Dh]
        block[0, 0, 0, :, 0], block[0, 0, 1, :, 1] = slots, slots + 50
        kv.make_room([kv.row(seq_id)], count)
        kv.write([kv.row(seq_id)], block, -block)

    def expect(seq_id, length):
        keys = kv.past().keys[0][kv.row(seq_id)]
        slots = np.arange(length, dtype=np.float32) + 100 * seq_id
        assert np.array_equal(keys[0, :length, 0], slots) and np.array_equal(keys[1, :length, 1], slots + 50)
        assert np.array_equal(kv.past().values[0][kv.row(seq_id), 1, :length, 1], -(slots + 50))

    return write, expect


def test_a_cache_laid_out_for_its_widest_row_re_lays_rows_out_in_place_and_keeps_every_slot():
    """Rows of distinct values at several lengths survive growing and shrinking T inside the buffers
    laid out at start for max_sequences rows of max_row_slots (heads > 1, so a row's heads move too),
    never reallocated."""
    kv = cache(max_sequences=4, heads=2, bucket=4, max_row_slots=32)
    buffers = [b.ctypes.data for b in kv._buffers]
    assert kv.bytes == 2 * 4 * 32 * 2 * 2 * 4  # keys and values: rows x widest x heads x Dh x fp32
    write, expect = _rows_of_distinct_values(kv)
    for seq_id, length in ((1, 3), (2, 2), (3, 4)):
        kv.reserve(seq_id, 32)
        write(seq_id, 0, length)
    write(2, 2, 11)  # T grows from 4 to 16 with three rows in use
    assert kv.width == 16
    expect(1, 3), expect(2, 13), expect(3, 4)
    kv.release(2)
    kv.compact()  # back to 4, in place, rows moved up front
    assert kv.width == 4
    expect(1, 3), expect(3, 4)
    kv.reserve(4, 32)
    write(4, 0, 30)
    assert kv.width == 32 and [b.ctypes.data for b in kv._buffers] == buffers
    expect(1, 3), expect(3, 4), expect(4, 30)


def _resident_bytes(array: np.ndarray) -> int:
    """Resident bytes of the pages under the array (libc's mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    pages = -(-array.nbytes // mmap.PAGESIZE)
    vector = ctypes.create_string_buffer(pages)
    assert array.ctypes.data % mmap.PAGESIZE == 0
    if libc.mincore(array.ctypes.data, array.nbytes, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector.raw) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="residency is read with Linux's mincore")
def test_the_cache_holds_memory_for_the_slots_written_not_for_rows_times_the_widest():
    """One slot of one head is a page here (Dh 1024 floats), so residency counts slots: a row
    reserved 1,000 slots wide with 3 written holds ~3 pages a head; a long row's pages come back
    when it leaves, and stale slots past a row's length read as zeros after a re-layout."""
    page_floats = mmap.PAGESIZE // 4
    kv = cache(max_sequences=3, heads=2, head_dim=page_floats, bucket=4, max_row_slots=1000)
    layer_keys = kv._buffers[0]
    assert _resident_bytes(layer_keys) == 0

    def write(seq_id, count):
        block = np.ones((1, 1, 2, count, page_floats), np.float32)
        kv.make_room([kv.row(seq_id)], count)
        kv.write([kv.row(seq_id)], block, block)

    kv.reserve(1, 1000)
    write(1, 3)
    assert _resident_bytes(layer_keys) == 2 * 3 * mmap.PAGESIZE  # heads x slots written
    kv.reserve(2, 1000)
    write(2, 300)
    assert kv.width == 300 and _resident_bytes(layer_keys) == 2 * 303 * mmap.PAGESIZE
    kv.release(2)
    kv.compact()
    assert kv.width == 4 and _resident_bytes(layer_keys) == 2 * 3 * mmap.PAGESIZE
    kv.reserve(3, 8)
    write(3, 1)
    kv.discard(kv.row(3), 1)  # a rejected draft: stale until overwritten or re-laid out
    write(1, 5)  # T grows to 8: row 3's stale slot is not carried
    assert not kv.past().keys[0][kv.row(3)].any() and kv.past().keys[0][kv.row(1), :, :8].all()
    kv.release(3), kv.release(1)
    kv.reserve(4, 1000)
    write(4, 300)
    kv.reserve(5, 1000)
    write(5, 2)
    kv.release(4)  # the short row moves into the long one's place: the long one's pages come back
    assert kv.row(5) == 0 and _resident_bytes(layer_keys) == 2 * 2 * mmap.PAGESIZE


def test_a_cache_without_a_budget_grows_its_buffers_and_carries_every_row_over():
    kv = cache(max_sequences=4, heads=2, bucket=4)
    buffers = [b.ctypes.data for b in kv._buffers]
    write, expect = _rows_of_distinct_values(kv)
    for seq_id, length in ((1, 3), (2, 20)):
        kv.reserve(seq_id, 32)
        write(seq_id, 0, length)
    assert kv.width == 20 and [b.ctypes.data for b in kv._buffers] != buffers
    expect(1, 3), expect(2, 20)


def test_kv_cache_runs_out_of_rows_with_a_clear_error():
    kv = cache(max_sequences=1)
    kv.reserve(1, 2)
    with pytest.raises(CapacityError, match="all 1 sequence rows are taken"):
        kv.reserve(2, 2)


def test_kv_cache_evicts_idle_sequences_and_says_so_to_their_next_step():
    now = [0.0]
    kv = cache(idle_timeout_s=10, clock=lambda: now[0])
    kv.reserve(1, 8)
    now[0] = 11.0
    kv.reserve(2, 8)  # a caller that vanished cannot hold a row forever
    assert 1 not in kv.sequences and kv.evicted_total == 1
    with pytest.raises(EvictedSequence, match="holds no KV cache"):
        kv.row(1)
    with pytest.raises(UnknownSequence) as never:
        kv.row(3)
    assert type(never.value) is UnknownSequence


def test_the_past_is_a_view_of_the_cache_and_rows_stay_dense():
    kv = cache(max_sequences=4)
    for seq_id, length in ((1, 2), (2, 13), (3, 1)):
        row = kv.reserve(seq_id, 16)
        kv.make_room([row], length)
        kv.write([row], filled(seq_id, length), filled(-seq_id, length))
    past = kv.past()
    assert np.shares_memory(past.keys[0], kv.keys[0]) and past.keys[0].flags.c_contiguous
    assert past.keys[0].shape == (3, 1, 16, 2) and past.lengths.tolist() == [2, 13, 1]  # T grew to 4 buckets
    assert past.valid[0].tolist() == [True] * 2 + [False] * 14
    kv.release(1)  # the last row (sequence 3) moves into row 0
    assert kv.row(3) == 0 and kv.row(2) == 1 and kv.length(3) == 1
    assert kv.past().keys[0][0, 0, 0, 0] == 3 and kv.past().values[0][1, 0, 4, 0] == -2
    kv.release(2)
    kv.compact()  # the long one left: back to one bucket (well below 4), the short one's keys kept
    assert kv.width == 4 and kv.past().keys[0][0, 0, 0, 0] == 3


def test_the_past_of_some_rows_is_a_view_when_they_are_consecutive_and_a_copy_in_their_order_otherwise():
    kv = cache(max_sequences=4)
    for seq_id in (1, 2, 3):
        row = kv.reserve(seq_id, 16)
        kv.make_room([row], seq_id)
        kv.write([row], filled(seq_id, seq_id), filled(-seq_id, seq_id))
    consecutive = kv.past(rows=[1, 2])
    assert np.shares_memory(consecutive.keys[0], kv.keys[0]) and consecutive.lengths.tolist() == [2, 3]
    picked = kv.past(rows=[2, 0])
    assert not np.shares_memory(picked.keys[0], kv.keys[0])
    assert picked.keys[0][:, 0, 0, 0].tolist() == [3, 1] and picked.values[0][:, 0, 0, 0].tolist() == [-3, -1]
    assert picked.lengths.tolist() == [3, 1] and picked.valid.sum(axis=1).tolist() == [3, 1]


@pytest.mark.parametrize("shape", [
    dict(pair_size=2, position_stride=2),                              # a pair model, RoPE at each pair's second token
    dict(pair_size=1, n_kv_heads=2, qkv_bias=True, tie_embeddings=False, head_size=32),  # Qwen2-like grouped queries
])
def test_the_fused_backbone_graph_computes_what_the_model_code_does_and_writes_its_keys_in_place(tmp_path, shape):
    """builder.fused_backbone writes the backbone node by node for ONNX Runtime (quantized exports run
    it); the reference is the torch backbone, on rows of different lengths, for a decode step, a
    verifying step and a prefill chunk. Its keys and values go into the past's own buffers, after each
    row's filled slots, and nothing else there changes."""
    import onnxruntime as ort

    from builder.fused_backbone import write_backbone_graph
    from dualend.engine.model import LanguageModel, ModelConfig
    from dualend.engine.onnx_engine import in_place_backbone_inputs, in_place_backbone_outputs, ort_session

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, pad_id=0, bos_id=1, eos_id=2, d_model=64, n_layers=3, n_heads=4,
                      ffn_hidden=80, **shape)  # heads of 16 and 32: GroupQueryAttention takes multiples of 16
    model = LanguageModel(cfg).eval()
    with torch.no_grad():  # norms and biases away from their initial ones and zeros, so each is checked
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                parameter.add_(torch.randn_like(parameter) * 0.3)
    write_backbone_graph(model, tmp_path / "backbone.onnx")
    session = ort_session(tmp_path / "backbone.onnx", 2)
    inputs, outputs = in_place_backbone_inputs(cfg.n_layers), in_place_backbone_outputs(cfg.n_layers)
    rng = np.random.default_rng(0)
    for lengths, new in (([7, 3], 1), ([7], 2), ([5], 6), ([0, 0], 4), ([0, 4, 2], 1)):  # S > 1 after a past: one row
        batch, width = len(lengths), max(lengths) + new + 2
        cache = rng.standard_normal((2, cfg.n_layers, batch, cfg.kv_heads, width, cfg.head_dim)).astype(np.float32)
        before = cache.copy()
        latents = rng.standard_normal((batch, new, cfg.d_model)).astype(np.float32)
        binding = session.io_binding()
        binding.bind_output("logits")  # outputs come back in the order they were bound
        binding.bind_output("hidden")
        binding.bind_cpu_input("latents", latents)
        binding.bind_cpu_input("seqlens_k", (np.array(lengths) + new - 1).astype(np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(max(lengths) + new, np.int32))
        for past_name, present_name, buffer in zip(inputs[3:], outputs[2:], [*cache[0], *cache[1]]):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)
            binding.bind_ortvalue_input(past_name, value)
            binding.bind_ortvalue_output(present_name, value)
        session.run_with_iobinding(binding)
        logits, hidden = (value.numpy() for value in binding.get_outputs()[:2])

        positions = np.array(lengths)[:, None] + np.arange(new)[None]
        past_valid = np.arange(width)[None] < np.array(lengths)[:, None]
        with torch.no_grad():
            want_hidden, keys, values = model.backbone(
                torch.from_numpy(latents), torch.from_numpy(positions), torch.ones(batch, new, dtype=torch.bool),
                torch.from_numpy(before[0]), torch.from_numpy(before[1]), torch.from_numpy(past_valid), last=2)
            want_logits = model.lm_head(want_hidden)
        np.testing.assert_allclose(hidden, want_hidden.numpy(), atol=1e-4)
        np.testing.assert_allclose(logits, want_logits.numpy(), atol=1e-4)
        assert logits.shape == (batch, min(new, 2), cfg.vocab_size)
        for row, length in enumerate(lengths):
            written = slice(length, length + new)
            np.testing.assert_allclose(cache[0][:, row, :, written], keys.numpy()[:, row], atol=1e-4)
            np.testing.assert_allclose(cache[1][:, row, :, written], values.numpy()[:, row], atol=1e-4)
            untouched = np.ones(width, bool)
            untouched[written] = False
            assert np.array_equal(cache[:, :, row, :, untouched], before[:, :, row, :, untouched])


def test_a_runner_over_the_in_place_graph_answers_and_keeps_its_cache_as_over_the_portable_graph(tmp_path):
    """The same calls through BackboneRunner on both graphs of one model: prefill chunks, decode steps
    over every row and over some (consecutive: views; not: a copy whose new slots go back), verifying
    steps (GroupQueryAttention takes S > 1 after a past for one row at a time), a rejected draft's
    slots dropped, a release that moves a row, a prefix-cache copy adopted, the cache re-laid out
    wider; the outputs and every row's filled slots agree."""
    from builder.export import write_backbone
    from dualend.engine.model import LanguageModel, ModelConfig
    from dualend.engine.onnx_engine import BackboneBatch, BackboneRunner, ort_session

    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=97, pad_id=0, bos_id=1, eos_id=2, d_model=64, n_layers=2, n_heads=4, ffn_hidden=80,
                      pair_size=1, n_kv_heads=2)
    model = LanguageModel(cfg).eval()
    runners = {}
    for fused in (False, True):
        write_backbone(model, tmp_path / f"{fused}.onnx", fused=fused)
        cache = KVCache(cfg.n_layers, cfg.kv_heads, cfg.head_dim, max_sequences=5, bucket=4)
        runners[fused] = BackboneRunner(ort_session(tmp_path / f"{fused}.onnx", 2), cache, cfg.vocab_size, cfg.d_model)
    assert runners[True].writes_in_place and not runners[False].writes_in_place
    rng = np.random.default_rng(5)

    def both(ids, counts, reserve=None, **fields):
        latents = rng.standard_normal((sum(counts), cfg.d_model)).astype(np.float32)
        results = [runner.run_batch(BackboneBatch(ids, latents, counts, reserve or [0] * len(ids), [], **fields))
                   for runner in runners.values()]
        assert results[0].status == results[1].status == [0] * len(ids), results[1].messages
        np.testing.assert_allclose(results[1].logits, results[0].logits, atol=1e-4)
        np.testing.assert_allclose(results[1].hidden, results[0].hidden, atol=1e-4)
        if fields.get("verify"):
            np.testing.assert_allclose(results[1].verify_logits, results[0].verify_logits, atol=1e-4)

    both([1, 2, 3, 4], [6, 2, 1, 1], reserve=[40] * 4)        # a chunk; starts of 2 and 1 latents
    both([1, 2, 3, 4], [1, 1, 1, 1])                          # every row
    both([1, 3], [2, 2], verify=True)                          # verifying, one row at a time in place
    both([1, 3], [1, 1], discard=[1, 0])                       # rows 0 and 2: a copy of their past; a draft dropped
    both([2, 3], [1, 1])                                       # consecutive rows: views
    both([4], [5])                                             # a chunk after a past
    both([1, 3, 4], [1, 1, 1], keeps=[2])                      # 2 kept for the prefix cache, the last row moved
    both([5, 1, 3, 4], [3, 1, 1, 1], reserve=[40, 0, 0, 0], reuse_ids=[2, 0, 0, 0], reuse_slots=[3, 0, 0, 0])
    for _ in range(6):                                         # past the width of the first layouts
        both([1, 3, 4, 5], [1, 1, 1, 1])
    portable, in_place = (runner.cache for runner in runners.values())
    row_4 = portable.row(4)
    both([4], [portable.width - int(portable.lengths[row_4])])  # 4 fills its row to the width, then is not
    both([1, 3, 5], [1, 1, 1])                                  # stepped: its dummy slot needs a wider layout
    assert in_place.row_owner == portable.row_owner and in_place.lengths.tolist() == portable.lengths.tolist()
    assert in_place.width > 8
    for row, length in enumerate(portable.lengths[:len(portable.row_owner)]):
        for ours, theirs in zip(in_place.keys + in_place.values, portable.keys + portable.values):
            np.testing.assert_allclose(ours[row, :, :length], theirs[row, :, :length], atol=1e-4)
