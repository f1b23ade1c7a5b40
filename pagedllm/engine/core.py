"""EngineCore: schedule -> execute -> update, over the scheduler, KV cache manager and executor.

Pipeline parallelism (P stages): a step's batch occupies one stage at a time, so the engine keeps
up to P batches in flight (``_step_pipelined``): it schedules and submits batches while fewer
than P are out, and otherwise collects the oldest one's output. With P batches out every stage
has one to work on in the steady state; more would only queue at stage 0, fewer leaves a stage
idle. A request in a batch in flight is not scheduled again until that batch's output is back
(its next token is not known yet), so each batch takes at most 1/P of the requests (the rest
form the next micro-batches); outputs are applied in submission order.
"""
from __future__ import annotations

import logging
from collections import deque

from pagedllm.config import EngineConfig, resolve_max_model_len, resolve_max_num_batched_tokens
from pagedllm.core.contracts import EngineCoreOutput, SchedulerStats
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.executor.base import Executor
from pagedllm.models.config_json import load_hf_config

logger = logging.getLogger(__name__)


def _spec_limits(config: EngineConfig) -> dict:
    spec = config.speculative_config
    if spec is None:
        return {}
    disable = spec.disable_by_batch_size
    if disable is None:  # auto_disable's measured default (spec_decode/governor.py): 16 on CPU, none elsewhere
        from pagedllm.spec_decode.governor import default_disable_batch_size

        disable = default_disable_batch_size(config.device) if spec.auto_disable else 0
    return {"num_spec_tokens": spec.num_speculative_tokens, "spec_disable_batch_size": disable}


