"""SpillingTierStore: the ``native+disk`` KV offload tier -- host memory in front of the disk tier.

The core's slots are the disk tier's (``kv_offloading_size``); the host part
(``kv_offload_host_size``) holds the most recently stored of them. A block is written to host
memory only; when the host part is full, its least recently used block spills to the disk tier
(an asynchronous file write, disk.py), so a block that comes back soon is never written to disk
at all. A load takes each slot from wherever it lives now. Every slot's data is in exactly one
place, so the host part adds speed, not capacity: the tier holds ``num_slots`` blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from pagedllm.worker.kv_tier.store import BLOCK_DIM


class SpillingTierStore:
    def __init__(self, host, disk) -> None:
        self.host = host  # a HostTierStore (host.py)
        self.disk = disk  # a DiskTierStore (disk.py)
        self.num_slots = disk.num_slots
        self.layout = disk.layout
        self._in_host: OrderedDict[int, int] = OrderedDict()  # core slot -> host slot, least recently used first
        self._free_host = list(range(host.num_slots - 1, -1, -1))
        self.spilled_blocks = 0

    def put(self, slots: Sequence[int], hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        n = len(slots)
        if not n:
            return
        direct = max(0, n - self.host.num_slots)  # a batch larger than the host part: its head goes to disk
        if direct:
            self._forget_host(slots[:direct])
            self.disk.put(list(slots[:direct]), list(hashes[:direct]), [b.narrow(BLOCK_DIM, 0, direct) for b in blocks])
        slots, hashes = list(slots[direct:]), list(hashes[direct:])
        spill_core, spill_host, host_slots = [], [], []
        for s in slots:
            hs = self._in_host.pop(s, None)
            if hs is None:
                self.disk.discard([s])  # the slot's old block, if it was on disk
                if self._free_host:
                    hs = self._free_host.pop()
                else:  # spill the least recently used block (not one of this batch: they are not in yet)
                    victim, hs = self._in_host.popitem(last=False)
                    spill_core.append(victim)
                    spill_host.append(hs)
            self._in_host[s] = hs
            host_slots.append(hs)
        if spill_core:
            idx = torch.tensor(spill_host, dtype=torch.long)
            self.disk.put(spill_core, [self.host.hashes[hs] for hs in spill_host],
                          [p.index_select(BLOCK_DIM, idx) for p in self.host.pools])
            self.spilled_blocks += len(spill_core)
        self.host.put(host_slots, hashes, [b.narrow(BLOCK_DIM, direct, len(slots)) for b in blocks])

    def get(self, slots: Sequence[int], hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        n = len(slots)
        ok = [False] * n
        where = [i for i, s in enumerate(slots) if s in self._in_host]
        elsewhere = [i for i in range(n) if slots[i] not in self._in_host]
        for s in (slots[i] for i in where):
            self._in_host.move_to_end(s)
        self._get_part(self.host, where, [self._in_host[slots[i]] for i in where], hashes, out, ok)
        self._get_part(self.disk, elsewhere, [slots[i] for i in elsewhere], hashes, out, ok)
        return ok

    def _get_part(self, store, rows: list[int], store_slots: list[int], hashes, out, ok: list[bool]) -> None:
        if not rows:
            return
        part_hashes = [hashes[i] for i in rows]
        if len(rows) == len(ok):
            ok[:] = store.get(store_slots, part_hashes, out)
            return
        part = self.layout.empty_batch(len(rows))
        got = store.get(store_slots, part_hashes, part)
        idx = torch.tensor(rows, dtype=torch.long)
        for o, p in zip(out, part):
            o.index_copy_(BLOCK_DIM, idx, p)
        for i, g in zip(rows, got):
            ok[i] = g

    def discard(self, slots: Sequence[int]) -> None:
        self._forget_host(slots)
        self.disk.discard(list(slots))

    def close(self) -> None:
        self.host.close()
        self.disk.close()
        self._in_host.clear()

    def _forget_host(self, slots: Sequence[int]) -> None:
        gone = []
        for s in slots:
            hs = self._in_host.pop(s, None)
            if hs is not None:
                gone.append(hs)
                self._free_host.append(hs)
        if gone:
            self.host.discard(gone)
