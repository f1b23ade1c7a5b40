"""Multi-head latent attention's cache-bound part: holds this layer's latent cache view (one
plane, one ``kv_lora_rank + qk_rope_head_dim`` vector per token) and attends through it. The
model (models/deepseek_v3.py) does the projections and absorbs the up-projections."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.attention.forward_context import get_attention_metadata
from pagedllm.attention.torch_mla import mla_attention


class MLAAttention(nn.Module):
    kv_planes = 1  # the worker allocates one plane per layer, not K and V
    sliding_window: Optional[int] = None  # attends to the whole context
    kv_scales: Optional[torch.Tensor] = None  # no 8-bit cache for the latent (the worker refuses one)

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + rope_dim  # the cached row's width
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.kv_cache: Optional[torch.Tensor] = None

    def bind(self, backend, kv_cache: torch.Tensor) -> None:
        if backend.name != "torch_native":
            raise NotImplementedError(
                f"multi-head latent attention (DeepSeek) runs on the torch_native backend (CPU) only; the "
                f"{backend.name} backend has no MLA path yet")
        self.kv_cache = kv_cache[0]  # [num_blocks, block_size, 1, R + dr]

    def forward(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """q [T, H, R + dr], latent [T, R + dr] -> per-head latent output [T, H, R]."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        return mla_attention(q, latent, self.kv_cache, get_attention_metadata(), self.scale, self.kv_lora_rank)
