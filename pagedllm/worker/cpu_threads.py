"""CPU threads of one rank: how many, and which cores they run on (config.cpu_threads[_bind])."""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from pagedllm.config import EngineConfig, cpu_bind_for_rank

logger = logging.getLogger(__name__)


def configure_cpu_threads(config: EngineConfig, rank: int, world_size: int) -> Optional[int]:
    """Bind this process to its CPUs (if asked) and set torch's intra-op thread count.

    Called before the model is built, so the OpenMP pool is created afterwards and its threads
    inherit the binding. With one rank and nothing asked, the process keeps torch's default
    (every core it may use). Returns the thread count set, or None if left alone.
    """
    cpus = cpu_bind_for_rank(config.cpu_threads_bind, rank, world_size)
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as e:
            raise ValueError(f"cpu_threads_bind: cannot bind rank {rank} to CPUs {cpus}: {e}") from e
    threads = config.cpu_threads
    if threads is None and cpus is not None:
        threads = len(cpus)
    if threads is None and world_size > 1:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    if threads is not None:
        torch.set_num_threads(threads)
        logger.info("rank %d: %d CPU threads%s", rank, threads, f" bound to CPUs {cpus}" if cpus else "")
    return threads
