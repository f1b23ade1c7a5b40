// W8A8: y[M, N] = (s_x q_x)[M, K] ((q_w - z) s_w)[N, K]^T (+ bias) with int8 weight codes and
// activations quantized per row at each call (s_x = absmax / 127, q_x = round-half-even(x / s_x)
// in [-127, 127], as quantization/qgemm.py defines it), the integer dot products exact in int32
// per weight group, then scaled in float32.
//
// Weight layout (quantization/packed_qweight.py): [ceil(N/16), K/4, 16, 4] int8, four
// consecutive k of one row per 32-bit lane, so one 64-byte line holds 4 k of a 16-row panel.
// With AVX512-VNNI (checked at run time; the avx512 levels' -m flags do not include it, so the
// kernel is compiled for it with a target attribute) each line is one vpdpbusd per row of x: it
// multiplies unsigned bytes by signed ones, so activations go in as q_x + 128 and the group's
// 128 * sum(q_w) (colsum, made at load) is subtracted from each group's sum. Zero points
// subtract z * sum(q_x) per group. Without VNNI: plain integer loops (the same exact sums).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "packed_gemm.h"
#include "quant_gemm.h"
#include "vec.h"

namespace pagedllm {
namespace qgemm_i8 {

constexpr int64_t kPanel = 16;

struct Weights {
  const int8_t* packed;  // [P, K/4, 16, 4]
  const float* sc;       // [P, G, 16]
  const float* zp;       // [P, G, 16] or null
  const int32_t* colsum; // [P, G, 16]: 128 * the group's sum of codes
  int64_t N, K, gs, G;
};

// Rows of x (float32 [M, K]) as unsigned bytes q + 128, their scales, and per-group sums of q
// (qs, when not null).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t gs, uint8_t* xu, float* sx, float* qs) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(r[k]));
    float s = amax / 127.0f;
    if (!(s > 0.0f)) s = 1.0f;
    sx[m] = s;
    for (int64_t k = 0; k < K; ++k) {
      const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(r[k] / s)));
      xu[m * K + k] = static_cast<uint8_t>(static_cast<int>(q) + 128);
    }
    if (qs != nullptr)
      for (int64_t g = 0; g < K / gs; ++g) {
        int32_t sum = 0;
        for (int64_t k = g * gs; k < (g + 1) * gs; ++k) sum += static_cast<int32_t>(xu[m * K + k]) - 128;
        qs[m * (K / gs) + g] = static_cast<float>(sum);
      }
  }
}

// Rows i < R, columns [16 p, 16 p + cols) of y with plain integer loops.
template <typename O>
void tile_scalar(const Weights& w, int64_t p, int64_t R, const uint8_t* xu, const float* sx, const float* qs, O* y,
                 int64_t ldy, const float* bias, int64_t cols) {
  const int64_t G = w.G, kq = w.K / 4;
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t pp = p + c / kPanel, j = c % kPanel;
    const int8_t* col = w.packed + pp * kq * kPanel * 4 + j * 4;
    for (int64_t i = 0; i < R; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int64_t k = g * w.gs; k < (g + 1) * w.gs; ++k)
          dot += static_cast<int32_t>(xu[i * w.K + k]) * col[(k / 4) * kPanel * 4 + k % 4];
        const int64_t gi = (pp * G + g) * kPanel + j;
        float t = static_cast<float>(dot - w.colsum[gi]);
        if (w.zp != nullptr) t -= w.zp[gi] * qs[i * G + g];
        acc += t * w.sc[gi];
      }
      y[i * ldy + c] = from_float<O>(acc * sx[i] + (bias != nullptr ? bias[c] : 0.0f));
    }
  }
}

#ifdef PAGEDLLM_AVX512
constexpr int kR = 4, kNP = 2, kNP1 = 4;

template <int R, int NP, typename O>
__attribute__((target("avx512vnni"))) void micro_vnni(const Weights& w, int64_t p, const uint8_t* xu, const float* sx,
                                                      const float* qs, O* y, int64_t ldy, const float* bias,
                                                      int64_t cols) {
  const int64_t G = w.G, pb = w.K * kPanel;  // bytes per panel
  const int8_t* base = w.packed + p * pb;
  __m512 acc[R][NP];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i part[R][NP];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) part[i][j] = _mm512_setzero_si512();
    for (int64_t k = g * w.gs; k < (g + 1) * w.gs; k += 4) {
      __m512i wv[NP];
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) wv[j] = _mm512_loadu_si512(base + j * pb + k * kPanel);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        int32_t quad;
        __builtin_memcpy(&quad, xu + i * w.K + k, 4);
        const __m512i a = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) part[i][j] = _mm512_dpbusd_epi32(part[i][j], a, wv[j]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const int64_t gi = ((p + j) * G + g) * kPanel;
      const __m512i cs = _mm512_loadu_si512(w.colsum + gi);
      const __m512 s = _mm512_loadu_ps(w.sc + gi);
      const __m512 z = w.zp != nullptr ? _mm512_loadu_ps(w.zp + gi) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(part[i][j], cs));
        if (w.zp != nullptr) t = _mm512_fnmadd_ps(z, _mm512_set1_ps(qs[i * G + g]), t);
        acc[i][j] = _mm512_fmadd_ps(t, s, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const __mmask16 m = lanes16(cols - j * kPanel);
    const __m512 b = bias != nullptr ? load16(bias + j * kPanel, m) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) store16(y + i * ldy + j * kPanel, _mm512_fmadd_ps(acc[i][j], _mm512_set1_ps(sx[i]), b), m);
  }
}
#else
constexpr int kR = 4, kNP = 1, kNP1 = 1;
#endif

