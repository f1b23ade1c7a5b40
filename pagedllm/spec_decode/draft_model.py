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
from pagedllm.sample.sampler import inverse_cdf


class DraftModelProposer:
    def __init__(self, path: str, num_speculative_tokens: int, target_vocab_size: int, dtype: torch.dtype,
                 device: torch.device, block_size: int) -> None:
        self.k = num_speculative_tokens
        self.device, self.dtype, self.block_size = device, dtype, block_size
        hf = load_hf_config(path)
        if hf.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model {path!r} has a vocabulary of {hf.vocab_size} tokens, the "
                             f"target {target_vocab_size}: a draft model must share the target's tokenizer")
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = resolve_model_class(hf)(hf)
        finally:
            torch.set_default_dtype(prev)
        load_weights(self.model, path)
        self.model.eval()
        if device.type == "cpu":
            from pagedllm.layers.cpu_gemm import pack_linear_weights

            pack_linear_weights(self.model, dtype)
        self.layers = self.model.attention_layers()
        a0 = self.layers[0]
        if any(getattr(layer, "sliding_window", None) for layer in self.layers):
            raise ValueError("speculative_config.model: draft models with sliding-window attention are not supported")
        self.planes = getattr(a0, "kv_planes", 2)
        self.kv_shape = (self.planes, len(self.layers), block_size, a0.num_kv_heads, a0.head_dim)
        self.valid: dict[str, int] = {}  # request id -> positions whose draft K/V are valid
        self.kv_cache: Optional[torch.Tensor] = None

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.kv_shape)) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, backend) -> None:
        p, nl, bs, h, d = self.kv_shape
        self.kv_cache = torch.zeros((p, nl, num_blocks, bs, h, d), dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.bind(backend, self.kv_cache[:, i])

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

    def _pick(self, logits: torch.Tensor, temps: Optional[torch.Tensor], greedy_rows: torch.Tensor,
              gens: list, generator: Optional[torch.Generator]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if temps is None:  # every drafted request is greedy
            return logits.argmax(dim=-1), None
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        u = torch.rand(len(logits), generator=generator, device=self.device)
        for row, gen in gens:
            u[row] = torch.rand(1, generator=gen, device=self.device)[0]
        drawn = inverse_cdf(probs, u)
        return torch.where(greedy_rows, logits.argmax(dim=-1), drawn), probs

    def propose(self, runner, so, slots: dict[str, int]) -> tuple[dict[str, list[int]], Optional[torch.Tensor]]:
        """Drafts for the requests in ``slots`` (request id -> draft slots), in batch order."""
        rids = [r for r in so.num_scheduled_tokens if r in slots]
        states = [runner.requests[r] for r in rids]
        k = np.fromiter((min(slots[r], self.k) for r in rids), dtype=np.int64, count=len(rids))
        n_tok = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        start = np.fromiter((min(self.valid.get(s.req_id, 0), s.num_computed_tokens) for s in states),
                            dtype=np.int64, count=len(states))
        width = max(len(s.block_ids) for s in states)
        table = np.zeros((len(states), width), dtype=np.int32)
        for i, s in enumerate(states):
            table[i, : len(s.block_ids)] = s.block_ids
        sps = [s.sampling_params for s in states]
        greedy = [sp.is_greedy for sp in sps]
        temps = greedy_rows = None
        gens: list = []
        if not all(greedy):
            temps = torch.tensor([1.0 if g else sp.temperature for g, sp in zip(greedy, sps)], device=self.device)
            greedy_rows = torch.tensor(greedy, dtype=torch.bool, device=self.device)
            gens = [(i, s.generator) for i, s in enumerate(states) if s.generator is not None and not greedy[i]]
        generator = runner.sampler.generator if runner.sampler is not None else None

        # 1. Catch up on the tokens the draft has not seen; the last row proposes d_1.
        n = n_tok - start
        qsl = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        ids = np.fromiter((t for s, a in zip(states, start.tolist()) for t in s.token_ids[a:]), dtype=np.int64,
                          count=int(qsl[-1]))
        positions = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1] - start, n)
        tok, probs = self._pick(self._forward(ids, positions, qsl, n_tok, table), temps, greedy_rows, gens, generator)
        k_max = int(k.max())
        grid = torch.zeros((len(states), k_max), dtype=torch.long, device=self.device)
        grid[:, 0] = tok
        prob_grid = None
        if probs is not None:
            prob_grid = torch.zeros((len(states), k_max, probs.shape[1]), device=self.device)
            prob_grid[:, 0] = probs
        # 2. One token at a time: d_j in at position N + j - 1, d_{j+1} out.
        for j in range(1, k_max):
            act = np.nonzero(k > j)[0]
            act_t = torch.from_numpy(act).to(self.device)
            pos = n_tok[act] + j - 1
            qsl_j = np.arange(len(act) + 1, dtype=np.int64)
            logits = self._forward(grid[act_t, j - 1], pos, qsl_j, pos + 1, table[act])
            row_of = {r: i for i, r in enumerate(act.tolist())}
            sub_gens = [(row_of[r], g) for r, g in gens if r in row_of]
            tok, probs = self._pick(logits, None if temps is None else temps[act_t],
                                    None if greedy_rows is None else greedy_rows[act_t], sub_gens, generator)
            grid[act_t, j] = tok
            if prob_grid is not None:
                prob_grid[act_t, j] = probs
        for s, a, kk in zip(states, n_tok.tolist(), k.tolist()):
            self.valid[s.req_id] = a + kk - 1  # d_1..d_{k-1} went in at positions N..N+k-2
        grid_l = grid.tolist()
        drafts = {r: grid_l[i][: int(k[i])] for i, r in enumerate(rids)}
        flat_probs = None
        if prob_grid is not None:
            req_idx = np.repeat(np.arange(len(rids)), k)
            pos_idx = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
            flat_probs = prob_grid[torch.from_numpy(req_idx).to(self.device), torch.from_numpy(pos_idx).to(self.device)]
        return drafts, flat_probs
