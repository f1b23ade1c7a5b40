"""Batched beam scoring: every beam-search group's next-token candidates in one set of ops.

For the step's beam rows (``[R, V]`` logits, rows of a group adjacent, best beam first):
logprobs = log_softmax(logits) (float32, as HF), scores = logprobs + the beam's cumulative
logprob; the rows are scattered into a ``[groups, max_beams, V]`` table (missing beams -inf),
and one ``topk`` over each group's flattened ``max_beams x V`` scores picks its best
continuations, sorted -- HF transformers' ``_get_top_k_continuations`` for all groups at once.
The host gets (score, row, token) per candidate with one device->host copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.sample.sampler import compute_logprob_table


@dataclass
class BeamTopK:
    scores: list[list[float]]  # per group, best first: cumulative logprob of each candidate
    rows: list[list[int]]  # the candidate's parent row (index into the step's beam rows)
    tokens: list[list[int]]
    # when asked: per group, per candidate (token ids, logprobs, rank): the token first, then top-n
    logprob_ids: Optional[list[list[list[int]]]] = None
    logprob_vals: Optional[list[list[list[float]]]] = None
    logprob_ranks: Optional[list[list[int]]] = None


def beam_topk(logits: torch.Tensor, group_of_row: torch.Tensor, slot_of_row: torch.Tensor, cum: torch.Tensor,
              num_groups: int, max_beams: int, k: int, num_logprobs: Optional[int] = None) -> BeamTopK:
    """``group_of_row`` / ``slot_of_row``: [R] long (the row's group and its place in it);
    ``cum``: [R] float32 cumulative logprobs; ``k``: candidates per group (the most any group
    asks; the caller keeps each group's own number -- a prefix of the sorted list)."""
    dev = logits.device
    num_rows, vocab = logits.shape
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    table_rows = group_of_row * max_beams + slot_of_row
    table = torch.full((num_groups * max_beams, vocab), float("-inf"), device=dev)
    table.index_copy_(0, table_rows, logprobs + cum.unsqueeze(1))
    k = min(k, max_beams * vocab)
    vals, flat = table.view(num_groups, max_beams * vocab).topk(k, dim=1)  # sorted, best first
    row_of_table = torch.full((num_groups * max_beams,), -1, dtype=torch.long, device=dev)
    row_of_table[table_rows] = torch.arange(num_rows, device=dev)
    parent = row_of_table[group_of_table(num_groups, max_beams, dev) + flat // vocab]
    tokens = flat % vocab
    host = torch.stack([vals.double(), parent.double(), tokens.double()]).cpu()  # the one sync
    out = BeamTopK(host[0].tolist(), host[1].long().tolist(), host[2].long().tolist())
    if num_logprobs is not None:
        safe_parent = parent.clamp_min(0).reshape(-1)
        ids, lps, ranks = compute_logprob_table(logprobs[safe_parent], tokens.reshape(-1), num_logprobs)
        out.logprob_ids = ids.view(num_groups, k, -1).tolist()
        out.logprob_vals = lps.view(num_groups, k, -1).tolist()
        out.logprob_ranks = ranks.view(num_groups, k).tolist()
    return out


def group_of_table(num_groups: int, max_beams: int, device: torch.device) -> torch.Tensor:
    """[G, 1]: the first table row of each group (added to a candidate's beam slot)."""
    return (torch.arange(num_groups, device=device) * max_beams).unsqueeze(1)
