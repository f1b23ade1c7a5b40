"""Checks on the PNG charts the benchmarks and the dashboard demo write."""
from __future__ import annotations

import struct


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG file, failing when it is not one."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])
