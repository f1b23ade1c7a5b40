// y[M, N] = x[M, K] w[N, K]^T (+ bias) for the linear layers, with the weight pre-packed once
// (pack_linear_weight) into 16-column panels in the layout this build's path uses:
//
//   float32 weights, every path:    [ceil(N/16), K, 16]          packed[p, k, j]     = w[16p + j, k]
//   bfloat16 weights, avx512_bf16:  [ceil(N/16), ceil(K/2), 32]  packed[p, q, 2j + t] = w[16p + j, 2q + t]
//   bfloat16 weights, other paths:  [ceil(N/16), K, 16]          (widened to float32 on load: exact)
//
// (zero past N and K), so a panel's next k (or k pair) of 16 outputs is one 64-byte line and a
// panel streams sequentially. x and y are float32 or bf16 (y in x's dtype). The path is fixed at
// compile time by the ISA macros of vec.h and reported by gemm_path():
//
// - avx512 (PAGEDLLM_AVX512): an 8 x 48 tile of y in 24 zmm accumulators (kMR x 16 kNP); each k
//   loads one 16-float vector from each of 3 panels and broadcasts 8 values of x. Measured on a
//   2-core Zen 5 (llama-100m shapes) against 12 x 32, 6 x 64 and 24 x 16: 8 x 48 best or tied.
// - avx512_bf16 (PAGEDLLM_AVX512_BF16), bf16 weights: vdpbf16ps on the pair-packed panels; x as
//   bf16 rows (bf16 x of even K used as is, else rounded to nearest even / padded once per call),
//   each k pair broadcasts one 32-bit pair per row against a panel's 16 x 2 weights: bf16
//   products, float32 accumulation, one rounding of the output -- what oneDNN's native bf16 GEMM
//   computes. float32 weights take the avx512 kernel.
// - avx2 (PAGEDLLM_AVX2): a 6 x 16 tile in 12 ymm accumulators, one panel per call.
// - scalar: plain loops.
//
// Decode-sized products (M <= kMc) go panel by panel, each panel read from memory once, front to
// back (the first row tile prefetching ahead), in dynamically handed out groups of panels; x is
// re-read from cache for every panel. Larger products are blocked as in GotoBLAS/BLIS, in
// dynamically handed out tasks of (up to kNc panels, kMc rows) that each run all of K: per
// K-block, the kc x 16 kNP slice of kNP panels stays in L1 while the task's rows of x (kMc x kc,
// in L2) pass by kMR at a time. A task's float32 block of y stays in cache until bias and the
// output conversion finish it; with bf16 output the float32 block lives in a thread-local buffer
// (no M x N float32 scratch).
#pragma once

