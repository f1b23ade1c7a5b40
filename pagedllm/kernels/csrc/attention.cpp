// Translation unit of the paged attention kernels (paged_decode.h, paged_prefill.h).
#include "ops.h"
#include "paged_prefill.h"  // includes paged_decode.h

namespace pagedllm {
namespace ops {

void paged_decode_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table,
                            Tensor seq_lens, double scale, int64_t sliding_window, double soft_cap) {
  pagedllm::paged_decode_attention(out, query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window,
                                   soft_cap);
}

void paged_prefill_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table,
                             Tensor q_start, Tensor q_len, Tensor seq_len, double scale, int64_t sliding_window,
                             double soft_cap) {
  pagedllm::paged_prefill_attention(out, query, key_cache, value_cache, block_table, q_start, q_len, seq_len, scale,
                                    sliding_window, soft_cap);
}

}  // namespace ops
}  // namespace pagedllm
