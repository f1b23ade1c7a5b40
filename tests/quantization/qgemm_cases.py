"""Random ``QuantizedWeight``s for the matmul-kernel tests (every kind, group size, zero-point and
act-order combination), and the float64 reference product from ``dequantize()``."""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.quantization.quantized_weight import QuantizedWeight


def random_qweight(kind: str, n: int, k: int, group: int = -1, asym: bool = False, perm: bool = False,
                   act_quant: Optional[str] = None, seed: int = 0) -> QuantizedWeight:
    """A random weight in the run-time form; ``group == -1`` means one group per row."""
    gen = torch.Generator().manual_seed(seed)
    g = k if group == -1 else group
    groups = k // g
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.002
    zeros = None
    if kind == "int8":
        qweight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
        if asym:
            zeros = torch.randint(-20, 21, (n, groups), generator=gen).float()
    elif kind == "int4":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        if asym:
            zeros = torch.randint(0, 16, (n, groups), generator=gen).float()
    elif kind == "fp8":
        qweight = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        if asym:
            zeros = torch.randn(n, groups, generator=gen).round()
    else:
        raise ValueError(kind)
    input_perm = torch.randperm(k, generator=gen) if perm else None
    return QuantizedWeight(kind, qweight, scales, zeros, g, k, input_perm=input_perm, act_quant=act_quant)


def random_input(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype)


def reference(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 ``x @ dequantize()^T (+ bias)`` (weight-only: activations unquantized)."""
    y = x.double() @ qw.dequantize().double().t()
    return y if bias is None else y + bias.double()


def int8_act_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float64 W8A8 reference written from the definition: per-row s = absmax / 127, codes
    round-half-even(x / s) in [-127, 127], exact integer dot product with dequantize()."""
    x = x.float()
    s = x.abs().amax(dim=1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(x / s).clamp(-127, 127).double()
    return (q @ qw.dequantize().double().t()) * s.double()


def chunks(k: int, group: int) -> list:
    """The kernels' chunks of K (quant_gemm.h): each group, cut into pieces of at most 256 k."""
    return [(c, min(c + 256, g + group)) for g in range(0, k, group) for c in range(g, g + group, 256)]


def int16_rounded(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """float32 x as the int16 path multiplies it (quant_gemm_i16.h), written from the definition:
    per row s = absmax / 32767 (1 for a row of zeros), q = round-half-even(x / s); returned as
    s * q."""
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True) / 32767.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(xf / s).clamp(-32767, 32767).double() * s.double()).float()


def kernel_input(x: torch.Tensor, qw: QuantizedWeight, kernels) -> torch.Tensor:
    """What the kernels multiply for x: int16_rounded(x) where they take the int16 path (float32
    x, int4 / int8 codes, an even group size, a CPU with AVX512-VNNI and VBMI), else x."""
    if (x.dtype == torch.float32 and qw.kind in ("int4", "int8") and qw.group_size % 2 == 0
            and qw.act_quant is None and kernels.int16_activations()):
        return int16_rounded(x, qw)
    return x
