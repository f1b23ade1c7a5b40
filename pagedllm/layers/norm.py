from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.quantization.base import materialize


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
    w = materialize(loaded)
    param.data.copy_(w.float() + offset)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (GPT-2), or weight only (``bias=False``: Cohere), computed as
    torch's layer_norm does."""

    def __init__(self, hidden: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class HeadLayerNorm(nn.Module):
    """A LayerNorm over head_dim with its own weights (and bias) per head, on [T, heads, head_dim]:
    StableLM's and Cohere's q/k norms. Holds this rank's ``heads`` heads from ``first_head``; the
    checkpoint gives either all heads' weights in one [heads, head_dim] tensor (Cohere) or one
    tensor per head, loaded with the head index as shard id (StableLM's ``norms.<i>``)."""

    def __init__(self, heads: int, head_dim: int, first_head: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps, self.first = eps, first_head
        self.weight = nn.Parameter(torch.ones(heads, head_dim), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self.bias = nn.Parameter(torch.zeros(heads, head_dim), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        n = param.shape[0]
        if shard_id is None:  # every head's rows in one tensor
            param.data.copy_(loaded.narrow(0, self.first, n))
        elif self.first <= shard_id < self.first + n:  # one head's; other ranks' heads are skipped
            param.data[shard_id - self.first].copy_(materialize(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt(var + self.eps) * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)
