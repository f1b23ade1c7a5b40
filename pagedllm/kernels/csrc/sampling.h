// Categorical sampling from logits, one row per request, without materialising probabilities:
// per row, the maximum m, the softmax denominator s = sum_j e^{(x_j - m) / T}, then one uniform
// u in [0, 1) picks the first token whose running sum of e^{(x_j - m) / T} exceeds u * s (the
// inverse CDF). Two full passes over the row and a partial third, against the seven or so the
// torch path makes (divide, softmax, exponential noise, divide, argmax). Rows with temperature
// 0 take the argmax (the first maximum) instead.
//
// The uniforms come from the caller, drawn per row from the request's own generator when it is
// seeded, so a seeded request samples the same tokens whatever batch it is in.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace pagedllm {
namespace sampling {

constexpr int64_t kParallelElems = 1 << 15;

// Index of the first maximum of x[0:V] (NaN never wins here: logits are finite or -inf).
inline int64_t first_max(const float* x, int64_t V, float* max_out) {
  float m = -INFINITY;
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= V; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  m = hmax(mv);
#endif
  for (; i < V; ++i) m = x[i] > m ? x[i] : m;
  *max_out = m;
  int64_t j = 0;
  while (j < V && !(x[j] == m)) ++j;
  return j < V ? j : 0;
}

// sum_j e^{(x_j - m) * inv_t} over x[0:V]; -inf logits contribute exactly 0.
inline float exp_sum(const float* x, int64_t V, float m, float inv_t) {
  float s = 0.f;
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  const __m256 mv = _mm256_set1_ps(m), it = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= V; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    acc0 = _mm256_add_ps(acc0, _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(a, mv), it)),
                                             _mm256_cmp_ps(a, ninf, _CMP_NEQ_OQ)));
    acc1 = _mm256_add_ps(acc1, _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(b, mv), it)),
                                             _mm256_cmp_ps(b, ninf, _CMP_NEQ_OQ)));
  }
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < V; ++i) s += x[i] == -INFINITY ? 0.f : std::exp((x[i] - m) * inv_t);
  return s;
}

// The first j whose running sum of e^{(x_j - m) * inv_t} exceeds target; blocks of 16 are
// summed vectorised and only the block holding the crossing is walked one by one. Rounding can
// leave the running sum a hair below a target near s: then the last token with weight wins.
inline int64_t inverse_cdf(const float* x, int64_t V, float m, float inv_t, float target) {
  float acc = 0.f;
  int64_t i = 0;
  int64_t last_positive = -1;
#ifdef PAGEDLLM_AVX2
  const __m256 mv = _mm256_set1_ps(m), it = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY);
  for (; i + 16 <= V; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 ea = _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(a, mv), it)), _mm256_cmp_ps(a, ninf, _CMP_NEQ_OQ));
    const __m256 eb = _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(b, mv), it)), _mm256_cmp_ps(b, ninf, _CMP_NEQ_OQ));
    const float block = hsum(_mm256_add_ps(ea, eb));
    if (acc + block > target) break;  // the crossing is in this block: walk it below
    acc += block;
    if (block > 0.f) last_positive = i + 15;  // refined below if the walk reaches the end
  }
#endif
  for (; i < V; ++i) {
    if (x[i] == -INFINITY) continue;
    const float e = std::exp((x[i] - m) * inv_t);
    if (e > 0.f) last_positive = i;
    acc += e;
    if (acc > target && e > 0.f) return i;
  }
  // Fell off the end by rounding: the last token with weight (a vector block's last index may
  // be a -inf logit, so look back for a finite one).
  int64_t j = last_positive < 0 ? V - 1 : last_positive;
  while (j > 0 && x[j] == -INFINITY) --j;
  return j;
}

// out[r] = a token drawn from softmax(logits[r] / temperature[r]) with uniform u[r] (argmax
// where temperature[r] == 0). logits float32 [B, V] with contiguous rows.
inline void sample_rows(torch::Tensor out, torch::Tensor logits, torch::Tensor temperature, torch::Tensor uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_rows: non-empty float32 rows expected");
  const int64_t B = logits.size(0), V = logits.size(1), xs = logits.stride(0);
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == B, "sample_rows: int64 out [B]");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == B,
              "sample_rows: float32 temperature [B]");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous() && uniforms.numel() == B,
              "sample_rows: float32 uniforms [B]");
  const float* xp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel for if (B * V >= kParallelElems)
  for (int64_t r = 0; r < B; ++r) {
    const float* x = xp + r * xs;
    float m;
    const int64_t best = first_max(x, V, &m);
    if (tp[r] <= 0.f || m == -INFINITY || !std::isfinite(m)) {
      op[r] = best;
      continue;
    }
    const float inv_t = 1.f / tp[r];
    const float s = exp_sum(x, V, m, inv_t);
    op[r] = inverse_cdf(x, V, m, inv_t, up[r] * s);
  }
}

// Structured outputs: -inf on logits[rows[r], j] wherever bit j of bitmask[r] is 0 (bit j % 32 of
// int32 word j / 32: xgrammar's layout); ids past the bitmask are disallowed too. Grammars mostly
// allow or forbid whole words, so an all-ones word costs one compare and the rest are masked
// stores of -inf (16 lanes per AVX-512 store): the pass is bound by reading the bitmask and
// writing the forbidden logits, not by the bit tests.
inline void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat,
              "apply_token_bitmask: float32 logits [B, V] with unit column stride");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_token_bitmask: int64 rows [R]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1 &&
                  bitmask.size(0) == rows.size(0),
              "apply_token_bitmask: int32 bitmask [R, W], one row per entry of rows");
  const int64_t B = logits.size(0), V = logits.size(1), ls = logits.stride(0);
  const int64_t R = rows.size(0), W = bitmask.size(1), bs = bitmask.stride(0);
  float* L = logits.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < B, "apply_token_bitmask: row out of range");
  const int64_t covered = std::min<int64_t>(V, W * 32);
#pragma omp parallel for if (R * V >= kParallelElems)
  for (int64_t r = 0; r < R; ++r) {
    float* x = L + rp[r] * ls;
    const uint32_t* b = bits + r * bs;
    int64_t k = 0;
#ifdef PAGEDLLM_AVX512
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (; (k + 1) * 32 <= covered; ++k) {
      const uint32_t w = b[k];
      if (w == 0xFFFFFFFFu) continue;
      _mm512_mask_storeu_ps(x + k * 32, static_cast<__mmask16>(~w & 0xFFFFu), ninf);
      _mm512_mask_storeu_ps(x + k * 32 + 16, static_cast<__mmask16>(~w >> 16), ninf);
    }
#endif
    for (; k * 32 < covered; ++k) {
      const uint32_t w = b[k];
      if (w == 0xFFFFFFFFu) continue;
      const int64_t base = k * 32, n = std::min<int64_t>(32, covered - base);
      for (int64_t i = 0; i < n; ++i)
        if (!((w >> i) & 1u)) x[base + i] = -INFINITY;
    }
    for (int64_t j = covered; j < V; ++j) x[j] = -INFINITY;
  }
}

}  // namespace sampling
}  // namespace pagedllm
