"""The steady decode step of a Llama-shaped model in one native call (kernels/csrc/decode_stack.cpp).

A step whose every request decodes one token runs the token embedding, all decoder layers --
norms, fused q/k/v, rotary (its rows gathered from the model's cos/sin tables by position), KV
write, paged attention, o projection, gated MLP, residuals -- and the final norm inside C++, on
the same kernels and in the same order the Python layers use, so its hidden states are the Python
path's bit for bit; the LM head is one more native call (:func:`logits`, for every step's logits
once the stack is built), sampling stays in Python. An embedding table in a form the stack does not
look up (a wrapped or tensor-parallel embedding) is looked up in Python and its rows passed in.
Prompt chunks, mixed steps and everything a native loop cannot see (LoRA
wrappers, hooks, tensor or pipeline parallel ranks, an 8-bit KV cache, q/k norms, biases, soft
caps, sliding windows, weights the kernels do not multiply) keep the Python layers: the stack is
built only where every layer is one it runs exactly.

``EngineConfig.native_decode`` (``--no-native-decode``, ``PAGEDLLM_NATIVE_DECODE=0``) False keeps the
Python layers always: the worker calls :func:`configure` once the model is ready.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

PACKED_FLOAT, QUANT_PANELS, GGUF_BLOCKS, DENSE = 0, 1, 2, 3


class Unsupported(Exception):
    """Why a model's decode step stays in the Python layers."""


def configure(model, enabled: bool) -> None:
    """The worker's switch, once the model is ready: a LlamaModel whose decode step must stay in
    the Python layers is marked so (its stack is then never built)."""
    inner = getattr(model, "model", None)
    if not enabled and inner is not None and hasattr(inner, "layers"):
        inner.__dict__["_decode_stack"] = None


def _plain(module, cls) -> None:
    if type(module) is not cls or "forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks:
        raise Unsupported(f"{type(module).__name__} is wrapped or hooked")


def _segments(module, kernels) -> list:
    """(kind, row offset, rows, a, b, c, p0, p1) per row segment of a linear layer's weight."""
    from pagedllm.quantization.gguf import GGUFWeight
    from pagedllm.quantization.packed_qweight import PackedQuantizedWeight

    if getattr(module, "bias", None) is not None:
        raise Unsupported("a linear layer with a bias")
    qm = module.quant_method
    if qm is None:
        return _float_segments(module.weight, kernels)
    qw = getattr(module, "quantized", None)
    if isinstance(qw, GGUFWeight):
        return _gguf_segments(qw, kernels)
    from pagedllm.quantization.base import QuantMethod

    # the base method's product (qgemm.quantized_linear) without static input quantization
    if isinstance(qw, PackedQuantizedWeight) and type(qm).apply is QuantMethod.apply and getattr(
            module, "static_input", None) is None:
        return [_panel_spec(qw, 0, qw.out_features, kernels)]
    raise Unsupported(f"weights of {type(qm).__name__}")


def _float_segments(w, kernels) -> list:
    """A float weight as cpu_gemm.linear multiplies it: packed panels or a plain dense tensor."""
    if hasattr(w, "panel_out_features"):
        if w.panel_kernels is not kernels:
            raise Unsupported("weights packed by another kernels build")
        return [(PACKED_FLOAT, 0, int(w.panel_out_features), w, None, None, 0, 0)]
    if w.is_mkldnn or w.device.type != "cpu":
        raise Unsupported("a oneDNN-packed or non-CPU weight")
    return [(DENSE, 0, int(w.shape[0]), w, None, None, 0, 0)]


def _gguf_segments(qw, kernels) -> list:
    out = []
    for s in qw.segments:
        if s.panels is not None:
            out.append(_panel_spec(s.panels, s.row_offset, s.rows, kernels))
        else:
            out.append((GGUF_BLOCKS, s.row_offset, s.rows, s.data, None, None, s.qtype, 0))
    return out


