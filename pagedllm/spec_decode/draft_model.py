"""Draft-model proposer: a smaller model with the target's vocabulary, run in the same worker,
proposes k tokens autoregressively for every drafted request, batched.

Its paged KV cache has the target's block count and block size and is addressed through the
SAME block tables and slots (a draft block id is the target block id), so the scheduler's
allocation, rollback, preemption and prefix-cache sharing cover both; the worker sizes the cache
with both models' bytes per block inside one memory budget.

Per step, for the requests with draft slots (in batch order):
 1. one forward over each request's tokens the draft has not computed yet (the whole sequence
    when the runner first sees it -- prefix-cache hits are never trusted for the draft --, else
    the last token and the drafts accepted last step), whose last row proposes d_1;
 2. k - 1 one-token forwards, d_j in, d_{j+1} out.
The draft's KV for positions < min(its own end, the target's computed count) stays valid: a
rejected draft's position is recomputed next step. Greedy requests take the draft's argmax;
sampled ones draw from q = softmax(draft logits / temperature), returned for the rejection
sampler (seeded requests draw from their own generator).
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.forward_context import set_attention_metadata
from pagedllm.models.config_json import load_hf_config
from pagedllm.models.loader import load_weights
from pagedllm.models.registry import resolve_model_class
from pagedllm.spec_decode.paged_drafter import PagedDrafter


class DraftModelProposer(PagedDrafter):
    def __init__(self, path: str, num_speculative_tokens: int, target_vocab_size: int, dtype: torch.dtype,
                 device: torch.device, block_size: int) -> None:
        self.k = num_speculative_tokens
        self.device, self.dtype, self.block_size = device, dtype, block_size
        hf = load_hf_config(path)
        if hf.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model {path!r} has a vocabulary of {hf.vocab_size} tokens, the "
                             f"target {target_vocab_size}: a draft model must share the target's tokenizer")
        self.model = self._build(lambda: resolve_model_class(hf)(hf), lambda m: load_weights(m, path))
        layers = self.model.attention_layers()
        if any(layer.sliding_window for layer in layers):
            raise ValueError("speculative_config.model: draft models with sliding-window attention are not supported")
        self.planes = layers[0].kv_planes
        self._init_cache(layers, block_size, self.planes)
        self.valid: dict[str, int] = {}  # request id -> positions whose draft K/V are valid

    def forget(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.valid.pop(rid, None)

    # ---- one step's proposals ---------------------------------------------------------------
    def _forward(self, ids, positions: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
                 table: np.ndarray) -> torch.Tensor:
        """Logits of each request's last query row."""
        req_of = np.repeat(np.arange(len(seq_lens)), np.diff(qsl))
        bs = self.block_size
        slots = table[req_of, positions // bs].astype(np.int64) * bs + positions % bs
        md = AttentionMetadata.from_host(qsl, seq_lens, table, slots, self.device)
        with set_attention_metadata(md):
            ids_t = ids if isinstance(ids, torch.Tensor) else torch.from_numpy(ids).to(self.device)
            hidden = self.model(ids_t, torch.from_numpy(positions).to(self.device))
        return self.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).to(self.device)]).float()

    def propose(self, runner, so, slots: dict[str, int]) -> tuple[dict[str, list[int]], Optional[torch.Tensor]]:
        """Drafts for the requests in ``slots`` (request id -> draft slots), in batch order."""
        rids = [r for r in so.num_scheduled_tokens if r in slots]
        states = [runner.requests[r] for r in rids]
        k = np.fromiter((min(slots[r], self.k) for r in rids), dtype=np.int64, count=len(rids))
        n_tok = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        start = np.fromiter((min(self.valid.get(s.req_id, 0), s.num_computed_tokens) for s in states),
                            dtype=np.int64, count=len(states))
        table = self._table(states)

        # 1. Catch up on the tokens the draft has not seen; the last row proposes d_1.
        n = n_tok - start
        qsl = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        ids = np.fromiter((t for s, a in zip(states, start.tolist()) for t in s.token_ids[a:]), dtype=np.int64,
                          count=int(qsl[-1]))
        positions = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1] - start, n)
        first = self._forward(ids, positions, qsl, n_tok, table)

        # 2. One token at a time: d_j in at position N + j - 1, d_{j+1} out.
        def next_logits(j, act, act_t, prev):
            pos = n_tok[act] + j - 1
            return self._forward(prev, pos, np.arange(len(act) + 1, dtype=np.int64), pos + 1, table[act])

        grid, flat_probs = self._draw_k(states, runner, k, first, next_logits)
        for s, a, kk in zip(states, n_tok.tolist(), k.tolist()):
            self.valid[s.req_id] = a + kk - 1  # d_1..d_{k-1} went in at positions N..N+k-2
        grid_l = grid.tolist()
        return {r: grid_l[i][: int(k[i])] for i, r in enumerate(rids)}, flat_probs
