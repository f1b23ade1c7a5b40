"""Triton weight-only quantized matmul (CUDA): ``y = x W^T (+ bias)`` for int8 (W8A16) and int4
(W4A16) ``QuantizedWeight``s with group scales and zero points and GPTQ act-order.

One program computes a ``BLOCK_M x BLOCK_N`` tile of y, walking K in ``BLOCK_K`` steps that never
straddle a weight group (``BLOCK_K`` divides ``group_size``), so each step reads one scale and
one zero point per output row. A step loads the x tile (through ``input_perm`` with act-order:
the gather is in the load, x is never permuted in memory), the codes (int4: the byte holding
columns ``2j, 2j + 1``, shifted by ``4 (k % 2)``), dequantizes them in registers as
``(q - z) s`` in float32, rounds them to x's dtype (bf16/fp16 products, float32 sums: what a
dense bf16 GEMM does; float32 x multiplies in IEEE float32, not TF32) and accumulates
``tl.dot``. The dense weight never exists in memory.

This module imports triton at the top; qgemm.py imports it only for CUDA tensors, and the tests
run it under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.quantization.quantized_weight import QuantizedWeight

BLOCK_M = 16
BLOCK_N = 32


def block_k(group_size: int) -> Optional[int]:
    """The K step for this group size (a power of two >= 16 dividing it), or None."""
    for bk in (64, 32, 16):
        if group_size % bk == 0:
            return bk
    return None


@triton.jit
def _qgemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, y_ptr, M, N, K, G, GROUP,
                  INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO_DEFAULT: tl.constexpr, HAS_PERM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        if HAS_PERM:
            src = tl.load(perm_ptr + ks)
        else:
            src = ks
        x = tl.load(x_ptr + rm[:, None] * K + src[None, :], mask=m_ok[:, None], other=0.0)
        if INT4:
            byte = tl.load(q_ptr + rn[:, None] * (K // 2) + (ks // 2)[None, :], mask=n_ok[:, None], other=0)
            codes = ((byte.to(tl.int32) >> ((ks % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        else:
            codes = tl.load(q_ptr + rn[:, None] * K + ks[None, :], mask=n_ok[:, None], other=0).to(tl.float32)
        g = k0 // GROUP
        s = tl.load(s_ptr + rn * G + g, mask=n_ok, other=0.0)
        if HAS_ZEROS:
            z = tl.load(z_ptr + rn * G + g, mask=n_ok, other=0.0)
            w = (codes - z[:, None]) * s[:, None]
        else:
            w = (codes - ZERO_DEFAULT) * s[:, None]
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight-only int8 / int4 ``x W^T (+ bias)``; x [..., K] float32/bf16/fp16 on qw's device."""
    if qw.kind not in ("int8", "int4") or qw.act_quant is not None:
        raise ValueError(f"triton quantized_linear: weight-only int8/int4 only, got {qw.kind} / {qw.act_quant}")
    bk = block_k(qw.group_size)
    if bk is None:
        raise ValueError(f"triton quantized_linear: group size {qw.group_size} is not a multiple of 16")
    lead, k = x.shape[:-1], x.shape[-1]
    if k != qw.in_features:
        raise ValueError(f"quantized_linear: x has {k} features, the weight expects {qw.in_features}")
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], qw.out_features
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    perm = qw.input_perm
    zeros = qw.zeros
    b = None if bias is None else bias.float().contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _qgemm_kernel[grid](
        x2, qw.qweight, qw.scales, zeros if zeros is not None else qw.scales,
        perm if perm is not None else qw.scales, b if b is not None else qw.scales, y,
        m, n, k, k // qw.group_size, qw.group_size,
        INT4=qw.kind == "int4", HAS_ZEROS=zeros is not None, ZERO_DEFAULT=8.0 if qw.kind == "int4" else 0.0,
        HAS_PERM=perm is not None, HAS_BIAS=b is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=bk)
    return y.reshape(*lead, n)
