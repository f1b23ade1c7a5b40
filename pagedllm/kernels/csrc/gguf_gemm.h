// y[M, N] = x[M, K] W[N, K]^T with W in a GGUF file's own blocks (llama.cpp's block formats),
// never made dense: W is uint8 [N, row_bytes], each row K / block_elems blocks as the file
// stores them (ggml's block_q4_0, block_q4_K, ...). Activations stay float: each block is
// dequantized exactly as ggml's dequantize_row_* (and gguf-py's gguf.quants) define it, up to
// fused multiply-adds, and multiplied in float32.
//
// Formats (elements per block / bytes): F32 1/4, F16 1/2, BF16 1/2, Q4_0 32/18, Q4_1 32/20,
// Q5_0 32/22, Q5_1 32/24, Q8_0 32/34, Q2_K 256/84, Q3_K 256/110, Q4_K 256/144, Q5_K 256/176,
// Q6_K 256/210.
//
// Paths:
// - M <= kSmallM (decode): the rows of W are split between the threads once, as contiguous
//   ranges (each thread streams its own part of the weight front to back). Q4_0 / Q4_1 / Q8_0
//   / Q5_0 / Q5_1 (AVX-512 or AVX2) dequantize 32 weights into registers and multiply them with
//   every row of x; the other formats dequantize one weight row into an L1 buffer (plain loops,
//   vectorized by the compiler) and take dot products from there.
// - Larger M (prompt chunks, big batches): tiles of rows are dequantized into a float32 buffer
//   by all threads and multiplied by torch's float32 GEMM; each weight block is unpacked once
//   per call, for every row of x.
#pragma once

#include <ATen/ops/mm.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace gguf {

// ggml's type ids (GGMLQuantizationType).
enum Type : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};
constexpr int kTypes[] = {kF32, kF16, kBF16, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K};
constexpr int64_t kSmallM = 4;  // at most this many rows of x take the GEMV path

struct Format {
  int64_t elems;  // per block
  int64_t bytes;  // per block
};

