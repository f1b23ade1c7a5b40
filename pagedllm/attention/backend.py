"""Attention backend interface: per-step metadata and the Protocol every backend implements.

KV cache layout (per layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). A token's slot is ``block_id * block_size + offset``.

The model runner builds one ``AttentionMetadata`` per step for the whole ragged batch; every
attention layer reads it from the forward context (see ``attention/forward_context.py``); ``attention/selector.py`` picks the backend.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one step's flat, unpadded batch.

    Requests are laid out one after another: request ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``, whose positions are the last
    ``query_len`` positions of its ``seq_lens[i]`` tokens (cached prefix + this step's chunk).
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_reqs] int32, on device: KV length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, on device
    max_query_len: int
    max_seq_len: int
    # Host mirrors so CPU backends can plan without device->host syncs.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    # Per-step scratch for backends (e.g. a plan built by the first layer, reused by the rest).
    backend_cache: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @classmethod
    def from_host(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                  slot_mapping: np.ndarray, device: torch.device) -> "AttentionMetadata":
        """Built once per step from the runner's numpy arrays (one copy each to the device)."""
        return cls(
            num_actual_tokens=int(query_start_loc[-1]),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_table=torch.from_numpy(block_table).to(device),
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )


class AttentionImpl(Protocol):
    """One attention layer's kernel pair: store new K/V into the paged cache, then attend."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


class AttentionBackend(Protocol):
    name: str
    kv_cache_dtypes: tuple[str, ...]  # the kv_cache_dtype values its impls run ("auto" and the 8-bit ones)

    @staticmethod
    def make_impl(
        num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None,
        logits_soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None,
    ) -> AttentionImpl:
        """One layer's impl. ``sliding_window``: key j visible from position p iff p - j < window
        (None: all earlier keys); ``logits_soft_cap``: scores become cap * tanh(score / cap) before
        the softmax (None: unchanged); ``alibi_slopes`` (float32 [num_heads], on the cache's device):
        the scaled score of key j from position p gains ``slope[head] * (j - p)`` (ALiBi)."""
        ...
