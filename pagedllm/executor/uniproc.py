"""UniprocExecutor: the single worker lives in the engine's own process."""
from __future__ import annotations

from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    def __init__(self, config, hf_config, max_model_len: int, max_num_batched_tokens: int) -> None:
        from pagedllm.worker.worker import Worker

        self.worker = Worker(config, hf_config, max_model_len, max_num_batched_tokens)
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks)
        self.num_blocks = num_blocks

    @property
    def num_forward_tokens(self) -> int:
        return self.worker.runner.num_forward_tokens

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)

    def shutdown(self) -> None:
        pass
