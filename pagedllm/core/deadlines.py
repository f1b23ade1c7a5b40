"""Request deadlines, kept by the core: a request past its deadline is ended by the scheduler
itself at the start of the next step (waiting, running or preempted alike), its blocks freed,
without a round trip to the front end that set it. The front end keeps its own timer as well
(a wedged core still answers its clients); whichever acts first, the client sees one timeout.

A heap of (deadline, request id): each step looks at its smallest entry only, so requests
without a deadline, or far from it, cost nothing. Entries of requests that ended otherwise are
dropped when they reach the top.
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional


class DeadlineWatch:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request_id: str, deadline: Optional[float]) -> None:
        """``deadline``: time.monotonic() seconds (system-wide on Linux, so a front end in another
        process sets it on the same clock); None: the request has none."""
        if deadline is not None:
            heapq.heappush(self._heap, (deadline, request_id))

    def expired(self, now: float, is_live: Callable[[str], bool]) -> list[str]:
        """The live requests whose deadline is at or before ``now``, taken off the watch."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            if is_live(rid):
                out.append(rid)
        return out
