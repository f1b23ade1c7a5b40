// Translation unit of the packed GEMM (packed_gemm.h).
#include "ops.h"
#include "packed_gemm.h"

namespace pagedllm {
namespace ops {

Tensor packed_linear(Tensor x, Tensor packed, int64_t out_features, std::optional<Tensor> bias) {
  return pagedllm::packed_linear(x, packed, out_features, bias);
}

Tensor pack_linear_weight(Tensor weight) { return pagedllm::pack_linear_weight(weight); }

std::string gemm_path() { return pagedllm::gemm_path(); }

}  // namespace ops
}  // namespace pagedllm