inline Format format(int64_t t) {
  switch (t) {
    case kF32: return {1, 4};
    case kF16: return {1, 2};
    case kBF16: return {1, 2};
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "gguf: unsupported block type id ", t);
  }
  return {0, 0};
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef PAGEDLLM_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}
inline float bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 6-bit scale and min j of a Q4_K / Q5_K block's 12 packed scale bytes.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block of type T into y[elems] (ggml's dequantize_row_* for one block).
template <int T>
inline void dequant_block(const uint8_t* b, float* __restrict y) {
  if constexpr (T == kQ4_0) {
    const float d = f16(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
      y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  } else if constexpr (T == kQ4_1) {
    const float d = f16(b), m = f16(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>(qs[j] & 0xF) * d + m;
      y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    const float d = f16(b), m = T == kQ5_1 ? f16(b + 2) : 0.0f;
    const uint8_t* p = b + (T == kQ5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const uint8_t* qs = p + 4;
    const int off = T == kQ5_0 ? 16 : 0;
    for (int j = 0; j < 16; ++j) {
      const int x0 = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10);
      const int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
      if constexpr (T == kQ5_0) {
        y[j] = static_cast<float>(x0 - off) * d;
        y[j + 16] = static_cast<float>(x1 - off) * d;
      } else {
        y[j] = static_cast<float>(x0) * d + m;
        y[j + 16] = static_cast<float>(x1) * d + m;
      }
    }
  } else if constexpr (T == kQ8_0) {
    const float d = f16(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
  } else if constexpr (T == kQ2_K) {
    const uint8_t* sc = b;
    const uint8_t* q = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    int is = 0;
    for (int n = 0; n < 256; n += 128) {
      int shift = 0;
      for (int j = 0; j < 4; ++j) {
        for (int h = 0; h < 2; ++h) {
          const uint8_t s = sc[is++];
          const float dl = d * (s & 0xF), ml = dmin * (s >> 4);
          for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[l + 16 * h] >> shift) & 3) - ml;
        }
        shift += 2;
      }
      q += 32;
    }
  } else if constexpr (T == kQ3_K) {
    const uint8_t* hm = b;
    const uint8_t* q = b + 32;
    const float dall = f16(b + 108);
    uint32_t aux[4];
    std::memcpy(aux, b + 96, 12);
    const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
    const int8_t* scales = reinterpret_cast<const int8_t*>(aux);
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
      int shift = 0;
      for (int j = 0; j < 4; ++j) {
        for (int h = 0; h < 2; ++h) {
          const float dl = dall * static_cast<float>(scales[is++] - 32);
          for (int l = 16 * h; l < 16 * h + 16; ++l)
            *y++ = dl * static_cast<float>(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
        }
        shift += 2;
        m <<= 1;
      }
      q += 32;
    }
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* q = b + (T == kQ5_K ? 48 : 16);
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
      uint8_t sc, mn;
      scale_min_k4(is, scales, sc, mn);
      const float d1 = d * sc, m1 = dmin * mn;
      scale_min_k4(is + 1, scales, sc, mn);
      const float d2 = d * sc, m2 = dmin * mn;
      for (int l = 0; l < 32; ++l) {
        const int hi = T == kQ5_K ? ((qh[l] & u1) ? 16 : 0) : 0;
        y[l] = d1 * static_cast<float>((q[l] & 0xF) + hi) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const int hi = T == kQ5_K ? ((qh[l] & u2) ? 16 : 0) : 0;
        y[l + 32] = d2 * static_cast<float>((q[l] >> 4) + hi) - m2;
      }
      y += 64;
      q += 32;
      u1 <<= 2;
      u2 <<= 2;
    }
  } else if constexpr (T == kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int n = 0; n < 256; n += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

template <int T>
inline void dequant_row_t(const uint8_t* row, int64_t k, float* __restrict y) {
  if constexpr (T == kF32) {
    std::memcpy(y, row, k * 4);
  } else if constexpr (T == kF16) {
    for (int64_t i = 0; i < k; ++i) y[i] = f16(row + 2 * i);
  } else if constexpr (T == kBF16) {
    for (int64_t i = 0; i < k; ++i) y[i] = bf16(row + 2 * i);
  } else {
    constexpr Format f = T == kQ4_0 ? Format{32, 18} : T == kQ4_1 ? Format{32, 20} : T == kQ5_0 ? Format{32, 22}
                       : T == kQ5_1 ? Format{32, 24} : T == kQ8_0 ? Format{32, 34} : T == kQ2_K ? Format{256, 84}
                       : T == kQ3_K ? Format{256, 110} : T == kQ4_K ? Format{256, 144} : T == kQ5_K ? Format{256, 176}
                                                                                          : Format{256, 210};
    for (int64_t i = 0; i < k / f.elems; ++i) dequant_block<T>(row + i * f.bytes, y + i * f.elems);
  }
}

// Calls fn.template operator()<T>() with the compile-time type T of the runtime id t.
template <typename Fn>
inline void dispatch(int64_t t, Fn&& fn) {
  switch (t) {
    case kF32: fn.template operator()<kF32>(); break;
    case kF16: fn.template operator()<kF16>(); break;
    case kBF16: fn.template operator()<kBF16>(); break;
    case kQ4_0: fn.template operator()<kQ4_0>(); break;
    case kQ4_1: fn.template operator()<kQ4_1>(); break;
    case kQ5_0: fn.template operator()<kQ5_0>(); break;
    case kQ5_1: fn.template operator()<kQ5_1>(); break;
    case kQ8_0: fn.template operator()<kQ8_0>(); break;
    case kQ2_K: fn.template operator()<kQ2_K>(); break;
    case kQ3_K: fn.template operator()<kQ3_K>(); break;
    case kQ4_K: fn.template operator()<kQ4_K>(); break;
    case kQ5_K: fn.template operator()<kQ5_K>(); break;
    case kQ6_K: fn.template operator()<kQ6_K>(); break;
    default: TORCH_CHECK(false, "gguf: unsupported block type id ", t);
  }
}

inline void dequant_row(int64_t t, const uint8_t* row, int64_t k, float* y) {
  dispatch(t, [&]<int T>() { dequant_row_t<T>(row, k, y); });
}

// ---- dot products of one weight row with up to kSmallM rows of x (float32, row stride ldx) ----

inline float dot(const float* a, const float* b, int64_t k) {
  int64_t i = 0;
  float s = 0.0f;
#if defined(PAGEDLLM_AVX512)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= k; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(PAGEDLLM_AVX2)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= k; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

// Whether rows of type T have a register (fused) GEMV on this build.
template <int T>
constexpr bool has_fused() {
#if defined(PAGEDLLM_AVX2)
  return T == kQ4_0 || T == kQ4_1 || T == kQ8_0 || T == kQ5_0 || T == kQ5_1;
#else
  return false;
#endif
}

#if defined(PAGEDLLM_AVX512)
using vf = __m512;
constexpr int kLanes = 16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
// 16 bytes -> 16 floats of their low nibbles (lo) and high nibbles (hi).
inline void nibbles16(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, m));
  hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m));
}
// The 32 weights of block b (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) as w[0..1] (16 lanes each).
template <int T>
inline void load_block(const uint8_t* b, vf* w) {
  if constexpr (T == kQ8_0) {
    const vf d = vset(f16(b));
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), d);
  } else {
    const vf d = vset(f16(b));
    const int qoff = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    __m512i lo, hi;
    nibbles16(b + qoff, lo, hi);
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      uint32_t qh;
      std::memcpy(&qh, b + qoff - 4, 4);
      const __m512i sixteen = _mm512_set1_epi32(16);
      lo = _mm512_mask_or_epi32(lo, static_cast<__mmask16>(qh & 0xFFFF), lo, sixteen);
      hi = _mm512_mask_or_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen);
    }
    if constexpr (T == kQ4_1 || T == kQ5_1) {
      const vf m = vset(f16(b + 2));
      w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m);
      w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m);
    } else {
      const __m512i off = _mm512_set1_epi32(T == kQ4_0 ? 8 : 16);
      w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off)), d);
      w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off)), d);
    }
  }
}
constexpr int kBlockVecs = 2;
#elif defined(PAGEDLLM_AVX2)
using vf = __m256;
constexpr int kLanes = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline float vsum(vf v) { return hsum(v); }
template <int T>
inline void load_block(const uint8_t* b, vf* w) {
  const vf d = vset(f16(b));
  if constexpr (T == kQ8_0) {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * i)))), d);
  } else {
    const int qoff = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qoff));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, m), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
    __m256i v[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), _mm256_cvtepu8_epi32(hi),
                    _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      uint32_t qh;
      std::memcpy(&qh, b + qoff - 4, 4);
      const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      for (int i = 0; i < 4; ++i) {  // bit 8i + j of qh is the fifth bit of element 8i + j
        const __m256i h = _mm256_set1_epi32(static_cast<int>((qh >> (8 * i)) & 0xFF));
        const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(h, bit), bit);
        v[i] = _mm256_or_si256(v[i], _mm256_and_si256(set, _mm256_set1_epi32(16)));
      }
    }
    if constexpr (T == kQ4_1 || T == kQ5_1) {
      const vf mn = vset(f16(b + 2));
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[i]), d, mn);
    } else {
      const __m256i off = _mm256_set1_epi32(T == kQ4_0 ? 8 : 16);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v[i], off)), d);
    }
  }
}
constexpr int kBlockVecs = 4;
#endif

