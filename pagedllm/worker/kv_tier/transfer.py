"""TierTransfers: the runner's part of the KV offload tier. Each step, before the block copies and
the forward, it runs the step's KVTransfers (core/contracts.py) against this rank's store:

1. drops: ``store.discard`` (slots the core forgot; a store below may reuse one);
2. stores: the listed device blocks are gathered (one ``index_select`` per cache tensor), brought
   to the host and handed to ``store.put`` -- before anything in this step overwrites them;
3. loads: ``store.get`` fills a host batch, which is scattered into the listed fresh device blocks
   (one ``index_copy_`` per cache tensor); a load the store refuses is reported as failed (under
   tensor parallelism: failed on any rank, agreed with one small all-reduce).
A store that raises degrades to "not stored" (the slots are discarded, a warning is logged) and
a get that raises to "every load failed": the request recomputes, it never errors.

On GPU the host side is pinned memory and the copies are plain ``copy_`` calls on the current
stream, ordered before the forward (the loads' blocks are only read by the next step). A side
stream that overlaps the copies with the forward is not written yet.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from pagedllm.core.contracts import KVTransfers
from pagedllm.worker.kv_tier.store import BLOCK_DIM, KVTierStore, TierBlockLayout

logger = logging.getLogger(__name__)


class TierTransfers:
    def __init__(self, store: KVTierStore, caches: Sequence[torch.Tensor], tp_group=None) -> None:
        self.store = store
        self.caches = list(caches)
        self.layout = TierBlockLayout.of(self.caches)
        self.tp = tp_group
        self.device = self.caches[0].device
        self._pin = self.device.type == "cuda"

    def run(self, transfers: KVTransfers) -> tuple[frozenset[int], float]:
        """(device block ids whose load failed, seconds spent)."""
        t0 = time.perf_counter()
        if transfers.drops:
            try:
                self.store.discard(list(transfers.drops))
            except Exception:
                logger.warning("KV offload tier: discarding %d slots failed", len(transfers.drops), exc_info=True)
        if transfers.stores:
            self._store(transfers)
        failed: set[int] = set()
        if transfers.loads:
            failed = self._load(transfers)
        if transfers.loads and self.tp is not None and self.tp.world_size > 1:
            failed = self._agree(transfers, failed)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the loads are done when the output returns
        return frozenset(failed), time.perf_counter() - t0

    def _store(self, t: KVTransfers) -> None:
        ids = torch.tensor([c.block_id for c in t.stores], dtype=torch.long, device=self.device)
        slots = [c.slot for c in t.stores]
        blocks = [cache.index_select(BLOCK_DIM, ids).to("cpu") for cache in self.caches]
        try:
            self.store.put(slots, [c.block_hash for c in t.stores], blocks)
        except Exception:
            logger.warning("KV offload tier: storing %d blocks failed; they will be recomputed when needed",
                           len(slots), exc_info=True)
            try:
                self.store.discard(slots)
            except Exception:
                pass

    def _load(self, t: KVTransfers) -> set[int]:
        n = len(t.loads)
        out = self.layout.empty_batch(n, pin_memory=self._pin)
        try:
            ok = self.store.get([c.slot for c in t.loads], [c.block_hash for c in t.loads], out)
        except Exception:
            logger.warning("KV offload tier: loading %d blocks failed; they are recomputed", n, exc_info=True)
            return {c.block_id for c in t.loads}
        good = [i for i, g in enumerate(ok) if g]
        if good:
            ids = torch.tensor([t.loads[i].block_id for i in good], dtype=torch.long, device=self.device)
            sel = None if len(good) == n else torch.tensor(good, dtype=torch.long)
            for cache, o in zip(self.caches, out):
                src = o if sel is None else o.index_select(BLOCK_DIM, sel)
                cache.index_copy_(BLOCK_DIM, ids, src.to(self.device, non_blocking=self._pin))
        return {c.block_id for c, g in zip(t.loads, ok) if not g}

    def _agree(self, t: KVTransfers, failed: set[int]) -> set[int]:
        """A load failed on one rank fails on all (each rank holds a shard of the same block)."""
        import torch.distributed as dist

        flags = torch.tensor([c.block_id in failed for c in t.loads], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.tp.cpu_group)
        return {c.block_id for c, f in zip(t.loads, flags.tolist()) if f}

    def close(self) -> None:
        self.store.close()
