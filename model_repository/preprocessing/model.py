"""Triton adapter: validates a request (`serving.contract`) and hands on its parameters, the
prompt's token ids among them, with a token the compressor checks (`serving.keys.request_token`)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.decode import ContextLengthExceeded, InvalidRequest
from dualend.serving.contract import REQUEST_INPUTS, prepare_request
from dualend.serving.keys import pipeline_secret, request_token
from dualend.serving.outcomes import Outcome
from dualend.serving.repository import DeploymentConfig, version_components
from dualend.serving.triton import error_response, input_arrays, tensors


class TritonPythonModel:
    def initialize(self, args):
        config = DeploymentConfig.from_args(args)
        exported = version_components(args, ("tokenizer",))
        self.tokenizer = exported.tokenizer()
        self.limits = config.limits()
        self.secret = pipeline_secret(args, exported.checkpoint_id)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            prepared = prepare_request(self.tokenizer, self.limits, **input_arrays(pb_utils, request, REQUEST_INPUTS))
        except InvalidRequest as error:
            outcome = Outcome.CONTEXT_LENGTH_EXCEEDED if isinstance(error, ContextLengthExceeded) else Outcome.BAD_REQUEST
            return error_response(pb_utils, outcome, f"invalid request: {error}")
        params = prepared.to_json().encode()
        return pb_utils.InferenceResponse(tensors(pb_utils, {
            "request_params": np.asarray([params], dtype=object),
            "pipeline_key": np.asarray([request_token(self.secret, params).encode()], dtype=object)}))
