from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels.for_tensor(x)
        if kernels is not None and x.dim() == 2 and x.stride(-1) == 1:
            out = x.new_empty(x.shape[0], x.shape[1] // 2)
            kernels.silu_and_mul(out, x)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> gelu(gate) * up (GeGLU; Gemma: tanh-approximate)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


# HF hidden_act names of the GELU forms -> torch's ``approximate`` argument
GELU_APPROXIMATE = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh"}


def gelu_approximate(act: str) -> str:
    if act not in GELU_APPROXIMATE:
        raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(GELU_APPROXIMATE)})")
    return GELU_APPROXIMATE[act]
