"""Triton adapter: released token ids -> text (PAD, BOS, EOS never appear)."""
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.onnx_engine import ExportedModel


class TritonPythonModel:
    def initialize(self, args):
        exported = ExportedModel.open(Path(args["model_repository"]) / args["model_version"], ("tokenizer",))
        self.tokenizer = exported.tokenizer()

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy().tolist()
            text = self.tokenizer.decode(ids).encode()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("text_output", np.asarray([text], dtype=object))]))
        return responses
