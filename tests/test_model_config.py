"""dualend.serving.model_config: config.pbtxt read as tritonserver reads it, once per version of the file."""
import os
from pathlib import Path

import pytest

from dualend.serving.model_config import (ModelConfigError, config_checkpoint, ensemble_pipeline, read_model_config,
                                          shared_model_config)

ROOT = Path(__file__).resolve().parent.parent

ENSEMBLE = """
name: "dualend"
platform: "ensemble"
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  {
    name: "stop_words"
    data_type: TYPE_STRING
    dims: [ -1 ]
    optional: true
  }
]
ensemble_scheduling { step [ { model_name: "dualend_v3_preprocessing" model_version: -1 } ] }
parameters { key: "checkpoint_id" value: { string_value: "abc123" } }
"""


def test_a_config_reads_whatever_its_layout_as_triton_hands_it_to_a_model(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(ENSEMBLE)
    config = read_model_config(path)
    assert [i["name"] for i in config["input"]] == ["text_input", "stop_words"]
    assert config["input"][1]["dims"] == ["-1"] and config["input"][1]["optional"] is True
    assert ensemble_pipeline(config) == "dualend_v3" and config_checkpoint(config) == "abc123"
    config["input"].clear()  # a caller's copy: the next reader is not affected
    assert len(read_model_config(path)["input"]) == 2


def test_a_changed_file_is_read_again_and_a_broken_one_named(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(ENSEMBLE)
    assert ensemble_pipeline(shared_model_config(path)) == "dualend_v3"
    path.write_text(ENSEMBLE.replace("dualend_v3_", "dualend_v4_"))
    os.utime(path, ns=(1, 1))  # even with an older time stamp, the size differs
    assert ensemble_pipeline(shared_model_config(path)) == "dualend_v4"
    path.write_text("input [ { name: ")
    with pytest.raises(ModelConfigError, match="config.pbtxt"):
        read_model_config(path)
    with pytest.raises(FileNotFoundError):
        read_model_config(tmp_path / "missing" / "config.pbtxt")


def test_the_contract_rendered_into_the_templates_reads_back_as_declared(tmp_path):
    """The ensemble's inputs and counter outputs, preprocessing's inputs and mtp_verify's counters, as
    tritonserver reads the rendered files, are what serving.contract declares; the ensemble maps each."""
    import string

    from dualend.serving.contract import COUNTERS, REQUEST_INPUT_TYPES, config_values

    values = {"deployment": "d", "pipeline": "d_v1", "checkpoint_id": "c", "parameters": "", "d_model": 8,
              "vocab_size": 16, "preprocessing_instances": 1} | config_values()
    read = {}
    for model in ("ensemble", "preprocessing", "mtp_verify"):
        template = (ROOT / "model_repository" / model / "config.pbtxt.template").read_text()
        (tmp_path / model).write_text(string.Template(template).safe_substitute(values))
        read[model] = read_model_config(tmp_path / model)
    types = {"TYPE_STRING": "BYTES"}
    for model in ("ensemble", "preprocessing"):
        declared = {i["name"]: (types.get(i["data_type"], i["data_type"].removeprefix("TYPE_")),
                                tuple(int(d) for d in i["dims"]), bool(i.get("optional"))) for i in read[model]["input"]}
        assert declared == REQUEST_INPUT_TYPES
    for model in ("ensemble", "mtp_verify"):
        outputs = [o["name"] for o in read[model]["output"]]
        assert [name for name in outputs if name in COUNTERS] == list(COUNTERS)
    steps = read["ensemble"]["ensemble_scheduling"]["step"]
    assert steps[0]["input_map"] == {name: name for name in REQUEST_INPUT_TYPES}
    assert all(steps[2]["output_map"][name] == name for name in COUNTERS)