#include <omp.h>

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace gemm {

constexpr int64_t kPanel = 16;  // output columns per packed panel

#if defined(PAGEDLLM_AVX512)
#ifndef PAGEDLLM_GEMM_MR  // overridable for tile-shape experiments
#define PAGEDLLM_GEMM_MR 8
#endif
#ifndef PAGEDLLM_GEMM_NP
#define PAGEDLLM_GEMM_NP 3
#endif
constexpr int kMR = PAGEDLLM_GEMM_MR;  // rows of x per microkernel call
constexpr int kNP = PAGEDLLM_GEMM_NP;  // panels per microkernel call
#elif defined(PAGEDLLM_AVX2)
constexpr int kMR = 6;
constexpr int kNP = 1;
#else
constexpr int kMR = 4;
constexpr int kNP = 1;
#endif
#ifndef PAGEDLLM_GEMM_KC
#define PAGEDLLM_GEMM_KC 256
#endif
#ifndef PAGEDLLM_GEMM_MC
#define PAGEDLLM_GEMM_MC 96
#endif
constexpr int64_t kKc = PAGEDLLM_GEMM_KC;  // k (or k pairs) per block: 16 KB of each panel
constexpr int64_t kMc = PAGEDLLM_GEMM_MC;  // rows per block (and the decode-sized limit): 96 KB of x in L2
constexpr int64_t kPrefetch = 32; // 64-byte lines ahead the first tile of a streamed panel prefetches
constexpr int64_t kGroup = (4 + kNP - 1) / kNP * kNP;  // panels per task of a decode-sized product
#ifndef PAGEDLLM_GEMM_NC
#define PAGEDLLM_GEMM_NC 32
#endif
constexpr int64_t kNc = PAGEDLLM_GEMM_NC;  // most panels per task of a larger product: 96 x 512 floats of y in L2

#ifdef PAGEDLLM_AVX512_BF16
constexpr bool kPairs = true;  // bf16 weights packed with k in pairs, for vdpbf16ps
#else
constexpr bool kPairs = false;
#endif

inline const char* path() {
#if defined(PAGEDLLM_AVX512_BF16)
  return "avx512_bf16";
#elif defined(PAGEDLLM_AVX512)
  return "avx512";
#elif defined(PAGEDLLM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// f(std::integral_constant<int, r>) for a run-time 1 <= r <= R: the microkernels' row and panel
// counts are compile-time.
template <int R, typename F>
inline void upto(int64_t r, const F& f) {
  if constexpr (R >= 1) {
    if (r == R) {
      f(std::integral_constant<int, R>{});
    } else {
      upto<R - 1>(r, f);
    }
  }
}

#ifdef PAGEDLLM_AVX512
// c[i, 0:cols] (+)= the R x NP tile of 16-column accumulators s (masked past cols): the epilogue
// shared by the float32 and bf16-pair microkernels.
template <int R, int NP>
inline void store_tile(const __m512 (&s)[R][NP], float* c, int64_t ldc, bool accumulate, int64_t cols) {
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const __mmask16 m = lanes16(cols - j * kPanel);
      float* cij = c + i * ldc + j * kPanel;
      __m512 v = s[i][j];
      if (accumulate) v = _mm512_add_ps(v, load16(cij, m));
      store16(cij, v, m);
    }
}
#endif

#ifdef PAGEDLLM_AVX512
// c[i, 0:cols] (+)= sum over k < kc of a[i, k] * B[k, 0:cols], i < R, where B is NP panel slices
// b, b + bs, ... (kc x 16 each) side by side and cols <= 16 NP.
template <int R, int NP, bool PF, typename W>
inline void micro512(const float* a, int64_t lda, const W* b, int64_t bs, int64_t kc, float* c, int64_t ldc,
                     bool accumulate, int64_t cols) {
  __m512 s[R][NP];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) s[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 bv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(b + j * bs + (k + kPrefetch) * kPanel), _MM_HINT_T0);
      bv[j] = load16(b + j * bs + k * kPanel);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) s[i][j] = _mm512_fmadd_ps(av, bv[j], s[i][j]);
    }
  }
  store_tile<R, NP>(s, c, ldc, accumulate, cols);
}
#endif

#ifdef PAGEDLLM_AVX512_BF16
// The same with bf16 pairs: a holds R rows of x as 32-bit bf16 pairs (row stride lda pairs), b NP
// pair-packed panel slices (kc2 x 32 bf16 each): one vdpbf16ps per row and panel per k pair,
// float32 accumulation.
template <int R, int NP, bool PF>
inline void micro_dp(const int32_t* a, int64_t lda, const c10::BFloat16* b, int64_t bs, int64_t kc2, float* c,
                     int64_t ldc, bool accumulate, int64_t cols) {
  __m512 s[R][NP];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) s[i][j] = _mm512_setzero_ps();
  for (int64_t q = 0; q < kc2; ++q) {
    __m512bh bv[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const c10::BFloat16* bj = b + j * bs + q * 2 * kPanel;
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(bj + kPrefetch * 2 * kPanel), _MM_HINT_T0);
      bv[j] = (__m512bh)_mm512_loadu_si512(bj);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(a[i * lda + q]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) s[i][j] = _mm512_dpbf16_ps(s[i][j], av, bv[j]);
    }
  }
  store_tile<R, NP>(s, c, ldc, accumulate, cols);
}
#endif

