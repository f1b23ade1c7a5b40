"""Granite (``GraniteForCausalLM``, IBM Granite 3.x): the Llama layer with its four multipliers:
embeddings times ``embedding_multiplier``, attention scores scaled by ``attention_multiplier``
(instead of head_dim ** -0.5), each attention and MLP output times ``residual_multiplier``
before it joins the residual stream, and the logits divided by ``logits_scaling``.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.dense_decoder import DecoderLM, DecoderModel, DenseAttention
from pagedllm.models.llama import FUSED_QKV_GATE_UP, LlamaMLP, rope_settings


class GraniteLayer(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = DenseAttention(hidden, heads, config.num_key_value_heads or heads, head_dim, qkv_bias=bias,
                                        o_bias=bias, scale=float(config.attention_multiplier))
        self.mlp = LlamaMLP(config)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(rope, self.input_layernorm(h)) * self.residual_multiplier
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier


class GraniteForCausalLM(DecoderLM):
    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta, scaling = rope_settings(config)
        model = DecoderModel(config.vocab_size, config.hidden_size, config.num_hidden_layers,
                             lambda i: GraniteLayer(config, head_dim), RMSNorm(config.hidden_size, config.rms_norm_eps),
                             RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling),
                             embedding_multiplier=float(config.embedding_multiplier))
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", False)),
                         logit_factor=1.0 / float(config.logits_scaling))
