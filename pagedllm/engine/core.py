"""EngineCore: schedule -> execute -> update, over the scheduler, KV cache manager and executor,
in one step loop whose depth is a policy (engine/in_flight.py).

Pipeline parallelism (P stages): a step's batch occupies one stage at a time, so the engine keeps
up to P batches in flight (``Pipelined``): it schedules and submits batches while fewer
than P are out, and otherwise collects the oldest one's output. With P batches out every stage
has one to work on in the steady state; more would only queue at stage 0, fewer leaves a stage
idle. A request in a batch in flight is not scheduled again until that batch's output is back
(its next token is not known yet), so each batch takes at most 1/P of the requests (the rest
form the next micro-batches); outputs are applied in submission order.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from pagedllm.config import (EngineConfig, resolve_max_model_len, resolve_max_num_batched_tokens,
                             resolve_max_num_seqs_per_request)
from pagedllm.core.contracts import EngineCoreOutput, SchedulerStats
from pagedllm.core.engine_request import EngineCoreRequest, EngineLimits, StepTiming
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_tier import KVTier
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerLimits
from pagedllm.engine.in_flight import Pipelined, in_flight_policy
from pagedllm.engine.structured_outputs import close_grammar_source, grammar_source
from pagedllm.executor import executor_class
from pagedllm.executor.base import Executor
from pagedllm.models.config_json import load_hf_config
from pagedllm.spec_decode.governor import scheduler_settings

logger = logging.getLogger(__name__)


_FINISH_STATUS = {"abort": RequestStatus.FINISHED_ABORTED, "stop": RequestStatus.FINISHED_STOPPED,
                  "error": RequestStatus.FINISHED_ERROR}


def finish_status(reason: str) -> RequestStatus:
    """The status a front end's finish reason ("abort", "stop", "error") sets in the scheduler."""
    return _FINISH_STATUS[reason]


