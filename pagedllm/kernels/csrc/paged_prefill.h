// Paged prefill attention for CPU: the query rows of prompt chunks (causal within the chunk, full
// over the cached prefix, optional sliding window) against the K/V already written to the cache.
//
// Work is split into tasks of (chunk, kv head, tile of kQueryTile query positions); a task's rows
// are its positions x the query heads of that kv head (GQA: they all share the K/V rows). The
// passes are those of the decode kernel (paged_decode.h): scores for the keys up to the tile's
// last position with the rows register-blocked against each K row, an exact softmax per row
// (keys after a row's position, or before its window, get weight 0), then the weighted sum of V
// rows. Causality costs at most one tile of wasted scores per row instead of the full square a
// masked dense product computes, and the exponentials are vectorised.
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "paged_decode.h"

namespace pagedllm {
namespace prefill {

constexpr int64_t kQueryTile = 8;

struct Chunk {
  int64_t q_start;  // first row of this chunk in query/out
  int64_t q_len;
  int64_t seq_len;  // tokens in the sequence after this chunk (the chunk is its last q_len)
  const int32_t* bt;
};

// Q: the query and output dtype; T: the cache's (Q, or 8-bit with the row scales ks/vs).
template <typename Q, typename T>
void run_task(const Chunk& c, int64_t h, int64_t tile, const Q* q, int64_t q_row_stride, const T* kc, const T* vc, Q* o, int64_t H,
              int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t window, float soft_cap, std::vector<float>& qs,
              std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& l, const c10::BFloat16* ks,
              const c10::BFloat16* vs) {
  const int64_t G = H / Hkv;
  const int64_t i0 = tile * kQueryTile, i1 = std::min(c.q_len, i0 + kQueryTile);
  const int64_t first_pos = c.seq_len - c.q_len + i0, last_pos = c.seq_len - c.q_len + i1 - 1;
  const int64_t k0 = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t n = last_pos + 1 - k0;  // keys [k0, last_pos]
  const int64_t R = (i1 - i0) * G;      // rows: position-major, then the kv head's query heads
  qs.resize(R * D);
  acc.assign(R * D, 0.0f);
  l.resize(R);
  for (int64_t i = i0; i < i1; ++i) {
    const Q* src = q + (c.q_start + i) * q_row_stride + h * G * D;
    float* dst = qs.data() + (i - i0) * G * D;
    for (int64_t e = 0; e < G * D; ++e) dst[e] = to_float(src[e]) * scale;
  }
  const decode::Task t{qs.data(), n, k0, c.bt, bs, Hkv * D, h * D, 1, G, D};
  const int64_t ls = (n + 7) / 8 * 8;
  if (static_cast<int64_t>(scores.size()) < R * ls) scores.resize(R * ls);
  float* s = scores.data();
#ifdef PAGEDLLM_AVX2
  decode::score_pass(t, kc, R, R, s, ls);  // the task's rows all read kv head h (t.head_off)
  if (ks != nullptr) decode::apply_scales(t, ks, R, R, s, ls);
  if (soft_cap > 0.0f) soft_cap8(s, R * ls, soft_cap);  // before the masks: only where asked
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * ls;
    const int64_t pos = first_pos + r / G;
    for (int64_t j = pos + 1 - k0; j < ls; ++j) sr[j] = -INFINITY;  // after the row's position
    if (window > 0)
      for (int64_t j = 0; j < pos - window + 1 - k0; ++j) sr[j] = -INFINITY;  // before its window
    l[r] = decode::exp_row(sr, ls);
  }
  if (vs != nullptr) decode::apply_scales(t, vs, R, R, s, ls);  // weights times scales, after the sums
  decode::value_pass(t, vc, s, ls, R, R, acc.data());
#else
  auto visible = [&](int64_t r, int64_t key) {  // key: absolute position
    const int64_t pos = first_pos + r / G;
    return key <= pos && (window <= 0 || key > pos - window);
  };
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * ls;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      float v = -INFINITY;
      if (visible(r, k0 + j)) {
        const T* kr = decode::row_ptr(kc, t, k0 + j);
        v = 0.0f;
        for (int64_t d = 0; d < D; ++d) v += qs[r * D + d] * to_float(kr[d]);
        if (ks != nullptr) v *= decode::row_scale(ks, t, k0 + j, h);
        if (soft_cap > 0.0f) v = soft_cap * std::tanh(v / soft_cap);
      }
      sr[j] = v;
      mx = std::max(mx, v);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      sr[j] = sr[j] == -INFINITY ? 0.0f : std::exp(sr[j] - mx);
      sum += sr[j];
    }
    l[r] = sum;
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = decode::row_ptr(vc, t, k0 + j);
      const float w = vs != nullptr ? sr[j] * decode::row_scale(vs, t, k0 + j, h) : sr[j];
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] += w * to_float(vr[d]);
    }
  }
