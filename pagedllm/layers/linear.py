"""Linear layers written for tensor parallelism (Megatron style); with tp size 1 they are plain.

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this rank's
slice of a checkpoint tensor in place, so the loader never needs to know the layout.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.cpu_gemm import linear
from pagedllm.quantization.base import materialize


_WEIGHTS_ON_META = False  # while a quantized model is built (layers/quantized.py): no dense weight memory


@contextlib.contextmanager
def linear_weights_on_meta(enabled: bool = True):
    """Build linear layers with their dense ``weight`` on the meta device (no memory): a quantization
    pass then gives each layer its method's parameters, or a real dense weight where it stays dense."""
    global _WEIGHTS_ON_META
    prev, _WEIGHTS_ON_META = _WEIGHTS_ON_META, enabled
    try:
        yield
    finally:
        _WEIGHTS_ON_META = prev


def _dense_weight(out_features: int, in_features: int) -> torch.Tensor:
    return torch.empty(out_features, in_features, device="meta" if _WEIGHTS_ON_META else None)


def _attach(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


# Loaders receive a tensor or a not-yet-read checkpoint slice (models/loader.SliceSource); both
# support .narrow(dim, start, length), which on a slice reads only that part from disk, and
# ``materialize`` (quantization/base.py) reads one whole.
def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    loaded = materialize(loaded)
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """What every linear layer carries for the CPU GEMM packing and for quantization, with the
    defaults of a dense weight."""

    packable_weight = True  # the worker may swap the weight for a packed CPU GEMM layout
    quant_method = None  # set by models/quantized.py: the layer's weight is quantized, its method multiplies
    quantized = None  # the weight form quant_method multiplies (quantization/base.py's install_quantized)
    checkpoint_param_names: tuple[str, ...] = ()  # the quantized checkpoint tensors it holds (register_params)
    static_input: Optional[tuple[str, float]] = None  # a checkpoint's static activation quantization (kind, scale)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _attach(nn.Parameter(_dense_weight(out_features, in_features), requires_grad=False), default_weight_loader)
        self.bias = (
            _attach(nn.Parameter(torch.empty(out_features), requires_grad=False), default_weight_loader) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward.

    ``output_sizes`` lists the logical sub-matrices packed along the output dim (e.g. gate and up);
    each is split across ranks separately so shard ``i`` of the checkpoint lands at its offset.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        for s in output_sizes:
            if s % self.tp_size:
                raise ValueError(f"output size {s} is not divisible by tensor parallel size {self.tp_size}")
        self.output_sizes = [s // self.tp_size for s in output_sizes]
        out_local = sum(self.output_sizes)
        self.weight = _attach(nn.Parameter(_dense_weight(out_local, in_features), requires_grad=False), self.weight_loader)
        self.bias = (
            _attach(nn.Parameter(torch.empty(out_local), requires_grad=False), self.weight_loader) if bias else None
        )

    def _shard_offset(self, shard_id: Optional[int]) -> tuple[int, int]:
        if shard_id is None:
            return 0, sum(self.output_sizes)
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        offset, size = self._shard_offset(shard_id)
        piece = loaded.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else materialize(loaded)
        if piece.shape[0] != size or piece.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch loading shard {shard_id}: {tuple(loaded.shape)} into {tuple(param.shape)}")
        param.data.narrow(0, offset, size).copy_(materialize(piece))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are replicated when tp size exceeds their number."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        if num_heads % tp_size:
            raise ValueError(f"num_attention_heads ({num_heads}) must be divisible by tensor_parallel_size ({tp_size})")
        self.num_heads = num_heads // tp_size
        if num_kv_heads >= tp_size:
            if num_kv_heads % tp_size:
                raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be divisible by tensor_parallel_size ({tp_size})")
            self.num_kv_heads = num_kv_heads // tp_size
            self.kv_replicas = 1
        else:
            if tp_size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads ({num_kv_heads})")
            self.num_kv_heads = 1
            self.kv_replicas = tp_size // num_kv_heads
        self.head_dim = head_dim
        self._kv_total = num_kv_heads
        sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        super().__init__(hidden, [s * tp_size for s in sizes], bias)
        self.output_sizes = sizes

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        idx = {"q": 0, "k": 1, "v": 2}[shard_id]
        offset, size = self._shard_offset(idx)
        if idx == 0:
            start = self.tp_rank * size
        else:  # rank r uses kv head block r // replicas
            start = (self.tp_rank // self.kv_replicas) * size
        piece = loaded.narrow(0, start, size)
        if piece.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch loading {shard_id}: {tuple(loaded.shape)} into {tuple(param.shape)}")
        param.data.narrow(0, offset, size).copy_(materialize(piece))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products summed with one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp = tp
        if in_features % tp.world_size:
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel size {tp.world_size}")
        self.in_local = in_features // tp.world_size
        self.weight = _attach(nn.Parameter(_dense_weight(out_features, self.in_local), requires_grad=False), self.weight_loader)
        self.bias = (
            _attach(nn.Parameter(torch.empty(out_features), requires_grad=False), default_weight_loader) if bias else None
        )

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        piece = loaded.narrow(1, self.tp.rank * self.in_local, self.in_local) if self.tp.world_size > 1 else loaded
        default_weight_loader(param, piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None) if self.quant_method is not None else linear(x, self.weight)
        y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
