"""The disk tier's read path: which way of reading a block file into the load buffer is fastest.

Writes ``--blocks`` block files in the disk tier's format (pagedllm/worker/kv_tier/disk_format.py)
of one llama-100m block (16 tokens, float32 K and V of 12 layers x 4 KV heads x 64: 384 KiB by
default), then reads them all back, in rounds alternating the methods:

  readinto   open, read the header, ``readinto`` the payload straight into the load buffer
  mmap       map the file, copy the payload from the mapping into the load buffer
  fromfile   numpy.fromfile (a new array), then copy into the load buffer

each with the payload checksum verified, both from the page cache ("warm") and after
``posix_fadvise(DONTNEED)`` evicted the files' pages ("cold": the disk). Also times the checksum
alone and the store's write of a file.

    python benchmarks/kv_disk_io.py --blocks 256 --rounds 3
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402
from pagedllm.worker.kv_tier.disk_format import (  # noqa: E402
    DEFAULT_CHECKSUM,
    HEADER_BYTES,
    check_header,
    checksum,
    pack_header,
)

FP = b"\x01" * 32


def write_files(d: str, n: int, nbytes: int) -> tuple[list[str], float]:
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(min(n, 8))]
    paths = []
    t = time.perf_counter()
    for i in range(n):
        payload = payloads[i % len(payloads)]
        h = i.to_bytes(32, "little")
        p = os.path.join(d, f"{i:06d}.kvb")
        with open(p, "wb", buffering=0) as f:
            f.write(pack_header(FP, h, nbytes, DEFAULT_CHECKSUM, checksum(DEFAULT_CHECKSUM, payload)))
            f.write(memoryview(payload))
        paths.append(p)
    return paths, time.perf_counter() - t


def read_readinto(path: str, h: bytes, out: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        kind, want = check_header(f.read(HEADER_BYTES), FP, h, out.nbytes)
        f.readinto(memoryview(out))
    assert checksum(kind, out) == want


def read_mmap(path: str, h: bytes, out: np.ndarray) -> None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        kind, want = check_header(m[:HEADER_BYTES], FP, h, out.nbytes)
        out[:] = np.frombuffer(m, dtype=np.uint8, count=out.nbytes, offset=HEADER_BYTES)
    assert checksum(kind, out) == want


def read_fromfile(path: str, h: bytes, out: np.ndarray) -> None:
    with open(path, "rb") as f:
        kind, want = check_header(f.read(HEADER_BYTES), FP, h, out.nbytes)
        out[:] = np.fromfile(f, dtype=np.uint8, count=out.nbytes)
    assert checksum(kind, out) == want


METHODS = {"readinto": read_readinto, "mmap": read_mmap, "fromfile": read_fromfile}


def evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=16 * 2 * 12 * 4 * 64 * 4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    ap.add_argument("--out", default="benchmarks/results/kv_disk_io.json")
    args = ap.parse_args()
    load_before = open("/proc/loadavg").read().split()[:3]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        paths, write_s = write_files(d, args.blocks, args.block_bytes)
        hashes = [i.to_bytes(32, "little") for i in range(args.blocks)]
        out = np.empty(args.block_bytes, dtype=np.uint8)
        t = time.perf_counter()
        for _ in range(args.blocks):
            checksum(DEFAULT_CHECKSUM, out)
        checksum_s = time.perf_counter() - t
        times = {(m, w): [] for m in METHODS for w in ("warm", "cold")}
        for r in range(args.rounds):
            for name in (list(METHODS) if r % 2 == 0 else list(METHODS)[::-1]):
                for where in ("cold", "warm"):  # cold first: its read leaves the pages warm
                    if where == "cold":
                        evict(paths)
                    t = time.perf_counter()
                    for p, h in zip(paths, hashes):
                        METHODS[name](p, h, out)
                    times[(name, where)].append(time.perf_counter() - t)
    load_after = open("/proc/loadavg").read().split()[:3]
    mib = args.blocks * args.block_bytes / 2**20
    rows = []
    for (name, where), ts in times.items():
        best = statistics.median(ts)
        rows.append({"method": name, "cache": where, "ms_per_block": round(best / args.blocks * 1e3, 3),
                     "MiB_s": round(mib / best, 1)})
    print(f"{args.blocks} blocks x {args.block_bytes} bytes ({mib:.0f} MiB); checksum kind {DEFAULT_CHECKSUM}: "
          f"{checksum_s / args.blocks * 1e3:.3f} ms/block ({mib / checksum_s:.0f} MiB/s); write "
          f"{write_s / args.blocks * 1e3:.3f} ms/block ({mib / write_s:.0f} MiB/s, page cache); "
          f"load average {' '.join(load_before)} -> {' '.join(load_after)}")
    print_table(rows, ["method", "cache", "ms_per_block", "MiB_s"])
    write_json(args.out, {"argv": sys.argv, "args": vars(args), "rows": rows, "checksum_ms_per_block":
                          checksum_s / args.blocks * 1e3, "write_ms_per_block": write_s / args.blocks * 1e3,
                          "loadavg_before": load_before, "loadavg_after": load_after})


if __name__ == "__main__":
    main()
