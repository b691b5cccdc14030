"""CPU time a served token costs in each process of the pipeline, while streams run.

    python -m benchmarks.process_cpu --duration 8 --streams 'build/served_profile/stream_*.sse'

Reads every process's CPU time (user + system, /proc/PID/stat) before and after `--duration`
seconds, and counts the streamed chunks (`data: {` lines of OpenAI-style server-sent events) the
`--streams` files gained meanwhile: one chunk is one response of the decode loop (one token, or two
where a draft was kept). Prints, per process group (tritonserver, each Python stub by deployment and
step, the OpenAI-compatible front, nginx, the launcher, the clients), the milliseconds of CPU per
chunk and the share of one core. On a machine with few cores, what the other processes take per token
is taken from the backbone's threads.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import time

_STUB = re.compile(r"triton_python_backend_stub \S*/(\w+?)_v\d+_(\w+)/")


def process_group(command: str) -> str | None:
    """The pipeline part a command line belongs to, None for any other process."""
    stub = _STUB.search(command)
    if stub:
        return f"{stub.group(1)}: {stub.group(2)}"
    if "tritonserver" in command:
        return "tritonserver"
    if "dualend.ops.openai_api" in command:
        return "OpenAI-compatible front"
    if command.startswith("nginx"):
        return "nginx (gateway)"
    if "dualend.ops.launch" in command:
        return "launcher"
    if command.startswith("curl "):
        return "clients (curl)"
    return None


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """{pid: (group, CPU seconds so far)} of the pipeline's processes."""
    tick, found = os.sysconf("SC_CLK_TCK"), {}
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{proc}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"{proc}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        group = process_group(command)
        if group is not None:
            found[int(proc.removeprefix("/proc/"))] = (group, (int(fields[11]) + int(fields[12])) / tick)
    return found


def chunks(pattern: str) -> int:
    total = 0
    for path in glob.glob(pattern):
        with open(path, errors="replace") as f:
            total += f.read().count("data: {")
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--streams", required=True, help="glob of the files the streaming clients write")
    args = parser.parse_args(argv)
    before, chunks_before, started = cpu_seconds(), chunks(args.streams), time.monotonic()
    time.sleep(args.duration)
    after, streamed, seconds = cpu_seconds(), chunks(args.streams) - chunks_before, time.monotonic() - started
    spent: dict[str, float] = {}
    for pid, (group, cpu) in after.items():
        if pid in before:  # a process started meanwhile has no start figure: left out
            spent[group] = spent.get(group, 0.0) + cpu - before[pid][1]
    per_chunk = 1000 / max(streamed, 1)
    print(f"{streamed} chunks in {seconds:.1f} s ({streamed / seconds:.1f} a second, {seconds * per_chunk:.2f} ms "
          f"apart); CPU ms a chunk and share of one core, by process:")
    for group, cpu in sorted(spent.items(), key=lambda item: -item[1]):
        if cpu > 0:
            print(f"  {cpu * per_chunk:7.2f} ms  {cpu / seconds:6.1%}  {group}")
    print(f"  {sum(spent.values()) * per_chunk:7.2f} ms  {sum(spent.values()) / seconds:6.1%}  all")


if __name__ == "__main__":
    main()
