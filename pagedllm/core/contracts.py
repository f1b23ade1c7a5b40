"""The small data types that cross the core's wall (scheduler <-> runner <-> engine).

Workers keep per-request state, so a SchedulerOutput carries only diffs: new requests in full,
continuing requests as (new block ids, computed count).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LoRAHandle:
    """A LoRA adapter as the core and the workers know it: ``key`` is its identity (its name and a
    hash of its files; keys the prefix cache and the adapter slots), ``path`` where workers read it."""

    name: str
    key: str
    path: str


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the workers have not seen (or a preempted one being resumed: sent again in full)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int
    lora_slot: int = -1  # the adapter slot its tokens use (-1: the base model)
    beam: Optional[BeamRow] = None  # a beam of a beam-search group: scored, not sampled


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A request the workers already hold: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Speculative decoding: trailing block ids to drop (rejected drafts' blocks went back to the
    # pool) before appending new_block_ids.
    num_dropped_block_ids: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str]  # workers drop their state for these
    preempted_req_ids: frozenset[str]
    lora_loads: tuple[tuple[int, LoRAHandle], ...] = ()  # (slot, adapter): workers load these before the step
    # Speculative decoding: request id -> draft slots reserved after its next token (its
    # num_scheduled_tokens is 1 + this); the runner proposes at most this many drafts.
    num_spec_slots: dict[str, int] = field(default_factory=dict)
    # Beam search: (source, destination) block ids whose K/V workers copy before the forward
    # (copy-on-write of a partly filled block that forked beams share).
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Per sampled position: (token ids, logprobs, ranks). Index 0 is the sampled token, then top-k."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_rank: list[int]
    start: int = 0  # prompt logprobs: index (in the P-1 prompt logprob slots) of the first row


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    req_ids: list[str]  # batch order
    sampled_token_ids: list[list[int]]  # empty list for a partial prefill chunk
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # prompt logprobs for the chunk computed this step: list over positions of (ids, logprobs)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # Speculative decoding: drafts verified per request (batch order); sampled_token_ids then
    # holds the accepted drafts and one more token. None: no request was drafted for.
    num_draft_tokens: Optional[list[int]] = None
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)  # by beam group id


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: Optional[Logprobs] = None
    prompt_logprobs: Optional[Logprobs] = None
    num_cached_tokens: int = 0
    beam_hypotheses: Optional[list[BeamHypothesis]] = None  # a finished beam search: best first


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_scheduled_tokens_total: int  # tokens run through the model since start
    num_steps: int
    num_batched_reqs_max: int
    running_loras: tuple[str, ...] = ()  # adapter names of running requests (vLLM's lora_requests_info)
    waiting_loras: tuple[str, ...] = ()
    # Speculative decoding (vLLM's spec_decode counters): verification rows with drafts, drafts
    # proposed, drafts accepted, and accepted counts by draft position (index 0 = first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


# ---- beam search ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BeamRow:
    """Marks a scheduled sequence as a beam: the runner scores its next token within its group."""

    group_id: str
    cum_logprob: float
    num_candidates: int  # the group's top-k across all its beams


@dataclass(frozen=True, slots=True)
class BeamCandidates:
    """One group's best continuations this step, best first (cumulative logprob order)."""

    parent_ids: list[str]  # the beam (request id) each continues
    token_ids: list[int]
    cum_logprobs: list[float]  # parent's cumulative logprob + the token's
    logprobs: Optional[Logprobs] = None  # a row per candidate (token first, then top-k) when asked


@dataclass(frozen=True, slots=True)
class BeamHypothesis:
    """A finished beam: its generated tokens, cumulative logprob and length-penalised score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    logprobs: Optional[list[Logprobs]]  # one row per token when logprobs were asked
    finish_reason: str
    stop_reason: int | str | None = None
