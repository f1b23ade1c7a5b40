"""Phi-1 / Phi-1.5 / Phi-2 (``PhiForCausalLM``): one LayerNorm feeding attention and the MLP in
parallel (``h + attn(ln(h)) + mlp(ln(h))``), rotary over the first ``partial_rotary_factor`` of
each head's dims, biased q/k/v/dense and fc1/fc2 (tanh GELU), optional q/k LayerNorms over
head_dim (``qk_layernorm``), a final LayerNorm, and an LM head with a bias.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from pagedllm.layers.norm import LayerNorm
from pagedllm.models.dense_decoder import DecoderLM, DecoderModel, DenseAttention, DenseMLP, renamed, rotary_for

_RENAMES = [(".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.fc."), (".mlp.fc2.", ".mlp.proj."),
            (".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm."), ("model.final_layernorm.", "model.norm."),
            ("lm_head.bias", "lm_head_bias")]


class PhiLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
        head_dim = hidden // heads
        self.input_layernorm = LayerNorm(hidden, eps)
        norm = (lambda n, first: LayerNorm(head_dim, eps)) if getattr(config, "qk_layernorm", False) else None
        self.self_attn = DenseAttention(hidden, heads, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                                        qkv_bias=True, o_bias=True, make_norm=norm)
        self.mlp = DenseMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        return self.self_attn(rope, x) + self.mlp(x) + h


class PhiForCausalLM(DecoderLM):
    def __init__(self, config) -> None:
        hidden = config.hidden_size
        model = DecoderModel(config.vocab_size, hidden, config.num_hidden_layers, lambda i: PhiLayer(config),
                             LayerNorm(hidden, config.layer_norm_eps),
                             rotary_for(config, hidden // config.num_attention_heads))
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", False)), lm_head_bias=True)

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        return renamed(weights, _RENAMES)
