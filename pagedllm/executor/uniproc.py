"""UniprocExecutor: the single worker lives in the engine's own process (an executor.base.Executor).

``submit`` / ``collect`` (async scheduling, engine/core.py): a step runs on one "device" thread
while the engine's thread schedules the next step and applies the previous one's output; steps
run in submission order (the runner's request states and the KV cache see them as a stream
would), and ``execute`` runs on the calling thread once nothing is in flight.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
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
        self._device: Optional[ThreadPoolExecutor] = None  # started by the first submit
        self._in_flight: deque[Future] = deque()

    @property
    def num_forward_tokens(self) -> int:
        return self.worker.runner.num_forward_tokens

    @property
    def dead_reason(self) -> None:
        return None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._in_flight:
            raise RuntimeError("execute() while submitted steps are in flight: collect() them first")
        return self.worker.execute(scheduler_output)

    def execute_host(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step's host work alone, on the calling thread (executor/simulated.py's runner mode)."""
        return self.worker.execute_host(scheduler_output)

    def idle_work(self, seconds: float) -> bool:
        return self.worker.idle_work(seconds)  # EngineCore calls it only with nothing in flight

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        if self._device is None:
            self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-step")
        self._in_flight.append(self._device.submit(self.worker.execute, scheduler_output))

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (its exception, if it raised)."""
        return self._in_flight.popleft().result()

    @property
    def weight_bytes_per_rank(self) -> list[int]:
        return [sum(p.numel() * p.element_size() for p in self.worker.model.parameters())]

    def shutdown(self) -> None:
        if self._device is not None:
            self._device.shutdown(wait=True)
            self._device = None
        if self.worker.kv_tier is not None:  # the disk tier's writer thread and run directory
            self.worker.kv_tier.close()
            self.worker.kv_tier = None
