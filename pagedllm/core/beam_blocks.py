"""Block sharing between forked beams: fork by reference, copy the partly filled last block on write.

A child beam starts as its parent's sequence plus one token. ``fork_blocks`` gives it every block
the parent holds, by reference (ref_cnt + 1 each), so a group of W beams holds its common prefix
once. Full blocks are immutable (their tokens are final, and they may carry a prefix-cache hash),
so they stay shared for good. The last block is usually partly filled: the next token of each
child goes into it, at the same slot. ``copy_on_write`` runs just before a beam's token is
allocated: when the block that token lands in is shared (ref_cnt > 1), the beam takes a fresh
block, drops its reference to the shared one, and records (shared id, fresh id) for the workers
to copy the K/V already written there before the step's forward. The last holder of a shared
block writes in place (no copy). With block_size 1 the next token always starts a new block:
no copy ever happens.

Both functions work on KVCacheManager's per-request block lists (its one source of truth).
"""
from __future__ import annotations

from typing import Optional

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request


def fork_blocks(kv: KVCacheManager, parent: Request, child: Request) -> None:
    """``child`` shares all of ``parent``'s blocks (one more reference each)."""
    blocks = kv.req_blocks.get(parent.request_id, [])
    freed = kv.num_window_freed.get(parent.request_id, 0)  # sliding window: placeholders, not held
    kv.pool.touch(blocks[freed:])
    kv.req_blocks[child.request_id] = list(blocks)
    if parent.request_id in kv.num_cached_blocks:
        kv.num_cached_blocks[child.request_id] = kv.num_cached_blocks[parent.request_id]
    if freed:
        kv.num_window_freed[child.request_id] = freed
    child.block_hashes = list(parent.block_hashes)


def shared_write_block(kv: KVCacheManager, request: Request) -> Optional[int]:
    """Index (in the request's block list) of a shared block its next computed token would be
    written into, or None when that token goes to a private or a new block."""
    pos = request.num_computed_tokens
    idx = pos // kv.block_size
    blocks = kv.req_blocks.get(request.request_id)
    if not blocks or idx >= len(blocks) or idx < kv.num_window_freed.get(request.request_id, 0):
        return None
    return idx if blocks[idx].ref_cnt > 1 else None


def copy_on_write(kv: KVCacheManager, request: Request) -> Optional[tuple[int, int]]:
    """Make the block the request writes next private. Returns (source, destination) block ids
    for the workers to copy, None when nothing had to be copied. Raises nothing when there is no
    free block: returns False-like ``()``, and the caller treats it as "no room" (preempt)."""
    idx = shared_write_block(kv, request)
    if idx is None:
        return None
    if kv.pool.num_free_blocks < 1:
        return ()
    blocks = kv.req_blocks[request.request_id]
    shared = blocks[idx]
    fresh = kv.pool.get_new_blocks(1)[0]
    blocks[idx] = fresh
    kv.pool.free_blocks([shared])  # still held by the other beams: ref_cnt stays >= 1
    return shared.block_id, fresh.block_id
