"""The scheduler's beam-search rules: a beam group is one scheduling unit.

- Admission and preemption take a group whole: it is admitted only if every live beam gets its
  blocks (and ``width`` seats under max_num_seqs, as each beam is a sequence), and preempting
  any beam preempts them all (back to the front of the waiting queue, in order).
- Token budget: the group's beams sample in the same step or not at all. When every beam can
  compute all its remaining tokens within the budget they do (and each produces logits); else
  each catches up to its last-but-one token (chunked, no logits) and they sample together later.
- Beams are sent to the workers in full every step (their tokens and block tables change under
  them when they fork), marked with a BeamRow; they are never sampled, only scored.
- After a step, ``apply_candidates`` advances the group (BeamGroup.advance), forks the chosen
  children off their parents' blocks (beam_blocks.fork_blocks) and frees the parents at once,
  so the blocks only dead beams held go back to the pool in the same step.

A group's live beams sit next to each other in ``running`` (and in ``waiting``), best first.
``BeamUnit`` is the group as a scheduling unit (core/scheduling_units.py's protocol); it uses
the scheduler only through its public methods.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from pagedllm.core.beam_blocks import copy_on_write, fork_blocks
from pagedllm.core.beam_group import BeamGroup
from pagedllm.core.contracts import (
    BeamRow,
    EngineCoreOutput,
    LoRAHandle,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduling_units import ADMITTED, BLOCKED, SET_ASIDE, StepPlan

_STATUS_REASONS = {RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


def plan_tokens(cap, remaining: list[int], budget: int) -> Optional[list[int]]:
    """Tokens per beam this step: all remaining (every beam then samples), or each up to its
    last-but-one token (none samples). None: nothing can run this step. ``cap(n, budget)``: the
    scheduler's per-request cap."""
    if sum(remaining) <= budget and all(cap(r, budget) == r for r in remaining):
        return remaining
    # Catching up is chunked even without chunked prefill: a root's prompt always fits one step
    # there (budget >= max_model_len), but W preempted beams recomputed at once may not.
    # Each beam first gets an equal share (so all can be admitted together), then the rest in order.
    behind = sum(1 for r in remaining if r > 1)
    if behind == 0 or budget < behind:
        return None
    share = budget // behind
    plan = [max(0, min(r - 1, cap(r - 1, share))) for r in remaining]
    left = budget - sum(plan)
    for i, r in enumerate(remaining):
        extra = max(0, min(r - 1 - plan[i], cap(r - 1, plan[i] + left) - plan[i]))
        plan[i] += extra
        left -= extra
    return plan if sum(plan) else None


