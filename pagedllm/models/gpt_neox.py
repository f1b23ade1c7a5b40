"""GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B): LayerNorm with bias, rotary over the
first ``rotary_pct`` of each head's dims, biased projections, exact GELU, and the parallel
residual (``h + attn(ln1(h)) + mlp(ln2(h))``; ``use_parallel_residual=False``: sequential).

q/k/v are fused per head in the checkpoint ([heads, 3, head_dim] rows of ``query_key_value``):
split on load into index views (models/checkpoint_views.py).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from pagedllm.layers.norm import LayerNorm
from pagedllm.models.dense_decoder import (DecoderLM, DecoderModel, DenseAttention, DenseMLP, renamed, rotary_for,
                                           split_qkv)

_RENAMES = [("gpt_neox.", "model."), (".embed_in.", ".embed_tokens."), (".final_layer_norm.", ".norm."),
            (".attention.query_key_value.", ".self_attn.qkv."), (".attention.dense.", ".self_attn.o_proj."),
            (".mlp.dense_h_to_4h.", ".mlp.fc."), (".mlp.dense_4h_to_h.", ".mlp.proj."), ("embed_out.", "lm_head.")]


class GPTNeoXLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
        self.parallel = bool(getattr(config, "use_parallel_residual", True))
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        bias = bool(getattr(config, "attention_bias", True))
        self.self_attn = DenseAttention(hidden, heads, heads, hidden // heads, qkv_bias=bias, o_bias=bias)
        self.mlp = DenseMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(rope, self.input_layernorm(h))
        if self.parallel:
            return self.mlp(self.post_attention_layernorm(h)) + a + h
        h = a + h
        return self.mlp(self.post_attention_layernorm(h)) + h


class GPTNeoXForCausalLM(DecoderLM):
    def __init__(self, config) -> None:
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        model = DecoderModel(config.vocab_size, hidden, config.num_hidden_layers, lambda i: GPTNeoXLayer(config),
                             LayerNorm(hidden, config.layer_norm_eps), rotary_for(config, self.head_dim))
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", False)))

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        heads = self.config.num_attention_heads
        weights = renamed(weights, _RENAMES, skip=(".attention.bias", ".attention.masked_bias"))
        return split_qkv(weights, "qkv", "per_head", heads, heads, self.head_dim)
