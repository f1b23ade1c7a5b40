"""Attention layer: holds this layer's KV cache view and delegates to the backend's impl."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.attention.forward_context import get_attention_metadata


class Attention(nn.Module):
    kv_planes = 2  # the worker allocates a K and a V plane per layer

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: Optional[int] = None,
                 logits_soft_cap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap  # Gemma 2: scores -> cap * tanh(score / cap)
        # ALiBi (Falcon-7B/40B, BLOOM, MPT): float32 [num_heads] of this rank's heads; score of key j
        # from position p gains slope * (j - p)
        self.alibi_slopes = alibi_slopes
        self.kv_cache: Optional[torch.Tensor] = None  # bound by the worker after allocation
        self.kv_scales: Optional[torch.Tensor] = None  # 8-bit kv_cache_dtype: [2, num_blocks, block_size, kv_heads]
        self.impl = None  # bound by the worker (backend chosen by device)

    def bind(self, backend, kv_cache: torch.Tensor, kv_scales: Optional[torch.Tensor] = None) -> None:
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales
        extra = {} if self.alibi_slopes is None else {"alibi_slopes": self.alibi_slopes.to(kv_cache.device)}
        self.impl = backend.make_impl(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window,
                                      self.logits_soft_cap, **extra)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.impl is None or self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        T = q.shape[0]
        args = (q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                v.view(T, self.num_kv_heads, self.head_dim), self.kv_cache, get_attention_metadata())
        # 8-bit caches only: backends without them keep the plain signature
        out = self.impl.forward(*args) if self.kv_scales is None else self.impl.forward(*args, kv_scales=self.kv_scales)
        return out.reshape(T, self.num_heads * self.head_dim)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """A fused projection's output [T, (H + 2 Hkv) * D] -> q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.reshape(T, num_heads, head_dim), k.reshape(T, num_kv_heads, head_dim), v.reshape(T, num_kv_heads, head_dim)
