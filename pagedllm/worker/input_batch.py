"""Worker-side per-request state, kept across steps so the scheduler only sends diffs, and the
flat batch one step builds from it (StepInputs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.contracts import BeamRow
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """One request as this rank knows it (it satisfies sample.metadata.SamplingRowState)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator] = None
    prompt_unique_ids: Optional[torch.Tensor] = field(default=None, repr=False)  # for penalties
    beam: Optional[BeamRow] = None  # a beam of a beam-search group: scored (worker/beam_rows.py), not sampled
    lora_slot: int = -1  # the LoRA adapter slot its rows use (-1: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def build_block_table(states: list[CachedRequestState]) -> np.ndarray:
    width = max(len(s.block_ids) for s in states)
    table = np.zeros((len(states), width), dtype=np.int32)
    for i, s in enumerate(states):
        table[i, : len(s.block_ids)] = s.block_ids
    return table


@dataclass(slots=True)
class StepInputs:
    """One step's ragged batch, built once: host arrays (numpy, for bookkeeping) and device tensors."""

    req_ids: list[str]  # batch order (the scheduler's)
    states: list[CachedRequestState]
    starts: np.ndarray  # [R] int64: num_computed_tokens before this step
    num_scheduled: np.ndarray  # [R] int64
    seq_lens: np.ndarray  # [R] int64: starts + num_scheduled
    query_start_loc: np.ndarray  # [R + 1] int64: row offsets in the flat token batch
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_metadata: AttentionMetadata
    sample_rows: np.ndarray  # batch rows that produce a token this step (not a partial prefill chunk)
    logits_indices: torch.Tensor  # [S] long: flat index of each sampling row's last token

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])
