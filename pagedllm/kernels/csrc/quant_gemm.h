// y[M, N] = x[M, K] W[N, K]^T (+ bias) with W quantized (int8, int4 or fp8 codes, float32 group
// scales and zero points: W[n, k] = (q[n, k] - z[n, g]) s[n, g], g = k / group_size), the weight
// never made dense: codes are widened in registers and multiplied in float32 (weight-only,
// W8A16 / W4A16 / FP8-W), or -- quant_gemm_i8.h -- multiplied as int8 x int8 (W8A8).
//
// Layout, made once at load by pack_quantized_weight (quantization/qgemm.py prepare()): the
// checkpoint's bytes transposed into 16-column panels, zero past N,
//
//   int8 / fp8:  [ceil(N/16), K, 16]      packed[p, k, j] = q[16p + j, k]
//   int4:        [ceil(N/16), K/2, 16]    packed[p, i, j] = q[16p + j, 2i] | q[16p + j, 2i + 1] << 4
//
// so each k (int4: k pair) of a panel is one 16-byte line and a panel streams front to back.
// Scales and zero points are panel-major float32 [ceil(N/16), G, 16]: sc = s, zp = z (fp8: 256 s
// and z / 256, since the fp8 codes are widened through fp16 bits as value / 256). zp is absent
// when every zero point is the kind's default (Weights::zc): 0 for int8 / fp8, 8 for int4 (the
// symmetric GPTQ / AWQ codes), so symmetric int4 streams no zero points.
//
// Per weight group the microkernel sums the products of x and the raw codes, part = x . q, and
// then applies the group once: acc += sc (part - zp xsum), with xsum the group's sum of x. A
// decode step (batch 1) is bound by reading the weights, so it reads 1 byte per int8/fp8 weight
// and half a byte per int4 weight instead of bf16's 2.
//
// Paths, fixed by the ISA macros of vec.h: avx512 (R x NP tiles of 16-column zmm accumulators,
// codes widened with vpmovsxbd / vpmovzxbd / vcvtph2ps), avx2 (the same with 2 ymm per panel),
// scalar loops. With AVX512-BF16 and bf16 x, batches (M > kR) widen each chunk of codes once into
// exact bf16 pairs for vdpbf16ps (run_blocked), and on CPUs that also have AVX512-VBMI (checked at
// run time) int4 codes become bf16 pairs in 2.25 instructions per 16-byte line, which a single
// bf16 row (decode) multiplies directly, panel by panel (panel1_int4_dp), each thread over ranges
// of consecutive panels that it reads as one sequential stream (for_panel_ranges). Otherwise
// work is handed out as groups of NP panels, every row of x per group, dynamically over OpenMP
// threads as the dense packed GEMM does.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "packed_gemm.h"
#include "vec.h"

namespace pagedllm {
namespace qgemm {

constexpr int64_t kPanel = 16;
constexpr int64_t kChunk = 256;  // most k summed before a group's scale is applied (even)
enum Kind : int { kInt8 = 0, kInt4 = 1, kFp8 = 2 };

// An fp8 e4m3fn byte as float, divided by 256 (what the vector paths' fp16 widening yields).
inline float fp8_over_256(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9 - 8) : std::ldexp(1.0f + m / 8.0f, e - 7 - 8);
  return (b & 0x80) ? -mag : mag;
}

inline int64_t chunks_per_group(int64_t gs) { return (gs + kChunk - 1) / kChunk; }
inline int64_t chunk_begin(int64_t gs, int64_t c) {
  return (c / chunks_per_group(gs)) * gs + (c % chunks_per_group(gs)) * kChunk;
}
inline int64_t chunk_end(int64_t gs, int64_t c) {
  return std::min(chunk_begin(gs, c) + kChunk, (c / chunks_per_group(gs) + 1) * gs);
}

struct Weights {  // one prepared weight (see the top of the file)
  int kind;
  const uint8_t* packed;
  const float* sc;  // [P, G, 16]
  const float* zp;  // [P, G, 16] zero points (fp8: z / 256) or null: then zc for every group
  int64_t N, K, gs, G;
  float zc;  // the zero point without zp: 8 for int4 (codes 0..15 around 8), else 0
  int64_t panel_bytes() const { return (kind == kInt4 ? K / 2 : K) * kPanel; }
  // K is summed in chunks: the groups, cut into pieces of at most kChunk (one group per chunk,
  // each chunk's sum scaled by its group's scale); xs holds x's sum per row and chunk.
  int64_t chunks_per_group() const { return qgemm::chunks_per_group(gs); }
  int64_t chunks() const { return G * chunks_per_group(); }
  int64_t chunk_begin(int64_t c) const { return qgemm::chunk_begin(gs, c); }
  int64_t chunk_end(int64_t c) const { return qgemm::chunk_end(gs, c); }
  // Panel p's codes, and its scales and zero points ([G, 16] each; zero points null when absent).
  const uint8_t* codes(int64_t p) const { return packed + p * panel_bytes(); }
  const float* scales(int64_t p) const { return sc + p * G * 16; }
  const float* zeros(int64_t p) const { return zp != nullptr ? zp + p * G * 16 : nullptr; }
};

#ifdef PAGEDLLM_AVX512
constexpr int kR = 4;   // rows of x per microkernel call (2 x kR x kNP accumulators)
constexpr int kNP = 2;  // panels per call
constexpr int kNP1 = 4; // panels per call when x has one row
constexpr int64_t kAhead = 64;  // k (int4: k pairs) a streamed panel is prefetched ahead: 1 KB

inline __m512 codes_i8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// e4m3 -> fp16 bits (value / 256) -> float32, exact: the byte sign-extended to 16 bits and
// shifted left by 7 puts the sign at bit 15 and exponent and mantissa at bits 7..13 (a copy of
// the sign at bit 14 is cleared).
inline __m512 codes_fp8(const uint8_t* p) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<short>(0xBF80))));
}

