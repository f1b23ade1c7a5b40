"""Falcon (``FalconForCausalLM``) in the three layouts its configs select:

- ``new_decoder_architecture`` (Falcon-40B/180B): grouped kv heads, q/k/v fused per kv group
  ([kv_heads, heads / kv_heads + 2, head_dim] rows), attention and MLP in parallel from two norms
  (``ln_attn``, ``ln_mlp``; one shared norm when ``num_ln_in_parallel_attn`` is 1);
- ``multi_query`` (Falcon-7B): one kv head, fused [q | k | v] rows, attention and MLP in parallel
  from one norm (``parallel_attn``) or sequential with a second norm;
- neither (Falcon-RW): a kv head per query head, q/k/v fused per head.

Rotary over whole heads, or ``alibi``: no rotary, ALiBi slopes divided by sqrt(head_dim) (HF adds
slope * position / sqrt(head_dim) to the scaled scores; its slopes are rounded to bfloat16
first, exact for the power-of-two slopes of power-of-two head counts while positions stay below
256). Exact GELU MLP; ``bias`` on every projection; the LM head tied to the embeddings.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

from pagedllm.layers.norm import LayerNorm
from pagedllm.models.dense_decoder import (DecoderLM, DecoderModel, DenseAttention, DenseMLP, alibi_slopes, renamed,
                                           rotary_for, split_qkv)

_RENAMES = [("transformer.", "model."), (".word_embeddings.", ".embed_tokens."), (".h.", ".layers."),
            ("model.ln_f.", "model.norm."), (".self_attention.query_key_value.", ".self_attn.qkv."),
            (".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.fc."),
            (".mlp.dense_4h_to_h.", ".mlp.proj.")]


def falcon_layout(config) -> tuple[str, int]:
    """(fused qkv layout, kv heads) of a Falcon config."""
    if getattr(config, "new_decoder_architecture", False):
        return "grouped", config.num_kv_heads
    if getattr(config, "multi_query", True):
        return "blocked", 1
    return "per_head", config.num_attention_heads


class FalconLayer(nn.Module):
    def __init__(self, config, alibi) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_epsilon
        new_arch = bool(getattr(config, "new_decoder_architecture", False))
        self.parallel = new_arch or bool(getattr(config, "parallel_attn", True))
        two_norms = new_arch and (getattr(config, "num_ln_in_parallel_attn", None) or 2) == 2
        if two_norms:
            self.ln_attn, self.ln_mlp = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        else:
            self.input_layernorm = LayerNorm(hidden, eps)
            self.ln_attn = self.ln_mlp = self.input_layernorm
        if not self.parallel:
            self.post_attention_layernorm = LayerNorm(hidden, eps)
        _, kv_heads = falcon_layout(config)
        bias = bool(config.bias)
        self.self_attn = DenseAttention(hidden, heads, kv_heads, hidden // heads, qkv_bias=bias, o_bias=bias, alibi=alibi)
        self.mlp = DenseMLP(hidden, getattr(config, "ffn_hidden_size", None) or 4 * hidden,
                            getattr(config, "activation", "gelu"), bias=bias)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        a = self.self_attn(rope, self.ln_attn(h))
        if self.parallel:
            return h + (self.mlp(self.ln_mlp(h)) + a)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class FalconForCausalLM(DecoderLM):
    def __init__(self, config) -> None:
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        if getattr(config, "alibi", False):
            alibi, rotary = alibi_slopes(heads) / math.sqrt(self.head_dim), None  # one tensor all layers share
        else:
            alibi, rotary = None, rotary_for(config, self.head_dim)
        model = DecoderModel(config.vocab_size, hidden, config.num_hidden_layers, lambda i: FalconLayer(config, alibi),
                             LayerNorm(hidden, config.layer_norm_epsilon), rotary)
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", True)))

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        layout, kv_heads = falcon_layout(self.config)
        weights = renamed(weights, _RENAMES)
        return split_qkv(weights, "qkv", layout, self.config.num_attention_heads, kv_heads, self.head_dim)
