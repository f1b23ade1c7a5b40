"""Verification of one step's drafts: the target's logits at every drafted position, rejection
sampling on the sampling rank, the accepted tokens appended to the runner's request states.

The runner put each drafted request's tokens [last token, d_1..d_k] in the flat batch (k + 1
query rows against the paged cache, like a small prefill chunk). Row j of a request is sampled
as the normal sampler would sample the token after d_1..d_j: its sampling metadata is built
from a view of the request with those drafts appended (so penalties count them and min_tokens
bans end at the right position). Rows without drafts (decodes with no proposal, last prefill
chunks) are one row with k = 0: the rejection sampler then just samples from p.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.core.contracts import Logprobs
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.sample.sampler import greedy


class DraftRowView:
    """Request state ``base`` as seen at draft position ``j`` (drafts[:j] appended): what
    ``build_sampling_metadata`` reads, without copying the token list unless it is read
    (penalties only)."""

    __slots__ = ("base", "drafts", "j")

    def __init__(self, base, drafts: list[int], j: int) -> None:
        self.base, self.drafts, self.j = base, drafts, j

    @property
    def token_ids(self) -> list[int]:
        return self.base.token_ids + self.drafts[: self.j] if self.j else self.base.token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.base.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.base.num_output_tokens + self.j

    @property
    def sampling_params(self):
        return self.base.sampling_params

    @property
    def generator(self):
        return self.base.generator

    @property
    def prompt_unique_ids(self):
        return self.base.prompt_unique_ids

    @prompt_unique_ids.setter
    def prompt_unique_ids(self, value) -> None:
        self.base.prompt_unique_ids = value


def _greedy_prefix_match(argmax: np.ndarray, k: np.ndarray, row_starts: np.ndarray, drafts: np.ndarray
                         ) -> torch.Tensor:
    """The rejection sampler's all-greedy case on the host (the common one; a dozen tiny torch
    ops cost more than the match on CPU): each request keeps its drafts up to the first that
    differs from the target's argmax, then the argmax after them. ``argmax`` [sum(k + 1)]:
    request i's rows from ``row_starts[i]``; ``drafts`` [sum k] flat. Returns the token grid
    [R, k_max + 1], -1 after each request's tokens."""
    num_reqs, k_max = len(k), int(k.max()) if len(k) else 0
    tokens = np.full((num_reqs, k_max + 1), -1, dtype=np.int64)
    draft_req = np.repeat(np.arange(num_reqs), k)
    draft_pos = np.arange(len(drafts)) - np.repeat(row_starts - np.arange(num_reqs), k)
    draft_rows = row_starts[draft_req] + draft_pos
    miss = np.ones((num_reqs, k_max + 1), dtype=bool)  # column k_i: the bonus row always "misses"
    miss[draft_req, draft_pos] = argmax[draft_rows] != drafts
    num_accepted = np.argmax(miss, axis=1)
    tokens[draft_req, draft_pos] = drafts
    tokens[np.arange(k_max + 1)[None, :] >= num_accepted[:, None]] = -1
    tokens[np.arange(num_reqs), num_accepted] = argmax[row_starts + num_accepted]
    return torch.from_numpy(tokens)


def verify_and_update(runner, inputs, hidden: torch.Tensor, drafts: dict[str, list[int]],
                      draft_probs: Optional[torch.Tensor], sampler: Optional[RejectionSampler]
                      ) -> tuple[list[list[int]], dict[str, Logprobs], list[int]]:
    """(tokens per batch row, logprobs by request id, drafts verified per batch row); the
    runner's states grow by the emitted tokens and their computed counts cover what was kept.
    ``draft_probs`` [sum k, V]: the drafted requests' proposal rows in batch order (None: one-hot)."""
    rows = inputs.sample_rows
    states = inputs.states
    num_rows_batch = len(states)
    sample_states = [states[i] for i in rows]
    k = np.fromiter((len(drafts.get(s.req_id, ())) for s in sample_states), dtype=np.int64, count=len(rows))
    ends = inputs.query_start_loc[1:][rows]
    # Logits rows: the last k_i + 1 query rows of each sampling request.
    first = np.repeat(ends - 1 - k, k + 1)
    row_starts = np.zeros(len(rows), dtype=np.int64)
    np.cumsum((k + 1)[:-1], out=row_starts[1:])
    offsets = np.arange(int((k + 1).sum())) - np.repeat(row_starts, k + 1)
    idx = torch.from_numpy(first + offsets).to(runner.device)
    logits = runner.model.compute_logits(hidden[idx]) if len(rows) else None  # a collective under TP

    k_max = int(k.max()) if len(rows) else 0
    grid: Optional[torch.Tensor] = None
    out = None
    if len(rows) and sampler is not None:
        md = build_sampling_metadata(sample_states, runner.vocab_size, runner.device)
        per_row = (md.bias_rows, md.ban_rows, md.seen_rows, md.max_num_logprobs, md.mask_rows)
        if not md.all_greedy or any(x is not None for x in per_row):  # tensors per row: one row per position
            views = [DraftRowView(s, drafts.get(s.req_id, []), j) for s, kk in zip(sample_states, k.tolist())
                     for j in range(kk + 1)]
            md = build_sampling_metadata(views, runner.vocab_size, runner.device)
        flat = [t for s in sample_states for t in drafts.get(s.req_id, ())]
        if (md.all_greedy and not any(x is not None for x in per_row) and draft_probs is None
                and runner.device.type == "cpu"):
            grid = _greedy_prefix_match(greedy(logits).numpy(), k, row_starts, np.asarray(flat, dtype=np.int64))
        else:
            draft_ids = torch.tensor(flat, dtype=torch.long, device=runner.device)
            out = sampler(logits, md, k, draft_ids, draft_probs)
            grid = out.tokens
    elif len(rows):
        grid = torch.empty((len(rows), k_max + 1), dtype=torch.long)
    if grid is not None:  # sampled on rank 0; every rank appends the same
        grid = runner.stage.share_sampled(grid)
    grid_l = grid.tolist() if grid is not None else []  # the step's one device->host sync

    tokens: list[list[int]] = [[] for _ in range(num_rows_batch)]
    num_drafts = [0] * num_rows_batch
    logprobs: dict[str, Logprobs] = {}
    want_lp = out is not None and out.logprob_ids is not None
    if want_lp:
        ids_l, vals_l, ranks_l = out.logprob_ids.tolist(), out.logprob_vals.tolist(), out.logprob_ranks.tolist()
    seq_lens = inputs.seq_lens.tolist()
    for st, n in zip(states, seq_lens):
        st.num_computed_tokens = n
    for j, (i, kk) in enumerate(zip(rows.tolist(), k.tolist())):
        row = grid_l[j]
        emitted = row[: row.index(-1)] if -1 in row else row
        st = states[i]
        st.token_ids.extend(emitted)
        runner.batch.append_tokens(st.row, emitted)
        tokens[i] = emitted
        num_drafts[i] = kk
        st.num_computed_tokens = seq_lens[i] - kk + len(emitted) - 1  # rejected drafts are not computed
        n_lp = st.sampling_params.logprobs
        if want_lp and n_lp is not None:
            a = int(row_starts[j])
            sl = slice(a, a + len(emitted))
            logprobs[st.req_id] = Logprobs([r[: 1 + n_lp] for r in ids_l[sl]], [r[: 1 + n_lp] for r in vals_l[sl]],
                                           ranks_l[sl])
    return tokens, logprobs, num_drafts
