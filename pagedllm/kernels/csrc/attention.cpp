// Translation unit of the paged attention kernels (paged_decode.h, paged_prefill.h) and of the
// 8-bit KV cache writes (kv_quant.h).
#include "kv_quant.h"
#include "ops.h"
#include "paged_prefill.h"  // includes paged_decode.h

namespace pagedllm {
namespace ops {

void paged_decode_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table,
                            Tensor seq_lens, double scale, int64_t sliding_window, double soft_cap,
                            std::optional<Tensor> k_scales, std::optional<Tensor> v_scales) {
  pagedllm::paged_decode_attention(out, query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window,
                                   soft_cap, k_scales, v_scales);
}

void paged_prefill_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table,
                             Tensor q_start, Tensor q_len, Tensor seq_len, double scale, int64_t sliding_window,
                             double soft_cap, std::optional<Tensor> k_scales, std::optional<Tensor> v_scales) {
  pagedllm::paged_prefill_attention(out, query, key_cache, value_cache, block_table, q_start, q_len, seq_len, scale,
                                    sliding_window, soft_cap, k_scales, v_scales);
}

void write_kv_quant(Tensor key_cache, Tensor value_cache, Tensor k_scales, Tensor v_scales, Tensor key, Tensor value,
                    Tensor slot_mapping) {
  pagedllm::write_kv_quant(key_cache, value_cache, k_scales, v_scales, key, value, slot_mapping);
}

}  // namespace ops
}  // namespace pagedllm
