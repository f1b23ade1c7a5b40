"""StableLM (``StableLmForCausalLM``: StableLM-3B-4E1T, StableLM-2): the Llama SwiGLU MLP under
LayerNorms with bias, rotary over the first ``partial_rotary_factor`` of each head's dims,
optional q/k/v bias (``use_qkv_bias``), optional per-head q/k LayerNorms (``qk_layernorm``,
StableLM-2-12B: one norm per head, ``norms.<i>`` in the checkpoint), sequential residual or one
norm feeding attention and the MLP in parallel (``use_parallel_residual``).
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
from torch import nn

from pagedllm.layers.norm import HeadLayerNorm, LayerNorm
from pagedllm.models.dense_decoder import DecoderLM, DecoderModel, DenseAttention, rotary_for
from pagedllm.models.llama import FUSED_QKV_GATE_UP, LlamaMLP

_HEAD_NORM = re.compile(r"\.(q|k)_layernorm\.norms\.(\d+)\.(weight|bias)$")


class StableLmLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, config.layer_norm_eps
        head_dim = hidden // heads
        self.parallel = bool(getattr(config, "use_parallel_residual", False))
        self.input_layernorm = LayerNorm(hidden, eps)
        if not self.parallel:
            self.post_attention_layernorm = LayerNorm(hidden, eps)
        norm = ((lambda n, first: HeadLayerNorm(n, head_dim, first, eps, bias=False))
                if getattr(config, "qk_layernorm", False) else None)
        bias = bool(getattr(config, "use_qkv_bias", False))
        self.self_attn = DenseAttention(hidden, heads, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                                        qkv_bias=bias, o_bias=False, make_norm=norm)
        self.mlp = LlamaMLP(config)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.parallel:
            return h + self.self_attn(rope, x) + self.mlp(x)
        h = h + self.self_attn(rope, x)
        return h + self.mlp(self.post_attention_layernorm(h))


class StableLmForCausalLM(DecoderLM):
    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config) -> None:
        hidden = config.hidden_size
        model = DecoderModel(config.vocab_size, hidden, config.num_hidden_layers, lambda i: StableLmLayer(config),
                             LayerNorm(hidden, config.layer_norm_eps),
                             rotary_for(config, hidden // config.num_attention_heads))
        super().__init__(config, model, tie=bool(getattr(config, "tie_word_embeddings", False)))

    def remap_checkpoint_name(self, name: str):
        """A per-head q/k norm tensor -> (the layer's HeadLayerNorm parameter, head index)."""
        m = _HEAD_NORM.search(name)
        if m is None:
            return None
        return name[: m.start()] + f".{m.group(1)}_norm.{m.group(3)}", int(m.group(2))

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        return weights
