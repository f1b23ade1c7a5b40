// Translation unit of the categorical sampling kernel (sampling.h).
#include "sampling.h"
#include "ops.h"

namespace pagedllm {
namespace ops {

void sample_rows(Tensor out, Tensor logits, Tensor temperature, Tensor uniforms) {
  pagedllm::sampling::sample_rows(out, logits, temperature, uniforms);
}

void apply_token_bitmask(Tensor logits, Tensor rows, Tensor bitmask) {
  pagedllm::sampling::apply_token_bitmask(logits, rows, bitmask);
}

}  // namespace ops
}  // namespace pagedllm
