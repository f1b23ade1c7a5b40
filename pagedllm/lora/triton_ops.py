"""Triton LoRA kernels for CUDA: segmented shrink and expand over a step's adapter rows.

The step's rows with an adapter are sorted by slot (lora/batch.py): segment g covers sorted rows
[start_g, end_g) of slot s_g. One launch per kernel covers every segment (grid: segment x row
block x column block), so a step mixing adapters costs two launches per layer, never one per
adapter or per request:

    shrink: t[i, :n_s]  = x[row_i] @ A[s].T             (A: [slots, n * max_rank, in]; fp32 t)
    expand: y[row_i, :] += t[i, :n_s] @ B[s, :, :n_s].T   (B: [slots, out, n * max_rank])

``n_s`` (the slot's stacked rank columns in this layer) comes from a per-layer [slots] tensor,
so a slot whose adapter leaves this layer out costs an early exit. Rows are distinct, so the
expand's read-add-write of ``y`` needs no atomics. Tested under ``TRITON_INTERPRET=1`` and
compiled on an H200.

Precision: ``tl.dot`` of float32 operands defaults to TF32 on NVIDIA GPUs (10-bit mantissa); a
float32 model's delta then differed from the float32 reference by up to 0.1 at magnitude ~20 (seen
on the H200). With float32 inputs the dots run in IEEE float32 (``IEEE``); bf16 / fp16 inputs are
exact in TF32, and the fp32 ``t`` rounded to TF32 in the expand of a bf16 layer errs below the
bf16 output's own rounding, so those keep the tensor-core path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, idx_ptr, a_ptr, t_ptr, seg_ptr, cols_ptr, stride_x, stride_as, stride_an, stride_t,
                   K: tl.constexpr, HAS_INDEX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr):
    seg, mb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(seg_ptr + 3 * seg)
    start = tl.load(seg_ptr + 3 * seg + 1) + mb * BM
    end = tl.load(seg_ptr + 3 * seg + 2)
    n_cols = tl.load(cols_ptr + slot)
    if start < end and nb * BN < n_cols:
        rows = start + tl.arange(0, BM)
        cols = nb * BN + tl.arange(0, BN)
        rmask = rows < end
        if HAS_INDEX:
            src = tl.load(idx_ptr + rows, mask=rmask, other=0)
        else:
            src = rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + src[:, None] * stride_x + ks[None, :], mask=rmask[:, None] & (ks[None, :] < K),
                        other=0.0)
            a = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_an + ks[:, None],
                        mask=(cols[None, :] < n_cols) & (ks[:, None] < K), other=0.0)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
        tl.store(t_ptr + rows[:, None] * stride_t + cols[None, :], acc, mask=rmask[:, None] & (cols[None, :] < n_cols))


@triton.jit
def _expand_kernel(t_ptr, idx_ptr, b_ptr, y_ptr, seg_ptr, cols_ptr, stride_t, stride_bs, stride_bn, stride_y, N,
                   MAX_COLS: tl.constexpr, HAS_INDEX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, IEEE: tl.constexpr):
    seg, mb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(seg_ptr + 3 * seg)
    start = tl.load(seg_ptr + 3 * seg + 1) + mb * BM
    end = tl.load(seg_ptr + 3 * seg + 2)
    n_cols = tl.load(cols_ptr + slot)
    if start < end and n_cols > 0:
        rows = start + tl.arange(0, BM)
        outs = nb * BN + tl.arange(0, BN)
        rmask = rows < end
        omask = outs < N
        if HAS_INDEX:
            dst = tl.load(idx_ptr + rows, mask=rmask, other=0)
        else:
            dst = rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.static_range(0, MAX_COLS, BK):
            ks = k0 + tl.arange(0, BK)
            t = tl.load(t_ptr + rows[:, None] * stride_t + ks[None, :], mask=rmask[:, None] & (ks[None, :] < n_cols),
                        other=0.0)
            b = tl.load(b_ptr + slot * stride_bs + outs[None, :] * stride_bn + ks[:, None],
                        mask=omask[None, :] & (ks[:, None] < n_cols), other=0.0)
            if IEEE:
                acc += tl.dot(t, b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(t, b.to(tl.float32))
        ptrs = y_ptr + dst[:, None] * stride_y + outs[None, :]
        m = rmask[:, None] & omask[None, :]
        y = tl.load(ptrs, mask=m, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=m)


_BM, _BN, _BK = 16, 32, 32


def _grid_rows(batch) -> int:
    return triton.cdiv(max(end - start for _, start, end in batch.groups), _BM)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slot_cols: torch.Tensor, batch) -> torch.Tensor:
    """[N, n * max_rank] float32: each adapter row's x @ A[slot].T (rows in the batch's sorted order)."""
    max_cols = lora_a.shape[1]
    t = torch.empty(batch.num_rows, max_cols, dtype=torch.float32, device=x.device)
    has_index = batch.index is not None
    grid = (len(batch.groups), _grid_rows(batch), triton.cdiv(max_cols, _BN))
    _shrink_kernel[grid](x, batch.index if has_index else x, lora_a, t, batch.segments, slot_cols, x.stride(0),
                         lora_a.stride(0), lora_a.stride(1), t.stride(0), K=x.shape[1], HAS_INDEX=has_index,
                         BM=_BM, BN=_BN, BK=_BK, IEEE=x.dtype == torch.float32 or lora_a.dtype == torch.float32)
    return t


def lora_expand(t: torch.Tensor, lora_b: torch.Tensor, slot_cols: torch.Tensor, batch, y: torch.Tensor) -> None:
    """y[row] += t[i] @ B[slot].T for every adapter row, in place."""
    out = y.shape[1]
    has_index = batch.index is not None
    grid = (len(batch.groups), _grid_rows(batch), triton.cdiv(out, _BN))
    _expand_kernel[grid](t, batch.index if has_index else t, lora_b, y, batch.segments, slot_cols, t.stride(0),
                         lora_b.stride(0), lora_b.stride(1), y.stride(0), out, MAX_COLS=lora_b.shape[2],
                         HAS_INDEX=has_index, BM=_BM, BN=_BN, BK=_BK,
                         IEEE=y.dtype == torch.float32 or lora_b.dtype == torch.float32)