// fn(p0, p1) over ranges of consecutive panels [0, panels) on the OpenMP threads: each thread
// takes the next range while any is left, of a quarter of what is left per thread (whole
// weights split evenly while the threads keep pace, small ranges at the end), at most kRangeBytes
// of weight (a thread woken late, or descheduled on a busy machine, holds back at most that
// much), at least one panel. A range is read as one sequential stream by the one-row kernels.
constexpr int64_t kRangeBytes = 512 << 10;
template <typename Fn>
void for_panel_ranges(int64_t panels, int64_t panel_bytes, const Fn& fn) {
  const int64_t cap = std::max<int64_t>(1, kRangeBytes / std::max<int64_t>(1, panel_bytes));
  std::atomic<int64_t> next{0};
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads();
    int64_t p0 = next.load(std::memory_order_relaxed), take = 0;
    for (;;) {
      do {
        take = std::clamp<int64_t>((panels - p0) / (4 * nt), 1, cap);
      } while (p0 < panels && !next.compare_exchange_weak(p0, p0 + take, std::memory_order_relaxed));
      if (p0 >= panels) break;
      fn(p0, std::min(panels, p0 + take));
      p0 = next.load(std::memory_order_relaxed);
    }
  }
}

#ifndef PAGEDLLM_QGEMM_AHEAD1
#define PAGEDLLM_QGEMM_AHEAD1 4096
#endif
constexpr int64_t kAheadBytes1 = PAGEDLLM_QGEMM_AHEAD1;  // how far panel1_int4_dp prefetches

// y[i, 0:cols] = tile rows i < R of x (row stride ldx, float32, K) times NP panels of w, group
// by group, + bias; out float32 or bf16 (row stride ldy).
template <int KIND, int R, int NP, typename O>
void micro(const Weights& w, int64_t p, const float* x, int64_t ldx, const float* xs, O* y, int64_t ldy,
           const float* bias, int64_t cols) {
  const int64_t pb = w.panel_bytes(), G = w.G;
  const uint8_t* base = w.packed + p * pb;
  const float* sc = w.sc + p * G * kPanel;
  const float* zp = w.zp != nullptr ? w.zp + p * G * kPanel : nullptr;
  __m512 acc[R][NP];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t C = w.chunks();
  for (int64_t c = 0; c < C; ++c) {
    __m512 part[R][NP];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) part[i][j] = _mm512_setzero_ps();
    const int64_t k0 = w.chunk_begin(c), k1 = w.chunk_end(c), g = c / w.chunks_per_group();
    if constexpr (KIND == kInt4) {
      for (int64_t k = k0; k < k1; k += 2) {
        __m512 lo[NP], hi[NP];
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          if (k % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(base + j * pb + (k / 2 + kAhead) * kPanel), _MM_HINT_T0);
          const __m512i v = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + j * pb + (k / 2) * kPanel)));
          lo[j] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
          hi[j] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          const __m512 a0 = _mm512_set1_ps(x[i * ldx + k]), a1 = _mm512_set1_ps(x[i * ldx + k + 1]);
#pragma GCC unroll 4
          for (int j = 0; j < NP; ++j) part[i][j] = _mm512_fmadd_ps(a1, hi[j], _mm512_fmadd_ps(a0, lo[j], part[i][j]));
        }
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        __m512 wv[NP];
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(base + j * pb + (k + kAhead) * kPanel), _MM_HINT_T0);
          wv[j] = KIND == kInt8 ? codes_i8(base + j * pb + k * kPanel) : codes_fp8(base + j * pb + k * kPanel);
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 4
          for (int j = 0; j < NP; ++j) part[i][j] = _mm512_fmadd_ps(a, wv[j], part[i][j]);
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      if (zp != nullptr || w.zc != 0.0f) {
        const __m512 z = zp != nullptr ? _mm512_loadu_ps(zp + (j * G + g) * kPanel) : _mm512_set1_ps(w.zc);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) part[i][j] = _mm512_fnmadd_ps(z, _mm512_set1_ps(xs[i * C + c]), part[i][j]);
      }
      const __m512 s = _mm512_loadu_ps(sc + (j * G + g) * kPanel);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(part[i][j], s, acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const __mmask16 m = lanes16(cols - j * kPanel);
    const __m512 b = bias != nullptr ? load16(bias + j * kPanel, m) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) store16(y + i * ldy + j * kPanel, _mm512_add_ps(acc[i][j], b), m);
  }
}

// Batches of more than kR rows: each chunk of a task's panels is widened once into an L1 buffer
// (float32, or with bf16 x on AVX512-BF16 exact bf16 codes paired for vdpbf16ps) and every row
// tile of x multiplies it, instead of widening the codes again for each row tile.
constexpr int kBR = 8;   // rows per blocked microkernel call
constexpr int kBNP = 3;  // panels per blocked task
constexpr int64_t kBW = kBNP * kPanel;  // buffer row width

// The codes of k pair q (k = 2q, 2q + 1) of a panel as two float32 vectors.
template <int KIND>
inline void codes_pair(const uint8_t* panel, int64_t q, __m512& even, __m512& odd) {
  if constexpr (KIND == kInt4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + q * kPanel)));
    even = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else if constexpr (KIND == kInt8) {
    even = codes_i8(panel + 2 * q * kPanel);
    odd = codes_i8(panel + (2 * q + 1) * kPanel);
  } else {
    even = codes_fp8(panel + 2 * q * kPanel);
    odd = codes_fp8(panel + (2 * q + 1) * kPanel);
  }
}

