"""BlockPool: the KV blocks, their reference counts, the LRU free queue and the prefix-cache map.

Invariants (checked by ``check_consistency`` in tests):
- a block is in the free queue  <=>  its ref_cnt == 0;
- free queue order = eviction order: least recently freed first; a request's blocks are freed
  tail-first, so the tail of a prompt is evicted before its head;
- a block with a hash is in ``cached`` under that hash; eviction (lazy) happens only when a
  free block is handed out again, and only then is ``on_evict(block_id, hash)`` told (the KV
  offload tier saves the block's K/V before the step overwrites it: core/kv_tier.py); a hash
  dropped because its contents are suspect (``uncache``, a reset) is not.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional


# block_states() codes
BLOCK_FREE, BLOCK_CACHED, BLOCK_IN_USE, BLOCK_SHARED = 0, 1, 2, 3


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:  # pragma: no cover
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list over KVCacheBlock: O(1) pop-front, append, and remove-from-middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool,
                 on_evict: Optional[Callable[[int, bytes], None]] = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached-but-unreferenced blocks count as free: evictable)."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_states(self) -> bytes:
        """One byte per block, by id: BLOCK_FREE, BLOCK_CACHED (free, still in the prefix cache:
        evictable), BLOCK_IN_USE (one holder) or BLOCK_SHARED (several holders: a shared prefix)."""
        return bytes(BLOCK_SHARED if b.ref_cnt > 1 else BLOCK_IN_USE if b.ref_cnt == 1
                     else BLOCK_CACHED if b.block_hash is not None else BLOCK_FREE for b in self.blocks)

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    # ---- allocation -------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out = []
        on_evict = self.on_evict
        for _ in range(n):
            block = self.free_queue.popleft()
            if on_evict is not None and block.block_hash is not None:
                on_evict(block.block_id, block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock], uncache: bool = False) -> None:
        """Release one reference per block. ``uncache``: blocks that become free also lose their
        hash (their contents may never have been written, e.g. after a failed step)."""
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if uncache:
                    self._evict(block)
                if block.block_hash is None:
                    self.free_queue.appendleft(block)  # nothing worth keeping: reuse first
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its hash. Identical content held twice keeps the first copy
        in the map; the second stays private (block tables are append-only)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no request holds a block (as in vLLM)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    # ---- testing aid ------------------------------------------------------------------------
    def check_consistency(self) -> None:
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == self.free_queue.num_free, "free queue count drifted"
        for b in self.blocks:
            assert b.ref_cnt >= 0, b
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), b
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, b
        for h, b in self.cached.items():
            assert b.block_hash == h
