// Weight-only int4 / int8 products (quant_gemm.h's panels) with float32 x quantized to int16 at
// each call and multiplied with AVX512-VNNI's vpdpwssd: 32 multiply-adds per instruction where a
// float32 FMA does 16, and codes made into int16 pairs with 2.25 (int4) or 1 (int8) VBMI shuffles
// per 16-byte line instead of 4 widening ops -- the batch-1 product streams the weights with
// fewer instructions per byte, batches do half the arithmetic.
//
// Activations: per row s = amax / 32767 and q = round-half-even(x / s), so each row keeps 16 bits
// of its largest value (llama.cpp's 8 bits per 32 values would be 256 times coarser); x's chunk
// sums (quant_gemm.h's chunks: a weight group, or 256 k of a longer one) are taken from the codes,
// so every product is exactly the product of the rounded x with the weight up to float32 rounding
// of the scaled chunk sums. The integer sums are exact: a chunk of at most 256 k sums
// |q_x q_w| <= 256 * 32767 * 128 < 2^31. One scale per row (not per chunk) is applied once per
// output, at the store, instead of once per row, panel and chunk (SmolLM2-135M's greedy agreement
// with HF and its perplexity are those of per-chunk scales: docs/usage.md, GGUF files).
//
// Only on CPUs with both AVX512-VNNI and AVX512-VBMI (checked at run time; compiled with a
// target attribute): Ice Lake / Sapphire Rapids and later, Zen 4 and later. Elsewhere (and for bf16
// x, fp8 codes, odd group sizes, or set_int16_activations(false)) quant_gemm.h's float paths run.
//
// Included by quant_gemm.h after its kernels (Weights, the chunk helpers, add_chunk, the panel
// ranges); not on its own.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "packed_gemm.h"
#include "vec.h"

namespace pagedllm {
namespace qgemm {

inline std::atomic<bool>& int16_activations_flag() {
  static std::atomic<bool> on{true};
  return on;
}
// Whether float32 x may be quantized to int16 (on by default; tests and benchmarks turn it off to
// compare with the float32 paths).
inline void set_int16_activations(bool on) { int16_activations_flag().store(on); }

#ifdef PAGEDLLM_AVX512
inline bool has_vnni_vbmi() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  return yes;
}

// Whether this product takes the int16 path.
inline bool int16_path(int kind, int64_t gs) {
  return int16_activations_flag().load(std::memory_order_relaxed) && kind != kFp8 && gs % 2 == 0 && has_vnni_vbmi();
}

// x [M, K] float32 in the weight's column order as int16 pairs q [M, K / 2] (k = 2i in the low
// half of int32 i), each row's scale s [M] and its integer chunk sums sum(q) [M, C] as floats
// (qsum). A row with a non-finite value gets q = 0 and s = NaN, so its outputs are NaN as in float32
// arithmetic.
// 16 lanes at a time (masked tails); rows are spread over the threads for prompt-sized x.
inline void quantize_i16(const float* x, int64_t M, const Weights& w, int16_t* q, float* s, float* qsum) {
  const int64_t K = w.K, C = w.chunks();
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    int16_t* o = q + m * K;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 odd = 0;  // lanes that saw a NaN or an infinity
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(lanes16(K - k), r + k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      odd |= _mm512_fpclass_ps_mask(v, 0x99);  // QNaN, SNaN, +inf, -inf
    }
    if (odd != 0) {
      std::fill(o, o + K, int16_t{0});
      s[m] = NAN;
      std::fill(qsum + m * C, qsum + (m + 1) * C, 0.0f);
      continue;
    }
    const float mx = _mm512_reduce_max_ps(amax);
    const float sc = mx > 0.0f ? mx / 32767.0f : 1.0f;
    const __m512 vs = _mm512_set1_ps(sc);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t k0 = w.chunk_begin(c), k1 = w.chunk_end(c);
      __m512i total = _mm512_setzero_si512();
      for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 mk = lanes16(k1 - k);
        // round half to even (the default rounding mode); |x / s| <= 32767 by the choice of s
        const __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(mk, r + k), vs));
        total = _mm512_add_epi32(total, v);
        _mm256_mask_storeu_epi16(o + k, mk, _mm512_cvtsepi32_epi16(v));
      }
      qsum[m * C + c] = static_cast<float>(_mm512_reduce_add_epi32(total));
    }
    s[m] = sc;
  }
}

