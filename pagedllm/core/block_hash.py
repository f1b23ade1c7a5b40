"""Hash chain of full KV blocks.

hash(block) = sha256(parent_hash || token ids packed as little-endian uint32 || extra keys).
A fixed byte encoding (no pickle, no salted ``hash()``) makes it stable across processes; sha256's
256-bit output makes an accidental collision (which would silently reuse the wrong KV) negligible.

Extra keys of a block: the cache salt (first block only; the chain carries it on) and, for a
multimodal prompt, the content hash and start position of every image (or other item) whose
placeholder positions overlap the block. Placeholder token ids are the same for every image, so
without its hash two different images at the same place would share KV blocks.
"""
from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from typing import Optional, Protocol, Sequence

NONE_HASH = hashlib.sha256(b"pagedllm-prefix-cache-root").digest()


class PlaceholderSpan(Protocol):
    """What the hash chain reads of a multimodal item (core.contracts.MultiModalFeature)."""

    offset: int  # first placeholder position in the prompt
    length: int  # number of placeholder positions
    content_hash: str


@lru_cache(maxsize=64)
def _uint32_le(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_key: Optional[str] = None) -> bytes:
    h = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    h.update(_uint32_le(len(token_ids)).pack(*token_ids))
    if extra_key:
        h.update(b"\x00extra\x00")
        h.update(extra_key.encode())
    return h.digest()


def block_extra_key(index: int, block_size: int, cache_salt: Optional[str],
                    mm_spans: Sequence[PlaceholderSpan] = ()) -> Optional[str]:
    """The extra key of block ``index``: the salt on block 0, then ``mm:<hash>@<offset>`` for each
    item overlapping the block's positions (None: the block has none)."""
    salt = cache_salt if index == 0 else None
    if not mm_spans:
        return salt
    start, end = index * block_size, (index + 1) * block_size
    items = [f"mm:{s.content_hash}@{s.offset}" for s in mm_spans if s.offset < end and s.offset + s.length > start]
    if not items:
        return salt  # text blocks hash exactly as before (the router's prompt hashes stay equal)
    return (salt or "") + "\x00" + "\x00".join(items)


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None,
    mm_spans: Sequence[PlaceholderSpan] = (),
) -> None:
    """Append hashes for every block of ``token_ids`` that became full (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i > 0 else None
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size],
                                              block_extra_key(i, block_size, cache_salt, mm_spans)))
