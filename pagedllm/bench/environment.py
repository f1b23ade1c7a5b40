"""What a result file records about where and how it was measured."""
from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional, Sequence


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command as typed: ``pagedllm bench ...`` (argv given to main, else sys.argv)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["pagedllm", *args])


def cpu_flags() -> list[str]:
    """The vector ISA flags of this CPU (avx2, avx512*, amx*), as /proc/cpuinfo lists them."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return []
    first = text.split("\n\n", 1)[0]
    m = re.search(r"^flags\s*:\s*(.*)$", first, re.M)
    if not m:
        return []
    return sorted({f for f in m.group(1).split() if re.fullmatch(r"(avx[0-9a-z_]*|amx[a-z_0-9]*)", f)})


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """GPU names: from torch when it is already imported (the offline kinds), else nvidia-smi."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            return []
        except Exception:  # a broken CUDA setup: record no GPU rather than fail the run
            return []
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def describe_machine() -> dict:
    from pagedllm.version import __version__

    return {"cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(),
            "gpus": gpu_names(), "python": platform.python_version(), "platform": platform.platform(),
            "pagedllm": __version__, "hostname": platform.node(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
