"""HostTierStore: the ``native`` KV offload tier, a second, larger pool of blocks in host memory
(a worker/kv_tier/store.KVTierStore). On GPU its memory is pinned (page-locked), so the runner's
copies to and from the device run at full PCIe speed.

Each cache tensor of the rank has a twin ``[planes, layers, num_slots, ...]`` here; a batch of
blocks goes in with one ``index_copy_`` per twin and comes out with one ``index_select`` per twin
(never a Python loop over blocks' data). The hash each slot was given is kept beside it and checked
on every ``get``: a slot that holds another hash (or nothing) is a failed load, never wrong KV.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from pagedllm.worker.cpu_memory import cpu_kv_cache_memory
from pagedllm.worker.kv_tier.store import BLOCK_DIM, TierBlockLayout

logger = logging.getLogger(__name__)


def _lazy_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on memory the OS fills on first touch (worker/cpu_memory.py)."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return cpu_kv_cache_memory(nbytes).view(dtype).view(shape)


class HostTierStore:
    def __init__(self, layout: TierBlockLayout, num_slots: int, pin_memory: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV offload tier needs at least 1 slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        # Pinned memory is resident at once (the device copies need it). Unpinned, each pool is an
        # anonymous mapping whose pages the OS zeroes when first written: a tier that is never used
        # costs neither start-up time nor resident memory (torch.zeros would memset all of it: a
        # 4 GiB tier took ~10 s and 4 GiB of RSS at start-up here).
        self.pools = [torch.zeros(layout.batch_shape(k, num_slots), dtype=d, pin_memory=True) if pin_memory
                      else _lazy_zeros(layout.batch_shape(k, num_slots), d)
                      for k, d in enumerate(layout.dtypes)]
        self.hashes: list[Optional[bytes]] = [None] * num_slots

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools)

    def put(self, slots: Sequence[int], hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        if not slots:
            return
        idx = torch.tensor(list(slots), dtype=torch.long)
        for pool, b in zip(self.pools, blocks):
            pool.index_copy_(BLOCK_DIM, idx, b.to(pool.dtype))
        for s, h in zip(slots, hashes):
            self.hashes[s] = h

    def get(self, slots: Sequence[int], hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        ok = [0 <= s < self.num_slots and self.hashes[s] == h for s, h in zip(slots, hashes)]
        if not any(ok):
            return ok
        idx = torch.tensor([s if good else 0 for s, good in zip(slots, ok)], dtype=torch.long)
        for pool, o in zip(self.pools, out):
            torch.index_select(pool, BLOCK_DIM, idx, out=o)
        return ok

    def discard(self, slots: Sequence[int]) -> None:
        for s in slots:
            if 0 <= s < self.num_slots:
                self.hashes[s] = None

    def close(self) -> None:
        self.pools = []
        self.hashes = [None] * self.num_slots
