"""PrefixIndex: one replica's approximate set of cached KV block hashes, LRU-bounded.

The router does not see the engines' caches; it remembers the block hashes of the prompts it
sent to each replica (the engine will have cached those blocks, until its own LRU evicts them).
Because a block's hash chains its parent's, a prompt's cached prefix on a replica is the run of
its leading hashes the index holds: the walk stops at the first miss. Pure Python, O(blocks).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the index holds (no mutation)."""
        n = 0
        for h in block_hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, block_hashes: Sequence[bytes]) -> None:
        """Record (or refresh) a routed prompt's blocks; the least recently used fall out. The
        leading blocks are touched last, so a chain loses its tail before its head (as the
        engines free a request's blocks tail first)."""
        lru = self._lru
        for h in reversed(block_hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()
