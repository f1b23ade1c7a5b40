// Paged decode attention for CPU (float32 or bfloat16 KV cache -- bfloat16 under a float32 query
// too -- or an 8-bit one -- int8, fp8 e4m3/e5m2 -- with a bfloat16 scale per token and kv head;
// float32 arithmetic).
//
// Each task (a sequence, or one kv head of it) reads its keys and values straight from the KV
// cache blocks through the block table -- no gathered copy, no padding. With AVX2+FMA a task
// makes three passes: all scores (each K row loaded from memory once for every query head that
// shares it, GQA, and from L1 once per register-blocked pair of those heads),
// then an exact softmax per head vectorised over positions, then the weighted sum of V rows
// (each loaded once). The next cache block is prefetched while the current one is computed on.
// AVX-512 builds run the score and value passes with 16-lane tiles where the head dim is a
// multiple of 16 (three query heads of a kv head register-blocked together); the prefill kernel
// shares these passes. Without AVX2 an online-softmax loop runs on scalars.
#pragma once

#include <omp.h>

#include <algorithm>
#include <optional>
#include <utility>
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

// rows[i] = row_ptr(cache, t, pos + min(i, valid - 1)) for i < count, with one division: the
// lanes past `valid` repeat the last valid row.
template <typename T>
inline void fill_rows(const T* cache, const Task& t, int64_t pos, int64_t count, int64_t valid, const T** rows) {
  int64_t blk = pos / t.bs, off = pos - blk * t.bs;
  if (valid == count && off + count <= t.bs) {  // all in one block: rows at a fixed stride
    const T* first = cache + (static_cast<int64_t>(t.bt[blk]) * t.bs + off) * t.row_stride + t.head_off;
    for (int64_t i = 0; i < count; ++i) rows[i] = first + i * t.row_stride;
    return;
  }
  const T* cur = nullptr;
  for (int64_t i = 0; i < count; ++i) {
    if (i < valid) {
      cur = cache + (static_cast<int64_t>(t.bt[blk]) * t.bs + off) * t.row_stride + t.head_off;
      if (++off == t.bs) off = 0, ++blk;
    }
    rows[i] = cur;
  }
}

// The scale of an 8-bit cache row: position pos of kv head h (sc: [num_slots, Hkv] bfloat16).
inline float row_scale(const c10::BFloat16* sc, const Task& t, int64_t pos, int64_t h) {
  const int64_t Hkv = t.row_stride / t.D;
  return static_cast<float>(sc[(static_cast<int64_t>(t.bt[pos / t.bs]) * t.bs + pos % t.bs) * Hkv + h]);
}

// 8-bit cache: the scores of its unscaled rows (or the softmax weights of its values) times each
// position's row scale, s[r * ls + j] *= scale(t.start + j, kv head of r) for j < t.n; rows go
// rows_per_head to a kv head from the task's first. Dequantizing this way costs one multiply per
// (row, position) instead of one per element, and no dequantized copy of the cache is made.
inline void apply_scales(const Task& t, const c10::BFloat16* sc, int64_t R, int64_t rows_per_head, float* s,
                         int64_t ls) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < t.n) buf.resize(t.n);
  const int64_t Hkv = t.row_stride / t.D;
  for (int64_t r0 = 0, h = t.head_off / t.D; r0 < R; r0 += rows_per_head, ++h) {
    int64_t blk = t.start / t.bs, off = t.start % t.bs;
    for (int64_t j = 0; j < t.n; ++j) {
      buf[j] = static_cast<float>(sc[(static_cast<int64_t>(t.bt[blk]) * t.bs + off) * Hkv + h]);
      if (++off == t.bs) off = 0, ++blk;
    }
    for (int64_t r = r0; r < r0 + rows_per_head; ++r) {
      float* sr = s + r * ls;
      for (int64_t j = 0; j < t.n; ++j) sr[j] *= buf[j];
    }
  }
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

