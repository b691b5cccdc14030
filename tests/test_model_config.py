"""dualend.serving.model_config: config.pbtxt read as tritonserver reads it, once per version of the file."""
import os

import pytest

from dualend.serving.model_config import (ModelConfigError, config_checkpoint, ensemble_pipeline, read_model_config,
                                          shared_model_config)

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
