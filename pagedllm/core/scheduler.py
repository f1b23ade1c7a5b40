"""Scheduler: continuous batching under a per-step token budget, as one loop over scheduling units.

There is no prefill phase and no decode phase: each request has ``num_computed_tokens`` that
catches up with ``num_tokens`` (prompt + outputs). Every step serves the running batch first
(decodes and unfinished prefill chunks, in the policy's order), then admits waiting units while
the token budget, ``max_num_seqs`` and the KV cache allow. The loop knows four seams, each a
small Protocol with its implementations beside it:
- units (core/scheduling_units.py): a plain request, a beam group (core/beam_scheduling.py) --
  what a unit takes from the budget, how it allocates, what its results do;
- the policy (core/scheduling_policy.py): queue order and the preemption victim (fcfs, priority);
- the look-ahead (core/look_ahead.py): slots a decoding request reserves (speculative decoding);
- admission constraints (core/admission.py): LoRA slots, batches in flight (pipeline parallelism,
  an asynchronous executor), one request's share of the running slots.
Requests with an output constraint are units of their own type (core/grammar_wait.py): they wait
in the queue as WAITING_FOR_GRAMMAR until the grammar source says their grammar is compiled, and
the step's bitmask (of those that sample) travels in SchedulerOutput.grammar.
When a running unit cannot get a block, ``make_room`` (the one preemption routine) preempts the
policy's victim -- its whole unit loses its blocks, its computed count resets, it waits again --
until the allocation succeeds or the unit itself was the victim.
"""
from __future__ import annotations

import logging
import sys
import time
from collections import deque
from itertools import repeat
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, TypeVar

