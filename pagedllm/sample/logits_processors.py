"""Batch-level logits processors (vLLM v1's plug-in interface; ``--logits-processors``).

A processor is a class, named at start-up by its qualified name (``package.module:Class`` or
``package.module.Class``) or given as the class itself offline, built once on the sampling rank
as ``cls(config, device, is_pin_memory)`` (``config`` is the EngineConfig). Each step, before
sampling, it is told how the batch of sampling rows changed (``update_state(BatchUpdate |
None)``: None when the rows are the same requests in the same order as last step), then
``apply(logits)`` gets the step's float32 logits, one row per sampling request in row order, and
returns them (in place or new). ``is_argmax_invariant()``: True when it never changes a row's
argmax (then an all-greedy batch skips it, as vLLM does). ``validate_params(params)``
(classmethod): called for every request when it arrives; a ValueError is the request's 400.

The batch update lists, in this order, the rows whose request left or moved (``removed``), then
the requests that joined or moved (``added``: ``(row, params, prompt token ids, output token
ids)``; the output ids are a live view that grows as the request generates); ``moved`` stays
empty (a moved request is removed and added again). A request that does not sample this step
(a prefill chunk before its last) is not in that step's batch.

Speculative decoding and pooling models refuse processors (their logits rows are not one per
request), like vLLM.
"""
from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # row i1's request moves to row i2
    SWAP = enum.auto()  # rows i1 and i2 trade requests


RemovedRequest = int
AddedRequest = tuple[int, SamplingParams, Optional[list[int]], Sequence[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int  # sampling rows this step
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request this processor cannot serve (its 400)."""
        return None

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def is_argmax_invariant(self) -> bool: ...

    @abstractmethod
    def update_state(self, batch_update: Optional[BatchUpdate]) -> None: ...


def load_processor_class(spec) -> type:
    """The class a ``--logits-processors`` entry names (``module:Class``, ``module.Class``, or a
    class); ValueError naming the entry when it cannot be imported or is not a LogitsProcessor."""
    if isinstance(spec, type):
        cls = spec
    else:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"logits_processors: expected a class or its qualified name, got {spec!r}")
        module_name, sep, qualname = spec.partition(":")
        if not sep:
            module_name, _, qualname = spec.rpartition(".")
        if not module_name or not qualname:
            raise ValueError(f"logits_processors: {spec!r} is not a qualified class name (package.module:Class)")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"logits_processors: cannot load {spec!r}: {type(e).__name__}: {e}") from None
        cls = obj
    if not isinstance(cls, type) or not issubclass(cls, LogitsProcessor):
        raise ValueError(f"logits_processors: {spec!r} is not a subclass of pagedllm.sample.logits_processors."
                         "LogitsProcessor")
    return cls


def load_processor_classes(specs) -> list[type]:
    return [load_processor_class(s) for s in specs or ()]


def validate_request(classes: Sequence[type], params: SamplingParams) -> None:
    """Every processor's validate_params for one request (a ValueError is its 400)."""
    for cls in classes:
        cls.validate_params(params)


class OutputTokens(Sequence):
    """A live, read-only view of a request's output token ids (its state's token list past the
    prompt): what ``AddedRequest``'s fourth entry is."""

    __slots__ = ("_state",)

    def __init__(self, state) -> None:
        self._state = state

    def __len__(self) -> int:
        return len(self._state.token_ids) - self._state.num_prompt_tokens

    def __getitem__(self, i):
        n = self._state.num_prompt_tokens
        if isinstance(i, slice):
            return self._state.token_ids[n:][i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("output token index out of range")
        return self._state.token_ids[n + i]


class BatchProcessors:
    """The built processors of one sampling rank and the row bookkeeping they are told about."""

    def __init__(self, classes: Sequence[type], config: Any, device: torch.device) -> None:
        self.processors = [cls(config, device, False) for cls in classes]
        self._rows: list[str] = []  # last step's sampling rows (request ids, in row order)

    def update(self, states: Sequence) -> None:
        """Tell every processor how this step's sampling rows (request states in row order)
        differ from last step's."""
        ids = [s.req_id for s in states]
        if ids == self._rows:
            update = None
        else:
            old = {rid: i for i, rid in enumerate(self._rows)}
            removed = [i for i, rid in enumerate(self._rows) if i >= len(ids) or ids[i] != rid]
            added = [(i, s.sampling_params, s.token_ids[: s.num_prompt_tokens], OutputTokens(s))
                     for i, s in enumerate(states) if old.get(s.req_id) != i]
            update = BatchUpdate(len(ids), removed, added, ())
            self._rows = ids
        for p in self.processors:
            p.update_state(update)

    def apply(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        for p in self.processors:
            if all_greedy and p.is_argmax_invariant():
                continue
            logits = p.apply(logits)
        return logits

    def changes_greedy(self) -> bool:
        """Whether a greedy batch must go through them (some processor may move an argmax)."""
        return any(not p.is_argmax_invariant() for p in self.processors)
