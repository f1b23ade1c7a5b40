"""A :class:`QuantizedWeight` repacked once at load for the C++ CPU kernels (``quant_gemm.h``).

``PackedQuantizedWeight`` replaces the weight it was made from (the original is dropped, so the
resident size stays the quantized size) and still answers what a ``QuantizedWeight`` does:
``kind``, ``in_features``, ``out_features``, ``group_size``, ``input_perm``, ``act_quant``,
``dequantize()`` (from the packed bytes), ``nbytes()`` and ``unpacked()`` (the run-time form back).

Layouts (zero past N; P = ceil(N / 16) panels of 16 output rows):

- weight-only (``act_quant`` None or fp8 activations): the checkpoint's bytes transposed into
  panels, ``packed[p, kk, j] = qweight[16 p + j, kk]`` (int4: kk indexes byte pairs of columns);
  ``scales`` / ``zeros`` ``[P, G, 16]`` float32. fp8 codes are widened in the kernel to value /
  256 (through fp16 bits), so their scales are stored times 256 and zero points divided by 256
  (powers of two: exact both ways).
- ``int8_per_token`` (W8A8, int8 weights): ``packed[p, kq, j, t] = qweight[16 p + j, 4 kq + t]``,
  four consecutive k of one row per 32-bit lane, for vpdpbusd; ``colsum[p, g, j]`` int32 is 128
  times the group's sum of the row's codes (the kernel feeds activations as unsigned ``q + 128``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.quantization.quantized_weight import QuantizedWeight

PANEL = 16
_KIND_CODE = {"int8": 0, "int4": 1, "fp8": 2}


@dataclass(frozen=True, slots=True)
class PackedQuantizedWeight:
    kind: str
    packed: torch.Tensor
    scales: torch.Tensor  # [P, G, 16] float32 (fp8: 256 s)
    zeros: Optional[torch.Tensor]  # [P, G, 16] float32 (fp8: z / 256), None when all 0 (int4: all 8)
    group_size: int
    in_features: int
    out_features: int
    input_perm: Optional[torch.Tensor]
    act_quant: Optional[str]
    kernels: Any  # the kernels module that packed it (its layout)
    colsum: Optional[torch.Tensor] = None  # W8A8: [P, G, 16] int32

    @property
    def kind_code(self) -> int:
        return _KIND_CODE[self.kind]

    @property
    def int8_activations(self) -> bool:
        return self.colsum is not None

    def unpacked(self) -> QuantizedWeight:
        """The run-time form this was packed from (a new copy)."""
        n, k = self.out_features, self.in_features
        if self.int8_activations:
            qweight = self.packed.permute(0, 2, 1, 3).reshape(-1, k)[:n]
        else:
            qweight = self.packed.permute(0, 2, 1).reshape(-1, self.packed.shape[1])[:n]
        qweight = qweight.contiguous().view(_storage_dtype(self.kind))

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n].contiguous()

        scales, zeros = rows(self.scales), None if self.zeros is None else rows(self.zeros)
        if self.kind == "fp8" and not self.int8_activations:
            scales = scales / 256.0
            zeros = None if zeros is None else zeros * 256.0
        return QuantizedWeight(self.kind, qweight, scales, zeros, self.group_size, k, self.input_perm, self.act_quant)

    def dequantize(self) -> torch.Tensor:
        return self.unpacked().dequantize()

    def nbytes(self) -> int:
        parts = [self.packed, self.scales, self.zeros, self.input_perm, self.colsum]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _storage_dtype(kind: str) -> torch.dtype:
    return {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[kind]


def _panel_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G] -> [P, G, 16] (zero past N)."""
    p = (n + PANEL - 1) // PANEL
    padded = torch.zeros(p * PANEL, t.shape[1], dtype=t.dtype)
    padded[:n] = t
    return padded.reshape(p, PANEL, t.shape[1]).permute(0, 2, 1).contiguous()


def supports(qw: QuantizedWeight) -> bool:
    """Whether the CPU kernels multiply this weight (else the torch path does)."""
    if qw.qweight.device.type != "cpu":
        return False
    if qw.act_quant == "int8_per_token":
        return qw.kind == "int8" and qw.group_size % 4 == 0
    return qw.kind != "int4" or qw.group_size % 2 == 0


def pack(qw: QuantizedWeight, kernels) -> PackedQuantizedWeight:
    """``qw`` in the kernels' layout (see the module docstring); call :func:`supports` first."""
    n, k = qw.out_features, qw.in_features
    zeros = qw.zeros
    if qw.kind == "int4" and zeros is not None and bool((zeros == 8.0).all()):
        zeros = None  # the kernels' int4 default: no zero points streamed
    scales = qw.scales
    colsum = None
    if qw.act_quant == "int8_per_token":
        codes = qw.qweight.to(torch.int32)
        colsum = _panel_rows(codes.reshape(n, -1, qw.group_size).sum(-1) * 128, n).to(torch.int32)
        p = (n + PANEL - 1) // PANEL
        padded = torch.zeros(p * PANEL, k, dtype=torch.int8)
        padded[:n] = qw.qweight
        packed = padded.reshape(p, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(torch.uint8)
    else:
        packed = kernels.pack_quantized_weight(qw.qweight.view(torch.uint8))
        if qw.kind == "fp8":
            scales = scales * 256.0
            zeros = None if zeros is None else zeros / 256.0
    stored_zeros = None if zeros is None else _panel_rows(zeros, n)
    perm = None if qw.input_perm is None else qw.input_perm.to(torch.int64).contiguous()
    return PackedQuantizedWeight(qw.kind, packed, _panel_rows(scales, n), stored_zeros, qw.group_size, k, n, perm,
                                 qw.act_quant, kernels, colsum)
