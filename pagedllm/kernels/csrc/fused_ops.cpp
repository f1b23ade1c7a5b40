// Translation unit of the fused elementwise ops (fused_ops.h).
#include "fused_ops.h"
#include "ops.h"

namespace pagedllm {
namespace ops {

void rms_norm(Tensor out, Tensor x, Tensor weight, double eps) { pagedllm::rms_norm(out, x, weight, eps); }
void fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, double eps) {
  pagedllm::fused_add_rms_norm(x, residual, weight, eps);
}
void silu_and_mul(Tensor out, Tensor x) { pagedllm::silu_and_mul(out, x); }
void rotary_inplace(Tensor x, Tensor cos, Tensor sin) { pagedllm::rotary_inplace(x, cos, sin); }
void write_kv(Tensor key_cache, Tensor value_cache, Tensor key, Tensor value, Tensor slot_mapping) {
  pagedllm::write_kv(key_cache, value_cache, key, value, slot_mapping);
}
void argmax_rows(Tensor out, Tensor logits) { pagedllm::argmax_rows(out, logits); }

}  // namespace ops
}  // namespace pagedllm
