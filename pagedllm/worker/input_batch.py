"""Worker-side per-request state, kept across steps so the scheduler only sends diffs: each
request's CachedRequestState and its row of the persistent BlockTable; and the flat batch one step
builds from them (StepInputs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.core.contracts import BeamRow
from pagedllm.sampling_params import SamplingParams


class BlockTable:
    """The block ids of every request this rank holds, one row each of one int32 array kept across
    steps and updated from the scheduler's diffs: a new (or resumed) request takes a free row, a
    continuing one drops its rejected drafts' tail ids and appends its new ids, a finished or
    preempted one gives its row back (zeroed). A step's table is one gather of its rows. Rows and
    width grow by doubling when a batch or a sequence needs more."""

    def __init__(self, num_rows: int = 64, width: int = 16) -> None:
        self.ids = np.zeros((num_rows, width), dtype=np.int32)
        self.lens = np.zeros(num_rows, dtype=np.int64)
        self._free = list(range(num_rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self._free:
            n = len(self.lens)
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int], num_dropped: int = 0) -> None:
        n = int(self.lens[row]) - num_dropped
        if num_dropped:
            self.ids[row, n:n + num_dropped] = 0
        end = n + len(block_ids)
        if end > self.ids.shape[1]:
            width = self.ids.shape[1]
            while width < end:
                width *= 2
            self.ids = np.pad(self.ids, ((0, 0), (0, width - self.ids.shape[1])))
        self.ids[row, n:end] = block_ids
        self.lens[row] = end

    def remove(self, row: int) -> None:
        self.ids[row, :self.lens[row]] = 0
        self.lens[row] = 0
        self._free.append(row)

    def row_ids(self, row: int) -> list[int]:
        return self.ids[row, :self.lens[row]].tolist()

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), the longest of them] int32, zero-padded."""
        return self.ids[rows, :int(self.lens[rows].max())]


class InputBatch:
    """What the runner keeps per row across steps: the BlockTable, and the per-row sampling facts
    decided once when a request joins (``plain_greedy``: sample.metadata.is_plain_greedy), so a
    step's metadata is a gather over its rows, not a pass over their parameters."""

    def __init__(self, num_rows: int = 64) -> None:
        self.block_table = BlockTable(num_rows)
        self.plain_greedy = np.zeros(num_rows, dtype=bool)

    def add(self, block_ids: list[int], plain_greedy: bool) -> int:
        row = self.block_table.add(block_ids)
        if row >= len(self.plain_greedy):
            self.plain_greedy = np.resize(self.plain_greedy, len(self.block_table.lens))
        self.plain_greedy[row] = plain_greedy
        return row

    def remove(self, row: int) -> None:
        self.block_table.remove(row)
        self.plain_greedy[row] = False


@dataclass
class CachedRequestState:
    """One request as this rank knows it (it satisfies sample.metadata.SamplingRowState). Its
    block ids live in ``table`` (row ``row``)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    table: BlockTable = field(repr=False)
    row: int
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

    @property
    def block_ids(self) -> list[int]:
        return self.table.row_ids(self.row)


@dataclass(slots=True)
class StepInputs:
    """One step's ragged batch, built once: host arrays (numpy, for bookkeeping) and device tensors."""

    req_ids: list[str]  # batch order (the scheduler's)
    states: list[CachedRequestState]
    rows: np.ndarray  # [R] int64: each request's BlockTable row
    starts: np.ndarray  # [R] int64: num_computed_tokens before this step
    num_scheduled: np.ndarray  # [R] int64
    seq_lens: np.ndarray  # [R] int64: starts + num_scheduled
    query_start_loc: np.ndarray  # [R + 1] int64: row offsets in the flat token batch
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_metadata: AttentionMetadata
    sample_rows: np.ndarray  # batch rows that produce a token this step (not a partial prefill chunk)
    logits_indices: torch.Tensor  # [S] long: flat index of each sampling row's last token
    # images: (flat token indices [K], encoder features [K, hidden]) replacing those tokens' embeddings
    mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])
