"""A secret argument for a program that takes it only on its command line, kept out of what `ps` shows.

`hidden_argument.c`, built once into `build/native/` with the system's C compiler and preloaded into the
program, puts the secret (from an environment variable, which only the program's user can read) where
the arguments hold `MARKER`, before the program's main() reads them. Used for tritonserver's admin key.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("hidden_argument.c")
MARKER = "@dualend-hidden-argument@"
VARIABLE = "DUALEND_HIDDEN_ARGUMENT"
BUILD_DIR = Path(os.environ.get("DUALEND_NATIVE_DIR") or Path(__file__).resolve().parents[2] / "build" / "native")


def library(build_dir: Path = BUILD_DIR) -> Path | bool:
    """The preloadable library, built if this source has not been yet; False without a C compiler or
    when it cannot be built there (a folder not writable, no C library headers)."""
    source = SOURCE.read_bytes()
    built = build_dir / f"hidden_argument-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if built.exists():
        return built
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return False
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=build_dir) as scratch:  # then renamed: concurrent builds are safe
            partial = Path(scratch) / built.name
            done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                return False
            partial.replace(built)
    except OSError:
        return False
    return built


def environment(built: Path, secret: str) -> dict[str, str]:
    """What to add to the program's environment so that `secret` replaces `MARKER` in its arguments."""
    if MARKER in secret or "\0" in secret:
        raise ValueError("a secret cannot hold the marker or a NUL")
    preloaded = " ".join(part for part in (str(built), os.environ.get("LD_PRELOAD", "")) if part)
    return {"LD_PRELOAD": preloaded, VARIABLE: secret}


def took_effect(pid: int, secret: str) -> bool:
    """Whether the preloaded library ran in process `pid`: it blanks the secret in the environment the
    process started with, which /proc still shows. If it did not, the program took MARKER itself."""
    try:
        started_with = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{VARIABLE}={secret}".encode() not in started_with


if __name__ == "__main__":  # build it ahead (an image without a compiler at run time)
    print(library() or "no C compiler (cc, gcc or $CC)")
