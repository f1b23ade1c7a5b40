"""The worker's adapter slots: the model's linear layers wrapped with ``max_loras`` slots, and the
adapters read from disk kept in an LRU cache in host memory (``max_cpu_loras``).

The scheduler decides which adapter goes into which slot (core/lora_slots.py) and says so in the
step's ``lora_loads``; loading copies this rank's slices of the adapter's A and B from the host
cache into every wrapped layer's slot (read from disk first when the cache does not hold it).
Each step, ``begin_step`` maps the flat batch's rows to slots for all layers at once.
"""
from __future__ import annotations

import logging
import re
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedllm.core.contracts import LoRAHandle
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.lora.batch import LoRAStepState, build_lora_batch
from pagedllm.lora.layers import LoRALinear
from pagedllm.lora.peft_adapter import AdapterWeights, ModelLoRALayout, load_adapter

logger = logging.getLogger(__name__)

# our (fused) module -> the PEFT targets it holds, in output order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_NAME = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)")


class LoRASlotManager:
    def __init__(self, model: nn.Module, hf_config, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layout = ModelLoRALayout.from_hf_config(hf_config)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.tp = get_tp_group()
        self.state = LoRAStepState()
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        self.cpu_cache: OrderedDict[str, AdapterWeights] = OrderedDict()
        self.slot_keys: list[str | None] = [None] * max_loras
        self.num_disk_loads = 0
        self._wrap(model)

    def _wrap(self, model: nn.Module) -> None:
        found = [(name, m) for name, m in model.named_modules() if _NAME.fullmatch(name)]
        for name, module in found:
            layer, kind = _NAME.fullmatch(name).groups()
            targets = _FUSED[kind]
            row = isinstance(module, RowParallelLinear)
            if not (row or isinstance(module, ColumnParallelLinear)) or (kind == "qkv_proj") != isinstance(
                    module, QKVParallelLinear):
                raise ValueError(f"LoRA cannot wrap {name} ({type(module).__name__})")
            fan_in = self.layout.shapes[targets[0]][0]
            if row:
                in_local, out_sizes = module.in_local, [self.layout.shapes[targets[0]][1]]
            else:
                in_local, out_sizes = fan_in, list(module.output_sizes)
            wrapped = LoRALinear(module, targets, out_sizes, in_local, row, self.state, self.max_loras,
                                 self.max_lora_rank, self.tp, self.dtype, self.device)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, wrapped)
            self.layers[(int(layer), kind)] = wrapped
        if len(self.layers) != 4 * self.layout.num_layers:
            raise ValueError(f"LoRA found {len(self.layers)} of the {4 * self.layout.num_layers} projections it wraps "
                             "(q/k/v, o, gate/up, down per layer) in this model")

    # ---- adapters ---------------------------------------------------------------------------
    def _weights(self, handle: LoRAHandle) -> AdapterWeights:
        weights = self.cpu_cache.get(handle.key)
        if weights is not None:
            self.cpu_cache.move_to_end(handle.key)
            return weights
        weights = load_adapter(handle.path, self.layout, self.max_lora_rank, self.dtype)
        self.num_disk_loads += 1
        self.cpu_cache[handle.key] = weights
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        return weights

    def load(self, slot: int, handle: LoRAHandle) -> None:
        """Put ``handle``'s adapter into ``slot`` of every wrapped layer."""
        if self.slot_keys[slot] == handle.key:
            return
        weights = self._weights(handle)
        rank = weights.config.rank
        for (layer, kind), mod in self.layers.items():
            pieces = {}
            for t, target in enumerate(mod.targets):
                ab = weights.tensors.get((layer, target))
                if ab is not None:
                    pieces[t] = self._shard(mod, t, *ab)
            mod.set_slot(slot, rank, pieces)
        self.slot_keys[slot] = handle.key
        logger.debug("LoRA adapter %s (rank %d) loaded into slot %d", handle.name, rank, slot)

    def _shard(self, mod: LoRALinear, t: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a target's A [r, in] and B [out, r], like the base weight's."""
        tp = self.tp
        if tp.world_size == 1:
            return a, b
        if mod.row_parallel:
            return a.narrow(1, tp.rank * mod.in_features, mod.in_features), b
        size = mod.out_sizes[t]
        base = mod.base
        if isinstance(base, QKVParallelLinear) and t > 0:  # k/v: rank r holds kv head block r // replicas
            start = (tp.rank // base.kv_replicas) * size
        else:
            start = tp.rank * size
        return a, b.narrow(0, start, size)

    # ---- the step ---------------------------------------------------------------------------
    def begin_step(self, token_slots: np.ndarray) -> None:
        self.state.batch = build_lora_batch(token_slots, self.device)

    def end_step(self) -> None:
        self.state.batch = None