def _embedding_spec(embed) -> Optional[tuple]:
    """(segment spec, dtype of its rows) of the token embedding as VocabParallelEmbedding looks it
    up on one rank, or None where the stack takes its rows from Python instead."""
    from pagedllm.layers.embedding import VocabParallelEmbedding

    try:
        _plain(embed, VocabParallelEmbedding)
    except Unsupported:
        return None
    if embed.tp.world_size != 1:
        return None
    gw = embed.packed
    if gw is None:
        w = embed.weight
        if type(w) is not torch.nn.Parameter or w.is_mkldnn or w.dim() != 2 or not w.is_contiguous():
            return None
        return (DENSE, 0, int(w.shape[0]), w, None, None, 0, 0), w.dtype
    seg = gw.segments[0]  # dequantize_rows: the first segment's rows
    pw = seg.panels
    if pw is None:
        return (GGUF_BLOCKS, 0, int(seg.rows), seg.data, None, None, seg.qtype, 0), embed.packed_dtype
    if pw.kind not in ("int8", "int4") or pw.int8_activations or pw.input_perm is not None:
        return None
    return (QUANT_PANELS, 0, int(seg.rows), pw.packed, pw.scales, pw.zeros, pw.kind_code, pw.group_size), \
        embed.packed_dtype


def _head_segments(head, kernels) -> list:
    """The LM head's weight as ParallelLMHead.forward multiplies it on one rank."""
    from pagedllm.layers.embedding import ParallelLMHead

    _plain(head, ParallelLMHead)
    if head.tp.world_size != 1:
        raise Unsupported("a tensor-parallel LM head")
    if head.packed is not None:
        return _gguf_segments(head.packed, kernels)
    return _float_segments(head.weight, kernels)


def _panel_spec(pw, row_offset: int, rows: int, kernels) -> tuple:
    if pw.kernels is not kernels or pw.act_quant is not None or pw.input_perm is not None or pw.int8_activations:
        raise Unsupported("quantized panels with activation quantization or act-order")
    return (QUANT_PANELS, row_offset, rows, pw.packed, pw.scales, pw.zeros, pw.kind_code, pw.group_size)


class Native:
    """A LlamaModel's built stack: the DecodeStack, the KV cache tensor it was built over (a new
    one means a rebuild), the dtype of its rows, and whether it multiplies the LM head (None: not
    tried yet; the head belongs to the model around the LlamaModel, so :func:`logits` sets it)."""

    __slots__ = ("stack", "kv_cache", "dtype", "head")

    def __init__(self, stack, kv_cache: torch.Tensor, dtype: torch.dtype) -> None:
        self.stack, self.kv_cache, self.dtype, self.head = stack, kv_cache, dtype, None


def build(inner, kinds: tuple) -> Optional[Native]:
    """The LlamaModel's built stack, or None (logged once) where its decode step stays in Python.
    ``kinds``: the model's (decoder layer, attention, MLP) classes."""
    kernels = cpu_kernels.ready()
    if kernels is None or not hasattr(kernels, "DecodeStack"):
        return None
    try:
        return _build(inner, kernels, kinds)
    except Unsupported as e:
        logger.info("native decode step: off (%s)", e)
        return None


