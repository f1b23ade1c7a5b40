// 8-lane float helpers shared by the CPU kernels: loads/stores from float32 or bfloat16
// memory, a vectorised exp, horizontal reductions (AVX2+FMA); every kernel also has a scalar
// path for CPUs without it (PAGEDLLM_AVX2 undefined). Builds for AVX-512 (F/BW/VL/DQ, x86-64-v4)
// also get PAGEDLLM_AVX512 and 16-lane helpers (load16/store16 with tail masks), and with
// AVX512-BF16 PAGEDLLM_AVX512_BF16 (vdpbf16ps, vcvtneps2bf16); AVX2 helpers stay defined there.
#pragma once

#include "tensor.h"

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif
#if defined(PAGEDLLM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define PAGEDLLM_AVX512 1
#endif
#if defined(PAGEDLLM_AVX512) && defined(__AVX512BF16__)
#define PAGEDLLM_AVX512_BF16 1
#endif

namespace pagedllm {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
// 8-bit KV cache values (attention/kv_quant.py), before their row's scale.
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e5m2 x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

#ifdef PAGEDLLM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// 8-bit cache values widened exactly: int8 by sign extension; fp8 through float16, whose
// conversion (F16C) handles subnormals: e5m2 is a float16's high byte, and e4m3 (bias 7) placed
// in a float16 (bias 15) is 2^-8 times its value.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
}
// e4m3 byte s eeee mmm -> float16 s 0eeee mmm0000000: shifted to the top, arithmetic-shifted
// back one (the sign lands in bits 15 and 14), bit 14 cleared.
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float -> bfloat16 with round-to-nearest-even (as c10::BFloat16 does for finite values).
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// The float lanes exp_lanes works on: 8 (AVX2) or 16 (AVX-512) floats, the same operations.
struct Lanes8 {
  using V = __m256;
  static __m256 set1(float x) { return _mm256_set1_ps(x); }
  static __m256 clamp(__m256 x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, set1(lo)), set1(hi)); }
  static __m256 round(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
  static __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
  static __m256 pow2(__m256 n) {  // 2^n for integral n in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};

// e^x, about 1 ulp: Cody-Waite range reduction and a degree-5 polynomial; x clamped to
// [-87, 88] (results ~0 below, finite above).
template <typename L, typename V = typename L::V>
inline V exp_lanes(V x) {
  x = L::clamp(x, -87.0f, 88.0f);
  const V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  V r = L::fnmadd(n, L::set1(0.693359375f), x);
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  V p = L::set1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = L::fmadd(p, r, L::set1(c));
  p = L::fmadd(p, L::mul(r, r), L::add(r, L::set1(1.0f)));
  // n + 127 is in [1, 254] after the clamp (127 * ln 2 > 88), so 2^n is a normal float
  return L::mul(p, L::pow2(n));
}
inline __m256 exp8(__m256 x) { return exp_lanes<Lanes8>(x); }

// Logit soft-capping of a score row in place: s = cap * tanh(s / cap), -inf (masked) entries kept.
// tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|), the sign put back after.
inline void soft_cap8(float* s, int64_t n /* multiple of 8 */, float cap) {
  const __m256 vcap = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap), one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f), ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(s + i);
    const __m256 y = _mm256_mul_ps(x, inv);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(-2.0f)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 capped = _mm256_mul_ps(vcap, _mm256_or_ps(t, _mm256_and_ps(sign, y)));
    _mm256_storeu_ps(s + i, _mm256_blendv_ps(capped, ninf, _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ)));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#ifdef PAGEDLLM_AVX512
// Lanes [0, n) set (all 16 for n >= 16, none for n <= 0).
inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> f32 is exact: the bits shifted up
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e5m2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h =
      _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
// Lanes outside the mask read as 0 and touch no memory.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// float -> bfloat16 as store8 and c10::BFloat16 round finite values: nearest even, subnormals kept
// (the rounded words' high halves gathered by one vpermw).
inline __m256i bf16x16_as_store8(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __m512i high = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,  // (unused half)
                                        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(high, rounded));
}
// float -> bfloat16, round to nearest even (vcvtneps2bf16 where there is one: it flushes subnormals).
inline __m256i to_bf16x16(__m512 v) {
#ifdef PAGEDLLM_AVX512_BF16
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return bf16x16_as_store8(v);
#endif
}
inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }
struct Lanes16 {
  using V = __m512;
  static __m512 set1(float x) { return _mm512_set1_ps(x); }
  static __m512 clamp(__m512 x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, set1(lo)), set1(hi)); }
  static __m512 round(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
  static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
  static __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
  static __m512 fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
  static __m512 pow2(__m512 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
// exp8 on 16 lanes: the same operations lane by lane, so the same values.
inline __m512 exp16(__m512 x) { return exp_lanes<Lanes16>(x); }
// 16 lanes rounded, stored (store16_as8) and widened back (round16) exactly as store8 does 8: the
// values of an 8-lane loop, subnormals included.
inline void store16_as8(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16_as8(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16_as_store8(v));
}
inline __m512 round16(float*, __m512 v) { return v; }
inline __m512 round16(c10::BFloat16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_as_store8(v)), 16));
}

inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, to_bf16x16(v));
}
#endif

}  // namespace pagedllm
