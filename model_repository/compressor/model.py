"""Triton adapter: token pairs -> prompt latents on the compressor engine."""
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engines import open_engine
from dualend.onnx_engine import ExportedModel


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
        exported = ExportedModel.open(Path(args["model_repository"]) / args["model_version"], ("compressor",))
        self.session = open_engine(exported, "compressor", parameters["engine"], int(parameters["threads"]))
        pair_size = exported.settings["pair_size"]
        self.session.run(None, {"tokens": np.full((1, pair_size), exported.settings["bos_id"], np.int64)})  # warm-up

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            latents = self.session.run(None, {"tokens": tokens})[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("prompt_latents", latents)]))
        return responses