#if defined(PAGEDLLM_AVX2) && !defined(PAGEDLLM_AVX512)
// c[i, 0:cols] (+)= sum over k < kc of a[i, k] * b[k, 0:16], i < MR; b is a packed panel slice.
template <int MR, bool PF, typename W>
inline void micro256(const float* a, int64_t lda, const W* b, int64_t kc, float* c, int64_t ldc, bool accumulate,
                     int64_t cols) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(b + (k + kPrefetch) * kPanel), _MM_HINT_T0);
    const __m256 b0 = load8(b + k * kPanel), b1 = load8(b + k * kPanel + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i * lda + k);
      lo[i] = _mm256_fmadd_ps(av, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(av, b1, hi[i]);
    }
  }
  alignas(32) float tile[MR][kPanel];  // through memory once per call: keeps lo/hi in registers in the loop
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(tile[i], lo[i]);
    _mm256_store_ps(tile[i] + 8, hi[i]);
  }
  for (int i = 0; i < MR; ++i) {
    float* ci = c + i * ldc;
    if (cols == kPanel) {
      __m256 t0 = _mm256_load_ps(tile[i]), t1 = _mm256_load_ps(tile[i] + 8);
      if (accumulate) {
        t0 = _mm256_add_ps(t0, _mm256_loadu_ps(ci));
        t1 = _mm256_add_ps(t1, _mm256_loadu_ps(ci + 8));
      }
      _mm256_storeu_ps(ci, t0);
      _mm256_storeu_ps(ci + 8, t1);
    } else {  // the last panel of an N that is not a multiple of 16
      for (int64_t j = 0; j < cols; ++j) ci[j] = accumulate ? ci[j] + tile[i][j] : tile[i][j];
    }
  }
}
#endif

// A float32 block of y for one task, reused by the thread's later tasks and calls (it only grows).
// Below this many multiply-adds (M x N x K units) a product runs on one thread: a few
// microseconds of work, less than a fork and join costs where a thread sleeps or is descheduled.
constexpr int64_t kParallelWork = 1 << 16;

inline float* task_buffer(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// The loop nest shared by every path. tile(m0, rows, p, np, k0, kc, accumulate, streamed, c, ldc)
// computes rows [m0, m0 + rows) of y against panels [p, p + np) (np <= kNP) over the k units
// [k0, k0 + kc) (k, or k pairs) into c (row stride ldc), the float32 block of y at (m0, 16 p);
// finish(m0, rows, p0, p1, c, ldc) completes a task's block after its last K-block (bias, the
// output's conversion) while it is in cache. y is the float32 output itself, or null when the
// output is bf16: then each task computes into a thread-local block buffer.
template <typename Tile, typename Finish>
void drive(int64_t M, int64_t N, int64_t panels, int64_t ku, float* y, const Tile& tile, const Finish& finish) {
  // Work is handed out dynamically: a thread that enters the parallel region late (woken from
  // sleep after Python ran between two products) takes less of it instead of everyone waiting.
  // A small product runs on the calling thread alone: no fork, no barrier to wait at for a
  // partner that is asleep or descheduled on a busy host (issue 30).
  const bool parallel = M * N * ku >= kParallelWork;
  if (M <= kMc) {
    // Decode-sized: x stays in L2 and each panel is read from memory once, front to back.
    const int64_t groups = (panels + kGroup - 1) / kGroup;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t pb = g * kGroup, pe = std::min(panels, pb + kGroup);
      const int64_t ldc = y != nullptr ? N : kGroup * kPanel;
      float* c = y != nullptr ? y + pb * kPanel : task_buffer(M * ldc);
      for (int64_t p = pb; p < pe; p += kNP)
        for (int64_t k0 = 0; k0 < ku; k0 += kKc)
          tile(0, M, p, std::min<int64_t>(kNP, pe - p), k0, std::min(kKc, ku - k0), k0 > 0, true,
               c + (p - pb) * kPanel, ldc);
      finish(0, M, pb, pe, c, ldc);
    }
  } else {
    // Prefill-sized: tasks of (a chunk of up to kNc panels, an M-block of kMc rows), chunk-major.
    // A task runs all of K: per K-block, the M-block of x (kMc x kc, in L2) meets the chunk's
    // K-block slices kNP panels at a time (each kc x 16 kNP slice in L1, reused by the M-block's
    // kMc / kMR microkernel calls), and the task's block of y (kMc x 16 kNc floats) stays in L2
    // until it is finished.
    const int64_t nchunks = (panels + kNc - 1) / kNc;
    const int64_t chunk = ((panels + nchunks - 1) / nchunks + kNP - 1) / kNP * kNP;  // even chunks
    const int64_t nc = (panels + chunk - 1) / chunk, nm = (M + kMc - 1) / kMc;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int64_t t = 0; t < nc * nm; ++t) {
      const int64_t pb = (t / nm) * chunk, pe = std::min(panels, pb + chunk);
      const int64_t m0 = (t % nm) * kMc, rows = std::min(kMc, M - m0);
      const int64_t ldc = y != nullptr ? N : chunk * kPanel;
      float* c = y != nullptr ? y + m0 * N + pb * kPanel : task_buffer(kMc * ldc);
      for (int64_t k0 = 0; k0 < ku; k0 += kKc)
        for (int64_t p = pb; p < pe; p += kNP)
          tile(m0, rows, p, std::min<int64_t>(kNP, pe - p), k0, std::min(kKc, ku - k0), k0 > 0, false,
               c + (p - pb) * kPanel, ldc);
      finish(m0, rows, pb, pe, c, ldc);
    }
  }
}

