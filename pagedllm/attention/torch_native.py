"""torch_native attention backend: CPU (and reference) implementation over the paged KV cache.

Per layer: one ``index_copy_`` writes the step's new K/V into their slots; then
- all decode rows (query_len == 1) attend in ONE batched SDPA call over keys gathered through
  the block table (``index_select``, several times faster than advanced indexing on CPU) and
  padded to the longest context, padding masked out;
- each prefill chunk attends with its query heads grouped per kv head (GQA without copying
  K/V), through the cache when it has a cached prefix, with an additive offset-causal mask.
  float32 uses baddbmm/softmax/bmm in query chunks (measured 2-4x faster than CPU SDPA here);
  other dtypes use SDPA, which accumulates in float32.
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

_QUERY_CHUNK_ROWS = 1024  # bounds the score matrix of the manual prefill path


def _additive(keep: np.ndarray, device) -> torch.Tensor:
    """0 where attended, -inf elsewhere (float masks take SDPA's fast CPU path; bool ones do not)."""
    return torch.from_numpy(np.where(keep, 0.0, -np.inf).astype(np.float32)).to(device)


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # [B] token rows of the decodes
    block_ids: torch.Tensor  # [B * nb] flattened block ids covering the longest context
    mask: Optional[torch.Tensor]  # [B, 1, 1, L] additive float; None when no padding
    length: int


@dataclass
class _PrefillPlan:
    start: int
    end: int
    block_ids: Optional[torch.Tensor]  # None: keys come straight from this step's chunk
    mask: torch.Tensor  # [group * q, L] additive float, rows in grouped layout (kv-head major)


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
            nb = -(-int(dl.max()) // block_size)
            idx_t = torch.from_numpy(decode_idx).to(device)
            block_ids = md.block_table[idx_t, :nb].reshape(-1).long()
            length = nb * block_size
            pos = np.arange(length)
            keep = pos[None, :] < dl[:, None]
            if sliding_window is not None:
                keep &= pos[None, :] > (dl[:, None] - 1 - sliding_window)
            mask = None if keep.all() else _additive(keep, device)[:, None, None, :]
            self.decode = _DecodePlan(torch.from_numpy(qsl[decode_idx]).to(device), block_ids, mask, length)
        self.prefills: list[_PrefillPlan] = []
        for i in np.nonzero(qlens > 1)[0]:
            s, e, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q = e - s
            from_cache = L != q
            nb = -(-L // block_size)
            qpos = np.arange(L - q, L)[:, None]
            kpos = np.arange(nb * block_size if from_cache else q)[None, :]
            keep = kpos <= qpos
            if sliding_window is not None:
                keep &= kpos > qpos - sliding_window
            mask = _additive(keep, device)
            if group > 1:
                mask = mask.repeat(group, 1)
            block_ids = md.block_table[i, :nb].long() if from_cache else None
            self.prefills.append(_PrefillPlan(s, e, block_ids, mask))


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
        Hkv, D = self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, Hkv, D).index_copy_(0, md.slot_mapping, key[:num_tokens])
        v_cache.view(-1, Hkv, D).index_copy_(0, md.slot_mapping, value[:num_tokens])

        plan = self._plan(md, block_size)
        out = torch.empty_like(query)
        if plan.decode is not None:
            d = plan.decode
            B = d.rows.shape[0]
            q = query[d.rows].view(B, Hkv, self.group, D)
            k = k_cache.index_select(0, d.block_ids).view(B, d.length, Hkv, D).transpose(1, 2)
            v = v_cache.index_select(0, d.block_ids).view(B, d.length, Hkv, D).transpose(1, 2)
            # GQA without copies: a kv head's query heads form the "query length" axis.
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=self.scale)
            out[d.rows] = o.reshape(B, self.num_heads, D)
        for p in plan.prefills:
            n = p.end - p.start
            if p.block_ids is None:
                k = key[p.start : p.end].transpose(0, 1)  # [Hkv, n, D]
                v = value[p.start : p.end].transpose(0, 1)
            else:
                k = k_cache.index_select(0, p.block_ids).view(-1, Hkv, D).transpose(0, 1)
                v = v_cache.index_select(0, p.block_ids).view(-1, Hkv, D).transpose(0, 1)
            qg = query[p.start : p.end].view(n, Hkv, self.group, D).permute(1, 2, 0, 3).reshape(Hkv, self.group * n, D)
            og = self._grouped_attention(qg, k, v, p.mask)
            out[p.start : p.end] = og.view(Hkv, self.group, n, D).permute(2, 0, 1, 3).reshape(n, self.num_heads, D)
        return out

    def _grouped_attention(self, q, k, v, mask) -> torch.Tensor:
        if q.dtype != torch.float32:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        kt = k.transpose(1, 2)
        rows = q.shape[1]
        if rows <= _QUERY_CHUNK_ROWS:
            scores = torch.baddbmm(mask, q, kt, alpha=self.scale)
            return torch.bmm(torch.softmax(scores, dim=-1), v)
        out = torch.empty_like(q)
        for a in range(0, rows, _QUERY_CHUNK_ROWS):
            b = min(a + _QUERY_CHUNK_ROWS, rows)
            scores = torch.baddbmm(mask[a:b], q[:, a:b], kt, alpha=self.scale)
            out[:, a:b] = torch.bmm(torch.softmax(scores, dim=-1), v)
        return out


class TorchNativeAttentionBackend:
    name = "torch_native"

    @staticmethod
    def make_impl(num_heads, num_kv_heads, head_dim, scale, sliding_window) -> TorchNativeAttention:
        return TorchNativeAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window)
