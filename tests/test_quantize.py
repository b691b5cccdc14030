"""builder.quantize: GGUF's block rules reproduce weights already on their grid, and the rewritten
graph (MatMulNBits plus the block-minimum correction) computes what the weight stands for; the
per-channel rule's graph computes its 8-bit codes on each row's own 8-bit activations."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from builder.quantize import (
    asymmetric_blocks,
    constant_weight_matmuls,
    dequantized,
    per_channel_codes,
    quantize_per_channel,
    quantize_weights,
    symmetric_blocks,
    weight_key,
)

BLOCK = 32


def q4_1_weight(k: int, n: int, seed: int = 0) -> np.ndarray:
    """[K, N] as a Q4_1 file stores it: per block of 32 along K, scale * q + minimum, q in 0..15
    with 0 and 15 both present (the block's own minimum and maximum)."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // BLOCK)
    codes = rng.integers(0, 16, (n, blocks, BLOCK))
    codes[:, :, 0], codes[:, :, 1] = 0, 15
    scales = rng.uniform(1e-3, 2e-2, (n, blocks, 1)).astype(np.float32)
    minimums = rng.uniform(-0.2, 0.0, (n, blocks, 1)).astype(np.float32)
    return (codes * scales + minimums).astype(np.float32).reshape(n, -1)[:, :k].T.copy()


def test_asymmetric_blocks_give_back_a_q4_1_weight():
    weight = q4_1_weight(128, 24)
    codes, scales, minimums = asymmetric_blocks(weight, BLOCK)
    assert codes.shape == (24, 4, BLOCK) and codes.max() == 15 and codes.min() == 0
    np.testing.assert_allclose(dequantized(codes, scales, minimums, 128), weight, rtol=0, atol=1e-6)


def test_a_tail_block_is_measured_on_its_real_weights():
    weight = q4_1_weight(128, 8)[:88]  # 2 whole blocks and 24 weights of a third
    codes, scales, minimums = asymmetric_blocks(weight, BLOCK)
    assert codes.shape == (8, 3, BLOCK) and not codes[:, 2, 24:].any()
    np.testing.assert_allclose(dequantized(codes, scales, minimums, 88), weight, rtol=0, atol=1e-6)


def test_symmetric_blocks_give_back_a_q8_0_weight():
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, (64, 16))
    codes[0], codes[BLOCK] = 127, -127  # each block's largest magnitude is 127 steps, as Q8_0 writes it
    weight = (codes * np.repeat(rng.uniform(1e-3, 1e-2, (2, 16)), BLOCK, 0)).astype(np.float32)
    stored, scales = symmetric_blocks(weight, BLOCK)
    np.testing.assert_allclose(dequantized(stored, scales, None, 64), weight, rtol=0, atol=1e-6)


def matmul_graph(tmp_path, weights: dict[str, np.ndarray], k: int, known_rank: bool = True, rows: tuple = ("b", "s")):
    """x [*rows, K] -> MatMul by each weight in turn (the last one has the vocabulary's width).
    Without `known_rank`, x is first reshaped by an input of unknown length (`shape`), so shape
    inference cannot tell the rank of what the first MatMul reads."""
    nodes, inits, source, width = [], [], "x", list(weights.values())[-1].shape[1]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*rows, k])]
    if not known_rank:
        inputs.append(helper.make_tensor_value_info("shape", TensorProto.INT64, ["rank"]))
        nodes.append(helper.make_node("Reshape", ["x", "shape"], ["reshaped"]))
        source = "reshaped"
    for index, (name, weight) in enumerate(weights.items()):
        inits.append(numpy_helper.from_array(weight, name))
        out = "logits" if index == len(weights) - 1 else f"h{index}"
        nodes.append(helper.make_node("MatMul", [source, name], [out], name=f"matmul_{name}"))
        source = out
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*rows, width])], inits)
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("k, known_rank, rows", [(96, True, ("b", "s")), (88, True, ("b", "s")), (96, False, ("b", "s")),
                                                  (88, False, ("b", "s")), (88, True, ("n",))],
                         ids=["whole blocks", "a short tail block", "input rank unknown", "a tail block, rank unknown",
                              "rows of tokens (one Gemm)"])
