// Paged decode attention for CPU (float32 or bfloat16 KV cache, float32 arithmetic).
//
// Each task (a sequence, or one kv head of it) reads its keys and values straight from the KV cache blocks
// through the block table -- no gathered copy, no padding -- and keeps an online softmax, so
// every K/V row is loaded from memory once for all the query heads that share it (GQA).
// With AVX2+FMA the scores of 8 positions are computed together (one transpose-reduce per
// 8 dot products), exponentials are vectorised (Cody-Waite range reduction + degree-5
// polynomial, about 1 ulp), and the value update is one FMA per 8 lanes. Without AVX2 the
// same algorithm runs on scalars.
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace pagedllm {
namespace decode {

// One sequence and a range of its kv heads. A task takes all kv heads when there are enough
// sequences to keep every thread busy, so it reads each position's K/V row (all heads)
// contiguously -- whole blocks in order, which the hardware prefetcher streams.
struct Task {
  const float* q;     // [nkv * G, D] query heads of these kv heads, already scaled, float32
  int64_t n;          // number of attended positions
  int64_t start;      // first attended position (sliding window)
  const int32_t* bt;  // block table row
  int64_t bs;         // block size
  int64_t row_stride; // elements between consecutive positions (Hkv * D)
  int64_t head_off;   // first kv head * D
  int64_t nkv, G, D;  // kv heads in this task, query heads per kv head, head dim
};

template <typename T>
inline const T* row_ptr(const T* cache, const Task& t, int64_t pos) {
  const int64_t block = t.bt[pos / t.bs];
  return cache + (block * t.bs + pos % t.bs) * t.row_stride + t.head_off;
}

#ifdef PAGEDLLM_AVX2
// Lane t of the result = sum of the 8 lanes of a[t].
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

template <typename T>
void attend(const Task& t, const T* kc, const T* vc, float* acc /*[nkv * G, D]*/, float* m, float* l) {
  const int64_t R = t.nkv * t.G, G = t.G, D = t.D;
  for (int64_t r = 0; r < R; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  std::fill(acc, acc + R * D, 0.0f);
  const T* krow[8];
  const T* vrow[8];
  alignas(32) float p[8];
  for (int64_t base = 0; base < t.n; base += 8) {
    const int64_t valid = std::min<int64_t>(8, t.n - base);
    for (int64_t i = 0; i < 8; ++i) {  // tail lanes repeat the last row; their weight is zeroed
      const int64_t pos = t.start + base + std::min<int64_t>(i, valid - 1);
      krow[i] = row_ptr(kc, t, pos);
      vrow[i] = row_ptr(vc, t, pos);
    }
    const __m256 lane_ok = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t hoff = (r / G) * D;  // this query head's kv head within the row
      const float* qr = t.q + r * D;
      __m256 dots[8];
      for (int i = 0; i < 8; ++i) dots[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + d);
        for (int i = 0; i < 8; ++i) dots[i] = _mm256_fmadd_ps(qv, load8(krow[i] + hoff + d), dots[i]);
      }
      __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), transpose_sum8(dots), lane_ok);
      const float m_new = std::max(m[r], hmax(sc));
      const float alpha = std::exp(m[r] - m_new);  // 0 on the first tile (m = -inf)
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(sc, _mm256_set1_ps(m_new))), lane_ok);
      l[r] = l[r] * alpha + hsum(e);
      m[r] = m_new;
      _mm256_store_ps(p, e);
      float* ar = acc + r * D;
      const __m256 av = _mm256_set1_ps(alpha);
      for (int64_t d = 0; d < D; d += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ar + d), av);
        for (int64_t i = 0; i < valid; ++i) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), load8(vrow[i] + hoff + d), a);
        _mm256_storeu_ps(ar + d, a);
      }
    }
  }
}
#else
template <typename T>
void attend(const Task& t, const T* kc, const T* vc, float* acc, float* m, float* l) {
  const int64_t R = t.nkv * t.G, G = t.G, D = t.D;
  for (int64_t r = 0; r < R; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  std::fill(acc, acc + R * D, 0.0f);
  for (int64_t i = 0; i < t.n; ++i) {
    const T* kr = row_ptr(kc, t, t.start + i);
    const T* vr = row_ptr(vc, t, t.start + i);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t hoff = (r / G) * D;
      const float* qr = t.q + r * D;
      float s = 0.0f;
      for (int64_t d = 0; d < D; ++d) s += qr[d] * to_float(kr[hoff + d]);
      const float m_new = std::max(m[r], s);
      const float alpha = std::exp(m[r] - m_new), w = std::exp(s - m_new);
      l[r] = l[r] * alpha + w;
      m[r] = m_new;
      float* ar = acc + r * D;
      for (int64_t d = 0; d < D; ++d) ar[d] = ar[d] * alpha + w * to_float(vr[hoff + d]);
    }
  }
}
#endif

template <typename T>
void run(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
         torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t sliding_window) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv, max_blocks = block_table.size(1);
  const T* q = query.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // Whole sequences per task when they alone keep the threads busy, else one kv head each.
  const int64_t nkv = B >= 2 * omp_get_max_threads() ? Hkv : 1;
  const int64_t splits = Hkv / nkv;
#pragma omp parallel
  {
    std::vector<float> qs(nkv * G * D), acc(nkv * G * D), m(nkv * G), l(nkv * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * splits; ++task) {
      const int64_t b = task / splits, h0 = (task % splits) * nkv;
      const int64_t L = sl[b];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, L - sliding_window) : 0;
      const int64_t rows = nkv * G;
      const T* qh = q + (b * H + h0 * G) * D;
      for (int64_t i = 0; i < rows * D; ++i) qs[i] = to_float(qh[i]) * fscale;
      const Task t{qs.data(), L - start, start, bt + b * max_blocks, bs, Hkv * D, h0 * D, nkv, G, D};
      attend<T>(t, kc, vc, acc.data(), m.data(), l.data());
      T* oh = o + (b * H + h0 * G) * D;
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) oh[r * D + d] = from_float<T>(acc[r * D + d] * inv);
      }
    }
  }
}

}  // namespace decode

inline void paged_decode_attention(torch::Tensor out,          // [B, H, D]
                            torch::Tensor query,        // [B, H, D], same dtype as the cache
                            torch::Tensor key_cache,    // [num_blocks, block_size, Hkv, D]
                            torch::Tensor value_cache,  // [num_blocks, block_size, Hkv, D]
                            torch::Tensor block_table,  // [B, max_blocks] int32
                            torch::Tensor seq_lens,     // [B] int32
                            double scale, int64_t sliding_window) {
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "paged_decode_attention: float32 or bfloat16 cache");
  TORCH_CHECK(query.scalar_type() == dtype && out.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "paged_decode_attention: query, out and cache dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: int32 block table and seq lens expected");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors expected");
  TORCH_CHECK(query.size(2) % 8 == 0, "paged_decode_attention: head_dim must be a multiple of 8");
  using decode::run;
  if (dtype == torch::kFloat32) {
    run<float>(out, query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window);
  } else {
    run<c10::BFloat16>(out, query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window);
  }
}

}  // namespace pagedllm
