"""Triton adapter: released token ids -> text (PAD, BOS, EOS never appear).

It is also where a client's cancellation shows up (Triton marks the ensemble's next step as
cancelled); it forwards it to mtp_verify as a `{"cancel": request_id}` control request. It takes only
responses of its own pipeline's decode loop: each carries mtp_verify's token for its request id and
token ids (`serving.response_token`).
"""
import json
from collections import deque

import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.serving.keys import PipelineGuard, response_token
from dualend.serving.repository import model_parameters, version_components


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        exported = version_components(args, ("tokenizer",))
        self.tokenizer = exported.tokenizer()
        self.mtp_verify = f"{parameters['pipeline']}_mtp_verify"  # of the same generation
        self.d_model = int(parameters["d_model"])
        self.max_ids = int(parameters["raw_context_limit"])  # no response of the decode loop holds more
        self.guard = PipelineGuard(args, exported.checkpoint_id, parameters["deployment"])
        self.pipeline_key = np.asarray([self.guard.secret.encode()], dtype=object)
        self.forwarded = deque(maxlen=1024)  # request ids whose cancellation was already sent

    def execute(self, requests):
        responses = []
        for request in requests:
            request_id = int(pb_utils.get_input_tensor_by_name(request, "request_id").as_numpy().reshape(-1)[0])
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            key = pb_utils.get_input_tensor_by_name(request, "pipeline_key")
            if ids.size > self.max_ids:  # longer than any response of the loop: refused without hashing it
                refusal = self.guard.refusal
            else:
                refusal = self.guard.refuses(None if key is None else key.as_numpy(),
                                             response_token(self.guard.secret, request_id, ids))
            if refusal:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal)))
                continue
            if request.is_cancelled():
                self._forward_cancel(request_id)
            text = self.tokenizer.decode(ids.tolist()).encode()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("text_output", np.asarray([text], dtype=object))]))
        return responses

    def _forward_cancel(self, request_id):
        if request_id in self.forwarded:
            return
        self.forwarded.append(request_id)
        control = pb_utils.InferenceRequest(
            model_name=self.mtp_verify, requested_output_names=[],
            inputs=[pb_utils.Tensor("prompt_latents", np.zeros((1, self.d_model), np.float32)),
                    pb_utils.Tensor("request_params", np.asarray([json.dumps({"cancel": request_id}).encode()],
                                                                 dtype=object)),
                    pb_utils.Tensor("pipeline_key", self.pipeline_key)])
        for _ in control.exec(decoupled=True):
            pass