// The codes of k pair q of a panel as 16 bf16 pairs (lane j: column j's codes of k = 2q in the
// low half, 2q + 1 in the high half), exact: every code has at most 8 significant bits.
// int4: each byte zero-extended to a 32-bit lane d, d | d << 12 puts the low nibble in bits 0..3
// of the low half and the high nibble in the high half, and one vpermw looks both up in a
// 32-entry table of bf16(i & 15) (vpermw reads an index's low 5 bits). int8 / fp8: both k widened
// to float32 as in codes_pair and the upper halves (their bf16 bits, exact) interleaved by one
// vpermt2w.
template <int KIND>
inline __m512i bf16_pairs(const uint8_t* panel, int64_t q) {
  if constexpr (KIND == kInt4) {
    const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                                           0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
                                           0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                                           0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + q * kPanel)));
    return _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table);
  } else {
    __m512 e, o;
    codes_pair<KIND>(panel, q, e, o);
    // word 2j: the high half of e's lane j (word 2j + 1), word 2j + 1: o's (32 + 2j + 1)
    const __m512i idx = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
                                         47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(e), idx, _mm512_castps_si512(o));
  }
}

// vpermi2b indices for int4_pairs4: line i of a 64-byte block v (4 pair lines) and its copy s
// shifted right by 4 bits: byte 4j <- byte j of line i of v (low nibble in bits 0..3), byte 4j + 2
// <- the same byte of s (high nibble in bits 0..3); bytes 4j + 1 and 4j + 3 are zeroed by a mask.
struct Int4PairIdx {
  alignas(64) uint8_t idx[4][64];
  Int4PairIdx() {
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 16; ++j) {
        idx[i][4 * j] = static_cast<uint8_t>(16 * i + j);
        idx[i][4 * j + 1] = 0;
        idx[i][4 * j + 2] = static_cast<uint8_t>(64 + 16 * i + j);
        idx[i][4 * j + 3] = 0;
      }
  }
};

#ifdef PAGEDLLM_AVX512_BF16
inline bool has_vbmi() {
  static const bool yes = __builtin_cpu_supports("avx512vbmi");
  return yes;
}

// int4 pair lines [q0, q1) of one panel as bf16 pairs into out (row stride kBW int32), 4 lines
// (64 bytes) at a time: one shift for the 4 lines, then per line one vpermi2b (each byte's low
// nibble into bits 0..3 of its lane's low half, its high nibble into bits 0..3 of the high half)
// and one vpermw lookup in bf16_pairs's table -- 2.25 instructions per line instead of 4. Returns
// the first line not done (a tail of fewer than 4 lines). AVX512-VBMI (vpermi2b), compiled with a
// target attribute and called only where the CPU has it.
__attribute__((target("avx512vbmi"))) inline int64_t int4_pairs4(const uint8_t* panel, int64_t q0, int64_t q1,
                                                                 int32_t* out) {
  static const Int4PairIdx ix;
  const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                                         0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160,
                                         0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                                         0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  const __m512i i0 = _mm512_load_si512(ix.idx[0]), i1 = _mm512_load_si512(ix.idx[1]);
  const __m512i i2 = _mm512_load_si512(ix.idx[2]), i3 = _mm512_load_si512(ix.idx[3]);
  constexpr __mmask64 even = 0x5555555555555555ULL;
  int64_t q = q0;
  for (; q + 4 <= q1; q += 4) {
    const __m512i v = _mm512_loadu_si512(panel + q * kPanel);
    const __m512i s = _mm512_srli_epi16(v, 4);
    int32_t* o = out + (q - q0) * kBW;
    _mm512_storeu_si512(o, _mm512_permutexvar_epi16(_mm512_maskz_permutex2var_epi8(even, v, i0, s), table));
    _mm512_storeu_si512(o + kBW, _mm512_permutexvar_epi16(_mm512_maskz_permutex2var_epi8(even, v, i1, s), table));
    _mm512_storeu_si512(o + 2 * kBW, _mm512_permutexvar_epi16(_mm512_maskz_permutex2var_epi8(even, v, i2, s), table));
    _mm512_storeu_si512(o + 3 * kBW, _mm512_permutexvar_epi16(_mm512_maskz_permutex2var_epi8(even, v, i3, s), table));
  }
  return q;
}
#endif

// Codes of panels [p, p + np) for k in [k0, k1) (both even) into buf: float32 rows of kBW per k,
// or (PAIRS) int32 rows of kBW per k pair, each lane two bf16 codes (exact: at most 8
// significant bits), panel j at column 16 j.
template <int KIND, bool PAIRS>
void widen_chunk(const Weights& w, int64_t p, int64_t np, int64_t k0, int64_t k1, void* buf) {
  const int64_t pb = w.panel_bytes();
  constexpr int64_t lpq = KIND == kInt4 ? 1 : 2;  // 16-byte lines per k pair
  for (int64_t j = 0; j < np; ++j) {
    const uint8_t* panel = w.packed + (p + j) * pb;
    // the chunk after next on its way to L2 while this one is multiplied, one 64-byte line per 4
    // lines (a prefetch past the weight's end is harmless: prefetches never fault)
    for (int64_t l = (k0 / 2 + kChunk / 2) * lpq; l < (k1 / 2 + kChunk / 2) * lpq; l += 4)
      _mm_prefetch(reinterpret_cast<const char*>(panel + l * kPanel), _MM_HINT_T1);
    int64_t q = k0 / 2;
#ifdef PAGEDLLM_AVX512_BF16
    if constexpr (PAIRS && KIND == kInt4)
      if (has_vbmi()) q = int4_pairs4(panel, q, k1 / 2, static_cast<int32_t*>(buf) + j * kPanel);
#endif
    for (; q < k1 / 2; ++q) {
      if constexpr (PAIRS) {
        _mm512_storeu_si512(static_cast<int32_t*>(buf) + (q - k0 / 2) * kBW + j * kPanel, bf16_pairs<KIND>(panel, q));
      } else {
        __m512 e, o;
        codes_pair<KIND>(panel, q, e, o);
        float* f = static_cast<float*>(buf) + (2 * q - k0) * kBW + j * kPanel;
        _mm512_storeu_ps(f, e);
        _mm512_storeu_ps(f + kBW, o);
      }
    }
  }
}

