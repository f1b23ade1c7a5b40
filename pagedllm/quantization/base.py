"""What a quantization method is, and the loading machinery every method shares.

A method owns one linear layer's weight layout from checkpoint to matmul:

1. ``create_weights(layer, part)`` registers the checkpoint-shaped parameters (``qweight``,
   ``scales``, ...) on the layer, each with a ``weight_loader`` that copies this rank's slice of
   the checkpoint tensor (``ParamSpec`` says which axes hold the output and input features and in
   what units: packed words, groups). No dense weight is allocated.
2. ``process_after_loading(layer)`` unpacks them into the one run-time form, a
   :class:`QuantizedWeight`, registers its tensors as parameters (so resident memory is counted)
   and drops the checkpoint tensors. On CPU the kernels then repack it once (``qgemm.prepare``).
3. ``apply(layer, x, bias)`` multiplies: ``quantized_linear`` (the kernels' dispatcher).

``LinearPartition`` is the layer's tensor-parallel shape, built by the layer side
(``layers/quantized.py``), so methods never import the layers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagedllm.quantization.qgemm import quantized_linear
from pagedllm.quantization.quantized_weight import QuantizedWeight

@dataclass(frozen=True, slots=True)
class LinearPartition:
    """This rank's part of one linear layer (checkpoint orientation: weight ``[N, K]``).

    ``shards``: (shard id, local row offset, rows, first checkpoint row) per logical output
    sub-matrix (q/k/v, gate/up), and always one for shard id None: the layer as one tensor. ``in_start``: the first
    checkpoint input column this rank holds (row parallel), ``in_features`` how many.
    """

    in_features: int
    in_full: int
    in_start: int
    out_features: int
    shards: tuple

    def out_slice(self, shard_id) -> tuple[int, int, int]:
        for sid, offset, size, start in self.shards:
            if sid == shard_id:
                return offset, size, start
        raise ValueError(f"unknown output shard {shard_id!r} (layer shards: {[s[0] for s in self.shards]})")

    @property
    def num_shards(self) -> int:
        return max(1, sum(1 for s in self.shards if s[0] is not None))

    def shard_index(self, shard_id) -> int:
        ids = [s[0] for s in self.shards if s[0] is not None]
        return ids.index(shard_id) if shard_id in ids else 0

    @property
    def row_split(self) -> bool:
        return self.in_features != self.in_full


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One checkpoint tensor of a quantized layer.

    ``out_axis``/``in_axis``: the axis holding output rows / input columns (None: not split along
    it); ``out_unit``/``in_unit``: how many rows / columns one element along that axis covers (the
    pack factor for packed words, the group size for scales). ``per_shard``: a scalar per output
    shard (per-tensor scales): ``"rows"`` fills that shard's rows of a ``[N]`` parameter,
    ``"index"`` stores it at the shard's index of a ``[num_shards]`` parameter; ``"ignore"``: read
    and dropped (compressed-tensors' ``weight_shape``). A tensor without an output axis loaded once
    per fused shard (GPTQ's ``g_idx``) must be the same for every shard. ``out_expand``: each
    checkpoint element along ``out_axis`` covers that many rows and is repeated per row at load
    (block scales: a fused shard or a rank need not start or end on a block boundary).
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    out_axis: Optional[int] = None
    out_unit: int = 1
    in_axis: Optional[int] = None
    in_unit: int = 1
    per_shard: Optional[str] = None
    out_expand: int = 1


def _narrow(src, axis: int, start: int, length: int, full: int):
    if start == 0 and length == full and isinstance(src, torch.Tensor):
        return src
    return src.narrow(axis, start, length)


def materialize(src) -> torch.Tensor:
    """A weight loader's ``loaded``: a tensor as it is, or a checkpoint tensor not read yet (a
    lazy view: models/loader.SliceSource, the GGUF tensors, models/checkpoint_views.py's; each
    has ``narrow`` and ``full``) read whole."""
    return src if isinstance(src, torch.Tensor) else src.full()


def make_loader(spec: ParamSpec, part: LinearPartition, layer_name: str):
    """The ``weight_loader`` of one checkpoint tensor of a quantized layer."""

    def where(what: str) -> str:
        return f"{layer_name}.{spec.name}: {what}"

    def load(param: torch.Tensor, loaded, shard_id=None) -> None:
        if spec.per_shard == "ignore":
            return
        if spec.per_shard is not None:
            value = materialize(loaded).reshape(-1)
            if spec.per_shard == "index":
                if value.numel() != 1:
                    raise ValueError(where(f"expected one value per shard, got shape {tuple(loaded.shape)}"))
                param.data[part.shard_index(shard_id)] = value[0]
                return
            offset, size, start = part.out_slice(shard_id)
            if value.numel() == 1:
                param.data.narrow(0, offset, size).fill_(value[0])
            elif value.numel() >= start + size:  # one value per row (per-channel scales)
                param.data.narrow(0, offset, size).copy_(value.narrow(0, start, size))
                param.per_channel = True
            else:
                raise ValueError(where(f"{value.numel()} scale values do not cover rows {start}..{start + size}"))
            return
        src, dest = loaded, param.data
        if spec.out_expand > 1:
            src = loaded = materialize(loaded).repeat_interleave(spec.out_expand, dim=spec.out_axis)
        if spec.out_axis is not None:
            offset, size, start = part.out_slice(shard_id)
            u = spec.out_unit
            if offset % u or size % u or start % u:
                raise ValueError(where(f"output rows {start}..{start + size} do not split on whole packed units of "
                                       f"{u}; choose a tensor_parallel_size that divides the layer cleanly"))
            dest = dest.narrow(spec.out_axis, offset // u, size // u)
            src = _narrow(src, spec.out_axis, start // u, size // u, loaded.shape[spec.out_axis])
        if spec.in_axis is not None and part.row_split and loaded.shape[spec.in_axis] > 1:
            u = spec.in_unit
            if part.in_start % u or part.in_features % u:
                raise ValueError(where(f"this rank's input columns {part.in_start}..{part.in_start + part.in_features}"
                                       f" split a unit of {u} (packed word or quantization group); choose a "
                                       "tensor_parallel_size that divides the groups"))
            src = src.narrow(spec.in_axis, part.in_start // u, part.in_features // u)
        src = materialize(src)
        if tuple(src.shape) != tuple(dest.shape):
            raise ValueError(where(f"checkpoint slice {tuple(src.shape)} does not fit parameter {tuple(dest.shape)} "
                                   f"(checkpoint tensor {tuple(loaded.shape)})"))
        if spec.out_axis is None and shard_id is not None:  # one tensor for every fused shard (g_idx)
            seen = param.loaded_shards
            if seen and not torch.equal(dest, src.to(dest.dtype)):
                raise ValueError(where(f"shard {shard_id!r} differs from shard {seen[0]!r}; pagedllm fuses them into "
                                       "one layer, which needs them equal"))
            param.loaded_shards = seen + (shard_id,)
        dest.copy_(src)

    return load


class CheckpointParam(nn.Parameter):
    """A quantized layer's parameter for one checkpoint tensor (``register_params``), with what
    its loader learned."""

    per_channel = False  # a per-shard scale came as one value per output row
    loaded_shards: tuple = ()  # the fused shards loaded into a tensor they all share (g_idx)


def register_params(layer: nn.Module, specs: list[ParamSpec], part: LinearPartition, layer_name: str) -> None:
    for spec in specs:
        p = CheckpointParam(torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=False)
        p.weight_loader = make_loader(spec, part, layer_name)  # type: ignore[attr-defined]
        layer.register_parameter(spec.name, p)
    layer.checkpoint_param_names = tuple(s.name for s in specs)


def install_quantized(layer: nn.Module, qw) -> None:
    """Drop the checkpoint tensors (or an earlier run-time form) and keep ``qw`` -- a
    QuantizedWeight, or the kernels' repacked form of one -- with its tensors registered as
    ``q_<field>`` parameters, so the layer's resident bytes are what its parameters add up to."""
    for name in list(layer._parameters):
        if name in layer.checkpoint_param_names or name.startswith("q_"):
            del layer._parameters[name]
    layer.checkpoint_param_names = ()
    for f in dataclasses.fields(qw):
        t = getattr(qw, f.name)
        if isinstance(t, torch.Tensor):
            layer.register_parameter(f"q_{f.name}", nn.Parameter(t, requires_grad=False))
    layer.quantized = qw


