"""GGUF block formats kept packed: the quantization method of a GGUF file's linear layers, its
embedding and LM head.

A layer's weight stays in the file's blocks (``GGUFWeight``: one or more row segments, each
uint8 ``[rows, row_bytes]`` of one block type: a fused q/k/v or gate/up layer whose parts the
file stores in different types -- Q4_K_M keeps some in Q6_K -- keeps a segment per part).
Products run in the C++ kernels (``kernels/csrc/gguf_gemm.h``: each block dequantized in
registers exactly as gguf's reference does and multiplied in float32; activations are never
quantized). Embedding rows are dequantized on lookup; a tied LM head multiplies the same packed
table. Without the kernels (no compiler), or on a GPU, a layer's weight is dequantized per call
or once at load (CUDA) with gguf's own reference.

Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.quantization.base import LinearPartition, QuantMethod
from pagedllm.quantization.qgemm import quantized_linear

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")


def check_type(type_name: str, where: str) -> None:
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(f"{where}: GGUF tensor type {type_name} is not supported; supported types: "
                         f"{', '.join(SUPPORTED_TYPES)}")


@dataclass(frozen=True, slots=True)
class GGUFSegment:
    """Rows ``[row_offset, row_offset + rows)`` of a layer's output, packed in one block type."""

    row_offset: int
    rows: int
    qtype: int
    type_name: str
    data: torch.Tensor  # uint8 [rows, row_bytes]; empty once ``panels`` holds the weight
    panels: Optional[object] = None  # the quantized-GEMM panel form (gguf_panels.py), where the type has one

    def nbytes(self) -> int:
        return self.data.numel() if self.panels is None else self.panels.nbytes()


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    segments: tuple
    out_features: int
    in_features: int
    act_quant = None

    @property
    def kind(self) -> str:
        return "gguf:" + "+".join(sorted({s.type_name for s in self.segments}))

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.segments)

    def with_panels(self, kernels) -> "GGUFWeight":
        """This weight with every segment whose type has a panel form rewritten into it (the
        file-layout bytes dropped); itself where none has."""
        from pagedllm.quantization.gguf_panels import to_panels

        segs, changed = [], False
        for seg in self.segments:
            pw = to_panels(seg.data, seg.type_name, self.in_features, kernels) if seg.panels is None else None
            if pw is not None:
                seg = replace(seg, data=seg.data.new_empty(0, 0), panels=pw)
                changed = True
            segs.append(seg)
        return replace(self, segments=tuple(segs)) if changed else self

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [len(rows), in_features] (an embedding lookup; single-segment tables)."""
        seg = self.segments[0]
        if seg.panels is not None:
            from pagedllm.quantization.gguf_panels import panel_rows

            return panel_rows(seg.panels, rows.cpu().to(torch.int64)).to(rows.device)
        kernels = cpu_kernels.ready()
        if kernels is not None and rows.device.type == "cpu":
            return kernels.gguf_dequantize(seg.data, seg.qtype, rows.to(torch.int64), self.in_features)
        return _reference_dequantize(seg, rows.cpu().to(torch.int64)).to(rows.device)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return gguf_linear(x, self, bias)

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 [out_features, in_features] (GPU layers at load; tests)."""
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        for seg in self.segments:
            out[seg.row_offset:seg.row_offset + seg.rows] = (
                _reference_dequantize(seg, None) if seg.panels is None else seg.panels.dequantize()[:seg.rows])
        return out


def _reference_dequantize(seg: GGUFSegment, rows: Optional[torch.Tensor]) -> torch.Tensor:
    from gguf.quants import dequantize

    data = seg.data.numpy() if rows is None else seg.data.numpy()[rows.numpy()]
    return torch.from_numpy(np.ascontiguousarray(dequantize(data, seg.qtype), dtype=np.float32))


