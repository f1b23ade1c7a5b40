// Paged decode attention for CPU (float32): each (sequence, kv head) pair reads its keys and
// values straight from the KV cache blocks through the block table -- no gathered copy, no
// padding. OpenMP over (sequence, kv head); the query heads sharing a kv head (GQA) reuse every
// key/value row they load.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

void paged_decode_attention(torch::Tensor out,          // [B, H, D] float32
                            torch::Tensor query,        // [B, H, D] float32
                            torch::Tensor key_cache,    // [num_blocks, block_size, Hkv, D]
                            torch::Tensor value_cache,  // [num_blocks, block_size, Hkv, D]
                            torch::Tensor block_table,  // [B, max_blocks] int32
                            torch::Tensor seq_lens,     // [B] int32
                            double scale, int64_t sliding_window) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors expected");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv, max_blocks = block_table.size(1);
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      const int64_t L = sl[b];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, L - sliding_window) : 0;
      const int64_t n = L - start;
      std::vector<float> scores(G * n);
      std::vector<float> acc(G * D, 0.0f);
      const float* qh = q + (b * H + kvh * G) * D;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = start + i;
        const int64_t block = bt[b * max_blocks + pos / bs];
        const float* kr = kc + ((block * bs + pos % bs) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kr[d];
          scores[g * n + i] = s * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float m = -INFINITY;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
        float z = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - m);
          z += sg[i];
        }
        const float inv = 1.0f / z;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = start + i;
        const int64_t block = bt[b * max_blocks + pos / bs];
        const float* vr = vc + ((block * bs + pos % bs) * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + i];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vr[d];
        }
      }
      float* oh = o + (b * H + kvh * G) * D;
      std::copy(acc.begin(), acc.end(), oh);
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
