"""Starcoder2 (``Starcoder2ForCausalLM``): the Llama layout of names with LayerNorms (bias), biased
q/k/v/o (``use_bias``), a plain c_fc -> tanh GELU -> c_proj MLP, grouped kv heads, rotary over
whole heads, an optional sliding window on every layer, the LM head tied by default.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from pagedllm.layers.norm import LayerNorm
from pagedllm.models.dense_decoder import DecoderLM, DecoderModel, DenseAttention, DenseMLP, renamed, rotary_for

_RENAMES = [(".mlp.c_fc.", ".mlp.fc."), (".mlp.c_proj.", ".mlp.proj.")]


class Starcoder2Layer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.norm_epsilon
        bias = bool(getattr(config, "use_bias", True))
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.self_attn = DenseAttention(hidden, heads, config.num_key_value_heads or heads, hidden // heads,
                                        qkv_bias=bias, o_bias=bias, sliding_window=getattr(config, "sliding_window", None))
        self.mlp = DenseMLP(hidden, config.intermediate_size, config.hidden_act, bias=bias)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(rope, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Starcoder2ForCausalLM(DecoderLM):
    def __init__(self, config) -> None:
        hidden = config.hidden_size
        model = DecoderModel(config.vocab_size, hidden, config.num_hidden_layers, lambda i: Starcoder2Layer(config),
                             LayerNorm(hidden, config.norm_epsilon), rotary_for(config, hidden // config.num_attention_heads))
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", True)))

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        return renamed(weights, _RENAMES)
