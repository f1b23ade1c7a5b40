"""Admission constraints: what limits which units the scheduler's loop may run in a step, beyond
the token budget, max_num_seqs and the KV cache.

A constraint is asked, per unit, in the loop's fixed order:
- ``batch_full(num_scheduled)``: the step takes no more units (micro-batches in flight);
- ``holds_back(unit)``: the unit sits this step out (a running one is not scheduled, a waiting one
  is set aside while the others go on);
- ``fits_step(unit)``: a running unit may run this step (it may be counted: LoRA's per-step cap);
- ``acquire(unit)``: a waiting unit takes what it holds while it runs (a LoRA slot, one of its
  request's share of the running slots); False sets it aside; ``release(request)`` gives it back when the request leaves the running batch or its
  admission fails.
``start_step(num_running, num_waiting)`` resets the per-step state; ``step_output()`` and
``stats(running, waiting)`` add its fields to the step's SchedulerOutput and to SchedulerStats. A
new constraint is a class with these methods, given to the Scheduler (``SchedulerLimits`` turns
the built-in ones on: ``make_constraints``).
"""
from __future__ import annotations

from typing import Iterable, Protocol

from pagedllm.core.lora_slots import AdapterSlots
from pagedllm.core.request import Request


class AdmissionConstraint(Protocol):
    def start_step(self, num_running: int, num_waiting: int) -> None: ...

    def batch_full(self, num_scheduled: int) -> bool: ...

    def holds_back(self, unit) -> bool: ...

    def fits_step(self, unit) -> bool: ...

    def acquire(self, unit) -> bool: ...

    def release(self, request: Request) -> None: ...

    def step_output(self) -> dict: ...

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict: ...


class LoRASlots:
    """LoRA: a running request pins its adapter's slot on the workers (core/lora_slots.py), and a
    step runs at most ``per_step`` distinct adapters."""

    def __init__(self, max_loras: int, per_step: int) -> None:
        self.slots = AdapterSlots(max_loras)
        self.per_step = per_step or max_loras
        self._step: set[str] = set()  # adapter keys this step runs

    def start_step(self, num_running: int, num_waiting: int) -> None:
        self._step.clear()

    def batch_full(self, num_scheduled: int) -> bool:
        return False

    def holds_back(self, unit) -> bool:
        return False

    def fits_step(self, unit) -> bool:
        """Under the cap of distinct adapters per step (counting this unit's)."""
        handle = unit.lora
        if handle is None or handle.key in self._step:
            return True
        if len(self._step) >= self.per_step:
            return False
        self._step.add(handle.key)
        return True

    def acquire(self, unit) -> bool:
        handle = unit.lora
        if handle is None:
            return True
        fresh = handle.key not in self._step
        if not self.fits_step(unit):
            return False
        slot = self.slots.acquire(handle)
        if slot is None:
            if fresh:
                self._step.discard(handle.key)
            return False
        for req in unit.requests:
            req.lora_slot = slot
        return True

    def release(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.slots.release(request.lora_slot)
            request.lora_slot = -1

    def step_output(self) -> dict:
        return {"lora_loads": self.slots.take_loads()}

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict:
        """Adapter names of running and waiting requests (vLLM's lora_requests_info)."""
        return {"running_loras": tuple(sorted({r.lora.name for r in running if r.lora is not None})),
                "waiting_loras": tuple(sorted({r.lora.name for r in waiting if r.lora is not None}))}


class InFlightBatches:
    """Batches in flight (pipeline parallelism's P stages, or an asynchronous executor that runs a
    step while the host prepares the next): a request in a batch whose output is not back is not
    scheduled again (its next token is unknown), and each batch takes at most 1/P of the requests,
    so the next batch has requests that are not in flight. The engine core marks a batch's
    requests in flight when it submits it and clears them when its output is back (``in_flight``)."""

    def __init__(self, num_stages: int, max_num_seqs: int) -> None:
        self.num_stages = num_stages
        self.max_num_seqs = max_num_seqs
        self.in_flight: set[str] = set()
        self.max_batch_reqs = 0

    def start_step(self, num_running: int, num_waiting: int) -> None:
        self.max_batch_reqs = -(-min(num_running + num_waiting, self.max_num_seqs) // self.num_stages)

    def batch_full(self, num_scheduled: int) -> bool:
        return 0 < self.max_batch_reqs <= num_scheduled

    def holds_back(self, unit) -> bool:
        return any(r.request_id in self.in_flight for r in unit.requests)

    def fits_step(self, unit) -> bool:
        return True

    def acquire(self, unit) -> bool:
        return True

    def release(self, request: Request) -> None:
        pass

    def step_output(self) -> dict:
        return {}

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict:
        return {}


class RequestShare:
    """One request's sequences (its n / best_of children, core requests with the same
    ``parent_id``) hold at most ``max_per_request`` running slots: the rest are set aside while
    other requests are admitted, and take a slot as one of theirs leaves (finished or preempted)."""

    def __init__(self, max_per_request: int) -> None:
        self.max_per_request = max_per_request
        self._running: dict[str, set[str]] = {}  # parent id -> its children holding a slot

    def start_step(self, num_running: int, num_waiting: int) -> None:
        pass

    def batch_full(self, num_scheduled: int) -> bool:
        return False

    def holds_back(self, unit) -> bool:
        return False

    def fits_step(self, unit) -> bool:
        return True

    def acquire(self, unit) -> bool:
        for req in unit.requests:
            if req.parent_id is None:
                continue
            held = self._running.setdefault(req.parent_id, set())
            if len(held) >= self.max_per_request:
                return False
            held.add(req.request_id)
        return True

    def release(self, request: Request) -> None:
        held = self._running.get(request.parent_id) if request.parent_id is not None else None
        if held is not None:
            held.discard(request.request_id)
            if not held:
                del self._running[request.parent_id]

    def step_output(self) -> dict:
        return {}

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict:
        return {}


def make_constraints(max_loras: int, max_loras_per_step: int, max_batches_in_flight: int,
                     max_num_seqs: int, max_num_seqs_per_request: int = 0) -> list[AdmissionConstraint]:
    """The built-in constraints a configuration turns on (``max_num_seqs_per_request`` 0 or at
    least max_num_seqs: no per-request share)."""
    out: list[AdmissionConstraint] = []
    if 0 < max_num_seqs_per_request < max_num_seqs:
        out.append(RequestShare(max_num_seqs_per_request))
    if max_loras:
        out.append(LoRASlots(max_loras, max_loras_per_step))
    if max_batches_in_flight > 1:
        out.append(InFlightBatches(max_batches_in_flight, max_num_seqs))
    return out
