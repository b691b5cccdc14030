"""Weight-only block quantization of an exported graph: every MatMul by a stored weight becomes
ONNX Runtime's MatMulNBits, blocks of `block_size` along the input dimension K.

Two block rules, the ones GGUF files use, so a checkpoint imported from such a file is stored on its
own grid again instead of being rounded a second time:
- 4 bits, asymmetric (Q4_1's rule): w = scale * q + block_min, q in 0..15, scale = (max - min) / 15.
  MatMulNBits' zero point is an integer (w = scale * (q - zero_point)), which cannot hold a float
  minimum, and its CPU kernels take float zero points only on a path that dequantizes the whole
  weight every call. So the minimum rides on a small correction beside it:
      A @ W = MatMulNBits(A; q, scale, zero point 0) + blocksum(A) @ block_min
  with blocksum(A) [.., K / block_size] the sum of A over each block, itself a product by a fixed 0/1
  matrix (one Gemm adds both to the MatMulNBits output where A is 2-D).
- 8 bits, symmetric (Q8_0's rule): w = scale * q, q in -127..127, scale = max|w| / 127 (stored as
  q + 128, MatMulNBits' default zero point for 8 bits).
An LM head (a weight with one output per vocabulary entry) keeps 8 bits at every precision: a tied
embedding is read one row per token elsewhere and GGUF files store it at 8 bits.

A third rule, `quantize_per_channel`, leaves MatMulNBits for ONNX's own MatMulInteger: every weight, LM
head included, at 8 bits with one scale per output column (w = scale * q, q in -127..127), and each
row of activations quantized to 8 bits at run time with a scale of its own (max |a| / 127):
    A @ W ~ (A / a_scale)_u8 @ q * a_scale * w_scale
ONNX Runtime multiplies 8-bit by 8-bit matrices on the CPU's integer matrix units (AMX, VNNI) where
MatMulNBits unpacks its blocks first: several times faster at 16 rows, alike at one
(reports/w8a8/). A row's scale is its own, so its result does not depend on the other rows of a batch.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ASYMMETRIC_BITS, SYMMETRIC_BITS = 4, 8
RULES = {ASYMMETRIC_BITS: "asymmetric, float block minimum", SYMMETRIC_BITS: "symmetric"}  # as manifests name them
PER_CHANNEL_RULE = "symmetric per output column, activations per row"
ACTIVATION_ZERO_POINT = 128  # MatMulInteger's fast kernels take unsigned activations: a + 128 in 0..255
LM_HEAD_BITS = 8


CORRECTION_WEIGHTS = ("_block_indicator", "_minimums")  # name suffixes of the block-minimum corrections' weights


def constant_weight_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """MatMul and Gemm nodes whose second input is a stored weight (an initializer), other than the
    small block-minimum corrections that 4-bit weights bring."""
    weights = {tensor.name for tensor in model.graph.initializer}
    return [node for node in model.graph.node if node.op_type in ("MatMul", "Gemm") and node.input[1] in weights
            and not node.input[1].endswith(CORRECTION_WEIGHTS)]


def _blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """weight [K, N] -> [N, K_blocks, block_size], K padded with zeros to whole blocks."""
    k, n = weight.shape
    padded = np.zeros((-(-k // block_size) * block_size, n), np.float32)
    padded[:k] = weight
    return padded.T.reshape(n, -1, block_size)


def symmetric_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [K, N] -> codes uint8 [N, K_blocks, block_size] (q + 128), scales [N, K_blocks]."""
    blocks = _blocks(weight, block_size)
    scales = np.abs(blocks).max(-1) / 127
    scales[scales == 0] = 1
    codes = np.clip(np.round(blocks / scales[..., None]), -127, 127) + 128
    return codes.astype(np.uint8), scales.astype(np.float32)


