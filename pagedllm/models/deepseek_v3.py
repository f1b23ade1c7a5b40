"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention (MLA) and, after the first
``first_k_dense_replace`` dense layers, MoE layers with DeepSeek-V3 routing (sigmoid scores,
``e_score_correction_bias``, grouped top-k, ``routed_scaling_factor``) plus shared experts.

MLA: keys and values come from a compressed latent ``c_kv = norm(W_DKV x)`` (kv_lora_rank R)
and one rope key ``k_pe`` shared by all heads (qk_rope_head_dim dr). The paged cache stores only
``[c_kv | k_pe]`` per token (R + dr numbers per layer, against 2 x heads x head_dim for MHA).
The up-projection ``kv_b_proj`` ([H x (dn + dv), R]) is absorbed: each head's no-rope query is
mapped into latent space (q_nope @ W_UK) to score against ``c_kv`` directly, and the attention
output (a latent per head) goes through W_UV afterwards -- K and V are never materialised.

Rope is applied to the rope parts only; with ``rope_interleave`` (the V3 default) their
dimensions are interleaved pairs, de-interleaved before the rotation as HF does. YaRN scaling
adds mscale(factor, mscale_all_dim)^2 to the softmax scale.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.pipeline import stage_layers, stage_module
from pagedllm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.mla import MLAAttention
from pagedllm.layers.moe import RouterConfig, SparseMoE, expert_weight_target
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.models.llama import LlamaDecoderLayer, LlamaMLP, rope_settings
from pagedllm.models.mixtral import check_silu, moe_num_experts
from pagedllm.distributed.parallel_state import get_tp_group


def mla_softmax_scale(config) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_settings(config)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        factor, m_all = float(scaling.get("factor", 1.0)), scaling.get("mscale_all_dim") or 0
        if m_all and factor > 1:
            mscale = 0.1 * float(m_all) * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        tp = get_tp_group().world_size
        H = config.num_attention_heads
        if H % tp:
            raise ValueError(f"num_attention_heads ({H}) must be divisible by tensor_parallel_size ({tp})")
        self.num_heads = H // tp
        self.dn, self.dr, self.dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        q_out = H * (self.dn + self.dr)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [q_out])
        else:
            self.q_proj = ColumnParallelLinear(hidden, [q_out])
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, [H * (self.dn + self.dv)])
        self.kv_b_proj.packable_weight = False  # absorbed: read per head as W_UK / W_UV, never packed
        self.o_proj = RowParallelLinear(H * self.dv, hidden, bias=bias)
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.attn = MLAAttention(self.num_heads, self.rank, self.dr, mla_softmax_scale(config))

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x.contiguous()

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(T, H, self.dn + self.dr)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, :self.rank].contiguous())
        q_pe, k_pe = apply_rotary(rope, self._rope_layout(q_pe), self._rope_layout(kv[:, self.rank:]).view(T, 1, self.dr))
        w = self.kv_b_proj.weight.view(H, self.dn + self.dv, self.rank)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :self.dn]).transpose(0, 1)  # [T, H, R]
        o_latent = self.attn(torch.cat([q_latent, q_pe], dim=-1), torch.cat([c_kv, k_pe.view(T, self.dr)], dim=-1))
        o = torch.bmm(o_latent.transpose(0, 1), w[:, self.dn:].transpose(1, 2))  # [H, T, dv]
        return self.o_proj(o.transpose(0, 1).reshape(T, H * self.dv))


def deepseek_mlp(config, layer: int) -> nn.Module:
    check_silu(config)
    num_experts = moe_num_experts(config)
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    if num_experts == 0 or layer < int(getattr(config, "first_k_dense_replace", 0)) or layer % freq:
        return LlamaMLP(config)
    router = RouterConfig(num_experts, int(config.num_experts_per_tok), "sigmoid",
                          renormalize=bool(getattr(config, "norm_topk_prob", True)),
                          num_groups=int(getattr(config, "n_group", 1) or 1),
                          topk_groups=int(getattr(config, "topk_group", 1) or 1),
                          scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)))
    shared = int(getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
    return SparseMoE(config.hidden_size, config.moe_intermediate_size, router, shared_intermediate=shared,
                     correction_bias=True)


class DeepseekV3Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        # Llama's pre-norm layer around MLA and, after the first dense layers, the MoE MLP
        self.layers, self.start, self.end, self.is_first, self.is_last = stage_layers(
            config.num_hidden_layers,
            lambda i: LlamaDecoderLayer(config, False, False, None, mlp=deepseek_mlp(config, i),
                                        attn=DeepseekV3Attention(config)))
        self.embed_tokens = stage_module(self.is_first, lambda: VocabParallelEmbedding(config.vocab_size,
                                                                                       config.hidden_size))
        self.norm = stage_module(self.is_last, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, theta, scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        h, residual = (self.embed_tokens(input_ids), None) if self.is_first else intermediate
        rope = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers[self.start : self.end]:
            h, residual = layer(rope, h, residual)
        return self.norm(h, residual)[0] if self.is_last else [h, residual]


class DeepseekV3ForCausalLM(nn.Module):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config)
        self.lm_head = stage_module(self.model.is_last, lambda: ParallelLMHead(config.vocab_size, config.hidden_size))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    supports_pp = True
    pp_num_intermediate = 2  # hidden states and the residual stream

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start : self.model.end]]

    def mha_kv_elements_per_token(self) -> int:
        """What the same attention would cache per token as plain MHA (K of qk_head_dim and V of
        v_head_dim for every head, every layer), for the start-up report."""
        c = self.config
        return c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)

    @staticmethod
    def remap_checkpoint_name(name: str) -> Optional[tuple]:
        target = expert_weight_target(name)
        if target is not None or ".mlp.shared_experts." not in name:
            return target
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        for frag, (fused, shard) in DeepseekV3ForCausalLM.packed_modules_mapping.items():
            if f".{frag}." in name:
                return name.replace(f".{frag}.", f".{fused}."), shard
        return name, None

