"""Hash chain of full KV blocks.

hash(block) = sha256(parent_hash || token ids packed as little-endian uint32 || extra keys).
A fixed byte encoding (no pickle, no salted ``hash()``) makes it stable across processes; sha256's
256-bit output makes an accidental collision (which would silently reuse the wrong KV) negligible.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

NONE_HASH = hashlib.sha256(b"pagedllm-prefix-cache-root").digest()


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_key: Optional[str] = None) -> bytes:
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else NONE_HASH)
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - exotic platforms
        packed = array("L", token_ids)
    h.update(packed.tobytes())
    if extra_key:
        h.update(b"\x00extra\x00")
        h.update(extra_key.encode())
    return h.digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None
) -> None:
    """Append hashes for every block of ``token_ids`` that became full (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i > 0 else None
        # The cache salt (e.g. per-tenant isolation, later a LoRA id) only keys the first block;
        # the chain carries it to every later block.
        block_hashes.append(
            hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], cache_salt if i == 0 else None)
        )
