"""What the draft-model and EAGLE proposers share: a small model built in the target's dtype on
its device (packed for the CPU GEMM), a paged KV cache addressed through the target's block
tables (one block id means the same block in both caches), and the drawing of k drafts per
request -- argmax for greedy requests, inverse-CDF samples from q = softmax(logits / T) for the
others (seeded ones from their own generator), the q rows returned in batch order for the
rejection sampler.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from pagedllm.sample.sampler import inverse_cdf


class PagedDrafter:
    k: int
    device: torch.device
    dtype: torch.dtype
    kv_shape: tuple
    layers: list
    kv_cache: Optional[torch.Tensor] = None

    def _build(self, make: Callable[[], torch.nn.Module], load: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
        """The module ``make`` builds, in this drafter's dtype and device, loaded, in eval mode and
        (on CPU) with its linear weights packed for pagedllm's GEMM."""
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                module = make()
        finally:
            torch.set_default_dtype(prev)
        load(module)
        module.eval()
        if self.device.type == "cpu":
            from pagedllm.layers.cpu_gemm import pack_linear_weights

            pack_linear_weights(module, self.dtype)
        return module

    def _init_cache(self, layers: list, block_size: int, planes: int = 2) -> None:
        self.layers = layers
        a0 = layers[0]
        self.kv_shape = (planes, len(layers), block_size, a0.num_kv_heads, a0.head_dim)
        self.kv_cache = None

    @property
    def bytes_per_block(self) -> int:
        return int(np.prod(self.kv_shape)) * torch.empty((), dtype=self.dtype).element_size()

    def observe(self, runner, inputs, hidden: torch.Tensor) -> None:
        """After every step: the target's hidden states of the positions it computed (EAGLE drafts
        from them; a draft model ignores them)."""

    def allocate(self, num_blocks: int, backend) -> None:
        p, nl, bs, h, d = self.kv_shape
        self.kv_cache = torch.zeros((p, nl, num_blocks, bs, h, d), dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.bind(backend, self.kv_cache[:, i])

    @staticmethod
    def _table(states) -> np.ndarray:
        """The requests' block tables, zero-padded to the longest."""
        width = max(len(s.block_ids) for s in states)
        table = np.zeros((len(states), width), dtype=np.int32)
        for i, s in enumerate(states):
            table[i, : len(s.block_ids)] = s.block_ids
        return table

    def _draw_k(self, states, runner, k: np.ndarray, first_logits: torch.Tensor,
                next_logits: Callable[[int, np.ndarray, torch.Tensor, torch.Tensor], torch.Tensor]):
        """Drafts for ``states`` (k[i] each): the first from ``first_logits`` [requests, V], then
        ``next_logits(j, act, act_t, prev_tokens)`` gives the logits of draft j + 1 for the
        requests ``act`` (numpy and device indices) still drafting, given their draft j.
        Returns (the grid [requests, max k] of drafts, the flat q rows [sum k, V] or None)."""
        sps = [s.sampling_params for s in states]
        greedy = [sp.is_greedy for sp in sps]
        temps = greedy_rows = None
        gens: list = []
        if not all(greedy):
            temps = torch.tensor([1.0 if g else sp.temperature for g, sp in zip(greedy, sps)], device=self.device)
            greedy_rows = torch.tensor(greedy, dtype=torch.bool, device=self.device)
            gens = [(i, s.generator) for i, s in enumerate(states) if s.generator is not None and not greedy[i]]
        generator = runner.sampling.generator

        def pick(logits, rows_t, sub_gens):
            if temps is None:  # every drafted request is greedy
                return logits.argmax(dim=-1), None
            t = temps if rows_t is None else temps[rows_t]
            g = greedy_rows if rows_t is None else greedy_rows[rows_t]
            probs = torch.softmax(logits / t.unsqueeze(1), dim=-1)
            u = torch.rand(len(logits), generator=generator, device=self.device)
            for row, gen in sub_gens:
                u[row] = torch.rand(1, generator=gen, device=self.device)[0]
            return torch.where(g, logits.argmax(dim=-1), inverse_cdf(probs, u)), probs

        tok, probs = pick(first_logits, None, gens)
        k_max = int(k.max())
        grid = torch.zeros((len(states), k_max), dtype=torch.long, device=self.device)
        grid[:, 0] = tok
        prob_grid = None
        if probs is not None:
            prob_grid = torch.zeros((len(states), k_max, probs.shape[1]), device=self.device)
            prob_grid[:, 0] = probs
        for j in range(1, k_max):
            act = np.nonzero(k > j)[0]
            act_t = torch.from_numpy(act).to(self.device)
            logits = next_logits(j, act, act_t, grid[act_t, j - 1])
            row_of = {r: i for i, r in enumerate(act.tolist())}
            tok, probs = pick(logits, act_t, [(row_of[r], g) for r, g in gens if r in row_of])
            grid[act_t, j] = tok
            if prob_grid is not None:
                prob_grid[act_t, j] = probs
        flat_probs = None
        if prob_grid is not None:
            req_idx = np.repeat(np.arange(len(states)), k)
            pos_idx = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
            flat_probs = prob_grid[torch.from_numpy(req_idx).to(self.device), torch.from_numpy(pos_idx).to(self.device)]
        return grid, flat_probs
