"""Views of checkpoint tensors for families whose layout differs from ours: a slice of a fused
tensor (Phi-3's qkv_proj / gate_up_proj, GPT-2's c_attn) and a transposed one (GPT-2's Conv1D
weights, stored [in, out]). Both keep the loader's lazy ``narrow`` / ``full`` interface, so a
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
