"""Scheduling policies: the order of the waiting queue and of the running batch, and who is preempted.

A policy answers four questions for the scheduler's loop and nothing else:
- ``enqueue``: where a new request waits;
- ``requeue``: where a preempted (or rewound) unit's requests wait again, kept together in order;
- ``join``: where an admitted unit's requests sit in the running batch (running requests are
  served in that order each step);
- ``victim``: which running request loses its blocks when one cannot get a block (its whole unit
  is preempted).

The loop relies on one invariant: the victim is the last running request (so the loop, which
serves the running batch front to back, never preempts a request it has already scheduled this
step). FCFS keeps it by admission order; the priority policy keeps the running batch sorted by
its key. A new policy is a class with these four methods, registered in ``POLICIES``.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from typing import Protocol, Sequence

from pagedllm.core.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def enqueue(self, waiting: deque[Request], request: Request) -> None: ...

    def requeue(self, waiting: deque[Request], requests: Sequence[Request]) -> None: ...

    def join(self, running: list[Request], requests: Sequence[Request]) -> None: ...

    def victim(self, running: list[Request]) -> Request: ...


class FCFSPolicy:
    """First come, first served: new requests wait at the back, preempted ones at the front; the
    most recently admitted running request is preempted first."""

    name = "fcfs"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def requeue(self, waiting: deque[Request], requests: Sequence[Request]) -> None:
        waiting.extendleft(reversed(requests))

    def join(self, running: list[Request], requests: Sequence[Request]) -> None:
        running.extend(requests)

    def victim(self, running: list[Request]) -> Request:
        return running[-1]


def priority_key(request: Request) -> tuple[int, float]:
    """Lower runs first (vLLM's rule); ties by arrival."""
    return request.priority, request.arrival_time


class PriorityPolicy:
    """By (priority, arrival time), lower first, in both queues: a waiting request is admitted
    before every waiting request with a greater key, and the running request with the greatest
    key is preempted first (so a request never loses its blocks to one that ranks below it).
    Equal keys keep their insertion order, so a unit's requests (a beam group shares one key)
    stay together."""

    name = "priority"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.insert(bisect_right(waiting, priority_key(request), key=priority_key), request)

    def requeue(self, waiting: deque[Request], requests: Sequence[Request]) -> None:
        # before the waiting requests of the same key: it was admitted ahead of them once
        key = priority_key(requests[0])
        at = next((i for i, r in enumerate(waiting) if priority_key(r) >= key), len(waiting))
        for j, r in enumerate(requests):
            waiting.insert(at + j, r)

    def join(self, running: list[Request], requests: Sequence[Request]) -> None:
        at = bisect_right(running, priority_key(requests[0]), key=priority_key)
        running[at:at] = requests

    def victim(self, running: list[Request]) -> Request:
        return running[-1]


POLICIES: dict[str, type] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {name!r}") from None
