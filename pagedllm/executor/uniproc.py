"""UniprocExecutor: the single worker lives in the engine's own process (an executor.base.Executor)."""
from __future__ import annotations

from typing import Optional

from pagedllm.core.contracts import KVTierSpec, ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    num_blocks: int
    max_model_len: int
    sliding_window: Optional[int]
    kv_tier_spec: Optional[KVTierSpec]
    is_dead = False  # an exception in the in-process worker leaves it usable for other requests
    max_concurrent_batches = 1

    def __init__(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int) -> None:
        from pagedllm.distributed.parallel_state import PPGroup, TPGroup, set_pp_group, set_tp_group
        from pagedllm.worker.worker import Worker

        set_tp_group(TPGroup())  # a single rank: every collective is the identity
        set_pp_group(PPGroup())
        self.worker = Worker(config, hf_config, max_model_len, max_num_batched_tokens)
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks)
        self.num_blocks = num_blocks
        self.max_model_len = self.worker.max_model_len  # lowered to what the cache holds if not set
        self.sliding_window = self.worker.kv_sliding_window
        self.kv_tier_spec = self.worker.kv_tier_spec

    @property
    def num_forward_tokens(self) -> int:
        return self.worker.runner.num_forward_tokens

    @property
    def dead_reason(self) -> None:
        return None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)

    @property
    def weight_bytes_per_rank(self) -> list[int]:
        return [sum(p.numel() * p.element_size() for p in self.worker.model.parameters())]

    def shutdown(self) -> None:
        pass