class EngineCore:
    """``tokenizer`` (optional): for structured outputs' grammars and beam search's stop strings
    (the core decodes nothing else); ``eos_token_ids``: the model's, for the grammars;
    ``executor_factory``: see _make_executor."""

    def __init__(self, config: EngineConfig, hf_config=None, tokenizer=None, eos_token_ids=(),
                 executor_factory=None) -> None:
        self.config = config
        self.hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
        self.max_model_len = resolve_max_model_len(self.hf_config, config.max_model_len)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(config, self.max_model_len)
        self.executor: Executor = self._make_executor(executor_factory)
        if self.executor.max_model_len != self.max_model_len:  # the KV cache holds less: the scheduler's limits follow
            self.max_model_len = self.executor.max_model_len
            self.max_num_batched_tokens = min(self.max_num_batched_tokens,
                                              resolve_max_num_batched_tokens(config, self.max_model_len))
        # How many steps are in flight (engine/in_flight.py): async scheduling's two overlapping
        # steps, micro-batches (one per pipeline stage, or what an asynchronous executor runs at
        # once: executor/simulated.py), or one at a time.
        async_scheduling = config.async_scheduling
        self.batch_depth = 2 if async_scheduling else self.executor.max_concurrent_batches
        tier_spec = self.executor.kv_tier_spec
        tier = (KVTier(tier_spec.num_slots, tier_spec.bytes_per_block, tier_spec.backend) if tier_spec is not None
                else None)
        self.kv_cache_manager = KVCacheManager(self.executor.num_blocks, config.block_size, config.enable_prefix_caching,
                                               sliding_window=self.executor.sliding_window, tier=tier)
        spec_limits, governor = scheduler_settings(config)  # speculative decoding's (none: {}, None)
        limits = SchedulerLimits(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_loras=config.max_loras if config.enable_lora else 0,
            max_loras_per_step=config.max_loras_per_step or 0,
            max_batches_in_flight=1 if async_scheduling else self.batch_depth,
            send_new_token_ids=config.pipeline_parallel_size > 1,  # the last stage samples, the others learn the ids
            scheduling_policy=config.scheduling_policy,
            max_num_seqs_per_request=resolve_max_num_seqs_per_request(config),
            **spec_limits,
        )
        self.tokenizer = tokenizer
        # the scheduler's grammar source (None without a tokenizer: constrained decoding needs one)
        self.structured = grammar_source(tokenizer, self.hf_config.vocab_size, eos_token_ids, config)
        self.scheduler = Scheduler(limits, self.kv_cache_manager, spec_governor=governor, grammars=self.structured)
        self.last_timing = StepTiming()  # the last step's phases
        self._phase = [0.0, 0.0, 0.0]
        self._last_mark = 0.0
        self._batch_queue: deque = deque()  # the steps in flight, oldest first: (SchedulerOutput, mode, tag)
        self.in_flight = in_flight_policy(self, async_scheduling, self.batch_depth)

    def _make_executor(self, factory=None) -> Executor:
        """``factory(config, hf_config, max_model_len, max_num_batched_tokens)``: another executor
        (executor/simulated.py's simulated device) instead of the configured one."""
        make = factory if factory is not None else executor_class(self.config)
        return make(self.config, self.hf_config, self.max_model_len, self.max_num_batched_tokens)

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (validated by the front end's InputProcessor): its children, or its
        beam group's root."""
        for req in self._core_requests(request):
            self.scheduler.add_request(req)

    def _core_requests(self, r: EngineCoreRequest) -> list[Request]:
        # priority: refused by the server unless the policy is "priority"; mm_features: its images
        # (placeholder spans hashed into its blocks, the encoder's inputs); deadline: every child
        # (or the beam group) ends with it
        common = dict(max_tokens=r.max_tokens, arrival_time=r.arrival_time, cache_salt=r.cache_salt,
                      priority=r.priority, mm_features=r.mm_features, deadline=r.deadline)
        if r.beam is not None:
            from pagedllm.engine.beam_search import make_beam_group

            req = Request(r.request_id, r.prompt_token_ids, r.sampling_params, **common)
            req.beam = make_beam_group(r, self.tokenizer)
            return [req]
        parent_id = r.request_id if r.num_children > 1 else None  # the children share the request's running slots
        return [Request(cid, r.prompt_token_ids, r.child_params(i), lora=r.lora, parent_id=parent_id, **common)
                for i, cid in enumerate(r.child_ids)]

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED
                       ) -> list[EngineCoreOutput]:
        """Finish these (core) requests; the final outputs of the beam searches among them (their
        live beams so far)."""
        return self.scheduler.abort_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def idle_work(self, seconds: float) -> bool:
        """While nothing runs: the executor's idle work (the CPU KV cache's prefault) for about
        ``seconds``; whether any is left. The loop that calls it takes requests between calls."""
        return not self.has_unfinished_requests() and self.executor.idle_work(seconds)

    def _update(self, so, runner_output) -> list[EngineCoreOutput]:
        try:  # each request is isolated inside; this is the last resort: the step's requests fail, not the engine
            return self.scheduler.update_from_output(so, runner_output)
        except Exception:
            logger.exception("applying a step's output failed (%d requests); they finish with \"error\"",
                             len(so.num_scheduled_tokens))
            return [o for rid in so.num_scheduled_tokens for o in self.scheduler.fail_request(rid)]

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        self._phase = [0.0, 0.0, 0.0]  # schedule, execute, update (perf_counter marks, see _mark)
        self._last_mark = t0
        outputs = self._step()
        outputs = self.scheduler.take_failed() + outputs  # finished while scheduled: a unit raised, a grammar failed
        sched, execute, update = self._phase
        self.last_timing = StepTiming(schedule=sched, execute=execute, update=update,
                                      total=time.perf_counter() - t0)
        return outputs

    def _mark(self, phase: int) -> None:
        """Charge the time since the last mark to ``phase`` (0 schedule, 1 execute, 2 update)."""
        now = time.perf_counter()
        self._phase[phase] += now - self._last_mark
        self._last_mark = now

    def _step(self) -> list[EngineCoreOutput]:
        """The one step loop: schedule and submit a step while fewer than the policy's depth are
        in flight (engine/in_flight.py), else (or when nothing new was worth submitting) land the
        oldest one and apply its output. A step submitted under another mode (async scheduling's
        overlapped steps before a synchronous one) lands under the mode it was launched with."""
        mode, queue = self.in_flight.mode(), self._batch_queue
        if len(queue) < mode.depth:
            so = self.scheduler.schedule()
            self._mark(0)
            if mode.submits(so):
                queue.append((so, mode, mode.launch(so)))
                self._mark(1)
                if so.num_scheduled_tokens and len(queue) < mode.depth:
                    return []  # room for another step: this one's output lands with a later call
        return self._land_oldest() if queue else []

    def _land_oldest(self) -> list[EngineCoreOutput]:
        so, mode, tag = self._batch_queue.popleft()
        try:
            runner_output = mode.land(so)
        except Exception:
            if self.executor.is_dead:  # e.g. a tensor-parallel rank is gone: nothing to save
                raise
            return mode.failed(so, tag)
        self._mark(1)
        outputs = self._update(so, runner_output)
        mode.applied(tag)
        self._mark(2)
        return outputs

    def _isolate(self, failed) -> list[EngineCoreOutput]:
        """A step raised: one request's input is the likely cause, so only it should fail. Its
        requests are rewound (preempted, half-written blocks uncached) and retried at once in two
        halves, recursively: a half that runs goes on as usual, a lone request that still fails
        finishes with "error". At most 2 x log2(batch) extra steps, only after a failure."""
        if len(failed.num_scheduled_tokens) <= 1:
            return self.scheduler.fail_step(failed)
        ids = self.scheduler.rewind(failed)
        half = len(ids) // 2
        outputs: list[EngineCoreOutput] = []
        for group in (ids[:half], ids[half:]):
            so = self.scheduler.schedule(only=set(group))
            if not so.has_device_work:
                continue
            try:
                runner_output = self.executor.execute(so)
            except Exception:
                if self.executor.is_dead:
                    raise
                outputs.extend(self._isolate(so))
                continue
            outputs.extend(self._update(so, runner_output))
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def snapshot(self) -> dict:
        """The scheduler's running and waiting requests (plain dicts) and the KV block map
        (KVCacheManager.block_states), for the server's dashboard."""
        scheduler, kv = self.scheduler, self.kv_cache_manager
        for _ in range(3):  # called from another thread in-process: a list may change while copied
            try:
                running, waiting = list(scheduler.running), list(scheduler.waiting)
                states = kv.block_states()
                break
            except RuntimeError:
                continue
        else:
            running, waiting, states = [], [], b""

        def describe(req) -> dict:
            try:
                blocks = len(kv.get_block_ids(req.request_id))
            except KeyError:
                blocks = 0
            return {"id": req.request_id, "state": req.status.name.lower(), "arrival_time": req.arrival_time,
                    "prompt_tokens": req.num_prompt_tokens, "output_tokens": req.num_output_tokens,
                    "max_tokens": req.max_tokens, "cached_tokens": max(0, req.num_cached_tokens), "blocks": blocks}

        return {"running": [describe(r) for r in running], "waiting": [describe(r) for r in waiting],
                "block_states": states}

    def limits(self) -> EngineLimits:
        """What the front end checks requests against."""
        c = self.config
        return EngineLimits(self.max_model_len, c.max_num_seqs, self.max_num_batched_tokens, self.num_blocks,
                            c.block_size, c.max_n, pipeline_parallel=isinstance(self.in_flight, Pipelined),
                            speculative=c.speculative_config is not None, step_cost=self._step_cost())

    def _step_cost(self):
        """The per-rank performance model of a step (metrics/perf_model.py), from the config and
        the weights loaded; None where the checkpoint's config lacks a decoder's fields."""
        from pagedllm.attention.kv_quant import SCALE_DTYPE, kv_quant, kv_storage_dtype
        from pagedllm.metrics.perf_model import step_cost_model
        from pagedllm.worker.worker import resolve_device, resolve_dtype

        c, quant = self.config, kv_quant(self.config.kv_cache_dtype)
        dtype = kv_storage_dtype(c.kv_cache_dtype, resolve_dtype(c.dtype, self.hf_config, resolve_device(c.device)))
        try:
            return step_cost_model(self.hf_config, c.tensor_parallel_size * c.pipeline_parallel_size,
                                   self.executor.weight_bytes_per_rank, dtype.itemsize,
                                   SCALE_DTYPE.itemsize if quant is not None else 0)
        except AttributeError:
            return None

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        close_grammar_source(self.structured)
        self.executor.shutdown()
