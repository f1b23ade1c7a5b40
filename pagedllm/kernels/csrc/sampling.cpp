// Translation unit of the categorical sampling kernel (sampling.h).
#include "sampling.h"
#include "ops.h"

namespace pagedllm {
namespace ops {

void sample_rows(Tensor out, Tensor logits, Tensor temperature, Tensor uniforms) {
  pagedllm::sampling::sample_rows(out, logits, temperature, uniforms);
}

}  // namespace ops
}  // namespace pagedllm
