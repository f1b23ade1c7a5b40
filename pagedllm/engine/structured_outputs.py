"""The engine core's hooks for constrained requests, around a StructuredOutputManager.

A constrained request waits here (not in the scheduler) until its grammar is compiled on the
manager's thread; each step, ``admit`` hands the compiled ones to the scheduler; ``grammar``
gives the runner the bitmask of the constrained requests that sample; ``after_update`` advances
their matchers with the appended tokens and stops a request whose grammar has ended (finish
reason "stop", as vLLM) or fails one that produced a token its grammar forbids.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Optional

from pagedllm.core.contracts import EngineCoreOutput, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.structured_output.manager import StepGrammar, StructuredOutputManager

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self.compiling: dict[str, tuple[Request, Future, float]] = {}  # request, compile, since

    def add(self, request: Request) -> None:
        fut = self.manager.submit(request.sampling_params.structured_outputs)
        self.compiling[request.request_id] = (request, fut, time.monotonic())

    def abort(self, request_ids) -> list[str]:
        """Forget these requests (their compiles withdrawn); the ids that were still compiling
        (unknown to the scheduler)."""
        dropped = []
        for rid in request_ids:
            entry = self.compiling.pop(rid, None)
            if entry is not None:
                entry[1].cancel()
                dropped.append(rid)
            self.manager.remove(rid)
        return dropped

    def admit(self, scheduler: Scheduler, idle: bool) -> list[EngineCoreOutput]:
        """Move compiled requests into the scheduler; a failed compile finishes its request with
        "error". ``idle``: nothing else to run, so wait (briefly) for a compile to end."""
        if not self.compiling:
            return []
        if idle:
            wait([e[1] for e in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        outputs = []
        now = time.monotonic()
        for rid, (req, fut, since) in list(self.compiling.items()):
            if not fut.done() and now - since > self.manager.limits.timeout:  # waited long enough
                del self.compiling[rid]
                fut.cancel()
                logger.error("request %s: %s", rid, self.manager.timeout_error(req.sampling_params.structured_outputs))
                outputs.append(EngineCoreOutput(rid, [], finish_reason="error"))
                continue
            if not fut.done():
                continue
            del self.compiling[rid]
            try:
                self.manager.start(rid, fut.result(), req.output_token_ids)
                scheduler.add_request(req)
            except Exception as e:
                logger.error("request %s: its structured output constraint failed: %s", rid, e)
                self.manager.remove(rid)
                outputs.append(EngineCoreOutput(rid, [], finish_reason="error"))
        return outputs

    def grammar(self, so: SchedulerOutput, scheduler: Scheduler) -> Optional[StepGrammar]:
        if not self.manager.matchers:
            return None
        sampling = []
        for rid in so.num_scheduled_tokens:  # after schedule(): computed counts include this step
            req = scheduler.requests.get(rid)
            if req is not None and req.num_computed_tokens >= req.num_tokens:
                sampling.append(rid)
        return self.manager.step_grammar(sampling)

    def after_update(self, outputs: list[EngineCoreOutput], scheduler: Scheduler) -> list[EngineCoreOutput]:
        if not self.manager.matchers:
            return outputs
        result = []
        for out in outputs:
            try:  # a matcher that raises fails its request only
                out = self._advance(out, scheduler)
            except Exception:
                logger.exception("request %s: advancing its grammar failed; it finishes with \"error\"", out.req_id)
                scheduler.fail_request(out.req_id)
                out = dataclasses.replace(out, finish_reason="error")
                self.manager.remove(out.req_id)
            result.append(out)
        return result

    def _advance(self, out: EngineCoreOutput, scheduler: Scheduler) -> EngineCoreOutput:
        req = scheduler.requests.get(out.req_id)
        adv = None
        if out.new_token_ids and req is not None:
            adv = self.manager.advance(out.req_id, out.new_token_ids, req.sampling_params._all_stop_token_ids)
        if adv is not None and out.finish_reason is None and (adv.rejected or adv.terminated):
            status = RequestStatus.FINISHED_ERROR if adv.rejected else RequestStatus.FINISHED_STOPPED
            scheduler.finish_requests([out.req_id], status)
            out = dataclasses.replace(out, finish_reason="error" if adv.rejected else "stop")
        if out.finish_reason is not None:
            self.manager.remove(out.req_id)
        return out
