"""On-the-fly quantization of an unquantized checkpoint (``quantization="int8"`` / ``"fp8"``).

Each checkpoint tensor is quantized as it is read, per output channel, straight into the layer's
int8 (or float8_e4m3fn) codes: ``s[n] = absmax(w[n, :]) / 127`` (448 for fp8), ``q = round(w / s)``
(fp8: ``w / s`` rounded to e4m3). A fused layer's q/k/v or gate/up shards are quantized
separately (their rows are independent), so no dense copy of a layer, let alone the model, is
ever held: only the one checkpoint tensor being read. Activations stay in the model's dtype
(weight-only, W8A16): a row-parallel rank's scales cover its own input columns.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.quantization.base import LinearPartition, QuantMethod, install_quantized, materialize
from pagedllm.quantization.quantized_weight import QuantizedWeight

_QMAX = {"int8": 127.0, "fp8": 448.0}


def quantize_rows(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense rows ``[R, K]`` -> (codes ``[R, K]`` int8 / float8_e4m3fn, float32 scales ``[R]``)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / _QMAX[kind]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    x = w / scale[:, None]
    if kind == "int8":
        return torch.round(x).clamp_(-127, 127).to(torch.int8), scale
    return x.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


class OnlineMethod(QuantMethod):
    def __init__(self, kind: str) -> None:
        if kind not in _QMAX:
            raise ValueError(f"on-the-fly quantization {kind!r} is not supported (supported: int8, fp8)")
        self.kind = kind
        self.name = kind

    def create_weights(self, layer: nn.Module, part: LinearPartition, layer_name: str) -> None:
        dtype = torch.int8 if self.kind == "int8" else torch.float8_e4m3fn
        codes = nn.Parameter(torch.zeros(part.out_features, part.in_features, dtype=dtype), requires_grad=False)

        def load(param: torch.Tensor, loaded, shard_id=None) -> None:
            offset, size, start = part.out_slice(shard_id)
            src = loaded.narrow(0, start, size)
            if part.row_split:
                src = src.narrow(1, part.in_start, part.in_features)
            src = materialize(src)
            if tuple(src.shape) != (size, part.in_features):
                raise ValueError(f"{layer_name}.weight: checkpoint {tuple(loaded.shape)} does not fit rows "
                                 f"{start}..{start + size} x {part.in_features} columns")
            q, s = quantize_rows(src, self.kind)
            param.data.narrow(0, offset, size).copy_(q)
            layer.online_scales.narrow(0, offset, size).copy_(s)

        codes.weight_loader = load  # type: ignore[attr-defined]
        layer.register_parameter("weight", codes)
        layer.online_scales = torch.ones(part.out_features, dtype=torch.float32)
        layer.checkpoint_param_names = ("weight",)
        layer.quant_info = (layer_name, part)

    def process_after_loading(self, layer: nn.Module) -> None:
        _, part = layer.quant_info
        k = part.in_features
        qw = QuantizedWeight(self.kind, layer.weight.data, layer.online_scales.reshape(-1, 1).contiguous(), None, k, k)
        del layer.online_scales
        install_quantized(layer, qw)
