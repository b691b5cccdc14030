"""Triton adapter: hands each request to the deployment's one batched decode loop.

`execute` only reads a request's inputs and hands them to `serving.service.DecodeService`, whose
thread runs `serving.loop.DecodeLoop`: it batches every live sequence into one backbone call per
iteration (over BLS, to this generation's backbone model), runs the MTP head and confidence gate
in-process, and answers through each request's response sender: exactly one FINAL response per
request, also after an error or a cancellation. Every response carries `request_id` and
postprocessing's token for it (`response_key`).

Besides generations from the ensemble it takes control requests (`serving.control`): a cancel
from postprocessing (Triton 2.51 does not pass a client's cancellation on to a running step) and
a drain from the launcher before it stops the server.
"""
import secrets
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dualend.engine.manifest import verify_component, verify_siblings
from dualend.serving.keys import PipelineGuard
from dualend.serving.repository import DeploymentConfig, version_components
from dualend.serving.service import INPUTS, DecodeService
from dualend.serving.triton import BLSBackbone, ResponseSenderOutput, TritonMetrics, input_arrays


class TritonPythonModel:
    def initialize(self, args):
        config = DeploymentConfig.from_args(args)
        drafts = config.pair_size == 2 or (Path(args["model_repository"]) / args["model_version"] / "mtp").exists()
        exported = version_components(args, ("tokenizer", "compressor") + (("mtp",) if drafts else ()))
        backbone = f"{config.pipeline}_backbone"  # the backbone of this generation of the pipeline
        backbone_manifest = verify_component(Path(args["model_repository"]).parent / backbone / "1" / "backbone")
        manifests = [*exported.manifests.values(), backbone_manifest]
        checkpoint_id = verify_siblings(manifests)
        self.guard = PipelineGuard(args, checkpoint_id, config.deployment)
        metrics = TritonMetrics(pb_utils, {"model": args["model_name"], "deployment": config.deployment})
        self.service = DecodeService(config, exported, BLSBackbone(pb_utils, backbone, self.guard.secret),
                                     self.guard, metrics, pb_utils.Logger.log_warn)
        mode = (f"dual-end: compressor + MTP head, acceptance_threshold {config.acceptance_threshold}"
                if config.pair_size == 2 else
                f"token-level with a draft head, each draft verified by the next step (fed from top probability "
                f"{config.acceptance_threshold})" if drafts else "token-level baseline, one token per step")
        pb_utils.Logger.log_info(
            f"{args['model_name']}: checkpoint {checkpoint_id}; {mode}; one batched decode loop for up "
            f"to {config.max_concurrent_requests} sequences; components "
            + ", ".join(f"{m.component} ({m.format})" for m in manifests))
        for notice in config.benchmark_notices():
            pb_utils.Logger.log_warn(f"{args['model_name']}: {notice}")

    def execute(self, requests):
        for request in requests:
            request_id = secrets.randbits(63)  # also the backbone's sequence id: not guessable
            output = ResponseSenderOutput(pb_utils, request.get_response_sender(), request_id, self.guard.secret)
            self.service.handle(request_id, input_arrays(pb_utils, request, INPUTS), output)
        return None

    def finalize(self):
        if not self.service.stop():
            pb_utils.Logger.log_warn("mtp_verify: responses still queued at shutdown after 5 s; they are lost")