def unpack_int32(packed: torch.Tensor, bits: int, axis: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes packed little-end into int32 words along ``axis`` (element j of a
    word at bits ``j * bits``) -> int32 codes, that axis ``32 // bits`` times longer."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    p = packed.to(torch.int32).movedim(axis, -1)
    codes = (p.unsqueeze(-1) >> shifts) & mask  # [..., words, per]
    codes = codes.reshape(*p.shape[:-1], p.shape[-1] * per)
    return codes.movedim(-1, axis)


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned int4 codes ``[N, K]`` (0..15) -> ``QuantizedWeight``'s uint8 ``[N, K // 2]``."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def integer_weight(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                   in_features: int, input_perm: Optional[torch.Tensor] = None,
                   act_quant: Optional[str] = None) -> QuantizedWeight:
    """Unsigned codes ``[N, K]`` in 0..2**bits-1 with float zero points ``[N, G]`` -> QuantizedWeight
    (int4 as nibbles; int8 shifted by -128 with its zero points, so ``q - z`` is unchanged).
    Zero points equal to the symmetric default become None."""
    zeros = zeros.to(torch.float32).contiguous()
    scales = scales.to(torch.float32).contiguous()
    if bits == 4:
        sym = bool((zeros == 8).all())
        return QuantizedWeight("int4", pack_int4_rows(codes), scales, None if sym else zeros, group_size, in_features,
                               input_perm, act_quant)
    if bits == 8:
        q = (codes.to(torch.int32) - 128).to(torch.int8).contiguous()
        zeros = zeros - 128
        sym = bool((zeros == 0).all())
        return QuantizedWeight("int8", q, scales, None if sym else zeros, group_size, in_features, input_perm,
                               act_quant)
    raise ValueError(f"{bits}-bit integer weights are not supported (4 and 8 are)")


