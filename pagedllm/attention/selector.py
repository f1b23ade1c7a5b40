"""Attention backend selection (beside, not inside, the interface both backends import)."""
from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.torch_native import TorchNativeAttentionBackend


def get_attention_backend(device: torch.device) -> type[AttentionBackend]:
    """Backend selection by device: CPU uses torch_native, CUDA uses Triton."""
    if device.type == "cuda":
        # Imported only here: triton is an optional dependency and slow to import.
        from pagedllm.attention.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend
    return TorchNativeAttentionBackend
