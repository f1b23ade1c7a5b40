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
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

from pagedllm.core.beam_blocks import copy_on_write, fork_blocks
from pagedllm.core.beam_group import BeamGroup
from pagedllm.core.contracts import BeamRow, EngineCoreOutput, ModelRunnerOutput, NewRequestData
from pagedllm.core.request import Request, RequestStatus

Scheduler = Any  # core/scheduler.py's Scheduler, which imports this module (no import back: no cycle)

logger = logging.getLogger(__name__)

ADMITTED, SKIPPED, BLOCKED = "admitted", "skipped", "blocked"


def beam_row_data(sched: Scheduler, beam: Request) -> NewRequestData:
    group: BeamGroup = beam.beam
    return replace(sched._new_request_data(beam),
                   beam=BeamRow(group.group_id, group.cum_logprob(beam), group.num_candidates))


def _plan(sched: Scheduler, remaining: list[int], budget: int) -> Optional[list[int]]:
    """Tokens per beam this step: all remaining (every beam then samples), or each up to its
    last-but-one token (none samples). None: nothing can run this step."""
    if sum(remaining) <= budget and all(sched._cap(r, budget) == r for r in remaining):
        return remaining
    # Catching up is chunked even without chunked prefill: a root's prompt always fits one step
    # there (budget >= max_model_len), but W preempted beams recomputed at once may not.
    # Each beam first gets an equal share (so all can be admitted together), then the rest in order.
    behind = sum(1 for r in remaining if r > 1)
    if behind == 0 or budget < behind:
        return None
    share = budget // behind
    plan = [max(0, min(r - 1, sched._cap(r - 1, share))) for r in remaining]
    left = budget - sum(plan)
    for i, r in enumerate(remaining):
        extra = max(0, min(r - 1 - plan[i], sched._cap(r - 1, plan[i] + left) - plan[i]))
        plan[i] += extra
        left -= extra
    return plan if sum(plan) else None


# ---- running groups -----------------------------------------------------------------------------
def schedule_running(sched: Scheduler, i: int, budget: int, only: Optional[set[str]],
                     num_scheduled: dict[str, int], new_reqs: list[NewRequestData], preempted: set[str],
                     copies: list[tuple[int, int]]) -> tuple[int, int, bool]:
    """Schedule the group whose first beam is ``running[i]``. Returns (index after the group,
    budget left, stop): stop means the group itself was preempted (nothing after it runs)."""
    group: BeamGroup = sched.running[i].beam
    beams = list(group.beams)
    n = len(beams)
    if only is not None and not any(b.request_id in only for b in beams):
        return i + n, budget, False
    plan = _plan(sched, [b.num_tokens - b.num_computed_tokens for b in beams], budget)
    if plan is None:
        return i + n, budget, False
    local_copies: list[tuple[int, int]] = []
    for beam, t in zip(beams, plan):
        if t == 0:
            continue
        while True:
            cow = copy_on_write(sched.kv, beam)
            if cow:
                local_copies.append(cow)
            if cow != () and sched.kv.allocate_slots(beam, t) is not None:
                break
            victim = sched.running.pop()
            sched._preempt(victim)
            preempted.add(victim.request_id)
            if beam.status != RequestStatus.RUNNING:
                return i, budget, True  # the group was the victim: its blocks (and copies) are gone
    for beam, t in zip(beams, plan):
        if t:
            num_scheduled[beam.request_id] = t
            new_reqs.append(beam_row_data(sched, beam))
    copies.extend(local_copies)
    return i + n, budget - sum(plan), False


def preempt_group(sched: Scheduler, group: BeamGroup, uncache: bool = False) -> None:
    """Every live beam loses its blocks and waits at the front of the queue (the group's order kept)."""
    beams = group.beams
    ids = {id(b) for b in beams}
    sched.running[:] = [r for r in sched.running if id(r) not in ids]
    for b in reversed(beams):
        sched.kv.free(b, uncache)
        b.status = RequestStatus.PREEMPTED
        b.num_computed_tokens = 0
        b.num_preemptions += 1
        if b.request_id in sched._sent_to_workers:
            sched._sent_to_workers.discard(b.request_id)
            sched._rewound_ids.add(b.request_id)
    sched.num_preemptions += 1
    sched.waiting.extendleft(reversed(beams))


