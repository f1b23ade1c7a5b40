"""How EngineCore keeps steps in flight: its one step loop (``EngineCore._step``) runs over a
queue of submitted steps, and the policy chosen at construction says how deep the queue goes
and what a step does when it is submitted, when its output lands and when it fails:

- ``Synchronous`` (depth 1): the step runs in place (``executor.execute``) as its output is
  wanted; a failure is isolated to the request that caused it (``EngineCore._isolate``).
- ``AsyncScheduling`` (depth 2, ``async_scheduling``): step N+1 is scheduled and submitted while
  step N runs, for the same requests. A request sampling in step N is scheduled in N+1 past that
  token (``Request.num_pending``, marked on submit, settled once N's output is applied): the
  worker appends what it samples to its own request state, so N+1's input is N's token without
  the host knowing it. Exact by construction: only known tokens are hashed into prefix-cache
  blocks; a request whose token in flight is its last (max_tokens, max_model_len) is not
  scheduled past it; one that finishes on N's token (a stop token, an abort) is simply dropped
  from N+1's output; one preempted while its token is in flight keeps that token (it waits for
  it before it is admitted again). Steps with a beam search or a constrained request running
  (their next step depends on the token: beams fork, grammars mask) go one at a time
  (``Synchronous``), after the steps in flight.
- ``Pipelined`` (depth P: pipeline stages, or what an asynchronous executor runs at once): the
  scheduler's InFlightBatches constraint splits the requests into micro-batches (a request in a
  batch in flight is not scheduled again until its output is back); a failure is the engine's:
  the stages are out of step, so no request is retried.

A mode's hooks: ``submits(so)`` (is this schedule worth sending), ``launch(so)`` -> a tag kept
with the step, ``land(so)`` -> its ModelRunnerOutput, ``applied(tag)`` after its output is
applied, ``failed(so, tag)`` -> the outputs when ``land`` raised (called while the exception is
handled: a bare ``raise`` re-raises it).
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _log_failure(so) -> None:
    logger.exception("step failed (%d requests); isolating the request that caused it", len(so.num_scheduled_tokens))


class Synchronous:
    """One step at a time, run in place; every schedule goes to the workers (even an empty one:
    it carries the requests they drop)."""

    depth = 1

    def __init__(self, core) -> None:
        self.core = core

    def mode(self) -> "Synchronous":
        return self

    def submits(self, so) -> bool:
        return True

    def launch(self, so) -> None:
        return None

    def land(self, so):
        return self.core.executor.execute(so)

    def applied(self, tag) -> None:
        pass

    def failed(self, so, tag) -> list:
        _log_failure(so)
        return self.core._isolate(so)


class Overlapped:
    """Async scheduling's overlapping steps: submitted to the executor, their sampling requests'
    tokens pending until their output is applied."""

    depth = 2

    def __init__(self, core) -> None:
        self.core = core

    def submits(self, so) -> bool:
        return so.has_work

    def launch(self, so) -> list:
        sampling = self.core.scheduler.mark_pending(so)
        self.core.executor.submit(so)
        return sampling

    def land(self, so):
        return self.core.executor.collect()

    def applied(self, sampling) -> None:
        self.core.scheduler.settle_pending(sampling)

    def failed(self, so, sampling) -> list:
        """The step submitted after the failed one ran on states it left unknown, so its requests
        are rewound (recomputed later) and the failed step is isolated as usual."""
        _log_failure(so)
        core = self.core
        later = list(core._batch_queue)
        core._batch_queue.clear()
        for _ in later:
            try:
                core.executor.collect()
            except Exception:
                pass  # the failure is the first step's; these are redone
        for reqs in [sampling] + [tag for _, _, tag in later]:
            core.scheduler.settle_pending(reqs, all_of_them=True)
        for later_so, _, _ in reversed(later):
            core.scheduler.rewind(later_so)
        core._mark(1)
        return core._isolate(so)


class AsyncScheduling:
    """Overlapped steps while no beam search and no constrained request runs, else synchronous
    ones (after the steps in flight have landed)."""

    def __init__(self, core) -> None:
        self.core = core
        self.overlapped, self.synchronous = Overlapped(core), Synchronous(core)

    def mode(self):
        return self.overlapped if self.can_overlap() else self.synchronous

    def can_overlap(self) -> bool:
        """No beam search and no constrained request running (a constrained request admitted by
        this step's schedule has no token in flight: its mask is right; the next step drains)."""
        structured = self.core.structured
        return not self.core.scheduler.beam_groups and not (structured is not None and structured.num_matching)


class Pipelined:
    """Up to ``depth`` micro-batches in flight, their requests held back until they return."""

    def __init__(self, core, depth: int) -> None:
        self.core = core
        self.depth = depth

    def mode(self) -> "Pipelined":
        return self

    def submits(self, so) -> bool:
        return so.has_work

    def launch(self, so) -> None:
        self.core.executor.submit(so)
        self.core.scheduler.batch_submitted(so)

    def land(self, so):
        runner_output = self.core.executor.collect()
        self.core.scheduler.batch_returned(so)
        return runner_output

    def applied(self, tag) -> None:
        pass

    def failed(self, so, tag) -> list:
        raise  # noqa: PLE0704 -- the exception land raised: the engine's, not one request's


def in_flight_policy(core, async_scheduling: bool, batch_depth: int):
    """The policy for the engine's life: async scheduling, micro-batches (``batch_depth`` > 1), or
    one step at a time."""
    if async_scheduling:
        return AsyncScheduling(core)
    return Pipelined(core, batch_depth) if batch_depth > 1 else Synchronous(core)
