"""What crosses between the engine's front end and its core (maybe another process).

``EngineCoreRequest``: one request, validated and tokenised once by the front end's
InputProcessor, carrying everything the core needs: the prompt's token ids, the sampling
parameters with the stop tokens resolved, the effective token cap, its fan-out (``n`` / best_of
children, or one beam group), its LoRA adapter, priority and deadline. The core turns it into its own Request(s).
``EngineCoreOutputs``: what one core step sends back (the per-request outputs, the scheduler's
statistics, the step's phase timings). Both are plain picklable dataclasses (no callables, no
tokenizer): the multiprocess client ships them over a pipe.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import msgspec

from pagedllm.core.contracts import EngineCoreOutput, LoRAHandle, SchedulerStats
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BeamSpec:
    """The request is one beam-search group of ``beam_width`` beams (core/beam_group.py)."""

    beam_width: int
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False


def child_request_ids(request_id: str, num_children: int) -> list[str]:
    """The core request ids of a request's children: itself when it has one."""
    return [request_id] if num_children == 1 else [f"{request_id}#{i}" for i in range(num_children)]


def child_seed(seed: int, index: int) -> int:
    """seed + index, wrapped to stay a 64-bit signed integer."""
    return (seed + index + 2**63) % 2**64 - 2**63


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # each child's (seeds aside); EOS among the stop tokens
    max_tokens: int  # the effective cap (within max_model_len)
    arrival_time: float  # time.monotonic() (system-wide on Linux, so valid across processes)
    num_children: int = 1  # sequences sampled (n, or best_of when it is larger), seeds seed + i
    lora: Optional[LoRAHandle] = None
    beam: Optional[BeamSpec] = None  # set: one beam group (num_children is 1)
    cache_salt: Optional[str] = None  # keys its first KV block with the tokens (tenants never share KV)
    priority: int = 0  # scheduling_policy "priority": lower first (0 otherwise)
    mm_features: tuple = ()  # its prompt's images (contracts.MultiModalFeature), placeholders expanded
    deadline: Optional[float] = None  # time.monotonic() past which the core ends it with "abort" (core/deadlines.py)

    @property
    def child_ids(self) -> list[str]:
        return child_request_ids(self.request_id, self.num_children)

    def child_params(self, index: int) -> SamplingParams:
        sp = self.sampling_params
        if self.num_children == 1:
            return sp
        return sp.clone(seed=None if sp.seed is None else child_seed(sp.seed, index))


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the core can hold, as the front end checks requests against it."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    max_n: int
    pipeline_parallel: bool = False
    speculative: bool = False
    step_cost: object = None  # metrics/perf_model.StepCostModel (vLLM's estimated_*_per_gpu), or None


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Seconds one core step spent in each phase: ``schedule`` (Scheduler.schedule),
    ``execute`` (the executor: prepare inputs, forward, sample), ``update``
    (update_from_output, grammar advance), ``total`` (the whole step, admitting compiled
    grammars included). The front end adds its output processing as a phase of its own."""

    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0
    total: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    """One step's outputs. Pickled (the engine-core process's pipe) with the outputs as one
    msgpack buffer: msgspec encodes the Structs (array-like) in C, ~8x faster than pickling each
    (95 -> 12 us at 256 rows, on the core's step thread)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: Optional[SchedulerStats] = None
    timing: Optional[StepTiming] = None  # None: no step ran (e.g. only aborts were handled)

    def __reduce__(self):
        return _outputs_from_msgpack, (_OUTPUTS_ENCODER.encode(self.outputs), self.stats, self.timing)


_OUTPUTS_ENCODER = msgspec.msgpack.Encoder()
_OUTPUTS_DECODER = msgspec.msgpack.Decoder(list[EngineCoreOutput])


def _outputs_from_msgpack(buf: bytes, stats: Optional[SchedulerStats], timing: Optional[StepTiming]) -> EngineCoreOutputs:
    return EngineCoreOutputs(_OUTPUTS_DECODER.decode(buf), stats, timing)
