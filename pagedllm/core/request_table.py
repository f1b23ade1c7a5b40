"""RequestTable: row slots for the scheduler's plain requests, and their hot facts as columns.

Each plain request (one sequence, no beam, no grammar) takes a row slot when the scheduler
accepts it and gives it back when it leaves (a free-slot list: O(1) both ways; the columns
double when every slot is taken). A row holds what the decode step checks for every running
request, written once at admission and read as array operations:

- ``token_cap``: the token count at which it finishes by length (``max_tokens`` outputs or
  ``max_model_len`` tokens, whichever comes first);
- ``stop_from``: the token count from which a stop token ends it (``min_tokens`` outputs);
- ``stop_ids``: its stop token ids (EOS included unless ``ignore_eos``), padded with -1; a request
  with more than MAX_STOP_COLUMNS of them is not ``listed`` (its rows take its own path).

The scheduler's decode rows are then found, and their sampled tokens stop-checked, for the whole
batch at once (``decode_rows``, ``quiet_rows``); a row the arrays cannot clear takes the request's
own path, which stays the reference.
"""
from __future__ import annotations

import numpy as np

from pagedllm.core.request import Request

UNIT_PATH, NO_ALLOCATION, ALLOCATE = 0, 1, 2  # decode_rows' verdicts
MAX_STOP_COLUMNS = 32
_NEVER = 1 << 62  # a count no request reaches (min_tokens beyond it cannot matter)


class RequestTable:
    def __init__(self, capacity: int = 64) -> None:
        self._free: list[int] = []
        self.token_cap = np.zeros(0, dtype=np.int64)
        self.stop_from = np.zeros(0, dtype=np.int64)
        self.stop_ids = np.full((0, 1), -1, dtype=np.int64)
        self.listed = np.zeros(0, dtype=bool)
        self._grow(capacity)

    @property
    def capacity(self) -> int:
        return len(self.token_cap)

    @property
    def num_rows(self) -> int:
        return self.capacity - len(self._free)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        self.token_cap = np.concatenate([self.token_cap, np.zeros(capacity - old, dtype=np.int64)])
        self.stop_from = np.concatenate([self.stop_from, np.zeros(capacity - old, dtype=np.int64)])
        self.listed = np.concatenate([self.listed, np.zeros(capacity - old, dtype=bool)])
        self.stop_ids = np.concatenate(
            [self.stop_ids, np.full((capacity - old, self.stop_ids.shape[1]), -1, dtype=np.int64)])
        self._free.extend(range(capacity - 1, old - 1, -1))  # the lowest slot is taken first

    def add(self, req: Request, max_model_len: int) -> int:
        """A row for ``req`` (``req.slot``)."""
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        num_prompt = req.num_prompt_tokens
        sp = req.sampling_params
        self.token_cap[slot] = min(num_prompt + req.max_tokens, max_model_len, _NEVER)
        self.stop_from[slot] = min(num_prompt + sp.min_tokens, _NEVER)
        stops = sorted(t for t in sp.all_stop_token_ids if 0 <= t < _NEVER)  # others match no token
        self.listed[slot] = len(stops) <= MAX_STOP_COLUMNS
        if not self.listed[slot]:
            stops = []
        if len(stops) > self.stop_ids.shape[1]:
            wider = np.full((self.capacity, len(stops)), -1, dtype=np.int64)
            wider[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = wider
        row = self.stop_ids[slot]
        row[:] = -1
        row[: len(stops)] = stops
        req.slot = slot
        return slot

    def remove(self, req: Request) -> None:
        if req.slot >= 0:
            self._free.append(req.slot)
            req.slot = -1

    def decode_rows(self, running: list[Request], room: np.ndarray) -> list[int]:
        """Per running request: NO_ALLOCATION when this step is a plain decode of one token whose
        slot is in a block it holds, with nothing to register in the prefix cache (``room``: the
        KV cache manager's, by slot) -- a row whose scheduling changes nothing but counts;
        ALLOCATE when it is a plain decode of one token that reaches a block boundary; else
        UNIT_PATH (a prefill chunk, a beam, a grammar, a token in flight that is its last ...)."""
        n = len(running)
        slots = np.fromiter((r.slot for r in running), dtype=np.int64, count=n)
        num_tokens = np.fromiter((len(r.all_token_ids) for r in running), dtype=np.int64, count=n)
        computed = np.fromiter((r.num_computed_tokens for r in running), dtype=np.int64, count=n)
        pending = np.fromiter((r.num_pending for r in running), dtype=np.int64, count=n)
        s = np.maximum(slots, 0)
        ahead = num_tokens + pending
        plain = (slots >= 0) & (ahead - computed == 1) & ((pending == 0) | (ahead < self.token_cap[s]))
        return (plain * (ALLOCATE - (computed < room[s]))).tolist()

    def quiet_rows(self, reqs: list, sampled: list[list[int]]) -> list[bool]:
        """Per output row (``reqs``: its request or None): whether it is a plain request's one
        sampled token that neither stops it nor reaches its length -- a row that only appends."""
        n = len(reqs)
        slots = np.fromiter((-1 if r is None else r.slot for r in reqs), dtype=np.int64, count=n)
        after = np.fromiter((0 if r is None else len(r.all_token_ids) + 1 for r in reqs), dtype=np.int64, count=n)
        toks = np.fromiter((s[0] if len(s) == 1 else -2 for s in sampled), dtype=np.int64, count=n)
        s = np.maximum(slots, 0)
        stops = (self.stop_ids[s] == toks[:, None]).any(axis=1) & (after >= self.stop_from[s])
        ok = (slots >= 0) & self.listed[s] & (toks >= 0) & (after < self.token_cap[s]) & ~stops
        return ok.tolist()
