"""KVCacheManager: the scheduler's only door to the block pool. Returns block ids, never blocks.

``allocate_slots`` regions for one request (token positions):

    | computed (in blocks already held) | new computed (prefix-cache hit) | new (to compute now) |
    0                          num_computed_tokens      +num_new_computed_tokens     +num_new_tokens

Blocks for the "new" region are taken from the pool only if ALL of them (and the hit blocks that
sit in the free queue) fit; otherwise nothing changes and None is returned ("no room": preempt).

Sliding window (``sliding_window``: every layer of the model attends only to the last W keys):
a query at position p sees key j iff p - j < W, so once a request's next token to compute is at
position P, every key j <= P - W is dead for good and the leading blocks holding only such keys go
back to the pool (keeping their prefix-cache hashes, like any freed block). The request's block
list keeps its positions: a freed entry becomes ``OUT_OF_WINDOW`` (block id 0). The workers' block
tables may still name a freed block (or block 0) there; no attention path reads it: the C++ and
Triton kernels start at the window and the torch path masks keys before it, and the cache only
ever holds finite values (zero-initialised, then K/V), so a masked stale entry weighs exactly 0.
Models whose layers mix windowed and full attention (Gemma 2/3) keep every block (``None``).

KV offload tier (``tier``, core/kv_tier.py): the pool tells the tier about every cached block it
hands out again (a store is planned), and a waiting request's device hit continues into the tier:
``prepare_admission`` starts its loads (it holds its device hits and a fresh block per tier block
and waits), ``finish_transfers`` caches what arrived and gives the blocks back at once, so the
next admission finds them as ordinary prefix-cache hits.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.contracts import KVTierStats, KVTransfers, TierCopy
from pagedllm.core.kv_tier import LOADING, KVTier
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Stands in a request's block list for a block freed because it fell out of the sliding window.
OUT_OF_WINDOW = KVCacheBlock(0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: Optional[int] = None, tier: Optional[KVTier] = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_window_freed: dict[str, int] = {}  # leading blocks of a request freed out of the window
        self.enable_prefix_caching = enable_prefix_caching
        if tier is not None and not enable_prefix_caching:
            raise ValueError("the KV offload tier keys blocks by their prefix-cache hash: it needs "
                             "enable_prefix_caching")
        self.tier = tier
        self._tier_loaded_tokens: dict[str, int] = {}  # tokens a request just got from the tier (stats)
        self.pool = BlockPool(num_blocks, enable_prefix_caching, tier.block_evicted if tier is not None else None)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already in the map
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # by RequestTable slot: the token count up to which a request's next slots are in blocks it
        # holds and fill none (allocate_slots would change nothing); 0: unknown (the full path runs)
        self.room = np.zeros(0, dtype=np.int64)

    # ---- stats ------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_states(self) -> bytes:
        """Each block's state, by block id (block_pool.BLOCK_FREE / CACHED / IN_USE / SHARED)."""
        return self.pool.block_states()

    def track_row(self, slot: int) -> None:
        """A new RequestTable row: its room starts unknown (the columns grow with the table's)."""
        if slot >= len(self.room):
            self.room = np.concatenate([self.room, np.zeros(max(slot + 1, 2 * len(self.room)) - len(self.room),
                                                            dtype=np.int64)])
        self.room[slot] = 0

    def _set_room(self, request: Request, blocks: list) -> None:
        """After the full path: what the fast path of allocate_slots accepts from now on."""
        if request.slot < 0 or self.sliding_window is not None:
            return
        room = len(blocks) * self.block_size
        if self.enable_prefix_caching:
            room = min(room, (self.num_cached_blocks.get(request.request_id, 0) + 1) * self.block_size - 1)
        self.room[request.slot] = room

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_key,
                            request.mm_features)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks for this request's tokens. The hit is capped so at
        least the last token is computed (its logits are needed). Does not take references."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break  # hashes chain: every later block misses too
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int, request_id: Optional[str] = None) -> None:
        """Counted once per admission (a request retried while waiting is not counted twice). The
        hit includes blocks just loaded from the tier; the tier counts its own part."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens
        if self.tier is not None and request_id is not None:
            loaded = self._tier_loaded_tokens.pop(request_id, 0)
            self.tier.count_lookup(num_tokens - (num_hit_tokens - loaded), loaded)

    # ---- the KV offload tier ----------------------------------------------------------------
    def prepare_admission(self, request: Request) -> bool:
        """Before a waiting request is admitted: False while it waits for tier loads (just given
        some, or in flight); True when it may be admitted now (blocks it loaded are prefix-cache
        hits for ``get_computed_blocks``)."""
        tier = self.tier
        if tier is None:
            return True
        if tier.load_state(request.request_id) == LOADING:
            return False
        return not self._start_tier_load(request)

    def _start_tier_load(self, request: Request) -> bool:
        hits, _ = self.get_computed_blocks(request)
        if request.sampling_params.prompt_logprobs is not None:
            return False
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        found = self.tier.lookup(request.block_hashes[len(hits):max_hit_blocks])
        if not found:
            return False
        num_hits_in_queue = sum(1 for b in hits if b.ref_cnt == 0)
        if len(found) + num_hits_in_queue > self.pool.num_free_blocks:
            return False  # no room to load into now: admitted as usual (it recomputes, or waits for room)
        self.pool.touch(hits)  # held while the loads run, so the chain cannot break meanwhile
        fresh = self.pool.get_new_blocks(len(found))
        rid = request.request_id
        self.req_blocks[rid] = list(hits) + fresh
        self.num_cached_blocks[rid] = len(hits)
        self.tier.plan_loads(rid, [TierCopy(b.block_id, slot, h) for b, (h, slot) in zip(fresh, found)])
        return True

    def finish_transfers(self, transfers: KVTransfers, failed=(), seconds: float = 0.0) -> None:
        """A step's output is back: blocks whose loads arrived join the prefix cache (a request's
        run stops at its first failed load: what follows is recomputed)."""
        if self.tier is None or not transfers:
            return
        self._cache_loaded(self.tier.finish_step(transfers, failed, seconds))

    def transfers_failed(self, transfers: KVTransfers) -> None:
        """The step's execution raised: its loads count as failed (those requests recompute)."""
        if self.tier is not None and transfers:
            self._cache_loaded(self.tier.step_failed(transfers))

    def _cache_loaded(self, done: list[tuple[str, list[TierCopy]]]) -> None:
        """Loaded blocks join the prefix cache; the waiting request lets go of all its blocks
        (most recently freed: the last to be evicted) and finds them again when admitted."""
        for rid, copies in done:
            blocks = self.req_blocks.pop(rid)
            start = self.num_cached_blocks.pop(rid)
            for k, copy in enumerate(copies):
                block = blocks[start + k]
                assert block.block_id == copy.block_id, (block, copy)
                self.pool.cache_block(block, copy.block_hash)
            self.pool.free_blocks(reversed(blocks))
            self._tier_loaded_tokens[rid] = len(copies) * self.block_size

    def take_transfers(self) -> KVTransfers:
        return self.tier.take_transfers() if self.tier is not None else KVTransfers()

    def tier_stats(self) -> Optional[KVTierStats]:
        return self.tier.stats() if self.tier is not None else None

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
    ) -> Optional[list[int]]:
        """Returns the ids of newly added blocks (cache hits first), or None when there is no room."""
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be > 0")
        held = self.req_blocks.get(request.request_id)
        if held is not None and not new_computed_blocks and not num_new_computed_tokens and self.sliding_window is None:
            # the usual decode step: its slots are in the blocks it holds and no block of known
            # tokens fills up (the general path below would do nothing; a block whose last token is
            # still being sampled by a step in flight is registered once that token is known)
            after = request.num_computed_tokens + num_new_tokens
            if -(-after // self.block_size) <= len(held) and (
                    not self.enable_prefix_caching
                    or min(after, len(request.all_token_ids)) // self.block_size
                    <= self.num_cached_blocks.get(request.request_id, 0)):
                return []
            return self._extend(request, held, after)
        new_computed_blocks = new_computed_blocks or []
        held = held if held is not None else []
        num_held = len(held)
        first_new_pos = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = first_new_pos + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens_after) - num_held - len(new_computed_blocks)
        # Sliding window: hits the window has already left behind are not taken at all (they stay
        # free, hashes and all), and held blocks it leaves behind are freed below, so they count
        # as room already (only those no other request shares: a shared one stays held).
        num_dead = self._num_dead_blocks(first_new_pos)
        num_skipped_hits = min(max(0, num_dead - num_held), len(new_computed_blocks))
        live_hits = new_computed_blocks[num_skipped_hits:]
        dying = held[self.num_window_freed.get(request.request_id, 0):num_dead]
        num_dying = sum(1 for b in dying if b.ref_cnt == 1)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_hits_in_queue = sum(1 for b in live_hits if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_hits_in_queue > self.pool.num_free_blocks + num_dying:
            return None
        if dying:
            self._free_out_of_window(request.request_id, held, first_new_pos)  # room before taking more
        self.pool.touch(live_hits)
        fresh = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if num_skipped_hits:
            blocks.extend([OUT_OF_WINDOW] * num_skipped_hits)
            self.num_window_freed[request.request_id] = num_held + num_skipped_hits
        blocks.extend(live_hits)
        blocks.extend(fresh)
        if self.enable_prefix_caching:
            self._register_full(request, blocks, num_tokens_after)
        self._set_room(request, blocks)
        return [b.block_id for b in blocks[num_held:]]

    def _extend(self, request: Request, blocks: list[KVCacheBlock], num_tokens_after: int) -> Optional[list[int]]:
        """The full path for a request that holds blocks, takes no hits and has no window (a
        decode step reaching a block boundary): fresh blocks for ``num_tokens_after`` tokens and
        the blocks that filled registered in the prefix cache."""
        num_new_blocks = self.blocks_needed(num_tokens_after) - len(blocks)
        fresh = []
        if num_new_blocks > 0:
            if num_new_blocks > self.pool.num_free_blocks:
                return None
            fresh = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(fresh)
        if self.enable_prefix_caching:
            self._register_full(request, blocks, num_tokens_after)
        self._set_room(request, blocks)
        return [b.block_id for b in fresh]

    def _register_full(self, request: Request, blocks: list[KVCacheBlock], num_tokens_after: int) -> None:
        """Register full blocks of known tokens now: they are written in this very step, and
        attention in the same forward pass reads them only after every layer's K/V store."""
        self._update_hashes(request)
        num_full = min(num_tokens_after // self.block_size, len(request.block_hashes))
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        for i in range(start, num_full):
            if blocks[i] is not OUT_OF_WINDOW:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[rid] = max(start, num_full)

    # ---- sliding window ---------------------------------------------------------------------
    def _num_dead_blocks(self, first_new_pos: int) -> int:
        """Leading blocks whose keys no query at or after ``first_new_pos`` can see."""
        if self.sliding_window is None:
            return 0
        return max(0, (first_new_pos - self.sliding_window + 1) // self.block_size)

    def _free_out_of_window(self, request_id: str, blocks: list[KVCacheBlock], first_new_pos: int) -> None:
        done = self.num_window_freed.get(request_id, 0)
        dead = min(self._num_dead_blocks(first_new_pos), len(blocks))
        if dead <= done:
            return
        # Oldest first into the free queue's tail: the far past is evicted before the recent past.
        self.pool.free_blocks(blocks[done:dead])
        blocks[done:dead] = [OUT_OF_WINDOW] * (dead - done)
        self.num_window_freed[request_id] = dead

    def free(self, request: Request, uncache: bool = False) -> None:
        """``uncache``: forget the prefix-cache hashes of blocks no one else holds (a failed
        step may have registered blocks whose K/V were never written)."""
        rid = request.request_id
        if request.slot >= 0:
            self.room[request.slot] = 0
        blocks = self.req_blocks.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        freed = self.num_window_freed.pop(rid, 0)
        if self.tier is not None:
            self.tier.forget(rid)  # loads still in flight only unpin their slots when they are back
            self._tier_loaded_tokens.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks[freed:]), uncache)

    def rollback(self, request: Request) -> int:
        """Speculative decoding: after rejected drafts, keep only the blocks that hold the
        request's ``num_computed_tokens`` positions; trailing blocks that held nothing but
        rejected drafts go back to the pool (never hashed: only known tokens are). Returns how
        many block ids were dropped from the tail."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = max(self.blocks_needed(request.num_computed_tokens), self.num_cached_blocks.get(request.request_id, 0))
        if keep >= len(blocks):
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        if request.slot >= 0:
            self.room[request.slot] = 0
        self.pool.free_blocks(reversed(tail))
        return len(tail)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, the tier's too (only when no request holds a block)."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.tier is not None:
            self.tier.clear()
        return True
