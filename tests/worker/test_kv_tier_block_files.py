"""The disk tier's block store on its own: round trip, the write queue, the byte cap's LRU, and
every bad file or failed write ending as a failed load (recompute) with one warning per cause."""
import errno
import logging
import os
import threading

import pytest

from pagedllm.worker.kv_tier import block_files as disk_mod
from pagedllm.worker.kv_tier.block_files import DiskBlockStore
from pagedllm.worker.kv_tier.disk_format import HEADER, HEADER_BYTES

NBYTES = 4096
FILE = NBYTES + HEADER_BYTES
FP = b"\x11" * 32  # a layout fingerprint


def make(root, blocks=64, fingerprint=FP, **kw):
    return DiskBlockStore(str(root), blocks * FILE, fingerprint, NBYTES, **kw)


def payload(i: int) -> bytearray:
    return bytearray(((i * 7 + j) % 251 for j in range(NBYTES)))


def h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a sha256 block hash


@pytest.fixture
def store(tmp_path):
    s = make(tmp_path)
    yield s
    s.close()


def load(store, i):
    out = bytearray(NBYTES)
    return store.load_into(h(i), out), out


def test_round_trip_and_files_named_by_hash(store):
    for i in range(3):
        assert store.store(h(i), payload(i))
    assert store.flush(10)
    for i in range(3):
        assert os.path.getsize(store.path_of(h(i))) == NBYTES + HEADER_BYTES
        ok, out = load(store, i)
        assert ok and out == payload(i)
    assert store.stats.writes_done == 3 and store.stats.loads == 3
    assert not load(store, 9)[0]  # never stored: a miss, no file opened


def test_load_before_the_write_is_served_from_the_queue(store, monkeypatch):
    gate = threading.Event()
    real = store._write_one
    monkeypatch.setattr(store, "_write_one", lambda bh, v: (gate.wait(10), real(bh, v)))
    assert store.store(h(1), payload(1))
    ok, out = load(store, 1)
    assert ok and out == payload(1) and store.stats.loads_from_queue == 1
    gate.set()
    assert store.flush(10) and load(store, 1) == (True, payload(1))


def test_full_write_queue_refuses_instead_of_stalling(tmp_path, monkeypatch):
    s = make(tmp_path, max_pending_bytes=NBYTES)
    gate = threading.Event()
    real = s._write_one
    monkeypatch.setattr(s, "_write_one", lambda bh, v: (gate.wait(10), real(bh, v)))
    assert s.store(h(1), payload(1))
    assert not s.store(h(2), payload(2)) and h(2) not in s and s.stats.stores_refused == 1
    gate.set()
    s.close()


def test_byte_cap_evicts_least_recently_used(tmp_path):
    s = make(tmp_path, blocks=3)
    for i in range(3):
        s.store(h(i), payload(i))
    s.flush(10)
    assert load(s, 0)[0]  # block 0 is now the most recent
    s.store(h(3), payload(3))
    s.flush(10)
    assert h(1) not in s and not os.path.exists(s.path_of(h(1)))
    assert all(load(s, i)[0] for i in (0, 2, 3)) and s.stats.evictions == 1
    s.evict(h(2))  # the core's decision
    assert h(2) not in s and not os.path.exists(s.path_of(h(2)))
    s.close()


def _damage(path, how):
    if how == "corrupt":
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    elif how == "truncated":
        os.truncate(path, HEADER_BYTES + NBYTES // 2)
    elif how == "stale":  # a file of an older format version
        with open(path, "r+b") as f:
            f.seek(8)
            f.write((99).to_bytes(2, "little"))
    elif how == "missing":
        os.unlink(path)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "stale", "missing"])
def test_bad_file_is_a_failed_load_warned_once(store, how, caplog):
    for i in range(3):
        store.store(h(i), payload(i))
    store.flush(10)
    _damage(store.path_of(h(0)), how)
    _damage(store.path_of(h(1)), how)
    with caplog.at_level(logging.WARNING, logger=disk_mod.__name__):
        assert load(store, 0)[0] is False and load(store, 1)[0] is False
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert (how if how != "missing" else "disappeared") in warned[0].getMessage()
    assert h(0) not in store and not os.path.exists(store.path_of(h(0)))  # deleted, never retried
    assert load(store, 2) == (True, payload(2)) and store.stats.loads_failed == 2


def test_a_file_of_another_layout_is_never_read(tmp_path):
    a = make(tmp_path / "a")
    a.store(h(1), payload(1))
    a.close()
    b = make(tmp_path / "b", fingerprint=b"\x22" * 32)
    b.store(h(1), payload(2))
    b.flush(10)
    os.replace(a.path_of(h(1)), b.path_of(h(1)))  # the right name, another layout's header
    assert load(b, 1)[0] is False and h(1) not in b
    b.close()


def test_disk_full_is_a_failed_store_warned_once_and_lowers_the_cap(store, monkeypatch, caplog):
    for i in range(2):
        store.store(h(i), payload(i))
    store.flush(10)

    def full(f, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod, "_write_all", full)
    with caplog.at_level(logging.WARNING, logger=disk_mod.__name__):
        for i in range(2, 5):
            assert store.store(h(i), payload(i))  # accepted: the write fails later, on the writer thread
        store.flush(10)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert len(caplog.records) == 1 and "disk is full" in caplog.records[0].getMessage()
    assert all(h(i) not in store and not load(store, i)[0] for i in range(2, 5))  # failed loads: recompute
    # lowered to what the disk held when a write failed (2 files, fewer if the LRU made room meanwhile)
    cap_blocks = store.capacity_bytes // FILE
    assert 1 <= cap_blocks <= 2 and len(store) <= cap_blocks and store.stats.writes_failed >= 1
    assert not [n for d in os.listdir(store.root) if os.path.isdir(os.path.join(store.root, d))
                for n in os.listdir(os.path.join(store.root, d)) if n.endswith(".tmp")]
    monkeypatch.undo()  # space again: the LRU keeps the tier under its lowered cap
    for i in range(5, 8):
        assert store.store(h(i), payload(i))
    store.flush(10)
    assert len(store) == cap_blocks and all(load(store, i) == (True, payload(i)) for i in range(8 - cap_blocks, 8))


def test_close_keeps_or_removes_the_files(tmp_path):
    a = make(tmp_path / "a")
    for i in range(3):
        a.store(h(i), payload(i))
    a.close()  # queued writes finish first
    assert all(os.path.getsize(a.path_of(h(i))) == FILE for i in range(3))
    assert not a.store(h(5), payload(5))  # closed
    b = make(tmp_path / "b")
    b.store(h(1), payload(1))
    b.close(remove_files=True)
    assert not os.path.exists(b.root)


def test_header_has_room_and_sizes_are_checked(store):
    assert HEADER.size <= HEADER_BYTES
    with pytest.raises(ValueError, match="payload of 10 bytes"):
        store.store(h(1), bytearray(10))
    with pytest.raises(ValueError, match="holds not even one block"):
        DiskBlockStore(store.root, NBYTES, FP, NBYTES)
