"""The workers' LoRA adapter slots as the scheduler assigns them.

Workers hold ``max_loras`` slots of stacked adapter weights; a running request pins its adapter's
slot. A request whose adapter is in no slot gets one when a slot is empty or holds an adapter no
running request uses (the least recently used such one is replaced): the scheduler then tells the
workers to load it before the step (``SchedulerOutput.lora_loads``). When every slot is pinned the
request waits while the others run.
"""
from __future__ import annotations

from typing import Optional

from pagedllm.core.contracts import LoRAHandle


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}  # adapter key -> slot
        self.handles: list[Optional[LoRAHandle]] = [None] * num_slots
        self.users = [0] * num_slots  # running requests pinning each slot
        self.last_used = [0] * num_slots  # LRU clock
        self._clock = 0
        self._loads: list[tuple[int, LoRAHandle]] = []

    def acquire(self, handle: LoRAHandle) -> Optional[int]:
        """Pin ``handle``'s slot (loading it into a free or unpinned slot if needed); None when
        every slot is pinned by other adapters."""
        slot = self.slot_of.get(handle.key)
        if slot is None:
            slot = self._victim()
            if slot is None:
                return None
            old = self.handles[slot]
            if old is not None:
                del self.slot_of[old.key]
            self.handles[slot] = handle
            self.slot_of[handle.key] = slot
            self._loads = [(s, h) for s, h in self._loads if s != slot] + [(slot, handle)]
        self.users[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        if self.users[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.users[slot] -= 1

    def _victim(self) -> Optional[int]:
        best: Optional[int] = None
        for s in range(self.num_slots):
            if self.handles[s] is None:
                return s
            if self.users[s] == 0 and (best is None or self.last_used[s] < self.last_used[best]):
                best = s
        return best

    def take_loads(self) -> tuple[tuple[int, LoRAHandle], ...]:
        """The (slot, adapter) loads decided since the last call, for this step's workers."""
        loads, self._loads = tuple(self._loads), []
        return loads
