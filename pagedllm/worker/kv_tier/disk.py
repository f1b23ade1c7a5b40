"""DiskTierStore: the ``disk`` KV offload tier (a worker/kv_tier/store.KVTierStore): one rank's slots
kept as block files under ``kv_offload_dir`` (block_files.DiskBlockStore: asynchronous writes,
checksummed, a failed load on any problem).

Where the files go::

    <kv_offload_dir>/<layout fingerprint, 16 hex>/layout.txt          whose blocks these are
    <kv_offload_dir>/<layout fingerprint, 16 hex>/run-<host>-<pid>-<n>/<hash[:2]>/<hash>.kvb

The fingerprint (disk_format.LayoutKey) covers the model directory and its weight files, the
dtype settings, every cache tensor's block shape and dtype (layers, block size, KV heads, head
dim, 8-bit scales) and the tensor-parallel rank and size, and every file's header repeats it: a
file from another model, layout or shard is never loaded. Each engine writes into a run directory
of its own, so engines that share ``kv_offload_dir`` (data-parallel replicas of one model) never
delete or overwrite each other's blocks; it is removed when the store closes, and one left by a
process that died on this host is swept at the next start. Blocks are not adopted across runs:
the core's TierIndex starts empty, and a slot is only ever loaded after this run stored it.

A block's payload is every cache tensor's part of that block, in layout order, as raw bytes (the
K/V planes ``[planes, layers, block_size, kv_heads, head_dim]``, then an 8-bit cache's scales):
``put`` packs a batch into one ``[n, bytes_per_block]`` host buffer (one strided copy per cache
tensor; its rows are the writes' payloads), ``get`` reads the files into such a buffer and
unpacks it into ``out`` the same way.
"""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import socket
from typing import Optional, Sequence

import torch

from pagedllm.worker.kv_tier.block_files import DiskBlockStore
from pagedllm.worker.kv_tier.disk_format import HEADER_BYTES, LayoutKey, weights_stamp
from pagedllm.worker.kv_tier.store import BLOCK_DIM, TierBlockLayout

logger = logging.getLogger(__name__)

_runs = itertools.count()


def layout_key(config, layout: TierBlockLayout, rank: int) -> LayoutKey:
    model = os.path.realpath(config.model)
    tensors = ",".join(f"{shape}:{str(dtype).removeprefix('torch.')}" for shape, dtype in zip(layout.shapes,
                                                                                              layout.dtypes))
    return LayoutKey(model=model, weights_stamp=weights_stamp(model), dtype=config.dtype,
                     kv_cache_dtype=config.kv_cache_dtype, quantization=str(config.quantization), tensors=tensors,
                     tp_rank=rank, tp_size=config.tensor_parallel_size, block_nbytes=layout.bytes_per_block)