#if defined(PAGEDLLM_AVX2)
// y[m][n] for rows n of W in [n0, n1), every block dequantized into registers once for all M
// rows of x (M <= kSmallM).
template <int T, int M>
inline void gemv_fused(const uint8_t* w, int64_t row_bytes, const float* x, int64_t ldx, int64_t k, int64_t n0,
                       int64_t n1, float* y, int64_t ldy) {
  const int64_t nb = k / 32;
  constexpr int64_t bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : 34;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    vf acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = vzero();
    for (int64_t i = 0; i < nb; ++i) {
      if ((i & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + (i + 16) * bytes), _MM_HINT_T0);
      vf wv[kBlockVecs];
      load_block<T>(row + i * bytes, wv);
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * ldx + i * 32;
        for (int v = 0; v < kBlockVecs; ++v) acc[m][v & 1] = vfma(wv[v], vload(xm + v * kLanes), acc[m][v & 1]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * ldy + n] = vsum(acc[m][0]) + vsum(acc[m][1]);
  }
}
#endif

// Rows [n0, n1) of W through an L1 row buffer (every type).
template <int T>
inline void gemv_buffered(const uint8_t* w, int64_t row_bytes, const float* x, int64_t ldx, int64_t m_rows,
                          int64_t k, int64_t n0, int64_t n1, float* y, int64_t ldy, float* buf) {
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row_t<T>(w + n * row_bytes, k, buf);
    for (int64_t m = 0; m < m_rows; ++m) y[m * ldy + n] = dot(buf, x + m * ldx, k);
  }
}

