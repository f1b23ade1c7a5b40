"""Host memory for the CPU worker: the KV cache mapping and the allocator's reuse of freed memory.

Both exist for one reason measured on the development VM: the first write to a page the process
has never touched costs far more than the write (the kernel zeroes it, and a VM's host may have
to back it too): there, torch's silu over 32 MB took 19.8 ms into a fresh output buffer and 5.9
ms into a reused one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

import torch

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_HEAP_TRIM_THRESHOLD = 1 << 30

_tuned = False


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module names it only from 3.13 on


def cpu_kv_cache_memory(nbytes: int, prefault: bool = False) -> torch.Tensor:
    """Anonymous memory the OS zeroes lazily (no second-long memset of a GiB-sized cache at
    start-up; pages are faulted in as blocks are first written), backed by transparent huge
    pages where the kernel allows it: 512x fewer page faults on first writes and fewer TLB
    misses when attention reads blocks scattered over the whole cache.

    ``prefault`` (EngineConfig.cpu_kv_cache_prefault) faults every page in now instead, as a
    cache allocated with torch.zeros is: start-up pays what the first pass over the cache's
    blocks would pay while serving. On the 2-core VMs of docs/benchmarks.md a first write costs
    2-3.5 s per GiB (the hypervisor backs the page), 9 s for a 4 GiB cache, and the 64-request
    llama-100m run went 10.85 -> 9.8 s with it."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages
            pass
    cache = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the mapping alive
    if prefault and nbytes:
        try:
            buf.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # an older kernel: write one byte of every page
            cache[::mmap.PAGESIZE] = 0
    return cache


def keep_freed_activations(enabled: bool = True) -> bool:
    """Make glibc malloc keep freed memory for reuse instead of handing it back to the OS.

    torch allocates every activation with malloc. By default glibc serves blocks above a
    (dynamic, at most 32 MB) threshold with a fresh mmap and unmaps them on free, and trims the
    heap top beyond 128 KB-ish, so each forward pass of a prefill step page-faults its large
    activations (a 2048-token chunk of a 768-wide Llama allocates ~1 GB across its layers) all
    over again. With mmap-served blocks disabled and a 1 GiB trim threshold, a step mostly reuses the
    memory the previous one freed. Measured on llama-100m float32 (the throughput benchmark's
    workload, instrumented): 60.4 -> 54.2 s, prefill GEMMs 118 -> 138 GFLOP/s.

    The cost: the process's resident memory stays at its peak instead of shrinking after it.
    Process-wide and idempotent; only glibc has mallopt (elsewhere this does nothing).
    ``enabled=False`` (EngineConfig.cpu_keep_freed_memory) turns it off. Returns whether it is in effect.
    """
    global _tuned
    if _tuned:
        return True
    if not enabled:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, _HEAP_TRIM_THRESHOLD) != 1:
        logger.debug("mallopt refused; freed activations go back to the OS")
        return False
    _tuned = True
    return True
