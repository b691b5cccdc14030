"""Every MatMulInteger of a w8a8 backbone on the France question's prefill: ONNX Runtime's int32 output
against numpy's int64 product of the same codes (graph optimizations off, one thread).

    PYTHONPATH=. python reports/w8a8/near_tie_amd/kernel_check.py W8A8_EXPORT"""
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from builder.quantize import ACTIVATION_ZERO_POINT
from dualend.engine.onnx_engine import ExportedModel, in_place_backbone_inputs

exported = ExportedModel.open(sys.argv[1])
tokenizer = exported.tokenizer()
ids = tokenizer.encode_prompt(tokenizer.user_turn("What is the capital of France?"))
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
compressor = ort.InferenceSession(str(exported.path("compressor")), options)
latents = compressor.run(None, {"tokens": np.array(ids, np.int64)[:, None]})[0][None]
model = onnx.load(str(exported.path("backbone")))
weights = {tensor.name: tensor for tensor in model.graph.initializer}
products = [node for node in model.graph.node if node.op_type == "MatMulInteger"]
watched = {node.input[0]: onnx.TensorProto.UINT8 for node in products} | {
    node.output[0]: onnx.TensorProto.INT32 for node in products}
del model.graph.output[:]
model.graph.output.extend([helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, None)] +
                          [helper.make_tensor_value_info(name, kind, None) for name, kind in watched.items()])
session = ort.InferenceSession(model.SerializeToString(), options)
layers, count = exported.settings["n_layers"], len(ids)
past = np.zeros((1, exported.settings["n_kv_heads"], count, exported.settings["head_dim"]), np.float32)
feed = {"latents": latents, "seqlens_k": np.array([count - 1], np.int32),
        "total_sequence_length": np.array(count, np.int32)}
feed |= {name: past for name in in_place_backbone_inputs(layers)[len(feed):]}
outputs = dict(zip(["logits", *watched], session.run(None, feed)))
differing = []
for node in products:
    activations = outputs[node.input[0]].astype(np.int64) - ACTIVATION_ZERO_POINT
    expected = activations @ numpy_helper.to_array(weights[node.input[1]]).astype(np.int64)
    if not np.array_equal(expected, outputs[node.output[0]]):
        differing.append(node.name)
print(f"{exported.settings['weight_precision']} backbone, {count} prompt tokens, onnxruntime {ort.__version__}: "
      f"{len(products)} MatMulInteger nodes, {len(differing)} differ from numpy's int64 products {differing}; "
      f"top first token {tokenizer.decode([int(outputs['logits'][0, -1].argmax())])!r}")