struct Act16 {
  const int32_t* q;   // [M, K / 2] int16 pairs
  const float* s;     // [M]: each row's scale
  const float* qsum;  // [M, C]: sum(q) per chunk
};

#define PAGEDLLM_VNNI_VBMI __attribute__((target("avx512vnni,avx512vbmi")))

// acc += the pairwise int16 products of a and b (vpdpwssd) as inline assembly, which needs no
// target attribute (callable from the shared loop nests) and compiles well: GCC 12 turns the
// intrinsic in unrolled accumulator loops into a register copy and a stack store per instruction.
inline void dpwssd(__m512i& acc, __m512i a, __m512i b) { __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); }

// vpermb indices for int8 codes: 64 bytes = 4 lines of k = 4t .. 4t + 3; pair h (k = 4t + 2h,
// 4t + 2h + 1) puts line 2h's byte j in byte 4j + 1 and line 2h + 1's in byte 4j + 3 (the even
// bytes masked to zero), so an arithmetic shift of each 16-bit word by 8 sign-extends them.
struct Int8PairIdx {
  alignas(64) uint8_t idx[2][64];
  Int8PairIdx() {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 16; ++j) {
        idx[h][4 * j] = idx[h][4 * j + 2] = 0;
        idx[h][4 * j + 1] = static_cast<uint8_t>(32 * h + j);
        idx[h][4 * j + 3] = static_cast<uint8_t>(32 * h + 16 + j);
      }
  }
};

// Pair lines [q0, q1) of one panel as int16 pairs (lane j: column j's codes of k = 2q low, 2q + 1
// high) into out (row stride kBW int32) -- int4 4 lines at a time as in int4_pairs4, int8 two
// pairs per 64 bytes -- and the tails one pair at a time.
template <int KIND>
PAGEDLLM_VNNI_VBMI inline __m512i i16_pair(const uint8_t* panel, int64_t q) {
  if constexpr (KIND == kInt4) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + q * kPanel)));
    return _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), _mm512_set1_epi32(0x000F000F));
  } else {
    const __m512i e = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + 2 * q * kPanel)));
    const __m512i o =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + (2 * q + 1) * kPanel)));
    return _mm512_mask_mov_epi16(e, 0xAAAAAAAA, _mm512_slli_epi32(o, 16));
  }
}

// The index vectors of i16_pairs64, loaded once per panel (int4: 4, int8: 2).
template <int KIND>
struct PairIdx16 {
  __m512i v[4];
  PAGEDLLM_VNNI_VBMI PairIdx16() {
    if constexpr (KIND == kInt4) {
      static const Int4PairIdx ix;
      for (int i = 0; i < 4; ++i) v[i] = _mm512_load_si512(ix.idx[i]);
    } else {
      static const Int8PairIdx ix;
      for (int i = 0; i < 2; ++i) v[i] = _mm512_load_si512(ix.idx[i]);
      v[2] = v[3] = v[0];
    }
  }
};

// The pairs of 64 bytes of a panel at line l (int4: lines l .. l + 3 = 4 pairs, one shift for
// the 4 and per pair one vpermi2b and one and; int8: 2 pairs, one vpermb and one shift each).
template <int KIND>
PAGEDLLM_VNNI_VBMI inline void i16_pairs64(const uint8_t* line, const PairIdx16<KIND>& ix, __m512i* out) {
  const __m512i v = _mm512_loadu_si512(line);
  if constexpr (KIND == kInt4) {
    constexpr __mmask64 even = 0x5555555555555555ULL;
    const __m512i s = _mm512_srli_epi16(v, 4), nib = _mm512_set1_epi32(0x000F000F);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) out[i] = _mm512_and_si512(_mm512_maskz_permutex2var_epi8(even, v, ix.v[i], s), nib);
  } else {
    constexpr __mmask64 odd = 0xAAAAAAAAAAAAAAAAULL;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) out[h] = _mm512_srai_epi16(_mm512_maskz_permutexvar_epi8(odd, ix.v[h], v), 8);
  }
}

