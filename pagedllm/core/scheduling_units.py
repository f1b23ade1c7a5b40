"""Scheduling units: what the scheduler's loop schedules, admits, preempts and updates whole.

A unit is one or more sequences (core Requests) that share a fate: a plain request is one; a beam
group (core/beam_scheduling.py) is its live beams, admitted, scheduled, preempted and finished
together. Every Request points at its unit (``Request.unit``); a unit's requests sit next to each
other in the scheduler's running batch and waiting queue, in the unit's order.

The protocol, as the loop (core/scheduler.py) uses it:
- ``unit_id``: the id its caller knows it by; ``requests``: the unit's live sequences; ``lora``:
  the adapter it runs with (None: the base model);
- ``schedule_running(sched, plan)``: take this step's tokens for a running unit out of
  ``plan.budget`` and allocate their slots (through ``sched.make_room``, the one preemption
  routine); False when making room preempted the unit itself (nothing after it runs);
- ``admit(sched, plan)``: a waiting unit at the head of the queue joins the batch whole
  (ADMITTED), is set aside while the ones behind it go on (SET_ASIDE: an admission constraint
  said no), or is BLOCKED (no budget or no blocks: nothing behind it is admitted this step), or
  LEFT the queue (it finished instead, e.g. its grammar failed to compile: the next one goes on);
- ``on_output(sched, so, out, row, outputs)``: the step's results for it (``row``: its row in
  ``out``), appended to ``outputs`` as EngineCoreOutputs;
- ``finish(sched, status)``: it ends (aborted, stopped, failed), every block back.
Preemption is not the unit's: the scheduler frees a unit's requests and requeues them together.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from pagedllm.core.contracts import (
    CachedRequestData,
    EngineCoreOutput,
    LoRAHandle,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.request import Request, RequestStatus, finish_reason_of


ADMITTED, SET_ASIDE, BLOCKED, LEFT = "admitted", "set aside", "blocked", "left"


@dataclass
class StepPlan:
    """What one ``schedule()`` call has decided so far."""

    budget: int
    only: Optional[set[str]] = None  # schedule just these requests (failure isolation)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # beam search copy-on-write
    spec_slots: dict[str, int] = field(default_factory=dict)
    masked: list[str] = field(default_factory=list)  # constrained requests that sample: their masks go with the step
    num_preempted: int = 0  # units preempted by this step

    def excludes(self, unit: "SchedulingUnit") -> bool:
        return self.only is not None and not any(r.request_id in self.only for r in unit.requests)

    def take(self, req_id: str, num_tokens: int) -> None:
        self.num_scheduled[req_id] = num_tokens
        self.budget -= num_tokens


class SchedulingUnit(Protocol):
    @property
    def unit_id(self) -> str: ...  # the id its caller knows it by (a request id; a beam search's group id)

    @property
    def requests(self) -> Sequence[Request]: ...

    @property
    def lora(self) -> Optional[LoRAHandle]: ...

    def schedule_running(self, sched, plan: StepPlan) -> bool: ...

    def admit(self, sched, plan: StepPlan) -> str: ...

    def on_output(self, sched, so: SchedulerOutput, out: ModelRunnerOutput, row: int,
                  outputs: list[EngineCoreOutput]) -> None: ...

    def finish(self, sched, status: RequestStatus) -> Optional[EngineCoreOutput]: ...


class RequestUnit:
    """A plain request: it decodes (plus look-ahead slots) or runs a prefill chunk each step."""

    __slots__ = ("request", "requests")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.requests = (request,)

    @property
    def unit_id(self) -> str:
        return self.request.request_id

    @property
    def lora(self) -> Optional[LoRAHandle]:
        return self.request.lora

    def schedule_running(self, sched, plan: StepPlan) -> bool:
        # Once per running request per step: the decode row (one token, the budget left is at
        # least 1) skips the calls that cannot change it.
        req = self.request
        pending = req.num_pending  # async scheduling: tokens of steps in flight, scheduled past as placeholders
        num_new = len(req.all_token_ids) + pending - req.num_computed_tokens
        if num_new != 1:
            num_new = sched.cap(num_new, plan.budget)
        if num_new <= 0 or (sched.constraints and not sched.fits_step(self)):
            return True
        if pending and (req.num_output_tokens + pending >= req.max_tokens
                        or req.num_tokens + pending >= sched.limits.max_model_len):
            return True  # the token in flight is its last: nothing after it to compute
        look_ahead = sched.look_ahead
        spec = look_ahead.slots(req, num_new, plan.budget, len(sched.running)) if look_ahead.drafts else 0
        num_new += spec
        new_block_ids = sched.kv.allocate_slots(req, num_new)
        if new_block_ids is None:
            new_block_ids = sched.make_room(self, lambda: sched.kv.allocate_slots(req, num_new), plan)
            if new_block_ids is None:
                return False
        plan.take(req.request_id, num_new)
        if spec:
            plan.spec_slots[req.request_id] = spec
        sched.send(req, plan, new_block_ids)
        return True

    def admit(self, sched, plan: StepPlan) -> str:
        req = self.request
        if req.num_pending:  # preempted while a step in flight samples its next token: wait for it
            return SET_ASIDE
        if sched.kv.tier is not None and not sched.kv.prepare_admission(req):
            return SET_ASIDE  # its blocks come from the KV offload tier with this step; admitted after
        hit_blocks, num_hit = sched.kv.get_computed_blocks(req)
        num_new = req.num_tokens - num_hit
        if not sched.limits.enable_chunked_prefill and num_new > plan.budget:
            return BLOCKED
        num_new = sched.cap(num_new, plan.budget)
        if not sched.acquire(self):  # e.g. its adapter waits for a slot; the others go on
            return SET_ASIDE
        if sched.kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
            sched.release(req)
            return BLOCKED
        sched.join_running(self, [num_hit])
        plan.take(req.request_id, num_new)
        sched.send(req, plan)
        return ADMITTED

    def on_output(self, sched, so: SchedulerOutput, out: ModelRunnerOutput, row: int,
                  outputs: list[EngineCoreOutput]) -> None:
        req = self.request
        rid = req.request_id
        sampled = out.sampled_token_ids[row]
        if so.num_spec_slots:
            reserved = so.num_spec_slots.get(rid, 0)
            if reserved and sampled:
                drafts = out.num_draft_tokens[row] if out.num_draft_tokens is not None else 0
                sched.look_ahead.settle(req, reserved, drafts, len(sampled))
        prompt_lp = out.prompt_logprobs.get(rid) if out.prompt_logprobs else None
        if not sampled:
            if prompt_lp is not None:
                outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=prompt_lp))
            return
        if len(sampled) == 1:  # the usual row: one token (the runner's list is not changed after the step)
            new_ids = sampled
            tok = sampled[0]
            req.output_token_ids.append(tok)
            req.all_token_ids.append(tok)
            status = sched.check_stop(req, tok)
        else:
            new_ids, status = [], None
            for tok in sampled:
                req.append_output_token(tok)
                new_ids.append(tok)
                status = sched.check_stop(req, tok)
                if status is not None:
                    break
        if status is not None:
            sched.finish(req, status)
        cached = req.num_cached_tokens
        outputs.append(EngineCoreOutput(  # positional: once per row per step, cheaper than keywords
            rid, new_ids, finish_reason_of(status) if status is not None else None, req.stop_reason,
            out.logprobs.get(rid) if out.logprobs else None, prompt_lp, cached if cached > 0 else 0, None,
            req.num_preemptions))

    def finish(self, sched, status: RequestStatus) -> Optional[EngineCoreOutput]:
        sched.finish(self.request, status)
        return None