def _build(inner, kernels, kinds: tuple) -> Native:
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    LlamaDecoderLayer, LlamaAttention, LlamaMLP = kinds
    if not (inner.is_first and inner.is_last):
        raise Unsupported("a pipeline stage")
    if type(inner.norm) is not RMSNorm:
        raise Unsupported("a final norm other than RMSNorm")
    _plain(inner.rotary, RotaryEmbedding)
    embedding = _embedding_spec(inner.embed_tokens)
    layers = inner.layers[inner.start:inner.end]
    stack = None
    for layer in layers:
        _plain(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        _plain(attn, LlamaAttention)
        _plain(mlp, LlamaMLP)
        if type(mlp.act) is not SiluAndMul:
            raise Unsupported("an activation other than SiLU-and-mul")
        if attn.q_norm is not None:
            raise Unsupported("q/k norms")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            _plain(norm, RMSNorm)
            if norm.eps != inner.norm.eps:
                raise Unsupported("norms with different eps")
        a = attn.attn
        if a.kv_cache is None or a.kv_cache.device.type != "cpu" or a.kv_scales is not None:
            raise Unsupported("an 8-bit or unbound KV cache")
        if a.sliding_window or a.logits_soft_cap or a.alibi_slopes is not None or a.head_dim % 8:
            raise Unsupported("a sliding window, soft cap, ALiBi or head size not a multiple of 8")
        if inner.rotary.head_dim != a.head_dim:
            raise Unsupported("rotary over part of each head")
        for m, cls in ((attn.qkv_proj, QKVParallelLinear), (attn.o_proj, RowParallelLinear),
                       (mlp.gate_up_proj, ColumnParallelLinear), (mlp.down_proj, RowParallelLinear)):
            _plain(m, cls)  # LoRA's wrappers, hooks: the Python layers
        if attn.qkv_proj.tp_size != 1 or mlp.down_proj.tp.world_size != 1:
            raise Unsupported("tensor parallel ranks")
        if stack is None:
            stack = kernels.DecodeStack(a.num_heads, a.num_kv_heads, a.head_dim, float(a.scale), 0,
                                        float(inner.norm.eps), inner.norm.weight)
        gate_up = _segments(mlp.gate_up_proj, kernels)
        intermediate = sum(s[2] for s in gate_up) // 2
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        _segments(attn.qkv_proj, kernels), None, _segments(attn.o_proj, kernels), gate_up,
                        _segments(mlp.down_proj, kernels), intermediate, a.kv_cache[0], a.kv_cache[1])
    # the rows' dtype: the embedding's (as in the Python forward, the rotary tables follow it)
    dtype = embedding[1] if embedding is not None else layers[0].input_layernorm.weight.dtype
    if embedding is not None:
        stack.set_embedding(embedding[0], int(layers[0].input_layernorm.weight.numel()), dtype)
    stack.set_rotary(*inner.rotary._tables(dtype))
    logger.info("native decode step: on (%d layers, %d heads / %d kv heads, embedding %s)", stack.num_layers,
                layers[0].self_attn.attn.num_heads, layers[0].self_attn.attn.num_kv_heads,
                "native" if embedding is not None else "in Python")
    return Native(stack, layers[0].self_attn.attn.kv_cache, dtype)


def _set_head(state: Native, head) -> bool:
    try:
        segments = _head_segments(head, cpu_kernels.ready())
    except Unsupported as e:
        logger.info("native LM head: off (%s)", e)
        return False
    state.stack.set_head(segments, int(head.per_rank), int(head.vocab_size))
    return True


def decode_step(inner, input_ids: torch.Tensor, positions: torch.Tensor, md, kinds: tuple) -> Optional[torch.Tensor]:
    """The final-normed hidden states of a decode-only step of ``inner`` (a LlamaModel) through
    the native stack, or None where this step (or model) takes the Python layers. ``kinds``: as
    for :func:`build`."""
    T = input_ids.shape[0]
    if md.max_query_len != 1 or md.num_actual_tokens != md.num_reqs or T != md.num_actual_tokens:
        return None
    if input_ids.device.type != "cpu" or input_ids.dim() != 1:
        return None
    state = inner.__dict__.get("_decode_stack", False)
    # the KV cache reallocated (the worker rebinds every layer at once): build again
    if state and state.kv_cache is not inner.layers[inner.start].self_attn.attn.kv_cache:
        state = False
    if state is False:
        state = inner.__dict__["_decode_stack"] = build(inner, kinds)
    if state is None:
        return None
    tokens = input_ids
    if not state.stack.has_embedding:  # an embedding the stack does not look up: its rows from Python
        tokens = inner.embed_tokens(input_ids)
        if tokens.dtype != state.dtype or tokens.dim() != 2:
            return None
        tokens = tokens.contiguous()
    return state.stack.run(tokens, positions, md.block_table, md.seq_lens, md.slot_mapping)


def logits(inner, head, hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """``head(hidden)`` (the LM head of the model around ``inner``) through the native stack, the
    Python head's bit for bit, or None where it takes the Python head (no stack built yet or
    switched off, or a head the stack cannot multiply)."""
    state = inner.__dict__.get("_decode_stack")
    if not state or hidden.dim() != 2 or hidden.device.type != "cpu":
        return None
    if state.head is None:
        state.head = _set_head(state, head)
    return state.stack.logits(hidden) if state.head else None
