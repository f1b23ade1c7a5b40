// Translation unit of the packed GEMM (packed_gemm.h).
#include "ops.h"
#include "packed_gemm.h"

namespace pagedllm {
namespace ops {

Tensor packed_linear(Tensor x, Tensor packed, int64_t out_features, std::optional<Tensor> bias) {
  return pagedllm::packed_linear(x, packed, out_features, bias);
}

}  // namespace ops
}  // namespace pagedllm
