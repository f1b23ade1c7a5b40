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
        self._fit_width(end)
        self.ids[row, n:end] = block_ids
        self.lens[row] = end

    def append_one(self, rows: np.ndarray, block_ids: np.ndarray) -> None:
        """One new block id appended to each of ``rows`` (distinct): a decode step's rows that
        crossed a block boundary, in one scatter."""
        n = self.lens[rows]
        self._fit_width(int(n.max()) + 1)
        self.ids[rows, n] = block_ids
        self.lens[rows] = n + 1

    def _fit_width(self, end: int) -> None:
        """Columns for ``end`` ids a row (doubling)."""
        if end > self.ids.shape[1]:
            width = self.ids.shape[1]
            while width < end:
                width *= 2
            self.ids = np.pad(self.ids, ((0, 0), (0, width - self.ids.shape[1])))

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
    """What the runner keeps per row across steps: the BlockTable; every request's token ids (one
    int32 array, a row each, mirroring its CachedRequestState's list: a step's input ids are one
    gather at the step's (row, position) pairs, and its sampled ids one scatter); and the per-row
    sampling facts decided once when a request joins (``plain_greedy``:
    sample.metadata.is_plain_greedy), so a step's metadata is a gather over its rows, not a pass
    over their parameters. Rows follow the BlockTable's (they grow with it); the token width
    grows by doubling when a sequence needs more."""

    def __init__(self, num_rows: int = 64, width: int = 256) -> None:
        self.block_table = BlockTable(num_rows)
        self.plain_greedy = np.zeros(num_rows, dtype=bool)
        self.token_ids = np.zeros((num_rows, width), dtype=np.int32)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)

    def add(self, block_ids: list[int], plain_greedy: bool, token_ids: list[int] = ()) -> int:
        row = self.block_table.add(block_ids)
        rows = len(self.block_table.lens)
        if rows > len(self.plain_greedy):
            self.plain_greedy = np.resize(self.plain_greedy, rows)
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])[:rows]
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros_like(self.num_tokens)])[:rows]
        self.plain_greedy[row] = plain_greedy
        self.num_tokens[row] = 0
        self.append_tokens(row, token_ids)
        return row

    def remove(self, row: int) -> None:
        self.block_table.remove(row)
        self.plain_greedy[row] = False
        self.num_tokens[row] = 0

    def fit_width(self, width: int) -> None:
        """Room for ``width`` tokens in every row."""
        if width > self.token_ids.shape[1]:
            w = self.token_ids.shape[1]
            while w < width:
                w *= 2
            self.token_ids = np.pad(self.token_ids, ((0, 0), (0, w - self.token_ids.shape[1])))

    def append_tokens(self, row: int, token_ids) -> None:
        n = int(self.num_tokens[row])
        self.write_tokens(row, n, token_ids)
        self.num_tokens[row] = n + len(token_ids)

    def write_tokens(self, row: int, start: int, token_ids) -> None:
        """Tokens at positions ``start...`` of a row without counting them (speculative drafts,
        read by this step's gather and overwritten by what is kept)."""
        end = start + len(token_ids)
        self.fit_width(end)
        self.token_ids[row, start:end] = token_ids

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One token appended to each of ``rows`` (distinct)."""
        n = self.num_tokens[rows]
        if len(n):
            self.fit_width(int(n.max()) + 1)
        self.token_ids[rows, n] = token_ids
        self.num_tokens[rows] = n + 1


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
    # speculative decoding: drafts by request id, run after its last token, and their proposal
    # probabilities [sum k, V] in batch order (None: one-hot); None in a step without drafts
    drafts: Optional[dict[str, list[int]]] = None
    draft_probs: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])
