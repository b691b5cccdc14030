"""Triton adapter: released token ids -> text (PAD, BOS, EOS never appear).

It is also where a client's cancellation shows up (Triton marks the ensemble's next step as
cancelled); it forwards it to mtp_verify as a cancel control request (`serving.control`). It takes
only responses of its own pipeline's decode loop: each carries mtp_verify's token for its request
id and token ids (`serving.keys.response_token`).
"""
from collections import deque

import numpy as np
import triton_python_backend_utils as pb_utils

from dualend.serving.control import cancel_request
from dualend.serving.keys import PipelineGuard, response_token
from dualend.serving.outcomes import Outcome
from dualend.serving.repository import DeploymentConfig, version_components
from dualend.serving.triton import error_response, input_arrays, tensors


class TritonPythonModel:
    def initialize(self, args):
        config = DeploymentConfig.from_args(args)
        exported = version_components(args, ("tokenizer",))
        self.tokenizer = exported.tokenizer()
        self.mtp_verify = f"{config.pipeline}_mtp_verify"  # of the same generation
        self.max_ids = config.raw_context_limit  # no response of the decode loop holds more
        self.guard = PipelineGuard(args, exported.checkpoint_id, config.deployment)
        self.forwarded = deque(maxlen=1024)  # request ids whose cancellation was already sent

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        inputs = input_arrays(pb_utils, request, ("request_id", "output_ids", "pipeline_key"))
        request_id, ids = int(inputs["request_id"].reshape(-1)[0]), inputs["output_ids"]
        if ids.size > self.max_ids:  # longer than any response of the loop: refused without hashing it
            refusal = self.guard.refusal
        else:
            refusal = self.guard.refuses(inputs["pipeline_key"], response_token(self.guard.secret, request_id, ids))
        if refusal:
            return error_response(pb_utils, Outcome.NOT_ALLOWED, refusal)
        if request.is_cancelled():
            self._forward_cancel(request_id)
        text = self.tokenizer.decode(ids.tolist()).encode()
        return pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.asarray([text], dtype=object))])

    def _forward_cancel(self, request_id):
        if request_id in self.forwarded:
            return
        self.forwarded.append(request_id)
        control = pb_utils.InferenceRequest(model_name=self.mtp_verify, requested_output_names=[],
                                            inputs=tensors(pb_utils, cancel_request(request_id, self.guard.secret)))
        for _ in control.exec(decoupled=True):
            pass
