"""Where a served deployment's processes spend a decode step: py-spy's raw samples summed per process.

    python -m benchmarks.profile_summary build/served_profile/*.txt --rate 250 --duration 8

Each file is one process's `py-spy record --format raw` (active samples only: py-spy leaves out a
thread that waits). For each: the share of the recorded time each thread was busy, and the functions
the busy samples were in (innermost frame), largest first.
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def summarize(path: Path, rate: float, duration: float, top: int) -> str:
    threads, functions, total = Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames, samples = stack.split(";"), int(count)
        threads[frames[0]] += samples
        functions[frames[-1] if len(frames) > 1 else "(native code, no Python frame)"] += samples
        total += samples
    possible = rate * duration
    lines = [f"{path.stem}: {total} busy samples of {possible:.0f} per thread"]
    lines += [f"  busy {samples / possible:6.1%}  {thread}" for thread, samples in threads.most_common()]
    lines += [f"    {samples / possible:6.1%}  {function}" for function, samples in functions.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", type=Path, nargs="+")
    parser.add_argument("--rate", type=float, required=True, help="py-spy's --rate, samples per second")
    parser.add_argument("--duration", type=float, required=True, help="py-spy's --duration, seconds")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    for path in args.profiles:
        print(summarize(path, args.rate, args.duration, args.top))


if __name__ == "__main__":
    main()
