"""KVCacheManager: the scheduler's only door to the block pool. Returns block ids, never blocks.

``allocate_slots`` regions for one request (token positions):

    | computed (in blocks already held) | new computed (prefix-cache hit) | new (to compute now) |
    0                          num_computed_tokens      +num_new_computed_tokens     +num_new_tokens

Blocks for the "new" region are taken from the pool only if ALL of them (and the hit blocks that
sit in the free queue) fit; otherwise nothing changes and None is returned ("no room": preempt).
"""
from __future__ import annotations

from typing import Optional

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already in the map
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)

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

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a request retried while waiting is not counted twice)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

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
        new_computed_blocks = new_computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens_after) - len(held) - len(new_computed_blocks)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_hits_in_queue = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_hits_in_queue > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        fresh = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(fresh)
        if self.enable_prefix_caching:
            # Register full blocks of known tokens now: they are written in this very step, and
            # attention in the same forward pass reads them only after every layer's K/V store.
            self._update_hashes(request)
            num_full = min(num_tokens_after // self.block_size, len(request.block_hashes))
            start = self.num_cached_blocks.get(request.request_id, 0)
            for i in range(start, num_full):
                self.pool.cache_block(blocks[i], request.block_hashes[i])
            self.num_cached_blocks[request.request_id] = max(start, num_full)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in fresh]

    def free(self, request: Request, uncache: bool = False) -> None:
        """``uncache``: forget the prefix-cache hashes of blocks no one else holds (a failed
        step may have registered blocks whose K/V were never written)."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks), uncache)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
