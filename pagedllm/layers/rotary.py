"""Rotary position embedding (neox/HF "rotate_half" layout), with rope_scaling variants."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels


def _inv_freq(head_dim: int, base: float, rope_scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scale = 1.0
    if not rope_scaling:
        return inv_freq, scale
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, scale
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"]), scale
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_ctx = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), scale
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: Optional[dict] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scale = _inv_freq(head_dim, base, rope_scaling)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per forward and shared by every layer: ([T, 1, D], [T, 1, D])."""
        return self.cos_cache[positions].unsqueeze(1).to(dtype), self.sin_cache[positions].unsqueeze(1).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def apply_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hkv, D] rotated by the step's shared (cos, sin). The CPU kernel
    rotates q and k in place (they are the caller's fresh projections) and returns them."""
    cos, sin = cos_sin
    kernels = cpu_kernels.for_tensor(q)
    if kernels is not None and cos.dtype == q.dtype and _heads_contiguous(q) and _heads_contiguous(k):
        T = q.shape[0]
        cos2, sin2 = cos.view(T, -1), sin.view(T, -1)
        kernels.rotary_inplace(q, cos2, sin2)
        kernels.rotary_inplace(k, cos2, sin2)
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