// This thread's contiguous share of [0, n), in multiples of `align`.
inline void thread_range(int64_t n, int64_t align, int64_t& lo, int64_t& hi) {
  const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t units = (n + align - 1) / align;
  lo = std::min(n, (units * t / nt) * align);
  hi = std::min(n, (units * (t + 1) / nt) * align);
}

inline void check_weight(const at::Tensor& w, int64_t t, int64_t k) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "gguf: weight must be contiguous uint8 [N, row_bytes]");
  const Format f = format(t);
  TORCH_CHECK(k % f.elems == 0, "gguf: K = ", k, " is not a multiple of the block size ", f.elems);
  TORCH_CHECK(w.size(1) == k / f.elems * f.bytes, "gguf: weight rows have ", w.size(1), " bytes, type ", t, " x K = ",
              k, " needs ", k / f.elems * f.bytes);
}

// out[M, N] (float32 or bf16, any row stride, unit column stride) = x[M, K] W^T.
inline void linear(at::Tensor out, at::Tensor x, at::Tensor w, int64_t t) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "gguf_linear: x and out must be 2-d");
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0);
  check_weight(w, t, k);
  TORCH_CHECK(out.size(0) == m_rows && out.size(1) == n && out.stride(1) == 1, "gguf_linear: out must be [M, N] with unit column stride");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "gguf_linear: out must be float32 or bf16");
  if (m_rows == 0 || n == 0) return;
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  if (m_rows > kSmallM) {  // dequantized tiles through the float32 GEMM
    const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(n, (1 << 20) / (4 * k)));
    at::Tensor buf = at::empty({tile, k}, xf.options());
    at::Tensor acc = at::empty({m_rows, tile}, xf.options());
    for (int64_t n0 = 0; n0 < n; n0 += tile) {
      const int64_t nt = std::min(tile, n - n0);
      float* bp = buf.data_ptr<float>();
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < nt; ++r) dequant_row(t, wp + (n0 + r) * row_bytes, k, bp + r * k);
      at::Tensor a = acc.narrow(1, 0, nt);
      at::mm_out(a, xf, buf.narrow(0, 0, nt).t());
      out.narrow(1, n0, nt).copy_(a);
    }
    return;
  }
  const bool direct = out.scalar_type() == at::kFloat;
  at::Tensor yf = direct ? out : at::empty({m_rows, n}, xf.options());
  float* yp = yf.data_ptr<float>();
  const int64_t ldy = yf.stride(0);
  dispatch(t, [&]<int T>() {
#pragma omp parallel
    {
      int64_t lo, hi;
      thread_range(n, 8, lo, hi);
      if (lo < hi) {
#if defined(PAGEDLLM_AVX2)
        if constexpr (has_fused<T>()) {
          switch (m_rows) {
            case 1: gemv_fused<T, 1>(wp, row_bytes, xp, k, k, lo, hi, yp, ldy); break;
            case 2: gemv_fused<T, 2>(wp, row_bytes, xp, k, k, lo, hi, yp, ldy); break;
            case 3: gemv_fused<T, 3>(wp, row_bytes, xp, k, k, lo, hi, yp, ldy); break;
            default: gemv_fused<T, 4>(wp, row_bytes, xp, k, k, lo, hi, yp, ldy); break;
          }
        } else
#endif
        {
          std::vector<float> rowbuf(k);
          gemv_buffered<T>(wp, row_bytes, xp, k, m_rows, k, lo, hi, yp, ldy, rowbuf.data());
        }
      }
    }
  });
  if (!direct) out.copy_(yf);
}

// float32 [len(rows), K]: rows of W dequantized (embedding lookups, tests).
inline at::Tensor dequantize(at::Tensor w, int64_t t, at::Tensor rows, int64_t k) {
  check_weight(w, t, k);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "gguf_dequantize: rows must be int64 [R]");
  const at::Tensor r = rows.contiguous();
  const int64_t nr = r.size(0), n = w.size(0), row_bytes = w.size(1);
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < nr; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < n, "gguf_dequantize: row ", rp[i], " out of range [0, ", n, ")");
  at::Tensor y = at::empty({nr, k}, at::TensorOptions().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static) if (nr * k > 65536)
  for (int64_t i = 0; i < nr; ++i) dequant_row(t, wp + rp[i] * row_bytes, k, yp + i * k);
  return y;
}

}  // namespace gguf
}  // namespace pagedllm
