"""A TensorRT engine behind ONNX Runtime's `run(output_names, feeds)` interface.

Needs an NVIDIA GPU, `tensorrt` and a CUDA build of torch (used for device buffers). The plan
holds two optimisation profiles, prefill chunks (one sequence, several new latents) and decode
(a batch of cache rows, one new latent each, or two when they verify drafts); `run` picks the profile
from the new latents.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .onnx_engine import OUTPUT_POSITIONS

PLAN_FILE = "model.plan"
PREFILL_PROFILE, DECODE_PROFILE = 0, 1


def gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class TensorRTSession:
    def __init__(self, plan: bytes):
        import tensorrt as trt
        import torch

        self.torch = torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError("TensorRT could not deserialize the plan (built for another GPU or TensorRT version?)")
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for profile in range(self.engine.num_optimization_profiles):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(profile, self.stream.cuda_stream)
            self.contexts.append(context)
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]

    @classmethod
    def open(cls, component_dir: str | Path) -> "TensorRTSession":
        path = Path(component_dir) / PLAN_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: build it with `python -m builder.tensorrt_build`")
        return cls(path.read_bytes())

    def run(self, output_names, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        torch = self.torch
        decode = feeds["latents"].shape[1] <= OUTPUT_POSITIONS
        context = self.contexts[DECODE_PROFILE if decode and len(self.contexts) > 1 else PREFILL_PROFILE]
        keep = []
        with torch.cuda.stream(self.stream):
            for name in self.inputs:
                tensor = torch.from_numpy(np.ascontiguousarray(feeds[name])).to("cuda", non_blocking=True)
                keep.append(tensor)
                if not context.set_input_shape(name, tuple(tensor.shape)):
                    raise RuntimeError(f"TensorRT: input {name} of shape {tuple(tensor.shape)} is outside the "
                                       f"plan's optimisation profile; rebuild it for these limits")
                context.set_tensor_address(name, tensor.data_ptr())
            outputs = {}
            for name in self.names:
                if name in self.inputs:
                    continue
                shape = tuple(context.get_tensor_shape(name))
                dtype = torch.float32 if "float" in str(self.engine.get_tensor_dtype(name)).lower() else torch.int64
                outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
                context.set_tensor_address(name, outputs[name].data_ptr())
            if not context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        names = output_names or [n for n in self.names if n not in self.inputs]
        return [outputs[n].float().cpu().numpy() for n in names]
