"""GPTBigCode (``GPTBigCodeForCausalLM``: StarCoder, SantaCoder): GPT-2's block (LayerNorms with
bias, learned absolute positions, tanh GELU MLP, the LM head tied) with ``nn.Linear`` weights
(not Conv1D) and multi-query attention: ``c_attn`` rows are [q | k | v] with one kv head
(``multi_query``; else per head [heads, 3, head_dim]).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from pagedllm.layers.norm import LayerNorm
from pagedllm.models.dense_decoder import DecoderLM, DecoderModel, DenseAttention, DenseMLP, renamed, split_qkv

_RENAMES = [("transformer.", "model."), ("model.wte.", "model.embed_tokens."), ("model.wpe.weight", "model.wpe"),
            (".h.", ".layers."), ("model.ln_f.", "model.norm."), (".attn.c_attn.", ".self_attn.qkv."),
            (".attn.c_proj.", ".self_attn.o_proj."), (".mlp.c_fc.", ".mlp.fc."), (".mlp.c_proj.", ".mlp.proj.")]


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads, eps = config.n_embd, config.n_head, config.layer_norm_epsilon
        self.ln_1 = LayerNorm(hidden, eps)
        self.ln_2 = LayerNorm(hidden, eps)
        scale = None if getattr(config, "scale_attn_weights", True) else 1.0
        self.self_attn = DenseAttention(hidden, heads, 1 if config.multi_query else heads, hidden // heads,
                                        qkv_bias=True, o_bias=True, scale=scale)
        self.mlp = DenseMLP(hidden, getattr(config, "n_inner", None) or 4 * hidden, config.activation_function)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(rope, self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class GPTBigCodeForCausalLM(DecoderLM):
    def __init__(self, config) -> None:
        hidden = config.n_embd
        model = DecoderModel(config.vocab_size, hidden, config.n_layer, lambda i: GPTBigCodeBlock(config),
                             LayerNorm(hidden, config.layer_norm_epsilon), None, max_positions=config.n_positions)
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", True)))

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        c = self.config
        weights = renamed(weights, _RENAMES, skip=(".attn.bias", ".attn.masked_bias"))
        layout = "blocked" if c.multi_query else "per_head"
        return split_qkv(weights, "qkv", layout, c.n_head, 1 if c.multi_query else c.n_head, c.n_embd // c.n_head)
