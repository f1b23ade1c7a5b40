"""The CPU worker's malloc setting: large activations come from the malloc heap (kept and reused
after free) instead of a fresh mmap per allocation; EngineConfig.cpu_keep_freed_memory=False (whose
default PAGEDLLM_CPU_KEEP_FREED_MEMORY=0 overrides) turns it off."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch
    from pagedllm import envs
    from pagedllm.worker.cpu_memory import keep_freed_activations
    on = keep_freed_activations(envs.cpu_keep_freed_memory())
    x = torch.empty(16 << 20)  # 64 MB: above glibc's largest mmap threshold
    addr = x.data_ptr()
    in_heap = False
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                in_heap |= lo <= addr < hi
    print(on, in_heap)
    """
)


def run(env_value):
    env = {"PAGEDLLM_CPU_KEEP_FREED_MEMORY": env_value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120, check=True)
    on, in_heap = out.stdout.split()
    return on == "True", in_heap == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt, /proc/self/maps")
def test_large_activations_come_from_the_heap_unless_turned_off():
    assert run("1") == (True, True)
    assert run("0") == (False, False)  # glibc's default: a separate mapping, unmapped on free