template <int KIND>
PAGEDLLM_VNNI_VBMI void widen_chunk_i16(const Weights& w, int64_t p, int64_t np, int64_t k0, int64_t k1, int32_t* buf) {
  const int64_t pb = w.panel_bytes();
  constexpr int64_t lpq = KIND == kInt4 ? 1 : 2;  // 16-byte lines per pair
  constexpr int64_t step = 4 / lpq;                 // pairs per 64 bytes
  const PairIdx16<KIND> ix;
  for (int64_t j = 0; j < np; ++j) {
    const uint8_t* panel = w.packed + (p + j) * pb;
    for (int64_t l = (k0 / 2 + kChunk / 2) * lpq; l < (k1 / 2 + kChunk / 2) * lpq; l += 4)
      _mm_prefetch(reinterpret_cast<const char*>(panel + l * kPanel), _MM_HINT_T1);
    int64_t q = k0 / 2;
    for (; q + step <= k1 / 2; q += step) {
      __m512i v[4];
      i16_pairs64<KIND>(panel + q * lpq * kPanel, ix, v);
#pragma GCC unroll 4
      for (int i = 0; i < step; ++i) _mm512_storeu_si512(buf + (q + i - k0 / 2) * kBW + j * kPanel, v[i]);
    }
    for (; q < k1 / 2; ++q) _mm512_storeu_si512(buf + (q - k0 / 2) * kBW + j * kPanel, i16_pair<KIND>(panel, q));
  }
}

// Rows [m, m + R) of x in one task against one widened chunk ch: the integer sums of the int16 x
// pairs and the widened codes, less the zero point's share, times the group scale, added to their
// float32 rows c (add_chunk); each row's scale multiplies its sums once, at the store.
template <int R, int NP>
void tile_i16(const Weights& w, int64_t p, const Act16& a, int64_t m, int64_t ch, const int32_t* widened, float* c) {
  const int64_t C = w.chunks(), G = w.G, K2 = w.K / 2;
  const int64_t k0 = w.chunk_begin(ch), k1 = w.chunk_end(ch), g = ch / w.chunks_per_group();
  __m512i part[R][NP];
  bmicro<R, NP>(a.q + m * K2 + k0 / 2, K2, widened, (k1 - k0) / 2, part, _mm512_setzero_si512(),
                [](const int32_t* q) { return _mm512_loadu_si512(q); }, [](int32_t v) { return _mm512_set1_epi32(v); },
                [](__m512i& acc, __m512i x, __m512i v) { dpwssd(acc, x, v); });
  __m512 f[R][NP];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) f[i][j] = _mm512_cvtepi32_ps(part[i][j]);
  const float* sc = w.sc + (p * G + g) * kPanel;
  const float* zp = w.zp != nullptr ? w.zp + (p * G + g) * kPanel : nullptr;
  add_chunk<R, NP>(f, c, sc, zp, w.zc, G * kPanel, a.qsum + m * C + ch, C);
}

// One task of the batched product: panels [p, p + np), every row of x, into y [M, N] float32;
// kMB rows at a time (their float32 rows stay in L1 across the chunks), chunk by chunk, each chunk
// widened once per pass.
constexpr int64_t kMB = 64;
template <int KIND>
void blocked_task_i16(const Weights& w, int64_t p, int64_t np, const Act16& a, int64_t M, float* y,
                      const float* bias) {
  static thread_local std::vector<int32_t> widened;
  if (widened.size() < static_cast<size_t>(kChunk / 2 * kBW)) widened.resize(kChunk / 2 * kBW);
  const int64_t n0 = p * kPanel, cols = std::min(np * kPanel, w.N - n0);
  float* c = gemm::task_buffer(std::min(M, kMB) * kBW);
  for (int64_t m0 = 0; m0 < M; m0 += kMB) {
    const int64_t mb = std::min(kMB, M - m0);
    std::fill(c, c + mb * kBW, 0.0f);
    for (int64_t ch = 0; ch < w.chunks(); ++ch) {
      widen_chunk_i16<KIND>(w, p, np, w.chunk_begin(ch), w.chunk_end(ch), widened.data());
      for (int64_t m = 0; m < mb; m += kBR)
        gemm::upto<kBNP>(np, [&](auto qq) {
          gemm::upto<kBR>(std::min<int64_t>(kBR, mb - m), [&](auto rr) {
            tile_i16<rr.value, qq.value>(w, p, a, m0 + m, ch, widened.data(), c + m * kBW);
          });
        });
    }
    store_task(c, mb, np, cols, n0, bias, y + m0 * w.N, w.N, a.s + m0, 1);
  }
}

