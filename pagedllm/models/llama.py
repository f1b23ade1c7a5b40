"""The Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Written over our own layers; checkpoints use HF parameter names, mapped onto fused q/k/v and
gate/up weights by ``packed_modules_mapping``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.attention.forward_context import get_attention_metadata
from pagedllm.models import decode_stack
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention, split_heads
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from pagedllm.models.pipeline import stage_layers, stage_module


def rope_settings(config) -> tuple[float, Optional[dict]]:
    """(base, scaling dict) from either spelling: transformers 5 ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or (params if params.get("rope_type", "default") != "default" else None)
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or (scaling or {}).get("rope_theta") or 10000.0
    return float(theta), scaling


# checkpoint name fragment -> (our fused module fragment, shard id): q/k/v into qkv_proj, gate/up
# into gate_up_proj (the layout of every family built on these layers)
FUSED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, sliding_window: Optional[int]) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=getattr(config, "attention_bias", False) and not qkv_bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, sliding_window)

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias=getattr(config, "mlp_bias", False))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=getattr(config, "mlp_bias", False))
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, sliding_window: Optional[int],
                 mlp: Optional[nn.Module] = None, attn: Optional[nn.Module] = None) -> None:
        super().__init__()
        # a family's own attention (e.g. DeepSeek's MLA) or MLP (e.g. MoE) in the same pre-norm layer
        self.self_attn = attn if attn is not None else LlamaAttention(config, qkv_bias, qk_norm, sliding_window)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, h: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (mlp output, residual stream before it); the caller adds them."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(rope, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool = False, qk_norm: bool = False, make_mlp=None) -> None:
        """``make_mlp(config, layer_index)``: a family's MLP for a layer (None: LlamaMLP)."""
        super().__init__()
        sliding_window = self._sliding_window(config)
        # pipeline parallel: this stage's layers only (placeholders elsewhere)
        self.layers, self.start, self.end, self.is_first, self.is_last = stage_layers(
            config.num_hidden_layers,
            lambda i: LlamaDecoderLayer(config, qkv_bias, qk_norm, sliding_window, make_mlp(config, i) if make_mlp else None))
        self.embed_tokens = stage_module(self.is_first, lambda: VocabParallelEmbedding(config.vocab_size,
                                                                                       config.hidden_size))
        self.norm = stage_module(self.is_last, lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)

    @staticmethod
    def _sliding_window(config) -> Optional[int]:
        if getattr(config, "use_sliding_window", True) is False:
            return None
        if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
            raise ValueError("per-layer sliding windows (layer_types) are not supported yet")
        return getattr(config, "sliding_window", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None,
                inputs_embeds: Optional[torch.Tensor] = None):
        """Hidden states after the final norm; on a pipeline stage before the last, the
        (hidden, residual) tensors for the next stage. ``intermediate``: the previous stage's;
        ``inputs_embeds``: the first stage's input instead of embedding ``input_ids`` (LLaVA's, with
        image features at the placeholder positions)."""
        if self.is_first and self.is_last and inputs_embeds is None:  # a decode-only step: all of it natively
            out = decode_stack.decode_step(self, input_ids, positions, get_attention_metadata(), _NATIVE_KINDS)
            if out is not None:
                return out
        if self.is_first:
            h, residual = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds, None
        else:
            h, residual = intermediate
        rope = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers[self.start : self.end]:
            h, residual = layer(rope, h, residual)
        if not self.is_last:
            return [h, residual]
        return self.norm(h, residual)[0]


# what a native decode step (models/decode_stack.py) runs exactly: these classes, not subclasses
_NATIVE_KINDS = (LlamaDecoderLayer, LlamaAttention, LlamaMLP)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    packed_modules_mapping = FUSED_QKV_GATE_UP
    make_mlp = None  # MoE families: (config, layer index) -> that layer's MLP module
    supports_pp = True  # pipeline parallel stages (models/pipeline.py)
    pp_num_intermediate = 2  # tensors a stage sends the next: hidden states and the residual stream

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias, self.qk_norm, self.make_mlp)
        self.lm_head = stage_module(self.model.is_last, lambda: ParallelLMHead(config.vocab_size, config.hidden_size))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = decode_stack.logits(self.model, self.lm_head, hidden)  # the native stack's, once it is built
        return self.lm_head(hidden) if logits is None else logits

    def attention_layers(self) -> list[Attention]:
        """This stage's layers (all of them without pipeline parallelism)."""
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start : self.model.end]]


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, config) -> None:
        # Qwen3 puts attention_bias on q/k/v and o together; usually False.
        self.qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config)
