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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore")
def test_kv_cache_memory_is_lazy_unless_prefaulted():
    from pagedllm.worker.cpu_memory import cpu_kv_cache_memory

    n = 64 << 20
    # the mapping's own residency, which other threads of the process cannot disturb
    lazy = cpu_kv_cache_memory(n)
    assert _resident_fraction(lazy) < 0.25  # pages come as blocks are first written
    eager = cpu_kv_cache_memory(n, prefault=True)
    assert _resident_fraction(eager) > 0.9  # every page is in before the first step
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


def _resident_fraction(t) -> float:
    """Pages of ``t``'s memory that are resident (mincore), as a fraction."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, mincore")
def test_idle_prefault_populates_the_lowest_blocks_and_keeps_their_data():
    import torch

    from pagedllm.worker.worker import KVCacheSpec

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    num_blocks = 4096  # 4 KiB per block per (plane, layer): 16 MiB per run, 64 MiB in all
    cache, scales = spec.allocate(num_blocks, torch.device("cpu"))
    cache[1, 1, 7] = 3.0  # a block the engine wrote before the prefault reached it
    pre = spec.idle_prefault(cache, scales, num_blocks, upto=num_blocks // 2)
    if pre.done:
        pytest.skip("this C library has no madvise")
    assert _resident_fraction(cache[0, 0, : num_blocks // 2]) < 0.5
    steps = 0
    while pre.run(0.0):  # a zero budget still does one slice per call
        steps += 1
        assert steps < 10_000
    if pre.populated_bytes == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert steps > 1  # slice by slice, the engine's requests can come in between
    for p in range(2):
        for layer in range(2):
            assert _resident_fraction(cache[p, layer, : num_blocks // 2]) > 0.99
    assert _resident_fraction(cache[0, 0, num_blocks // 2 + 512 :]) < 0.5  # the cap holds (bar a huge page's rounding)
    assert bool((cache[1, 1, 7] == 3.0).all()) and int(cache[0].count_nonzero()) == 0


def test_idle_prefault_size_is_checked(llama_ckpt):
    from pagedllm.config import EngineConfig

    assert EngineConfig(model=llama_ckpt, cpu_kv_cache_idle_prefault="512MiB").cpu_kv_cache_idle_prefault == 512 << 20
    with pytest.raises(ValueError, match="cpu_kv_cache_idle_prefault"):
        EngineConfig(model=llama_ckpt, cpu_kv_cache_idle_prefault=-1)