// One panel times one row of int16 x (batch 1), read front to back as one stream (see
// panel1_int4_dp): 256 bytes per step, 8 vpdpwssd chains.
template <int KIND>
PAGEDLLM_VNNI_VBMI void panel1_i16(const Weights& w, int64_t p, const Act16& a, float* y, const float* bias,
                                   int64_t cols) {
  constexpr int64_t lpq = KIND == kInt4 ? 1 : 2;
  constexpr int64_t step = 16 / lpq;  // pairs per 256 bytes
  const int64_t C = w.chunks();
  const uint8_t* base = w.codes(p);
  const float* sc = w.scales(p);
  const float* zp = w.zeros(p);
  const PairIdx16<KIND> ix;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const int64_t q0 = w.chunk_begin(c) / 2, q1 = w.chunk_end(c) / 2, g = c / w.chunks_per_group();
    __m512i t[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) t[r] = _mm512_setzero_si512();
    int64_t q = q0;
    for (; q + step <= q1; q += step) {
      const uint8_t* line = base + q * lpq * kPanel;
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(line + 64 * b + kAheadBytes1), _MM_HINT_T0);
        __m512i v[4];
        i16_pairs64<KIND>(line + 64 * b, ix, v);
        constexpr int per = 4 / lpq;
#pragma GCC unroll 4
        for (int i = 0; i < per; ++i)
          dpwssd(t[(b * per + i) % 8], v[i], _mm512_set1_epi32(a.q[q + b * per + i]));
      }
    }
    for (; q < q1; ++q) dpwssd(t[0], i16_pair<KIND>(base, q), _mm512_set1_epi32(a.q[q]));
    const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(t[0], t[1]), _mm512_add_epi32(t[2], t[3])),
                                       _mm512_add_epi32(_mm512_add_epi32(t[4], t[5]), _mm512_add_epi32(t[6], t[7])));
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a.s[0]));
    if (zp != nullptr || w.zc != 0.0f) {
      const __m512 z = zp != nullptr ? _mm512_loadu_ps(zp + g * kPanel) : _mm512_set1_ps(w.zc);
      f = _mm512_fnmadd_ps(z, _mm512_set1_ps(a.s[0] * a.qsum[c]), f);
    }
    acc = _mm512_fmadd_ps(f, _mm512_loadu_ps(sc + g * kPanel), acc);
  }
  const __mmask16 m = lanes16(cols);
  store16(y, _mm512_add_ps(acc, bias != nullptr ? load16(bias, m) : _mm512_setzero_ps()), m);
}
#undef PAGEDLLM_VNNI_VBMI

// y [M, N] = x W^T (+ bias) through the int16 kernels: batch 1 over ranges of consecutive panels,
// batches in tasks of kBNP panels.
template <int KIND>
void run_i16(const Weights& w, const Act16& a, int64_t M, float* y, const float* bias) {
  const int64_t panels = (w.N + kPanel - 1) / kPanel;
  if (M == 1) {
    for_panel_ranges(panels, w.panel_bytes(), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel;
        panel1_i16<KIND>(w, p, a, y + n0, bias != nullptr ? bias + n0 : nullptr, std::min(kPanel, w.N - n0));
      }
    });
    return;
  }
  const int64_t tasks = (panels + kBNP - 1) / kBNP;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t)
    blocked_task_i16<KIND>(w, t * kBNP, std::min<int64_t>(kBNP, panels - t * kBNP), a, M, y, bias);
}
#else
inline bool int16_path(int, int64_t) { return false; }
#endif

}  // namespace qgemm
}  // namespace pagedllm
