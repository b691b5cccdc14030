"""Open a component's engine by name: ONNX Runtime here, TensorRT where it was built.

Both return an object with ONNX Runtime's `run(output_names, feeds)`, so the runners do not
care which engine is underneath. TensorRT is imported only when asked for.
"""
from __future__ import annotations

from .onnx_engine import ExportedModel, ort_session, verify_session

ENGINES = ("onnxruntime", "tensorrt")


def open_engine(exported: ExportedModel, component: str, engine: str, threads: int | None = None):
    if engine == "onnxruntime":
        return ort_session(exported.path(component), threads)
    if engine == "tensorrt":
        from .tensorrt_engine import TensorRTSession

        return TensorRTSession.open(exported.directory / component)
    raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")


def open_verify_engine(exported: ExportedModel, engine: str, threads: int | None = None):
    """The backbone's verifying graph on ONNX Runtime, where the export has one; else None (the runner
    then verifies one sequence a call)."""
    return verify_session(exported, threads) if engine == "onnxruntime" else None
