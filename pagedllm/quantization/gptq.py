"""GPTQ checkpoints (AutoGPTQ / optimum / GPTQModel layout), 4 and 8 bits.

Per linear layer (``pf = 32 // bits`` codes per int32 word, ``G`` groups along K):

- ``qweight`` int32 ``[K / pf, N]``: packed along K, code of row ``k = i * pf + j`` at bits
  ``j * bits`` of word ``i``;
- ``qzeros`` int32 ``[G, N / pf]``: zero points packed along N the same way;
- ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]`` (the group of each input column;
  not ``k // group_size`` under act-order, ``desc_act``); optional ``bias``.

``w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]``. The zero points of the original
format (``checkpoint_format`` / ``format`` ``"gptq"``, the default, what optimum and transformers
write) are stored minus one: ``z = stored + 1`` (so a symmetric 4-bit checkpoint stores 7 for 8);
``"gptq_v2"`` (GPTQModel's internal format) stores ``z`` itself.

Act-order: the columns are permuted at load so each group is contiguous (``input_perm``);
under tensor parallelism a row-parallel layer keeps every group's scales and refuses a split
that cuts through a group (act-order groups are scattered over K, so this means tp 1).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.quantization.base import (
    LinearPartition, ParamSpec, QuantMethod, act_order, install_quantized, integer_weight, register_params,
    unpack_int32,
)


def parse_gptq_config(qc: dict) -> dict:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (supported: 4 and 8 bits)")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
    group = int(qc.get("group_size", 128) if qc.get("group_size") is not None else -1)
    return dict(bits=bits, group_size=group, desc_act=bool(qc.get("desc_act", False)), v2=fmt == "gptq_v2",
                sym=bool(qc.get("sym", True)))


class GPTQMethod(QuantMethod):
    name = "gptq"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, desc_act: bool, v2: bool, sym: bool = True,
                 has_g_idx: bool = True) -> None:
        self.bits, self.group_size, self.desc_act, self.v2 = bits, group_size, desc_act, v2
        self.has_g_idx = has_g_idx
        self.pack = 32 // bits

    def _group(self, part: LinearPartition) -> int:
        g = part.in_full if self.group_size == -1 else self.group_size
        if part.in_full % g:
            raise ValueError(f"GPTQ group_size {g} does not divide the layer's {part.in_full} input features")
        return g

    def create_weights(self, layer: nn.Module, part: LinearPartition, layer_name: str) -> None:
        g, pf = self._group(part), self.pack
        n, k = part.out_features, part.in_features
        if k % pf or n % pf:
            raise ValueError(f"{layer_name}: GPTQ {self.bits}-bit packing needs input ({k}) and output ({n}) "
                             f"features divisible by {pf}")
        # act-order on a split K: every rank keeps all groups' scales and zero points
        keep_all_groups = self.desc_act and part.row_split
        groups = part.in_full // g if keep_all_groups or g == part.in_full else k // g
        in_axis = None if keep_all_groups else 0
        specs = [
            ParamSpec("qweight", (k // pf, n), torch.int32, out_axis=1, in_axis=0, in_unit=pf),
            ParamSpec("qzeros", (groups, n // pf), torch.int32, out_axis=1, out_unit=pf, in_axis=in_axis, in_unit=g),
            ParamSpec("scales", (groups, n), torch.float32, out_axis=1, in_axis=in_axis, in_unit=g),
        ]
        if self.has_g_idx:
            specs.append(ParamSpec("g_idx", (k,), torch.int32, in_axis=0))
        register_params(layer, specs, part, layer_name)
        layer.quant_info = (layer_name, part, g)

    def process_after_loading(self, layer: nn.Module) -> None:
        layer_name, part, g = layer.quant_info
        codes = unpack_int32(layer.qweight.data, self.bits, axis=0).t()  # [N, K]
        zeros = unpack_int32(layer.qzeros.data, self.bits, axis=1).t().float()  # [N, groups]
        if not self.v2:
            zeros = zeros + 1
        scales = layer.scales.data.t()
        k = part.in_features
        local_groups = k // g if g != part.in_full else 1
        group_size = k // local_groups
        perm = None
        if self.has_g_idx:
            g_idx = layer.g_idx.data.to(torch.int64)
            if not self.desc_act and part.row_split and g != part.in_full:
                g_idx = g_idx - part.in_start // g  # this rank's groups start at 0
            if g == part.in_full:
                g_idx = torch.zeros_like(g_idx)
            perm, present = act_order(g_idx, group_size, zeros.shape[1], layer_name)
            if perm is not None:
                codes = codes.index_select(1, perm.long())
                zeros, scales = zeros[:, present], scales[:, present]
        qw = integer_weight(codes, zeros, scales, self.bits, group_size, k, perm)
        install_quantized(layer, qw)
