// Translation unit of the quantized-weight matmuls (quant_gemm.h: weight-only int8 / int4 / fp8,
// quant_gemm_i16.h: with int16 activations; quant_gemm_i8.h: W8A8).
#include "ops.h"
#include "quant_gemm_i8.h"  // includes quant_gemm.h

namespace pagedllm {
namespace ops {

Tensor pack_quantized_weight(Tensor qweight) { return pagedllm::pack_quantized_weight(qweight); }

Tensor quant_linear(Tensor x, Tensor packed, int64_t kind, Tensor scales, std::optional<Tensor> zeros,
                    int64_t out_features, int64_t group_size, std::optional<Tensor> perm, std::optional<Tensor> bias) {
  return pagedllm::quant_linear(x, packed, kind, scales, zeros, out_features, group_size, perm, bias);
}

Tensor quant_linear_out(Tensor out, Tensor x, Tensor packed, int64_t kind, Tensor scales, std::optional<Tensor> zeros,
                        int64_t out_features, int64_t group_size) {
  return pagedllm::quant_linear(x, packed, kind, scales, zeros, out_features, group_size, std::nullopt, std::nullopt, out);
}

Tensor quant_linear_i8(Tensor x, Tensor packed, Tensor scales, std::optional<Tensor> zeros, Tensor colsum,
                       int64_t out_features, int64_t group_size, std::optional<Tensor> perm, std::optional<Tensor> bias,
                       bool vnni) {
  return pagedllm::quant_linear_i8(x, packed, scales, zeros, colsum, out_features, group_size, perm, bias, vnni);
}

bool int8_dot_vnni() { return pagedllm::int8_dot_path_vnni(); }

bool int16_activations(std::optional<bool> on) {
  if (on.has_value()) pagedllm::qgemm::set_int16_activations(*on);
  return pagedllm::qgemm::int16_path(pagedllm::qgemm::kInt4, 2);
}

}  // namespace ops
}  // namespace pagedllm
