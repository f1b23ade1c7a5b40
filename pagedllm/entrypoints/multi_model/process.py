"""One loaded model's server process: a child ``pagedllm serve`` on an internal port, its log
lines passed on to this process's stderr (each prefixed with the model's name, the last ones kept
for the error a failed load answers with), and the memory its process tree holds.

Memory is the tree's proportional set size (PSS, /proc/PID/smaps_rollup): shared library pages
are split between the processes that map them, so the sum over models is what they hold together
(RSS would count torch's libraries once per process)."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
from typing import Optional

from pagedllm.entrypoints.router.data_parallel import Replicas

_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ \S+ \[[^\]]*\]: ")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # no smaps_rollup (old kernels): RSS, an over-count
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_memory_bytes(pid: int) -> int:
    """PSS of ``pid`` and all its descendants (0 once they are gone)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += pss_bytes(p)
        todo += _children(p)
    return total


class ModelProcess:
    """The child server of one model; it dies with this process (``Replicas``' parent pipe)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_lines: int = 40) -> None:
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._replicas = Replicas([command], [env], stderr=subprocess.PIPE)
        self.proc = self._replicas.procs[0]
        self._reader = threading.Thread(target=self._pass_on_log, name=f"pagedllm-model-log-{name}", daemon=True)
        self._reader.start()

    def _pass_on_log(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            try:
                sys.stderr.write(f"[{self.name}] {line}\n")
            except (OSError, ValueError):
                pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> Optional[int]:
        return self.proc.poll()

    def memory_bytes(self) -> int:
        return 0 if self.exited() is not None else tree_memory_bytes(self.proc.pid)

    def error_summary(self) -> str:
        """What the child said last: its one-line error, else its last line naming an error, else
        its last lines (log lines without their time and logger prefix)."""
        self._reader.join(timeout=2)  # the child exited: read what it wrote to the end
        lines = [_LOG_PREFIX.sub("", ln).strip() for ln in self.tail if ln.strip()]
        for ln in reversed(lines):
            if ln.startswith("pagedllm serve: error:"):
                return ln[len("pagedllm serve: error:"):].strip()[-500:]
        for ln in reversed(lines):
            if "error" in ln.lower():
                return ln[-500:]
        return " | ".join(lines[-3:])[-500:] or "no output"

    def terminate(self) -> None:
        self._replicas.terminate()

    def stop(self, timeout: float) -> None:
        """SIGTERM (the child drains as a server does), then a kill after ``timeout`` seconds."""
        self._replicas.stop(timeout)
