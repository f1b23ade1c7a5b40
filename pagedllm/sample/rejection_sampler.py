"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A request with k drafts d_1..d_k has k + 1 verified rows of target logits: row j scores the
token after d_1..d_j. Each row is turned into the target distribution p_j exactly as the normal
sampler would (logit bias, min_tokens bans and penalties -- which see the earlier drafts, since
the caller's metadata has one row per position -- then temperature, min_p, top-k, top-p). Draft
d_{j+1}, drawn from the proposal q_j, is accepted with probability min(1, p_j(d) / q_j(d)); at
the first rejection the next token is drawn from norm(max(0, p_j - q_j)); when all k are
accepted a bonus token is drawn from p_k. Every emitted token is then distributed exactly as
p (the proof: P(emit x) = min(p, q)(x) + (1 - sum min(p, q)) * (p - q)+(x) / sum (p - q)+ = p(x)).

Proposals without probabilities (n-gram lookup) are one-hot: q(d) = 1, so d is accepted with
probability p(d) and the residual is p with d removed. Greedy rows reduce to a prefix match
against the argmax of the processed logits (the same argmax the normal sampler takes), so greedy
output is token-identical with and without speculation.

Everything is batched over requests and positions: tensor ops over the flat rows and a padded
[requests, k_max + 1] grid, no per-token Python loop; the caller makes one host copy of the
result grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, compute_logprob_table, greedy, inverse_cdf, tempered_probs


@dataclass
class RejectionOutput:
    tokens: torch.Tensor  # [R, k_max + 1] long: accepted drafts then the drawn token, -1 after
    num_accepted: torch.Tensor  # [R] long
    logprob_ids: Optional[torch.Tensor] = None  # [T, 1 + n]: per verified row, the emitted token then top-n
    logprob_vals: Optional[torch.Tensor] = None
    logprob_ranks: Optional[torch.Tensor] = None


def target_distribution(logits: torch.Tensor, md: SamplingMetadata) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(probs [T, V] float32 or None when every row is greedy, argmax [T]) after the same
    logits processing as ``Sampler`` (constraints, temperature, min_p, top-k/top-p)."""
    constrained = md.bias_rows is not None or md.ban_rows is not None or md.seen_rows is not None
    if md.all_greedy and not constrained:
        return None, greedy(logits)
    logits = Sampler._apply_constraints(logits.float(), md)
    argmax = greedy(logits)
    if md.all_greedy:
        return None, argmax
    probs = tempered_probs(logits, md)
    if md.top_k is not None or md.top_p is not None:
        probs = Sampler._top_k_top_p(probs, md.top_k, md.top_p)
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30), argmax


class RejectionSampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # the engine's stream (seeded requests draw from their own)

    def _uniforms(self, num_rows: int, num_reqs: int, md: SamplingMetadata, row_req: np.ndarray,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """One uniform per verified row (draft acceptance) and one per request (the final draw);
        a seeded request's come from its own generator, in row order."""
        u = torch.rand(num_rows + num_reqs, generator=self.generator, device=device)
        if md.generators:
            by_req: dict[int, list[int]] = {}
            for row in md.generators:
                by_req.setdefault(int(row_req[row]), []).append(row)
            for req, rows in by_req.items():
                gen = md.generators[rows[0]]
                draws = torch.rand(len(rows) + 1, generator=gen, device=device)
                u[torch.tensor(rows, device=device)] = draws[:-1]
                u[num_rows + req] = draws[-1]
        return u[:num_rows], u[num_rows:]

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata, num_drafts: np.ndarray, draft_ids: torch.Tensor,
                 draft_probs: Optional[torch.Tensor] = None) -> RejectionOutput:
        """``logits`` [T, V]: request i's k_i + 1 rows one after another (T = sum(k_i + 1));
        ``md`` has one row per logits row; ``num_drafts`` [R] host ints; ``draft_ids`` [D = sum k_i]
        long; ``draft_probs`` [D, V] the proposal distributions (None: one-hot proposals)."""
        device = logits.device
        num_reqs = len(num_drafts)
        rows_per_req = num_drafts + 1
        row_start = np.zeros(num_reqs, dtype=np.int64)
        np.cumsum(rows_per_req[:-1], out=row_start[1:])
        num_rows = int(rows_per_req.sum())
        k_max = int(num_drafts.max()) if num_reqs else 0
        row_req = np.repeat(np.arange(num_reqs), rows_per_req)
        # Flat draft index -> (request, position) and the row that scores it.
        draft_req = np.repeat(np.arange(num_reqs), num_drafts)
        draft_start = np.zeros(num_reqs, dtype=np.int64)
        np.cumsum(num_drafts[:-1], out=draft_start[1:])
        draft_pos = np.arange(len(draft_req)) - draft_start[draft_req]
        draft_rows_np = row_start[draft_req] + draft_pos
        draft_rows = torch.from_numpy(draft_rows_np).to(device)

        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if md.max_num_logprobs is not None else None
        probs, argmax = target_distribution(logits, md)
        greedy_rows = None if probs is None else md.greedy_rows  # None with probs: every row is random
        u_accept, u_final = (self._uniforms(num_rows, num_reqs, md, row_req, device) if probs is not None
                             else (None, None))

        # 1. Accept or reject every draft.
        if probs is None:
            accept = argmax[draft_rows] == draft_ids
        else:
            p_d = probs[draft_rows, draft_ids]
            q_d = draft_probs.gather(1, draft_ids.unsqueeze(1)).squeeze(1) if draft_probs is not None else 1.0
            accept = u_accept[draft_rows] * q_d < p_d
            if greedy_rows is not None:
                accept = torch.where(greedy_rows[draft_rows], argmax[draft_rows] == draft_ids, accept)
        grid = torch.zeros(num_reqs, k_max, dtype=torch.long, device=device)
        req_t = torch.from_numpy(draft_req).to(device)
        pos_t = torch.from_numpy(draft_pos).to(device)
        grid[req_t, pos_t] = accept.long()
        num_accepted = grid.cumprod(dim=1).sum(dim=1) if k_max else torch.zeros(num_reqs, dtype=torch.long,
                                                                                   device=device)

        # 2. The token after the accepted prefix: residual after a rejection, p after all accepted.
        final_rows = torch.from_numpy(row_start).to(device) + num_accepted
        final = argmax[final_rows]
        if probs is not None:
            dist = probs[final_rows]
            k_t = torch.from_numpy(num_drafts).to(device)
            rejected = num_accepted < k_t
            if bool(num_drafts.any()):
                rej_draft = (torch.from_numpy(draft_start).to(device) + num_accepted).clamp_max(max(len(draft_req) - 1, 0))
                if draft_probs is not None:
                    q = draft_probs[rej_draft]
                    residual = (dist - q).clamp_min(0.0)
                else:  # one-hot q: p with the rejected draft removed
                    residual = dist.scatter(1, draft_ids[rej_draft].unsqueeze(1), 0.0)
                # p == q leaves nothing (a rejection then had probability 0): fall back to p
                empty = residual.sum(dim=1, keepdim=True) <= 0
                residual = torch.where(empty, dist, residual)
                dist = torch.where(rejected.unsqueeze(1), residual, dist)
            drawn = inverse_cdf(dist, u_final)
            final = drawn if greedy_rows is None else torch.where(greedy_rows[final_rows], final, drawn)

        # 3. The output grid: accepted drafts, the final token, -1 after.
        tokens = torch.full((num_reqs, k_max + 1), -1, dtype=torch.long, device=device)
        if k_max:
            tokens[req_t, pos_t] = draft_ids
        cols = torch.arange(k_max + 1, device=device).unsqueeze(0)
        tokens = torch.where(cols < num_accepted.unsqueeze(1), tokens, -1)
        tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
        out = RejectionOutput(tokens, num_accepted)
        if raw_logprobs is not None:
            row_pos = torch.from_numpy(np.arange(num_rows) - row_start[row_req]).to(device)
            chosen = tokens[torch.from_numpy(row_req).to(device), row_pos].clamp_min(0)
            out.logprob_ids, out.logprob_vals, out.logprob_ranks = compute_logprob_table(
                raw_logprobs, chosen, md.max_num_logprobs)
        return out
