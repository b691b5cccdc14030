"""Triton adapter: a request's prompt -> prompt latents on the compressor engine.

It reads the prompt from the request parameters preprocessing wrote (preprocessing's token names
them) and signs the latents it returns for mtp_verify (`serving.keys.latents_token`).
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.engines import open_engine
from dualend.serving.contract import PreparedRequest
from dualend.serving.keys import PipelineGuard, latents_token, request_token
from dualend.serving.outcomes import Outcome
from dualend.serving.repository import DeploymentConfig, version_components
from dualend.serving.triton import error_response, input_arrays, tensors


class TritonPythonModel:
    def initialize(self, args):
        config = DeploymentConfig.from_args(args)
        exported = version_components(args, ("compressor",))
        self.session = open_engine(exported, "compressor", config.compressor_engine, config.compressor_threads)
        self.guard = PipelineGuard(args, exported.checkpoint_id, config.deployment)
        self.pair_size, self.pad_id = exported.settings["pair_size"], exported.settings["pad_id"]
        self.session.run(None, {"tokens": np.full((1, self.pair_size), exported.settings["bos_id"], np.int64)})  # warm-up

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        inputs = input_arrays(pb_utils, request, ("request_params", "pipeline_key"))
        params = bytes(inputs["request_params"][0])
        refusal = self.guard.refuses(inputs["pipeline_key"], request_token(self.guard.secret, params))
        if refusal:
            return error_response(pb_utils, Outcome.NOT_ALLOWED, refusal)
        try:
            prompt = PreparedRequest.from_json(params)
        except (KeyError, TypeError, ValueError) as error:  # only a caller holding the secret gets here
            return error_response(pb_utils, Outcome.BAD_REQUEST, f"malformed request_params: {error}")
        latents = self.session.run(None, {"tokens": prompt.prompt_pairs(self.pair_size, self.pad_id)})[0]  # [n, D]
        key = latents_token(self.guard.secret, params, latents).encode()
        return pb_utils.InferenceResponse(tensors(pb_utils, {
            "prompt_latents": latents, "latents_key": np.asarray([key], dtype=object)}))