#ifdef PAGEDLLM_AVX512_BF16
// One panel of int4 codes times one row of bf16 x (int32 bf16 pairs xb), on CPUs with
// AVX512-VBMI: the pairs made as in int4_pairs4 and multiplied with vdpbf16ps. The panel's bytes
// are read front to back as one stream (8 lines per step, 8 accumulators for the vdpbf16ps
// chains), prefetched kAheadBytes1 ahead: consecutive panels are contiguous, so a thread that
// runs a range of panels reads one sequential stream, which the hardware prefetchers follow
// across panel ends. Without zero points (int4 symmetric around 8: w.zc) the table gives
// bf16(code - 8) instead of bf16(code), so no group needs the x-sum correction (and no zero points
// are read). The products are exact (bf16 x times integers of at most 4 bits), the sums float32.
template <typename O>
__attribute__((target("avx512vbmi"))) void panel1_int4_dp(const Weights& w, int64_t p, const int32_t* xb,
                                                          const float* xs, O* y, const float* bias, int64_t cols) {
  static const Int4PairIdx ix;
  // vpermw reads 5 index bits: bit 4 is the other nibble's low bit, so each table is there twice
  const __m512i table = w.zp != nullptr
      ? _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                         0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                         0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000)
      : _mm512_set_epi16(0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040,
                         0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000,
                         0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100);
  const __m512i i0 = _mm512_load_si512(ix.idx[0]), i1 = _mm512_load_si512(ix.idx[1]);
  const __m512i i2 = _mm512_load_si512(ix.idx[2]), i3 = _mm512_load_si512(ix.idx[3]);
  constexpr __mmask64 even = 0x5555555555555555ULL;
  const int64_t C = w.chunks();
  const uint8_t* base = w.codes(p);
  const float* sc = w.scales(p);
  const float* zp = w.zeros(p);
#define pairs(v, s, idx) (__m512bh) _mm512_permutexvar_epi16(_mm512_maskz_permutex2var_epi8(even, v, idx, s), table)
#define bx(q) (__m512bh) _mm512_set1_epi32(xb[q])
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const int64_t q0 = w.chunk_begin(c) / 2, q1 = w.chunk_end(c) / 2, g = c / w.chunks_per_group();
    __m512 a[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
    int64_t q = q0;
    for (; q + 8 <= q1; q += 8) {
      const uint8_t* line = base + q * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(line + kAheadBytes1), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(line + 64 + kAheadBytes1), _MM_HINT_T0);
      const __m512i v0 = _mm512_loadu_si512(line), s0 = _mm512_srli_epi16(v0, 4);
      const __m512i v1 = _mm512_loadu_si512(line + 64), s1 = _mm512_srli_epi16(v1, 4);
      a[0] = _mm512_dpbf16_ps(a[0], pairs(v0, s0, i0), bx(q));
      a[1] = _mm512_dpbf16_ps(a[1], pairs(v0, s0, i1), bx(q + 1));
      a[2] = _mm512_dpbf16_ps(a[2], pairs(v0, s0, i2), bx(q + 2));
      a[3] = _mm512_dpbf16_ps(a[3], pairs(v0, s0, i3), bx(q + 3));
      a[4] = _mm512_dpbf16_ps(a[4], pairs(v1, s1, i0), bx(q + 4));
      a[5] = _mm512_dpbf16_ps(a[5], pairs(v1, s1, i1), bx(q + 5));
      a[6] = _mm512_dpbf16_ps(a[6], pairs(v1, s1, i2), bx(q + 6));
      a[7] = _mm512_dpbf16_ps(a[7], pairs(v1, s1, i3), bx(q + 7));
    }
    if (q + 4 <= q1) {
      const __m512i v0 = _mm512_loadu_si512(base + q * kPanel), s0 = _mm512_srli_epi16(v0, 4);
      a[0] = _mm512_dpbf16_ps(a[0], pairs(v0, s0, i0), bx(q));
      a[1] = _mm512_dpbf16_ps(a[1], pairs(v0, s0, i1), bx(q + 1));
      a[2] = _mm512_dpbf16_ps(a[2], pairs(v0, s0, i2), bx(q + 2));
      a[3] = _mm512_dpbf16_ps(a[3], pairs(v0, s0, i3), bx(q + 3));
      q += 4;
    }
    for (; q < q1; ++q) {  // a group of fewer than 4 pairs left: one line as in bf16_pairs
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + q * kPanel)));
      a[4] = _mm512_dpbf16_ps(a[4], (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table), bx(q));
    }
    __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                             _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
    if (zp != nullptr) t = _mm512_fnmadd_ps(_mm512_loadu_ps(zp + g * kPanel), _mm512_set1_ps(xs[c]), t);
    acc = _mm512_fmadd_ps(t, _mm512_loadu_ps(sc + g * kPanel), acc);
  }
#undef pairs
#undef bx
  const __mmask16 m = lanes16(cols);
  store16(y, _mm512_add_ps(acc, bias != nullptr ? load16(bias, m) : _mm512_setzero_ps()), m);
}
#endif

