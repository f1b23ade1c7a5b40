"""Process checks from /proc (tests of the engine-core process and of the server's shutdown)."""
from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int, command_has: str = "") -> list[int]:
    """Processes whose parent is ``pid`` (and whose command line contains ``command_has``)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) != pid:
                        continue
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if command_has.encode() in f.read():
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The ``pids`` still alive after up to ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)
