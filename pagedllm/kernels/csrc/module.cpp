// The pybind module of pagedllm's CPU kernels. Each kernel family is compiled in its own
// translation unit (attention.cpp, gemm.cpp, fused_ops.cpp) against the light tensor.h, in
// parallel, for one ISA level (-DPAGEDLLM_ISA=..., the level's -m flags); this one only binds
// their entry points (ops.h). A new family: its header, a <family>.cpp defining its entry points
// in pagedllm::ops, their declarations in ops.h, and an m.def below.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "ops.h"

#ifndef PAGEDLLM_ISA
#define PAGEDLLM_ISA "unknown"
#endif

namespace pagedllm {
namespace ops {
const char* isa_level() { return PAGEDLLM_ISA; }
}  // namespace ops
}  // namespace pagedllm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pagedllm::ops;
  m.attr("isa") = PAGEDLLM_ISA;  // the level this build was compiled for (kernels/isa.py)
  // The instruction-set macros the compiler defined for this build (what the kernels' #ifs see).
  py::list features;
#ifdef __AVX2__
  features.append("avx2");
#endif
#ifdef __FMA__
  features.append("fma");
#endif
#ifdef __AVX512F__
  features.append("avx512f");
#endif
#ifdef __AVX512BW__
  features.append("avx512bw");
#endif
#ifdef __AVX512BF16__
  features.append("avx512bf16");
#endif
#ifdef __AMX_TILE__
  features.append("amx_tile");
#endif
#ifdef __AMX_BF16__
  features.append("amx_bf16");
#endif
  m.attr("compiled_features") = features;
  // soft_cap > 0: scores become soft_cap * tanh(score / soft_cap) before the softmax (Gemma 2)
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("soft_cap") = 0.0, py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(), "paged decode attention over the KV cache blocks (8-bit: with row scales)");
  m.def("paged_prefill_attention", &paged_prefill_attention, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_table"), py::arg("q_start"), py::arg("q_len"), py::arg("seq_len"),
        py::arg("scale"), py::arg("sliding_window"), py::arg("soft_cap") = 0.0, py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(),
        "causal attention of prompt chunks over the KV cache blocks (cached prefix + the chunk)");
  m.def("packed_linear", &packed_linear, py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias") = py::none(), "y = x w^T (+ bias) with w packed by pack_linear_weight; x's dtype out");
  m.def("pack_linear_weight", &pack_linear_weight, py::arg("weight"),
        "w [N, K] packed in 16-column panels in the layout this build's GEMM path uses");
  m.def("gemm_path", &gemm_path, "the GEMM path compiled: avx512_bf16, avx512, avx2 or scalar");
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual) * weight (in place)");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:]");
  m.def("rotary_inplace", &rotary_inplace, "neox-style rotary embedding, in place");
  m.def("write_kv", &write_kv, "write key/value rows into their cache slots");
  m.def("write_kv_quant", &write_kv_quant, py::arg("key_cache"), py::arg("value_cache"), py::arg("k_scales"),
        py::arg("v_scales"), py::arg("key"), py::arg("value"), py::arg("slot_mapping"),
        "quantize key/value rows into an int8/fp8 cache, a bfloat16 scale per row and kv head");
  m.def("pack_quantized_weight", &pack_quantized_weight, py::arg("qweight"),
        "int8/int4/fp8 codes [N, KB] (bytes) transposed into 16-row panels [ceil(N/16), KB, 16]");
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("packed"), py::arg("kind"), py::arg("scales"),
        py::arg("zeros"), py::arg("out_features"), py::arg("group_size"), py::arg("perm") = py::none(),
        py::arg("bias") = py::none(), "y = x W^T (+ bias), W int8/int4/fp8 codes dequantized in registers");
  m.def("quant_linear_i8", &quant_linear_i8, py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("zeros"),
        py::arg("colsum"), py::arg("out_features"), py::arg("group_size"), py::arg("perm") = py::none(),
        py::arg("bias") = py::none(), py::arg("vnni") = true,
        "W8A8 y = x W^T (+ bias): per-row int8 activations, exact int32 group sums (vpdpbusd where the CPU has it)");
  m.def("int8_dot_vnni", &int8_dot_vnni, "whether quant_linear_i8 uses AVX512-VNNI here");
  m.def("int16_activations", &int16_activations, py::arg("on") = py::none(),
        "whether quant_linear quantizes float32 x to int16 for vpdpwssd here (on: switch it first, process-wide)");
  m.def("gguf_linear", &gguf_linear, py::arg("out"), py::arg("x"), py::arg("w"), py::arg("qtype"),
        "out[M, N] = x[M, K] W^T with W uint8 [N, row_bytes] in a GGUF block type (ggml type id), dequantized in registers");
  m.def("gguf_dequantize", &gguf_dequantize, py::arg("w"), py::arg("qtype"), py::arg("rows"), py::arg("k"),
        "float32 [len(rows), K]: the given rows of a GGUF-packed weight, dequantized");
  m.def("gguf_types", &gguf_types, "the ggml type ids gguf_linear and gguf_dequantize accept");
  bind_decode_stack(m);
  m.def("argmax_rows", &argmax_rows, "index of the first maximum of each float32 row");
  m.def("sample_rows", &sample_rows,
        "a token per float32 row from softmax(row / temperature) by inverse CDF of one uniform (argmax at temperature 0)");
  m.def("apply_token_bitmask", &apply_token_bitmask, py::arg("logits"), py::arg("rows"), py::arg("bitmask"),
        "-inf on logits[rows[r], j] where bit j of the int32 bitmask row r is 0 (structured outputs), in place");
}
