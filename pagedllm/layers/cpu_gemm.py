"""CPU matrix products with each linear layer's weight pre-packed once after loading.

``F.linear`` goes to MKL's sgemm on x86, which is slow for the skinny products decode steps make
(2-core AVX2 EPYC, M=8 rows x 768 -> 2048: 13 GFLOP/s). Two packed forms replace it:

- pagedllm's own GEMM (``kernels/csrc/packed_gemm.h``) when the C++ kernels are built: the weight
  packed once by the kernels module (``pack_linear_weight``, in the layout of the GEMM path its
  ISA level compiled, ``gemm_path()``), float32 or bfloat16 as the model is. On AVX512-BF16 CPUs
  bf16 layers run vdpbf16ps (bf16 products, float32 sums); on AVX-512 / AVX2 bf16 weights are
  widened on load and multiplied in float32. ``benchmarks/cpu_gemm.py`` (llama-100m's 12 layers of
  products, weights streamed from memory as in a decode step; docs/benchmarks.md has the
  commands): on a 2-core AVX512-BF16 EPYC, bf16 M=1 44 vs oneDNN's native bf16 38 GFLOP/s,
  M=8 327 vs 276, M=64 797 vs 758, M=512 867 vs 891 (oneDNN 3% ahead from here up); float32 M=8
  171 vs 141, M=64 415 vs 393, M=512 433 vs 450. On a 2-core AVX2 EPYC (the AVX2 path): float32
  M=8 85.6 vs oneDNN 57.6, M=512 159 vs 146.
- Without the kernels (no compiler): oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, the pair torch.compile
  uses). A bfloat16 model on a CPU without native bf16 (no AVX512-BF16/AMX) has its weights
  upcast once to float32 there (exact; 140 vs 18 GFLOP/s for the emulated bf16 path).

Either way a bf16 layer computes what a native bf16 GEMM does: bf16 inputs, float32
accumulation, one rounding of the output to bf16.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; measured on the 2-core AVX2 machine, 64 was as
# good as 512 for 7..1500 rows and much better than 1 for all but single-row products.
PACKING_BATCH_HINT = 64


def packing_available() -> bool:
    ops = torch.ops.mkldnn  # a torch build without oneDNN's linear ops lacks them
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


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


PANEL = 16  # output columns per panel of pagedllm's packed layout


def pack_weight(weight: torch.Tensor, compute_dtype: torch.dtype) -> nn.Parameter:
    """oneDNN's blocked layout of ``weight`` [N, K] (the path without pagedllm's kernels)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(compute_dtype).contiguous(), PACKING_BATCH_HINT)
    return nn.Parameter(packed, requires_grad=False)


class PanelWeight(nn.Parameter):
    """A weight in pagedllm's panel layout (``pack_panels``): ``panel_out_features`` is its N, and
    ``panel_kernels`` the kernels module that packed it (layouts differ between ISA levels)."""

    panel_out_features: int
    panel_kernels: object


def pack_panels(weight: torch.Tensor, kernels=None) -> PanelWeight:
    """``weight`` [N, K] (float32 or bfloat16) packed for ``kernels.packed_linear`` by the kernels
    module itself (``pack_linear_weight``), in the layout its compiled GEMM path uses
    (``kernels.gemm_path()``): 16-column panels [ceil(N / 16), K, 16], or for bf16 weights on
    the avx512_bf16 path [ceil(N / 16), ceil(K / 2), 32] with k in pairs. ``kernels`` defaults to
    the loaded module."""
    module = kernels if kernels is not None else cpu_kernels.load()
    packed = PanelWeight(module.pack_linear_weight(weight.detach()), requires_grad=False)
    packed.panel_out_features = weight.shape[0]
    packed.panel_kernels = module
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` that also accepts a weight packed by :func:`pack_panels` or :func:`pack_weight`."""
    if isinstance(weight, PanelWeight):
        n = weight.panel_out_features
        flat = x.dim() == 2  # [tokens, features], the models' usual shape: no reshapes
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32 and x2.dtype != torch.bfloat16:
            x2 = x2.float()
        b = bias if bias is None or bias.dtype == torch.float32 else bias.float()
        y = weight.panel_kernels.packed_linear(x2.contiguous(), weight, n, b)  # float32 or bf16, as x2
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if flat else y.reshape(*x.shape[:-1], n)
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


def packable_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that opt in to a packed weight (``packable_weight = True``: our linear, MoE and
    embedding layers, unless quantized or absorbed); torch's own modules have no such flag."""
    return [m for m in model.modules() if getattr(m, "packable_weight", False)]


def pack_linear_weights(model: nn.Module, model_dtype: torch.dtype, gemm: str = "pagedllm",
                        cache_dir: Optional[str] = None) -> int:
    """Replace every packable module's ``weight`` (modules with ``packable_weight = True``) by its
    packed form and return how many were packed. With the C++ kernels loaded the form is
    pagedllm's panels, or per weight shape oneDNN's where ``gemm`` says so ("auto": timed on this
    CPU, layers/gemm_select.py; "onednn": every shape); without them oneDNN's. A weight shared
    with another module (a tied LM head shares the embedding table) gets its own packed copy, the
    original stays dense."""
    modules = [m for m in packable_modules(model) if not m.weight.is_mkldnn and not isinstance(m.weight, PanelWeight)]
    kernels = cpu_kernels.ready()
    compute = packed_compute_dtype(model_dtype)
    if model_dtype in (torch.float32, torch.bfloat16) and kernels is not None:
        def ours(w: torch.Tensor) -> nn.Parameter:
            return pack_panels(w, kernels)

        forms: dict = {}
        if gemm == "onednn" and compute is not None:
            forms = {tuple(m.weight.shape): "onednn" for m in modules}
        elif gemm == "auto" and compute == model_dtype and modules:  # oneDNN native in this dtype: worth timing
            from pagedllm.layers.gemm_select import select_forms

            forms = select_forms((tuple(m.weight.shape) for m in modules), model_dtype, gemm, cache_dir,
                                 kernels.gemm_path(), ours, lambda w: pack_weight(w, model_dtype), linear)
        elif gemm not in ("auto", "pagedllm", "onednn"):
            raise ValueError(f"cpu_gemm must be 'auto', 'pagedllm' or 'onednn', got {gemm!r}")

        def pack(w: torch.Tensor) -> nn.Parameter:
            return pack_weight(w, compute) if forms.get(tuple(w.shape)) == "onednn" else ours(w)
    else:
        if compute is None:
            return 0
        if compute != model_dtype:
            logger.info("CPU GEMMs: %s weights upcast to %s once (no native %s on this CPU)", model_dtype, compute,
                        model_dtype)

        def pack(w: torch.Tensor) -> nn.Parameter:
            return pack_weight(w, compute)
    for module in modules:
        module.weight = pack(module.weight)
    return len(modules)


def gemm_forms(model: nn.Module) -> dict[str, int]:
    """How many packable layers run each GEMM form ({"pagedllm": n, "onednn": m, "dense": d})."""
    counts = {"pagedllm": 0, "onednn": 0, "dense": 0}
    for m in packable_modules(model):
        w = m.weight
        counts["pagedllm" if isinstance(w, PanelWeight) else "onednn" if w.is_mkldnn else "dense"] += 1
    return counts
