"""The one run-time form every quantized weight format is converted to at load.

Each checkpoint format (GPTQ, AWQ, compressed-tensors, FP8, on-the-fly INT8) has its own on-disk
packing; its method unpacks it once into a ``QuantizedWeight`` and the matmul kernels (C++ on CPU,
Triton on GPU, the torch fallback) only ever see this form:

- ``kind == "int8"``: ``qweight`` int8 ``[N, K]``, signed. Unsigned on-disk codes (GPTQ 8-bit with
  zero points) are shifted by -128 at load, their zero points with them, so ``(q - z)`` is unchanged.
- ``kind == "int4"``: ``qweight`` uint8 ``[N, K // 2]``, two unsigned codes 0..15 per byte: the low
  nibble is column ``2j``, the high nibble column ``2j + 1``.
- ``kind == "fp8"``: ``qweight`` ``torch.float8_e4m3fn`` ``[N, K]``.

``scales`` float32 ``[N, K // group_size]`` (one group per row, ``group_size == K``, is
per-channel; FP8 per-tensor scales are broadcast to ``[N, 1]``). ``zeros`` float32 like ``scales``,
in code units, or None: symmetric, meaning zero point 0 for int8 and fp8 and 8 for int4.
Dequantization is ``w[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]``, computed in float32.

``input_perm`` (GPTQ act-order, ``desc_act`` with ``g_idx``): the weight's columns were permuted at
load so that each group is contiguous; the product is ``x[:, input_perm] @ W_perm^T``.
``dequantize()`` undoes the permutation, so it always returns W in the checkpoint's column order.

``act_quant`` says how activations are quantized for the product: None (weight-only: activations
stay bf16/float32), ``"int8_per_token"`` (W8A8: dynamic symmetric per-row int8 scales),
``"fp8_per_token"`` / ``"fp8_per_tensor"`` (FP8 W8A8, dynamic).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

KINDS = ("int8", "int4", "fp8")
ACT_QUANTS = (None, "int8_per_token", "fp8_per_token", "fp8_per_tensor")


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    group_size: int
    in_features: int
    input_perm: Optional[torch.Tensor] = None
    act_quant: Optional[str] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"QuantizedWeight.kind must be one of {KINDS}, got {self.kind!r}")
        if self.act_quant not in ACT_QUANTS:
            raise ValueError(f"QuantizedWeight.act_quant must be one of {ACT_QUANTS}, got {self.act_quant!r}")
        n, k = self.out_features, self.in_features
        packed_k = k // 2 if self.kind == "int4" else k
        if tuple(self.qweight.shape) != (n, packed_k):
            raise ValueError(f"{self.kind} qweight must be [{n}, {packed_k}], got {tuple(self.qweight.shape)}")
        if self.group_size < 1 or k % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide in_features {k}")
        groups = k // self.group_size
        if tuple(self.scales.shape) != (n, groups) or self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 [{n}, {groups}], got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.zeros is not None and (tuple(self.zeros.shape) != (n, groups) or self.zeros.dtype != torch.float32):
            raise ValueError(f"zeros must be float32 [{n}, {groups}] or None, got {self.zeros.dtype} {tuple(self.zeros.shape)}")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def codes(self) -> torch.Tensor:
        """The integer (or fp8) codes as float32 ``[N, K]``, in the permuted column order."""
        if self.kind == "int4":
            low = (self.qweight & 0x0F).to(torch.float32)
            high = (self.qweight >> 4).to(torch.float32)
            return torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)
        return self.qweight.to(torch.float32)

    def dequantize(self) -> torch.Tensor:
        """The reference float32 ``[N, K]`` weight, in the checkpoint's column order."""
        codes = self.codes()
        g = self.group_size
        scales = self.scales.repeat_interleave(g, dim=1)
        if self.zeros is not None:
            codes = codes - self.zeros.repeat_interleave(g, dim=1)
        elif self.kind == "int4":
            codes = codes - 8.0
        w = codes * scales
        if self.input_perm is not None:
            restored = torch.empty_like(w)
            restored[:, self.input_perm] = w
            w = restored
        return w

    def nbytes(self) -> int:
        """Resident bytes of this weight (codes, scales, zeros, permutation)."""
        parts = [self.qweight, self.scales, self.zeros, self.input_perm]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
