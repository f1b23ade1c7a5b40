"""Tensor-parallel group state. With tp_size 1 every collective is the identity."""
from __future__ import annotations

import torch


class TPGroup:
    def __init__(self, rank: int = 0, world_size: int = 1, group=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.cpu_group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_tp = TPGroup()


def get_tp_group() -> TPGroup:
    return _tp


def set_tp_group(group: TPGroup) -> None:
    global _tp
    _tp = group


def init_distributed(rank: int, world_size: int, device: torch.device, timeout_s: float = 120.0) -> TPGroup:
    """torch.distributed through the env:// rendezvous (MASTER_ADDR/MASTER_PORT set by the
    launcher: our executor, or torchrun across nodes). gloo on CPU, NCCL on GPU."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    # Control messages (pickled SchedulerOutputs, sampled ids) always travel over gloo on the CPU.
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    group = TPGroup(rank, world_size, dist.group.WORLD)
    group.cpu_group = cpu_group
    set_tp_group(group)
    return group
