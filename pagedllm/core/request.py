"""Request: the scheduler's view of one sequence (never shipped to workers)."""
from __future__ import annotations

import enum
import time
from typing import Optional

from pagedllm.core.contracts import LoRAHandle
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status greater than PREEMPTED is a finished one. WAITING_FOR_GRAMMAR: in
    the waiting queue while its output constraint compiles (core/grammar_wait.py); it is not
    admitted before its grammar is ready."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def finish_reason_of(status: RequestStatus) -> Optional[str]:
    return _FINISH_REASONS.get(status)


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "status",
        "num_computed_tokens",
        "num_pending",
        "num_cached_tokens",
        "block_hashes",
        "cache_salt",
        "arrival_time",
        "num_preemptions",
        "stop_reason",
        "max_tokens",
        "beam",
        "lora",
        "lora_slot",
        "priority",
        "unit",
        "mm_features",
        "deadline",
        "parent_id",
        "slot",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        lora: Optional[LoRAHandle] = None,
        priority: int = 0,
        mm_features: tuple = (),
        deadline: Optional[float] = None,
        parent_id: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # effective cap, already clipped to max_model_len
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling (engine/core.py): tokens being sampled by steps in flight, not known yet;
        # a running request is scheduled past them (their positions are computed as placeholders)
        self.num_pending = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache (set on first schedule)
        self.block_hashes: list[bytes] = []  # hashes of full blocks, grown by the KV cache manager
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.beam = None  # its BeamGroup (core/beam_group.py) when it is a beam of a beam search
        self.lora = lora  # the adapter it runs with (None: the base model)
        self.lora_slot = -1  # the adapter slot it holds while running (-1: none)
        self.priority = priority  # lower runs first under the "priority" scheduling policy (vLLM's rule)
        self.unit = None  # its scheduling unit (core/scheduling_units.py), set by the scheduler
        # its prompt's images (contracts.MultiModalFeature): placeholder spans, content hashes (in the
        # block hash chain) and the encoder inputs the workers get with it
        self.mm_features = tuple(mm_features)
        self.deadline = deadline  # time.monotonic() past which the core ends it (None: never)
        self.parent_id = parent_id  # the request it is one of n / best_of children of (None: it is the request)
        self.slot = -1  # its row in the scheduler's RequestTable (core/request_table.py); -1: none

    @property
    def cache_key(self) -> Optional[str]:
        """What keys its first KV block besides the tokens (the chain carries it on): the adapter's
        identity and the cache salt, so two adapters (or tenants) never share KV."""
        if self.lora is None:
            return self.cache_salt
        return f"lora:{self.lora.key}" + (f"\x00salt:{self.cache_salt}" if self.cache_salt else "")

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
