"""Mixtral (``MixtralForCausalLM``): the Llama/Mistral decoder with a sparse MoE in place of the
MLP -- softmax over ``num_local_experts``, top ``num_experts_per_tok``, always renormalised.

Checkpoints name the MoE ``block_sparse_moe`` with per-expert ``w1`` (gate), ``w3`` (up) and
``w2`` (down) tensors; they are stacked at load into ``mlp.experts.w13_weight`` / ``w2_weight``.
"""
from __future__ import annotations

from typing import Optional

from pagedllm.layers.moe import RouterConfig, SparseMoE, expert_weight_target
from pagedllm.models.llama import LlamaForCausalLM


def moe_num_experts(config) -> int:
    """The routed expert count under any of its config spellings (0 when the config has none)."""
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 0


def check_silu(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config, layer: int) -> SparseMoE:
        check_silu(config)
        router = RouterConfig(moe_num_experts(config), int(config.num_experts_per_tok), "softmax", renormalize=True)
        return SparseMoE(config.hidden_size, config.intermediate_size, router)

    @staticmethod
    def remap_checkpoint_name(name: str) -> Optional[tuple]:
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_weight_target(name, gate="w1", up="w3", down="w2") or (name, None)