// Rows [0, rows) of a tile in microkernel calls of kMR rows (the first one prefetching along
// the panels when they stream from memory), then the row tail. call(m, r, prefetch).
template <typename Call>
inline void row_tiles(int64_t rows, bool streamed, const Call& call) {
  int64_t m = 0;
  if (streamed) {
    m = std::min<int64_t>(rows, kMR);
    call(0, m, true);
  }
  for (; m + kMR <= rows; m += kMR) call(m, kMR, false);
  if (m < rows) call(m, rows - m, false);
}

// float32 arithmetic: y32 = x w^T with x float32 [M, K] and W float32 or bf16 (widened) panels
// [P, K, 16].
template <typename W, typename Finish>
void run_f32(float* y, const float* x, int64_t M, int64_t K, const W* packed, int64_t N, const Finish& finish) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t bs = K * kPanel;  // elements from one panel to the next
  auto tile = [&](int64_t m0, int64_t rows, int64_t p, int64_t np, int64_t k0, int64_t kc, bool accumulate,
                  bool streamed, float* c, int64_t ldc) {
    const W* b = packed + p * bs + k0 * kPanel;
    const float* a = x + m0 * K + k0;
    const int64_t cols = std::min(np * kPanel, N - p * kPanel);
#if defined(PAGEDLLM_AVX512)
    row_tiles(rows, streamed, [&](int64_t m, int64_t r, bool pf) {
      upto<kNP>(np, [&](auto q) {
        upto<kMR>(r, [&](auto rr) {
          if (pf) {
            micro512<rr.value, q.value, true>(a + m * K, K, b, bs, kc, c + m * ldc, ldc, accumulate, cols);
          } else {
            micro512<rr.value, q.value, false>(a + m * K, K, b, bs, kc, c + m * ldc, ldc, accumulate, cols);
          }
        });
      });
    });
#elif defined(PAGEDLLM_AVX2)
    (void)np;
    row_tiles(rows, streamed, [&](int64_t m, int64_t r, bool pf) {
      upto<kMR>(r, [&](auto rr) {
        if (pf) {
          micro256<rr.value, true>(a + m * K, K, b, kc, c + m * ldc, ldc, accumulate, cols);
        } else {
          micro256<rr.value, false>(a + m * K, K, b, kc, c + m * ldc, ldc, accumulate, cols);
        }
      });
    });
#else
    (void)streamed;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const W* bj = b + (j / kPanel) * bs + j % kPanel;
        float s = accumulate ? c[i * ldc + j] : 0.0f;
        for (int64_t k = 0; k < kc; ++k) s += a[i * K + k] * to_float(bj[k * kPanel]);
        c[i * ldc + j] = s;
      }
#endif
  };
  drive(M, N, panels, K, y, tile, finish);
}

#ifdef PAGEDLLM_AVX512_BF16
// x [M, K] float32 (rounded to nearest even) or bf16 as bf16 rows of K2 = ceil(K / 2) pairs,
// zero past K: xb [M, 2 K2].
template <typename T>
void to_bf16_rows(c10::BFloat16* xb, const T* x, int64_t M, int64_t K) {
  const int64_t kp = (K + 1) / 2 * 2;
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
  for (int64_t r = 0; r < M; ++r) {
    const T* src = x + r * K;
    c10::BFloat16* dst = xb + r * kp;
    for (int64_t k = 0; k < kp; k += 16) {
      const __mmask16 m = lanes16(K - k);
      if constexpr (std::is_same_v<T, float>) {
        _mm256_mask_storeu_epi16(dst + k, lanes16(kp - k), to_bf16x16(load16(src + k, m)));
      } else {
        _mm256_mask_storeu_epi16(dst + k, lanes16(kp - k), _mm256_maskz_loadu_epi16(m, src + k));
      }
    }
  }
}

