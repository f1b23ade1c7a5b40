"""Gemma 3 text (``Gemma3ForCausalLM``): Gemma 2's decoder layer (gemma2.py) with per-head q/k
RMSNorm (1 + w), no soft-capping by default, and two rotary embeddings: sliding-window layers
use the local base (``rope_local_base_freq``, 10k) without scaling, global layers the global base
with the config's scaling (e.g. linear x8). Every ``sliding_window_pattern``-th layer is global
(``layer_types`` in transformers 5). The mixed pattern keeps every layer's blocks (docs/usage.md).
"""
from __future__ import annotations

from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.gemma2 import GemmaCausalLM, GemmaModel, layer_types


def _rope_parameters(config) -> dict[str, tuple[float, dict | None]]:
    """{layer type: (base, scaling)} from transformers 5's per-type ``rope_parameters`` or the
    older ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params or "sliding_attention" in params:
        out = {}
        for kind, default_theta in (("full_attention", 1_000_000.0), ("sliding_attention", 10_000.0)):
            p = dict(params.get(kind) or {})
            theta = float(p.get("rope_theta", default_theta))
            out[kind] = (theta, p if p.get("rope_type", "default") != "default" else None)
        return out
    theta = float(getattr(config, "rope_theta", 1_000_000.0))
    local = float(getattr(config, "rope_local_base_freq", 10_000.0))
    return {"full_attention": (theta, getattr(config, "rope_scaling", None)), "sliding_attention": (local, None)}


class Gemma3ForCausalLM(GemmaCausalLM):
    def __init__(self, config) -> None:
        ropes = {kind: RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta, scaling)
                 for kind, (theta, scaling) in _rope_parameters(config).items()}
        super().__init__(config, GemmaModel(config, layer_types(config, 6), ropes, qk_norm=True))