# ---- admission ----------------------------------------------------------------------------------
def admit(sched: Scheduler, budget: int, only: Optional[set[str]], num_scheduled: dict[str, int],
          new_reqs: list[NewRequestData]) -> tuple[str, int]:
    """Admit the group whose first beam is ``waiting[0]``, whole or not at all. Returns (ADMITTED,
    SKIPPED -- not in ``only``, the caller sets its beams aside -- or BLOCKED, budget left)."""
    group: BeamGroup = sched.waiting[0].beam
    beams = list(group.beams)
    if only is not None and not any(b.request_id in only for b in beams):
        return SKIPPED, budget
    if len(sched.running) + group.width > sched.limits.max_num_seqs:
        return BLOCKED, budget
    hits = []
    for b in beams:
        blocks, num_hit = sched.kv.get_computed_blocks(b)
        while len(beams) > 1 and blocks and b.num_tokens - num_hit < 2:  # every beam computes >= 1 token
            blocks, num_hit = blocks[:-1], num_hit - sched.kv.block_size
        hits.append((blocks, num_hit))
    plan = _plan(sched, [b.num_tokens - h[1] for b, h in zip(beams, hits)], budget)
    if plan is None or not all(plan):
        return BLOCKED, budget
    done: list[Request] = []
    for beam, (blocks, num_hit), t in zip(beams, hits, plan):
        if sched.kv.allocate_slots(beam, t, num_hit, blocks) is None:
            for b in done:  # all or nothing; blocks registered for this step were never written
                sched.kv.free(b, uncache=True)
            return BLOCKED, budget
        done.append(beam)
    for beam, (_blocks, num_hit), t in zip(beams, hits, plan):
        assert sched.waiting[0] is beam
        sched.admit_waiting_head(beam, num_hit)
        if t:
            num_scheduled[beam.request_id] = t
            new_reqs.append(beam_row_data(sched, beam))
    return ADMITTED, budget - sum(plan)


# ---- results ------------------------------------------------------------------------------------
def apply_candidates(sched: Scheduler, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
    """Advance every group the step scored; a finished group's hypotheses go out as one output."""
    outputs: list[EngineCoreOutput] = []
    for gid, cands in runner_output.beam_candidates.items():
        group = sched.beam_groups.get(gid)
        if group is None:
            continue
        live = {b.request_id for b in group.beams}
        if not set(cands.parent_ids) <= live or any(
                b.status != RequestStatus.RUNNING or b.num_computed_tokens < b.num_tokens for b in group.beams):
            continue  # preempted or aborted while the step ran
        try:  # a failure in one group's bookkeeping ends that search with "error", not the engine
            out = _advance_group(sched, group, cands)
        except Exception:
            logger.exception("beam search %s: advancing it failed; it finishes with \"error\"", gid)
            out = sched.fail_request(gid)[0]
        if out is not None:
            outputs.append(out)
    return outputs


def _advance_group(sched: Scheduler, group: BeamGroup, cands) -> Optional[EngineCoreOutput]:
    nxt = group.advance(cands, sched.limits.max_model_len)
    if group.done:
        return finish_group(sched, group, None)
    children: list[Request] = []
    try:
        for parent, tok, _ in nxt:
            children.append(_child(sched, group, parent, tok))
    except Exception:
        for c in children:  # their forked block references go back before the group fails
            sched.kv.free(c)
        raise
    old = group.beams
    k = sched.running.index(old[0])
    sched.running[k:k + len(old)] = children
    for b in old:
        _retire(sched, b)
    for c in children:
        sched.requests[c.request_id] = c
    group.adopt(children, nxt, cands)
    return None


def _child(sched: Scheduler, group: BeamGroup, parent: Request, token: int) -> Request:
    child = Request(group.new_beam_id(), parent.prompt_token_ids, parent.sampling_params, parent.max_tokens,
                    arrival_time=parent.arrival_time, cache_salt=parent.cache_salt)
    child.output_token_ids = parent.output_token_ids + [token]
    child.all_token_ids = parent.all_token_ids + [token]
    child.status = RequestStatus.RUNNING
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_cached_tokens = parent.num_cached_tokens
    child.num_preemptions = parent.num_preemptions
    child.beam = group
    fork_blocks(sched.kv, parent, child)
    return child


def _retire(sched: Scheduler, beam: Request, uncache: bool = False) -> None:
    """A beam leaves: its references go back to the pool at once, the workers forget it."""
    sched.kv.free(beam, uncache)
    sched.requests.pop(beam.request_id, None)
    if beam.request_id in sched._sent_to_workers:
        sched._finished_ids.add(beam.request_id)
        sched._sent_to_workers.discard(beam.request_id)


def finish_group(sched: Scheduler, group: BeamGroup, status: Optional[RequestStatus]) -> EngineCoreOutput:
    """The search is over (``status`` None: it ended by its rules; else aborted / stopped / error)."""
    ids = {id(b) for b in group.beams}
    sched.running[:] = [r for r in sched.running if id(r) not in ids]
    if any(id(r) in ids for r in sched.waiting):
        remaining = [r for r in sched.waiting if id(r) not in ids]
        sched.waiting.clear()
        sched.waiting.extend(remaining)
    for b in group.beams:
        b.status = status or RequestStatus.FINISHED_STOPPED
        _retire(sched, b, uncache=status == RequestStatus.FINISHED_ERROR)
    sched.beam_groups.pop(group.group_id, None)
    group.done = True
    results = group.results() if status != RequestStatus.FINISHED_ERROR else []  # the failure path scores nothing
    reason = results[0].finish_reason if status is None and results else None
    if status is not None:
        reason = {RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(status, "stop")
    return EngineCoreOutput(group.group_id, [], finish_reason=reason or "length", beam_hypotheses=results,
                            num_cached_tokens=max(group.beams[0].num_cached_tokens, 0) if group.beams else 0)
