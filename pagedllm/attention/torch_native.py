"""torch_native attention backend: CPU (and reference) implementation over the paged KV cache.

Per layer: the step's new K/V are written into their slots (C++ ``write_kv``, else one
``index_copy_``); then, where the C++ kernels are built (CPU float32/bfloat16, head_dim a
multiple of 8), the decodes go to ``paged_decode_attention`` and the prefill chunks to
``paged_prefill_attention``, both reading K/V straight from the cache blocks. Otherwise (no
compiler, other dtypes) the pure-torch paths:
- all decode rows (query_len == 1) attend in ONE batched SDPA call over keys gathered through
  the block table (``index_select``, several times faster than advanced indexing on CPU) and
  padded to the longest context, padding masked out;
- each prefill chunk attends with its query heads grouped per kv head (GQA without copying
  K/V), through the cache when it has a cached prefix, with an additive offset-causal mask.
  float32 uses baddbmm/softmax/bmm in query chunks (measured 2-4x faster than CPU SDPA here);
  other dtypes use SDPA, which accumulates in float32.
The plan (which rows are decodes, gather indices, masks) is built once per step and shared by
all layers. Per layer: a sliding window and logit soft-capping (Gemma 2: scores become
``cap * tanh(score / cap)`` before the softmax; the kernels take it as an argument, the torch
paths then compute the scores explicitly instead of through SDPA). ALiBi (``alibi_slopes``,
Falcon-7B/40B): the torch paths only (the C++ kernels take no bias), with the per-head linear
bias ``slope * (key position - query position)`` folded into the step's additive masks, so the
masks of an ALiBi step are per kv head and query head.

A bfloat16 cache under a float32 model (kv_cache_dtype bfloat16): rows are rounded as they are
stored (``write_kv``), read as float32, and prefill chunks read their own keys back as 8-bit
caches do (below).

8-bit caches (kv_cache_dtype int8 / fp8, ``kv_scales`` given; attention/kv_quant.py): the write
quantizes each token's K/V row per kv head (C++ ``write_kv_quant``, else the torch reference);
the kernels read the 8-bit rows and apply the row scales to the scores and the softmax weights;
the torch paths dequantize only the blocks they gather. A prefill chunk then always reads its own
keys back from the cache, so a prefix-cache hit or a recomputation after preemption sees exactly
what a cold run saw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.attention import kv_quant
from pagedllm.attention.backend import AttentionMetadata

_MAX_DECODE_BUCKETS = 4
_MIN_DECODE_BUCKET = 8
_QUERY_CHUNK_POSITIONS = 256  # manual prefill path: query positions per chunk (bounds the score
# matrix, and a chunk only multiplies against keys up to its last position: causal savings)


def _int32(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)


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
    mask: torch.Tensor  # [q * group, L] additive float, rows in grouped layout (position major)
    prefix: int  # cached tokens before this chunk (keys [0, prefix + i] are visible to query i)


@dataclass
class _KernelDecodePlan:
    """All decodes for the C++ paged kernel: it reads K/V straight from the cache blocks."""

    rows: torch.Tensor | slice  # token rows of the decodes; a slice when they are consecutive
    block_table: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32


@dataclass
class _KernelPrefillPlan:
    """All prefill chunks for the C++ paged prefill kernel (keys and values read from the cache,
    where this step's chunk was just written)."""

    block_table: torch.Tensor  # [P, max_blocks] int32, contiguous
    q_start: torch.Tensor  # [P] int32
    q_len: torch.Tensor  # [P] int32
    seq_len: torch.Tensor  # [P] int32


def _alibi_bias(slopes: torch.Tensor, rel: np.ndarray, num_kv_heads: int, group: int) -> torch.Tensor:
    """[..., Hkv, G, L]-broadcastable bias ``slope * rel`` for ``rel`` [R, L] (key - query position)
    -> [R, Hkv, G, L] float32."""
    r = torch.from_numpy(rel.astype(np.float32)).to(slopes.device)
    return slopes.view(1, num_kv_heads, group, 1).float() * r[:, None, None, :]


class _StepPlan:
    def __init__(self, md: AttentionMetadata, block_size: int, sliding_window: Optional[int], group: int,
                 use_kernel: bool, rounded: bool = False, alibi: Optional[torch.Tensor] = None) -> None:
        qsl = md.query_start_loc_cpu
        seq_lens = md.seq_lens_cpu
        self.kernel_decode: Optional[_KernelDecodePlan] = None
        self.decodes: list[_DecodePlan] = []
        self.prefills: list[_PrefillPlan] = []
        self.kernel_prefill: Optional[_KernelPrefillPlan] = None
        if use_kernel and md.max_query_len == 1 and md.num_actual_tokens == len(seq_lens):  # decodes only: the
            # usual step; the step's own block table and lengths, every row in place
            self.kernel_decode = _KernelDecodePlan(slice(0, len(seq_lens)), md.block_table, md.seq_lens)
            return
        qlens = np.diff(qsl)
        device = md.block_table.device
        decode_idx = np.nonzero(qlens == 1)[0]
        if use_kernel and len(decode_idx):
            idx_t = torch.from_numpy(decode_idx).to(device)
            rows = qsl[decode_idx]
            consecutive = rows[-1] - rows[0] == len(rows) - 1  # (rows increase)
            self.kernel_decode = _KernelDecodePlan(
                slice(int(rows[0]), int(rows[-1]) + 1) if consecutive else torch.from_numpy(rows).to(device),
                md.block_table[idx_t].contiguous(),
                _int32(seq_lens[decode_idx], device),
            )
            decode_idx = decode_idx[:0]
        # Decodes sorted by context length and cut into a few buckets: each bucket pads only to
        # its own longest context (less gathering and masked work than one padded batch).
        if len(decode_idx):
            order = decode_idx[np.argsort(seq_lens[decode_idx], kind="stable")]
            num_buckets = min(_MAX_DECODE_BUCKETS, -(-len(order) // _MIN_DECODE_BUCKET))
            for bucket in np.array_split(order, num_buckets):
                self.decodes.append(self._decode_plan(md, bucket, block_size, sliding_window, device, alibi, group))
        prefill_idx = np.nonzero(qlens > 1)[0]
        if use_kernel and len(prefill_idx):
            idx_t = torch.from_numpy(prefill_idx).to(device)
            self.kernel_prefill = _KernelPrefillPlan(
                md.block_table[idx_t].contiguous(),
                _int32(qsl[prefill_idx], device),
                _int32(qlens[prefill_idx], device),
                _int32(seq_lens[prefill_idx], device),
            )
            prefill_idx = prefill_idx[:0]
        for i in prefill_idx:
            s, e, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q = e - s
            from_cache = L != q or rounded  # a cache coarser than the query: the chunk's keys as stored, as a later hit reads them
            nb = -(-L // block_size)
            qpos = np.arange(L - q, L)[:, None]
            kpos = np.arange(nb * block_size if from_cache else q)[None, :]
            keep = kpos <= qpos
            if sliding_window is not None:
                keep &= kpos > qpos - sliding_window
            mask = _additive(keep, device)
            if alibi is not None:  # [Hkv, q * group, L]: rows (position, query head of the kv head)
                bias = _alibi_bias(alibi, kpos - qpos, alibi.shape[0] // group, group)  # [q, Hkv, G, L]
                mask = (bias + mask[:, None, None, :]).permute(1, 0, 2, 3).reshape(-1, q * group, mask.shape[-1])
            elif group > 1:
                mask = mask.repeat_interleave(group, dim=0)
            block_ids = md.block_table[i, :nb].long() if from_cache else None
            self.prefills.append(_PrefillPlan(s, e, block_ids, mask, L - q))


    @staticmethod
    def _decode_plan(md, idx, block_size, sliding_window, device, alibi=None, group=1) -> _DecodePlan:
        dl = md.seq_lens_cpu[idx]
        nb = -(-int(dl.max()) // block_size)
        block_ids = md.block_table[torch.from_numpy(idx).to(device), :nb].reshape(-1).long()
        length = nb * block_size
        pos = np.arange(length)
        keep = pos[None, :] < dl[:, None]
        if sliding_window is not None:
            keep &= pos[None, :] > (dl[:, None] - 1 - sliding_window)
        mask = None if keep.all() else _additive(keep, device)[:, None, None, :]
        if alibi is not None:  # [B, Hkv, G, L]
            bias = _alibi_bias(alibi, pos[None, :] - (dl[:, None] - 1), alibi.shape[0] // group, group)
            mask = bias if mask is None else bias + mask
        return _DecodePlan(torch.from_numpy(md.query_start_loc_cpu[idx]).to(device), block_ids, mask, length)


def _blocks(cache: torch.Tensor, scales: Optional[torch.Tensor], block_ids: torch.Tensor, dtype) -> torch.Tensor:
    """The blocks ``block_ids`` of a cache plane as ``dtype`` (dequantized when the cache is 8-bit)."""
    if scales is None:
        return cache.index_select(0, block_ids).to(dtype)
    return kv_quant.gather_dequantized(cache, scales, block_ids, dtype)


class TorchNativeAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: Optional[int],
                 logits_soft_cap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = float(logits_soft_cap) if logits_soft_cap else 0.0
        self.alibi = None if alibi_slopes is None else alibi_slopes.float().contiguous()
        if self.alibi is not None and self.alibi.shape != (num_heads,):
            raise ValueError(f"alibi_slopes must have one slope per query head ({num_heads}), got {tuple(self.alibi.shape)}")

    def _plan(self, md: AttentionMetadata, block_size: int, dtype: torch.dtype, use_kernel: bool,
              rounded: bool) -> _StepPlan:
        # Built by the first layer of the step, reused by the others.
        alibi_key = None if self.alibi is None else self.alibi.data_ptr()  # layers share one slopes tensor
        key = ("torch_native", block_size, self.sliding_window, self.group, dtype, rounded, alibi_key)
        plan = md.backend_cache.get(key)
        if plan is None:
            plan = md.backend_cache[key] = _StepPlan(md, block_size, self.sliding_window, self.group, use_kernel,
                                                     rounded, self.alibi)
        return plan

    def forward(self, query, key, value, kv_cache, md: AttentionMetadata, kv_scales=None) -> torch.Tensor:
        """``kv_scales`` [2, num_blocks, block_size, kv_heads]: the cache is 8-bit (kv_quant.py)."""
        num_tokens = md.num_actual_tokens
        block_size = kv_cache.shape[2]
        Hkv, D = self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kernels = cpu_kernels.for_tensor(key)
        rows_ok = key.stride(1) == D and value.stride(1) == D and key.stride(2) == 1 and value.stride(2) == 1
        k_scales = v_scales = None
        if kv_scales is not None:
            k_scales, v_scales = kv_scales[0], kv_scales[1]
            if kernels is not None and rows_ok:
                kernels.write_kv_quant(k_cache, v_cache, k_scales, v_scales, key, value, md.slot_mapping)
            else:
                spec = kv_quant.for_storage(k_cache.dtype)
                kv_quant.write_quantized(k_cache, k_scales, key, md.slot_mapping, spec)
                kv_quant.write_quantized(v_cache, v_scales, value, md.slot_mapping, spec)
        elif kernels is not None and rows_ok:
            kernels.write_kv(k_cache, v_cache, key, value, md.slot_mapping)
        else:
            k_cache.view(-1, Hkv, D).index_copy_(0, md.slot_mapping, key[:num_tokens].to(k_cache.dtype))
            v_cache.view(-1, Hkv, D).index_copy_(0, md.slot_mapping, value[:num_tokens].to(v_cache.dtype))
        scale_kw = {} if kv_scales is None else {"k_scales": k_scales, "v_scales": v_scales}

        use_kernel = kernels is not None and D % 8 == 0 and self.alibi is None
        # an 8-bit cache, or a bfloat16 one under a float32 model, stores rows rounded
        plan = self._plan(md, block_size, query.dtype, use_kernel, kv_scales is not None or k_cache.dtype != query.dtype)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous rows
        if plan.kernel_decode is not None:
            kd = plan.kernel_decode
            # consecutive rows (the usual case): the kernel reads the strided query rows and
            # writes its output in place; otherwise a gather and a scatter
            gathered = not isinstance(kd.rows, slice)
            q = query[kd.rows].contiguous() if gathered else query[kd.rows]
            o = torch.empty_like(q) if gathered else out[kd.rows]
            kernels.paged_decode_attention(
                o, q, k_cache, v_cache, kd.block_table, kd.seq_lens, self.scale, self.sliding_window or 0,
                self.soft_cap, **scale_kw,
            )
            if gathered:
                out[kd.rows] = o
        if plan.kernel_prefill is not None:
            kp = plan.kernel_prefill
            kernels.paged_prefill_attention(
                out, query, k_cache, v_cache, kp.block_table, kp.q_start, kp.q_len, kp.seq_len, self.scale,
                self.sliding_window or 0, self.soft_cap, **scale_kw,
            )
        for d in plan.decodes:
            B = d.rows.shape[0]
            q = query[d.rows].view(B, Hkv, self.group, D)
            k = _blocks(k_cache, k_scales, d.block_ids, query.dtype).view(B, d.length, Hkv, D).transpose(1, 2)
            v = _blocks(v_cache, v_scales, d.block_ids, query.dtype).view(B, d.length, Hkv, D).transpose(1, 2)
            # GQA without copies: a kv head's query heads form the "query length" axis.
            if self.soft_cap:
                o = self._capped_attention(q, k, v, d.mask)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=self.scale)
            out[d.rows] = o.reshape(B, self.num_heads, D)
        for p in plan.prefills:
            n = p.end - p.start
            if p.block_ids is None:
                k = key[p.start : p.end].transpose(0, 1)  # [Hkv, n, D]
                v = value[p.start : p.end].transpose(0, 1)
            else:
                k = _blocks(k_cache, k_scales, p.block_ids, query.dtype).view(-1, Hkv, D).transpose(0, 1)
                v = _blocks(v_cache, v_scales, p.block_ids, query.dtype).view(-1, Hkv, D).transpose(0, 1)
            # rows = (position, query head of this kv head): position-major so chunks are causal
            qg = query[p.start : p.end].view(n, Hkv, self.group, D).transpose(0, 1).reshape(Hkv, n * self.group, D)
            og = self._grouped_attention(qg, k, v, p.mask, p.prefix)
            out[p.start : p.end] = og.view(Hkv, n, self.group, D).transpose(0, 1).reshape(n, self.num_heads, D)
        return out

    def _capped_attention(self, q, k, v, mask) -> torch.Tensor:
        """softmax(cap * tanh(q k^T * scale / cap) + mask) v, softmax in float32."""
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
        if mask is not None:
            scores = scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)

    def _grouped_attention(self, q, k, v, mask, prefix: int) -> torch.Tensor:
        if self.soft_cap:
            return self._capped_attention(q, k, v, mask)
        if q.dtype != torch.float32:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        G = self.group
        n = q.shape[1] // G
        if n <= _QUERY_CHUNK_POSITIONS:
            scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=self.scale)
            return torch.bmm(torch.softmax(scores, dim=-1), v)
        out = torch.empty_like(q)
        for a in range(0, n, _QUERY_CHUNK_POSITIONS):
            b = min(a + _QUERY_CHUNK_POSITIONS, n)
            kend = prefix + b  # later keys are masked for every query of this chunk
            rows = slice(a * G, b * G)
            scores = torch.baddbmm(mask[..., rows, :kend], q[:, rows], k[:, :kend].transpose(1, 2), alpha=self.scale)
            out[:, rows] = torch.bmm(torch.softmax(scores, dim=-1), v[:, :kend])
        return out


class TorchNativeAttentionBackend:
    name = "torch_native"
    kv_cache_dtypes = kv_quant.UNQUANTIZED_KV_CACHE_DTYPES + kv_quant.QUANTIZED_KV_CACHE_DTYPES

    @staticmethod
    def make_impl(num_heads, num_kv_heads, head_dim, scale, sliding_window, logits_soft_cap=None,
                  alibi_slopes=None) -> TorchNativeAttention:
        return TorchNativeAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window, logits_soft_cap,
                                    alibi_slopes)