// c[i, 0:16 NP] += sc (part - zp xs[i]) for one chunk's R x NP partial sums.
template <int R, int NP>
inline void add_chunk(const __m512 (&part)[R][NP], float* c, const float* sc, const float* zp, float zc,
                      int64_t gstride, const float* xs, int64_t xstride) {
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const __m512 s = _mm512_loadu_ps(sc + j * gstride);
    const __m512 z = zp != nullptr ? _mm512_loadu_ps(zp + j * gstride) : _mm512_set1_ps(zc);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      __m512 t = part[i][j];
      if (zp != nullptr || zc != 0.0f) t = _mm512_fnmadd_ps(z, _mm512_set1_ps(xs[i * xstride]), t);
      float* ci = c + i * kBW + j * kPanel;
      _mm512_storeu_ps(ci, _mm512_fmadd_ps(t, s, _mm512_loadu_ps(ci)));
    }
  }
}

// The loop nest of the blocked microkernels: part[i][j] (zeroed first) = mac over u < ku of the
// broadcast a[i * lda + u] (row i of x: a float, or an int32 pair) and the buffer's vector
// b[u * kBW + 16 j] (a k, or a k pair, of panel j).
template <int R, int NP, typename V, typename A, typename B, typename Load, typename Bcast, typename Mac>
inline void bmicro(const A* a, int64_t lda, const B* b, int64_t ku, V (&part)[R][NP], V zero, const Load& load,
                   const Bcast& bcast, const Mac& mac) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) part[i][j] = zero;
  for (int64_t u = 0; u < ku; ++u) {
    decltype(load(b)) bv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) bv[j] = load(b + u * kBW + j * kPanel);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const auto av = bcast(a[i * lda + u]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) mac(part[i][j], av, bv[j]);
    }
  }
}

// part = rows i < R of x (float32, row stride lda) times the float32 buffer, kc k.
template <int R, int NP>
inline void bmicro_f32(const float* a, int64_t lda, const float* b, int64_t kc, __m512 (&part)[R][NP]) {
  bmicro<R, NP>(a, lda, b, kc, part, _mm512_setzero_ps(), [](const float* p) { return _mm512_loadu_ps(p); },
                [](float v) { return _mm512_set1_ps(v); },
                [](__m512& acc, __m512 x, __m512 w) { acc = _mm512_fmadd_ps(x, w, acc); });
}

#ifdef PAGEDLLM_AVX512_BF16
// The same with bf16 pairs: a holds rows of x as int32 bf16 pairs (row stride lda pairs), b the
// paired buffer, kc2 pairs.
template <int R, int NP>
inline void bmicro_dp(const int32_t* a, int64_t lda, const int32_t* b, int64_t kc2, __m512 (&part)[R][NP]) {
  bmicro<R, NP>(a, lda, b, kc2, part, _mm512_setzero_ps(),
                [](const int32_t* p) { return (__m512bh)_mm512_loadu_si512(p); },
                [](int32_t v) { return (__m512bh)_mm512_set1_epi32(v); },
                [](__m512& acc, __m512bh x, __m512bh w) { acc = _mm512_dpbf16_ps(acc, x, w); });
}
#endif

// y[m, n0 + 16 j ...] = the task's float32 rows c (row stride kBW) (times row m's scale rs[m *
// rs_stride] where rs is given) + bias, for np panels of cols columns from n0.
template <typename O>
inline void store_task(const float* c, int64_t M, int64_t np, int64_t cols, int64_t n0, const float* bias, O* y,
                       int64_t ldy, const float* rs = nullptr, int64_t rs_stride = 0) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < np; ++j) {
      const __mmask16 mk = lanes16(cols - j * kPanel);
      __m512 v = _mm512_loadu_ps(c + m * kBW + j * kPanel);
      const __m512 b = bias != nullptr ? load16(bias + n0 + j * kPanel, mk) : _mm512_setzero_ps();
      v = rs != nullptr ? _mm512_fmadd_ps(v, _mm512_set1_ps(rs[m * rs_stride]), b) : _mm512_add_ps(v, b);
      store16(y + m * ldy + n0 + j * kPanel, v, mk);
    }
}

// The blocked product: tasks of kBNP panels, every row, chunk by chunk. xb: x as bf16 pairs
// (null: float32 arithmetic on xf).
template <int KIND, typename O>
void run_blocked(const Weights& w, const float* xf, const int32_t* xb, int64_t M, const float* xs, O* y,
                 const float* bias) {
  const int64_t panels = (w.N + kPanel - 1) / kPanel, tasks = (panels + kBNP - 1) / kBNP;
  const int64_t C = w.chunks(), G = w.G, K = w.K;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    static thread_local std::vector<float> widened;
    if (widened.size() < static_cast<size_t>(kChunk * kBW)) widened.resize(kChunk * kBW);
    const int64_t p = t * kBNP, np = std::min<int64_t>(kBNP, panels - p), n0 = p * kPanel;
    const int64_t cols = std::min(np * kPanel, w.N - n0);
    float* c = gemm::task_buffer(M * kBW);
    std::fill(c, c + M * kBW, 0.0f);
    for (int64_t ch = 0; ch < C; ++ch) {
      const int64_t k0 = w.chunk_begin(ch), k1 = w.chunk_end(ch), g = ch / w.chunks_per_group();
      if (xb != nullptr) {
        widen_chunk<KIND, true>(w, p, np, k0, k1, widened.data());
      } else {
        widen_chunk<KIND, false>(w, p, np, k0, k1, widened.data());
      }
      const float* sc = w.sc + (p * G + g) * kPanel;
      const float* zp = w.zp != nullptr ? w.zp + (p * G + g) * kPanel : nullptr;
      for (int64_t m = 0; m < M; m += kBR) {
        gemm::upto<kBNP>(np, [&](auto qq) {
          gemm::upto<kBR>(std::min<int64_t>(kBR, M - m), [&](auto rr) {
            __m512 part[rr.value][qq.value];
#ifdef PAGEDLLM_AVX512_BF16
            if (xb != nullptr) {
              bmicro_dp<rr.value, qq.value>(xb + m * (K / 2) + k0 / 2, K / 2,
                                            reinterpret_cast<const int32_t*>(widened.data()), (k1 - k0) / 2, part);
            } else
#endif
            {
              bmicro_f32<rr.value, qq.value>(xf + m * K + k0, K, widened.data(), k1 - k0, part);
            }
            add_chunk<rr.value, qq.value>(part, c + m * kBW, sc, zp, w.zc, G * kPanel, xs != nullptr ? xs + m * C + ch : nullptr, C);
          });
        });
      }
    }
    store_task(c, M, np, cols, n0, bias, y, w.N);
  }
}
#elif defined(PAGEDLLM_AVX2)
constexpr int kR = 3;
constexpr int kNP = 1;
constexpr int kNP1 = 2;