class EngineCore:
    def __init__(self, config: EngineConfig, hf_config=None) -> None:
        self.config = config
        self.hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
        self.max_model_len = resolve_max_model_len(self.hf_config, config.max_model_len)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(config, self.max_model_len)
        self.executor: Executor = self._make_executor()
        if self.executor.max_model_len != self.max_model_len:  # the KV cache holds less: the scheduler's limits follow
            self.max_model_len = self.executor.max_model_len
            self.max_num_batched_tokens = min(self.max_num_batched_tokens,
                                              resolve_max_num_batched_tokens(config, self.max_model_len))
        self.kv_cache_manager = KVCacheManager(self.executor.num_blocks, config.block_size, config.enable_prefix_caching,
                                               sliding_window=self.executor.sliding_window)
        limits = SchedulerLimits(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_loras=config.max_loras if config.enable_lora else 0,
            max_loras_per_step=config.max_loras_per_step or 0,
            **_spec_limits(config),
        )
        self.scheduler = Scheduler(limits, self.kv_cache_manager)
        spec = config.speculative_config
        if spec is not None and spec.auto_disable:  # plain steps while measured costs say speculation loses
            from pagedllm.spec_decode.governor import SpecGovernor

            # Wall time, also on CPU: the process's CPU time counts OpenMP threads spinning through
            # a speculative step's longer Python stretches, and the main thread's CPU time misses
            # work on the others; with either, a quiet 2-thread CPU turned a 1.7x n-gram and a
            # 1.2x EAGLE speed-up off (docs/benchmarks.md, issue 20).
            self.scheduler.spec_governor = SpecGovernor()
        self.structured = None  # StructuredOutputs, set by the LLMEngine (it needs the tokenizer)
        self.pp_size = config.pipeline_parallel_size
        self._batch_queue: deque = deque()  # pipeline parallel: submitted SchedulerOutputs, oldest first

    def _make_executor(self) -> Executor:
        args = (self.config, self.hf_config, self.max_model_len, self.max_num_batched_tokens)
        if self.config.distributed_executor_backend == "ray":
            from pagedllm.executor.ray_executor import RayExecutor

            return RayExecutor(*args)
        if self.config.tensor_parallel_size > 1 or self.config.pipeline_parallel_size > 1:
            from pagedllm.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor(*args)
        from pagedllm.executor.uniproc import UniprocExecutor

        return UniprocExecutor(*args)

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    def add_request(self, request: Request) -> None:
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is {request.num_prompt_tokens} tokens, but max_model_len is {self.max_model_len}: "
                "there is no room to generate a token"
            )
        if self.pp_size > 1 and getattr(request, "beam", None) is not None:
            raise ValueError("beam search does not support pipeline_parallel_size > 1 yet")
        if request.sampling_params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs needs the engine's tokenizer (the engine was started without one)")
            if getattr(self.config, "speculative_config", None) is not None:  # the mask covers one token a step
                raise ValueError("structured_outputs cannot be combined with speculative decoding on this engine yet")
            self.structured.add(request)  # compiled off the step loop; scheduled once compiled
            return
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[str]:
        request_ids = list(request_ids)
        compiling = self.structured.abort(request_ids) if self.structured is not None else []
        return compiling + self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._batch_queue)
                or bool(self.structured is not None and self.structured.compiling))

    def _execute(self, so):
        grammar = self.structured.grammar(so, self.scheduler) if self.structured is not None else None
        if grammar is None:
            return self.executor.execute(so)
        return self.executor.execute(so, grammar=grammar)

    def _update(self, so, runner_output) -> list[EngineCoreOutput]:
        try:  # each request is isolated inside; this is the last resort: the step's requests fail, not the engine
            outputs = self.scheduler.update_from_output(so, runner_output)
        except Exception:
            logger.exception("applying a step's output failed (%d requests); they finish with \"error\"",
                             len(so.num_scheduled_tokens))
            outputs = [o for rid in so.num_scheduled_tokens for o in self.scheduler.fail_request(rid)]
        return self.structured.after_update(outputs, self.scheduler) if self.structured is not None else outputs

    def step(self) -> list[EngineCoreOutput]:
        admitted: list[EngineCoreOutput] = []
        if self.structured is not None and self.structured.compiling:
            admitted = self.structured.admit(self.scheduler, idle=not self.scheduler.has_unfinished_requests())
        if self.pp_size > 1:
            return admitted + self._step_pipelined()
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self._execute(scheduler_output)
        except Exception:
            if self.executor.is_dead:  # e.g. a tensor-parallel rank is gone: nothing to save
                raise
            logger.exception("step failed (%d requests); isolating the request that caused it",
                             len(scheduler_output.num_scheduled_tokens))
            return admitted + self._isolate(scheduler_output)
        return admitted + self._update(scheduler_output, runner_output)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Submit a new batch while fewer than pipeline_parallel_size are in flight; else (or
        when nothing new can be scheduled) collect the oldest batch's output. A failure here is
        the engine's: the stages are out of step, so no request is retried."""
        queue, sched = self._batch_queue, self.scheduler
        if len(queue) < self.pp_size:
            # micro-batches split the requests: each takes at most 1/P of them, so the next batch
            # has requests that are not in flight (with one batch of all of them, stages would idle)
            sched.max_batch_reqs = -(-min(len(sched.running) + len(sched.waiting), self.config.max_num_seqs)
                                     // self.pp_size)
            so = sched.schedule()
            if so.num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                grammar = self.structured.grammar(so, self.scheduler) if self.structured is not None else None
                self.executor.submit(so, grammar)
                queue.append(so)
                self.scheduler.in_flight.update(so.num_scheduled_tokens)
                if so.num_scheduled_tokens and len(queue) < self.pp_size:
                    return []  # room for another batch: its output is collected later
        if not queue:
            return []
        so = queue.popleft()
        runner_output = self.executor.collect()
        self.scheduler.in_flight.difference_update(so.num_scheduled_tokens)
        return self._update(so, runner_output)

    def _isolate(self, failed) -> list[EngineCoreOutput]:
        """A step raised: one request's input is the likely cause, so only it should fail. Its
        requests are rewound (preempted, half-written blocks uncached) and retried at once in two
        halves, recursively: a half that runs goes on as usual, a lone request that still fails
        finishes with "error". At most 2 x log2(batch) extra steps, only after a failure."""
        if len(failed.num_scheduled_tokens) <= 1:
            outputs = self.scheduler.fail_step(failed)
            return self.structured.after_update(outputs, self.scheduler) if self.structured is not None else outputs
        ids = self.scheduler.rewind(failed)
        half = len(ids) // 2
        outputs: list[EngineCoreOutput] = []
        for group in (ids[:half], ids[half:]):
            so = self.scheduler.schedule(only=set(group))
            if not so.num_scheduled_tokens:
                continue
            try:
                runner_output = self._execute(so)
            except Exception:
                if self.executor.is_dead:
                    raise
                outputs.extend(self._isolate(so))
                continue
            outputs.extend(self._update(so, runner_output))
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.manager.shutdown()
        self.executor.shutdown()
