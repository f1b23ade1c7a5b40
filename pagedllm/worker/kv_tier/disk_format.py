"""The disk tier's file format: one file per KV block, a fixed header, then the block's bytes.

A file is named from the block hash and lives under a directory named from the layout
fingerprint, so engines of different models, dtypes, block sizes or shards (TP / PP ranks) can
share one ``--kv-offload-dir`` without ever reading one another's blocks:

    <dir>/<fingerprint hex, 16 chars>/<hash hex[:2]>/<hash hex>.kvb

Header (little-endian, ``HEADER_BYTES`` long, zero-padded):

    magic 8s | format version u16 | checksum kind u16 | hash length u16 | reserved u16 |
    layout fingerprint 32s | block hash 32s | payload bytes u64 | payload checksum u64

The header repeats the fingerprint and the block hash, so a file that was copied, renamed or
left by another layout is recognised as stale even under the right name; the checksum (zlib's
crc32, or xxhash64 where the ``xxhash`` package is installed: its kind is recorded, and a file
whose kind this process cannot compute is stale) catches a corrupt payload; the payload length
catches a truncated one. Nothing here touches torch: payloads are any writable buffer.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import Optional

MAGIC = b"PGLLMKV\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHHH32s32sQQ")
HEADER_BYTES = 128  # HEADER.size rounded up: the payload starts 128-byte aligned
assert HEADER.size <= HEADER_BYTES

CHECKSUM_CRC32, CHECKSUM_XXH64 = 1, 2

try:  # optional: several times faster than crc32 on large buffers
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

DEFAULT_CHECKSUM = CHECKSUM_XXH64 if _xxhash is not None else CHECKSUM_CRC32


def checksum(kind: int, payload) -> Optional[int]:
    """The payload's checksum of ``kind``; None when this process cannot compute that kind."""
    if kind == CHECKSUM_CRC32:
        return zlib.crc32(payload)  # releases the GIL on large buffers
    if kind == CHECKSUM_XXH64 and _xxhash is not None:
        return _xxhash.xxh64_intdigest(payload)
    return None


@dataclass(frozen=True)
class LayoutKey:
    """Everything that decides what the bytes of one block mean on one rank. Two engines whose
    keys differ in any field never load each other's files (the fingerprint differs)."""

    model: str  # the checkpoint directory (resolved)
    weights_stamp: str  # the weight files' names, sizes and mtimes: a rebuilt checkpoint is another model
    dtype: str  # the engine's dtype setting
    kv_cache_dtype: str
    quantization: str
    tensors: str  # per cache tensor: its block's shape (planes, layers, block size, kv heads, head dim) and dtype
    tp_rank: int
    tp_size: int
    block_nbytes: int  # the payload of one block (an 8-bit cache: values and scales)

    def fingerprint(self) -> bytes:
        text = ";".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(b"pagedllm-kv-layout\x00" + text.encode()).digest()


def weights_stamp(model_dir: str) -> str:
    """Names, sizes and modification times of the checkpoint's weight files."""
    parts = []
    try:
        names = sorted(os.listdir(model_dir))
    except OSError:
        return ""
    for name in names:
        if name.endswith((".safetensors", ".bin", ".pt")):
            try:
                st = os.stat(os.path.join(model_dir, name))
            except OSError:
                continue
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return ",".join(parts)


def pack_header(fingerprint: bytes, block_hash: bytes, payload_nbytes: int, kind: int, value: int) -> bytes:
    if len(block_hash) > 32:
        raise ValueError(f"block hash of {len(block_hash)} bytes: the disk tier keys blocks by at most 32")
    head = HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(block_hash), 0, fingerprint, block_hash.ljust(32, b"\0"),
                       payload_nbytes, value)
    return head.ljust(HEADER_BYTES, b"\0")


class BadBlockFile(Exception):
    """A block file that must not be loaded; ``cause`` names why (one warning per cause)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def check_header(raw: bytes, fingerprint: bytes, block_hash: bytes, payload_nbytes: int) -> tuple[int, int]:
    """(checksum kind, checksum) of a header that belongs to this block of this layout; raises
    BadBlockFile("truncated" / "stale" / "corrupt") otherwise."""
    if len(raw) < HEADER.size:
        raise BadBlockFile("truncated", f"header of {len(raw)} bytes")
    magic, version, kind, hash_len, _, fp, h, nbytes, value = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BadBlockFile("corrupt", "not a pagedllm KV block file (bad magic)")
    if version != FORMAT_VERSION:
        raise BadBlockFile("stale", f"format version {version}, this build reads {FORMAT_VERSION}")
    if fp != fingerprint:
        raise BadBlockFile("stale", "written for another model / layout / shard")
    if hash_len != len(block_hash) or h[:hash_len] != block_hash:
        raise BadBlockFile("stale", "holds another block")
    if nbytes != payload_nbytes:
        raise BadBlockFile("stale", f"payload of {nbytes} bytes, the layout's block is {payload_nbytes}")
    if kind not in (CHECKSUM_CRC32, CHECKSUM_XXH64) or (kind == CHECKSUM_XXH64 and _xxhash is None):
        raise BadBlockFile("stale", f"checksum kind {kind} cannot be verified here")
    return kind, value
