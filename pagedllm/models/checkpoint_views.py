"""Views of checkpoint tensors for families whose layout differs from ours: a slice of a fused
tensor (Phi-3's qkv_proj / gate_up_proj, GPT-2's c_attn) and a transposed one (GPT-2's Conv1D
weights, stored [in, out]), and rows picked by index (interleaved fused q/k/v layouts, rows
permuted within each head). All keep the loader's lazy ``narrow`` / ``full`` interface, so a
tensor-parallel rank still reads only its own part from disk."""
from __future__ import annotations

import torch


def _full(src) -> torch.Tensor:
    return src.full() if hasattr(src, "full") else src


class NarrowedView:
    """``src.narrow(dim, start, length)`` without reading it yet."""

    def __init__(self, src, dim: int, start: int, length: int) -> None:
        self.src, self.dim, self.start = src, dim, start
        shape = list(src.shape)
        shape[dim] = length
        self.shape = torch.Size(shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == self.dim:
            return self.src.narrow(dim, self.start + start, length)
        return self.src.narrow(self.dim, self.start, self.shape[self.dim]).narrow(dim, start, length)

    def full(self) -> torch.Tensor:
        return self.src.narrow(self.dim, self.start, self.shape[self.dim])


class TransposedView:
    """A 2-D tensor read transposed (dims swapped)."""

    def __init__(self, src) -> None:
        self.src = src
        self.shape = torch.Size(reversed(tuple(src.shape)))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.src.narrow(1 - dim, start, length).t().contiguous()

    def full(self) -> torch.Tensor:
        return _full(self.src).t().contiguous()


def split_rows(src, sizes: list[int]) -> list[NarrowedView]:
    """Consecutive row blocks of ``src`` (dim 0) of the given sizes."""
    if sum(sizes) != src.shape[0]:
        raise ValueError(f"fused tensor of {src.shape[0]} rows cannot split into {sizes}")
    out, start = [], 0
    for n in sizes:
        out.append(NarrowedView(src, 0, start, n))
        start += n
    return out


class RowsView:
    """Rows ``index`` of ``src`` (dim 0) in that order: a fused tensor whose parts interleave
    (GPT-NeoX's per-head [q, k, v] rows, Falcon's per-group [q..., k, v]) or a permutation within
    each head. A rank's ``narrow`` reads only the span of source rows its part covers."""

    def __init__(self, src, index: torch.Tensor) -> None:
        self.src, self.index = src, index
        self.shape = torch.Size([len(index), *src.shape[1:]])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.full().narrow(dim, start, length)
        sel = self.index[start : start + length]
        lo, hi = int(sel.min()), int(sel.max()) + 1
        return self.src.narrow(0, lo, hi - lo)[sel - lo]

    def full(self) -> torch.Tensor:
        return _full(self.src)[self.index]


def fused_qkv_index(layout: str, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Row indices of q, k and v in a fused projection: ``"per_head"`` ([heads, 3, head_dim]:
    GPT-NeoX, Falcon without multi-query, GPTBigCode without multi-query) or ``"grouped"``
    ([kv_heads, heads / kv_heads + 2, head_dim]: Falcon's new decoder architecture)."""
    d = torch.arange(head_dim)
    if layout == "per_head":
        rows = torch.arange(heads)[:, None] * 3 * head_dim + d  # [heads, head_dim]
        return tuple((rows + i * head_dim).reshape(-1) for i in range(3))
    if layout == "grouped":
        qpk = heads // kv_heads
        group = torch.arange(kv_heads)[:, None, None] * (qpk + 2) * head_dim
        q = group + torch.arange(qpk)[None, :, None] * head_dim + d
        k = group[:, 0] + qpk * head_dim + d
        return q.reshape(-1), k.reshape(-1), (k + head_dim).reshape(-1)
    raise ValueError(f"unknown fused qkv layout {layout!r}")


def split_fused_qkv(src, layout: str, heads: int, kv_heads: int, head_dim: int) -> list:
    """Views of q, k and v in a fused projection's weight or bias: ``"blocked"`` ([q | k | v]),
    or one of ``fused_qkv_index``'s interleaved layouts."""
    if layout == "blocked":
        return split_rows(src, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    return [RowsView(src, idx) for idx in fused_qkv_index(layout, heads, kv_heads, head_dim)]
