"""Batched KV block copies (beam search's copy-on-write), one op per cache tensor per step.

The scheduler lists (source, destination) block pairs; before the step's forward every cache
tensor whose dim 2 is the block dim (a whole cache ``[planes, layers, num_blocks, block_size,
kv_heads, head_dim]``, an 8-bit cache's scales ``[planes, layers, num_blocks, block_size,
kv_heads]``, or one layer's view with a unit layer dim) gets ``cache[:, :, dst] =
cache[:, :, src]`` for all pairs at once: both planes in one gather + scatter (CPU), or one
Triton launch (CUDA: any strides before the block's own elements, so a layer's view of the
whole cache qualifies). Destinations are fresh
blocks, never a source of the same step, so the order of the pairs does not matter.
"""
from __future__ import annotations

from typing import Sequence

import torch

BLOCK_DIM = 2


def _two_leading(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """A view with exactly two dims before the block dim (``trailing`` dims from it on)."""
    while t.dim() < trailing + 2:
        t = t.unsqueeze(1 if t.dim() > trailing else 0)
    return t


def layer_cache_planes(layers) -> list[torch.Tensor]:
    """Every attention layer's cache view (``[planes, num_blocks, block_size, kv_heads, head_dim]``,
    or MLA's ``[num_blocks, block_size, 1, dim]``) and its 8-bit scales (``[planes, num_blocks,
    block_size, kv_heads]``), as views whose dim 2 is the block dim."""
    out = []
    for layer in layers:
        out.append(_two_leading(layer.kv_cache, 4))
        if layer.kv_scales is not None:
            out.append(_two_leading(layer.kv_scales, 3))
    return out


def copy_blocks_reference(cache: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """One pair at a time (the tests' reference)."""
    for src, dst in pairs:
        cache[:, :, dst].copy_(cache[:, :, src])


def copy_blocks(caches: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    if not pairs:
        return
    for cache in caches:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=cache.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=cache.device)
        if cache.device.type == "cuda":
            from pagedllm.attention.triton_block_copy import block_is_contiguous, triton_copy_blocks

            if block_is_contiguous(cache):
                triton_copy_blocks(cache, src, dst)
            else:
                cache.index_copy_(BLOCK_DIM, dst, cache.index_select(BLOCK_DIM, src))
        else:
            cache.index_copy_(BLOCK_DIM, dst, cache.index_select(BLOCK_DIM, src))