// 8 codes (half a panel line) as float32.
template <int KIND>
inline __m256 codes8(const uint8_t* p) {
  if constexpr (KIND == kInt8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else {
    const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // as codes_fp8
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
  }
}

template <int KIND, int R, int NP, typename O>
void micro(const Weights& w, int64_t p, const float* x, int64_t ldx, const float* xs, O* y, int64_t ldy,
           const float* bias, int64_t cols) {
  constexpr int H = 2 * NP;  // 8-lane halves
  const int64_t pb = w.panel_bytes(), G = w.G;
  const uint8_t* base = w.packed + p * pb;
  const float* sc = w.sc + p * G * kPanel;
  const float* zp = w.zp != nullptr ? w.zp + p * G * kPanel : nullptr;
  __m256 acc[R][H];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) acc[i][h] = _mm256_setzero_ps();
  const int64_t C = w.chunks();
  for (int64_t c = 0; c < C; ++c) {
    __m256 part[R][H];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h) part[i][h] = _mm256_setzero_ps();
    const int64_t k0 = w.chunk_begin(c), k1 = w.chunk_end(c), g = c / w.chunks_per_group();
    if constexpr (KIND == kInt4) {
      for (int64_t k = k0; k < k1; k += 2) {
        __m256 lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(base + (h / 2) * pb + (k / 2) * kPanel + (h % 2) * 8)));
          lo[h] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
          hi[h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        }
        for (int i = 0; i < R; ++i) {
          const __m256 a0 = _mm256_set1_ps(x[i * ldx + k]), a1 = _mm256_set1_ps(x[i * ldx + k + 1]);
          for (int h = 0; h < H; ++h) part[i][h] = _mm256_fmadd_ps(a1, hi[h], _mm256_fmadd_ps(a0, lo[h], part[i][h]));
        }
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        __m256 wv[H];
        for (int h = 0; h < H; ++h) wv[h] = codes8<KIND>(base + (h / 2) * pb + k * kPanel + (h % 2) * 8);
        for (int i = 0; i < R; ++i) {
          const __m256 a = _mm256_set1_ps(x[i * ldx + k]);
          for (int h = 0; h < H; ++h) part[i][h] = _mm256_fmadd_ps(a, wv[h], part[i][h]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int64_t off = ((h / 2) * G + g) * kPanel + (h % 2) * 8;
      if (zp != nullptr || w.zc != 0.0f) {
        const __m256 z = zp != nullptr ? _mm256_loadu_ps(zp + off) : _mm256_set1_ps(w.zc);
        for (int i = 0; i < R; ++i) part[i][h] = _mm256_fnmadd_ps(z, _mm256_set1_ps(xs[i * C + c]), part[i][h]);
      }
      const __m256 s = _mm256_loadu_ps(sc + off);
      for (int i = 0; i < R; ++i) acc[i][h] = _mm256_fmadd_ps(part[i][h], s, acc[i][h]);
    }
  }
  alignas(32) float tile[8];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) {
      _mm256_store_ps(tile, acc[i][h]);
      for (int64_t e = 0; e < 8 && h * 8 + e < cols; ++e)
        y[i * ldy + h * 8 + e] = from_float<O>(tile[e] + (bias != nullptr ? bias[h * 8 + e] : 0.0f));
    }
}
#else
constexpr int kR = 4;
constexpr int kNP = 1;
constexpr int kNP1 = 1;

template <int KIND, int R, int NP, typename O>
void micro(const Weights& w, int64_t p, const float* x, int64_t ldx, const float* xs, O* y, int64_t ldy,
           const float* bias, int64_t cols) {
  const int64_t pb = w.panel_bytes(), G = w.G, C = w.chunks();
  for (int64_t n = 0; n < cols; ++n) {
    const uint8_t* col = w.packed + (p + n / kPanel) * pb + n % kPanel;
    const float* sc = w.sc + ((p + n / kPanel) * G) * kPanel + n % kPanel;
    const float* zp = w.zp != nullptr ? w.zp + ((p + n / kPanel) * G) * kPanel + n % kPanel : nullptr;
    for (int i = 0; i < R; ++i) {
      float acc = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t g = c / w.chunks_per_group();
        float part = 0.0f;
        for (int64_t k = w.chunk_begin(c); k < w.chunk_end(c); ++k) {
          float q;
          if (KIND == kInt8) {
            q = static_cast<float>(static_cast<int8_t>(col[k * kPanel]));
          } else if (KIND == kInt4) {
            const uint8_t b = col[(k / 2) * kPanel];
            q = static_cast<float>(k % 2 ? b >> 4 : b & 0xF);
          } else {
            q = fp8_over_256(col[k * kPanel]);
          }
          part += x[i * ldx + k] * q;
        }
        acc += sc[g * kPanel] * (part - (zp != nullptr ? zp[g * kPanel] * xs[i * C + c] : w.zc != 0.0f ? w.zc * xs[i * C + c] : 0.0f));
      }
      y[i * ldy + n] = from_float<O>(acc + (bias != nullptr ? bias[n] : 0.0f));
    }
  }
}
#endif

