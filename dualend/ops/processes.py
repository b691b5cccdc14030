"""The server processes on this machine and what they use: tritonserver, its Python backend stubs
(named by model), nginx's master and the OpenAI-compatible service, read from /proc."""
from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
API_SERVICE_MODULE = b"dualend.ops.openai_api"  # how the launcher starts the OpenAI-compatible service


def stub_processes(server_pid: int) -> dict[str, tuple[int, str]]:
    """{model: (pid, shared-memory region)} of one tritonserver's Python backend stubs, from their
    command lines (`stub model.py region size growth parent-pid backends ... <model>_<n>_<device>`)."""
    stubs = {}
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(args) > 8 and args[0].endswith(b"triton_python_backend_stub") and args[5] == str(server_pid).encode():
            stubs[args[8].decode().rsplit("_", 2)[0]] = (int(proc.name), args[2].decode())
    return stubs


def is_stopped(pid: int) -> bool:
    """Whether a process is stopped (kill -STOP, a debugger): state T or t in /proc/PID/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] in "Tt"


def server_tree(server_pid: int) -> dict[str, int]:
    """{name: pid} of one tritonserver and its Python backend stubs (by model)."""
    return {"tritonserver": server_pid} | {model: pid for model, (pid, _) in stub_processes(server_pid).items()}


def server_processes() -> dict[str, int]:
    """{name: pid} of tritonserver, each of its Python backend stubs (by model), nginx and the
    OpenAI-compatible service (`openai_api`) here."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            role = server_role((proc / "cmdline").read_bytes().split(b"\0"))
        except OSError:
            continue
        if role == "tritonserver":
            found |= server_tree(int(proc.name))
        elif role is not None:
            found[role] = int(proc.name)
    return found


def server_role(args: list[bytes]) -> str | None:
    """Which server process a command line is: tritonserver, nginx (its master, by the title nginx gives
    it: the workers come and go with reloads), openai_api (`python -m dualend.ops.openai_api`), or None."""
    if os.path.basename(args[0].decode(errors="replace")) == "tritonserver":
        return "tritonserver"
    if args[0].startswith(b"nginx: master"):
        return "nginx"
    if any(flag == b"-m" and module == API_SERVICE_MODULE for flag, module in zip(args, args[1:])):
        return "openai_api"
    return None


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of `pid` so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces; fields 14 and 15 follow it
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_snapshot(processes: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process that is still running."""
    snapshot = {}
    for name, pid in processes.items():
        try:
            snapshot[name] = cpu_seconds(pid)
        except (OSError, ValueError):
            continue
    return snapshot


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process used between two snapshots (only processes in both)."""
    return {name: after[name] - before[name] for name in after if name in before}
