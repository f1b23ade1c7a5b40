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
import time

import torch

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_HEAP_TRIM_THRESHOLD = 1 << 30

_tuned = False


def _libc() -> ctypes.CDLL:
    """The C library (OSError where there is none to load), errno kept for its callers."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


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


class IdlePrefault:
    """Faults a lazily mapped KV cache's pages in while the engine has nothing to do, lowest
    blocks first (the block pool hands blocks out from the low ids up), so a cache that starts
    lazily (no start-up wait) still spares the requests the first-write cost: a fresh huge page
    cost ~6 ms on the development VM, and the 64-request llama-tiny run at 8 req/s had a TTFT
    p99 of 88-117 ms lazily and 27-33 ms prefaulted (docs/benchmarks.md, session 19).

    ``regions``: (address, bytes per block, number of regions) of the mapping's block-major
    parts, e.g. the cache's [planes x layers] planes of ``num_blocks`` blocks each, of which
    blocks 0..``upto``-1 are populated (EngineConfig.cpu_kv_cache_idle_prefault bytes: the
    memory it commits stays bounded; later blocks are faulted in on first write); the pages
    are populated with MADV_POPULATE_WRITE through ctypes (the GIL is released meanwhile), in
    slices of about ``slice_bytes`` per region, so one call of ``run`` overruns its budget by at
    most one slice. Data already written stays (populating does not change a page's content).
    Where the kernel lacks MADV_POPULATE_WRITE (before 5.14) it stops at the first slice."""

    def __init__(self, regions: list[tuple[int, int, int]], num_blocks: int, upto: int,
                 slice_bytes: int = 2 << 20) -> None:
        self._madvise = None
        try:
            self._madvise = _libc().madvise
            self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            self._madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            pass
        per_block = max(b for _, b, _ in regions) if regions else 1
        step = max(1, slice_bytes // per_block)
        page = mmap.PAGESIZE
        self._work: list[tuple[int, int]] = []  # (page-aligned address, length), in the order to populate
        for b0 in range(0, min(upto, num_blocks), step):
            b1 = min(upto, num_blocks, b0 + step)
            for base, block_bytes, count in regions:
                for k in range(count):
                    start = base + (k * num_blocks + b0) * block_bytes
                    end = base + (k * num_blocks + b1) * block_bytes
                    start -= start % page
                    self._work.append((start, end - start))
        self._next = 0
        self.populated_bytes = 0

    @property
    def done(self) -> bool:
        return self._madvise is None or self._next >= len(self._work)

    def run(self, seconds: float) -> bool:
        """Populate slices for about ``seconds``; whether any remain."""
        deadline = time.perf_counter() + seconds
        while not self.done:
            addr, length = self._work[self._next]
            if self._madvise(addr, length, _MADV_POPULATE_WRITE) != 0:
                logger.info("KV cache idle prefault stopped: madvise(MADV_POPULATE_WRITE) failed (errno %d)",
                            ctypes.get_errno())
                self._madvise = None
                break
            self._next += 1
            self.populated_bytes += length
            if time.perf_counter() >= deadline:
                break
        return not self.done


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
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, _HEAP_TRIM_THRESHOLD) != 1:
        logger.debug("mallopt refused; freed activations go back to the OS")
        return False
    _tuned = True
    return True
