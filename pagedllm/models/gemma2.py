"""Gemma 2 (``Gemma2ForCausalLM``), and the decoder layer Gemma 3 reuses (gemma3.py).

What differs from Llama: RMSNorm scales by (1 + w) (the sum is stored at load); the embeddings
are multiplied by sqrt(hidden); every layer normalises both before and after attention and
the MLP (four norms); the MLP is GeGLU with tanh-approximate GELU; queries are scaled by
``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``; attention scores are
soft-capped (``cap * tanh(score / cap)``, an attention-backend option) and so are the final
logits; layers alternate between a sliding window and global attention (``layer_types``).
The mixed pattern keeps every layer's blocks for the whole sequence (docs/usage.md).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.layers.activation import GeluAndMul, gelu_approximate
from pagedllm.layers.attention import Attention, split_heads
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.pipeline import stage_layers, stage_module
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.models.llama import FUSED_QKV_GATE_UP, rope_settings


def layer_types(config, default_pattern: int) -> list[str]:
    """Per layer "sliding_attention" or "full_attention": the config's ``layer_types`` (transformers
    5), else the family's pattern (every ``pattern``-th layer global; Gemma 2: 2, Gemma 3: 6)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or default_pattern
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config.num_hidden_layers)]


def gemma_norm(dim: int, config) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, weight_offset=1.0)


class GemmaAttention(nn.Module):
    def __init__(self, config, sliding_window: Optional[int], qk_norm: bool) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=config.attention_bias)
        self.q_norm = gemma_norm(head_dim, config) if qk_norm else None
        self.k_norm = gemma_norm(head_dim, config) if qk_norm else None
        scale = float(config.query_pre_attn_scalar) ** -0.5
        soft_cap = getattr(config, "attn_logit_softcapping", None)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale, sliding_window, soft_cap)

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v))


class GemmaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        self.act = GeluAndMul(gelu_approximate(act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP."""

    def __init__(self, config, sliding_window: Optional[int], qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, sliding_window, qk_norm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = gemma_norm(config.hidden_size, config)
        self.post_attention_layernorm = gemma_norm(config.hidden_size, config)
        self.pre_feedforward_layernorm = gemma_norm(config.hidden_size, config)
        self.post_feedforward_layernorm = gemma_norm(config.hidden_size, config)

    def forward(self, rope, h: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (post-normed MLP output, residual stream before it)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    """Embeddings scaled by sqrt(hidden), the decoder layers, the final norm. ``ropes`` maps a
    layer type to its rotary embedding (Gemma 3 has a local and a global one)."""

    def __init__(self, config, types: list[str], ropes: dict[str, RotaryEmbedding], qk_norm: bool) -> None:
        super().__init__()
        self.normalizer = float(config.hidden_size) ** 0.5
        window = config.sliding_window
        self.types = types
        self.layers, self.start, self.end, self.is_first, self.is_last = stage_layers(
            len(types), lambda i: GemmaDecoderLayer(config, window if types[i] == "sliding_attention" else None, qk_norm))
        self.embed_tokens = stage_module(self.is_first, lambda: VocabParallelEmbedding(config.vocab_size,
                                                                                       config.hidden_size))
        self.norm = stage_module(self.is_last, lambda: gemma_norm(config.hidden_size, config))
        self.ropes = nn.ModuleDict(ropes)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        if self.is_first:
            h = self.embed_tokens(input_ids)
            h, residual = h * torch.tensor(self.normalizer, dtype=h.dtype), None  # rounded to the dtype first, as HF
        else:
            h, residual = intermediate
        cos_sin = {name: rope.cos_sin(positions, h.dtype) for name, rope in self.ropes.items()}
        for t, layer in zip(self.types[self.start : self.end], self.layers[self.start : self.end]):
            h, residual = layer(cos_sin.get(t, cos_sin["full_attention"]), h, residual)
        return self.norm(h, residual)[0] if self.is_last else [h, residual]


class GemmaCausalLM(nn.Module):
    """The LM head (tied to the embeddings unless the checkpoint has its own) with the final
    logit soft-cap; shared by Gemma 2 and Gemma 3."""

    packed_modules_mapping = FUSED_QKV_GATE_UP
    supports_pp = True
    pp_num_intermediate = 2  # hidden states and the residual stream

    def __init__(self, config, model: GemmaModel) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = stage_module(model.is_last, lambda: ParallelLMHead(config.vocab_size, config.hidden_size))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_soft_cap:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start : self.model.end]]


class Gemma2ForCausalLM(GemmaCausalLM):
    """Gemma 2: one rotary embedding for every layer, no q/k norms."""

    def __init__(self, config) -> None:
        theta, scaling = rope_settings(config)
        rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, scaling)
        super().__init__(config, GemmaModel(config, layer_types(config, 2), {"full_attention": rope}, qk_norm=False))
