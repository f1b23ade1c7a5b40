"""The KV offload tier, core side: which block hashes the tier holds and in which slot, its own LRU
and capacity, and each step's transfer plan. Pure Python (no torch), like the rest of core/.

The tier is a second, larger and slower store of KV blocks below the device cache (host memory,
a disk: worker/kv_tier/). This index is AUTHORITATIVE for what it holds: workers never choose a
slot, so every tensor-parallel rank keeps the same slots (each with its own shard of the heads).

Interface (stable; the disk tier and the worker side are written against it)
----------------------------------------------------------------------------
Key: a block's prefix-cache hash (core/block_hash.py: the chain over the token ids, keyed by the
request's LoRA adapter and cache salt at its first block), so a tenant or adapter never reads
another's blocks from the tier either.

Life of a block in the tier (the KV cache manager drives it, core/kv_cache_manager.py):
- **store on eviction**: when the block pool hands out again a free block that still holds a
  cached hash, ``KVTier.block_evicted(block_id, hash)`` plans a store ``device block -> slot``
  (the tier's least recently used unpinned entry makes room; nothing is planned when the tier
  already holds the hash, or every slot is pinned). The worker runs it at the start of that very
  step, BEFORE anything (loads, block copies, the forward) overwrites the block.
- **lookup**: ``KVTier.lookup(hashes)`` -> the leading run of (hash, slot) the tier holds; the
  KV cache manager continues a request's device prefix-cache hit into the tier with it.
- **load before admit**: the request takes fresh device blocks for those hashes and waits in the
  waiting queue (set aside, others go on) while ``KVTier.plan_loads`` schedules ``slot -> block``
  copies in the next SchedulerOutput; their slots are pinned (never reused for a store) until the
  step's output comes back. ``KVTier.finish_step(transfers, failed)`` then reports each request
  whose loads are done; the manager caches the loaded blocks in the pool (up to the first failed
  one: the chain stops there) and lets go of the request's blocks at once (a waiting request
  holds nothing for long: no waiting request can block the one ahead of it), and the request is
  admitted on the next schedule with them as ordinary prefix-cache hits, computing the rest. A
  failed load (``failed_kv_loads``: a missing, stale or corrupt slot) drops that slot from the
  index and degrades to recompute.
- **drops**: slots the index forgot (a failed load, ``clear`` on a prefix-cache reset) reach the
  workers in ``KVTransfers.drops`` (run first in the step: a store of that step may reuse the
  slot), so a store may free what it kept there.

``KVTier.take_transfers()`` hands the scheduler the step's ``KVTransfers`` (contracts.py); a step
whose execution raised gives its transfers back through ``step_failed`` (its loads fail, the
requests recompute). Slots are ints in ``[0, num_slots)``; the worker's store (Protocol in
worker/kv_tier/store.py) keeps, per slot, the hash it was given and refuses a load whose hash
differs, so a plan can never load the wrong KV even after a failed step.

Swap preemption comes with it: a preempted request's full blocks keep their hashes (blocks of
output tokens too), so when they are evicted they go to the tier, and on resume the request's
lookup finds them on the device or in the tier; only its last, partial block is recomputed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from pagedllm.core.contracts import KVTierStats, KVTransfers, TierCopy

# KVTier.load_state()
LOADING = "loading"


class TierIndex:
    """hash -> slot with an LRU order (least recently used first) over ``num_slots`` slots.
    A pinned slot (a load in flight reads it) is never given to another hash; a pinned slot whose
    hash is removed goes back to the free slots only once its last pin is released."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the KV offload tier needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._pins: dict[int, int] = {}  # slot -> loads in flight
        self._orphans: set[int] = set()  # pinned slots whose hash was removed: free once unpinned

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self._slots.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)

    def lru_order(self) -> list[bytes]:
        return list(self._slots)

    def reserve(self, block_hash: bytes) -> tuple[Optional[int], Optional[bytes]]:
        """A slot for a new entry (most recently used): (slot, the hash evicted to make room or
        None). (None, None) when the hash is already held (it is touched) or every slot is pinned."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None, None
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            for h, s in self._slots.items():
                if s not in self._pins:
                    evicted = h
                    break
            else:
                return None, None
            slot = self._slots.pop(evicted)
        self._slots[block_hash] = slot
        return slot, evicted

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins.get(slot, 0)
        if n <= 0:
            raise RuntimeError(f"tier slot {slot} is not pinned")
        if n == 1:
            del self._pins[slot]
            if slot in self._orphans:
                self._orphans.discard(slot)
                self._free.append(slot)
        else:
            self._pins[slot] = n - 1

    def remove(self, block_hash: bytes) -> Optional[int]:
        """Forget a hash; its slot (returned) is free again (once unpinned)."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._release(slot)
        return slot

    def clear(self) -> list[int]:
        """Forget everything; the slots that held something."""
        slots = list(self._slots.values())
        self._slots.clear()
        for s in slots:
            self._release(s)
        return slots

    def _release(self, slot: int) -> None:
        if slot in self._pins:
            self._orphans.add(slot)
        else:
            self._free.append(slot)

    def check_consistency(self) -> None:
        held = list(self._slots.values())
        assert len(set(held)) == len(held), "a slot holds two hashes"
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        assert not free & set(held), "a held slot is also free"
        assert not free & self._orphans and not set(held) & self._orphans
        assert self._orphans <= set(self._pins), "an orphan slot is not pinned"
        assert len(held) + len(free) + len(self._orphans) == self.num_slots, "a slot leaked"
        assert all(0 <= s < self.num_slots for s in held + self._free)
        assert all(n > 0 for n in self._pins.values())