inline bool has_vnni() {
#ifdef PAGEDLLM_AVX512
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

template <typename O>
void run(const Weights& w, const uint8_t* xu, int64_t M, const float* sx, const float* qs, O* y, const float* bias,
         bool vnni) {
  const int64_t panels = (w.N + kPanel - 1) / kPanel, np = M == 1 ? kNP1 : kNP;
  const int64_t tasks = (panels + np - 1) / np;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t p = t * np, n0 = p * kPanel, cols = std::min(np * kPanel, w.N - n0);
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    for (int64_t m = 0; m < M; m += kR) {
      const int64_t r = std::min<int64_t>(kR, M - m);
      const float* q = qs != nullptr ? qs + m * w.G : nullptr;
#ifdef PAGEDLLM_AVX512
      if (vnni) {
        constexpr int NPmax = kNP1 > kNP ? kNP1 : kNP;
        gemm::upto<NPmax>((cols + kPanel - 1) / kPanel, [&](auto qq) {
          gemm::upto<kR>(r, [&](auto rr) {
            micro_vnni<rr.value, qq.value>(w, p, xu + m * w.K, sx + m, q, y + m * w.N + n0, w.N, b, cols);
          });
        });
        continue;
      }
#endif
      (void)vnni;
      tile_scalar(w, p, r, xu + m * w.K, sx + m, q, y + m * w.N + n0, w.N, b, cols);
    }
  }
}

}  // namespace qgemm_i8

// W8A8 y = x W^T (+ bias): packed [P, K/4, 16, 4] int8 (as uint8), sc / zp [P, G, 16] float32,
// colsum [P, G, 16] int32, perm the act-order column order; x float32 / bf16 [M, K], y in x's
// dtype. vnni=false forces the integer loops (tests compare both).
inline torch::Tensor quant_linear_i8(torch::Tensor x, torch::Tensor packed, torch::Tensor sc, std::optional<torch::Tensor> zp,
                                     torch::Tensor colsum, int64_t N, int64_t group_size, std::optional<torch::Tensor> perm,
                                     std::optional<torch::Tensor> bias, bool vnni) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "quant_linear_i8: contiguous float32 or bfloat16 x [M, K] expected");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + qgemm::kPanel - 1) / qgemm::kPanel;
  TORCH_CHECK(group_size > 0 && group_size % 4 == 0 && K % group_size == 0, "quant_linear_i8: group size ",
              group_size, " must be a multiple of 4 dividing K = ", K);
  const int64_t G = K / group_size;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == panels && packed.size(1) == K / 4 && packed.size(2) == 16 && packed.size(3) == 4,
              "quant_linear_i8: weight packed [", panels, ", ", K / 4, ", 16, 4] expected");
  auto check_groups = [&](const torch::Tensor& t, at::ScalarType dt, const char* what) {
    TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.dim() == 3 && t.size(0) == panels && t.size(1) == G &&
                    t.size(2) == 16,
                "quant_linear_i8: ", what, " must be [", panels, ", ", G, ", 16] of ", dt);
  };
  check_groups(sc, at::kFloat, "scales");
  check_groups(colsum, at::kInt, "colsum");
  const bool zeros = zp.has_value() && zp->defined();
  if (zeros) check_groups(*zp, at::kFloat, "zero points");
  if (perm.has_value() && perm->defined())
    TORCH_CHECK(perm->scalar_type() == torch::kInt64 && perm->is_contiguous() && perm->numel() == K,
                "quant_linear_i8: int64 permutation of K entries expected");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "quant_linear_i8: float32 bias of N elements expected");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xf = gather_input(x, perm, group_size, false).first;
  auto xu = torch::empty({M, K}, x.options().dtype(at::kByte));
  auto sx = torch::empty({M}, x.options().dtype(torch::kFloat32));
  auto qs = torch::empty({zeros ? M : 0, G}, x.options().dtype(torch::kFloat32));
  qgemm_i8::quantize_rows(xf.data_ptr<float>(), M, K, group_size, xu.data_ptr<uint8_t>(), sx.data_ptr<float>(),
                          zeros ? qs.data_ptr<float>() : nullptr);
  const qgemm_i8::Weights w{reinterpret_cast<const int8_t*>(packed.data_ptr<uint8_t>()), sc.data_ptr<float>(),
                            zeros ? zp->data_ptr<float>() : nullptr, colsum.data_ptr<int32_t>(), N, K, group_size, G};
  const bool use_vnni = vnni && qgemm_i8::has_vnni();
  const float* qsp = zeros ? qs.data_ptr<float>() : nullptr;
  if (x.scalar_type() == torch::kBFloat16) {
    qgemm_i8::run(w, xu.data_ptr<uint8_t>(), M, sx.data_ptr<float>(), qsp, y.data_ptr<c10::BFloat16>(), b, use_vnni);
  } else {
    qgemm_i8::run(w, xu.data_ptr<uint8_t>(), M, sx.data_ptr<float>(), qsp, y.data_ptr<float>(), b, use_vnni);
  }
  return y;
}

// Whether quant_linear_i8 runs vpdpbusd here (an AVX-512 build on a CPU with AVX512-VNNI).
inline bool int8_dot_path_vnni() { return qgemm_i8::has_vnni(); }

}  // namespace pagedllm
