"""benchmarks.process_cpu: the CPU a streamed token costs in each process of the pipeline."""
import subprocess
import sys
import threading
import time

from benchmarks import process_cpu


def test_the_pipelines_processes_are_told_apart_by_their_command_lines():
    stub = ("/root/.cache/dualend/tritonserver-2.51.0/backends/python/triton_python_backend_stub "
            "/work/main/build/model_repository/smollm2_mtp_int4_v2_mtp_verify/1/model.py dualend_58d1e72 1048576")
    assert process_cpu.process_group(stub) == "smollm2_mtp_int4: mtp_verify"
    assert process_cpu.process_group(stub.replace("_v2_mtp_verify", "_v1_backbone")) == "smollm2_mtp_int4: backbone"
    assert process_cpu.process_group("/root/.cache/dualend/tritonserver-2.51.0/bin/tritonserver "
                                     "--model-repository=/work/main/build/model_repository") == "tritonserver"
    assert process_cpu.process_group("/work/main/.venv/bin/python -m dualend.ops.openai_api --triton-grpc "
                                     "127.0.0.1:18001") == "OpenAI-compatible front"
    assert process_cpu.process_group("nginx: worker process ") == "nginx (gateway)"
    assert process_cpu.process_group("/usr/bin/python3 -m dualend.ops.launch --model-repository x") == "launcher"
    assert process_cpu.process_group("/usr/bin/python3 -m pytest") is None


def test_each_process_groups_cpu_is_counted_per_streamed_chunk(tmp_path, monkeypatch, capsys):
    marker = "process-cpu-test-busy-loop"
    busy = subprocess.Popen([sys.executable, "-c", f"# {marker}\nwhile True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", f"# {marker}-idle\nimport time; time.sleep(60)"])
    monkeypatch.setattr(process_cpu, "process_group", lambda command: (
        "idle" if f"{marker}-idle" in command else "busy" if marker in command else None))
    stream = tmp_path / "stream_1.sse"
    stream.write_text('data: {"before": 1}\n\n')  # written before the window: not counted
    stopping = threading.Event()

    def respond():
        if stopping.wait(0.3):  # once the window has opened
            return
        with stream.open("a") as f:
            for _ in range(40):
                if stopping.wait(0.025):
                    return
                f.write('data: {"choices": []}\n\n')
                f.flush()
    writer = threading.Thread(target=respond)
    try:
        time.sleep(0.2)  # both running before the window opens
        writer.start()
        process_cpu.main(["--duration", "2.5", "--streams", str(tmp_path / "stream_*.sse")])
    finally:
        stopping.set()
        writer.join()
        busy.kill()
        idle.kill()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("40 chunks in 2.5 s")
    figures = {line.split()[-1]: line.split() for line in lines[1:]}
    assert set(figures) == {"busy", "all"}  # a process that spent nothing is not listed
    milliseconds, share = float(figures["busy"][0]), float(figures["busy"][2].rstrip("%"))
    assert share > 50 and milliseconds > 0.5 * 2500 / 40  # one core, busy throughout
