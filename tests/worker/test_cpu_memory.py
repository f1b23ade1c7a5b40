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


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
def test_kv_cache_memory_is_lazy_unless_prefaulted():
    from pagedllm.worker.cpu_memory import cpu_kv_cache_memory

    n = 64 << 20
    before = _rss_bytes()
    lazy = cpu_kv_cache_memory(n)
    assert _rss_bytes() - before < n // 4  # pages come as blocks are first written
    before = _rss_bytes()
    eager = cpu_kv_cache_memory(n, prefault=True)
    assert _rss_bytes() - before > n * 0.9  # every page is in before the first step
    assert int(eager.count_nonzero()) == 0 and lazy.numel() == eager.numel() == n


def test_prefaulted_kv_cache_serves_the_same_tokens(llama_ckpt):
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outs = []
    for prefault in (False, True):
        llm = LLM(model=llama_ckpt, dtype="float32", kv_cache_memory=8 << 20, skip_tokenizer_init=True,
                  cpu_kv_cache_prefault=prefault)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp,
                                                                  use_tqdm=False)])
        llm.engine.shutdown()
    assert outs[0] == outs[1]
