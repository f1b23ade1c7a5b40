"""One step's adapter mapping: which flat-batch rows run with which adapter slot.

Built once per step from the slot of every token (-1: the base model). Rows with an adapter are
sorted by slot (a stable sort keeps their order inside a slot), so every wrapped layer gathers them
once, runs one shrink and one expand product per slot over a contiguous segment, and adds the
deltas back with one scatter. Base rows pay nothing. When every row of the step uses one slot the
gather and scatter are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass(slots=True)
class LoRABatch:
    index: Optional[torch.Tensor]  # [N] long: rows with an adapter, sorted by slot; None = every row, one slot
    groups: list[tuple[int, int, int]]  # (slot, start, end): segments of the sorted rows
    num_rows: int  # N
    segments: Optional[torch.Tensor] = None  # [3 * G] int32 (slot, start, end) on the device: the Triton kernels'


class LoRAStepState:
    """Shared by every wrapped layer of a model: the current step's batch (None: no adapter rows)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


def build_lora_batch(token_slots: np.ndarray, device: torch.device, with_segments: bool = False) -> Optional[LoRABatch]:
    """``token_slots``: [T] int, the adapter slot of each row (-1: none). ``segments`` (for the
    Triton kernels) are built on CUDA or when asked."""
    rows = np.flatnonzero(token_slots >= 0)
    if not len(rows):
        return None
    slots = token_slots[rows]
    order = np.argsort(slots, kind="stable")
    rows, slots = rows[order], slots[order]
    uniq, starts = np.unique(slots, return_index=True)
    ends = np.append(starts[1:], len(rows))
    groups = [(int(s), int(a), int(b)) for s, a, b in zip(uniq, starts, ends)]
    segments = None
    if with_segments or device.type == "cuda":
        segments = torch.tensor([v for g in groups for v in g], dtype=torch.int32).to(device, non_blocking=True)
    if len(groups) == 1 and len(rows) == len(token_slots):
        return LoRABatch(None, groups, len(rows), segments)
    return LoRABatch(torch.from_numpy(rows.astype(np.int64)).to(device), groups, len(rows), segments)
