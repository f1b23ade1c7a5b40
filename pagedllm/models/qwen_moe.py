"""Qwen MoE: ``Qwen2MoeForCausalLM`` (qkv bias; routed experts plus a shared expert scaled by
sigmoid(shared_expert_gate(x))) and ``Qwen3MoeForCausalLM`` (per-head q/k RMSNorm; routed
experts only). Softmax routing, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob``. Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step``
stride, keep a dense MLP of ``intermediate_size``; experts use ``moe_intermediate_size``.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from pagedllm.layers.moe import RouterConfig, SparseMoE, expert_weight_target
from pagedllm.models.llama import LlamaForCausalLM, LlamaMLP
from pagedllm.models.mixtral import check_silu, moe_num_experts


def qwen_moe_mlp(config, layer: int, shared: bool) -> nn.Module:
    check_silu(config)
    num_experts = moe_num_experts(config)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    if layer in (getattr(config, "mlp_only_layers", None) or []) or num_experts == 0 or (layer + 1) % step:
        return LlamaMLP(config)
    router = RouterConfig(num_experts, int(config.num_experts_per_tok), "softmax",
                          renormalize=bool(getattr(config, "norm_topk_prob", False)))
    shared_size = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if shared else 0
    return SparseMoE(config.hidden_size, config.moe_intermediate_size, router, shared_intermediate=shared_size,
                     shared_gate=shared_size > 0)


def _remap(name: str) -> Optional[tuple]:
    return expert_weight_target(name)  # the shared expert and dense MLPs use the generic gate/up fusion


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))
        super().__init__(config)

    def make_mlp(self, config, layer: int) -> nn.Module:
        return qwen_moe_mlp(config, layer, shared=True)

    remap_checkpoint_name = staticmethod(_remap)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, config) -> None:
        self.qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config)

    def make_mlp(self, config, layer: int) -> nn.Module:
        return qwen_moe_mlp(config, layer, shared=False)

    remap_checkpoint_name = staticmethod(_remap)
