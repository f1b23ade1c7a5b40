// y[M, N] = x[M, K] w[N, K]^T (+ bias) for the linear layers, float32 arithmetic, with the weight
// pre-packed once into 16-column panels: packed[p, k, j] = w[16 p + j, k] (zero rows past N), so
// a panel's k-th 16 outputs' weights are one 64-byte line and a panel streams sequentially.
//
// The microkernel keeps a 6 x 16 tile of y in 12 AVX2 registers; each k broadcasts 6 values of x
// and loads two 8-wide vectors of the panel for 12 FMAs. Decode-sized products (M <= kMc) go panel
// by panel, each panel read from memory once, front to back (its first tile prefetching ahead),
// in dynamically handed out groups of panels; x is re-read from cache for every panel (measured
// still ahead of the blocked order with K = 8192). Larger products are blocked as in
// GotoBLAS/BLIS: a K-block of a panel (kc x 16) stays in L1 while the x rows of an M-block
// (mc x kc, in L2) pass by six at a time, threads taking contiguous ranges of panels. Weights may
// be float32 or bfloat16 (widened on load: bf16 -> f32 is exact).
#pragma once

#include <omp.h>

#include <algorithm>

#include "vec.h"

namespace pagedllm {
namespace gemm {

constexpr int64_t kPanel = 16;  // output columns per packed panel
constexpr int kMR = 6;          // rows of x per microkernel call
constexpr int64_t kKc = 256;    // k per block: a 16 KB float32 panel slice in L1
constexpr int64_t kMc = 96;     // rows of x per block: 96 x 256 floats = 96 KB in L2
constexpr int64_t kPrefetch = 32; // k ahead (= 64-byte lines of a float32 panel) the first tile prefetches
constexpr int64_t kGroup = 4;   // panels per task of a decode-sized product

#ifdef PAGEDLLM_AVX2
// c[i, 0:cols] (+)= sum over k < kc of a[i, k] * b[k, 0:16], i < MR; b is a packed panel slice.
template <int MR, typename W, bool PF = false>
inline void micro(const float* a, int64_t lda, const W* b, int64_t kc, float* c, int64_t ldc, bool accumulate,
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

// The rows < MR left after the full tiles of an M-block.
template <int MR, typename W, bool PF = false>
inline void micro_tail(int64_t rows, const float* a, int64_t lda, const W* b, int64_t kc, float* c, int64_t ldc,
                       bool accumulate, int64_t cols) {
  if constexpr (MR > 1) {
    if (rows == MR - 1) return micro<MR - 1, W, PF>(a, lda, b, kc, c, ldc, accumulate, cols);
    return micro_tail<MR - 1, W, PF>(rows, a, lda, b, kc, c, ldc, accumulate, cols);
  }
}
#endif

// y rows [0, mc) (+)= x rows [0, mc) times one K-block slice b (kc x 16) of a panel; c is the
// panel's first output column of y, cols of its 16 are real.
template <typename W>
inline void slice(const float* x, int64_t K, int64_t mc, const W* b, int64_t kc, float* c, int64_t N,
                  bool accumulate, int64_t cols, bool streamed) {
#ifdef PAGEDLLM_AVX2
  int64_t m = 0;
  if (streamed) {  // read from memory (the panels of a decode-sized product, once, in order): the
    m = std::min(mc, static_cast<int64_t>(kMR));  // first tile prefetches ahead along the panel
    if (m == kMR) {
      micro<kMR, W, true>(x, K, b, kc, c, N, accumulate, cols);
    } else {
      micro_tail<kMR, W, true>(m, x, K, b, kc, c, N, accumulate, cols);
    }
  }
  for (; m + kMR <= mc; m += kMR) micro<kMR, W>(x + m * K, K, b, kc, c + m * N, N, accumulate, cols);
  if (m < mc) micro_tail<kMR, W>(mc - m, x + m * K, K, b, kc, c + m * N, N, accumulate, cols);
#else
  (void)streamed;
  for (int64_t i = 0; i < mc; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      float s = accumulate ? c[i * N + j] : 0.0f;
      for (int64_t k = 0; k < kc; ++k) s += x[i * K + k] * to_float(b[k * kPanel + j]);
      c[i * N + j] = s;
    }
#endif
}

// y[rows, n0:n1] += bias[n0:n1]
inline void add_bias(float* y, int64_t N, int64_t rows, const float* bias, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
}

template <typename W>
void run(float* y, const float* x, int64_t M, int64_t K, const W* packed, int64_t N, const float* bias) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // Work is handed out dynamically: a thread that enters the parallel region late (woken from
  // sleep after Python ran between two products) takes less of it instead of everyone waiting.
  if (M <= kMc) {
    // Decode-sized: x stays in L2 and each panel is read from memory once, front to back; tasks
    // of kGroup panels.
    const int64_t groups = (panels + kGroup - 1) / kGroup;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t p = g * kGroup; p < std::min(panels, (g + 1) * kGroup); ++p)
        for (int64_t k0 = 0; k0 < K; k0 += kKc)
          slice(x + k0, K, M, packed + (p * K + k0) * kPanel, std::min(kKc, K - k0), y + p * kPanel, N, k0 > 0,
                std::min(kPanel, N - p * kPanel), true);
      if (bias != nullptr) add_bias(y, N, M, bias, g * kGroup * kPanel, std::min(N, (g + 1) * kGroup * kPanel));
    }
  } else {
#pragma omp parallel
    {
      // Prefill-sized: per K-block, each M-block of x (in L2) meets every panel slice of this
      // thread's contiguous range of panels.
      const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
      const int64_t p0 = panels * tid / nt, p1 = panels * (tid + 1) / nt;
      for (int64_t k0 = 0; k0 < K; k0 += kKc)
        for (int64_t m0 = 0; m0 < M; m0 += kMc)
          for (int64_t p = p0; p < p1; ++p)
            slice(x + m0 * K + k0, K, std::min(kMc, M - m0), packed + (p * K + k0) * kPanel, std::min(kKc, K - k0),
                  y + m0 * N + p * kPanel, N, k0 > 0, std::min(kPanel, N - p * kPanel), false);
      if (bias != nullptr) add_bias(y, N, M, bias, std::min(N, p0 * kPanel), std::min(N, p1 * kPanel));
    }
  }
}

}  // namespace gemm