// bf16 arithmetic: y32 = x w^T with xs x's rows as K2 bf16 pairs each and packed [P, K2, 32] bf16.
template <typename Finish>
void run_dp(float* y, const int32_t* xs, int64_t M, int64_t K, const c10::BFloat16* packed, int64_t N,
            const Finish& finish) {
  const int64_t panels = (N + kPanel - 1) / kPanel, k2 = (K + 1) / 2;
  const int64_t bs = k2 * 2 * kPanel;
  auto tile = [&](int64_t m0, int64_t rows, int64_t p, int64_t np, int64_t q0, int64_t kc2, bool accumulate,
                  bool streamed, float* c, int64_t ldc) {
    const c10::BFloat16* b = packed + p * bs + q0 * 2 * kPanel;
    const int64_t cols = std::min(np * kPanel, N - p * kPanel);
    row_tiles(rows, streamed, [&](int64_t m, int64_t r, bool pf) {
      const int32_t* a = xs + (m0 + m) * k2 + q0;
      upto<kNP>(np, [&](auto q) {
        upto<kMR>(r, [&](auto rr) {
          if (pf) {
            micro_dp<rr.value, q.value, true>(a, k2, b, bs, kc2, c + m * ldc, ldc, accumulate, cols);
          } else {
            micro_dp<rr.value, q.value, false>(a, k2, b, bs, kc2, c + m * ldc, ldc, accumulate, cols);
          }
        });
      });
    });
  };
  drive(M, N, panels, k2, y, tile, finish);
}
#endif

// out[0:rows, 0:cols] (row stride N) = c[0:rows, 0:cols] (row stride ldc) (+ bias[0:cols]); out
// float32 (possibly c itself) or bf16.
template <typename O>
inline void finish_block(O* out, int64_t N, const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias) {
  if (std::is_same_v<O, float> && static_cast<const void*>(out) == c && bias == nullptr) return;
  for (int64_t m = 0; m < rows; ++m) {
    const float* src = c + m * ldc;
    O* dst = out + m * N;
#ifdef PAGEDLLM_AVX512
    for (int64_t n = 0; n < cols; n += 16) {
      const __mmask16 k = lanes16(cols - n);
      __m512 v = load16(src + n, k);
      if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + n, k));
      store16(dst + n, v, k);
    }
#else
    for (int64_t n = 0; n < cols; ++n) dst[n] = from_float<O>(src[n] + (bias != nullptr ? bias[n] : 0.0f));
#endif
  }
}

template <typename T>
void pack(T* out, const T* w, int64_t N, int64_t K, bool pairs) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t ku = pairs ? (K + 1) / 2 : K, width = pairs ? 2 * kPanel : kPanel;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    T* dst = out + p * ku * width;
    for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
      const T* row = w + (p * kPanel + j) * K;
      if (pairs) {
        for (int64_t k = 0; k < K; ++k) dst[(k / 2) * width + 2 * j + k % 2] = row[k];
      } else {
        for (int64_t k = 0; k < K; ++k) dst[k * width + j] = row[k];
      }
    }
  }
}

}  // namespace gemm

// Which GEMM path this build compiled: "avx512_bf16", "avx512", "avx2" or "scalar".
inline std::string gemm_path() { return gemm::path(); }

// w [N, K] (float32 or bfloat16) packed for packed_linear in this build's layout (see the top of
// this file): bf16 weights are pair-packed on the avx512_bf16 path, panels of k elsewhere.
inline torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
              "pack_linear_weight: float32 or bfloat16 weight [N, K] expected");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + gemm::kPanel - 1) / gemm::kPanel;
  if (w.scalar_type() == torch::kBFloat16 && gemm::kPairs) {
    auto out = torch::zeros({panels, (K + 1) / 2, 2 * gemm::kPanel}, w.options());
    gemm::pack(out.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), N, K, true);
    return out;
  }
  auto out = torch::zeros({panels, K, gemm::kPanel}, w.options());
  if (w.scalar_type() == torch::kFloat32) {
    gemm::pack(out.data_ptr<float>(), w.data_ptr<float>(), N, K, false);
  } else {
    gemm::pack(out.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), N, K, false);
  }
  return out;
}

