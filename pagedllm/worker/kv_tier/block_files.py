"""DiskBlockStore: KV blocks as files in one directory, keyed by block hash (the disk tier's files;
worker/kv_tier/disk.py puts the store Protocol's slots and tensors on top).

- ``store`` never blocks the step: the payload (a private host copy of the block) is queued for
  a background writer thread and the call returns. Until the file is written, a load of that
  block is served from the queued copy, so a block is never missed because its write is late.
  Queued copies are bounded (``max_pending_bytes``); past that a store is refused (returns
  False) rather than stalling or growing without bound.
- ``load_into`` reads the file straight into the caller's buffer (one ``readinto``: no second
  copy), checks the header (disk_format.py: magic, version, layout fingerprint, block hash,
  length) and the payload checksum. Anything wrong -- a missing, truncated, corrupt or stale
  file, an I/O error -- is a failed load (False): the caller recomputes the block. Each cause is
  warned about once per store, never once per block, and a bad file is deleted.
- A byte cap with its own LRU over the blocks it holds (written or queued). The core's tier
  index decides evictions (``evict``) and never holds more blocks than the cap, so the LRU acts
  only after ENOSPC, which lowers the cap to what the disk held when it filled (warned once): the
  LRU then makes room instead of every later write failing.
- Writes go to a temporary name and are renamed into place: a crash mid-write leaves no file
  under a block's name, only a ``.tmp`` file.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from pagedllm.worker.kv_tier.disk_format import (
    DEFAULT_CHECKSUM,
    HEADER_BYTES,
    BadBlockFile,
    check_header,
    checksum,
    pack_header,
)

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"


@dataclass
class DiskTierStats:
    """Counters since start (bytes are payload bytes)."""

    stores: int = 0
    stores_refused: int = 0  # the write queue was full: not stored
    writes_done: int = 0
    writes_failed: int = 0
    loads: int = 0  # successful loads (from a file or from a queued write)
    loads_from_queue: int = 0
    loads_failed: int = 0
    evictions: int = 0  # by the cap (not counting ``evict`` calls from the core)
    bytes_written: int = 0
    bytes_read: int = 0


class DiskBlockStore:
    def __init__(self, root: str, capacity_bytes: int, fingerprint: bytes, block_nbytes: int,
                 max_pending_bytes: int = 256 << 20, checksum_kind: int = DEFAULT_CHECKSUM) -> None:
        self.file_nbytes = block_nbytes + HEADER_BYTES
        if capacity_bytes < self.file_nbytes:
            raise ValueError(f"the disk tier's size ({capacity_bytes} bytes) holds not even one block "
                             f"({self.file_nbytes} bytes)")
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.fingerprint = fingerprint
        self.block_nbytes = block_nbytes
        self.capacity_bytes = capacity_bytes
        self.checksum_kind = checksum_kind
        self.max_pending = max(1, max_pending_bytes // block_nbytes)
        self.stats = DiskTierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # blocks held (written or queued), LRU first
        self._pending: dict[bytes, memoryview] = {}  # queued, not yet written
        self._queue: queue.Queue = queue.Queue()
        self._queued = 0  # hashes put on the queue and not yet taken care of by the writer
        self._warned: set[str] = set()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- queries ----------------------------------------------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self) * self.file_nbytes

    def path_of(self, block_hash: bytes) -> str:
        h = block_hash.hex()
        return os.path.join(self.root, h[:2], h + SUFFIX)

    # ---- store ------------------------------------------------------------------------------
    def store(self, block_hash: bytes, payload) -> bool:
        """Queue one block for writing. ``payload``: a buffer of exactly ``block_nbytes``
        bytes that the caller never touches again (the store keeps a reference until written).
        False: not stored (the queue is full, or the store is closed)."""
        view = memoryview(payload).cast("B")
        if view.nbytes != self.block_nbytes:
            raise ValueError(f"block payload of {view.nbytes} bytes, the block is {self.block_nbytes}")
        with self._lock:
            if self._closed:
                return False
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            if len(self._pending) >= self.max_pending:
                self.stats.stores_refused += 1
                return False
            self._index[block_hash] = None
            self._pending[block_hash] = view
            self.stats.stores += 1
            self._queued += 1
        self._queue.put(block_hash)
        self._enforce_cap()
        return True

    def evict(self, block_hash: bytes) -> None:
        """Forget a block (the core's index dropped it): its file is deleted, a queued write cancelled."""
        with self._lock:
            if block_hash not in self._index:
                return
            del self._index[block_hash]
            self._pending.pop(block_hash, None)
        self._unlink(block_hash)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write is done (tests, shutdown). False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def close(self, remove_files: bool = False) -> None:
        """Stop the writer (after the queued writes, unless ``remove_files``: then they are dropped
        and every file of the store deleted with its directory)."""
        with self._lock:
            self._closed = True
            if remove_files:
                self._pending.clear()
        self._queue.put(None)
        self._writer.join()
        if remove_files:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- load -------------------------------------------------------------------------------
    def load_into(self, block_hash: bytes, out) -> bool:
        """Read one block into ``out`` (a writable buffer of ``block_nbytes`` bytes). False:
        not available (missing, bad file, I/O error): the caller recomputes it. ``out`` may have
        been partly written on a False."""
        dst = memoryview(out).cast("B")
        if dst.nbytes != self.block_nbytes:
            raise ValueError(f"load buffer of {dst.nbytes} bytes, the block is {self.block_nbytes}")
        with self._lock:
            if block_hash not in self._index:
                self.stats.loads_failed += 1
                return False
            self._index.move_to_end(block_hash)
            queued = self._pending.get(block_hash)
            if queued is not None:
                dst[:] = queued
                self.stats.loads += 1
                self.stats.loads_from_queue += 1
                self.stats.bytes_read += dst.nbytes
                return True
        try:
            self._read_file(block_hash, dst)
        except BadBlockFile as e:
            self._warn_once(e.cause, f"KV disk tier: a block file is {e}; it is deleted and the block recomputed "
                                     f"({self.path_of(block_hash)}; further files with this problem are not reported)")
            self._drop_bad(block_hash)
            return False
        except OSError as e:
            cause = errno.errorcode.get(e.errno, "OSError") if e.errno else "OSError"
            if e.errno == errno.ENOENT:
                self._warn_once("missing", f"KV disk tier: a block file disappeared ({self.path_of(block_hash)}); "
                                           "the block is recomputed (further missing files are not reported)")
            else:
                self._warn_once(f"read:{cause}", f"KV disk tier: reading a block failed ({e}); the block is recomputed "
                                                 f"(further {cause} read errors are not reported)")
            self._drop_bad(block_hash)
            return False
        with self._lock:
            self.stats.loads += 1
            self.stats.bytes_read += dst.nbytes
        return True

    def _read_file(self, block_hash: bytes, dst: memoryview) -> None:
        with open(self.path_of(block_hash), "rb", buffering=0) as f:
            kind, expected = check_header(f.read(HEADER_BYTES), self.fingerprint, block_hash, dst.nbytes)
            got = f.readinto(dst)
            while got < dst.nbytes:  # readinto may return short on some file systems
                n = f.readinto(dst[got:])
                if not n:
                    raise BadBlockFile("truncated", f"{got} of {dst.nbytes} payload bytes")
                got += n
        if checksum(kind, dst) != expected:
            raise BadBlockFile("corrupt", "payload checksum mismatch")

    # ---- the writer thread ------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            if block_hash is None:
                return
            try:
                with self._lock:
                    view = self._pending.get(block_hash)
                if view is not None:  # None: evicted or cancelled before its turn
                    self._write_one(block_hash, view)
            finally:
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    def _write_one(self, block_hash: bytes, view: memoryview) -> None:
        path = self.path_of(block_hash)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            header = pack_header(self.fingerprint, block_hash, view.nbytes, self.checksum_kind,
                                 checksum(self.checksum_kind, view))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, memoryview(header))
                _write_all(f, view)
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quietly(tmp)
            self._write_failed(block_hash, e)
            return
        with self._lock:
            still_wanted = self._pending.pop(block_hash, None) is not None
            if still_wanted:
                self.stats.writes_done += 1
                self.stats.bytes_written += view.nbytes
        if not still_wanted:  # evicted while it was being written: the file must not stay
            self._unlink(block_hash)

    def _write_failed(self, block_hash: bytes, e: OSError) -> None:
        with self._lock:
            self._pending.pop(block_hash, None)
            self._index.pop(block_hash, None)
            self.stats.writes_failed += 1
            held = (len(self._index) - len(self._pending)) * self.file_nbytes  # written files only
        cause = errno.errorcode.get(e.errno, "OSError") if e.errno else "OSError"
        if e.errno == errno.ENOSPC:
            new_cap = max(held, self.file_nbytes)
            self._warn_once("write:ENOSPC", f"KV disk tier: the disk is full ({self.root}); the tier's size cap is "
                                            f"lowered from {self.capacity_bytes} to {new_cap} bytes, what it held when "
                                            "the disk filled; blocks that could not be written are recomputed")
            with self._lock:
                self.capacity_bytes = min(self.capacity_bytes, new_cap)
            self._enforce_cap()
        else:
            self._warn_once(f"write:{cause}", f"KV disk tier: writing a block failed ({e}); it is recomputed when "
                                              f"needed (further {cause} write errors are not reported)")

    # ---- helpers ----------------------------------------------------------------------------
    def _enforce_cap(self) -> None:
        victims = []
        with self._lock:
            while self._index and len(self._index) * self.file_nbytes > self.capacity_bytes:
                h, _ = self._index.popitem(last=False)
                self._pending.pop(h, None)
                victims.append(h)
            self.stats.evictions += len(victims)
        for h in victims:
            self._unlink(h)

    def _drop_bad(self, block_hash: bytes) -> None:
        with self._lock:
            self._index.pop(block_hash, None)
            self.stats.loads_failed += 1
        self._unlink(block_hash)

    def _unlink(self, block_hash: bytes) -> None:
        _unlink_quietly(self.path_of(block_hash))

    def _warn_once(self, cause: str, message: str) -> None:
        with self._lock:
            if cause in self._warned:
                return
            self._warned.add(cause)
        logger.warning(message)


def _write_all(f, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        done += f.write(view[done:])


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
