"""The small data types that cross the core's wall (scheduler <-> runner <-> engine).

Workers keep per-request state, so a SchedulerOutput carries only diffs: new requests in full,
continuing requests as (new block ids, computed count).

Frozen dataclasses, except the two made once per request per step, ``CachedRequestData`` and
``EngineCoreOutput``: frozen msgspec Structs (as immutable, built in C: 0.08 us against 0.8-1.5
us for a frozen dataclass's ``object.__setattr__`` per field, 0.6 ms a step at 256 rows; and
untracked by the garbage collector, gc=False: they never hold themselves).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import msgspec

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LoRAHandle:
    """A LoRA adapter as the core and the workers know it: ``key`` is its identity (its name and a
    hash of its files; keys the prefix cache and the adapter slots), ``path`` where workers read it."""

    name: str
    key: str
    path: str


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """One image of a prompt (made by pagedllm/multimodal): the prompt positions its encoder output
    fills (``offset``, ``length``: its expanded placeholder tokens), its ``content_hash`` (hex
    sha256 of the encoder input; keys the KV blocks it overlaps, core/block_hash.py), and ``data``,
    the encoder's input (numpy float32 pixel values [3, H, W] for an image), opaque to the core."""

    offset: int
    length: int
    content_hash: str
    data: Any = None
    modality: str = "image"


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
    mm_features: tuple[MultiModalFeature, ...] = ()  # its prompt's images: the encoder runs on them


NO_BLOCKS: tuple = ()  # CachedRequestData.new_block_ids of a row that takes no block (shared: never mutated)


class CachedRequestData(msgspec.Struct, frozen=True, gc=False):
    """A request the workers already hold: only what changed."""

    req_id: str
    new_block_ids: Sequence[int]
    num_computed_tokens: int
    # Speculative decoding: trailing block ids to drop (rejected drafts' blocks went back to the
    # pool) before appending new_block_ids.
    num_dropped_block_ids: int = 0
    # Pipeline parallelism: the ids sampled since the workers last saw the request (the last
    # stage samples and appends nothing; every stage learns them here). Empty otherwise: the
    # sampling rank appended them itself.
    new_token_ids: Sequence[int] = ()


# ---- the KV offload tier (core/kv_tier.py plans, worker/kv_tier/ runs) ---------------------------
@dataclass(frozen=True, slots=True)
class TierCopy:
    """One block moved between the device KV cache and the tier: ``block_id`` a device block,
    ``slot`` a tier slot (the core's TierIndex chose it), ``block_hash`` the block's prefix-cache
    hash (the store keeps it beside the slot and a load checks it: a stale or foreign slot is a
    failed load, never wrong KV)."""

    block_id: int
    slot: int
    block_hash: bytes


@dataclass(frozen=True, slots=True)
class KVTransfers:
    """A step's moves between the device KV cache and the tier, run by every worker BEFORE the
    step's block copies and forward, in this order: ``drops`` (slots the tier forgot before this
    step was planned; a store below may reuse one), ``stores`` (device block -> slot: the block is
    about to be reused, so its K/V is saved first), then ``loads`` (slot -> a fresh device block
    of a request waiting for them; the request computes nothing this step). Every load is finished (or failed) when the step's
    ModelRunnerOutput comes back (``failed_kv_loads``); a store may still be in flight then, as
    long as a later load of its slot either sees it or fails."""

    stores: tuple[TierCopy, ...] = ()
    loads: tuple[TierCopy, ...] = ()
    drops: tuple[int, ...] = ()
    seq: int = 0  # the core's number for this plan (its loads' results are matched by it)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.drops)


NO_TRANSFERS = KVTransfers()


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """Structured outputs: one step's allowed-token masks. ``bitmask[rows[req_id]]`` is the mask of
    each constrained request that samples this step (int32 words, xgrammar's layout: a tensor
    [len(rows), ceil(vocab / 32)], filled by the scheduler's grammar source, applied by the
    sampling rank). A fresh array every step: a step still in flight keeps its own."""

    rows: dict[str, int]
    bitmask: object


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
    kv_transfers: KVTransfers = NO_TRANSFERS  # the KV offload tier's stores and loads (empty: no tier)
    # Structured outputs: the masks of the constrained requests that sample this step (None: none).
    grammar: Optional[GrammarBitmask] = None

    @property
    def is_empty(self) -> bool:
        """No token to compute (the step may still move blocks: ``kv_transfers``)."""
        return self.total_num_scheduled_tokens == 0

    @property
    def has_device_work(self) -> bool:
        """Tokens to compute or KV tier blocks to move."""
        return bool(self.num_scheduled_tokens or self.kv_transfers)

    @property
    def has_work(self) -> bool:
        """Anything for the workers: device work, or requests whose state they drop."""
        return bool(self.num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids or self.kv_transfers)

    def without_grammar(self) -> "SchedulerOutput":
        """The step as ranks that do not sample need it (the masks stay with the sampling rank)."""
        return self if self.grammar is None else replace(self, grammar=None)


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
    # The KV offload tier: device block ids of this step's loads that failed (on any rank; every
    # other load of SchedulerOutput.kv_transfers succeeded), and the seconds the step's transfers took.
    failed_kv_loads: frozenset[int] = frozenset()
    kv_transfer_seconds: float = 0.0


class EngineCoreOutput(msgspec.Struct, frozen=True, gc=False, array_like=True):
    # (RequestUnit.on_output builds these positionally: keep the fields in this order)
    req_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: Optional[Logprobs] = None
    prompt_logprobs: Optional[Logprobs] = None
    num_cached_tokens: int = 0
    beam_hypotheses: Optional[list[BeamHypothesis]] = None  # a finished beam search: best first
    num_preemptions: int = 0  # times the request was preempted so far (vLLM's request_num_preemptions)


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
    kv_tier: Optional[KVTierStats] = None  # the KV offload tier's counters (None: no tier)
    # Waiting requests the last step set aside (an admission constraint held them: LoRA slots, a
    # batch in flight, a grammar still compiling) rather than left for lack of room (vLLM's
    # num_requests_waiting_by_reason).
    num_waiting_deferred: int = 0
    # Since start, for the step performance model (metrics/perf_model.py): requests scheduled
    # (summed over steps), (query token, context token) pairs attended, tokens whose KV was read
    num_scheduled_rows_total: int = 0
    num_attention_pairs_total: int = 0
    num_context_tokens_total: int = 0


@dataclass(frozen=True, slots=True)
class KVTierSpec:
    """What the workers' tier holds (an executor's ``kv_tier_spec``; None without a tier):
    ``num_slots`` blocks (the same on every rank), ``bytes_per_block`` summed over the ranks."""

    num_slots: int
    bytes_per_block: int
    backend: str = "native"


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """The KV offload tier since start (counters) and now (slots): tokens looked up in the tier
    past the device prefix cache's hit and found there, blocks stored (device -> tier) and loaded
    (tier -> device), loads that failed (recomputed instead), the workers' transfer seconds."""

    num_slots: int
    num_used_slots: int
    bytes_per_block: int
    lookup_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    failed_loads: int = 0
    transfer_seconds: float = 0.0
    num_transfer_steps: int = 0

    @property
    def usage(self) -> float:
        return self.num_used_slots / self.num_slots if self.num_slots else 0.0


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
