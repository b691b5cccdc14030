"""Triton adapter: validates a request and turns its text into token pairs."""
import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.engine.decode import InvalidRequest
from dualend.serving.contract import Limits, prepare_request
from dualend.serving.keys import pipeline_secret, request_token
from dualend.serving.repository import model_parameters, version_components

OPTIONAL_INPUTS = ("stream", "temperature", "top_k", "top_p", "random_seed", "stop_words",
                   "exclude_input_in_output", "acceptance_threshold", "ignore_eos")


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        exported = version_components(args, ("tokenizer",))
        self.tokenizer = exported.tokenizer()
        self.limits = Limits(int(parameters["raw_context_limit"]), int(parameters["pair_size"]),
                             int(parameters["max_new_tokens"]))
        self.secret = pipeline_secret(args, exported.checkpoint_id)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        def value(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        try:
            prepared = prepare_request(self.tokenizer, self.limits, text_input=value("text_input"),
                                       max_tokens=value("max_tokens"),
                                       **{name: value(name) for name in OPTIONAL_INPUTS})
        except InvalidRequest as error:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"invalid request: {error}", pb_utils.TritonError.INVALID_ARG))
        pairs = prepared.prompt_pairs(self.limits.pair_size, self.tokenizer.pad_id)
        params = prepared.to_json().encode()
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("input_ids", pairs),
            pb_utils.Tensor("request_params", np.asarray([params], dtype=object)),
            pb_utils.Tensor("pipeline_key", np.asarray([request_token(self.secret, params).encode()], dtype=object)),
        ])