// Scores of NG query heads that share one kv head, for the 8 positions of krow, into rows of s
// (stride ls); invalid lanes get -inf. Every K vector loaded feeds NG FMAs (the load ports, not
// the FMA units, bound a one-head-at-a-time loop); NP positions per pass keep NG * NP
// accumulators plus the operands within the 16 AVX2 registers.
template <int NG, int NP, typename T>
inline void score_tile(const float* q /*[NG, D]*/, const T* const* krow, int64_t hoff, int64_t D, __m256 lane_ok,
                       float* s, int64_t ls) {
  __m256 dots[NG][8];
  for (int p0 = 0; p0 < 8; p0 += NP) {
    __m256 part[NG][NP];
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < NP; ++i) part[g][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qv[NG];
      for (int g = 0; g < NG; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
      for (int i = 0; i < NP; ++i) {
        const __m256 kv = load8(krow[p0 + i] + hoff + d);
        for (int g = 0; g < NG; ++g) part[g][i] = _mm256_fmadd_ps(qv[g], kv, part[g][i]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < NP; ++i) dots[g][p0 + i] = part[g][i];
  }
  for (int g = 0; g < NG; ++g)
    _mm256_storeu_ps(s + g * ls, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), transpose_sum8(dots[g]), lane_ok));
}

// acc rows of NG heads += sum over the cnt positions of vrow of weight * v (weights: rows of w,
// stride ls). NG x 4 accumulators (32 dims per head) stay in registers across the positions.
template <int NG, typename T>
inline void value_tile(const float* w, int64_t ls, const T* const* vrow, int64_t cnt, int64_t hoff, int64_t D,
                       float* acc /*[NG, D]*/) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    __m256 a[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm256_loadu_ps(acc + g * D + d0 + 8 * j);
    for (int64_t i = 0; i < cnt; ++i) {
      __m256 pb[NG];
      for (int g = 0; g < NG; ++g) pb[g] = _mm256_broadcast_ss(w + g * ls + i);
      for (int j = 0; j < 4; ++j) {
        const __m256 vv = load8(vrow[i] + hoff + d0 + 8 * j);
        for (int g = 0; g < NG; ++g) a[g][j] = _mm256_fmadd_ps(pb[g], vv, a[g][j]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + g * D + d0 + 8 * j, a[g][j]);
  }
  for (; d0 < D; d0 += 8) {  // head dims that are not a multiple of 32
    for (int g = 0; g < NG; ++g) {
      __m256 a = _mm256_loadu_ps(acc + g * D + d0);
      for (int64_t i = 0; i < cnt; ++i) a = _mm256_fmadd_ps(_mm256_broadcast_ss(w + g * ls + i), load8(vrow[i] + hoff + d0), a);
      _mm256_storeu_ps(acc + g * D + d0, a);
    }
  }
}

#ifdef PAGEDLLM_AVX512
// AVX-512 forms of score_tile / value_tile for head dims that are a multiple of 16: half the
// instructions per K/V row of the AVX2 tiles, and the 32 zmm registers hold three query heads'
// accumulators (a kv head's whole group for 3:1 GQA) where AVX2 has room for two.
template <int NG, int NP, typename T>
__attribute__((always_inline)) inline void score_tile16(const float* q /*[NG, D]*/, const T* const* krow, int64_t hoff,
                                                        int64_t D, __m256 lane_ok, float* s, int64_t ls) {
  __m256 dots[NG][8];
  for (int p0 = 0; p0 < 8; p0 += NP) {
    __m512 part[NG][NP];
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < NP; ++i) part[g][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 qv[NG];
      for (int g = 0; g < NG; ++g) qv[g] = _mm512_loadu_ps(q + g * D + d);
      for (int i = 0; i < NP; ++i) {
        const __m512 kv = load16(krow[p0 + i] + hoff + d);
        for (int g = 0; g < NG; ++g) part[g][i] = _mm512_fmadd_ps(qv[g], kv, part[g][i]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < NP; ++i)
        dots[g][p0 + i] = _mm256_add_ps(_mm512_castps512_ps256(part[g][i]), _mm512_extractf32x8_ps(part[g][i], 1));
  }
  for (int g = 0; g < NG; ++g)
    _mm256_storeu_ps(s + g * ls, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), transpose_sum8(dots[g]), lane_ok));
}