// y = x w^T (+ bias): x [M, K] float32 (rows contiguous), packed [ceil(N / 16), K, 16] float32 or
// bfloat16 (layers/cpu_gemm.py pack_panels), bias [N] float32 or None; returns y [M, N] float32.
inline torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "packed_linear: contiguous float32 x [M, K] expected");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == gemm::kPanel && packed.size(1) == x.size(1) &&
                  packed.size(0) == (N + gemm::kPanel - 1) / gemm::kPanel && packed.is_contiguous(),
              "packed_linear: weight packed as [ceil(N / 16), K, 16] expected");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 || packed.scalar_type() == torch::kBFloat16,
              "packed_linear: float32 or bfloat16 weight expected");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "packed_linear: float32 bias of N elements expected");
    b = bias->data_ptr<float>();
  }
  if (x.size(0) == 0 || x.size(1) == 0) {  // nothing to multiply: an empty or all-bias product
    auto y = torch::zeros({x.size(0), N}, x.options());
    return bias.has_value() && bias->defined() ? y + *bias : y;
  }
  auto y = torch::empty({x.size(0), N}, x.options());
  if (packed.scalar_type() == torch::kFloat32) {
    gemm::run<float>(y.data_ptr<float>(), x.data_ptr<float>(), x.size(0), x.size(1), packed.data_ptr<float>(), N, b);
  } else {
    gemm::run<c10::BFloat16>(y.data_ptr<float>(), x.data_ptr<float>(), x.size(0), x.size(1),
                             packed.data_ptr<c10::BFloat16>(), N, b);
  }
  return y;
}

}  // namespace pagedllm