def act_order(g_idx: torch.Tensor, group_size: int, num_groups: int, where: str):
    """An act-order ``g_idx`` (group of each input column) -> (input_perm or None, the groups in the
    permuted order). None when the columns are already in group order; raises when a group does not
    hold exactly ``group_size`` of this rank's columns (a tensor-parallel split through a group)."""
    g = g_idx.to(torch.int64)
    k = g.numel()
    if torch.equal(g, torch.arange(k, dtype=torch.int64, device=g.device) // group_size):
        return None, None
    perm = torch.argsort(g, stable=True)
    present, counts = torch.unique(g, return_counts=True)
    if bool((counts != group_size).any()) or int(present.max()) >= num_groups:
        raise ValueError(f"{where}: act-order (desc_act) groups are not whole on this rank's {k} input columns "
                         "(a tensor-parallel split of a row-parallel layer cuts through them); use "
                         "tensor_parallel_size 1 for act-order checkpoints")
    return perm.to(torch.int32), present


class QuantMethod:
    """One layer's quantized weight: checkpoint layout, loading and matmul (see the module doc)."""

    name = "?"

    def create_weights(self, layer: nn.Module, part: LinearPartition, layer_name: str) -> None:
        raise NotImplementedError

    def process_after_loading(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if layer.static_input is not None:
            x = fake_quantize_static(x, *layer.static_input)
        return matmul(x, layer.quantized, bias)


def fake_quantize_static(x: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """Static per-tensor activation quantization (a checkpoint's ``input_scale``): the values the
    quantized product sees, ``q(x / s) * s``; the weight product that follows is then exact."""
    xf = x.float() / scale
    if kind == "int8":
        q = torch.round(xf).clamp_(-128.0, 127.0)
    else:
        q = xf.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).to(x.dtype)


def matmul(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return quantized_linear(x, qw, bias)
