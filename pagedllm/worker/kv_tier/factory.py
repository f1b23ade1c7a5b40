"""Which KV offload tier store a configuration names (``kv_offloading_backend``), built per rank."""
from __future__ import annotations

import torch

from pagedllm.worker.kv_tier.store import KVTierStore, TierBlockLayout


def make_tier_store(config, layout: TierBlockLayout, num_slots: int, rank: int, device: torch.device) -> KVTierStore:
    """The store ``config.kv_offloading_backend`` names, for this rank."""
    backend = config.kv_offloading_backend
    if backend == "native":
        from pagedllm.worker.kv_tier.host import HostTierStore

        return HostTierStore(layout, num_slots, pin_memory=device.type == "cuda")
    if backend == "disk":
        from pagedllm.worker.kv_tier.disk import DiskTierStore

        return DiskTierStore(config, layout, num_slots, rank)
    if backend == "native+disk":
        from pagedllm.worker.kv_tier.disk import DiskTierStore
        from pagedllm.worker.kv_tier.host import HostTierStore
        from pagedllm.worker.kv_tier.spill import SpillingTierStore

        per_rank = int(config.kv_offload_host_size * (1 << 30)) // config.tensor_parallel_size
        host_slots = min(per_rank // layout.bytes_per_block, num_slots)
        if host_slots < 1:
            raise ValueError(f"kv_offload_host_size {config.kv_offload_host_size:g} GiB holds no KV block (one block "
                             f"is {layout.bytes_per_block} bytes per rank)")
        return SpillingTierStore(HostTierStore(layout, host_slots, pin_memory=device.type == "cuda"),
                                 DiskTierStore(config, layout, num_slots, rank))
    raise ValueError(f"unknown kv_offloading_backend {backend!r}")
