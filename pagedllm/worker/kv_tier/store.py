"""The store Protocol of the KV offload tier: what one rank keeps of the blocks the core's
TierIndex (core/kv_tier.py) put into its slots.

Interface (stable; ``native`` host memory is host.py, ``disk`` is disk.py)
----------------------------------------------------------------------------
A store is built once per rank by factory.py's ``make_tier_store(config, layout, num_slots, rank,
device)`` after the KV cache is allocated. ``layout`` (``TierBlockLayout``) says what one block is on this rank: one
entry per cache tensor of the worker (the K/V planes ``[planes, layers, num_blocks, block_size,
kv_heads, head_dim]``; with an 8-bit cache also its scales ``[planes, layers, num_blocks,
block_size, kv_heads]``), as the shape with the block dim (dim 2) taken out, and the dtype. Every
batch of blocks crossing the Protocol is a list of host (CPU) tensors in that order, each of shape
``layout.batch_shape(k, n)`` = the cache tensor's shape with ``n`` at dim 2; block ``i`` of a batch
is ``t[:, :, i]``.

- ``put(slots, hashes, blocks)``: keep block ``i`` of ``blocks`` in ``slots[i]`` under
  ``hashes[i]`` (replacing whatever the slot held). May return before the data is durable (an
  asynchronous write), as long as a later ``get`` of that slot either sees it or reports a
  failure. ``blocks`` may be reused by the caller once ``put`` returns (copy what you keep).
  Should not raise for an I/O problem (log it, forget the slot); a raise is caught by the caller,
  which then discards those slots.
- ``get(slots, hashes, out) -> list[bool]``: fill block ``i`` of ``out`` from ``slots[i]`` when the
  slot holds ``hashes[i]`` intact, reporting True; False for a slot that is empty, holds another
  hash, or whose data is corrupt or unreadable (the request recomputes it). Must never fill a
  block it reports True for with anything but exactly what was put. Synchronous: done on return.
- ``discard(slots)``: forget these slots (the core will not ask for them again until a new put).
- ``close()``: release files / memory (the engine is shutting down).
``num_slots`` is fixed at construction. Slots and hashes come from the core only; a store never
picks a slot. Under tensor parallelism every rank gets the same calls with its own shard's data
(a load counts as failed when it failed on any rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

BLOCK_DIM = 2  # the block dim of every cache tensor (worker/worker.KVCacheSpec.allocate)


@dataclass(frozen=True)
class TierBlockLayout:
    """What one block is on this rank: per cache tensor, its shape without the block dim, and dtype."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor]) -> "TierBlockLayout":
        return cls(tuple(tuple(c.shape[:BLOCK_DIM]) + tuple(c.shape[BLOCK_DIM + 1:]) for c in caches),
                   tuple(c.dtype for c in caches))

    def batch_shape(self, k: int, n: int) -> tuple[int, ...]:
        s = self.shapes[k]
        return s[:BLOCK_DIM] + (n,) + s[BLOCK_DIM:]

    def empty_batch(self, n: int, pin_memory: bool = False) -> list[torch.Tensor]:
        return [torch.empty(self.batch_shape(k, n), dtype=d, pin_memory=pin_memory) for k, d in enumerate(self.dtypes)]

    @property
    def bytes_per_block(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = 1
            for x in shape:
                n *= x
            total += n * torch.empty((), dtype=dtype).element_size()
        return total


class KVTierStore(Protocol):
    num_slots: int

    def put(self, slots: Sequence[int], hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None: ...

    def get(self, slots: Sequence[int], hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]: ...

    def discard(self, slots: Sequence[int]) -> None: ...

    def close(self) -> None: ...
