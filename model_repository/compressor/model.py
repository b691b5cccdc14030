"""Triton adapter: token pairs -> prompt latents on the compressor engine."""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engines import open_engine
from dualend.serving import PipelineGuard, model_parameters, version_components


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        exported = version_components(args, ("compressor",))
        self.session = open_engine(exported, "compressor", parameters["engine"], int(parameters["threads"]))
        self.guard = PipelineGuard(args, exported.checkpoint_id, parameters["deployment"])
        pair_size = exported.settings["pair_size"]
        self.session.run(None, {"tokens": np.full((1, pair_size), exported.settings["bos_id"], np.int64)})  # warm-up

    def execute(self, requests):
        responses = []
        for request in requests:
            refusal = self.guard.refuses(_input(request, "pipeline_key"), bytes(_input(request, "request_params")[0]))
            if refusal:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal)))
                continue
            tokens = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            latents = self.session.run(None, {"tokens": tokens})[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("prompt_latents", latents)]))
        return responses


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