def asymmetric_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [K, N] -> codes uint8 [N, K_blocks, block_size] in 0..15, scales and minimums [N, K_blocks].
    A padded tail block is measured on its real weights only; its padding codes are 0."""
    k = weight.shape[0]
    blocks = _blocks(weight, block_size)
    real = (np.arange(blocks.shape[1] * block_size) < k).reshape(blocks.shape[1], block_size)  # [K_blocks, bs]
    minimums = np.where(real, blocks, np.inf).min(-1)
    maximums = np.where(real, blocks, -np.inf).max(-1)
    scales = (maximums - minimums) / 15
    scales[scales == 0] = 1
    codes = np.clip(np.round((blocks - minimums[..., None]) / scales[..., None]), 0, 15) * real
    return codes.astype(np.uint8), scales.astype(np.float32), minimums.astype(np.float32)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 2m] values 0..15 -> [..., m] bytes, the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def dequantized(codes: np.ndarray, scales: np.ndarray, minimums: np.ndarray | None, k: int) -> np.ndarray:
    """The weight [K, N] that codes and scales (and minimums, for asymmetric blocks) stand for."""
    if minimums is None:
        blocks = (codes.astype(np.float32) - 128) * scales[..., None]
    else:
        blocks = codes * scales[..., None] + minimums[..., None]
    return blocks.reshape(len(codes), -1)[:, :k].T


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, block_size: int, accuracy_level: int):
        self.model, self.block_size, self.accuracy_level = model, block_size, accuracy_level
        inferred = onnx.shape_inference.infer_shapes(model)
        self.ranks = {value.name: len(value.type.tensor_type.shape.dim)
                      for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
        self.new_weights: dict[str, onnx.TensorProto] = {}

    def weight(self, name: str, array: np.ndarray) -> str:
        self.new_weights[name] = numpy_helper.from_array(array, name)
        return name

    def nbits(self, node: onnx.NodeProto, codes: np.ndarray, scales: np.ndarray, bits: int, k: int,
              output: str, zero_points: np.ndarray | None = None) -> onnx.NodeProto:
        packed = _pack_nibbles(codes) if bits == 4 else codes
        inputs = [node.input[0], self.weight(f"{node.name}_codes", packed),
                  self.weight(f"{node.name}_scales", scales.reshape(-1))]
        if zero_points is not None:
            inputs.append(self.weight(f"{node.name}_zero_points", zero_points))
        return helper.make_node("MatMulNBits", inputs, [output], name=f"{node.name}_nbits", domain="com.microsoft",
                                K=k, N=codes.shape[0], bits=bits, block_size=self.block_size,
                                accuracy_level=self.accuracy_level)

    def minimum_correction(self, node: onnx.NodeProto, minimums: np.ndarray, k: int, partial: str) -> list[onnx.NodeProto]:
        """Nodes adding blocksum(A) @ minimums to `partial`, into the MatMul's own output: the block
        sums as A @ indicator ([K, K_blocks], 1 where row k is in block j; a tail block sums its real
        rows only), then one Gemm where A is 2-D, else a MatMul and an Add."""
        activations, name = node.input[0], node.name
        blocks = minimums.shape[1]
        indicator = f"k{k}_block{self.block_size}{CORRECTION_WEIGHTS[0]}"  # one per K, shared
        if indicator not in self.new_weights:
            array = np.zeros((k, blocks), np.float32)
            array[np.arange(k), np.arange(k) // self.block_size] = 1
            self.weight(indicator, array)
        sums = f"{name}_block_sums"
        minimums_weight = self.weight(f"{name}{CORRECTION_WEIGHTS[1]}", minimums.T.copy())
        nodes = [helper.make_node("MatMul", [activations, indicator], [sums], name=f"{name}_block_sums")]
        if self.ranks.get(activations) == 2:
            return nodes + [helper.make_node("Gemm", [sums, minimums_weight, partial], [node.output[0]],
                                             name=f"{name}_minimum_term")]
        return nodes + [helper.make_node("MatMul", [sums, minimums_weight], [f"{name}_minimum_term"],
                                         name=f"{name}_minimum_term"),
                        helper.make_node("Add", [partial, f"{name}_minimum_term"], [node.output[0]])]

    def replace(self, node: onnx.NodeProto, weight: np.ndarray, bits: int) -> list[onnx.NodeProto]:
        """`node` (a MatMul by `weight` [K, N]) as MatMulNBits at `bits`, with its correction at 4 bits."""
        k = weight.shape[0]
        if bits == SYMMETRIC_BITS:
            codes, scales = symmetric_blocks(weight, self.block_size)
            return [self.nbits(node, codes, scales, bits, k, node.output[0])]
        codes, scales, minimums = asymmetric_blocks(weight, self.block_size)
        zero_points = np.zeros(codes.shape[0] * ((codes.shape[1] + 1) // 2), np.uint8)  # 4-bit zeros, rows packed apart
        partial = f"{node.name}_on_grid"
        return [self.nbits(node, codes, scales, bits, k, partial, zero_points),
                *self.minimum_correction(node, minimums, k, partial)]


def _rewrite_products(model: onnx.ModelProto, path: Path, replace, new_weights: dict[str, onnx.TensorProto]) -> None:
    """Replaces every constant-weight MatMul of `model` (loaded from `path`) by `replace(node, weight [K, N])`'s
    nodes, whose new initializers `replace` puts in `new_weights`; drops the replaced weights no longer
    read. Raises if a Gemm by a stored weight would stay in fp32."""
    targets = constant_weight_matmuls(model)
    gemms = [node.name for node in targets if node.op_type == "Gemm"]
    if gemms:
        raise ValueError(f"{path}: Gemm by a stored weight is not quantized: {gemms}")
    weights = {tensor.name: tensor for tensor in model.graph.initializer}
    replaced, nodes, used = {id(node) for node in targets}, [], set()  # used: weights of the replaced MatMuls
    for node in model.graph.node:
        if id(node) in replaced:
            used.add(node.input[1])
            nodes += replace(node, numpy_helper.to_array(weights[node.input[1]]).astype(np.float32))
        else:
            nodes.append(node)
    still_read = {name for node in nodes for name in node.input}
    kept = [tensor for tensor in model.graph.initializer if tensor.name not in used or tensor.name in still_read]
    del model.graph.node[:], model.graph.initializer[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(kept + list(new_weights.values()))


def _save_checked(model: onnx.ModelProto, path: Path) -> None:
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path))


def quantize_weights(path: Path, bits: int, block_size: int, accuracy_level: int, lm_head_outputs: int) -> None:
    """Rewrites the graph at `path` with every constant-weight MatMul as MatMulNBits: `bits` 4 or 8, and
    LM_HEAD_BITS for a weight with `lm_head_outputs` (the vocabulary size) columns. Raises if a
    constant-weight MatMul or Gemm would stay in fp32."""
    if bits not in (ASYMMETRIC_BITS, SYMMETRIC_BITS):
        raise ValueError(f"{bits}-bit weights: expected {ASYMMETRIC_BITS} or {SYMMETRIC_BITS}")
    model = onnx.load(str(path))
    rewriter = _Rewriter(model, block_size, accuracy_level)
    _rewrite_products(model, path, lambda node, weight: rewriter.replace(
        node, weight, LM_HEAD_BITS if weight.shape[-1] == lm_head_outputs else bits), rewriter.new_weights)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _save_checked(model, path)


def per_channel_codes(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """weight [K, N] -> codes int8 [K, N] in -127..127, scales [N] (max |w| of each column / 127)."""
    scales = np.abs(weight).max(0) / 127
    scales[scales == 0] = 1
    return np.clip(np.round(weight / scales), -127, 127).astype(np.int8), scales.astype(np.float32)


def weight_key(weight: np.ndarray) -> str:
    """A stored weight [K, N]'s name for `quantize_per_channel`'s input peaks, from its values."""
    return hashlib.sha256(np.ascontiguousarray(weight, np.float32).tobytes()).hexdigest()[:16]


def smoothing(input_peaks: np.ndarray, weight: np.ndarray, strength: float) -> np.ndarray:
    """[K] factors s moving quantization difficulty from activations to weights (SmoothQuant):
    A @ W = (A / s) @ (s W), with s = peak|A_k|^strength / peak|W_k|^(1 - strength) for each input k."""
    weight_peaks = np.abs(weight).max(1)
    factors = np.maximum(input_peaks, 1e-5) ** strength / np.maximum(weight_peaks, 1e-5) ** (1 - strength)
    return factors.astype(np.float32)


class _PerChannelRewriter:
    def __init__(self, input_peaks: dict[str, np.ndarray], strength: float | None):
        self.input_peaks, self.strength = input_peaks, strength
        self.new_weights: dict[str, onnx.TensorProto] = {}
        self.quantized_rows: dict[str, tuple[str, str]] = {}  # activations -> their 8-bit codes, row scales

    def constant(self, name: str, array: np.ndarray) -> str:
        if name not in self.new_weights:
            self.new_weights[name] = numpy_helper.from_array(array, name)
        return name

    def activation_rows(self, activations: str) -> tuple[list[onnx.NodeProto], str, str]:
        """Nodes quantizing each row (last axis) of `activations` to 8 bits, once for every product
        that reads them; their codes and row scales."""
        if activations in self.quantized_rows:
            return [], *self.quantized_rows[activations]
        a = activations
        peak, scale, scaled, codes = (f"{a}_row_peak", f"{a}_row_scale", f"{a}_row_scaled", f"{a}_row_codes")
        nodes = [helper.make_node("Abs", [a], [f"{a}_abs"]),
                 helper.make_node("ReduceMax", [f"{a}_abs"], [peak], axes=[-1], keepdims=1),
                 helper.make_node("Mul", [peak, self.constant("per_row_step", np.array(1 / 127, np.float32))],
                                  [f"{a}_row_step"]),
                 helper.make_node("Max", [f"{a}_row_step", self.constant("per_row_least_step", np.array(1e-30, np.float32))],
                                  [scale]),  # a row of zeros: codes 0, not 0 / 0
                 helper.make_node("Div", [a, scale], [scaled]),
                 helper.make_node("QuantizeLinear", [scaled, self.constant("unit_scale", np.array(1, np.float32)),
                                                     self.zero_point()], [codes])]
        self.quantized_rows[activations] = codes, scale
        return nodes, codes, scale

    def zero_point(self) -> str:
        return self.constant("activation_zero_point", np.array(ACTIVATION_ZERO_POINT, np.uint8))

    def replace(self, node: onnx.NodeProto, weight: np.ndarray) -> list[onnx.NodeProto]:
        name, activations, nodes = node.name, node.input[0], []
        peaks = self.input_peaks.get(weight_key(weight))
        if peaks is not None:  # this product's own activations, divided by its factors
            factors = smoothing(peaks, weight, self.strength)
            weight = weight * factors[:, None]
            nodes.append(helper.make_node("Mul", [activations, self.constant(f"{name}_smoothing", 1 / factors)],
                                          [f"{name}_smoothed"]))
            activations = f"{name}_smoothed"
        codes, scales = per_channel_codes(weight)
        quantizing, activation_codes, row_scale = self.activation_rows(activations)
        return nodes + quantizing + [
            helper.make_node("MatMulInteger", [activation_codes, self.constant(f"{name}_codes", codes),
                                               self.zero_point(), self.constant("weight_zero_point", np.array(0, np.int8))],
                             [f"{name}_integer"], name=f"{name}_integer"),
            helper.make_node("Cast", [f"{name}_integer"], [f"{name}_counts"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Mul", [f"{name}_counts", row_scale], [f"{name}_rows_scaled"]),
            helper.make_node("Mul", [f"{name}_rows_scaled", self.constant(f"{name}_column_scales", scales)],
                             [node.output[0]])]


def quantize_per_channel(path: Path, input_peaks: dict[str, np.ndarray] | None = None,
                         strength: float | None = None) -> None:
    """Rewrites the graph at `path` with every constant-weight MatMul as MatMulInteger by 8-bit codes,
    one scale per output column, its activations quantized per row at run time (the module's third
    rule). `input_peaks` (weight_key -> the largest |activation| of each input seen in calibration) smooths
    those products' activations by `smoothing` at `strength`. Raises if a Gemm by a stored weight would
    stay in fp32."""
    if input_peaks and strength is None:
        raise ValueError("smoothing by input peaks needs a strength")
    model, rewriter = onnx.load(str(path)), _PerChannelRewriter(input_peaks or {}, strength)
    _rewrite_products(model, path, rewriter.replace, rewriter.new_weights)
    _save_checked(model, path)
