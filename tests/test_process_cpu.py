"""benchmarks.process_cpu: the CPU a streamed token costs in each process of the server."""
import re
import subprocess
import sys
import threading

import pytest

from benchmarks import process_cpu


def started(code: str) -> subprocess.Popen:
    """A Python child that has printed "ready" (so its start-up is not in the window), then runs `code`."""
    child = subprocess.Popen([sys.executable, "-c", f"print('ready', flush=True)\n{code}"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_each_processs_cpu_is_counted_per_streamed_chunk(tmp_path, monkeypatch, capsys):
    busy, idle = started("while True: pass"), started("import time; time.sleep(60)")
    monkeypatch.setattr(process_cpu, "server_processes", lambda: {"busy": busy.pid, "idle": idle.pid})
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
        writer.start()
        process_cpu.main(["--duration", "2.5", "--streams", str(tmp_path / "stream_*.sse")])
    finally:
        stopping.set()
        writer.join()
        busy.kill()
        idle.kill()
    lines = capsys.readouterr().out.splitlines()
    window = re.match(r"40 chunks in ([\d.]+) s", lines[0])
    assert window and 2.4 <= float(window.group(1)) <= 3.5
    figures = {line.split()[-1]: line.split() for line in lines[1:]}
    assert set(figures) == {"busy", "all"}  # a process that spent nothing is not listed
    milliseconds, share = float(figures["busy"][0]), float(figures["busy"][2].rstrip("%"))
    assert share > 25 and milliseconds == pytest.approx(float(figures["all"][0]))  # a spinning core's worth, all busy's
    assert milliseconds > 0.25 * 2500 / 40


def test_a_window_without_a_streamed_chunk_is_refused_not_printed(tmp_path, monkeypatch):
    monkeypatch.setattr(process_cpu, "server_processes", lambda: {})
    (tmp_path / "stream_1.sse").write_text('data: {"before": 1}\n\n')
    with pytest.raises(SystemExit, match="no chunk was streamed"):
        process_cpu.main(["--duration", "0.1", "--streams", str(tmp_path / "stream_*.sse")])