@dataclass
class _RequestLoad:
    copies: list[TierCopy]  # in block order: the request's blocks after its device hit
    remaining: int
    failed: set[int] = field(default_factory=set)  # device block ids whose load failed


class KVTier:
    """The tier's index plus what the core plans for the workers this step and has in flight."""

    def __init__(self, num_slots: int, bytes_per_block: int = 0, backend: str = "native") -> None:
        self.index = TierIndex(num_slots)
        self.bytes_per_block = bytes_per_block
        self.backend = backend
        self._stores: list[TierCopy] = []
        self._loads: list[TierCopy] = []
        self._load_owners: list[tuple[str, _RequestLoad]] = []  # the request of each planned load
        self._drops: list[int] = []
        self._seq = 0
        self._in_flight: dict[int, tuple[KVTransfers, list]] = {}  # by KVTransfers.seq: its loads' owners
        self._requests: dict[str, _RequestLoad] = {}  # requests with loads planned or in flight
        self.lookup_tokens = self.hit_tokens = 0
        self.stored_blocks = self.loaded_blocks = self.failed_loads = 0
        self.transfer_seconds = 0.0
        self.num_transfer_steps = 0

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    # ---- planning (the KV cache manager) ------------------------------------------------------
    def block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """A cached device block is being reused: save its K/V first (if the tier has room)."""
        slot, _ = self.index.reserve(block_hash)
        if slot is not None:
            self._stores.append(TierCopy(block_id, slot, block_hash))

    def lookup(self, block_hashes: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """The leading run of these hashes the tier holds, with their slots."""
        out = []
        for h in block_hashes:
            slot = self.index.lookup(h)
            if slot is None:
                break
            out.append((h, slot))
        return out

    def plan_loads(self, request_id: str, copies: list[TierCopy]) -> None:
        if request_id in self._requests:
            raise RuntimeError(f"request {request_id!r} already has tier loads")
        for c in copies:
            self.index.pin(c.slot)
            self.index.touch(c.block_hash)
        load = self._requests[request_id] = _RequestLoad(list(copies), len(copies))
        self._loads.extend(copies)
        self._load_owners.extend([(request_id, load)] * len(copies))

    def load_state(self, request_id: str) -> Optional[str]:
        """LOADING while the request's loads are planned or in flight, else None."""
        return LOADING if request_id in self._requests else None

    def forget(self, request_id: str) -> None:
        """The request let go of its blocks (aborted, finished): its loads' results, when they
        come back, only unpin their slots."""
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        """Forget every entry (the prefix cache was reset): the workers drop every slot."""
        self._drops.extend(self.index.clear())
        self._stores.clear()  # planned stores of hashes no longer wanted (their slots were just freed)

    # ---- the step ---------------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers:
        if not (self._stores or self._loads or self._drops):
            return KVTransfers()
        self._seq += 1
        out = KVTransfers(tuple(self._stores), tuple(self._loads), tuple(self._drops), seq=self._seq)
        self.stored_blocks += len(self._stores)
        if self._loads:
            self._in_flight[self._seq] = (out, self._load_owners)
        self._stores, self._loads, self._load_owners, self._drops = [], [], [], []
        return out

    def finish_step(self, transfers: KVTransfers, failed: Iterable[int] = (),
                    seconds: float = 0.0) -> list[tuple[str, list[TierCopy]]]:
        """A step's output is back: unpin its loads' slots, drop the failed ones from the index,
        and return (request id, its loaded copies up to the first failed one) for every request
        whose loads are now all back."""
        if transfers:
            self.num_transfer_steps += 1
            self.transfer_seconds += seconds
        entry = self._in_flight.pop(transfers.seq, None) if transfers.loads else None
        if entry is None:
            return []
        failed = set(failed)
        done = []
        for copy, (rid, owner) in zip(entry[0].loads, entry[1]):
            self.index.unpin(copy.slot)
            bad = copy.block_id in failed
            if bad:
                self.failed_loads += 1
                if self.index.lookup(copy.block_hash) == copy.slot:
                    self.index.remove(copy.block_hash)
                    self._drops.append(copy.slot)
            req = self._requests.get(rid)
            if req is not owner:
                continue  # it let go of its blocks meanwhile
            if bad:
                req.failed.add(copy.block_id)
            req.remaining -= 1
            if req.remaining == 0:
                del self._requests[rid]
                good = []
                for c in req.copies:
                    if c.block_id in req.failed:
                        break
                    good.append(c)
                self.loaded_blocks += len(good)
                done.append((rid, good))
        return done

    def step_failed(self, transfers: KVTransfers) -> list[tuple[str, list[TierCopy]]]:
        """The step's execution raised: none of its loads can be trusted."""
        return self.finish_step(transfers, [c.block_id for c in transfers.loads])

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.lookup_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def stats(self) -> KVTierStats:
        return KVTierStats(self.num_slots, len(self.index), self.bytes_per_block, self.lookup_tokens,
                           self.hit_tokens, self.stored_blocks, self.loaded_blocks, self.failed_loads,
                           self.transfer_seconds, self.num_transfer_steps)

    def check_consistency(self) -> None:
        self.index.check_consistency()
        pins: dict[int, int] = {}
        for transfers, _ in self._in_flight.values():
            for c in transfers.loads:
                pins[c.slot] = pins.get(c.slot, 0) + 1
        for c in self._loads:
            pins[c.slot] = pins.get(c.slot, 0) + 1
        assert pins == self.index._pins, (pins, self.index._pins)
