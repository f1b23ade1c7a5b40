"""FP8 checkpoints (``quant_method: fp8``: vLLM / transformers' fine-grained FP8, DeepSeek-V3 style).

Per linear layer: ``weight`` float8_e4m3fn ``[N, K]`` and either ``weight_scale`` -- one value
(per tensor; fused q/k/v or gate/up shards each keep their own) or one per output channel
(``[N]`` / ``[N, 1]``) -- or, with ``weight_block_size: [bn, bk]``, ``weight_scale_inv``
``[ceil(N / bn), ceil(K / bk)]`` (one scale per block; despite the name it multiplies). ``w = q * s``.

``activation_scheme``: ``dynamic`` (scales per step: per tensor for per-tensor weights, per token
otherwise -- block checkpoints were made for per-token-group activation scales of 1 x bk, which
the run-time form does not express; per token is the nearest finer-than-tensor choice) or
``static`` (each layer's ``input_scale``; fused shards take the largest).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.quantization.base import LinearPartition, ParamSpec, QuantMethod, install_quantized, register_params
from pagedllm.quantization.quantized_weight import QuantizedWeight


def parse_fp8_config(qc: dict) -> dict:
    scheme = str(qc.get("activation_scheme", "dynamic"))
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (supported: dynamic, static)")
    fmt = str(qc.get("fmt", "e4m3"))
    if fmt != "e4m3":
        raise ValueError(f"fp8 fmt {fmt!r} is not supported (supported: e4m3)")
    block = qc.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise ValueError(f"fp8 weight_block_size must be [rows, cols], got {block!r}")
    return dict(static=scheme == "static", block=tuple(int(b) for b in block) if block else None)


class Fp8Method(QuantMethod):
    name = "fp8"

    def __init__(self, static: bool, block: Optional[tuple]) -> None:
        self.static, self.block = static, block

    def create_weights(self, layer: nn.Module, part: LinearPartition, layer_name: str) -> None:
        n, k = part.out_features, part.in_features
        specs = [ParamSpec("weight", (n, k), torch.float8_e4m3fn, out_axis=0, in_axis=1)]
        if self.block is not None:
            bn, bk = self.block
            if k % bk:
                raise ValueError(f"{layer_name}: fp8 block {self.block} does not divide the input features ({k})")
            specs.append(ParamSpec("weight_scale_inv", (n, k // bk), torch.float32, out_axis=0, out_expand=bn,
                                   in_axis=1, in_unit=bk))
        else:
            specs.append(ParamSpec("weight_scale", (n,), torch.float32, per_shard="rows"))
        if self.static:
            specs.append(ParamSpec("input_scale", (part.num_shards,), torch.float32, per_shard="index"))
        register_params(layer, specs, part, layer_name)
        layer.quant_info = (layer_name, part)

    def process_after_loading(self, layer: nn.Module) -> None:
        _, part = layer.quant_info
        n, k = part.out_features, part.in_features
        if self.block is not None:
            scales = layer.weight_scale_inv.data  # [N, K / bk]: block rows repeated at load
            act = "fp8_per_token"
        else:
            scales = layer.weight_scale.data.reshape(n, 1)
            act = "fp8_per_token" if layer.weight_scale.per_channel else "fp8_per_tensor"
        if self.static:
            layer.static_input = ("fp8", float(layer.input_scale.data.max()))
            act = None
        qw = QuantizedWeight("fp8", layer.weight.data, scales.float().contiguous(), None, k // scales.shape[1], k,
                             act_quant=act)
        install_quantized(layer, qw)
