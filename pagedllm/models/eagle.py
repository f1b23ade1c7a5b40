"""EAGLE-1 draft head for Llama-family targets (Li et al., 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty"), over our own layers and attention backends.

The head predicts the target's next *feature* (its last hidden state, after the final norm:
the tensor the target's LM head multiplies) from the current feature and the embedding of the
token that feature produced:

    x_i   = fc(concat(embed(t_{i+1}), f_i))          # fc: Linear(2H -> H), bias optional
    f'_i  = decoder layers(x_i, position i)           # Llama layers; the first has no input norm
    logits for t_{i+2} = target LM head(f'_i)         # no final norm: f' imitates a normed feature

Checkpoint layout (what EAGLE-1 releases such as yuhuili/EAGLE-llama2-chat-7B ship and vLLM
loads as an EAGLE Llama draft): a Llama ``config.json`` (usually ``num_hidden_layers`` 1) and
``model.safetensors`` / ``*.safetensors`` / ``pytorch_model.bin`` with tensors

    fc.weight [H, 2H], fc.bias [H] (optional), embed_tokens.weight [V, H] (optional: the
    target's embedding is shared when absent), layers.N.self_attn.{q,k,v,o}_proj.weight,
    layers.N.mlp.{gate,up,down}_proj.weight, layers.N.post_attention_layernorm.weight,
    layers.N.input_layernorm.weight (layers N >= 1 only)

optionally under a ``model.`` prefix; ``lm_head.*`` and a final ``norm.*`` are ignored (the
target's LM head is always used, and EAGLE-1 has no final norm).
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import torch
from torch import nn

from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, default_weight_loader
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.llama import FUSED_QKV_GATE_UP, LlamaDecoderLayer, rope_settings


def eagle_checkpoint_tensors(path: str) -> Iterator[tuple[str, object]]:
    """(name, tensor or safetensors slice source) of an EAGLE checkpoint directory: safetensors
    when present, else ``pytorch_model.bin`` (read with ``weights_only``)."""
    if any(f.endswith(".safetensors") for f in os.listdir(path)):
        from pagedllm.models.loader import iterate_weights

        yield from iterate_weights(path)
        return
    bins = sorted(f for f in os.listdir(path) if f.startswith("pytorch_model") and f.endswith(".bin"))
    if not bins:
        raise FileNotFoundError(f"speculative_config.model {path!r}: no *.safetensors or pytorch_model*.bin weights")
    for name in bins:
        state = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


def _head_name(name: str) -> Optional[str]:
    """A checkpoint name -> the head's own name (None: not a head tensor we load)."""
    name = name.removeprefix("model.")
    if name.startswith(("lm_head.", "norm.")) or "rotary_emb.inv_freq" in name:
        return None
    return name


def eagle_checkpoint_names(path: str) -> set[str]:
    return {n for n in (_head_name(name) for name, _ in eagle_checkpoint_tensors(path)) if n is not None}


class EagleHead(nn.Module):
    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config, has_embedding: bool, fc_bias: bool) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden) if has_embedding else None
        self.fc = ColumnParallelLinear(2 * hidden, [hidden], bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, bool(getattr(config, "attention_bias", False)), False,
                                                       None) for _ in range(config.num_hidden_layers)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: the fc output enters un-normed
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Predicted next features [T, H] from token embeddings and target features [T, H]."""
        h = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        rope = self.rotary.cos_sin(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(rope, h, residual)
        return h + residual

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    def load(self, path: str) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in eagle_checkpoint_tensors(path):
            own = _head_name(name)
            if own is None:
                continue
            target, shard = own, None
            for frag, (fused, sid) in self.packed_modules_mapping.items():
                if f".{frag}." in own:
                    target, shard = own.replace(f".{frag}.", f".{fused}."), sid
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"EAGLE checkpoint {path!r}: tensor {name!r} has no place in the head (an EAGLE-1 "
                                 "head has fc, layers.N.* and optionally embed_tokens)")
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard) if shard is not None else loader(param, tensor)
            loaded.add(target)
        missing = sorted(n for n in params if n not in loaded)
        if missing:
            raise ValueError(f"EAGLE checkpoint {path!r} is missing weights: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