// J 16-lane vectors of NG heads' accumulators from dim d0, in registers across the cnt positions:
// every lane sums its positions in order, whichever J covers it.
template <int NG, int J, typename T>
__attribute__((always_inline)) inline void value_chunk16(const float* w, int64_t ls, const T* const* vrow, int64_t cnt,
                                                         int64_t hoff, int64_t d0, int64_t D, float* acc /*[NG, D]*/) {
  __m512 a[NG][J];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < J; ++j) a[g][j] = _mm512_loadu_ps(acc + g * D + d0 + 16 * j);
  for (int64_t i = 0; i < cnt; ++i) {
    __m512 pb[NG];
    for (int g = 0; g < NG; ++g) pb[g] = _mm512_set1_ps(w[g * ls + i]);
    for (int j = 0; j < J; ++j) {
      const __m512 vv = load16(vrow[i] + hoff + d0 + 16 * j);
      for (int g = 0; g < NG; ++g) a[g][j] = _mm512_fmadd_ps(pb[g], vv, a[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(acc + g * D + d0 + 16 * j, a[g][j]);
}

// 64 dims at a time, then 32 (a head dim of 32 or 96: NG x 2 independent chains rather than one
// chain of cnt dependent FMAs per 16 dims), then 16.
template <int NG, typename T>
inline void value_tile16(const float* w, int64_t ls, const T* const* vrow, int64_t cnt, int64_t hoff, int64_t D,
                         float* acc /*[NG, D]*/) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) value_chunk16<NG, 4>(w, ls, vrow, cnt, hoff, d0, D, acc);
  if (d0 + 32 <= D) value_chunk16<NG, 2>(w, ls, vrow, cnt, hoff, d0, D, acc), d0 += 32;
  if (d0 < D) value_chunk16<NG, 1>(w, ls, vrow, cnt, hoff, d0, D, acc);
}
#endif

// Prefetch this task's rows of the cache block holding position pos (rows from pos to the block's
// end, at most up to n): issued one block ahead, the next block's lines are in flight while the
// current one is computed on. The hardware prefetchers stop at the jump between two (randomly
// placed) blocks, which otherwise costs a stall on every block.
template <typename T>
inline int64_t prefetch_block(const T* cache, const Task& t, int64_t pos) {
  const int64_t blk = (t.start + pos) / t.bs, off = t.start + pos - blk * t.bs;  // one division per block
  const int64_t end = std::min<int64_t>(t.n, pos + t.bs - off);
  const int64_t row_bytes = t.nkv * t.D * static_cast<int64_t>(sizeof(T));
  const int64_t stride = t.row_stride * static_cast<int64_t>(sizeof(T));
  const char* r = reinterpret_cast<const char*>(cache + (static_cast<int64_t>(t.bt[blk]) * t.bs + off) * t.row_stride +
                                                t.head_off);
  for (int64_t p = pos; p < end; ++p, r += stride)
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
  return end;  // first position of the next block
}

// sr[0:ls] = exp(sr - max(sr)) in place, -inf entries (masked, past the end) becoming exactly 0
// rather than exp8's clamped tiny value; returns the sum (the softmax denominator).
inline float exp_row(float* sr, int64_t ls /* multiple of 8 */) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < ls; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + i));
  const __m256 m = _mm256_set1_ps(hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
#ifdef PAGEDLLM_AVX512  // 16 exponentials at a time (exp16: exp8's values), summed in the 8-lane order
  for (const __m512 m16 = _mm512_set1_ps(hmax(mx)); i + 16 <= ls; i += 16) {
    const __m512 x = _mm512_loadu_ps(sr + i);
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                         exp16(_mm512_sub_ps(x, m16)));
    _mm512_storeu_ps(sr + i, e);
    sum = _mm256_add_ps(_mm256_add_ps(sum, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
#endif
  for (; i < ls; i += 8) {
    const __m256 x = _mm256_loadu_ps(sr + i);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_storeu_ps(sr + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

// Pass 1 of a task: s[r * ls + j] = score of row r (query t.q + r * D) against the task's
// position j, for j < t.n; lanes up to ls get -inf. Row r reads kv head r / rows_per_head of
// the task. Rows go in register-blocked pairs (three would spill AVX2's 16 registers: measured
// 62 vs 72 GFLOP/s in the prefill kernel); each K row is loaded from memory once.
template <typename T>
void score_pass(const Task& t, const T* kc, int64_t R, int64_t rows_per_head, float* s, int64_t ls) {
  const T* rows[8];
  int64_t fetched = 0;  // positions before this one are prefetched
  for (int64_t base = 0; base < t.n; base += 8) {
    while (fetched < std::min(t.n, base + 8 + t.bs)) fetched = prefetch_block(kc, t, fetched);
    const int64_t valid = std::min<int64_t>(8, t.n - base);
    fill_rows(kc, t, t.start + base, 8, valid, rows);  // tail lanes repeat the last row; their scores become -inf
    const __m256 lane_ok = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    for (int64_t r0 = 0, hoff = 0; r0 < R; r0 += rows_per_head, hoff += t.D) {
#ifdef PAGEDLLM_AVX512
      if (t.D % 16 == 0) {  // rows in threes, then a pair or one
        for (int64_t r = r0, left = rows_per_head; left > 0;) {
          const int64_t take = left >= 3 ? 3 : left;
          float* sr = s + r * ls + base;
          if (take == 3) score_tile16<3, 8>(t.q + r * t.D, rows, hoff, t.D, lane_ok, sr, ls);
          else if (take == 2) score_tile16<2, 8>(t.q + r * t.D, rows, hoff, t.D, lane_ok, sr, ls);
          else score_tile16<1, 8>(t.q + r * t.D, rows, hoff, t.D, lane_ok, sr, ls);
          r += take, left -= take;
        }
        continue;
      }
#endif
      for (int64_t r = r0; r < r0 + rows_per_head;) {
        if (r + 2 <= r0 + rows_per_head) {
          score_tile<2, 4>(t.q + r * t.D, rows, hoff, t.D, lane_ok, s + r * ls + base, ls);
          r += 2;
        } else {
          score_tile<1, 8>(t.q + r * t.D, rows, hoff, t.D, lane_ok, s + r * ls + base, ls);
          r += 1;
        }
      }
    }
  }
}

// Pass 3 of a task: acc[r * D:] += sum over positions j of s[r * ls + j] * v_j, rows as in
// score_pass; each V row is loaded from memory once.
template <typename T>
void value_pass(const Task& t, const T* vc, const float* s, int64_t ls, int64_t R, int64_t rows_per_head, float* acc) {
  const T* rows[16];
  int64_t fetched = 0;
  for (int64_t base = 0; base < t.n; base += 16) {
    while (fetched < std::min(t.n, base + 16 + t.bs)) fetched = prefetch_block(vc, t, fetched);
    const int64_t cnt = std::min<int64_t>(16, t.n - base);
    fill_rows(vc, t, t.start + base, cnt, cnt, rows);
    for (int64_t r0 = 0, hoff = 0; r0 < R; r0 += rows_per_head, hoff += t.D) {
#ifdef PAGEDLLM_AVX512
      if (t.D % 16 == 0) {
        for (int64_t r = r0, left = rows_per_head; left > 0;) {
          const int64_t take = left >= 3 ? 3 : left;
          const float* wr = s + r * ls + base;
          if (take == 3) value_tile16<3>(wr, ls, rows, cnt, hoff, t.D, acc + r * t.D);
          else if (take == 2) value_tile16<2>(wr, ls, rows, cnt, hoff, t.D, acc + r * t.D);
          else value_tile16<1>(wr, ls, rows, cnt, hoff, t.D, acc + r * t.D);
          r += take, left -= take;
        }
        continue;
      }
#endif
      for (int64_t r = r0; r < r0 + rows_per_head;) {
        if (r + 2 <= r0 + rows_per_head) {
          value_tile<2>(s + r * ls + base, ls, rows, cnt, hoff, t.D, acc + r * t.D);
          r += 2;
        } else {
          value_tile<1>(s + r * ls + base, ls, rows, cnt, hoff, t.D, acc + r * t.D);
          r += 1;
        }
      }
    }
  }
}

// Three passes over one task: (1) all scores, reading each K row once; (2) per head, the max
// and the exponentials, vectorised over positions; (3) the weighted sum of V rows, reading each
// V row once. Unlike an online softmax there is no per-tile rescaling chain (max, scalar exp,
// horizontal sums) on the critical path, and the scores (heads x positions floats) stay in cache.
// ks/vs: the row scales of an 8-bit cache (nullptr otherwise).
template <typename T>
void attend(const Task& t, const T* kc, const T* vc, float* acc /*[nkv * G, D]*/, float* l,
            std::vector<float>& scores, float soft_cap, const c10::BFloat16* ks, const c10::BFloat16* vs) {
  const int64_t R = t.nkv * t.G, ls = (t.n + 7) / 8 * 8;
  if (static_cast<int64_t>(scores.size()) < R * ls) scores.resize(R * ls);
  std::fill(acc, acc + R * t.D, 0.0f);
  score_pass(t, kc, R, t.G, scores.data(), ls);
  if (ks != nullptr) apply_scales(t, ks, R, t.G, scores.data(), ls);
  if (soft_cap > 0.0f) soft_cap8(scores.data(), R * ls, soft_cap);  // one extra pass, only where asked
  for (int64_t r = 0; r < R; ++r) l[r] = exp_row(scores.data() + r * ls, ls);
  if (vs != nullptr) apply_scales(t, vs, R, t.G, scores.data(), ls);  // after the sums: weights times scales
  value_pass(t, vc, scores.data(), ls, R, t.G, acc);
}
#else
template <typename T>
void attend(const Task& t, const T* kc, const T* vc, float* acc, float* l, std::vector<float>& m_work, float soft_cap,
            const c10::BFloat16* ks, const c10::BFloat16* vs) {
  const int64_t R = t.nkv * t.G, G = t.G, D = t.D;
  if (static_cast<int64_t>(m_work.size()) < R) m_work.resize(R);
  float* m = m_work.data();  // online softmax: running max per head
  for (int64_t r = 0; r < R; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  std::fill(acc, acc + R * D, 0.0f);
  for (int64_t i = 0; i < t.n; ++i) {
    const T* kr = row_ptr(kc, t, t.start + i);
    const T* vr = row_ptr(vc, t, t.start + i);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t hoff = (r / G) * D;
      const float* qr = t.q + r * D;
      const int64_t h = t.head_off / D + r / G;
      float s = 0.0f;
      for (int64_t d = 0; d < D; ++d) s += qr[d] * to_float(kr[hoff + d]);
      if (ks != nullptr) s *= row_scale(ks, t, t.start + i, h);
      if (soft_cap > 0.0f) s = soft_cap * std::tanh(s / soft_cap);
      const float m_new = std::max(m[r], s);
      const float alpha = std::exp(m[r] - m_new), w = std::exp(s - m_new);
      l[r] = l[r] * alpha + w;
      m[r] = m_new;
      const float wv = vs != nullptr ? w * row_scale(vs, t, t.start + i, h) : w;
      float* ar = acc + r * D;
      for (int64_t d = 0; d < D; ++d) ar[d] = ar[d] * alpha + wv * to_float(vr[hoff + d]);
    }
  }
}
#endif

// Q: the query and output dtype; T: the cache's (Q, or 8-bit with the row scales ks/vs).
template <typename Q, typename T>
void run(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
         torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t sliding_window, double soft_cap,
         const c10::BFloat16* ks, const c10::BFloat16* vs) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv, max_blocks = block_table.size(1);
  const Q* q = query.data_ptr<Q>();
  const int64_t q_stride = query.stride(0);  // rows may be strided (a view into the fused qkv)
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  Q* o = out.data_ptr<Q>();
  const float fscale = static_cast<float>(scale);

  // Whole sequences per task when they alone keep the threads busy, else one kv head each.
  const int64_t nkv = B >= 2 * omp_get_max_threads() ? Hkv : 1;
  const int64_t splits = Hkv / nkv;
  // A few cached tokens in all (short contexts, small batches): the calling thread alone, no
  // fork and no barrier to wait at (issue 30).
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) tokens += sl[b];
#pragma omp parallel if (tokens * H * D >= (1 << 16))
  {
    std::vector<float> qs(nkv * G * D), acc(nkv * G * D), l(nkv * G), work;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * splits; ++task) {
      const int64_t b = task / splits, h0 = (task % splits) * nkv;
      const int64_t L = sl[b];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, L - sliding_window) : 0;
      const int64_t rows = nkv * G;
      const Q* qh = q + b * q_stride + h0 * G * D;
      for (int64_t i = 0; i < rows * D; ++i) qs[i] = to_float(qh[i]) * fscale;
      const Task t{qs.data(), L - start, start, bt + b * max_blocks, bs, Hkv * D, h0 * D, nkv, G, D};
      attend<T>(t, kc, vc, acc.data(), l.data(), work, static_cast<float>(soft_cap), ks, vs);
      Q* oh = o + (b * H + h0 * G) * D;
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) oh[r * D + d] = from_float<Q>(acc[r * D + d] * inv);
      }
    }
  }
}

