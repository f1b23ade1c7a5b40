"""compressed-tensors checkpoints (llm-compressor): ``pack-quantized``, ``int-quantized`` and
``float-quantized``.

``quantization_config.config_groups`` map ``targets`` (``"Linear"``, ``"re:<regex>"`` or a module
name) to a scheme; ``ignore`` lists modules (same spelling) left dense. Per quantized layer:

- ``pack-quantized`` (W4A16 / W8A16): ``weight_packed`` int32 ``[N, K * bits / 32]``, codes packed
  little-end along K, stored as ``q + 2**(bits-1)`` (signed codes made unsigned); ``weight_scale``
  ``[N, G]`` (``[N, 1]`` per channel); ``weight_shape`` ``[2]``; asymmetric schemes add
  ``weight_zero_point`` packed the same way along N (``[N * bits / 32, G]``); act-order ``group``
  adds ``weight_g_idx`` ``[K]``.
- ``int-quantized`` (W8A8, W8A16): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]`` /
  ``[1]`` / ``[N, G]``, optional ``weight_zero_point`` int8 of the scale's shape.
- ``float-quantized`` (FP8 W8A8 / W8A16): ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale``
  ``[1]`` (tensor), ``[N, 1]`` (channel), ``[N, G]`` (group) or ``[ceil(N/bn), ceil(K/bk)]`` (block).
- ``naive-quantized``: ``weight`` in the dtype of its type and bits (int8 or float8_e4m3fn), scales
  as above. compressed-tensors 0.19 (llm-compressor 0.14) writes weight-only FP8 this way, keeping
  ``int-quantized`` / ``float-quantized`` for schemes that also quantize activations.

``w = (q - z) * s``. ``input_activations``: None (weight only); dynamic ``token`` / ``tensor``
(scales computed per step); static ``tensor`` with a stored ``input_scale`` (fused q/k/v or
gate/up take the largest of their shards', as the product shares one input).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagedllm.quantization.base import (
    LinearPartition, ParamSpec, QuantMethod, act_order, install_quantized, integer_weight, register_params,
    unpack_int32,
)
from pagedllm.quantization.quantized_weight import QuantizedWeight

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


@dataclass(frozen=True)
class Scheme:
    fmt: str  # "pack" | "int" | "float"
    bits: int
    strategy: str  # "tensor" | "channel" | "group" | "block"
    group_size: int
    block: tuple
    symmetric: bool
    g_idx: bool
    act: Optional[str]  # QuantizedWeight.act_quant, or "static_int8" / "static_fp8"


def parse_scheme(group: dict, fmt: str, where: str) -> Scheme:
    w = group.get("weights") or {}
    fmt = group.get("format") or fmt
    if fmt not in FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} ({where}) is not supported (supported: {', '.join(FORMATS)})")
    bits, wtype = int(w.get("num_bits", 8)), w.get("type", "int")
    kind = {"pack-quantized": "pack", "float-quantized": "float"}.get(fmt, "int")
    if fmt == "naive-quantized" and wtype == "float":
        kind = "float"  # weight-only fp8: compressed-tensors keeps "float-quantized" for fp8 activations
    if (kind == "float") != (wtype == "float") or (kind == "float" and bits != 8) or bits not in (4, 8):
        raise ValueError(f"compressed-tensors {where}: {bits}-bit {wtype} weights in {fmt!r} are not supported "
                         "(supported: int4/int8 pack-quantized, int8 int-quantized, fp8 float-quantized)")
    if kind != "pack" and bits != 8:
        raise ValueError(f"compressed-tensors {where}: {bits}-bit weights in {fmt!r} are not supported")
    strategy = w.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise ValueError(f"compressed-tensors {where}: weight strategy {strategy!r} is not supported")
    symmetric = bool(w.get("symmetric", True))
    if not symmetric and (kind == "float" or strategy not in ("channel", "group")):
        raise ValueError(f"compressed-tensors {where}: asymmetric {strategy} {wtype} weights are not supported")
    if w.get("dynamic"):
        raise ValueError(f"compressed-tensors {where}: dynamic weight quantization is not supported")
    a = group.get("input_activations")
    act = None
    if a is not None:
        atype, astrat = a.get("type", "int"), a.get("strategy", "tensor")
        if int(a.get("num_bits", 8)) != 8 or atype != wtype or not a.get("symmetric", True):
            raise ValueError(f"compressed-tensors {where}: input activations {atype}{a.get('num_bits')} "
                             f"(symmetric={a.get('symmetric', True)}) with {wtype} weights are not supported")
        if kind == "pack":
            raise ValueError(f"compressed-tensors {where}: quantized activations with packed weights are not supported")
        if a.get("dynamic") in (True, "true"):
            if atype == "int" and astrat == "token":
                act = "int8_per_token"
            elif atype == "float" and astrat in ("token", "tensor"):
                act = f"fp8_per_{astrat}"
        elif astrat == "tensor":
            act = f"static_{'int8' if atype == 'int' else 'fp8'}"
        if act is None:
            raise ValueError(f"compressed-tensors {where}: {'dynamic' if a.get('dynamic') else 'static'} {astrat} "
                             "activation quantization is not supported (supported: dynamic per-token int8, dynamic "
                             "per-token or per-tensor fp8, static per-tensor)")
    block = tuple(w.get("block_structure") or ())
    if strategy == "block" and len(block) != 2:
        raise ValueError(f"compressed-tensors {where}: block strategy without a [rows, cols] block_structure")
    g_idx = w.get("actorder") == "group"
    return Scheme(kind, bits, strategy, int(w.get("group_size") or 0), block, symmetric, g_idx, act)


class CompressedTensorsMethod(QuantMethod):
    name = "compressed-tensors"

    def __init__(self, scheme: Scheme) -> None:
        self.s = scheme

    def create_weights(self, layer: nn.Module, part: LinearPartition, layer_name: str) -> None:
        s = self.s
        n, k = part.out_features, part.in_features
        if s.strategy == "group":
            g = s.group_size
            if g <= 0 or part.in_full % g:
                raise ValueError(f"{layer_name}: group size {g} does not divide the input features ({part.in_full})")
        elif s.strategy == "block":
            g = s.block[1]
            if k % g:
                rank = f" of {part.in_full} on this tensor-parallel rank" if part.row_split else ""
                raise ValueError(f"{layer_name}: fp8 block {s.block} does not divide the input features ({k}{rank})")
        else:
            g = part.in_full
        keep_all = s.g_idx and part.row_split
        groups = 1 if g == part.in_full else (part.in_full // g if keep_all else k // g)
        in_axis = None if keep_all else 1
        specs: list[ParamSpec] = []
        if s.fmt == "pack":
            pf = 32 // s.bits
            if k % pf:
                raise ValueError(f"{layer_name}: {s.bits}-bit packing needs input features ({k}) divisible by {pf}")
            specs += [ParamSpec("weight_packed", (n, k // pf), torch.int32, out_axis=0, in_axis=1, in_unit=pf),
                      ParamSpec("weight_shape", (2,), torch.int64, per_shard="ignore")]
        else:
            dtype = torch.float8_e4m3fn if s.fmt == "float" else torch.int8
            specs.append(ParamSpec("weight", (n, k), dtype, out_axis=0, in_axis=1))
        if s.strategy in ("tensor", "channel"):
            specs.append(ParamSpec("weight_scale", (n,), torch.float32, per_shard="rows"))
        elif s.strategy == "block":
            specs.append(ParamSpec("weight_scale", (n, k // g), torch.float32, out_axis=0, out_expand=s.block[0],
                                   in_axis=1, in_unit=g))
        else:
            specs.append(ParamSpec("weight_scale", (n, groups), torch.float32, out_axis=0, in_axis=in_axis, in_unit=g))
        if not s.symmetric:
            if s.fmt == "pack":
                pf = 32 // s.bits
                specs.append(ParamSpec("weight_zero_point", (n // pf, groups), torch.int32, out_axis=0, out_unit=pf,
                                       in_axis=in_axis, in_unit=g))
            else:
                specs.append(ParamSpec("weight_zero_point", (n, groups), torch.int8, out_axis=0, in_axis=in_axis,
                                       in_unit=g))
        if s.g_idx:
            specs.append(ParamSpec("weight_g_idx", (k,), torch.int32, in_axis=0))
        if s.act is not None and s.act.startswith("static_"):
            specs.append(ParamSpec("input_scale", (part.num_shards,), torch.float32, per_shard="index"))
        register_params(layer, specs, part, layer_name)
        layer.quant_info = (layer_name, part, g)

    def process_after_loading(self, layer: nn.Module) -> None:
        s = self.s
        layer_name, part, g = layer.quant_info
        n, k = part.out_features, part.in_features
        act = s.act
        if act is not None and act.startswith("static_"):
            layer.static_input = (act[len("static_"):], float(layer.input_scale.data.max()))
            act = None
        scales = layer.weight_scale.data
        if s.strategy in ("tensor", "channel"):
            scales = scales.reshape(n, 1)
        groups = scales.shape[1]
        group_size = k // groups
        if s.fmt == "float":
            qw = QuantizedWeight("fp8", layer.weight.data, scales.float().contiguous(), None, group_size, k,
                                 act_quant=act)
            install_quantized(layer, qw)
            return
        offset = 1 << (s.bits - 1)
        if s.fmt == "pack":
            codes = unpack_int32(layer.weight_packed.data, s.bits, axis=1)[:, :k]
        else:
            codes = layer.weight.data.to(torch.int32) + offset
        if s.symmetric:
            zeros = torch.full((n, groups), float(offset), device=codes.device)
        elif s.fmt == "pack":
            zeros = unpack_int32(layer.weight_zero_point.data, s.bits, axis=0)[:n].float()
        else:
            zeros = layer.weight_zero_point.data.float() + offset
        perm = None
        if s.g_idx:
            perm, present = act_order(layer.weight_g_idx.data, group_size, groups, layer_name)
            if perm is not None:
                codes = codes.index_select(1, perm.long())
                zeros, scales = zeros[:, present], scales[:, present]
        install_quantized(layer, integer_weight(codes, zeros, scales, s.bits, group_size, k, perm, act))


def _matches(name: str, patterns, class_name: str = "Linear") -> int:
    """How specifically ``name`` is targeted: 3 by its exact name, 2 by a ``re:`` pattern, 1 by the
    layer class, 0 not at all."""
    best = 0
    for p in patterns or ():
        if p == name:
            return 3
        if p.startswith("re:") and re.match(p[3:], name):
            best = max(best, 2)
        elif p == class_name:
            best = max(best, 1)
    return best


def scheme_for(qc: dict, module_name: str) -> Optional[Scheme]:
    """The scheme that applies to one checkpoint module (None: ignored or not targeted)."""
    if _matches(module_name, qc.get("ignore")):
        return None
    best, chosen = 0, None
    for key, group in (qc.get("config_groups") or {}).items():
        score = _matches(module_name, group.get("targets"))
        if score > best:
            best, chosen = score, (key, group)
    if chosen is None:
        return None
    return parse_scheme(chosen[1], qc.get("format", "pack-quantized"), f"config group {chosen[0]!r}")
