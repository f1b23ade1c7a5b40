"""Triton kernel for batched KV block copies (see block_copy.py): one launch per cache tensor.

The cache is viewed as ``[outer = planes x layers, num_blocks, block_elems]`` (contiguous); the
grid is (pair, outer row, chunk of ``BLOCK`` elements): each program copies one chunk of one
block of one (plane, layer) from the pair's source block to its destination.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, num_blocks, block_elems, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    outer = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_elems
    row = outer.to(tl.int64) * num_blocks
    vals = tl.load(cache_ptr + (row + src) * block_elems + offs, mask=mask)
    tl.store(cache_ptr + (row + dst) * block_elems + offs, vals, mask=mask)


def triton_copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, block: int = 1024) -> None:
    """``cache[:, :, dst] = cache[:, :, src]`` for a contiguous cache whose dim 2 is the block dim."""
    if not cache.is_contiguous():
        raise ValueError("triton_copy_blocks needs a contiguous cache")
    outer = cache.shape[0] * cache.shape[1]
    num_blocks = cache.shape[2]
    block_elems = cache[0, 0, 0].numel()
    block = min(block, triton.next_power_of_2(block_elems))
    grid = (src.numel(), outer, triton.cdiv(block_elems, block))
    _copy_blocks_kernel[grid](cache, src, dst, num_blocks, block_elems, BLOCK=block)
