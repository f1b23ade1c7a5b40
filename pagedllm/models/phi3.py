"""Phi-3 (``Phi3ForCausalLM``): the Llama decoder with fused checkpoint tensors and LongRoPE.

The checkpoint's ``qkv_proj`` ([q | k | v] rows) and ``gate_up_proj`` ([gate | up] rows) are split
on load into the q/k/v and gate/up shards our fused layers take, as lazy views
(models/checkpoint_views.py), so under tensor parallelism each rank still reads only its own rows
of each part. LongRoPE / su scaling (short and long factor sets) is the shared rotary layer's
``longrope`` type: positions below ``original_max_position_embeddings`` use the short factors,
later ones the long factors (HF picks one set per forward call from the longest sequence: the
two agree while a sequence stays below that length). A sliding window applies to every layer.
"""
from __future__ import annotations

from typing import Iterator

from pagedllm.models.checkpoint_views import split_rows
from pagedllm.models.llama import LlamaForCausalLM, rope_settings


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        if float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise ValueError("Phi-3 with partial_rotary_factor < 1 (Phi-4-mini) is not supported yet")
        _, scaling = rope_settings(config)
        if scaling and "original_max_position_embeddings" not in scaling:  # transformers 4 keeps it top-level
            scaling["original_max_position_embeddings"] = config.original_max_position_embeddings
        super().__init__(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self._qkv_sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self._gate_up_sizes = [config.intermediate_size, config.intermediate_size]

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        """Fused checkpoint tensors split into the names the packed mapping routes."""
        for name, src in weights:
            if ".qkv_proj." in name:
                for part, view in zip(("q_proj", "k_proj", "v_proj"), split_rows(src, self._qkv_sizes)):
                    yield name.replace(".qkv_proj.", f".{part}."), view
            elif ".gate_up_proj." in name:
                for part, view in zip(("gate_proj", "up_proj"), split_rows(src, self._gate_up_sizes)):
                    yield name.replace(".gate_up_proj.", f".{part}."), view
            else:
                yield name, src
