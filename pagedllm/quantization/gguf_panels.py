"""GGUF blocks rewritten once at load into the quantized-GEMM panels of ``quant_gemm.h``, for the
block types whose codes and scales map exactly onto its int4 / int8 codes with per-group float32
scale and zero point (``w = (q - z) * s``):

=========  =====  =====  ==========================================  ================
type       codes  group  scale s, zero point z                       bytes / weight
=========  =====  =====  ==========================================  ================
Q4_0       int4   32     s = d, z = 8 (the int4 default: not stored)  0.5625 -> 0.625
Q4_1       int4   32     s = d, z = -m / d                            0.625 -> 0.75
Q4_K       int4   32     s = d sc_j, z = dmin m_j / (d sc_j)          0.5625 -> 0.75
Q8_0       int8   32     s = d                                        1.0625 -> 1.125
Q6_K       int8   16     s = d sc_j (codes q - 32)                    0.82 -> 1.25
=========  =====  =====  ==========================================  ================

The panels interleave 16 rows per 16-byte line, so a decode step streams each panel front to back
and the kernel applies a group's scale once per 16 rows (``quant_gemm.h``); on this layout the
batch-1 product runs about 1.9x faster than on the file's row-major blocks. A group whose scale
is 0 (all its weights equal: ``w = m`` or ``-dmin m_j``) gets codes 1, ``s = w``, ``z = 0``, so
every weight stays exactly the file's value up to float32 rounding. The other types (Q5_x, Q2_K,
Q3_K, F16, BF16) stay in the file's blocks (``gguf_gemm.h``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.quantization import packed_qweight
from pagedllm.quantization.packed_qweight import PANEL, PackedQuantizedWeight
from pagedllm.quantization.quantized_weight import QuantizedWeight

PANEL_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K")


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    return blocks[..., off:off + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _int4_pairs(q: np.ndarray) -> np.ndarray:
    """codes [N, K] 0..15 -> uint8 [N, K / 2], column 2j in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def _flat_groups(x: np.ndarray, n: int) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(n, -1), dtype=np.float32)


def _constant_groups(q: np.ndarray, s: np.ndarray, z: np.ndarray, value: np.ndarray, group: int) -> None:
    """Where a group's scale is 0 its weights all equal ``value``: codes 1, s = value, z = 0."""
    dead = s == 0
    if dead.any():
        qg = q.reshape(q.shape[0], -1, group)
        qg[dead] = 1
        s[dead] = value[dead]
        z[dead] = 0.0


