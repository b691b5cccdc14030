"""CPU time a served token costs in each process of the server, while streams run.

    python -m benchmarks.process_cpu --duration 8 --streams 'build/served_profile/stream_*.sse'

Reads the CPU time (user + system) of tritonserver, each of its Python stubs (by model), nginx's master
and the OpenAI-compatible service (`dualend.ops.processes.server_processes`; nginx's workers, ~0.1 ms a
token here, are not among them) before and after `--duration` seconds, and counts the streamed chunks
(`data: {` lines of OpenAI-style server-sent events) the `--streams` files gained meanwhile: one chunk
is one response of the decode loop (one token, or two where a draft was kept). Prints each process's
milliseconds of CPU per chunk and its share of one core. On a machine with few cores, what the other
processes take per token is taken from the backbone's threads.
"""
from __future__ import annotations

import argparse
import glob
import sys
import time

from dualend.ops.processes import cpu_snapshot, cpu_used, server_processes


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
    processes = server_processes()
    before, chunks_before, started = cpu_snapshot(processes), chunks(args.streams), time.monotonic()
    time.sleep(args.duration)
    used = cpu_used(before, cpu_snapshot(processes))
    streamed, seconds = chunks(args.streams) - chunks_before, time.monotonic() - started
    if not streamed:
        sys.exit(f"no chunk was streamed in the {seconds:.1f} s window ({args.streams}): were the streams still running?")
    print(f"{streamed} chunks in {seconds:.1f} s ({streamed / seconds:.1f} a second, {1000 * seconds / streamed:.2f} ms "
          f"apart); CPU ms a chunk and share of one core, by process:")
    for name, cpu in sorted(used.items(), key=lambda item: -item[1]):
        if cpu > 0:
            print(f"  {1000 * cpu / streamed:7.2f} ms  {cpu / seconds:6.1%}  {name}")
    print(f"  {1000 * sum(used.values()) / streamed:7.2f} ms  {sum(used.values()) / seconds:6.1%}  all")


if __name__ == "__main__":
    main()
