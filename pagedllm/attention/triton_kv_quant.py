"""8-bit KV cache (``kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2) for the Triton backend: the cache
write and the in-register decode the attention kernel uses.

Same layout, scales and bytes as the CPU path (attention/kv_quant.py): one bfloat16 scale per
(token, kv head, K or V), ``scale = bf16(max|x| / qmax)``, values ``x / scale`` clamped to
+-qmax and rounded (int8: half to even; fp8: to nearest even, subnormals included).

Every rounding is done with integer and exact float arithmetic instead of the hardware
conversions: IEEE division (``div_rn``; a plain ``/`` compiles to an approximate division on
NVIDIA), round-to-nearest-even to bfloat16 and to fp8 on the float32 bits, and ``rint`` with
the 1.5 * 2**23 trick. So the bytes equal ``kv_quant.quantize`` bit for bit on the GPU and under
Triton's interpreter alike (the interpreter's own float32 -> bf16 / fp8 casts truncate or round
ties away from zero), and the tests that run here under the interpreter check the code the GPU
runs. The write is a small memory-bound kernel; the extra integer work costs nothing measurable.

Reading: the cache is passed as bytes (uint8) and each tile is bitcast in registers to int8 /
``tl.float8e4nv`` / ``tl.float8e5`` and converted to the query's dtype (exact: every int8 and
fp8 value is representable in fp16, bf16 and fp32); the attention kernel multiplies the K scales
into the score columns and the V scales into the softmax weights (float32), as the C++ kernels do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention import kv_quant

# constexpr codes of the stored format (0: the model dtype, no scales)
KV_PLAIN, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2, 3
_KIND = {torch.int8: KV_INT8, torch.float8_e4m3fn: KV_FP8_E4M3, torch.float8_e5m2: KV_FP8_E5M2}

_RINT_MAGIC = 12582912.0  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 to an integer, ties to even


def kv_kind(cache_dtype: torch.dtype) -> int:
    """The constexpr code of an 8-bit cache dtype."""
    if cache_dtype not in _KIND:
        raise ValueError(f"no 8-bit KV cache format stores {cache_dtype}")
    return _KIND[cache_dtype]


@triton.jit
def _rint(x):
    """Round float32 |x| < 2**22 to the nearest integer, ties to even (IEEE addition does it)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _bf16_round_bits(x):
    """float32 x >= 0 (or NaN) -> the int32 bits of bf16(x), round to nearest even (in the low 16 bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16


@triton.jit
def _fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL_INV: tl.constexpr):
    """float32 y with |y| <= the format's largest finite value -> its fp8 byte (int32 0..255),
    round to nearest even: exponent/mantissa from the float32 bits for normal results, an integer
    multiple of the smallest subnormal (1 / SUBNORMAL_INV) below the smallest normal. NaN -> 0x7F."""
    ybits = y.to(tl.int32, bitcast=True)
    sign = (ybits >> 31) & 1
    abits = ybits & 0x7FFFFFFF
    normal = ((abits + ((1 << (22 - MANT)) - 1) + ((abits >> (23 - MANT)) & 1)) >> (23 - MANT)) \
        - ((127 - BIAS) << MANT)
    a = tl.minimum(abits.to(tl.float32, bitcast=True), 1.0)  # (the normal ones: keep the int cast in range)
    # a * 2**k is exact, so the compiler fusing it with _rint's addition (fma) changes nothing
    sub = _rint(a * SUBNORMAL_INV).to(tl.int32)
    code = tl.where(abits < ((128 - BIAS) << 23), sub, normal)
    code = tl.where(abits > 0x7F800000, 0x7F, code)  # NaN
    return (sign << 7) | code


@triton.jit
def _quantize_rows(x, KIND: tl.constexpr, QMAX: tl.constexpr):
    """x [R, D] float32 (padding 0) -> (bytes [R, D] int32 0..255, bf16 scale bits [R] int32)."""
    amax = tl.max(tl.abs(x), 1)
    sbits = _bf16_round_bits(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)))
    s = (sbits << 16).to(tl.float32, bitcast=True)
    s2 = tl.broadcast_to(s[:, None], x.shape)
    pos = s2 > 0
    y = tl.where(pos, tl.math.div_rn(x, tl.where(pos, s2, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if KIND == 1:
        q = _rint(y).to(tl.int32) & 0xFF
    elif KIND == 2:
        q = _fp8_bits(y, 3, 7, 512.0)  # e4m3fn: smallest subnormal 2**-9
    else:
        q = _fp8_bits(y, 2, 15, 65536.0)  # e5m2: 2**-16
    return q, sbits


@triton.jit
def kv_dequant_tile(raw, KIND: tl.constexpr, dtype: tl.constexpr):
    """A tile of stored bytes (uint8) -> the 8-bit values in ``dtype`` (exact), not yet scaled."""
    if KIND == 1:
        # through float32: Triton's interpreter casts int8 -> bf16 wrongly (the integer as bits)
        return raw.to(tl.int8, bitcast=True).to(tl.float32).to(dtype)
    elif KIND == 2:
        return raw.to(tl.float8e4nv, bitcast=True).to(dtype)
    else:
        return raw.to(tl.float8e5, bitcast=True).to(dtype)


@triton.jit
def _reshape_and_cache_quant_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,  # uint8 view
    v_cache_ptr,
    k_scale_ptr,  # int16 view of the bfloat16 scales
    v_scale_ptr,
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
    stride_sb,
    stride_ss,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KIND: tl.constexpr,
    QMAX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    h_ok = offs_h < NUM_KV_HEADS
    mask = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]

    src_k = key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    src_v = value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    sdst = blk * stride_sb + off * stride_ss + offs_h * stride_sh

    k = tl.load(src_k, mask=mask, other=0.0).to(tl.float32)
    qk, sk = _quantize_rows(k, KIND, QMAX)
    tl.store(k_cache_ptr + dst, qk.to(tl.uint8), mask=mask)
    tl.store(k_scale_ptr + sdst, sk.to(tl.int16), mask=h_ok)
    v = tl.load(src_v, mask=mask, other=0.0).to(tl.float32)
    qv, sv = _quantize_rows(v, KIND, QMAX)
    tl.store(v_cache_ptr + dst, qv.to(tl.uint8), mask=mask)
    tl.store(v_scale_ptr + sdst, sv.to(tl.int16), mask=h_ok)


def reshape_and_cache_quant(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any float dtype
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] int8 / fp8
    kv_scales: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads] bfloat16
    slot_mapping: torch.Tensor,  # [num_tokens] int (negative = skip)
) -> None:
    """Quantize this step's K/V rows into the 8-bit cache and their scales (kv_quant.py's scheme)."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert key.shape[0] >= num_tokens and value.shape[0] >= num_tokens
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.shape[1:] == (num_kv_heads, head_dim), (key.shape, kv_cache.shape)
    assert value.shape[1:] == (num_kv_heads, head_dim), (value.shape, kv_cache.shape)
    assert kv_scales.shape == kv_cache.shape[:-1] and kv_scales.dtype == kv_quant.SCALE_DTYPE, kv_scales.shape
    kind = kv_kind(kv_cache.dtype)
    cache_u8 = kv_cache.view(torch.uint8)
    scales_i16 = kv_scales.view(torch.int16)
    k_cache, v_cache = cache_u8[0], cache_u8[1]
    k_scales, v_scales = scales_i16[0], scales_i16[1]
    assert k_cache.stride() == v_cache.stride() and k_scales.stride() == v_scales.stride()
    _reshape_and_cache_quant_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
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
        k_scales.stride(0),
        k_scales.stride(1),
        k_scales.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        KIND=kind,
        QMAX=kv_quant.for_storage(kv_cache.dtype).qmax,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )


__all__ = ["KV_PLAIN", "kv_dequant_tile", "kv_kind", "reshape_and_cache_quant"]
