"""Requests with an output constraint (structured outputs) as the scheduler knows them.

A constrained request enters the scheduler at once, in the status WAITING_FOR_GRAMMAR, and sits
in the waiting queue (in the policy's order) while its grammar compiles off the step loop. It is
a scheduling unit of its own type, ``GrammarUnit``: a plain request (RequestUnit) whose admission
first asks whether its grammar is ready -- not yet: it is set aside and the units behind it go
on; failed or timed out: it finishes with "error" (an output the engine takes with
``Scheduler.take_outputs``) -- and whose results advance its grammar: a token the grammar
forbids fails it, the grammar's end stops it (finish reason "stop", as vLLM).

The grammars themselves are behind one seam, ``GrammarSource`` (engine/structured_outputs.py
implements it over the compile pool and xgrammar's matchers; the core imports nothing of it).
Each step the scheduler asks it for the bitmask of the constrained requests that sample, and the
mask travels to the sampling rank in SchedulerOutput.grammar. Preemption keeps a request's
matcher where it is (its tokens are kept); a rewound step never reached the matcher.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

import msgspec

from pagedllm.core.contracts import EngineCoreOutput, GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus, finish_reason_of
from pagedllm.core.scheduling_units import ADMITTED, LEFT, SET_ASIDE, RequestUnit, StepPlan

logger = logging.getLogger(__name__)


def no_tokenizer_for_structured_outputs() -> ValueError:
    """The refusal of a constrained request by an engine started without a tokenizer."""
    return ValueError("structured_outputs needs the engine's tokenizer (the engine was started without one)")


@dataclass(frozen=True, slots=True)
class Advance:
    """What accepting a request's new tokens found."""

    rejected: bool  # a token the grammar does not allow (the output is not valid: fail the request)
    terminated: bool  # the grammar reached its end (the request should stop)


class GrammarSource(Protocol):
    """The scheduler's view of the grammars, keyed by request id."""

    @property
    def num_compiling(self) -> int: ...  # requests whose compile has not been taken up by ``ready``

    def submit(self, request: Request) -> None: ...  # start compiling its constraint (raises: refused)

    def ready(self, request: Request) -> bool: ...  # compiled and its matcher started; raises: failed / timed out

    def wait(self, timeout: float) -> None: ...  # block until some compile ends (at most ``timeout`` s)

    def bitmask(self, req_ids: list[str]) -> Optional[GrammarBitmask]: ...  # masks of these sampling requests

    def accept(self, req_id: str, tokens: list[int], stop_token_ids: Iterable[int]) -> Optional[Advance]: ...

    def remove(self, req_id: str) -> None: ...  # forget it (its compile withdrawn)


class GrammarUnit(RequestUnit):
    """A constrained request: waits for its grammar, decodes one masked token per step."""

    __slots__ = ("grammars",)

    def __init__(self, request: Request, grammars: GrammarSource) -> None:
        super().__init__(request)
        self.grammars = grammars

    def admit(self, sched, plan: StepPlan) -> str:
        req = self.request
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            try:
                if not self.grammars.ready(req):
                    return SET_ASIDE  # still compiling: the units behind it go on
            except Exception as e:
                logger.error("request %s: its structured output constraint failed: %s", req.request_id, e)
                self.finish(sched, RequestStatus.FINISHED_ERROR)
                sched.report(EngineCoreOutput(req.request_id, [], finish_reason="error"))
                return LEFT
            req.status = RequestStatus.WAITING
        verdict = super().admit(sched, plan)
        if verdict == ADMITTED:
            self.schedule_step(sched, plan)
        return verdict

    def schedule_step(self, sched, plan: StepPlan) -> None:
        """After scheduling: it samples this step (its computed count reaches its tokens), so
        its mask goes with the step."""
        req = self.request
        n = plan.num_scheduled.get(req.request_id, 0)
        if n and req.num_computed_tokens + n >= req.num_tokens:
            plan.masked.append(req.request_id)

    def schedule_running(self, sched, plan: StepPlan) -> bool:
        running = super().schedule_running(sched, plan)
        self.schedule_step(sched, plan)
        return running

    def on_output(self, sched, so: SchedulerOutput, out: ModelRunnerOutput, row: int,
                  outputs: list[EngineCoreOutput]) -> None:
        n = len(outputs)
        super().on_output(sched, so, out, row, outputs)
        req = self.request
        if len(outputs) > n and outputs[-1].new_token_ids and not req.is_finished:
            outputs[-1] = self._advance(sched, outputs[-1])
        if req.is_finished:
            self.grammars.remove(req.request_id)

    def _advance(self, sched, out: EngineCoreOutput) -> EngineCoreOutput:
        req = self.request
        try:  # a matcher that raises fails its request only
            adv = self.grammars.accept(req.request_id, out.new_token_ids, req.sampling_params.all_stop_token_ids)
        except Exception:
            logger.exception("request %s: advancing its grammar failed; it finishes with \"error\"", req.request_id)
            adv = Advance(rejected=True, terminated=False)
        if adv is None or not (adv.rejected or adv.terminated):
            return out
        status = RequestStatus.FINISHED_ERROR if adv.rejected else RequestStatus.FINISHED_STOPPED
        sched.finish(req, status)
        return msgspec.structs.replace(out, finish_reason=finish_reason_of(status))

    def finish(self, sched, status: RequestStatus) -> Optional[EngineCoreOutput]:
        sched.finish(self.request, status)
        self.grammars.remove(self.request.request_id)
        return None
