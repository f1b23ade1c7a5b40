"""The parts the GPT-style dense families share (GPT-NeoX, Falcon, Phi, StableLM, Starcoder2,
GPTBigCode, Granite, Cohere): an attention block with optional partial rotary, ALiBi and per-head
q/k norms; the plain (non-gated) MLP; and ``DecoderLM``, the frame of embeddings, a family's
layers, the final norm and the LM head (optionally biased, scaled).

A family's layer is ``layer(rope, h) -> h`` (its own residual wiring: sequential or parallel
attention + MLP); the residual stream is added in plain torch, not fused into the norms.
Checkpoint tensors keep their family's names until the family's ``checkpoint_tensors`` renames
them onto these modules: ``model.embed_tokens``, ``model.layers.<i>.…``, ``model.norm``, ``lm_head``.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.activation import gelu_approximate
from pagedllm.layers.attention import Attention, split_heads
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary import RotaryEmbedding, apply_partial_rotary
from pagedllm.models.checkpoint_views import split_fused_qkv
from pagedllm.models.llama import rope_settings
from pagedllm.models.pipeline import PPMissingLayer, stage_layers, stage_module

QKV_SHARDS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.): a geometric sequence from 2^(-8/n) for the largest
    power of two n <= num_heads, the remaining heads taking every other slope of the 2n sequence."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(min(closest, num_heads - closest))]
    return torch.tensor(slopes, dtype=torch.float32)


class DenseAttention(nn.Module):
    """Fused q/k/v projection, optional q/k norms (``make_norm(heads, first_head)`` -> a module on
    [T, heads, head_dim]), rotary over ``rope``'s width (all or the first dims of each head; None:
    no rotary), paged attention, output projection."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, qkv_bias: bool,
                 o_bias: bool, scale: Optional[float] = None, sliding_window: Optional[int] = None,
                 alibi: Optional[torch.Tensor] = None, make_norm: Optional[Callable] = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        rank = get_tp_group().rank
        self.q_norm = make_norm(self.num_heads, rank * self.num_heads) if make_norm else None
        kv_first = (rank // self.qkv_proj.kv_replicas) * self.num_kv_heads
        self.k_norm = make_norm(self.num_kv_heads, kv_first) if make_norm else None
        if alibi is not None:  # this rank's heads' slopes
            alibi = alibi[rank * self.num_heads : (rank + 1) * self.num_heads]
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5 if scale is None else scale,
                              sliding_window, alibi_slopes=alibi)

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_partial_rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v))


class DenseMLP(nn.Module):
    """fc -> GELU (exact or tanh, from the HF activation name) -> proj, both biased by default."""

    def __init__(self, hidden: int, inner: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(hidden, [inner], bias=bias)
        self.proj = RowParallelLinear(inner, hidden, bias=bias)
        self.approximate = gelu_approximate(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class DecoderModel(nn.Module):
    """Pipeline parallel (models/pipeline.py): a stage builds only its own layers; the embedding
    (with GPTBigCode's learned positions and Granite's multiplier) lives on the first stage, the
    final norm on the last; one tensor, the residual stream, goes from stage to stage."""

    def __init__(self, vocab: int, hidden: int, num_layers: int, make_layer: Callable, norm: nn.Module,
                 rotary: Optional[nn.Module], max_positions: int = 0, embedding_multiplier: float = 1.0) -> None:
        super().__init__()
        self.hidden_size = hidden
        self.layers, self.start, self.end, self.is_first, self.is_last = stage_layers(num_layers, make_layer)
        self.embed_tokens = stage_module(self.is_first, lambda: VocabParallelEmbedding(vocab, hidden))
        # learned absolute positions (GPTBigCode), replicated on every rank of the first stage
        self.wpe = (nn.Parameter(torch.zeros(max_positions, hidden), requires_grad=False)
                    if max_positions and self.is_first else None)
        self.norm = norm if self.is_last else PPMissingLayer()
        self.rotary = rotary
        self.embedding_multiplier = embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        """The final hidden states; before the last stage, [the residual stream] for the next."""
        if self.is_first:
            h = self.embed_tokens(input_ids)
            if self.wpe is not None:
                h = h + F.embedding(positions, self.wpe)
            if self.embedding_multiplier != 1.0:
                h = h * self.embedding_multiplier
        else:
            h = intermediate[0]
        rope = self.rotary.cos_sin(positions, h.dtype) if self.rotary is not None else None
        for layer in self.layers[self.start : self.end]:
            h = layer(rope, h)
        return self.norm(h) if self.is_last else [h]


class DecoderLM(nn.Module):
    """The model interface the worker uses (forward, compute_logits, attention_layers) over a
    ``DecoderModel``; the LM head tied to the embeddings unless the checkpoint has its own, with
    an optional bias (Phi) and a factor on the logits (Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``)."""

    packed_modules_mapping = QKV_SHARDS
    supports_pp = True  # DecoderModel's stages
    pp_num_intermediate = 1  # the residual stream

    def __init__(self, config, model: DecoderModel, *, tie: bool, lm_head_bias: bool = False,
                 logit_factor: float = 1.0) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.pp_hidden_size = model.hidden_size
        self.lm_head = stage_module(model.is_last, lambda: ParallelLMHead(config.vocab_size, model.hidden_size))
        self.lm_head_bias = (nn.Parameter(torch.zeros(config.vocab_size), requires_grad=False)
                             if lm_head_bias and model.is_last else None)
        # names other stages own that are parameters, not modules (the loader skips them here)
        self.pp_missing_names = (() if model.is_first else ("model.wpe",)) + (
            () if model.is_last or not lm_head_bias else ("lm_head_bias",))
        self.tie_word_embeddings = tie
        self.logit_factor = float(logit_factor)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias
        if self.logit_factor != 1.0:
            logits = logits * self.logit_factor
        return logits

    def attention_layers(self) -> list[Attention]:
        """This stage's layers (all of them without pipeline parallelism)."""
        return [layer.self_attn.attn for layer in self.model.layers[self.model.start : self.model.end]]


def rotary_for(config, head_dim: int) -> RotaryEmbedding:
    """The rotary embedding over the first ``partial_rotary_factor`` (``rotary_pct``) of each head's
    dims, base and scaling from either config spelling."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))
    theta, scaling = rope_settings(config)
    return RotaryEmbedding(int(head_dim * float(factor or 1.0)), config.max_position_embeddings, theta, scaling)


def renamed(weights: Iterator, renames: list[tuple[str, str]], skip: tuple[str, ...] = ()) -> Iterator:
    """Checkpoint (name, tensor) pairs with each ``(old, new)`` fragment replaced in order;
    names ending in one of ``skip`` (old checkpoints' causal-mask buffers) dropped."""
    for name, src in weights:
        if name.endswith(skip):
            continue
        for old, new in renames:
            name = name.replace(old, new)
        yield name, src


def split_qkv(weights: Iterator, fused: str, layout: str, heads: int, kv_heads: int, head_dim: int) -> Iterator:
    """A fused ``.<fused>.`` projection (weight and bias) split into q_proj / k_proj / v_proj views."""
    for name, src in weights:
        if f".{fused}." in name:
            for part, view in zip(("q_proj", "k_proj", "v_proj"), split_fused_qkv(src, layout, heads, kv_heads, head_dim)):
                yield name.replace(f".{fused}.", f".{part}."), view
        else:
            yield name, src