// y = x w^T (+ bias): x [M, K] float32 or bfloat16 (rows contiguous), packed by
// pack_linear_weight (float32 or bfloat16), bias [N] float32 or None; returns y [M, N] in x's
// dtype (bf16: rounded once from the float32 result plus bias). With bf16 weights on the
// avx512_bf16 path x is rounded to bf16 (exact for bf16 x): bf16 products, float32 sums.
inline torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "packed_linear: contiguous float32 or bfloat16 x [M, K] expected");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 || packed.scalar_type() == torch::kBFloat16,
              "packed_linear: float32 or bfloat16 packed weight expected");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + gemm::kPanel - 1) / gemm::kPanel;
  const bool pairs = packed.scalar_type() == torch::kBFloat16 && gemm::kPairs;
  const int64_t ku = pairs ? (K + 1) / 2 : K, width = pairs ? 2 * gemm::kPanel : gemm::kPanel;
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == panels && packed.size(1) == ku && packed.size(2) == width &&
                  packed.is_contiguous(),
              "packed_linear: weight packed by pack_linear_weight for this K and N expected: [", panels, ", ", ku,
              ", ", width, "], got ", packed.sizes());
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "packed_linear: float32 bias of N elements expected");
    b = bias->data_ptr<float>();
  }
  const bool bf16_out = x.scalar_type() == torch::kBFloat16;
  if (M == 0 || K == 0) {  // nothing to multiply: an empty or all-bias product
    auto y = torch::zeros({M, N}, x.options().dtype(torch::kFloat32));
    if (b != nullptr) y = y + *bias;
    return bf16_out ? y.to(torch::kBFloat16) : y;
  }
  auto y = torch::empty({M, N}, x.options());
  float* y32 = bf16_out ? nullptr : y.data_ptr<float>();  // null: bf16 output through task buffers
  c10::BFloat16* y16 = bf16_out ? y.data_ptr<c10::BFloat16>() : nullptr;
  auto finish = [&](int64_t m0, int64_t rows, int64_t p0, int64_t p1, const float* c, int64_t ldc) {
    const int64_t n0 = p0 * gemm::kPanel, cols = std::min(N, p1 * gemm::kPanel) - n0;
    const float* bn = b != nullptr ? b + n0 : nullptr;
    if (bf16_out) {
      gemm::finish_block(y16 + m0 * N + n0, N, c, ldc, rows, cols, bn);
    } else {
      gemm::finish_block(y32 + m0 * N + n0, N, c, ldc, rows, cols, bn);
    }
  };
#ifdef PAGEDLLM_AVX512_BF16
  if (pairs) {  // x as bf16 pairs: bf16 x of even K as it is, else a rounded or padded copy
    torch::Tensor xb = x;
    if (!bf16_out || K % 2 != 0) {
      xb = torch::empty({M, ku * 2}, x.options().dtype(torch::kBFloat16));
      if (bf16_out) {
        gemm::to_bf16_rows(xb.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), M, K);
      } else {
        gemm::to_bf16_rows(xb.data_ptr<c10::BFloat16>(), x.data_ptr<float>(), M, K);
      }
    }
    const int32_t* xs = reinterpret_cast<const int32_t*>(xb.data_ptr<c10::BFloat16>());
    gemm::run_dp(y32, xs, M, K, packed.data_ptr<c10::BFloat16>(), N, finish);
    return y;
  }
#endif
  const torch::Tensor xf = bf16_out ? x.to(torch::kFloat32) : x;
  if (packed.scalar_type() == torch::kFloat32) {
    gemm::run_f32(y32, xf.data_ptr<float>(), M, K, packed.data_ptr<float>(), N, finish);
  } else {
    gemm::run_f32(y32, xf.data_ptr<float>(), M, K, packed.data_ptr<c10::BFloat16>(), N, finish);
  }
  return y;
}

}  // namespace pagedllm