// Checks the cache against the query (``what`` names the kernel) and returns the scale pointers:
// nullptr for a cache of the query's dtype, else those of an 8-bit cache's [num_blocks,
// block_size, Hkv] bfloat16 scales.
inline std::pair<const c10::BFloat16*, const c10::BFloat16*> check_cache(
    const char* what, const torch::Tensor& query, const torch::Tensor& out, const torch::Tensor& key_cache,
    const torch::Tensor& value_cache, const std::optional<torch::Tensor>& k_scales,
    const std::optional<torch::Tensor>& v_scales) {
  const auto qt = query.scalar_type(), ct = key_cache.scalar_type();
  TORCH_CHECK(qt == torch::kFloat32 || qt == torch::kBFloat16, what, ": float32 or bfloat16 query");
  TORCH_CHECK(out.scalar_type() == qt && value_cache.scalar_type() == ct, what, ": query/out or key/value cache dtypes differ");
  TORCH_CHECK(k_scales.has_value() == v_scales.has_value(), what, ": key and value scales go together");
  if (!k_scales.has_value()) {
    TORCH_CHECK(ct == qt || (qt == torch::kFloat32 && ct == torch::kBFloat16), what,
                ": query and cache dtypes differ (a float32 query reads a float32 or bfloat16 cache; an 8-bit "
                "cache needs its scales)");
    return {nullptr, nullptr};
  }
  TORCH_CHECK(ct == at::kChar || ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2, what,
              ": scales are for an int8 or fp8 cache");
  const int64_t rows = key_cache.numel() / key_cache.size(-1);
  for (const auto* s : {&*k_scales, &*v_scales})
    TORCH_CHECK(s->scalar_type() == at::kBFloat16 && s->is_contiguous() && s->numel() == rows, what,
                ": contiguous bfloat16 scales [num_blocks, block_size, kv_heads] expected");
  return {k_scales->data_ptr<c10::BFloat16>(), v_scales->data_ptr<c10::BFloat16>()};
}