from pagedllm.core.admission import AdmissionConstraint, LoRASlots, InFlightBatches, make_constraints
from pagedllm.core.beam_scheduling import BeamUnit
from pagedllm.core.grammar_wait import GrammarSource, GrammarUnit, no_tokenizer_for_structured_outputs
from pagedllm.core.deadlines import DeadlineWatch
from pagedllm.core.contracts import (
    CachedRequestData,
    EngineCoreOutput,
    NO_BLOCKS,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.look_ahead import make_look_ahead
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_table import ALLOCATE, NO_ALLOCATION, UNIT_PATH, RequestTable
from pagedllm.core.scheduling_policy import make_policy
from pagedllm.core.scheduling_units import BLOCKED, SET_ASIDE, RequestUnit, SchedulingUnit, StepPlan

T = TypeVar("T")
logger = logging.getLogger(__name__)
FAILED = "failed"  # a unit raised while it was scheduled: it finished with "error" (see _run_unit)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap beyond the budget
    max_loras: int = 0  # LoRA adapter slots on the workers (0 = LoRA off)
    max_loras_per_step: int = 0  # most distinct adapters in one step (0 = max_loras)
    num_spec_tokens: int = 0  # speculative decoding: draft slots per decoding request (0 = off)
    spec_disable_batch_size: int = 0  # no drafts while this many requests run (0 = never)
    # > 1: batches in flight at once (pipeline stages, an asynchronous executor), each with at most
    # 1/this of the requests, none of a batch still in flight
    max_batches_in_flight: int = 1
    # pipeline parallelism: workers learn sampled ids from the diffs (CachedRequestData.new_token_ids)
    send_new_token_ids: bool = False
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (core/scheduling_policy.py)
    max_num_seqs_per_request: int = 0  # one request's sequences running at once (0: up to max_num_seqs)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv_cache_manager: KVCacheManager, spec_governor=None,
                 constraints: Iterable[AdmissionConstraint] = (), grammars: Optional[GrammarSource] = None) -> None:
        """``grammars``: where constrained requests' grammars compile and match (None: such
        requests are refused)."""
        self.limits = limits
        self.kv = kv_cache_manager
        self.policy = make_policy(limits.scheduling_policy)
        self.look_ahead = make_look_ahead(limits.num_spec_tokens, limits.spec_disable_batch_size,
                                          limits.max_model_len, kv_cache_manager, spec_governor)
        self.constraints: list[AdmissionConstraint] = list(constraints) + make_constraints(
            limits.max_loras, limits.max_loras_per_step, limits.max_batches_in_flight, limits.max_num_seqs,
            limits.max_num_seqs_per_request)
        # LoRA's AdapterSlots and pipeline parallelism's in-flight set, for the engine, stats and tests
        self.lora_slots = next((c.slots for c in self.constraints if isinstance(c, LoRASlots)), None)
        self._pipeline = next((c for c in self.constraints if isinstance(c, InFlightBatches)), None)
        # a request's most new tokens a step (long_prefill_token_threshold; 0: the budget alone)
        threshold = limits.long_prefill_token_threshold
        self._prefill_cap = threshold if threshold > 0 else sys.maxsize
        self.requests: dict[str, Request] = {}
        self.table = RequestTable(max(8, limits.max_num_seqs))  # plain requests' rows (core/request_table.py)
        kv_cache_manager.track_row(self.table.capacity - 1)
        # the decode rows may be scheduled in bulk (workers learn no ids from the diffs, no window)
        self._bulk_decode = not limits.send_new_token_ids and kv_cache_manager.sliding_window is None
        self.beam_groups: dict[str, BeamUnit] = {}  # units known by a group id (= the request id of a beam search)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell workers next step
        self._preempted_ids: set[str] = set()  # workers drop these next step (preempted or rewound)
        self._sent_to_workers: dict[str, int] = {}  # request id -> the tokens the workers hold of it
        self._failed: list[EngineCoreOutput] = []  # finished while scheduled, for take_failed()
        self.deadlines = DeadlineWatch()  # requests carrying a deadline (core/deadlines.py)
        self.num_expired = 0  # requests ended by their deadline
        self.grammars = grammars
        self.num_preemptions = 0
        self.num_waiting_deferred = 0  # waiting requests the last step set aside (SchedulerStats)
        self.num_scheduled_tokens_total = 0
        self.num_scheduled_rows_total = 0  # requests scheduled, summed over steps
        self.num_attention_pairs_total = 0  # (query token, context token) pairs attended
        self.num_context_tokens_total = 0  # tokens whose KV each step's rows read (context + new)
        self.num_steps = 0
        self.num_batched_reqs_max = 0

    @property
    def in_flight(self) -> set[str]:
        """Requests in a submitted batch whose output is not back (pipeline parallelism, async executors)."""
        return self._pipeline.in_flight if self._pipeline is not None else set()

    @property
    def spec_governor(self):
        return self.look_ahead.governor

    @spec_governor.setter
    def spec_governor(self, governor) -> None:
        self.look_ahead.governor = governor

    @property
    def spec_stats(self) -> list[int]:
        """Speculative decoding: verification rows with drafts, drafts, accepted drafts."""
        return self.look_ahead.counts

    # ---- admission --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.lora is not None and self.lora_slots is None:
            raise ValueError("this engine was started without LoRA (enable_lora)")
        if request.beam is not None:
            request.beam.start(request)
            request.unit = self.beam_groups[request.request_id] = BeamUnit(request.beam)
        elif request.sampling_params.structured_outputs is not None:
            if self.grammars is None:
                raise no_tokenizer_for_structured_outputs()
            self.grammars.submit(request)  # compiled off the step loop; admitted once its grammar is ready
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            request.unit = GrammarUnit(request, self.grammars)
        else:
            request.unit = RequestUnit(request)
            self.kv.track_row(self.table.add(request, self.limits.max_model_len))
        self.requests[request.request_id] = request
        self.policy.enqueue(self.waiting, request)
        self.deadlines.add(request.request_id, request.deadline)

    # ---- steps in flight (the engine core tells; the scheduler writes its own state) --------
    def mark_pending(self, so: SchedulerOutput) -> list[Request]:
        """Async scheduling submitted ``so``: its requests that sample have one more token in
        flight (``Request.num_pending``) until ``settle_pending``; returns them."""
        requests, sampling = self.requests, []
        for rid in so.num_scheduled_tokens:
            req = requests[rid]
            if req.num_computed_tokens >= req.num_tokens + req.num_pending:
                req.num_pending += 1
                sampling.append(req)
        return sampling

    @staticmethod
    def settle_pending(sampling: list[Request], all_of_them: bool = False) -> None:
        """Their step's output is applied (``all_of_them``: the steps in flight were abandoned)."""
        for req in sampling:
            req.num_pending = 0 if all_of_them else req.num_pending - 1

    def batch_submitted(self, so: SchedulerOutput) -> None:
        """A micro-batch is in flight (pipeline stages; only with ``max_batches_in_flight`` > 1):
        its requests wait for its output."""
        self._pipeline.in_flight.update(so.num_scheduled_tokens)

    def batch_returned(self, so: SchedulerOutput) -> None:
        self._pipeline.in_flight.difference_update(so.num_scheduled_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._failed)

    def take_failed(self) -> list[EngineCoreOutput]:
        """The outputs of requests that finished while they were scheduled (once each): "error"
        when a unit raised or a grammar did not compile, "abort" when a deadline passed."""
        failed, self._failed = self._failed, []
        return failed

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self, only: Optional[set[str]] = None) -> SchedulerOutput:
        """``only``: schedule just these requests (the others wait a step), used to find the
        request that made a step fail."""
        if self.deadlines and only is None:
            self._expire(time.monotonic())
        plan = StepPlan(self.limits.max_num_batched_tokens, only)
        if not self.running and self.grammars is not None and self.grammars.num_compiling >= len(self.waiting):
            self.grammars.wait(0.05)  # nothing can run until a grammar is ready: wait for one, briefly
        for c in self.constraints:
            c.start_step(len(self.running), len(self.waiting))
        self.look_ahead.start_step(len(self.running))
        self._schedule_running(plan)
        self.num_waiting_deferred = 0
        if not plan.num_preempted:  # memory is tight: admit nobody this step
            self._admit_waiting(plan)
        return self._close_step(plan)

    def _expire(self, now: float) -> None:
        """End the requests (beam groups) past their deadline, as an abort would, and tell their
        callers: a plain request's output ends it with "abort" (a beam search's, with its live
        beams so far)."""
        def live(rid: str) -> bool:
            return rid in self.requests or rid in self.beam_groups

        for rid in self.deadlines.expired(now, live):
            logger.info("request %s: past its deadline; it finishes with \"abort\"", rid)
            self.num_expired += 1
            try:
                done = self._finish_units([rid], RequestStatus.FINISHED_ABORTED)
            except Exception:
                logger.exception("request %s: ending it at its deadline raised", rid)
                self._failed.extend(self.fail_request(rid))
                continue
            for uid, out in done:
                self._failed.append(out if out is not None else EngineCoreOutput(uid, [], finish_reason="abort"))

    def _batch_full(self, plan: StepPlan) -> bool:
        return plan.budget <= 0 or any(c.batch_full(len(plan.num_scheduled)) for c in self.constraints)

    def _held_back(self, unit: SchedulingUnit, plan: StepPlan) -> bool:
        return plan.excludes(unit) or any(c.holds_back(unit) for c in self.constraints)

    def _schedule_running(self, plan: StepPlan) -> None:
        running = self.running
        checked = bool(self.constraints) or plan.only is not None  # else only the budget limits the loop
        # the plain decode rows, found for the whole batch at once (valid while no unit leaves it)
        decode = (self.table.decode_rows(running, self.kv.room)
                  if running and self._bulk_decode and not checked and not self.look_ahead.drafts else None)
        num_running = len(running)
        i = 0
        while i < len(running) and plan.budget > 0:
            if decode is not None and len(running) == num_running and decode[i]:
                if decode[i] == NO_ALLOCATION:  # a run of rows that change nothing but counts: at once
                    i = self._take_decode_run(running, i, decode, plan)
                    continue
                if self._take_decode_row(running[i], plan, True):
                    i += 1
                    continue
            unit = running[i].unit
            n = len(unit.requests)
            if checked and self._batch_full(plan):
                break
            if checked and self._held_back(unit, plan):
                i += n
                continue
            result = self._run_unit(unit, plan, unit.schedule_running)
            if result == FAILED:  # it left the running batch: the next unit is at i now
                if i < len(running) and running[i].unit is unit:  # its cleanup failed too: step over it
                    i += n
                continue
            if not result:
                break  # it preempted itself: nothing after it is running anymore
            i += n

    def _take_decode_row(self, req: Request, plan: StepPlan, allocate: bool) -> bool:
        """What RequestUnit.schedule_running does for a plain decode row; False when its slot
        could not be allocated (no room, or the allocation raised): the unit's own path then
        makes room (or fails it)."""
        new_block_ids = []
        if allocate:
            try:
                new_block_ids = self.kv.allocate_slots(req, 1)
            except Exception:
                return False
            if new_block_ids is None:
                return False
        rid = req.request_id
        plan.num_scheduled[rid] = 1
        plan.budget -= 1
        plan.cached_reqs.append(CachedRequestData(rid, new_block_ids, req.num_computed_tokens))
        return True

    @staticmethod
    def _take_decode_run(running: list[Request], i: int, decode: list[int], plan: StepPlan) -> int:
        """``_take_decode_row`` for the plain decode rows from ``i`` up to the next row that is
        not one (or the budget's end), in C-level passes; the index after them."""
        j = i + 1
        end = min(len(decode), i + plan.budget)
        try:
            j = decode.index(UNIT_PATH, j, end)
        except ValueError:
            j = end
        try:
            j = decode.index(ALLOCATE, i + 1, j)
        except ValueError:
            pass
        reqs = running[i:j]
        rids = [r.request_id for r in reqs]
        plan.num_scheduled.update(dict.fromkeys(rids, 1))
        plan.budget -= j - i
        plan.cached_reqs.extend(map(CachedRequestData, rids, repeat(NO_BLOCKS),
                                    [r.num_computed_tokens for r in reqs]))
        return j

    def _admit_waiting(self, plan: StepPlan) -> None:
        set_aside: list[Request] = []
        while self.waiting and not self._batch_full(plan):
            unit = self.waiting[0].unit
            if self._held_back(unit, plan):  # e.g. in flight: preempted while its batch runs
                set_aside.extend(self.waiting.popleft() for _ in unit.requests)
                continue
            if len(self.running) + len(unit.requests) > self.limits.max_num_seqs:
                break
            verdict = self._run_unit(unit, plan, unit.admit)
            if verdict == FAILED and self.waiting and self.waiting[0].unit is unit:  # its cleanup failed too
                verdict = SET_ASIDE
            if verdict == BLOCKED:
                break
            if verdict == SET_ASIDE:
                set_aside.extend(self.waiting.popleft() for _ in unit.requests)
        self.waiting.extendleft(reversed(set_aside))
        self.num_waiting_deferred = len(set_aside)

    def _run_unit(self, unit: SchedulingUnit, plan: StepPlan, call: Callable[["Scheduler", StepPlan], T]):
        """``call(self, plan)`` (the unit's schedule_running or admit). A raise there is that unit's
        alone (a constraint, an adapter, a plug-in failing for one request): what it put in the
        plan is taken out, it finishes with "error" (its blocks freed and uncached) and FAILED is
        returned; the step goes on with the others."""
        marks = (len(plan.num_scheduled), len(plan.new_reqs), len(plan.cached_reqs), len(plan.block_copies),
                 len(plan.masked), plan.budget)
        try:
            return call(self, plan)
        except Exception:
            logger.exception("request %s: scheduling it failed; it finishes with \"error\"", unit.unit_id)
            n_sched, n_new, n_cached, n_copies, n_masked, plan.budget = marks
            for rid in list(plan.num_scheduled)[n_sched:]:
                del plan.num_scheduled[rid]
                plan.spec_slots.pop(rid, None)
            del plan.new_reqs[n_new:], plan.cached_reqs[n_cached:], plan.block_copies[n_copies:], plan.masked[n_masked:]
            self._failed.extend(self.fail_request(unit.unit_id))
            return FAILED

    def _close_step(self, plan: StepPlan) -> SchedulerOutput:
        pairs = context = 0  # the step's attention (query, key) pairs x 2, and context tokens (metrics/perf_model.py)
        for rid, n in plan.num_scheduled.items():
            req = self.requests[rid]
            c = req.num_computed_tokens
            req.num_computed_tokens = c + n
            context += c
            pairs += n * (2 * c + n + 1)
        for nr in plan.new_reqs:
            self._sent_to_workers[nr.req_id] = len(nr.token_ids)
        total = sum(plan.num_scheduled.values())
        self.num_scheduled_tokens_total += total
        self.num_attention_pairs_total += pairs // 2
        self.num_context_tokens_total += context + total
        self.num_scheduled_rows_total += len(plan.num_scheduled)
        if total:
            self.num_steps += 1
            self.num_batched_reqs_max = max(self.num_batched_reqs_max, len(plan.num_scheduled))
        self.look_ahead.end_step(len(plan.num_scheduled), len(plan.spec_slots), total)
        extra = {k: v for c in self.constraints for k, v in c.step_output().items()}
        out = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=frozenset(self._finished_ids),
            preempted_req_ids=frozenset(self._preempted_ids),
            num_spec_slots=plan.spec_slots,
            block_copies=tuple(plan.block_copies),
            kv_transfers=self.kv.take_transfers(),
            grammar=self.grammars.bitmask(plan.masked) if plan.masked else None,
            **extra,
        )
        self._finished_ids.clear()
        self._preempted_ids.clear()
        return out

    # ---- what units use ---------------------------------------------------------------------
    def cap(self, num_new: int, budget: int) -> int:
        return min(num_new, self._prefill_cap, budget)

    def fits_step(self, unit: SchedulingUnit) -> bool:
        return not self.constraints or all(c.fits_step(unit) for c in self.constraints)

    def acquire(self, unit: SchedulingUnit) -> bool:
        """Every constraint's hold for a waiting unit, or none (what was taken is given back)."""
        for k, c in enumerate(self.constraints):
            if not c.acquire(unit):
                for r in unit.requests:
                    for taken in self.constraints[:k]:
                        taken.release(r)
                return False
        return True

    def release(self, req: Request) -> None:
        for c in self.constraints:
            c.release(req)

    def make_room(self, unit: SchedulingUnit, allocate: Callable[[], Optional[T]], plan: StepPlan) -> Optional[T]:
        """The one preemption routine: ``allocate()`` until it succeeds (not None), preempting the
        policy's victim (its whole unit) after each failure; None when ``unit`` was the victim."""
        while True:
            result = allocate()
            if result is not None:
                return result
            victim = self.policy.victim(self.running)
            self._preempt(victim)
            plan.num_preempted += 1
            if victim.unit is unit:
                return None

    def _preempt(self, req: Request, uncache: bool = False, count: bool = True) -> None:
        """``req``'s unit: its requests lose their blocks (``uncache``: those registered this step
        leave the prefix cache) and wait again, together; workers drop them with the next step."""
        unit = req.unit
        reqs = list(unit.requests)
        self.drop_from_queues(unit)
        for r in reversed(reqs):
            self.kv.free(r, uncache)
            self.release(r)
            self.look_ahead.forget(r.request_id)
            r.status = RequestStatus.PREEMPTED
            r.num_computed_tokens = 0
            r.num_preemptions += count
            self._sent_to_workers.pop(r.request_id, None)
            self._preempted_ids.add(r.request_id)
        self.num_preemptions += count
        self.policy.requeue(self.waiting, reqs)

    def drop_from_queues(self, unit: SchedulingUnit) -> None:
        """Take the unit's requests out of the running batch or the waiting queue."""
        reqs = unit.requests
        if not reqs:
            return
        queue = self.running if reqs[0].status == RequestStatus.RUNNING else self.waiting
        if len(queue) >= len(reqs) and all(queue[-len(reqs) + k] is r for k, r in enumerate(reqs)):
            for _ in reqs:  # the usual victim: the tail
                queue.pop()
        elif len(reqs) == 1:
            if reqs[0] in queue:
                queue.remove(reqs[0])
        else:
            remaining = [r for r in queue if r.unit is not unit]
            queue.clear()
            queue.extend(remaining)

    def join_running(self, unit: SchedulingUnit, num_hits: list[int]) -> None:
        """The unit at the head of the waiting queue joins the running batch (its slots already
        allocated), each request starting after its prefix-cache hit tokens."""
        for req, num_hit in zip(unit.requests, num_hits):
            assert self.waiting[0] is req
            self.waiting.popleft()
            self.kv.record_prefix_lookup(req.num_tokens, num_hit, req.request_id)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
        self.policy.join(self.running, unit.requests)

    def replace_running(self, old: list[Request], new: list[Request]) -> None:
        k = self.running.index(old[0])
        self.running[k:k + len(old)] = new

    def register(self, req: Request) -> None:
        self.requests[req.request_id] = req

    def unregister(self, req: Request) -> None:
        """A sequence that never ran leaves the table (a beam fork that failed half way)."""
        self.requests.pop(req.request_id, None)

    def forget_group(self, group_id: str) -> None:
        self.beam_groups.pop(group_id, None)

    def new_request_data(self, req: Request) -> NewRequestData:
        # num_computed_tokens here is the value BEFORE this step's tokens are added.
        return NewRequestData(
            req_id=req.request_id,
            token_ids=list(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=req.sampling_params,
            block_ids=self.kv.get_block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens,
            num_output_tokens=req.num_output_tokens,
            lora_slot=req.lora_slot,
            mm_features=req.mm_features,
        )

    def send(self, req: Request, plan: StepPlan, new_block_ids: Optional[list[int]] = None) -> None:
        """What the workers get for a scheduled request: in full when they do not hold it, else the diff."""
        rid = req.request_id
        held = self._sent_to_workers.get(rid)
        if held is not None:
            new_ids = req.all_token_ids[held:] if self.limits.send_new_token_ids else ()
            if new_ids:
                self._sent_to_workers[rid] = req.num_tokens
            look_ahead = self.look_ahead
            plan.cached_reqs.append(CachedRequestData(rid, new_block_ids or [], req.num_computed_tokens,
                                                      look_ahead.take_dropped_blocks(rid) if look_ahead.drafts else 0,
                                                      new_ids))
        else:
            plan.new_reqs.append(self.new_request_data(req))

    def report(self, output: EngineCoreOutput) -> None:
        """An output of a request that finished while scheduling (e.g. its grammar failed to
        compile): the engine takes it with ``take_failed``."""
        self._failed.append(output)

    def check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        """Whether ``token``, just appended to ``req``, ends it: once per row per step."""
        sp = req.sampling_params
        num_output = len(req.output_token_ids)  # (once per row per step: no property calls)
        if token in sp.all_stop_token_ids and num_output >= sp.min_tokens:
            req.stop_reason = None if token not in sp.stop_token_ids else token
            return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def retire(self, req: Request, uncache: bool = False) -> None:
        """A request leaves for good: its blocks and holds go back, the workers forget it."""
        self.kv.free(req, uncache)
        self.release(req)
        self.look_ahead.forget(req.request_id)
        self.requests.pop(req.request_id, None)
        self.table.remove(req)
        if self._sent_to_workers.pop(req.request_id, None) is not None:
            self._finished_ids.add(req.request_id)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """A plain request ends (running or waiting)."""
        self.drop_from_queues(req.unit)
        req.status = status
        self.retire(req, uncache=status == RequestStatus.FINISHED_ERROR)

    # ---- results ----------------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        # first: whatever fails below, the tier's loads are accounted for
        self.kv.finish_transfers(so.kv_transfers, runner_output.failed_kv_loads, runner_output.kv_transfer_seconds)
        requests, running = self.requests, RequestStatus.RUNNING
        reqs = [requests.get(rid) for rid in runner_output.req_ids]
        sampled = runner_output.sampled_token_ids
        quiet = (self.table.quiet_rows(reqs, sampled)
                 if reqs and not so.num_spec_slots and not runner_output.prompt_logprobs else None)
        logprobs = runner_output.logprobs
        for row, req in enumerate(reqs):
            if req is None or (req.status != running and not (req.num_pending and req.status == RequestStatus.PREEMPTED)):
                continue  # aborted while the step ran (or preempted, its token not awaited: pipeline parallelism)
            if quiet is not None and quiet[row] and req.status == running:  # a plain row that only appends
                new_ids = sampled[row]
                req.output_token_ids.append(new_ids[0])
                req.all_token_ids.append(new_ids[0])
                rid, cached = req.request_id, req.num_cached_tokens
                outputs.append(EngineCoreOutput(rid, new_ids, None, req.stop_reason,
                                                logprobs.get(rid) if logprobs else None, None,
                                                cached if cached > 0 else 0, None, req.num_preemptions))
                continue
            try:  # a failure here is this request's (or beam group's) alone: it finishes with "error"
                req.unit.on_output(self, so, runner_output, row, outputs)
            except Exception:
                uid = req.unit.unit_id
                logger.exception("request %s: applying its step output failed; it finishes with \"error\"", uid)
                outputs.extend(self.fail_request(uid))
        self.look_ahead.end_output()
        return outputs

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Abort (or stop, e.g. on a stop string found by the detokenizer). Frees blocks at once.
        A beam search ends whole, under its group (= request) id. Returns the ids of the units ended."""
        return [uid for uid, _ in self._finish_units(request_ids, status)]

    def abort_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[EngineCoreOutput]:
        """``finish_requests``, returning the final outputs the units made (a beam search's live
        beams so far, as its hypotheses)."""
        return [out for _, out in self._finish_units(request_ids, status) if out is not None]

    def _finish_units(self, request_ids: Iterable[str], status: RequestStatus):
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            unit = req.unit if req is not None else self.beam_groups.get(rid)
            if unit is not None:
                done.append((unit.unit_id, unit.finish(self, status)))
        return done

    def fail_request(self, rid: str) -> list[EngineCoreOutput]:
        """Something raised for this request (or beam group) alone: it finishes with "error", its
        blocks freed (and uncached: what they hold is suspect); the output tells its caller."""
        group = rid in self.beam_groups  # a beam search's result: no hypotheses
        try:
            self.finish_requests([rid], RequestStatus.FINISHED_ERROR)
        except Exception:  # its bookkeeping is broken: forget it (its blocks may be lost), keep the engine
            logger.exception("request %s: finishing it after a failure raised too", rid)
            req = self.requests.pop(rid, None)
            if req is not None:
                self.table.remove(req)
                req.status = RequestStatus.FINISHED_ERROR
                self.running[:] = [r for r in self.running if r is not req]
                if req in self.waiting:
                    self.waiting.remove(req)
            self.beam_groups.pop(rid, None)
        return [EngineCoreOutput(rid, [], finish_reason="error", beam_hypotheses=[] if group else None)]

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """The step's execution raised: finish every request it scheduled with "error" (their
        freshly registered blocks leave the prefix cache), so the engine can go on serving the
        others."""
        self.kv.transfers_failed(scheduler_output.kv_transfers)
        failed = self.finish_requests(list(scheduler_output.num_scheduled_tokens), RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, [], finish_reason="error") for rid in failed]

    def rewind(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Undo a step whose execution raised, to retry its requests in smaller groups: each unit
        is preempted (not counted as a preemption; blocks this step may have half-written leave
        the prefix cache; recomputed from its tokens when scheduled again). Workers drop their
        state of these requests (and of the step's finished ones, again) with the next step.
        Returns the requests, in their order in the step."""
        ids = [rid for rid in scheduler_output.num_scheduled_tokens if rid in self.requests]
        self._finished_ids |= scheduler_output.finished_req_ids
        self.kv.transfers_failed(scheduler_output.kv_transfers)
        seen: set[int] = set()
        for rid in reversed(ids):
            req = self.requests[rid]
            if id(req.unit) not in seen:
                seen.add(id(req.unit))
                self._preempt(req, uncache=True, count=False)
        return ids

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens_total=self.num_scheduled_tokens_total,
            num_scheduled_rows_total=self.num_scheduled_rows_total,
            num_attention_pairs_total=self.num_attention_pairs_total,
            num_context_tokens_total=self.num_context_tokens_total,
            num_steps=self.num_steps,
            num_batched_reqs_max=self.num_batched_reqs_max,
            num_waiting_deferred=self.num_waiting_deferred,
            **{k: v for c in self.constraints for k, v in c.stats(self.running, self.waiting).items()},
            **self.look_ahead.stats(),
            kv_tier=self.kv.tier_stats(),
        )
