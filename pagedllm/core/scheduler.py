"""Scheduler: continuous batching under a per-step token budget.

There is no prefill phase and no decode phase: each request has ``num_computed_tokens`` that
catches up with ``num_tokens`` (prompt + outputs). Every step serves running requests first
(decodes and unfinished prefill chunks, FCFS), then admits waiting ones while the token budget,
``max_num_seqs`` and the KV cache allow. When a running request cannot get a block, the most
recently admitted running request is preempted (blocks freed, computed count reset, requeued at
the front of the waiting queue) until it can, or until it is itself the victim.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from pagedllm.core.contracts import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedllm.core import beam_scheduling
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.lora_slots import AdapterSlots
from pagedllm.core.request import Request, RequestStatus, finish_reason_of

logger = logging.getLogger(__name__)


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


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv_cache_manager: KVCacheManager) -> None:
        self.limits = limits
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell workers next step
        self._rewound_ids: set[str] = set()  # preempted by rewind(): workers drop them next step
        self._sent_to_workers: set[str] = set()
        self.in_flight: set[str] = set()  # pipeline parallel: in a batch whose output is not back (not scheduled)
        self.max_batch_reqs = 0  # pipeline parallel: most requests in one micro-batch (0 = no cap)
        self.num_preemptions = 0
        self.num_scheduled_tokens_total = 0
        self.num_steps = 0
        self.num_batched_reqs_max = 0
        self.beam_groups: dict = {}  # group id -> BeamGroup (core/beam_scheduling.py has their rules)
        self.lora_slots = AdapterSlots(limits.max_loras) if limits.max_loras else None
        self._dropped_blocks: dict[str, int] = {}  # speculative decoding: tail block ids workers must drop
        self.spec_stats = [0, 0, 0]  # rows with drafts, drafts, accepted drafts
        self.spec_accepted_per_pos = [0] * limits.num_spec_tokens
        # speculative decoding: a spec_decode SpecGovernor (set by the engine core when auto_disable is on);
        # it says per step whether decoding requests get draft slots at all
        self.spec_governor = None

    # ---- admission --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.beam is not None:
            request.beam.start(request)
            self.beam_groups[request.request_id] = request.beam

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self, only: Optional[set[str]] = None) -> SchedulerOutput:
        """``only``: schedule just these requests (the others wait a step), used to find the
        request that made a step fail."""
        budget = self.limits.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        block_copies: list[tuple[int, int]] = []  # beam search copy-on-write
        step_loras: set[str] = set()  # adapters this step runs (capped at max_loras_per_step)
        spec_slots: dict[str, int] = {}
        gov = self.spec_governor if self.limits.num_spec_tokens else None
        speculate = gov.plan(len(self.running)) if gov is not None else True
        num_plain_decodes = 0  # decoding requests the governor kept plain this step

        i = 0
        while i < len(self.running) and budget > 0:
            if self.max_batch_reqs and len(num_scheduled) >= self.max_batch_reqs:
                break
            req = self.running[i]
            if req.beam is not None:  # a beam group: scheduled whole (core/beam_scheduling.py)
                i, budget, stop = beam_scheduling.schedule_running(self, i, budget, only, num_scheduled, new_reqs,
                                                                   preempted, block_copies)
                if stop:
                    break
                continue
            if (only is not None and req.request_id not in only) or req.request_id in self.in_flight:
                i += 1
                continue
            num_new = self._num_new_tokens(req, budget)
            if num_new <= 0 or not self._lora_fits_step(req, step_loras):
                i += 1
                continue
            spec = self._spec_slots(req, num_new, budget)
            if spec and not speculate and req.sampling_params.seed is None:
                # A plain step reserves nothing. Seeded requests speculate regardless: how many
                # uniforms their stream gives up per step must not depend on the governor's timing.
                spec, num_plain_decodes = 0, num_plain_decodes + 1
            num_new += spec
            while True:
                new_block_ids = self.kv.allocate_slots(req, num_new)
                if new_block_ids is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if new_block_ids is None:
                break  # req preempted itself: nothing after it is running anymore
            num_scheduled[req.request_id] = num_new
            if spec:
                spec_slots[req.request_id] = spec
            budget -= num_new
            if req.request_id in self._sent_to_workers:
                cached_reqs.append(CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens,
                                                     self._dropped_blocks.pop(req.request_id, 0)))
            else:
                new_reqs.append(self._new_request_data(req))
            i += 1

        # Admit waiting requests (none if we just had to preempt: memory is tight).
        if not preempted:
            skipped: list[Request] = []
            while (self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs
                   and not (self.max_batch_reqs and len(num_scheduled) >= self.max_batch_reqs)):
                req = self.waiting[0]
                if req.beam is not None:  # a beam group: admitted whole or not at all
                    verdict, budget = beam_scheduling.admit(self, budget, only, num_scheduled, new_reqs)
                    if verdict == beam_scheduling.SKIPPED:
                        skipped.extend(self.waiting.popleft() for _ in req.beam.beams)
                        continue
                    if verdict == beam_scheduling.BLOCKED:
                        break
                    continue
                if (only is not None and req.request_id not in only) or req.request_id in self.in_flight:
                    skipped.append(self.waiting.popleft())  # in_flight: preempted while its batch runs
                    continue
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_hit
                if not self.limits.enable_chunked_prefill and num_new > budget:
                    break
                num_new = self._cap(num_new, budget)
                if not self._lora_admit(req, step_loras):  # its adapter waits for a slot; others go on
                    skipped.append(self.waiting.popleft())
                    continue
                if self.kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
                    self._lora_release(req)
                    break
                self.admit_waiting_head(req, num_hit)
                num_scheduled[req.request_id] = num_new
                budget -= num_new
                new_reqs.append(self._new_request_data(req))
            self.waiting.extendleft(reversed(skipped))

        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        for nr in new_reqs:
            self._sent_to_workers.add(nr.req_id)
        total = sum(num_scheduled.values())
        self.num_scheduled_tokens_total += total
        if total:
            self.num_steps += 1
            self.num_batched_reqs_max = max(self.num_batched_reqs_max, len(num_scheduled))
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=frozenset(self._finished_ids),
            preempted_req_ids=frozenset(preempted | self._rewound_ids),
            lora_loads=self.lora_slots.take_loads() if self.lora_slots is not None else (),
            num_spec_slots=spec_slots,
            block_copies=tuple(block_copies),
        )
        self._finished_ids.clear()
        self._rewound_ids.clear()
        if gov is not None:  # measurable: only decodes, all speculating or none
            only_decodes = total and len(num_scheduled) == len(spec_slots) + num_plain_decodes
            gov.scheduled(None if not only_decodes or (spec_slots and num_plain_decodes) else bool(spec_slots))
        return out

    def _cap(self, num_new: int, budget: int) -> int:
        if self.limits.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.limits.long_prefill_token_threshold)
        return min(num_new, budget)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        return self._cap(req.num_tokens - req.num_computed_tokens, budget)

    def _spec_slots(self, req: Request, num_new: int, budget: int) -> int:
        """Speculative decoding: draft slots to reserve after a decoding request's next token,
        so that the accepted drafts plus one token never pass max_tokens or max_model_len."""
        lim = self.limits
        if not lim.num_spec_tokens or num_new != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        if lim.spec_disable_batch_size and len(self.running) >= lim.spec_disable_batch_size:
            return 0
        # Beams are scored, not sampled, and a grammar would have to walk the drafts: these
        # requests decode one token per step (correct, just not sped up).
        if getattr(req, "beam", None) is not None or getattr(req.sampling_params, "structured_outputs", None):
            return 0
        return max(0, min(lim.num_spec_tokens, budget - 1, req.max_tokens - req.num_output_tokens - 1,
                          lim.max_model_len - req.num_tokens - 1))

    def _spec_settle(self, req: Request, reserved: int, num_drafts: int, num_sampled: int) -> None:
        """After a verification step: the computed count covers the accepted drafts only (the
        last sampled token is computed next step), blocks holding only rejected drafts are freed,
        and the acceptance counters advance."""
        req.num_computed_tokens -= 1 + reserved - num_sampled
        dropped = self.kv.rollback(req)
        if dropped:
            self._dropped_blocks[req.request_id] = self._dropped_blocks.get(req.request_id, 0) + dropped
        if num_drafts:
            accepted = num_sampled - 1
            self.spec_stats[0] += 1
            self.spec_stats[1] += num_drafts
            self.spec_stats[2] += accepted
            for j in range(accepted):  # at most num_speculative_tokens per request
                self.spec_accepted_per_pos[j] += 1

    def _new_request_data(self, req: Request) -> NewRequestData:
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
        )

    # ---- LoRA adapter slots -----------------------------------------------------------------
    def _lora_fits_step(self, req: Request, step_loras: set[str]) -> bool:
        """Under the cap of distinct adapters per step (counting this request's)."""
        if req.lora is None or req.lora.key in step_loras:
            return True
        if len(step_loras) >= (self.limits.max_loras_per_step or self.limits.max_loras):
            return False
        step_loras.add(req.lora.key)
        return True

    def _lora_admit(self, req: Request, step_loras: set[str]) -> bool:
        """Pin a slot for a waiting request's adapter (False: none free, or over the step's cap)."""
        if req.lora is None:
            return True
        if self.lora_slots is None:
            raise ValueError("this engine was started without LoRA (enable_lora)")
        fresh = req.lora.key not in step_loras
        if not self._lora_fits_step(req, step_loras):
            return False
        slot = self.lora_slots.acquire(req.lora)
        if slot is None:
            if fresh:
                step_loras.discard(req.lora.key)
            return False
        req.lora_slot = slot
        return True

    def _lora_release(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1

    def admit_waiting_head(self, req: Request, num_hit: int) -> None:
        """The head of the waiting queue joins the running batch (its slots already allocated),
        starting after its ``num_hit`` prefix-cache hit tokens."""
        self.waiting.popleft()
        self.kv.record_prefix_lookup(req.num_tokens, num_hit)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit

    def _preempt(self, req: Request) -> None:
        if req.beam is not None:  # its whole group goes
            return beam_scheduling.preempt_group(self, req.beam)
        self.kv.free(req)
        self._lora_release(req)
        self._dropped_blocks.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._sent_to_workers.discard(req.request_id)
        self.waiting.appendleft(req)

    # ---- results ----------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        spec_rows = spec_tokens = spec_drafts = 0  # for the governor
        if runner_output.beam_candidates:  # beam groups advance (their rows sample nothing)
            outputs.extend(beam_scheduling.apply_candidates(self, runner_output))
        for idx, rid in enumerate(runner_output.req_ids):
            req = self.requests.get(rid)
            if req is None or req.is_finished or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            try:  # a failure here is this request's alone: it finishes with "error", the rest go on
                counted = self._apply_sampled(req, idx, scheduler_output, runner_output, outputs)
            except Exception:
                logger.exception("request %s: applying its step output failed; it finishes with \"error\"", rid)
                outputs.extend(self.fail_request(rid))
                continue
            if counted:
                spec_rows, spec_tokens, spec_drafts = (spec_rows + 1, spec_tokens + counted[0],
                                                       spec_drafts + counted[1])
        if self.spec_governor is not None and self.limits.num_spec_tokens:
            self.spec_governor.verified(spec_tokens / spec_rows if spec_rows else 1.0, spec_drafts)
        return outputs

    def _apply_sampled(self, req: Request, idx: int, scheduler_output: SchedulerOutput,
                       runner_output: ModelRunnerOutput, outputs: list[EngineCoreOutput]) -> tuple[int, int]:
        """Append one request's sampled tokens, check its stops, add its output. Returns
        (tokens, drafts) of a speculative verification, for the governor, else ()."""
        rid = req.request_id
        counted: tuple[int, int] = ()
        sampled = runner_output.sampled_token_ids[idx]
        reserved = scheduler_output.num_spec_slots.get(rid, 0)
        if reserved and sampled:
            drafts = runner_output.num_draft_tokens[idx] if runner_output.num_draft_tokens is not None else 0
            self._spec_settle(req, reserved, drafts, len(sampled))
            counted = (len(sampled), drafts)
        prompt_lp = runner_output.prompt_logprobs.get(rid)
        if not sampled:
            if prompt_lp is not None:
                outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=prompt_lp))
            return counted
        new_ids: list[int] = []
        status: Optional[RequestStatus] = None
        for tok in sampled:
            req.append_output_token(tok)
            new_ids.append(tok)
            status = self._check_stop(req, tok)
            if status is not None:
                break
        if status is not None:
            self._finish(req, status)
        outputs.append(
            EngineCoreOutput(
                rid,
                new_ids,
                finish_reason=finish_reason_of(status) if status is not None else None,
                stop_reason=req.stop_reason,
                logprobs=runner_output.logprobs.get(rid),
                prompt_logprobs=prompt_lp,
                num_cached_tokens=max(req.num_cached_tokens, 0),
            )
        )
        return counted

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
                req.status = RequestStatus.FINISHED_ERROR
                self.running[:] = [r for r in self.running if r is not req]
                if req in self.waiting:
                    self.waiting.remove(req)
            self.beam_groups.pop(rid, None)
        return [EngineCoreOutput(rid, [], finish_reason="error", beam_hypotheses=[] if group else None)]

    def _check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens and token in sp._all_stop_token_ids:
            req.stop_reason = None if token not in sp.stop_token_ids else token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req, uncache=status == RequestStatus.FINISHED_ERROR)
        self._lora_release(req)
        self._dropped_blocks.pop(req.request_id, None)
        if req.request_id in self._sent_to_workers:
            self._finished_ids.add(req.request_id)
            self._sent_to_workers.discard(req.request_id)
        del self.requests[req.request_id]

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Abort (or stop, e.g. on a stop string found by the detokenizer). Frees blocks at once."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            group = self.beam_groups.get(rid) if req is None else req.beam
            if group is not None:  # a beam search ends whole, under its group (= request) id
                if group.group_id in self.beam_groups:
                    beam_scheduling.finish_group(self, group, status)
                    done.append(group.group_id)
                continue
            if req is None:
                continue
            if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(rid)
        return done

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """The step's execution raised: finish every request it scheduled with "error" (their
        freshly registered blocks leave the prefix cache), so the engine can go on serving the
        others."""
        failed = self.finish_requests(list(scheduler_output.num_scheduled_tokens), RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, [], finish_reason="error") for rid in failed]

    def rewind(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Undo a step whose execution raised, to retry its requests in smaller groups: each is
        preempted (blocks freed; blocks this step may have half-written leave the prefix cache;
        recomputed from its tokens when scheduled again). Workers drop their state of these
        requests (and of the step's finished ones, again) with the next step. Returns the
        requests, in their order in the step."""
        ids = [rid for rid in scheduler_output.num_scheduled_tokens if rid in self.requests]
        self._finished_ids |= scheduler_output.finished_req_ids
        for rid in reversed(ids):
            req = self.requests[rid]
            if req.beam is not None:  # the whole group goes back
                if req.status == RequestStatus.RUNNING:
                    beam_scheduling.preempt_group(self, req.beam, uncache=True)
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(req)
            self.kv.free(req, uncache=True)
            self._lora_release(req)
            self._dropped_blocks.pop(rid, None)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            self._sent_to_workers.discard(rid)
            self._rewound_ids.add(rid)
            self.waiting.appendleft(req)
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
            num_steps=self.num_steps,
            num_batched_reqs_max=self.num_batched_reqs_max,
            running_loras=tuple(sorted({r.lora.name for r in self.running if r.lora is not None})),
            waiting_loras=tuple(sorted({r.lora.name for r in self.waiting if r.lora is not None})),
            spec_num_drafts=self.spec_stats[0],
            spec_num_draft_tokens=self.spec_stats[1],
            spec_num_accepted_tokens=self.spec_stats[2],
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
        )
