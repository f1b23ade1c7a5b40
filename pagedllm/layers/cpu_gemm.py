"""CPU matrix products through oneDNN with weights pre-packed once after loading.

On x86 CPUs, ``F.linear`` goes to MKL's sgemm, which is slow for the skinny products that
decode steps make (measured on a 2-core AVX2 EPYC, M=8 rows x 768 -> 2048: 13 GFLOP/s with MKL
vs 55 with a packed oneDNN weight; the 32000-row LM head at M=64: 71 vs 118). So after the
weights are loaded, each linear layer's weight is reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and products run through
``torch.ops.mkldnn._linear_pointwise`` — the same pair torch.compile uses for CPU linears.

Precision: a bfloat16 model on a CPU without native bf16 instructions (no AVX512-BF16/AMX)
cannot pack bf16 weights; there the bf16 weights are upcast once to float32 (exactly, every bf16
value is a float32 value) and the product runs in float32 before rounding back to bf16. That is
what a native bf16 GEMM computes (bf16 inputs, float32 accumulation), at float32 speed instead
of the emulated bf16 path (measured 18 vs 140 GFLOP/s), for twice the weight memory.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; measured on the 2-core AVX2 machine, 64 was as
# good as 512 for 7..1500 rows and much better than 1 for all but single-row products.
PACKING_BATCH_HINT = 64


def packing_available() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight") and hasattr(
        ops, "_linear_pointwise"
    )


def packed_compute_dtype(model_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype packed weights are stored in for a model of ``model_dtype``; None = no packing."""
    if not packing_available():
        return None
    if model_dtype == torch.float32:
        return torch.float32
    if model_dtype == torch.bfloat16:
        try:  # oneDNN refuses bf16 packing where the CPU cannot run bf16 natively
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), PACKING_BATCH_HINT)
            return torch.bfloat16
        except RuntimeError:
            return torch.float32
    return None


def pack_weight(weight: torch.Tensor, compute_dtype: torch.dtype) -> nn.Parameter:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(compute_dtype).contiguous(), PACKING_BATCH_HINT)
    return nn.Parameter(packed, requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` that also accepts a weight packed by :func:`pack_weight`."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    out_dtype = x.dtype
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    fused_bias = bias if bias is not None and bias.dtype == weight.dtype else None
    y = torch.ops.mkldnn._linear_pointwise(x, weight, fused_bias, "none", [], "")
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    if bias is not None and fused_bias is None:
        y = y + bias
    return y


def pack_linear_weights(model: nn.Module, model_dtype: torch.dtype) -> int:
    """Replace every packable module's ``weight`` (modules with ``packable_weight = True``) by its
    packed form; returns how many were packed. A weight shared with another module (a tied LM
    head shares the embedding table) gets its own packed copy, the original stays dense."""
    compute = packed_compute_dtype(model_dtype)
    if compute is None:
        return 0
    count = 0
    for module in model.modules():
        if getattr(module, "packable_weight", False) and not module.weight.is_mkldnn:
            module.weight = pack_weight(module.weight, compute)
            count += 1
    if compute != model_dtype:
        logger.info("CPU GEMMs: %s weights upcast to %s once (no native %s on this CPU)", model_dtype, compute, model_dtype)
    return count
