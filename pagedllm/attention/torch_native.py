"""torch_native attention backend: CPU (and reference) implementation over the paged KV cache.

Per layer: one ``index_copy_`` writes the step's new K/V into their slots; then
- all decode rows (query_len == 1) attend in ONE batched SDPA call over keys gathered through
  the block table and padded to the longest context (padding masked out);
- each prefill chunk attends with one SDPA call: plain causal when it starts at position 0 and
  no window applies (keys straight from this step), else through the cache with an offset mask.
The plan (which rows are decodes, gather indices, masks) is built once per step and shared by
all layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # [B] token rows of the decodes
    block_table: torch.Tensor  # [B, nb] block ids covering the longest context
    mask: Optional[torch.Tensor]  # [B, 1, 1, L] additive float; None when no padding
    length: int


@dataclass
class _PrefillPlan:
    start: int
    end: int
    seq_len: int
    block_ids: Optional[torch.Tensor]  # None: keys come straight from this step's chunk
    mask: Optional[torch.Tensor]  # [q, L] additive float, None: plain causal


def _additive(keep: np.ndarray, device) -> torch.Tensor:
    """0 where attended, -inf elsewhere (float masks take SDPA's fast CPU path; bool ones do not)."""
    return torch.from_numpy(np.where(keep, 0.0, -np.inf).astype(np.float32)).to(device)


class _StepPlan:
    def __init__(self, md: AttentionMetadata, block_size: int, sliding_window: Optional[int], group: int) -> None:
        qsl = md.query_start_loc_cpu
        seq_lens = md.seq_lens_cpu
        qlens = np.diff(qsl)
        device = md.block_table.device
        decode_idx = np.nonzero(qlens == 1)[0]
        self.decode: Optional[_DecodePlan] = None
        if len(decode_idx):
            dl = seq_lens[decode_idx]
            max_len = int(dl.max())
            nb = -(-max_len // block_size)
            idx_t = torch.from_numpy(decode_idx).to(device)
            bt = md.block_table[idx_t, :nb]
            length = nb * block_size
            pos = np.arange(length)
            keep = pos[None, :] < dl[:, None]
            if sliding_window is not None:
                keep &= pos[None, :] > (dl[:, None] - 1 - sliding_window)
            mask = None if keep.all() else _additive(keep, device)[:, None, None, :]
            self.decode = _DecodePlan(torch.from_numpy(qsl[decode_idx]).to(device), bt, mask, length)
        self.prefills: list[_PrefillPlan] = []
        for i in np.nonzero(qlens > 1)[0]:
            s, e, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q = e - s
            if L == q and (sliding_window is None or L <= sliding_window):
                self.prefills.append(_PrefillPlan(s, e, L, None, None))
                continue
            nb = -(-L // block_size)
            qpos = np.arange(L - q, L)[:, None]
            kpos = np.arange(nb * block_size)[None, :]
            keep = kpos <= qpos
            if sliding_window is not None:
                keep &= kpos > qpos - sliding_window
            mask = _additive(keep, device)
            # rows follow the grouped query layout used in forward: [group * q, L]
            self.prefills.append(_PrefillPlan(s, e, L, md.block_table[i, :nb], mask.repeat(group, 1) if group > 1 else mask))


class TorchNativeAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: Optional[int]) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def _plan(self, md: AttentionMetadata, block_size: int) -> _StepPlan:
        # Built by the first layer of the step, reused by the others.
        key = ("torch_native", block_size, self.sliding_window, self.group)
        plan = md.backend_cache.get(key)
        if plan is None:
            plan = md.backend_cache[key] = _StepPlan(md, block_size, self.sliding_window, self.group)
        return plan

    def forward(self, query, key, value, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        num_tokens = md.num_actual_tokens
        block_size = kv_cache.shape[2]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, md.slot_mapping, key[:num_tokens])
        flat_v.index_copy_(0, md.slot_mapping, value[:num_tokens])

        plan = self._plan(md, block_size)
        out = torch.empty_like(query)
        if plan.decode is not None:
            d = plan.decode
            B = d.rows.shape[0]
            q = query[d.rows].view(B, self.num_kv_heads, self.group, self.head_dim)
            k = k_cache[d.block_table].reshape(B, d.length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v_cache[d.block_table].reshape(B, d.length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            # GQA without copies: a kv head's query heads form the "query length" axis.
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=self.scale)
            out[d.rows] = o.reshape(B, self.num_heads, self.head_dim)
        for p in plan.prefills:
            q = query[p.start : p.end].transpose(0, 1)  # [H, q, D]
            if p.block_ids is None:
                k = key[p.start : p.end].transpose(0, 1)
                v = value[p.start : p.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.group > 1)
                out[p.start : p.end] = o.transpose(0, 1)
            else:
                # Through the cache with an offset causal mask. GQA by grouping: the G query heads
                # of a kv head are stacked along the query axis (no K/V copies per query head).
                L = p.block_ids.shape[0] * block_size
                n = p.end - p.start
                k = k_cache[p.block_ids].reshape(L, self.num_kv_heads, self.head_dim).transpose(0, 1)
                v = v_cache[p.block_ids].reshape(L, self.num_kv_heads, self.head_dim).transpose(0, 1)
                qg = query[p.start : p.end].view(n, self.num_kv_heads, self.group, self.head_dim)
                qg = qg.permute(1, 2, 0, 3).reshape(self.num_kv_heads, self.group * n, self.head_dim)
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=p.mask, scale=self.scale)
                out[p.start : p.end] = o.view(self.num_kv_heads, self.group, n, self.head_dim).permute(2, 0, 1, 3).reshape(
                    n, self.num_heads, self.head_dim
                )
        return out


class TorchNativeAttentionBackend:
    name = "torch_native"

    @staticmethod
    def make_impl(num_heads, num_kv_heads, head_dim, scale, sliding_window) -> TorchNativeAttention:
        return TorchNativeAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window)
