"""EAGLE proposer: an EAGLE-1 head (models/eagle.py) over the target's last hidden states
proposes k tokens autoregressively for every drafted request, batched.

Head position i consumes (token t_{i+1}, target feature f_i) and predicts f_{i+1}, whose LM-head
logits propose t_{i+2}. Its paged KV cache is addressed like the draft model's: the target's
block count, block size and block tables (a head block id is the target block id), so the
scheduler's allocation, rollback, preemption and prefix sharing cover it, and the worker sizes
both caches inside one memory budget.

Features. After every step (drafted or not) the runner hands over the target's hidden states of
the positions it newly computed and kept (``observe``: one gather; chunked-prefill rows, the
last token's row and the accepted drafts' rows; rejected drafts' rows are dropped): they wait,
per request, until the head consumes them. Invariant per request: the head's KV is valid below
``head_end``, and the pending features cover exactly positions [head_end, num_computed).

Per drafting step, for the requests with draft slots and pending features (in batch order):
 1. one head forward over each request's pending positions [head_end, c) (c = its computed
    count = N - 1 for a decode), tokens t_{head_end+1}..t_c: the last row's predicted feature
    proposes d_1 (the token at position N);
 2. k - 1 one-token forwards: (d_j, the previous predicted feature) at position c + j - 1 -> d_{j+1}.
Afterwards head_end = c: positions c..c+k-2 were written from predicted features and are
recomputed from the target's real ones next time (like a rejected draft's K/V in draft_model).

Prefix-cache hits: the target never computes features for a cached prefix, so a request starts
with head_end = its first computed count and the head attends to the head K/V already in the
shared blocks (written by whichever request computed them; a block's last position saw that
request's next token) -- an approximation that only affects acceptance, never the output.
Long pending runs (a long prompt's chunks, or decodes while speculation is switched off) are
consumed early once longer than ``max_pending`` (one head forward, no logits), which bounds
the features held to about ``max_pending`` x hidden size per request.

Greedy requests take the head's argmax; sampled ones draw from q = softmax(logits / T), returned
for the rejection sampler (seeded requests draw from their own generator).
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.forward_context import set_attention_metadata
from pagedllm.config import hf_field
from pagedllm.models.config_json import load_hf_config
from pagedllm.models.eagle import EagleHead, eagle_checkpoint_names
from pagedllm.spec_decode.paged_drafter import PagedDrafter

# Target families whose last hidden state / embedding an EAGLE-1 head is defined over.
EAGLE_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class EagleProposer(PagedDrafter):
    MAX_PENDING = 512  # features held per request before the head consumes them early

    def __init__(self, path: str, num_speculative_tokens: int, target, target_config, dtype: torch.dtype,
                 device: torch.device, block_size: int) -> None:
        arch = type(target).__name__
        if arch not in EAGLE_TARGETS:
            raise ValueError(f"speculative_config method 'eagle' supports Llama-family targets {EAGLE_TARGETS}, "
                             f"not {arch}")
        self.k = num_speculative_tokens
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.max_pending = self.MAX_PENDING
        self.target = target
        hf = load_hf_config(path)
        for field, head_value, target_value in (("hidden_size", hf.hidden_size, target_config.hidden_size),
                                                ("vocab_size", hf.vocab_size, target_config.vocab_size)):
            if head_value != target_value:
                raise ValueError(f"speculative_config.model {path!r}: EAGLE head {field} {head_value} != the "
                                 f"target's {target_value} (a head is trained for one target)")
        if hf_field(hf, "num_hidden_layers", 0) < 1:
            raise ValueError(f"speculative_config.model {path!r}: an EAGLE head needs num_hidden_layers >= 1")
        names = eagle_checkpoint_names(path)
        if "fc.weight" not in names:
            raise ValueError(f"speculative_config.model {path!r} is not an EAGLE-1 head (no fc.weight; EAGLE-3 and "
                             "Medusa heads are not supported)")
        self.head = self._build(lambda: EagleHead(hf, "embed_tokens.weight" in names, "fc.bias" in names),
                                lambda m: m.load(path))
        self.embed = self.head.embed_tokens if self.head.embed_tokens is not None else target.model.embed_tokens
        self._init_cache(self.head.attention_layers(), block_size)
        self.head_end: dict[str, int] = {}  # request id -> positions whose head K/V are valid
        self.pending: dict[str, list[torch.Tensor]] = {}  # request id -> features of [head_end, computed)

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.head_end.pop(rid, None)
            self.pending.pop(rid, None)

    # ---- features from the target ------------------------------------------------------------
    def observe(self, runner, inputs, hidden: torch.Tensor) -> None:
        """Take the features of the positions this step computed and kept (after the states were
        updated: rejected drafts are not counted as computed)."""
        states = inputs.states
        if not states:
            return
        starts = inputs.starts
        comp = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        n = np.maximum(comp - starts, 0)
        qsl = inputs.query_start_loc
        total = int(n.sum())
        chunks: list = [None] * len(states)
        if total:
            row0 = np.repeat(qsl[:-1], n)
            idx = row0 + np.arange(total) - np.repeat(np.cumsum(n) - n, n)
            chunks = list(torch.split(hidden[torch.from_numpy(idx).to(hidden.device)], n.tolist()))  # one gather
        for i, s in enumerate(states):
            rid = s.req_id
            if rid not in self.head_end:
                self.head_end[rid] = int(starts[i])
                self.pending[rid] = []
            if n[i]:
                self.pending[rid].append(chunks[i])
        if len(self.head_end) > len(runner.requests):  # finished in a step that never proposed
            self.forget([r for r in self.head_end if r not in runner.requests])
        long = [s for s in states if s.num_computed_tokens - self.head_end[s.req_id] > self.max_pending]
        if long:
            self._consume(long, keep_last=True)

    def _consume(self, states: list, keep_last: bool) -> Optional[torch.Tensor]:
        """Run the head over each request's pending positions (all but the last with
        ``keep_last``); the predicted feature of each request's last row, unless ``keep_last``."""
        bs = self.block_size
        h = np.fromiter((self.head_end[s.req_id] for s in states), dtype=np.int64, count=len(states))
        c = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        ends = c - 1 if keep_last else c
        n = ends - h
        feats = []
        for s, m in zip(states, n.tolist()):
            f = self.pending[s.req_id]
            f = f[0] if len(f) == 1 else torch.cat(f)
            feats.append(f[:m])
            self.pending[s.req_id] = [f[m:].clone()] if keep_last else []  # not a view: frees the gathered rows
            self.head_end[s.req_id] += m
        qsl = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        total = int(qsl[-1])
        req_of = np.repeat(np.arange(len(states)), n)
        positions = np.arange(total) - np.repeat(qsl[:-1], n) + np.repeat(h, n)
        ids = np.fromiter((t for s, a, e in zip(states, h.tolist(), ends.tolist()) for t in s.token_ids[a + 1: e + 1]),
                          dtype=np.int64, count=total)
        table = self._table(states)
        slots = table[req_of, positions // bs].astype(np.int64) * bs + positions % bs
        out = self._forward(torch.from_numpy(ids).to(self.device), torch.cat(feats), positions, qsl, ends, table, slots)
        return None if keep_last else out[torch.from_numpy(qsl[1:] - 1).to(self.device)]

    def _forward(self, ids: torch.Tensor, feats: torch.Tensor, positions: np.ndarray, qsl: np.ndarray,
                 seq_lens: np.ndarray, table: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        md = AttentionMetadata.from_host(qsl, seq_lens, table, slots, self.device)
        with set_attention_metadata(md):
            return self.head(self.embed(ids), feats, torch.from_numpy(positions).to(self.device))

    # ---- one step's proposals ---------------------------------------------------------------
    def _ready(self, state) -> bool:
        """Whether the request has pending features that cover [head_end, computed) exactly (a
        mismatch -- which the step bookkeeping should never produce -- restarts the head there)."""
        rid = state.req_id
        pending = self.pending.get(rid)
        if not pending:
            return False
        if sum(len(f) for f in pending) == state.num_computed_tokens - self.head_end[rid]:
            return True
        self.head_end[rid], self.pending[rid] = state.num_computed_tokens, []
        return False

    def propose(self, runner, so, slots: dict[str, int]) -> tuple[dict[str, list[int]], Optional[torch.Tensor]]:
        """Drafts for the requests in ``slots`` that have target features to start from (a
        request whose first step in this worker is a decode -- a full prefix-cache hit -- has
        none yet and decodes plainly this step), in batch order."""
        rids = [r for r in so.num_scheduled_tokens if r in slots and self._ready(runner.requests[r])]
        if not rids:
            return {}, None
        states = [runner.requests[r] for r in rids]
        k = np.fromiter((min(slots[r], self.k) for r in rids), dtype=np.int64, count=len(rids))
        c = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        compute_logits = self.target.compute_logits

        # 1. Catch up on the pending features; each last row proposes d_1.
        feat = self._consume(states, keep_last=False)
        # 2. One token at a time: (d_j, predicted feature) in at position c + j - 1, d_{j+1} out.
        table = self._table(states)
        bs = self.block_size

        def next_logits(j, act, act_t, prev):
            pos = c[act] + j - 1
            slots_j = table[act, pos // bs].astype(np.int64) * bs + pos % bs
            feat[act_t] = self._forward(prev, feat[act_t], pos, np.arange(len(act) + 1, dtype=np.int64), pos + 1,
                                        table[act], slots_j)
            return compute_logits(feat[act_t]).float()

        grid, flat_probs = self._draw_k(states, runner, k, compute_logits(feat).float(), next_logits)
        grid_l = grid.tolist()
        drafts = {r: grid_l[i][: int(k[i])] for i, r in enumerate(rids)}
        return drafts, flat_probs
