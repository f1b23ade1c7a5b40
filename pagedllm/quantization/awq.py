"""AWQ checkpoints (AutoAWQ ``version: gemm``, 4 bits, zero points).

Per linear layer (8 codes per int32 word, packed along N with AWQ's interleave):

- ``qweight`` int32 ``[K, N / 8]``: word ``i`` of row ``k`` holds columns ``8i .. 8i + 7``; the code
  at bits ``4j`` is column ``8i + ORDER[j]`` with ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``;
- ``qzeros`` int32 ``[G, N / 8]``: zero points in the same interleaved packing (stored as is);
- ``scales`` float16 ``[G, N]``; optional ``bias``.

``w[n, k] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n]``. Tensor parallel
splits of N move whole words (8 columns), so the interleave never crosses a rank.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.quantization.base import (
    LinearPartition, ParamSpec, QuantMethod, install_quantized, integer_weight, register_params, unpack_int32,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset of the code at nibble j of a word


def parse_awq_config(qc: dict) -> dict:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"AWQ with {bits} bits is not supported (supported: 4 bits)")
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (supported: the 'gemm' layout)")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ without zero points (zero_point: false) is not supported")
    return dict(group_size=int(qc.get("group_size", qc.get("q_group_size", 128))))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C / 8]`` in AWQ's interleaved order -> codes ``[R, C]`` in column order."""
    nibbles = unpack_int32(packed, 4, axis=1)  # nibble order: [R, C] with column 8i + j = nibble j
    r, c = nibbles.shape
    inverse = torch.argsort(torch.tensor(AWQ_ORDER, device=packed.device))  # column offset o is at nibble inverse[o]
    return nibbles.view(r, c // 8, 8)[:, :, inverse].reshape(r, c)


class AWQMethod(QuantMethod):
    name = "awq"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, part: LinearPartition, layer_name: str) -> None:
        g = part.in_full if self.group_size == -1 else self.group_size
        n, k = part.out_features, part.in_features
        if part.in_full % g or n % 8:
            raise ValueError(f"{layer_name}: AWQ needs the output features ({n}) divisible by 8 and group size {g} "
                             f"dividing the input features ({part.in_full})")
        groups = 1 if g == part.in_full else k // g
        specs = [
            ParamSpec("qweight", (k, n // 8), torch.int32, out_axis=1, out_unit=8, in_axis=0),
            ParamSpec("qzeros", (groups, n // 8), torch.int32, out_axis=1, out_unit=8, in_axis=0, in_unit=g),
            ParamSpec("scales", (groups, n), torch.float32, out_axis=1, in_axis=0, in_unit=g),
        ]
        register_params(layer, specs, part, layer_name)
        layer.quant_info = (layer_name, part, g)

    def process_after_loading(self, layer: nn.Module) -> None:
        _, part, _ = layer.quant_info
        k = part.in_features
        codes = unpack_awq(layer.qweight.data).t()  # [N, K]
        zeros = unpack_awq(layer.qzeros.data).t().float()  # [N, groups]
        scales = layer.scales.data.t()
        qw = integer_weight(codes, zeros, scales, 4, k // zeros.shape[1], k)
        install_quantized(layer, qw)
