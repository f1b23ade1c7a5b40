// The kernels' entry points as the pybind module (module.cpp) sees them: each is defined in its
// family's translation unit (attention.cpp, gemm.cpp, fused_ops.cpp, ...), which compiles the
// family's header for this ISA level. Only declarations here, so module.cpp stays light.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pybind11 {
class module_;
}

namespace pagedllm {
namespace ops {

using at::Tensor;

// attention.cpp (k_scales/v_scales: an 8-bit cache's row scales; kv_quant.h writes it)
void paged_decode_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table,
                            Tensor seq_lens, double scale, int64_t sliding_window, double soft_cap,
                            std::optional<Tensor> k_scales, std::optional<Tensor> v_scales);
void paged_prefill_attention(Tensor out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table,
                             Tensor q_start, Tensor q_len, Tensor seq_len, double scale, int64_t sliding_window,
                             double soft_cap, std::optional<Tensor> k_scales, std::optional<Tensor> v_scales);
void write_kv_quant(Tensor key_cache, Tensor value_cache, Tensor k_scales, Tensor v_scales, Tensor key, Tensor value,
                    Tensor slot_mapping);

// gemm.cpp
Tensor packed_linear(Tensor x, Tensor packed, int64_t out_features, std::optional<Tensor> bias);
Tensor pack_linear_weight(Tensor weight);
std::string gemm_path();

// fused_ops.cpp
void rms_norm(Tensor out, Tensor x, Tensor weight, double eps);
void fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, double eps);
void silu_and_mul(Tensor out, Tensor x);
void rotary_inplace(Tensor x, Tensor cos, Tensor sin);
void write_kv(Tensor key_cache, Tensor value_cache, Tensor key, Tensor value, Tensor slot_mapping);
void argmax_rows(Tensor out, Tensor logits);

// sampling.cpp
void sample_rows(Tensor out, Tensor logits, Tensor temperature, Tensor uniforms);
void apply_token_bitmask(Tensor logits, Tensor rows, Tensor bitmask);

// quant_gemm.cpp (quantized weights: quant_gemm.h, quant_gemm_i16.h, quant_gemm_i8.h)
Tensor pack_quantized_weight(Tensor qweight);
Tensor quant_linear(Tensor x, Tensor packed, int64_t kind, Tensor scales, std::optional<Tensor> zeros,
                    int64_t out_features, int64_t group_size, std::optional<Tensor> perm, std::optional<Tensor> bias);
// quant_linear into out (contiguous [M, N] of x's dtype), without permutation or bias: the decode stack's
Tensor quant_linear_out(Tensor out, Tensor x, Tensor packed, int64_t kind, Tensor scales, std::optional<Tensor> zeros,
                        int64_t out_features, int64_t group_size);
Tensor quant_linear_i8(Tensor x, Tensor packed, Tensor scales, std::optional<Tensor> zeros, Tensor colsum,
                       int64_t out_features, int64_t group_size, std::optional<Tensor> perm, std::optional<Tensor> bias,
                       bool vnni);
bool int8_dot_vnni();
bool int16_activations(std::optional<bool> on);

// gguf_gemm.cpp (GGUF block formats kept packed: gguf_gemm.h)
void gguf_linear(Tensor out, Tensor x, Tensor w, int64_t qtype);
Tensor gguf_dequantize(Tensor w, int64_t qtype, Tensor rows, int64_t k);
std::vector<int64_t> gguf_types();

// decode_stack.cpp: the DecodeStack class (every decoder layer of a decode step in one call)
void bind_decode_stack(pybind11::module_& m);

// module.cpp: what this build was compiled for.
const char* isa_level();

}  // namespace ops
}  // namespace pagedllm
