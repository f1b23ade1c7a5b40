"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache, in torch (CPU and reference).

The cache holds ONE vector per token and layer: the compressed latent ``c_kv`` (kv_lora_rank)
followed by the rotated rope key ``k_pe`` (qk_rope_head_dim), in a single plane
``[num_blocks, block_size, 1, R + dr]``. With the up-projections absorbed into the query and the
output (the model's job), attention is multi-query attention with one shared "head": every
query head's ``[q_latent | q_pe]`` (R + dr) scores against the cached ``[c_kv | k_pe]`` rows, and
the values are the same rows' first R columns (``c_kv``). The output is per-head latent
``[T, H, R]``, which the model maps through W_UV.

Rows are read through the block table (gathered by block id). All decodes (query length 1)
attend in one batched product, padded to the longest context with the padding masked; each
prefill chunk attends on its own (a loop over requests, never over tokens) with a causal mask
offset by its cached prefix. The plan is built once per step and shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata


def _additive(keep: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.where(keep, 0.0, -np.inf).astype(np.float32)).to(device)


@dataclass
class _Decodes:
    rows: torch.Tensor  # [B] token rows
    block_ids: torch.Tensor  # [B * nb]
    mask: Optional[torch.Tensor]  # [B, 1, L] additive; None without padding
    length: int


@dataclass
class _Prefill:
    start: int
    end: int
    block_ids: torch.Tensor  # [nb]
    mask: torch.Tensor  # [n, L] additive, causal from the cached prefix


class _MLAPlan:
    def __init__(self, md: AttentionMetadata, block_size: int) -> None:
        qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        qlens = np.diff(qsl)
        device = md.block_table.device
        self.decodes: Optional[_Decodes] = None
        idx = np.nonzero(qlens == 1)[0]
        if len(idx):
            lens = seq_lens[idx]
            nb = -(-int(lens.max()) // block_size)
            length = nb * block_size
            keep = np.arange(length)[None, :] < lens[:, None]
            self.decodes = _Decodes(
                torch.from_numpy(qsl[idx].astype(np.int64)).to(device),
                md.block_table[torch.from_numpy(idx).to(device), :nb].reshape(-1).long(),
                None if keep.all() else _additive(keep, device)[:, None, :],
                length,
            )
        self.prefills: list[_Prefill] = []
        for i in np.nonzero(qlens > 1)[0]:
            s, e, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            nb = -(-L // block_size)
            qpos = np.arange(L - (e - s), L)[:, None]
            keep = np.arange(nb * block_size)[None, :] <= qpos
            self.prefills.append(_Prefill(s, e, md.block_table[i, :nb].long(), _additive(keep, device)))


def mla_attention(q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata,
                  scale: float, value_dim: int) -> torch.Tensor:
    """q: [T, H, R + dr] (absorbed latent query | rotated rope query); latent: [T, R + dr] this
    step's ``[c_kv | k_pe]`` rows, written into ``cache`` [num_blocks, block_size, 1, R + dr] at
    the step's slots. Returns the per-head latent output [T, H, value_dim (= R)]."""
    num_tokens = md.num_actual_tokens
    block_size, width = cache.shape[1], cache.shape[-1]
    rows_view = cache.view(-1, width)
    rows_view.index_copy_(0, md.slot_mapping, latent[:num_tokens].to(cache.dtype))
    key = ("torch_mla", block_size)
    plan = md.backend_cache.get(key)
    if plan is None:
        plan = md.backend_cache[key] = _MLAPlan(md, block_size)
    blocks = cache.view(cache.shape[0], block_size, width)
    H = q.shape[1]
    out = q.new_empty(q.shape[0], H, value_dim)
    d = plan.decodes
    if d is not None:
        B = d.rows.shape[0]
        kv = blocks.index_select(0, d.block_ids).view(B, d.length, width)  # [B, L, R + dr]
        scores = torch.bmm(q[d.rows], kv.transpose(1, 2)) * scale  # [B, H, L]
        if d.mask is not None:
            scores = scores + d.mask
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[d.rows] = torch.bmm(probs, kv[:, :, :value_dim])
    for p in plan.prefills:
        kv = blocks.index_select(0, p.block_ids).view(-1, width)  # [L, R + dr]
        qs = q[p.start:p.end]  # [n, H, R + dr]
        scores = torch.matmul(qs, kv.T) * scale + p.mask[:, None, :]  # [n, H, L]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[p.start:p.end] = torch.matmul(probs, kv[:, :value_dim])
    return out