// The whole product: tasks of np panels (every row of x, kR rows per microkernel call).
template <int KIND, typename O>
void run(const Weights& w, const float* x, const int32_t* xb, int64_t M, const float* xs, O* y, const float* bias) {
#ifdef PAGEDLLM_AVX512
  if (M > kR && w.gs % 2 == 0) {
    run_blocked<KIND>(w, x, xb, M, xs, y, bias);
    return;
  }
#endif
#ifdef PAGEDLLM_AVX512_BF16
  if constexpr (KIND == kInt4) {
    if (M == 1 && xb != nullptr && has_vbmi()) {
      for_panel_ranges((w.N + kPanel - 1) / kPanel, w.panel_bytes(), [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * kPanel;
          panel1_int4_dp(w, p, xb, xs, y + n0, bias != nullptr ? bias + n0 : nullptr, std::min(kPanel, w.N - n0));
        }
      });
      return;
    }
  }
#endif
  (void)xb;
  const int64_t panels = (w.N + kPanel - 1) / kPanel;
  constexpr int NPmax = kNP1 > kNP ? kNP1 : kNP;
  const int64_t np = M == 1 ? kNP1 : kNP;
  const int64_t tasks = (panels + np - 1) / np;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t p = t * np, n0 = p * kPanel;
    const int64_t cols = std::min(np * kPanel, w.N - n0);
    const int64_t q = (cols + kPanel - 1) / kPanel;  // panels this task really has
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    for (int64_t m = 0; m < M; m += kR) {
      const int64_t r = std::min<int64_t>(kR, M - m);
      gemm::upto<NPmax>(q, [&](auto qq) {
        gemm::upto<kR>(r, [&](auto rr) {
          micro<KIND, rr.value, qq.value>(w, p, x + m * w.K, w.K, xs != nullptr ? xs + m * w.chunks() : nullptr, y + m * w.N + n0, w.N, b, cols);
        });
      });
    }
  }
}

}  // namespace qgemm
}  // namespace pagedllm

#include "quant_gemm_i16.h"  // int16 activations with AVX512-VNNI (uses the kernels above)

namespace pagedllm {

// packed[p, kk, j] = q[16 p + j, kk] for the bytes of q [N, KB] (zero past N): the panel layout
// of every kind (int4's KB = K / 2).
inline torch::Tensor pack_quantized_weight(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.element_size() == 1, "pack_quantized_weight: a [N, K] tensor of bytes expected");
  q = q.contiguous();
  const int64_t N = q.size(0), KB = q.size(1), panels = (N + qgemm::kPanel - 1) / qgemm::kPanel;
  auto out = torch::zeros({panels, KB, qgemm::kPanel}, q.options().dtype(at::kByte));
  const uint8_t* src = static_cast<const uint8_t*>(q.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t j = 0; j < qgemm::kPanel && p * qgemm::kPanel + j < N; ++j) {
      const uint8_t* row = src + (p * qgemm::kPanel + j) * KB;
      uint8_t* d = dst + p * KB * qgemm::kPanel + j;
      for (int64_t k = 0; k < KB; ++k) d[k * qgemm::kPanel] = row[k];
    }
  return out;
}

namespace qgemm {
// The int16 activations of a small product and their row scales and chunk sums (quant_linear's int16
// path): scratch of the calling thread, reused by its next call, instead of two tensors allocated
// and freed per product (~0.3 us each, 8 per decoder layer of a decode step). They never leave the
// call; products of more than kScratchElems activations take tensors, so the scratch stays small.
constexpr int64_t kScratchElems = 64 << 10;
struct I16Scratch {
  std::vector<int16_t> q;
  std::vector<float> s;
};
inline I16Scratch& i16_scratch() {
  thread_local I16Scratch scratch;
  return scratch;
}
}  // namespace qgemm

// x [M, K] float32 / bf16 as a float32 [M, K] copy in the weight's column order (perm: int64
// [K], x[:, perm]), and its sums per chunk [M, G * chunks_per_group] when the weight has zero
// points.
inline std::pair<torch::Tensor, torch::Tensor> gather_input(const torch::Tensor& x, const std::optional<torch::Tensor>& perm,
                                                          int64_t gs, bool sums) {
  const int64_t M = x.size(0), K = x.size(1), G = K / gs;
  const bool has_perm = perm.has_value() && perm->defined();
  torch::Tensor xf;
  if (!has_perm && x.scalar_type() == torch::kFloat32) {
    xf = x;
  } else {
    xf = torch::empty({M, K}, x.options().dtype(torch::kFloat32));
    const int64_t* pi = has_perm ? perm->data_ptr<int64_t>() : nullptr;
    float* d = xf.data_ptr<float>();
    const bool bf = x.scalar_type() == torch::kBFloat16;
    const void* s = x.data_ptr();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t src = m * K + (pi != nullptr ? pi[k] : k);
        d[m * K + k] = bf ? static_cast<float>(static_cast<const c10::BFloat16*>(s)[src]) : static_cast<const float*>(s)[src];
      }
  }
  torch::Tensor xs;
  if (sums) {
    const int64_t C = G * qgemm::chunks_per_group(gs);
    xs = torch::empty({M, C}, x.options().dtype(torch::kFloat32));
    const float* a = xf.data_ptr<float>();
    float* o = xs.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < C; ++c) {
        float s = 0.0f;
        for (int64_t k = qgemm::chunk_begin(gs, c); k < qgemm::chunk_end(gs, c); ++k) s += a[m * K + k];
        o[m * C + c] = s;
      }
  }
  return {xf, xs};
}

