"""GPT-2 (``GPT2LMHeadModel``): learned absolute position embeddings (no rotary), LayerNorm with
bias before attention and the MLP, biased projections, GELU (``gelu_new``: tanh-approximate), the
LM head tied to the token embeddings.

The checkpoint stores its projections as Conv1D weights ([in, out]) and q/k/v fused in one
``c_attn``: on load they are transposed and split (lazy views, models/checkpoint_views.py) into
our layers' names, so tensor parallelism shards them like any other model's.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import gelu_approximate
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import LayerNorm
from pagedllm.models.checkpoint_views import TransposedView, split_rows
from pagedllm.models.pipeline import stage_layers, stage_module

# checkpoint name (after "transformer." and "h.N." became "model." and "layers.N.") -> ours
_RENAMES = {"attn.c_proj.": "attn.o_proj.", "mlp.c_fc.": "mlp.fc.", "mlp.c_proj.": "mlp.proj.",
            "wte.": "embed_tokens."}


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config.n_embd, config.n_head
        self.head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads
        self.size = self.num_heads * self.head_dim
        self.o_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.size] * 3, dim=-1)
        return self.o_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inner = getattr(config, "n_inner", None) or 4 * config.n_embd
        self.fc = ColumnParallelLinear(config.n_embd, [inner], bias=True)
        self.proj = RowParallelLinear(inner, config.n_embd, bias=True)
        self.approximate = gelu_approximate(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.n_embd, eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, eps)
        self.mlp = GPT2MLP(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers, self.start, self.end, self.is_first, self.is_last = stage_layers(
            config.n_layer, lambda i: GPT2Block(config, i))
        self.embed_tokens = stage_module(self.is_first, lambda: VocabParallelEmbedding(config.vocab_size, config.n_embd))
        # the learned positions belong with the embedding (the loader skips them on the other stages)
        self.wpe = nn.Parameter(torch.zeros(config.n_positions, config.n_embd), requires_grad=False) if self.is_first else None
        self.ln_f = stage_module(self.is_last, lambda: LayerNorm(config.n_embd, config.layer_norm_epsilon))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        h = self.embed_tokens(input_ids) + F.embedding(positions, self.wpe) if self.is_first else intermediate[0]
        for layer in self.layers[self.start : self.end]:
            h = layer(h)
        return self.ln_f(h) if self.is_last else [h]


class GPT2LMHeadModel(nn.Module):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = GPT2Model(config)
        self.lm_head = stage_module(self.model.is_last, lambda: ParallelLMHead(config.vocab_size, config.n_embd))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.hidden = config.n_embd

    supports_pp = True
    pp_num_intermediate = 1  # the residual stream itself
    pp_hidden_size = property(lambda self: self.hidden)
    pp_missing_names = property(lambda self: () if self.model.is_first else ("model.wpe",))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.attn.attn for layer in self.model.layers[self.model.start : self.model.end]]

    def checkpoint_tensors(self, weights: Iterator) -> Iterator:
        """HF names -> ours; Conv1D weights transposed, c_attn split into q/k/v."""
        for name, src in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of old checkpoints
                continue
            name = re.sub(r"^(transformer\.)?", "model.", name, count=1) if not name.startswith("lm_head.") else name
            name = re.sub(r"\.h\.(\d+)\.", r".layers.\1.", name)
            for old, new in _RENAMES.items():
                name = name.replace(old, new)
            if name.endswith("wpe.weight"):
                yield "model.wpe", src
                continue
            conv = name.endswith(".weight") and (".attn." in name or ".mlp." in name)
            if conv:
                src = TransposedView(src)
            if ".attn.c_attn." in name:
                for part, view in zip(("q_proj", "k_proj", "v_proj"), split_rows(src, [self.hidden] * 3)):
                    yield name.replace(".c_attn.", f".{part}."), view
            else:
                yield name, src
