"""Triton paged-attention backend (CUDA).

Two kernels plus an optional reduction:

* ``reshape_and_cache``: scatters this step's new K/V rows ``[num_tokens, num_kv_heads, head_dim]``
  into the paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` at
  ``slot_mapping`` (``slot = block_id * block_size + offset``; negative slots are padding and are
  skipped). One program per token, all kv heads at once.

* ``unified_attention``: one launch for the whole ragged batch (prefill chunks with a cached
  prefix, and decodes, mixed freely). The grid is ``(query tiles, kv heads, kv splits)``.

  - A *query tile* is ``BLOCK_Q`` consecutive query tokens of one request. Tiles are numbered so
    that request ``i`` owns tile ids ``[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1)``;
    this is an upper bound on ``cdiv(query_len, BLOCK_Q)`` that needs only the device
    ``query_start_loc``, so the grid size is ``num_tokens // BLOCK_Q + num_reqs`` (host ints) and
    each program finds its request with a binary search over ``query_start_loc`` in-kernel.
    Surplus tiles exit immediately.
  - One program computes ``BLOCK_M = BLOCK_Q * QPK_PAD`` rows: every query token of its tile times
    every query head that shares its kv head (GQA group, padded to a power of two), so K/V tiles
    are loaded once per group instead of once per query head.
  - It walks the request's KV positions in tiles of ``TILE_N`` keys, translating each position to
    ``block_table[req, pos // block_size]`` / ``pos % block_size`` (so ``TILE_N`` is independent
    of the cache block size: any block size works, the tests use 8/16/32), with an fp32 online
    softmax (base-2 exponentials, scale folded in), causal mask with the ``seq_len - query_len``
    offset and optional sliding window (key ``j`` visible from position ``p`` iff
    ``j <= p and p - j < window``) and optional logit soft-capping (``cap * tanh(score / cap)``
    before the softmax, Gemma 2; a compile-time flag, so other layers run the same code as
    before) and optional ALiBi (``slope[head] * (key - query position)`` added to the scaled
    score, Falcon; also a compile-time flag). The KV range is clipped per tile: it stops at the tile's last
    query position and, with a window, starts at the first key any row of the tile can see.
  - Split-KV (flash-decoding): with ``NUM_SPLITS > 1`` the tile's KV range is divided into
    contiguous chunks over grid axis 2; each program writes an unnormalised partial
    (acc, running max, running sum) to fp32 scratch and ``_reduce_splits_kernel`` combines them.
    Used automatically for decode-only batches with long contexts and too few
    (request, kv head) pairs to fill the GPU.

8-bit caches (kv_cache_dtype int8 / fp8_e4m3 / fp8_e5m2; attention/kv_quant.py's scheme, one bf16
scale per token and kv head in ``kv_scales``): ``reshape_and_cache_quant`` (triton_kv_quant.py)
quantizes the new rows with exactly the reference's bytes, and ``unified_attention`` loads the
tiles as bytes, converts them in registers (exact) and multiplies the K scales into the score
columns and the V scales into the softmax weights, in fp32 (the compile-time ``KV_QUANT`` code;
0 compiles the plain kernel as before). The scales are device tensors bound once per layer, so
CUDA graphs replay them like the cache.

Everything accumulates in fp32; inputs may be fp16/bf16/fp32 (fp32 dots use IEEE precision, not
TF32). This module imports triton at the top; nothing imports it unless the device is CUDA (see
``attention.selector.get_attention_backend``), except the tests which run it under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.attention import kv_quant
from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.triton_kv_quant import (
    KV_PLAIN,
    kv_dequant_tile,
    kv_kind,
    reshape_and_cache_quant,
)

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    src_k = key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    src_v = value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd

    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int (negative = skip)
) -> None:
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert key.shape[0] >= num_tokens and value.shape[0] >= num_tokens
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.shape[1:] == (num_kv_heads, head_dim), (key.shape, kv_cache.shape)
    assert value.shape[1:] == (num_kv_heads, head_dim), (value.shape, kv_cache.shape)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride() == v_cache.stride()
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )


# --------------------------------------------------------------------------------------------
# unified paged attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_request(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest request i with ``qsl[i] // BLOCK_Q + i <= tile_id`` (binary search)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # 8-bit caches: bf16 scales [num_blocks, block_size, kv_heads] (else unused)
    v_scale_ptr,
    alibi_ptr,  # float32 [num_heads] ALiBi slopes (ALIBI set; else unused)
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_reqs,
    num_heads,
    scale_log2,
    soft_cap,  # > 0: scores become soft_cap * tanh(score / soft_cap) (SOFT_CAP set)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    SLIDING_WINDOW: tl.constexpr,  # 0 = no window
    SOFT_CAP: tl.constexpr,  # logit soft-capping compiled in (a separate specialisation)
    ALIBI: tl.constexpr,  # ALiBi bias compiled in
    QPK: tl.constexpr,  # query heads per kv head
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * QPK_PAD
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,  # 0: cache in the model dtype; else triton_kv_quant's code (bytes + scales)
):
    tile_id = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, tile_id, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_off = (tile_id - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if q_off >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens already cached before this step's chunk

    # Rows: (query token within tile) x (query head within the kv head's group).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_idx = q_off + offs_m // QPK_PAD
    hq = offs_m % QPK_PAD
    head = kvh * QPK + hq
    row_ok = (q_idx < q_len) & (hq < QPK)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q_pos = ctx_len + q_idx  # absolute position of each row

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    if ALIBI:  # slopes in base-2 units, as the scores below
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634

    # KV positions this tile can see: [kv_lo, kv_hi).
    kv_hi = tl.minimum(seq_len, ctx_len + q_off + BLOCK_Q)
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(ctx_len + q_off - SLIDING_WINDOW + 1, 0)
    else:
        kv_lo = 0
    num_tiles = tl.cdiv(kv_hi - kv_lo, TILE_N)
    if NUM_SPLITS == 1:
        t_begin = 0
        t_end = num_tiles
    else:
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        t_begin = split * per_split
        t_end = tl.minimum(t_begin + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    offs_n = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch

    for t in range(t_begin, t_end):
        kp = kv_lo + t * TILE_N + offs_n  # key positions [TILE_N]
        kv_ok = kp < kv_hi
        blk = tl.load(bt_row + kp // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        tok_off = blk * stride_cb + (kp % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
        # K loaded transposed: [HEAD_PAD, TILE_N]; V: [TILE_N, HEAD_PAD].
        k = tl.load(
            k_cache_ptr + tok_off[None, :] + offs_d[:, None] * stride_cd,
            mask=kv_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + tok_off[:, None] + offs_d[None, :] * stride_cd,
            mask=kv_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if KV_QUANT == 0:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        else:
            # 8-bit values, exact in q's dtype; the per-token scales scale the score columns (K)
            # and the softmax weights (V) in float32. Masked keys: scale 0, score masked below.
            k = kv_dequant_tile(k, KV_QUANT, q.dtype)
            v = kv_dequant_tile(v, KV_QUANT, q.dtype)
            s_off = blk * stride_sb + (kp % BLOCK_SIZE).to(tl.int64) * stride_ss + kvh.to(tl.int64) * stride_sh
            k_sc = tl.load(k_scale_ptr + s_off, mask=kv_ok, other=0.0).to(tl.float32)
            v_sc = tl.load(v_scale_ptr + s_off, mask=kv_ok, other=0.0).to(tl.float32)

        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if KV_QUANT != 0:
            s = s * k_sc[None, :]
        if SOFT_CAP:
            # scale_log2 = scale * log2(e): cap the natural-unit score, then back to base 2.
            # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends in float32.
            x = s * (scale_log2 / (1.4426950408889634 * soft_cap))
            t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
            s = t * (soft_cap * 1.4426950408889634)
        else:
            s = s * scale_log2
        if ALIBI:
            s = s + slope[:, None] * (kp[None, :] - q_pos[:, None]).to(tl.float32)

        visible = kv_ok[None, :] & (kp[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & ((q_pos[:, None] - kp[None, :]) < SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 to avoid (-inf) - (-inf).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT != 0:
            p = p * v_sc[None, :]
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (tok * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    base = (tok * num_heads + head) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + offs_s)
    l = tl.load(part_l_ptr + base + offs_s)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    denom = tl.sum(w * l, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # interpreter / CPU: pretend H100/H200-sized


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, sm_count: int
) -> int:
    """Split-KV only for decode-only batches whose (request, kv head) pairs can't fill the GPU."""
    if max_query_len != 1 or max_seq_len < 1024:
        return 1
    programs = num_reqs * num_kv_heads
    if programs >= sm_count:
        return 1
    want = triton.cdiv(2 * sm_count, programs)
    want = min(want, max_seq_len // 256, 64)  # keep >= 256 keys per split
    if want < 2:
        return 1
    return 1 << (want.bit_length() - 1)  # floor to a power of two


def _tile_config(max_query_len: int, qpk_pad: int, head_pad: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N). tl.dot needs every dim >= 16."""
    block_m = triton.next_power_of_2(max(1, max_query_len)) * qpk_pad
    block_m = min(max(block_m, 16), 64)
    block_m = max(block_m, qpk_pad)
    block_q = block_m // qpk_pad
    if block_q == 1 or block_m <= 16:
        tile_n = 64 if head_pad <= 128 else 32  # decode-like: memory bound, wide KV tiles
    else:
        tile_n = 64 if head_pad <= 64 else 32
    return block_m, block_q, tile_n


def unified_attention(
    query: torch.Tensor,  # [>= num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out: torch.Tensor,  # [>= num_tokens, num_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,  # 8-bit kv_cache: [2, num_blocks, block_size, num_kv_heads] bf16
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads], on the query's device
) -> torch.Tensor:
    if num_tokens == 0 or num_reqs == 0:
        return out
    _, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert block_table.stride(1) == 1
    qpk = num_heads // num_kv_heads
    qpk_pad = triton.next_power_of_2(qpk)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_q, tile_n = _tile_config(max_query_len, qpk_pad, head_pad)

    if num_splits is None:
        num_splits = choose_num_splits(
            num_reqs, num_kv_heads, max_query_len, max_seq_len, _device_sm_count(query.device)
        )
    assert num_splits >= 1 and (num_splits & (num_splits - 1)) == 0, "num_splits: power of two"

    if kv_scales is None:
        kv_code = KV_PLAIN
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_scales = v_scales = k_cache  # unused
        scale_strides = (0, 0, 0)
    else:
        kv_code = kv_kind(kv_cache.dtype)
        assert kv_scales.shape == kv_cache.shape[:-1] and kv_scales.dtype == kv_quant.SCALE_DTYPE
        cache_u8 = kv_cache.view(torch.uint8)  # bitcast to the 8-bit format in the kernel
        k_cache, v_cache = cache_u8[0], cache_u8[1]
        k_scales, v_scales = kv_scales[0], kv_scales[1]
        assert k_scales.stride() == v_scales.stride()
        scale_strides = k_scales.stride()
    assert k_cache.stride() == v_cache.stride()
    if num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device
        )
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused

    if alibi_slopes is not None:
        assert alibi_slopes.shape == (num_heads,) and alibi_slopes.dtype == torch.float32
    num_q_tiles = num_tokens // block_q + num_reqs
    grid = (num_q_tiles, num_kv_heads, num_splits)
    _unified_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        alibi_slopes if alibi_slopes is not None else out,
        out,
        part_acc,
        part_m,
        part_l,
        query_start_loc,
        seq_lens,
        block_table,
        num_reqs,
        num_heads,
        float(scale) * _LOG2E,
        float(soft_cap or 0.0),
        query.stride(0),
        query.stride(1),
        query.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        *scale_strides,
        block_table.stride(0),
        SLIDING_WINDOW=int(sliding_window) if sliding_window else 0,
        SOFT_CAP=bool(soft_cap),
        ALIBI=alibi_slopes is not None,
        QPK=qpk,
        QPK_PAD=qpk_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        IEEE_DOT=query.dtype == torch.float32,
        KV_QUANT=kv_code,
        num_warps=4,
        num_stages=2 if block_m > 16 else 3,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            num_heads,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits,
            num_warps=4,
        )
    return out


# --------------------------------------------------------------------------------------------
# backend
# --------------------------------------------------------------------------------------------


class TritonAttentionImpl:
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None,
        logits_soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
        # None = heuristic (choose_num_splits); an int forces the split count (tests/benchmarks).
        self.num_splits: int | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv_scales`` [2, num_blocks, block_size, kv_heads]: the cache is 8-bit (kv_quant.py)."""
        n = metadata.num_actual_tokens
        if key is not None and value is not None and n > 0:
            if kv_scales is None:
                reshape_and_cache(key, value, kv_cache, metadata.slot_mapping[:n])
            else:
                reshape_and_cache_quant(key, value, kv_cache, kv_scales, metadata.slot_mapping[:n])
        if query.shape[0] > n:  # padded batch (e.g. CUDA graphs): keep padding rows finite
            out = torch.zeros_like(query)
        else:
            out = torch.empty_like(query)
        unified_attention(
            query,
            kv_cache,
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            num_tokens=n,
            num_reqs=metadata.num_reqs,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=self.scale,
            sliding_window=self.sliding_window,
            num_splits=self.num_splits,
            soft_cap=self.soft_cap,
            kv_scales=kv_scales,
            alibi_slopes=self.alibi_slopes,
        )
        return out


class TritonAttentionBackend:
    name = "triton"
    kv_cache_dtypes = ("auto",) + kv_quant.QUANTIZED_KV_CACHE_DTYPES

    @staticmethod
    def make_impl(
        num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None,
        logits_soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None,
    ) -> TritonAttentionImpl:
        return TritonAttentionImpl(num_heads, num_kv_heads, head_dim, scale, sliding_window, logits_soft_cap,
                                   alibi_slopes)


__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "choose_num_splits",
    "reshape_and_cache",
    "unified_attention",
]