// Calls f(Q{}, T{}) with the query type Q and cache type T of these tensors (checked before).
template <typename F>
inline void dispatch_cache(const torch::Tensor& query, const torch::Tensor& key_cache, F&& f) {
  const bool fq = query.scalar_type() == torch::kFloat32;
  const auto with_q = [&](auto q) {
    switch (key_cache.scalar_type()) {
      case at::kChar: f(q, int8_t{}); break;
      case at::kFloat8_e4m3fn: f(q, c10::Float8_e4m3fn{}); break;
      case at::kFloat8_e5m2: f(q, c10::Float8_e5m2{}); break;
      case at::kBFloat16: f(q, c10::BFloat16{}); break;  // a bfloat16 cache under a float32 model too
      default: f(q, q);
    }
  };
  if (fq) with_q(float{});
  else with_q(c10::BFloat16{});
}

}  // namespace decode

inline void paged_decode_attention(torch::Tensor out,          // [B, H, D]
                            torch::Tensor query,        // [B, H, D] float32/bfloat16; rows may be strided
                            torch::Tensor key_cache,    // [num_blocks, block_size, Hkv, D]: query's dtype or 8-bit
                            torch::Tensor value_cache,  // [num_blocks, block_size, Hkv, D]
                            torch::Tensor block_table,  // [B, max_blocks] int32
                            torch::Tensor seq_lens,     // [B] int32
                            double scale, int64_t sliding_window,
                            double soft_cap,            // > 0: scores become soft_cap * tanh(score / soft_cap)
                            std::optional<torch::Tensor> k_scales = std::nullopt,   // 8-bit cache: [num_blocks,
                            std::optional<torch::Tensor> v_scales = std::nullopt) {  // block_size, Hkv] bf16
  const auto scales = decode::check_cache("paged_decode_attention", query, out, key_cache, value_cache, k_scales,
                                          v_scales);
  const c10::BFloat16 *ks = scales.first, *vs = scales.second;
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: int32 block table and seq lens expected");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors expected");
  TORCH_CHECK(query.size(2) % 8 == 0, "paged_decode_attention: head_dim must be a multiple of 8");
  decode::dispatch_cache(query, key_cache, [&](auto q, auto c) {
    decode::run<decltype(q), decltype(c)>(out, query, key_cache, value_cache, block_table, seq_lens, scale,
                                          sliding_window, soft_cap, ks, vs);
  });
}

}  // namespace pagedllm
