"""Triton kernel for batched KV block copies (see block_copy.py): one launch per cache tensor.

The cache is ``[d0, d1, num_blocks, ...]`` with each block's elements contiguous (a whole cache,
or one layer's strided view of it: any strides for dims 0-2). The grid is (pair, d0 x d1, chunk
of ``BLOCK`` elements): each program copies one chunk of one block of one (plane, layer) from the
pair's source block to its destination.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, d1, stride0, stride1, stride_block, block_elems,
                        BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    outer = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_elems
    row = (outer // d1).to(tl.int64) * stride0 + (outer % d1).to(tl.int64) * stride1
    vals = tl.load(cache_ptr + row + src * stride_block + offs, mask=mask)
    tl.store(cache_ptr + row + dst * stride_block + offs, vals, mask=mask)


def block_is_contiguous(cache: torch.Tensor) -> bool:
    """Each block's elements (dims 3 on) lie contiguously: what the kernel needs."""
    expected = 1
    for size, stride in zip(reversed(cache.shape[3:]), reversed(cache.stride()[3:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def triton_copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, block: int = 1024) -> None:
    """``cache[:, :, dst] = cache[:, :, src]`` for a cache whose dim 2 is the block dim."""
    if not block_is_contiguous(cache):
        raise ValueError("triton_copy_blocks needs each block's elements contiguous")
    d0, d1 = cache.shape[0], cache.shape[1]
    block_elems = cache[0, 0, 0].numel()
    block = min(block, triton.next_power_of_2(block_elems))
    grid = (src.numel(), d0 * d1, triton.cdiv(block_elems, block))
    s0, s1, sb = cache.stride(0), cache.stride(1), cache.stride(2)
    _copy_blocks_kernel[grid](cache, src, dst, d1, s0, s1, sb, block_elems, BLOCK=block)
