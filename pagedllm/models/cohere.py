"""Cohere (``CohereForCausalLM``: Command-R, Aya): one LayerNorm without bias (computed in float32)
feeding attention and the SwiGLU MLP in parallel (``h + attn(ln(h)) + mlp(ln(h))``), optional
per-head q/k LayerNorms (``use_qk_norm``), the logits times ``logit_scale``, the LM head tied.

Its rotary rotates interleaved pairs of dims (2i, 2i+1) where the shared rotary layer rotates
(i, i + head_dim/2). On load the q and k projection rows (and their norms' weights) are permuted
within each head, evens first then odds: the shared layer's rotation of the permuted dims is
Cohere's rotation of the original ones, and q . k (a sum over dims) is unchanged by permuting
both alike; v and the output projection are untouched.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from pagedllm.layers.norm import HeadLayerNorm, LayerNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.checkpoint_views import RowsView
from pagedllm.models.dense_decoder import DecoderLM, DecoderModel, DenseAttention
from pagedllm.models.llama import FUSED_QKV_GATE_UP, LlamaMLP, rope_settings


class CohereLayer(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
        self.input_layernorm = LayerNorm(hidden, eps, bias=False)
        norm = ((lambda n, first: HeadLayerNorm(n, head_dim, first, eps, bias=False))
                if getattr(config, "use_qk_norm", False) else None)
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = DenseAttention(hidden, heads, config.num_key_value_heads or heads, head_dim, qkv_bias=bias,
                                        o_bias=bias, make_norm=norm)
        self.mlp = LlamaMLP(config)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        return h + self.self_attn(rope, x) + self.mlp(x)


class CohereForCausalLM(DecoderLM):
    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config) -> None:
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        theta, scaling = rope_settings(config)
        model = DecoderModel(config.vocab_size, hidden, config.num_hidden_layers, lambda i: CohereLayer(config, self.head_dim),
                             LayerNorm(hidden, config.layer_norm_eps, bias=False),
                             RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling))
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", True)),
                         logit_factor=float(getattr(config, "logit_scale", 1.0)))

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        d = self.head_dim
        perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # evens, then odds
        for name, src in weights:
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                heads = src.shape[0] // d
                yield name, RowsView(src, (torch.arange(heads)[:, None] * d + perm).reshape(-1))
            elif ".self_attn.q_norm." in name or ".self_attn.k_norm." in name:  # [heads, head_dim]
                full = src.full() if hasattr(src, "full") else src
                yield name, full[:, perm].contiguous()
            else:
                yield name, src