// y = x W^T (+ bias) for a weight packed by pack_quantized_weight: kind 0 int8 / 1 int4 / 2 fp8,
// sc / zp its panel-major scales and zero points (see the top of the file), perm the act-order column order; x
// float32 or bf16 [M, K], y in x's dtype.
// ``out``: where y goes (contiguous [M, N] of x's dtype), else a new tensor.
inline torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t kind, torch::Tensor sc,
                                  std::optional<torch::Tensor> zp, int64_t N, int64_t group_size,
                                  std::optional<torch::Tensor> perm, std::optional<torch::Tensor> bias,
                                  std::optional<torch::Tensor> out = std::nullopt) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "quant_linear: contiguous float32 or bfloat16 x [M, K] expected");
  TORCH_CHECK(kind >= 0 && kind <= 2, "quant_linear: kind 0 (int8), 1 (int4) or 2 (fp8) expected");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + qgemm::kPanel - 1) / qgemm::kPanel;
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && (kind != qgemm::kInt4 || group_size % 2 == 0),
              "quant_linear: group size ", group_size, " does not fit K = ", K);
  const int64_t G = K / group_size, kb = kind == qgemm::kInt4 ? K / 2 : K;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == panels && packed.size(1) == kb && packed.size(2) == qgemm::kPanel,
              "quant_linear: weight packed by pack_quantized_weight for this K and N expected");
  auto check_groups = [&](const torch::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == 3 && t.size(0) == panels &&
                    t.size(1) == G && t.size(2) == qgemm::kPanel,
                "quant_linear: ", what, " must be float32 [", panels, ", ", G, ", 16]");
  };
  check_groups(sc, "scales");
  const bool zeros = zp.has_value() && zp->defined();
  if (zeros) check_groups(*zp, "zero points");
  if (perm.has_value() && perm->defined())
    TORCH_CHECK(perm->scalar_type() == torch::kInt64 && perm->is_contiguous() && perm->numel() == K,
                "quant_linear: int64 permutation of K entries expected");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: float32 bias of N elements expected");
    b = bias->data_ptr<float>();
  }
  if (out.has_value())
    TORCH_CHECK(out->is_contiguous() && out->dim() == 2 && out->size(0) == M && out->size(1) == N &&
                    out->scalar_type() == x.scalar_type(), "quant_linear: out must be contiguous [M, N] of x's dtype");
  auto y = out.has_value() ? *out : torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float zc = kind == qgemm::kInt4 && !zeros ? 8.0f : 0.0f;  // int4 without zero points: 8
  const qgemm::Weights w{static_cast<int>(kind), packed.data_ptr<uint8_t>(), sc.data_ptr<float>(),
                         zeros ? zp->data_ptr<float>() : nullptr, N, K, group_size, G, zc};
#ifdef PAGEDLLM_AVX512
  if (x.scalar_type() == torch::kFloat32 && qgemm::int16_path(static_cast<int>(kind), group_size)) {
    const torch::Tensor xf = gather_input(x, perm, group_size, false).first;
    // small products (decode steps) quantize into the calling thread's scratch, larger ones into tensors
    int16_t* qp;
    float* sp;
    torch::Tensor q, s;
    if (M * K <= qgemm::kScratchElems) {
      qgemm::I16Scratch& scratch = qgemm::i16_scratch();
      scratch.q.resize(qgemm::kScratchElems);
      scratch.s.resize(std::max<size_t>(scratch.s.size(), M * (1 + w.chunks())));
      qp = scratch.q.data();
      sp = scratch.s.data();
    } else {
      q = torch::empty({M, K}, x.options().dtype(at::kShort));
      s = torch::empty({M * (1 + w.chunks())}, x.options());  // row scales, integer chunk sums
      qp = static_cast<int16_t*>(q.data_ptr());
      sp = s.data_ptr<float>();
    }
    qgemm::quantize_i16(xf.data_ptr<float>(), M, w, qp, sp, sp + M);
    const qgemm::Act16 a{reinterpret_cast<const int32_t*>(qp), sp, sp + M};
    float* yp = y.data_ptr<float>();
    if (kind == qgemm::kInt4) {
      qgemm::run_i16<qgemm::kInt4>(w, a, M, yp, b);
    } else {
      qgemm::run_i16<qgemm::kInt8>(w, a, M, yp, b);
    }
    return y;
  }
#endif
  auto [xf, xs] = gather_input(x, perm, group_size, zeros || zc != 0.0f);
  const float* xp = xf.data_ptr<float>();
  const float* xsp = xs.defined() ? xs.data_ptr<float>() : nullptr;
  // bf16 x of a batch on AVX512-BF16: its bf16 pairs (in the weight's column order) for vdpbf16ps
  torch::Tensor xb;
#ifdef PAGEDLLM_AVX512_BF16
  if (x.scalar_type() == torch::kBFloat16 && group_size % 2 == 0 &&
      (M > qgemm::kR || (M == 1 && kind == qgemm::kInt4 && qgemm::has_vbmi())))
    xb = (perm.has_value() && perm->defined()) ? xf.to(torch::kBFloat16) : x;  // exact: xf holds bf16 values
#endif
  const int32_t* xbp = xb.defined() ? reinterpret_cast<const int32_t*>(xb.data_ptr<c10::BFloat16>()) : nullptr;
  auto go = [&](auto out) {
    if (kind == qgemm::kInt8) {
      qgemm::run<qgemm::kInt8>(w, xp, xbp, M, xsp, out, b);
    } else if (kind == qgemm::kInt4) {
      qgemm::run<qgemm::kInt4>(w, xp, xbp, M, xsp, out, b);
    } else {
      qgemm::run<qgemm::kFp8>(w, xp, xbp, M, xsp, out, b);
    }
  };
  if (x.scalar_type() == torch::kBFloat16) {
    go(y.data_ptr<c10::BFloat16>());
  } else {
    go(y.data_ptr<float>());
  }
  return y;
}

}  // namespace pagedllm
