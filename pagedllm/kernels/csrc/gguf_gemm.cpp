// Translation unit of the GGUF block-format matmuls (gguf_gemm.h).
#include "gguf_gemm.h"
#include "ops.h"

namespace pagedllm {
namespace ops {

void gguf_linear(Tensor out, Tensor x, Tensor w, int64_t qtype) { pagedllm::gguf::linear(out, x, w, qtype); }

Tensor gguf_dequantize(Tensor w, int64_t qtype, Tensor rows, int64_t k) {
  return pagedllm::gguf::dequantize(w, qtype, rows, k);
}

std::vector<int64_t> gguf_types() {
  return std::vector<int64_t>(std::begin(pagedllm::gguf::kTypes), std::end(pagedllm::gguf::kTypes));
}

}  // namespace ops
}  // namespace pagedllm
