"""Triton adapter: token pairs -> prompt latents on the compressor engine.

It takes only the prompt preprocessing tokenized for these request parameters (preprocessing's
token names them), and signs the latents it returns for mtp_verify (`serving.latents_token`).
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.engines import open_engine
from dualend.serving.contract import PreparedRequest
from dualend.serving.keys import PipelineGuard, latents_token, request_token
from dualend.serving.repository import model_parameters, version_components


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        exported = version_components(args, ("compressor",))
        self.session = open_engine(exported, "compressor", parameters["engine"], int(parameters["threads"]))
        self.guard = PipelineGuard(args, exported.checkpoint_id, parameters["deployment"])
        self.pair_size, self.pad_id = exported.settings["pair_size"], exported.settings["pad_id"]
        self.session.run(None, {"tokens": np.full((1, self.pair_size), exported.settings["bos_id"], np.int64)})  # warm-up

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        params = bytes(_input(request, "request_params")[0])
        refusal = self.guard.refuses(_input(request, "pipeline_key"), request_token(self.guard.secret, params))
        if refusal:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal))
        tokens = _input(request, "input_ids")
        if not np.array_equal(tokens, PreparedRequest.from_json(params.decode()).prompt_pairs(self.pair_size, self.pad_id)):
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"input_ids ({tokens.shape[0]} rows) are not the prompt of these request_params", pb_utils.TritonError.INVALID_ARG))
        latents = self.session.run(None, {"tokens": tokens})[0]
        key = latents_token(self.guard.secret, params, latents).encode()
        return pb_utils.InferenceResponse([pb_utils.Tensor("prompt_latents", latents),
                                           pb_utils.Tensor("latents_key", np.asarray([key], dtype=object))])


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
