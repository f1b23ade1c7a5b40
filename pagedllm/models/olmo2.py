"""OLMo 2 (``Olmo2ForCausalLM``): norms after, not before, attention and the MLP (each output is
normalised, then added to the residual stream), and q/k RMSNorm over the whole projection (all
heads together, not per head). Under tensor parallelism a rank holds some heads: the squared sum
is all-reduced so every rank normalises by the full projection's mean.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.pipeline import stage_layers, stage_module
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.models.llama import FUSED_QKV_GATE_UP, LlamaMLP, rope_settings


class ProjectionNorm(nn.Module):
    """RMSNorm over a projection of ``full`` features of which this rank holds ``heads`` rows
    (consecutive, from ``first_head``); weight multiplied in float32 (OLMo 2's numerics)."""

    def __init__(self, full: int, heads: int, head_dim: int, first_head: int, eps: float) -> None:
        super().__init__()
        self.full, self.eps, self.start = full, eps, first_head * head_dim
        self.tp = get_tp_group()
        self.weight = nn.Parameter(torch.ones(heads * head_dim), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = xf.pow(2).sum(-1, keepdim=True)
        if self.tp.world_size > 1:
            sq = self.tp.all_reduce(sq)
        return (self.weight.float() * (xf * torch.rsqrt(sq / self.full + self.eps))).to(x.dtype)


class Olmo2Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = head_dim = getattr(config, "head_dim", None) or hidden // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        if self.qkv_proj.kv_replicas > 1:
            raise ValueError("OLMo 2 needs num_key_value_heads >= tensor_parallel_size (k norm over the projection)")
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rank = get_tp_group().rank
        self.q_norm = ProjectionNorm(heads * head_dim, self.num_heads, head_dim, rank * self.num_heads, config.rms_norm_eps)
        self.k_norm = ProjectionNorm(kv_heads * head_dim, self.num_kv_heads, head_dim, rank * self.num_kv_heads,
                                     config.rms_norm_eps)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5,
                              getattr(config, "sliding_window", None))

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).reshape(T, self.num_heads, self.head_dim)
        k = self.k_norm(k).reshape(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(T, self.num_kv_heads, self.head_dim)))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, h: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(rope, h))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Olmo2Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers, self.start, self.end, self.is_first, self.is_last = stage_layers(
            config.num_hidden_layers, lambda i: Olmo2DecoderLayer(config))
        self.embed_tokens = stage_module(self.is_first, lambda: VocabParallelEmbedding(config.vocab_size,
                                                                                       config.hidden_size))
        self.norm = stage_module(self.is_last, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        h = self.embed_tokens(input_ids) if self.is_first else intermediate[0]
        rope = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers[self.start : self.end]:
            h = layer(rope, h)
        return self.norm(h) if self.is_last else [h]


class Olmo2ForCausalLM(nn.Module):
    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Olmo2Model(config)
        self.lm_head = stage_module(self.model.is_last, lambda: ParallelLMHead(config.vocab_size, config.hidden_size))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    supports_pp = True
    pp_num_intermediate = 1  # the hidden states (no separate residual stream)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start : self.model.end]]