def to_quantized_weight(data: torch.Tensor, type_name: str, k: int) -> QuantizedWeight:
    """A GGUF tensor's blocks (uint8 [N, row_bytes]) as the equivalent QuantizedWeight."""
    raw = data.numpy()
    n = raw.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        nbytes = 18 if type_name == "Q4_0" else 20
        b = raw.reshape(n, k // 32, nbytes)
        d = _f16(b, 0)
        qs = b[..., nbytes - 16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k).astype(np.uint8)
        if type_name == "Q4_0":
            return QuantizedWeight("int4", torch.from_numpy(_int4_pairs(q)), torch.from_numpy(_flat_groups(d, n)),
                                   None, 32, k)
        m = _f16(b, 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(d != 0, -m / np.where(d != 0, d, 1), 0).astype(np.float32)
        s = d.copy()
        _constant_groups(q, s, z, m, 32)
        return QuantizedWeight("int4", torch.from_numpy(_int4_pairs(q)), torch.from_numpy(_flat_groups(s, n)),
                               torch.from_numpy(_flat_groups(z, n)), 32, k)
    if type_name == "Q4_K":
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc_bytes = b[..., 4:16].astype(np.int32)
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)
        sc = np.empty((n, k // 256, 8), np.int32)
        mn = np.empty((n, k // 256, 8), np.int32)
        sc[..., :4] = sc_bytes[..., 0:4] & 63
        mn[..., :4] = sc_bytes[..., 4:8] & 63
        sc[..., 4:] = (sc_bytes[..., 8:12] & 0xF) | ((sc_bytes[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (sc_bytes[..., 8:12] >> 4) | ((sc_bytes[..., 4:8] >> 6) << 4)
        # sub-block 2j: low nibbles of qs[32j : 32j + 32]; 2j + 1: their high nibbles
        q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, k).astype(np.uint8)
        s = (d[..., None] * sc.astype(np.float32)).astype(np.float32)
        off = (dmin[..., None] * mn.astype(np.float32)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(s != 0, off / np.where(s != 0, s, 1), 0).astype(np.float32)
        _constant_groups(q, s.reshape(n, -1), z.reshape(n, -1), -off.reshape(n, -1), 32)
        return QuantizedWeight("int4", torch.from_numpy(_int4_pairs(q)), torch.from_numpy(_flat_groups(s, n)),
                               torch.from_numpy(_flat_groups(z, n)), 32, k)
    if type_name == "Q8_0":
        b = raw.reshape(n, k // 32, 34)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        return QuantizedWeight("int8", torch.from_numpy(q.copy()), torch.from_numpy(_flat_groups(_f16(b, 0), n)), None,
                               32, k)
    if type_name == "Q6_K":
        b = raw.reshape(n, k // 256, 210)
        ql, qh = b[..., :128].astype(np.int16), b[..., 128:192].astype(np.int16)
        scales = b[..., 192:208].copy().view(np.int8).astype(np.float32)
        d = _f16(b, 208)
        q = np.empty((n, k // 256, 2, 4, 32), np.int16)  # [half, quarter, l]: element 128 h + 32 quarter + l
        for h in range(2):
            lo, hi = ql[..., 64 * h:64 * h + 32], ql[..., 64 * h + 32:64 * h + 64]
            bits = qh[..., 32 * h:32 * h + 32]
            q[:, :, h, 0] = (lo & 0xF) | (((bits >> 0) & 3) << 4)
            q[:, :, h, 1] = (hi & 0xF) | (((bits >> 2) & 3) << 4)
            q[:, :, h, 2] = (lo >> 4) | (((bits >> 4) & 3) << 4)
            q[:, :, h, 3] = (hi >> 4) | (((bits >> 6) & 3) << 4)
        codes = (q.reshape(n, k) - 32).astype(np.int8)
        # scale index of element 128 h + 32 quarter + l: 8 h + 2 quarter + l // 16, i.e. groups of 16 in order
        s = (d[..., None] * scales).astype(np.float32)
        return QuantizedWeight("int8", torch.from_numpy(codes), torch.from_numpy(_flat_groups(s, n)), None, 16, k)
    raise ValueError(f"GGUF type {type_name} has no panel form")


def to_panels(data: torch.Tensor, type_name: str, k: int, kernels) -> Optional[PackedQuantizedWeight]:
    """The panel form of a GGUF segment, or None where the type has none (or the kernels lack it)."""
    if kernels is None or type_name not in PANEL_TYPES:
        return None
    qw = to_quantized_weight(data, type_name, k)
    if not packed_qweight.supports(qw):
        return None
    return packed_qweight.pack(qw, kernels)


def panel_rows(pw: PackedQuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), K]: the given rows of a panel-packed weight dequantized (embedding
    lookups from a table the tied head multiplies)."""
    p, j = rows // PANEL, rows % PANEL
    codes = pw.packed[p, :, j]  # [R, K] int8 bytes, or [R, K / 2] int4 pairs
    n, g = rows.shape[0], pw.group_size
    if pw.kind == "int4":
        q = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(n, -1, g).float()
        q = q - (8.0 if pw.zeros is None else pw.zeros[p, :, j].unsqueeze(-1))
    else:
        q = codes.view(torch.int8).reshape(n, -1, g).float()
        if pw.zeros is not None:
            q = q - pw.zeros[p, :, j].unsqueeze(-1)
    return (q * pw.scales[p, :, j].unsqueeze(-1)).reshape(n, -1)
