"""The router's replicas: health, load (requests in flight), prefix index, and the choice of
where one request goes.

Health: a replica starts "down" until its /health answers 200 (polled every ``retry_min_s``
while it has never answered: it may be loading); a connect error, a timeout or a 5xx on /health
(polled) or on a proxied request takes it out; it is tried again after a backoff that doubles per
consecutive failure (``retry_min_s`` .. ``retry_max_s``). Its prefix index is
cleared when it goes down (a restarted server has an empty cache).

Choice (``policy``):
- ``prefix``: the healthy replica holding the longest prefix of the request's block hashes; ties
  and misses go to the least loaded (fewest in flight, then fewest routed). The match must cover
  at least ``min_prefix_ratio`` of the prompt's full blocks: a chat template's boilerplate (the
  first block of every chat request) or a short common preamble would otherwise pull every
  request to whichever replica saw it first. A prefix owner more than ``max_load_imbalance``
  requests busier than the least loaded replica is passed over, so a hot prefix cannot pin all
  traffic on one replica.
- ``least_loaded``: fewest in flight.
- ``round_robin``: in turn (the baseline the benchmark compares against).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from pagedllm.entrypoints.router.prefix_index import PrefixIndex

POLICIES = ("prefix", "least_loaded", "round_robin")


class Replica:
    def __init__(self, index: int, url: str, index_capacity_blocks: int) -> None:
        self.id = index
        self.url = url.rstrip("/")
        self.prefix = PrefixIndex(index_capacity_blocks)
        self.healthy = False
        self.in_flight = 0
        self.routed = 0  # requests sent here (counter)
        self.prefix_routed = 0  # of which chosen for a cached prefix
        self.failures = 0  # consecutive failed checks
        self.next_check = 0.0  # monotonic time of the next health check while down
        self.last_error: Optional[str] = None
        self.ever_up = False  # until a first 200, a starting server is polled at the shortest interval
        self.last_check = 0.0  # monotonic time of its last health check


@dataclass(frozen=True, slots=True)
class Choice:
    replica: Replica
    matched_blocks: int  # leading blocks the replica's index held (0: a load-based choice)


class ReplicaSet:
    def __init__(self, urls: Sequence[str], policy: str = "prefix", index_capacity_blocks: int = 1 << 16,
                 max_load_imbalance: int = 8, retry_min_s: float = 1.0, retry_max_s: float = 30.0,
                 min_prefix_ratio: float = 0.5) -> None:
        if not urls:
            raise ValueError("the router needs at least one backend URL")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"backend URL must start with http:// or https://, got {u!r}")
        if max_load_imbalance < 0:
            raise ValueError(f"max_load_imbalance must be >= 0, got {max_load_imbalance}")
        self.replicas = [Replica(i, u, index_capacity_blocks) for i, u in enumerate(urls)]
        self.policy = policy
        self.max_load_imbalance = max_load_imbalance
        if not 0.0 <= min_prefix_ratio <= 1.0:
            raise ValueError(f"min_prefix_ratio must be in [0, 1], got {min_prefix_ratio}")
        self.min_blocks = lambda total: max(1, math.ceil(min_prefix_ratio * total))
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self._rr = 0

    def healthy(self, exclude: Sequence[Replica] = ()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r not in exclude]

    def choose(self, block_hashes: Sequence[bytes], exclude: Sequence[Replica] = (),
               count: bool = True) -> Optional[Choice]:
        """Where a request with these prompt block hashes goes (None: no healthy replica). The
        choice is recorded: the replica's in-flight count and index grow (``finish`` undoes the
        first); ``count``: a generation request, counted in ``routed`` (not /v1/models and the like)."""
        live = self.healthy(exclude)
        if not live:
            return None
        matched = 0
        if self.policy == "round_robin":
            chosen = live[self._rr % len(live)]
            self._rr += 1
        else:
            least = min(live, key=lambda r: (r.in_flight, r.routed))
            chosen = least
            if self.policy == "prefix" and block_hashes:
                best = max(live, key=lambda r: (r.prefix.match(block_hashes), -r.in_flight, -r.routed))
                n = best.prefix.match(block_hashes)
                if n >= self.min_blocks(len(block_hashes)) and best.in_flight - least.in_flight <= self.max_load_imbalance:
                    chosen, matched = best, n
        chosen.in_flight += 1
        chosen.routed += int(count)
        if matched:
            chosen.prefix_routed += 1
        if block_hashes and self.policy != "round_robin":
            chosen.prefix.insert(block_hashes)
        return Choice(chosen, matched)

    @staticmethod
    def finish(replica: Replica) -> None:
        replica.in_flight -= 1

    def mark_up(self, replica: Replica) -> None:
        replica.healthy = True
        replica.ever_up = True
        replica.failures = 0
        replica.last_error = None

    def mark_down(self, replica: Replica, error: str, now: Optional[float] = None) -> None:
        """Take a replica out; it is checked again after a backoff doubling per failure."""
        now = time.monotonic() if now is None else now
        if replica.healthy:
            replica.prefix.clear()
        replica.healthy = False
        replica.failures += 1
        replica.last_error = error
        backoff = self.retry_min_s * 2 ** (replica.failures - 1) if replica.ever_up else self.retry_min_s
        replica.next_check = now + min(self.retry_max_s, backoff)

    def due_for_check(self, interval: float, now: Optional[float] = None) -> list[Replica]:
        """Healthy replicas checked ``interval`` seconds ago or more, and down ones whose backoff
        has passed; they are marked checked now."""
        now = time.monotonic() if now is None else now
        due = [r for r in self.replicas
               if (r.healthy and now - r.last_check >= interval) or (not r.healthy and r.next_check <= now)]
        for r in due:
            r.last_check = now
        return due
