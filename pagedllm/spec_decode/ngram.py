"""N-gram (prompt lookup) proposer: the tokens that followed the most recent earlier occurrence
of the sequence's last n tokens, trying n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
When that continuation reaches the present (a loop shorter than k tokens), it repeats it.
A match of n tokens drafts at most 2n (a one-token match is weak evidence: on the default
model's copy workload, k = 8, it raised acceptance per draft 0.31 -> 0.50 and the batch-1
speed-up 1.68 / 1.54 -> 1.84 / 1.68x in two quiet runs, the free-text workload unchanged at 2.2x;
docs/benchmarks.md).

Each request keeps an incremental index: n-gram -> where its latest earlier occurrence's
continuation starts. Tokens appended since the last step add their n-grams (a few dict writes
per new token and n); a proposal is one dict lookup per n. So a step costs O(new tokens) per
request, never O(history); the prompt is indexed once, when the request is first seen.
Proposals are one-hot (no probabilities): the rejection sampler accepts draft d with
probability p(d), which for greedy requests is a prefix match.
"""
from __future__ import annotations

from typing import Iterable, Sequence


class _Index:
    __slots__ = ("table", "length")

    def __init__(self) -> None:
        self.table: dict[tuple[int, ...], int] = {}
        self.length = 0  # tokens whose n-grams ending before the last token are indexed


class NgramProposer:
    drafts_per_matched_token = 2  # a match of n tokens drafts at most 2n

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max
        self.indexes: dict[str, _Index] = {}

    def drop(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.indexes.pop(rid, None)

    def _extend(self, idx: _Index, tokens: Sequence[int]) -> None:
        """Index every n-gram that now has a continuation token (ends before the last token).
        Later occurrences overwrite earlier ones: the lookup finds the most recent."""
        table, sizes = idx.table, range(self.n_min, self.n_max + 1)
        end = len(tokens) - 1  # n-grams ending at positions < end have a continuation
        for e in range(max(idx.length - 1, 0), end):
            for n in sizes:
                if e - n + 1 < 0:
                    break
                table[tuple(tokens[e - n + 1 : e + 1])] = e + 1
        idx.length = len(tokens)

    def propose_one(self, req_id: str, tokens: Sequence[int], max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` (<= k) tokens continuing ``tokens``; [] when no n-gram recurs."""
        idx = self.indexes.get(req_id)
        if idx is None or idx.length > len(tokens):
            idx = self.indexes[req_id] = _Index()
        self._extend(idx, tokens)
        num = len(tokens)
        for n in range(min(self.n_max, num - 1), self.n_min - 1, -1):
            start = idx.table.get(tuple(tokens[num - n :]))
            if start is not None:
                max_drafts = min(max_drafts, self.drafts_per_matched_token * n)
                if start + max_drafts <= num:
                    return list(tokens[start : start + max_drafts])
                # The continuation runs into the present: the text repeats with period num - start,
                # so the drafts repeat it too (a short loop still fills all the slots).
                period = num - start
                return [tokens[start + i % period] for i in range(max_drafts)]
        return []

    def propose(self, requests: dict[str, Sequence[int]], max_drafts: dict[str, int]) -> dict[str, list[int]]:
        """Drafts for each request id in ``max_drafts`` (its reserved slots) from its tokens."""
        return {rid: self.propose_one(rid, requests[rid], min(m, self.k)) for rid, m in max_drafts.items()}