class BeamUnit:
    """One beam search's live beams as one scheduling unit."""

    __slots__ = ("group",)

    def __init__(self, group: BeamGroup) -> None:
        self.group = group

    @property
    def unit_id(self) -> str:
        return self.group.group_id

    @property
    def requests(self) -> list[Request]:
        return self.group.beams

    @property
    def lora(self) -> Optional[LoRAHandle]:
        return None  # beam search with an adapter is refused by the engine

    def _row_data(self, sched, beam: Request) -> NewRequestData:
        g = self.group
        return replace(sched.new_request_data(beam), beam=BeamRow(g.group_id, g.cum_logprob(beam), g.num_candidates))

    def _send(self, sched, plan: StepPlan, beams: list[Request], tokens: list[int]) -> None:
        for beam, t in zip(beams, tokens):
            if t:
                plan.take(beam.request_id, t)
                plan.new_reqs.append(self._row_data(sched, beam))  # in full: forks change tokens and blocks

    # ---- running -----------------------------------------------------------------------------
    def schedule_running(self, sched, plan: StepPlan) -> bool:
        beams = list(self.group.beams)
        tokens = plan_tokens(sched.cap, [b.num_tokens - b.num_computed_tokens for b in beams], plan.budget)
        if tokens is None:
            return True
        copies: list[tuple[int, int]] = []
        for beam, t in zip(beams, tokens):
            if t and sched.make_room(self, lambda beam=beam, t=t: self._allocate(sched, beam, t, copies), plan) is None:
                return False  # the group was the victim: its blocks (and copies) are gone
        self._send(sched, plan, beams, tokens)
        plan.block_copies.extend(copies)
        return True

    @staticmethod
    def _allocate(sched, beam: Request, num_tokens: int, copies: list) -> Optional[bool]:
        cow = copy_on_write(sched.kv, beam)
        if cow:
            copies.append(cow)
        if cow != () and sched.kv.allocate_slots(beam, num_tokens) is not None:
            return True
        return None

    # ---- admission ---------------------------------------------------------------------------
    def admit(self, sched, plan: StepPlan) -> str:
        """Whole or not at all: every live beam gets its blocks and a seat under max_num_seqs."""
        beams = list(self.group.beams)
        if len(sched.running) + self.group.width > sched.limits.max_num_seqs:
            return BLOCKED
        hits = []
        for b in beams:
            blocks, num_hit = sched.kv.get_computed_blocks(b)
            while len(beams) > 1 and blocks and b.num_tokens - num_hit < 2:  # every beam computes >= 1 token
                blocks, num_hit = blocks[:-1], num_hit - sched.kv.block_size
            hits.append((blocks, num_hit))
        tokens = plan_tokens(sched.cap, [b.num_tokens - h[1] for b, h in zip(beams, hits)], plan.budget)
        if tokens is None or not all(tokens):
            return BLOCKED
        done: list[Request] = []
        for beam, (blocks, num_hit), t in zip(beams, hits, tokens):
            if sched.kv.allocate_slots(beam, t, num_hit, blocks) is None:
                for b in done:  # all or nothing; blocks registered for this step were never written
                    sched.kv.free(b, uncache=True)
                return BLOCKED
            done.append(beam)
        sched.join_running(self, [h[1] for h in hits])
        self._send(sched, plan, beams, tokens)
        return ADMITTED

    # ---- results -----------------------------------------------------------------------------
    def on_output(self, sched, so: SchedulerOutput, out: ModelRunnerOutput, row: int,
                  outputs: list[EngineCoreOutput]) -> None:
        """The group advances once per step, at its first row (its rows sample nothing)."""
        group = self.group
        cands = out.beam_candidates.get(group.group_id)
        if cands is None or out.req_ids[row] != group.beams[0].request_id:
            return
        live = {b.request_id for b in group.beams}
        if not set(cands.parent_ids) <= live or any(
                b.status != RequestStatus.RUNNING or b.num_computed_tokens < b.num_tokens for b in group.beams):
            return  # preempted or aborted while the step ran
        nxt = group.advance(cands, sched.limits.max_model_len)
        if group.done:
            outputs.append(self.finish(sched, None))
            return
        children: list[Request] = []
        try:
            for parent, tok, _ in nxt:
                children.append(_child(sched, group, parent, tok))
        except Exception:
            for c in children:  # their forked block references go back before the group fails
                sched.kv.free(c)
                sched.unregister(c)
            raise
        old = group.beams
        sched.replace_running(old, children)
        for b in old:
            sched.retire(b)
        group.adopt(children, nxt, cands)

    def finish(self, sched, status: Optional[RequestStatus]) -> EngineCoreOutput:
        """The search is over (``status`` None: it ended by its rules; else aborted / stopped / error)."""
        group = self.group
        sched.drop_from_queues(self)
        for b in group.beams:
            b.status = status or RequestStatus.FINISHED_STOPPED
            sched.retire(b, uncache=status == RequestStatus.FINISHED_ERROR)
        sched.forget_group(group.group_id)
        group.done = True
        results = group.results() if status != RequestStatus.FINISHED_ERROR else []  # the failure path scores nothing
        reason = results[0].finish_reason if status is None and results else None
        if status is not None:
            reason = _STATUS_REASONS.get(status, "stop")
        return EngineCoreOutput(group.group_id, [], finish_reason=reason or "length", beam_hypotheses=results,
                                num_cached_tokens=max(group.beams[0].num_cached_tokens, 0) if group.beams else 0)


def _child(sched, group: BeamGroup, parent: Request, token: int) -> Request:
    """A child beam: its parent's sequence plus ``token``, sharing the parent's blocks."""
    child = Request(group.new_beam_id(), parent.prompt_token_ids, parent.sampling_params, parent.max_tokens,
                    arrival_time=parent.arrival_time, cache_salt=parent.cache_salt, priority=parent.priority)
    child.output_token_ids = parent.output_token_ids + [token]
    child.all_token_ids = parent.all_token_ids + [token]
    child.status = RequestStatus.RUNNING
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_cached_tokens = parent.num_cached_tokens
    child.num_preemptions = parent.num_preemptions
    child.beam = group
    child.unit = parent.unit
    fork_blocks(sched.kv, parent, child)
    sched.register(child)
    return child