def gguf_linear(x: torch.Tensor, gw: GGUFWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x W^T (+ bias)`` with W in its GGUF blocks; ``x.dtype`` out."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != gw.in_features:
        raise ValueError(f"gguf_linear: x has {k} features, the weight expects {gw.in_features}")
    x2 = x.reshape(-1, k)
    kernels = cpu_kernels.ready()
    if kernels is not None and x2.device.type == "cpu":
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        if len(gw.segments) == 1 and gw.segments[0].panels is not None:
            y = quantized_linear(x2, gw.segments[0].panels)
        else:
            y = torch.empty(x2.shape[0], gw.out_features, dtype=x2.dtype)
            for seg in gw.segments:
                out = y if len(gw.segments) == 1 else y[:, seg.row_offset:seg.row_offset + seg.rows]
                if seg.panels is not None:
                    out.copy_(quantized_linear(x2, seg.panels))
                else:
                    kernels.gguf_linear(out, x2, seg.data, seg.qtype)
    else:
        y = torch.empty(x2.shape[0], gw.out_features, dtype=torch.float32, device=x2.device)
        for seg in gw.segments:  # one segment dequantized at a time, never the whole model
            w = _reference_dequantize(seg, None).to(x2.device)
            y[:, seg.row_offset:seg.row_offset + seg.rows] = x2.float() @ w.t()
    if bias is not None:
        y = y + bias.to(y.dtype)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.reshape(*lead, gw.out_features)


def _segment(src, row_offset: int, where: str) -> GGUFSegment:
    check_type(src.type_name, where)
    data = src.packed()
    return GGUFSegment(row_offset, int(src.shape[0]), src.qtype, src.type_name, data)


class GGUFMethod(QuantMethod):
    """A linear layer whose checkpoint tensors are GGUF blocks (see the module doc)."""

    name = "gguf"

    def create_weights(self, layer: nn.Module, part: LinearPartition, layer_name: str) -> None:
        segments: dict = {}
        layer.gguf_segments = segments
        layer.gguf_partition = part
        layer.gguf_target = (torch.empty(0).device, torch.get_default_dtype())  # where the model is built

        def load(param, src, shard_id=None) -> None:
            if not hasattr(src, "packed"):
                raise ValueError(f"{layer_name}: expected a GGUF tensor, got {type(src).__name__}")
            offset, size, start = part.out_slice(shard_id)
            if (start, size) != (0, src.shape[0]):
                src = src.narrow(0, start, size)
            if part.row_split:
                src = src.narrow(1, part.in_start, part.in_features)
            if tuple(src.shape) != (size, part.in_features):
                raise ValueError(f"{layer_name}: GGUF tensor {src.name} slice {tuple(src.shape)} does not fit "
                                 f"rows {offset}..{offset + size} x {part.in_features} columns")
            segments[offset] = _segment(src, offset, f"{layer_name} ({src.name})")

        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.weight_loader = load  # type: ignore[attr-defined]
        layer.register_parameter("weight", placeholder)
        layer.checkpoint_param_names = ("weight",)

    def process_after_loading(self, layer: nn.Module) -> None:
        part: LinearPartition = layer.gguf_partition
        segs = [layer.gguf_segments[k] for k in sorted(layer.gguf_segments)]
        covered = sum(s.rows for s in segs)
        if covered != part.out_features:
            raise ValueError(f"GGUF layer of {part.out_features} rows got only {covered} rows from the file")
        segs = _merge_runs(segs)
        gw = GGUFWeight(tuple(segs), part.out_features, part.in_features)
        device, dtype = layer.gguf_target
        del layer.gguf_segments, layer.gguf_partition, layer.gguf_target
        if device.type != "cpu":  # a GPU multiplies dense weights: this layer dequantized once, here
            del layer._parameters["weight"]
            layer.weight = nn.Parameter(gw.dequantize().to(device=device, dtype=dtype), requires_grad=False)
            layer.quant_method = None
            return
        install_gguf(layer, gw)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return gguf_linear(x, layer.quantized, bias)


def _merge_runs(segs: list) -> list:
    """Adjacent segments of one block type as one (one tensor, one kernel call): q/k/v all Q4_K
    become one segment; Q4_K_M's q, k in Q4_K and v in Q6_K become two."""
    out: list = []
    for s in segs:
        last = out[-1] if out else None
        if last is not None and last[-1].qtype == s.qtype:
            last.append(s)
        else:
            out.append([s])
    return [run[0] if len(run) == 1 else GGUFSegment(run[0].row_offset, sum(s.rows for s in run), run[0].qtype,
                                                      run[0].type_name, torch.cat([s.data for s in run]))
            for run in out]


def install_gguf(layer: nn.Module, gw: GGUFWeight) -> None:
    """``gw`` becomes the layer's weight: its segments registered as ``q_seg<i>`` parameters (so
    resident bytes are counted), the placeholder dropped."""
    for name in list(layer._parameters):
        if name == "weight" or name.startswith("q_seg"):
            del layer._parameters[name]
    for i, seg in enumerate(gw.segments):
        if seg.panels is None:
            layer.register_parameter(f"q_seg{i}", nn.Parameter(seg.data, requires_grad=False))
            continue
        panels = seg.panels
        for part, t in (("packed", panels.packed), ("scales", panels.scales), ("zeros", panels.zeros)):
            if t is not None:
                layer.register_parameter(f"q_seg{i}_{part}", nn.Parameter(t, requires_grad=False))
    layer.checkpoint_param_names = ()
    layer.quantized = gw


def pack_vocab_table(module: nn.Module, where: str) -> None:
    """A (vocab-parallel) embedding or LM head whose table the file stores quantized: its weight
    becomes a loader that keeps this rank's rows packed (``module.packed``, a GGUFWeight; rows
    past the vocabulary on the last rank are zero blocks, which dequantize to 0). On a GPU the
    rows are dequantized once at load instead, into the usual dense table."""
    hidden = module.weight.shape[1]
    dtype = torch.get_default_dtype()  # called where the model is built: its dtype
    device = torch.empty(0).device

    def load(param, src, shard_id=None) -> None:
        if src.shape[0] < module.vocab_size or src.shape[1] != hidden:
            raise ValueError(f"{where}: GGUF table {tuple(src.shape)} does not match vocab {module.vocab_size} x "
                             f"{hidden}")
        piece = src.narrow(0, module.start, module.end - module.start)
        if device.type != "cpu":
            dense = torch.zeros(module.per_rank, hidden, dtype=dtype, device=device)
            dense[:piece.shape[0]] = piece.full().to(device=device, dtype=dtype)
            module.weight = nn.Parameter(dense, requires_grad=False)
            module.weight.weight_loader = load  # type: ignore[attr-defined]
            module.packed = None
            return
        seg = _segment(piece, 0, where)
        data = seg.data
        if data.shape[0] < module.per_rank:
            data = torch.cat([data, data.new_zeros(module.per_rank - data.shape[0], data.shape[1])])
        gw = GGUFWeight((GGUFSegment(0, module.per_rank, seg.qtype, seg.type_name, data),), module.per_rank, hidden)
        module.packed = gw
        module.packed_dtype = dtype
        module.weight = nn.Parameter(data, requires_grad=False)  # the same bytes, counted once
        module.weight.weight_loader = load  # type: ignore[attr-defined]

    placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
    placeholder.weight_loader = load  # type: ignore[attr-defined]
    module.weight = placeholder
    module.packable_weight = False


class GGUFQuantConfig:
    """A GGUF file's quantization: per HF tensor name, its block type. A linear layer is GGUF
    packed when any of its checkpoint parts is stored in a block type other than F32 (an all-F32
    layer stays dense, in our fast float GEMMs)."""

    name = "gguf"
    online = False
    require_match = False  # a file of float tensors only (F32) has no packed layer, and is still a model

    def __init__(self, types: dict) -> None:
        self.types = dict(types)
        self.keys = frozenset(self.types)
        for name, kind in self.types.items():
            check_type(kind, name)

    def method_for(self, layer_name: str, parts: list) -> Optional[QuantMethod]:
        kinds = [self.types.get(f"{p}.weight") for p in parts]
        if not any(k not in (None, "F32") for k in kinds):
            return None
        return GGUFMethod()


def tie_packed_head(model: nn.Module) -> None:
    """After loading: a tied LM head multiplies the embedding's packed table."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(embed, "packed", None) is None:
        return
    if getattr(head, "packed", None) is None and head.weight is embed.weight:
        head.packed = embed.packed
        head.packable_weight = False