def test_quantized_graph_computes_the_stored_weights(tmp_path, k, known_rank, rows):
    hidden, vocab = q4_1_weight(k, 40, seed=2), np.random.default_rng(3).normal(0, 0.05, (40, 50)).astype(np.float32)
    path = matmul_graph(tmp_path, {"proj": hidden, "head": vocab}, k, known_rank, rows)
    quantize_weights(path, 4, BLOCK, accuracy_level=0, lm_head_outputs=50)  # fp32 activations: exact
    model = onnx.load(str(path))
    assert not constant_weight_matmuls(model)
    nbits = {node.name: {a.name: helper.get_attribute_value(a) for a in node.attribute}
             for node in model.graph.node if node.op_type == "MatMulNBits"}
    assert {attrs["bits"] for attrs in nbits.values()} == {4, 8}
    assert any(node.op_type == "Gemm" for node in model.graph.node) == (len(rows) == 1 and known_rank)
    head_codes, head_scales = symmetric_blocks(vocab, BLOCK)
    x = np.random.default_rng(4).normal(size=(2, 3, k)[-len(rows) - 1:]).astype(np.float32)
    feeds = {"x": x} if known_rank else {"x": x, "shape": np.array(x.shape, np.int64)}
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    want = (x @ hidden) @ dequantized(head_codes, head_scales, None, 40)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_an_unknown_bit_width_is_refused(tmp_path):
    path = matmul_graph(tmp_path, {"w": np.ones((32, 4), np.float32)}, 32)
    with pytest.raises(ValueError, match="3-bit weights: expected 4 or 8"):
        quantize_weights(path, 3, BLOCK, 4, lm_head_outputs=4)


def test_per_channel_codes_give_back_a_weight_on_their_grid():
    rng = np.random.default_rng(5)
    codes = rng.integers(-127, 128, (48, 6))
    codes[0] = 127  # each column's largest magnitude is 127 steps
    weight = (codes * rng.uniform(1e-3, 1e-2, 6)).astype(np.float32)
    stored, scales = per_channel_codes(weight)
    assert stored.dtype == np.int8 and scales.shape == (6,)
    np.testing.assert_allclose(stored * scales, weight, rtol=0, atol=1e-6)


def row_quantized(x: np.ndarray) -> np.ndarray:
    """Each row of x on its own 8-bit grid, as the per-channel rule's graph quantizes activations:
    step max |row| / 127, rounded half to even."""
    step = np.abs(x).max(-1, keepdims=True) / 127
    return np.round(x / step) * step


@pytest.mark.parametrize("rows", [("b", "s"), ("n",)], ids=["batch of sequences", "rows of tokens"])
def test_per_channel_graph_multiplies_each_rows_own_codes(tmp_path, rows):
    rng = np.random.default_rng(6)
    hidden, vocab = rng.normal(0, 0.05, (64, 40)).astype(np.float32), rng.normal(0, 0.05, (40, 50)).astype(np.float32)
    path = matmul_graph(tmp_path, {"proj": hidden, "head": vocab}, 64, rows=rows)
    quantize_per_channel(path)
    model = onnx.load(str(path))
    assert not constant_weight_matmuls(model)
    assert sum(node.op_type == "MatMulInteger" for node in model.graph.node) == 2
    x = rng.normal(size=(2, 3, 64)[-len(rows) - 1:]).astype(np.float32)
    x[..., 0, :] *= 100  # rows of very different size: each keeps a grid of its own
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    (hidden_codes, hidden_scales), (head_codes, head_scales) = per_channel_codes(hidden), per_channel_codes(vocab)
    want = row_quantized(row_quantized(x) @ (hidden_codes * hidden_scales)) @ (head_codes * head_scales)
    row_size = np.abs(want).max(-1, keepdims=True)
    np.testing.assert_allclose(got / row_size, want / row_size, rtol=0, atol=1e-4)
    one_row = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x[..., :1, :]})[0]
    np.testing.assert_array_equal(one_row, got[..., :1, :])  # a row's result does not depend on the others


def test_a_row_of_zeros_gives_zeros(tmp_path):
    path = matmul_graph(tmp_path, {"w": np.ones((32, 4), np.float32)}, 32, rows=("n",))
    quantize_per_channel(path)
    x = np.zeros((2, 32), np.float32)
    x[1] = 1
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, [[0] * 4, [32] * 4], rtol=1e-6)


def test_smoothing_by_calibrated_peaks_keeps_an_outlier_channel_from_coarsening_every_row(tmp_path):
    """One input channel 50x the others (as some of a language model's are): quantized per row, it sets
    every row's step, and the other channels lose their precision; divided out by the calibrated
    smoothing factors (and multiplied into the weight), it does not."""
    rng = np.random.default_rng(7)
    weight = rng.normal(0, 0.05, (64, 48)).astype(np.float32)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    x[:, 5] *= 50
    exact = x @ weight
    errors = {}
    for smoothed in (False, True):
        path = matmul_graph(tmp_path, {"w": weight}, 64, rows=("n",))
        quantize_per_channel(path, {weight_key(weight): np.abs(x).max(0)} if smoothed else None, strength=0.6)
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        errors[smoothed] = float(np.sqrt(((got - exact) ** 2).mean() / (exact ** 2).mean()))
    assert errors[True] < errors[False] / 2
    assert errors[True] < 0.008  # measured 0.004, against 0.017 unsmoothed


def test_smoothing_without_a_strength_is_refused(tmp_path):
    weight = np.ones((32, 4), np.float32)
    path = matmul_graph(tmp_path, {"w": weight}, 32, rows=("n",))
    with pytest.raises(ValueError, match="smoothing by input peaks needs a strength"):
        quantize_per_channel(path, {weight_key(weight): np.ones(32, np.float32)})
