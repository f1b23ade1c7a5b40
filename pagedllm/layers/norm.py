from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (HF Llama's numerics).

    ``forward(x, residual)`` also adds the residual first and returns ``(normed, x + residual)``,
    which the CPU kernels do in one pass (in place: x and residual are the caller's temporaries).
    """

    def __init__(self, hidden: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        if weight_offset:  # Gemma stores w and scales by (1 + w): the sum is kept, computed on load
            self.weight.weight_loader = functools.partial(_offset_loader, weight_offset)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        kernels = cpu_kernels.for_tensor(x)
        if kernels is not None and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            if residual is None:
                out = torch.empty_like(x)
                kernels.rms_norm(out, x, self.weight, self.eps)
                return out
            if residual.is_contiguous() and x.is_contiguous():
                kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _offset_loader(offset: float, param: torch.Tensor, loaded, shard_id=None) -> None:
    w = loaded.full() if hasattr(loaded, "full") else loaded
    param.data.copy_(w.float() + offset)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (GPT-2), computed as torch's layer_norm does."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
