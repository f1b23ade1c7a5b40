"""``y = x W^T (+ bias)`` for a quantized weight, without ever holding the model dense.

``quantized_linear`` picks, per call, the fastest path the tensors allow:

- CPU, weight prepared by :func:`prepare` (a ``PackedQuantizedWeight``, made once at load when the
  C++ kernels are loaded): the fused kernels of ``kernels/csrc/quant_gemm.h`` -- codes widened in
  registers and multiplied in float32, group scales and zero points applied once per group
  (weight-only int8 / int4 / fp8) -- or of ``quant_gemm_i8.h`` for ``int8_per_token`` activations
  (int8 x int8 with AVX512-VNNI where the CPU has it, exact integer loops elsewhere). fp8
  activations have no CPU arithmetic: they are rounded to fp8 (below) and multiplied as floats.
- CUDA tensors with Triton: ``triton_qgemm.py`` (weight-only int8 / int4).
- Anything else: :func:`torch_quantized_linear`, which dequantizes this one layer's weight in
  float32 and multiplies (the reference the kernels are tested against).

Activation quantization (``act_quant``), the same on every path:

- ``int8_per_token``: per row ``s_x = absmax(x_row) / 127`` (float32; rows of zeros get 1),
  ``q_x = clamp(round_half_even(x / s_x), -127, 127)``; the integer products
  ``sum_k q_x[k] (q_w[n, k] - z[n, g(k)])`` are exact (int32 in the kernels, float64 here) per
  weight group, then scaled by ``s_x * s_w[n, g]``.
- ``fp8_per_token`` / ``fp8_per_tensor``: ``s_x = absmax / 448`` per row / over the whole
  ``[M, K]`` input, ``q_x = float8_e4m3fn(clamp(x / s_x, -448, 448))``; the products of the fp8
  values are summed in float32 and scaled like int8's.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.quantization import packed_qweight
from pagedllm.quantization.packed_qweight import PackedQuantizedWeight
from pagedllm.quantization.quantized_weight import QuantizedWeight

INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_act_int8(x: torch.Tensor):
    """Per-row symmetric int8 codes of ``x`` [M, K] (as float32 values) and their float32 scales [M, 1]."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX)
    return q, scale


def quantize_act_fp8(x: torch.Tensor, per_token: bool):
    """fp8 e4m3 values of ``x`` [M, K] (widened back to float32) and their float32 scales ([M, 1] or [1, 1])."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True) if per_token else x.abs().amax().reshape(1, 1)
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return q, scale


def _zero_codes(qw: QuantizedWeight) -> Optional[torch.Tensor]:
    """Zero points [N, groups] (None when they are all 0)."""
    if qw.zeros is not None:
        return qw.zeros
    if qw.kind == "int4":
        return torch.full_like(qw.scales, 8.0)
    return None


def _permuted_input(x2: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    return x2 if qw.input_perm is None else x2.index_select(1, qw.input_perm.to(x2.device))


def torch_quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The pure-torch path: one layer's weight dequantized (float32) and multiplied; ``x.dtype`` out."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != qw.in_features:
        raise ValueError(f"quantized_linear: x has {k} features, the weight expects {qw.in_features}")
    x2 = _permuted_input(x.reshape(-1, k), qw)
    n, g = qw.out_features, qw.group_size
    if qw.act_quant is None:
        codes = qw.codes()
        zeros = _zero_codes(qw)
        if zeros is not None:
            codes = codes - zeros.repeat_interleave(g, dim=1)
        w = codes * qw.scales.repeat_interleave(g, dim=1)  # permuted column order, like x2
        y = x2.float() @ w.t()
    elif qw.act_quant == "int8_per_token":
        y = _int8_product(x2, qw)
    else:
        xq, sx = quantize_act_fp8(x2, per_token=qw.act_quant == "fp8_per_token")
        groups = k // g
        codes = qw.codes()
        zeros = _zero_codes(qw)
        if zeros is not None:
            codes = codes - zeros.repeat_interleave(g, dim=1)
        if groups == 1:
            y = (xq @ codes.t()) * qw.scales.t()
        else:
            part = torch.einsum("mgk,ngk->mng", xq.reshape(-1, groups, g), codes.reshape(n, groups, g))
            y = (part * qw.scales.unsqueeze(0)).sum(-1)
        y = y * sx
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, n)


def _int8_product(x2: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """W8A8: per-token int8 activations times the weight codes, exact integer sums per group."""
    xq, sx = quantize_act_int8(x2)
    n, k, g = qw.out_features, qw.in_features, qw.group_size
    groups = k // g
    xg = xq.double().reshape(-1, groups, g)
    codes = qw.codes().double().reshape(n, groups, g)
    dots = torch.einsum("mgk,ngk->mng", xg, codes)  # exact: integers far below 2**53
    zeros = _zero_codes(qw)
    if zeros is not None:
        dots = dots - xg.sum(-1).unsqueeze(1) * zeros.double().unsqueeze(0)
    y = (dots * qw.scales.double().unsqueeze(0)).sum(-1)
    return (y * sx.double()).float()


def prepare(qw: QuantizedWeight):
    """The weight in the layout the C++ CPU kernels multiply (a ``PackedQuantizedWeight`` that
    replaces ``qw``: keep only the result), or ``qw`` itself where they do not apply (kernels not
    loaded -- call this after the worker loads them --, a CUDA weight, a layout they lack)."""
    kernels = cpu_kernels.ready()
    if kernels is None or not packed_qweight.supports(qw):
        return qw
    return packed_qweight.pack(qw, kernels)


def quantized_linear(x: torch.Tensor, qw, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x W^T (+ bias)`` with ``W = qw.dequantize()`` (``qw`` a ``QuantizedWeight`` or what
    :func:`prepare` made of one); x [..., K] float32/bf16/fp16, ``x.dtype`` out."""
    if isinstance(qw, PackedQuantizedWeight):
        return _cpu_linear(x, qw, bias)
    if x.is_cuda and qw.act_quant is None and qw.kind in ("int8", "int4"):
        from pagedllm.quantization import triton_qgemm

        if triton_qgemm.block_k(qw.group_size) is not None:
            return triton_qgemm.quantized_linear(x, qw, bias)
    return torch_quantized_linear(x, qw, bias)


def _cpu_linear(x: torch.Tensor, pw: PackedQuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    if k != pw.in_features:
        raise ValueError(f"quantized_linear: x has {k} features, the weight expects {pw.in_features}")
    if x.device.type != "cpu":
        raise ValueError(f"quantized_linear: the weight was packed for the CPU kernels, x is on {x.device}")
    x2 = x.reshape(-1, k)
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    if pw.act_quant in ("fp8_per_token", "fp8_per_tensor"):
        xq, sx = quantize_act_fp8(x2, per_token=pw.act_quant == "fp8_per_token")
        x2 = xq * sx  # the fp8-rounded activations; no CPU multiplies fp8 natively
    x2 = x2.contiguous()
    b = None if bias is None else bias.float().contiguous()
    if pw.int8_activations:
        y = pw.kernels.quant_linear_i8(x2, pw.packed, pw.scales, pw.zeros, pw.colsum, pw.out_features,
                                       pw.group_size, pw.input_perm, b)
    else:
        y = pw.kernels.quant_linear(x2, pw.packed, pw.kind_code, pw.scales, pw.zeros, pw.out_features, pw.group_size,
                                    pw.input_perm, b)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.reshape(*lead, pw.out_features)