class DiskTierStore:
    def __init__(self, config, layout: TierBlockLayout, num_slots: int, rank: int,
                 max_pending_bytes: int = 256 << 20) -> None:
        if num_slots < 1:
            raise ValueError(f"the disk KV offload tier needs at least 1 slot, got {num_slots}")
        if not config.kv_offload_dir:
            raise ValueError("kv_offloading_backend 'disk' needs kv_offload_dir (a directory for the block files)")
        self.layout = layout
        self.num_slots = num_slots
        self.block_nbytes = layout.bytes_per_block
        key = layout_key(config, layout, rank)
        fingerprint = key.fingerprint()
        base = os.path.join(os.path.abspath(config.kv_offload_dir), fingerprint.hex()[:16])
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {config.kv_offload_dir!r} cannot be used: {e}") from None
        _write_note(base, key)
        _sweep_dead_runs(base)
        root = os.path.join(base, f"run-{socket.gethostname()}-{os.getpid()}-{next(_runs)}")
        self.files = DiskBlockStore(root, num_slots * (self.block_nbytes + HEADER_BYTES), fingerprint,
                                    self.block_nbytes, max_pending_bytes)
        self.hashes: list[Optional[bytes]] = [None] * num_slots
        # each cache tensor's byte range in a block's payload (a dtype view needs aligned offsets)
        self._parts: list[tuple[int, int]] = []
        offset = 0
        for k, dtype in enumerate(layout.dtypes):
            elem = torch.empty((), dtype=dtype).element_size()
            n = 1
            for x in layout.shapes[k]:
                n *= x
            if offset % elem:
                raise ValueError(f"KV disk tier: cache tensor {k} ({dtype}) would start at byte {offset} of a block")
            self._parts.append((offset, n * elem))
            offset += n * elem

    # ---- the store Protocol -----------------------------------------------------------------
    def put(self, slots: Sequence[int], hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        if not slots:
            return
        payload = self._pack(blocks, len(slots))
        rows = payload.numpy()
        for i, (s, h) in enumerate(zip(slots, hashes)):
            old = self.hashes[s]
            if old is not None and old != h:
                self.files.evict(old)
            # refused (the write queue is full): the slot holds nothing, a later get of it fails
            self.hashes[s] = h if self.files.store(h, rows[i]) else None

    def get(self, slots: Sequence[int], hashes: Sequence[bytes], out: Sequence[torch.Tensor]) -> list[bool]:
        n = len(slots)
        buf = torch.empty((n, self.block_nbytes), dtype=torch.uint8)
        rows = buf.numpy()
        ok = []
        for i, (s, h) in enumerate(zip(slots, hashes)):
            mine = 0 <= s < self.num_slots and self.hashes[s] == h
            good = mine and self.files.load_into(h, rows[i])
            if mine and not good:
                self.hashes[s] = None  # the file is gone or bad (deleted): the slot holds nothing now
            ok.append(good)
        if any(ok):
            self._unpack(buf, out, n)
        return ok

    def discard(self, slots: Sequence[int]) -> None:
        for s in slots:
            if 0 <= s < self.num_slots and self.hashes[s] is not None:
                self.files.evict(self.hashes[s])
                self.hashes[s] = None

    def close(self) -> None:
        self.files.close(remove_files=True)
        self.hashes = [None] * self.num_slots

    @property
    def stats(self):
        return self.files.stats

    # ---- payload <-> cache tensors ----------------------------------------------------------
    def _views(self, buf: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Each cache tensor's part of the ``[n, bytes_per_block]`` buffer, as ``[n, *block shape]``."""
        views = []
        for (offset, nbytes), shape, dtype in zip(self._parts, self.layout.shapes, self.layout.dtypes):
            views.append(buf[:, offset:offset + nbytes].view(dtype).view((n,) + tuple(shape)))
        return views

    def _pack(self, blocks: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        buf = torch.empty((n, self.block_nbytes), dtype=torch.uint8)
        for view, b in zip(self._views(buf, n), blocks):
            view.copy_(b.movedim(BLOCK_DIM, 0))
        return buf

    def _unpack(self, buf: torch.Tensor, out: Sequence[torch.Tensor], n: int) -> None:
        for view, o in zip(self._views(buf, n), out):
            o.movedim(BLOCK_DIM, 0).copy_(view)


def _write_note(base: str, key: LayoutKey) -> None:
    """A readable note of whose blocks the directory holds (never read back: headers decide)."""
    note = os.path.join(base, "layout.txt")
    if os.path.exists(note):
        return
    try:
        with open(note, "w") as f:
            for k, v in sorted(vars(key).items()):
                f.write(f"{k} = {v}\n")
    except OSError:
        pass


def _sweep_dead_runs(base: str) -> None:
    """Remove run directories left by processes of this host that no longer exist."""
    host = socket.gethostname()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != "run" or "-".join(parts[1:-2]) != host or not parts[-2].isdigit():
            continue
        pid = int(parts[-2])
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        logger.info("KV disk tier: removed %s, left by process %d which is gone", name, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