#endif
  for (int64_t r = 0; r < R; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    Q* dst = o + ((c.q_start + i0 + r / G) * H + h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<Q>(acc[r * D + d] * inv);
  }
}

template <typename Q, typename T>
void run(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
         torch::Tensor block_table, torch::Tensor q_start, torch::Tensor q_len, torch::Tensor seq_len, double scale,
         int64_t window, double soft_cap, const c10::BFloat16* ks, const c10::BFloat16* vs) {
  const int64_t H = query.size(1), D = query.size(2), bs = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t P = q_start.size(0), max_blocks = block_table.size(1);
  std::vector<Chunk> chunks(P);
  std::vector<int64_t> first_task(P + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    chunks[p] = Chunk{q_start.data_ptr<int32_t>()[p], q_len.data_ptr<int32_t>()[p], seq_len.data_ptr<int32_t>()[p],
                      block_table.data_ptr<int32_t>() + p * max_blocks};
    first_task[p + 1] = first_task[p] + Hkv * ((chunks[p].q_len + kQueryTile - 1) / kQueryTile);
  }
  const Q* q = query.data_ptr<Q>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  Q* o = out.data_ptr<Q>();
  const int64_t num_tasks = first_task[P], q_row_stride = query.stride(0);
#pragma omp parallel
  {
    std::vector<float> qs, scores, acc, l;
    int64_t p = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = num_tasks - 1; task >= 0; --task) {  // longest (last) tiles first
      p = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t local = task - first_task[p];
      run_task<Q, T>(chunks[p], local % Hkv, local / Hkv, q, q_row_stride, kc, vc, o, H, Hkv, D, bs, static_cast<float>(scale),
                     window, static_cast<float>(soft_cap), qs, scores, acc, l, ks, vs);
    }
  }
}

}  // namespace prefill

inline void paged_prefill_attention(torch::Tensor out,          // [T, H, D]: rows of the chunks written
                                    torch::Tensor query,        // [T, H, D] (rows may be strided), cache dtype
                                    torch::Tensor key_cache,    // [num_blocks, block_size, Hkv, D]
                                    torch::Tensor value_cache,  // [num_blocks, block_size, Hkv, D]
                                    torch::Tensor block_table,  // [P, max_blocks] int32, one row per chunk
                                    torch::Tensor q_start,      // [P] int32: first row of each chunk
                                    torch::Tensor q_len,        // [P] int32
                                    torch::Tensor seq_len,      // [P] int32: context length after the chunk
                                    double scale, int64_t sliding_window,
                                    double soft_cap,  // > 0: scores become soft_cap * tanh(score / soft_cap)
                                    std::optional<torch::Tensor> k_scales = std::nullopt,   // 8-bit cache: [num_blocks,
                                    std::optional<torch::Tensor> v_scales = std::nullopt) {  // block_size, Hkv] bf16
  const auto scales = decode::check_cache("paged_prefill_attention", query, out, key_cache, value_cache, k_scales,
                                          v_scales);
  const c10::BFloat16 *ks = scales.first, *vs = scales.second;
  for (const auto& t : {block_table, q_start, q_len, seq_len})
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous(), "paged_prefill_attention: contiguous int32 metadata expected");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_prefill_attention: contiguous out/cache and query heads expected");
  TORCH_CHECK(query.size(2) % 8 == 0, "paged_prefill_attention: head_dim must be a multiple of 8");
  TORCH_CHECK(q_start.size(0) == q_len.size(0) && q_len.size(0) == seq_len.size(0) && block_table.size(0) == q_len.size(0),
              "paged_prefill_attention: one block table row, start, length and seq len per chunk");
  decode::dispatch_cache(query, key_cache, [&](auto q, auto c) {
    prefill::run<decltype(q), decltype(c)>(out, query, key_cache, value_cache, block_table, q_start, q_len, seq_len,
                                           scale, sliding_window, soft_cap, ks, vs);
  });
}

}  // namespace pagedllm
