"""The one reader of a Triton model's config.pbtxt: protobuf text format parsed as tritonserver
parses it (tritonclient's ModelConfig message), into the JSON form Triton hands a Python model as
`args["model_config"]` (field names as in the proto, int64 values as strings), so code that reads a
config from disk and code that reads it inside a model see the same dict.
"""
from __future__ import annotations

import copy
from pathlib import Path

_parsed: dict[Path, tuple[tuple[int, int], dict]] = {}  # path -> ((mtime_ns, size), its config)


class ModelConfigError(ValueError):
    """A config.pbtxt that does not parse as a ModelConfig."""


def read_model_config(path: Path) -> dict:
    """The config at `path` (a config.pbtxt) as a dict; FileNotFoundError when there is none."""
    return copy.deepcopy(shared_model_config(path))


def shared_model_config(path: Path) -> dict:
    """`read_model_config`'s dict itself, parsed once per version of the file and shared by every
    caller, who must not change it (the OpenAI service asks on every request)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(path)
    status = path.stat()
    stamp = (status.st_mtime_ns, status.st_size)
    known = _parsed.get(path)
    if known is None or known[0] != stamp:
        try:
            message = text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
        except text_format.ParseError as error:
            raise ModelConfigError(f"{path}: {error}") from None
        known = _parsed[path] = (stamp, json_format.MessageToDict(message, preserving_proto_field_name=True))
    return known[1]


def ensemble_pipeline(config: dict) -> str | None:
    """The pipeline an ensemble config (from the server or from disk) runs, e.g. "dualend_v2"; None
    when it is not an ensemble."""
    steps = config.get("ensemble_scheduling", {}).get("step", [])
    return steps[0]["model_name"].rsplit("_", 1)[0] if steps else None


def config_checkpoint(config: dict) -> str | None:
    """The checkpoint id a model config names (its `checkpoint_id` parameter)."""
    return config.get("parameters", {}).get("checkpoint_id", {}).get("string_value")
