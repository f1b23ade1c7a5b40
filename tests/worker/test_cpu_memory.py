"""The CPU worker's malloc setting: freed activations are reused, not page-faulted afresh."""
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from pagedllm.worker.cpu_memory import keep_freed_activations
    on = keep_freed_activations()
    def faults_of_one_step():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(16 << 20)  # 64 MB: above glibc's largest mmap threshold
        x.fill_(1.0)
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults_of_one_step()  # the first time the memory is new either way
    print(on, min(faults_of_one_step() for _ in range(3)))
    """
)


def run(env_value):
    env = {"PAGEDLLM_CPU_KEEP_FREED_MEMORY": env_value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120, check=True)
    on, faults = out.stdout.split()
    return on == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_activations_are_reused_and_the_setting_can_be_turned_off():
    on, faults = run("1")
    assert on
    assert faults < 256  # 64 MB of 4 KiB pages would be 16384 faults
    off, faults_off = run("0")
    assert not off
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp_always = "[always]" in f.read()
    except OSError:
        thp_always = False
    if not thp_always:  # 4 KiB pages: glibc maps and unmaps the block every time
        assert faults_off > 1000
