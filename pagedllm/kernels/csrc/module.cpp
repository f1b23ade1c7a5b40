// The one translation unit of pagedllm's CPU kernels (torch/extension.h is slow to compile,
// so the kernels are headers included here once).
#include "fused_ops.h"
#include "packed_gemm.h"
#include "paged_decode.h"
#include "paged_prefill.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &pagedllm::paged_decode_attention, "paged decode attention over the KV cache blocks");
  m.def("paged_prefill_attention", &pagedllm::paged_prefill_attention,
        "causal attention of prompt chunks over the KV cache blocks (cached prefix + the chunk)");
  m.def("packed_linear", &pagedllm::packed_linear, py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias") = py::none(), "y = x w^T (+ bias) with w packed in 16-column panels");
  m.def("rms_norm", &pagedllm::rms_norm, "out = rms_norm(x) * weight");
  m.def("fused_add_rms_norm", &pagedllm::fused_add_rms_norm, "residual += x; x = rms_norm(residual) * weight (in place)");
  m.def("silu_and_mul", &pagedllm::silu_and_mul, "out = silu(x[:, :I]) * x[:, I:]");
  m.def("rotary_inplace", &pagedllm::rotary_inplace, "neox-style rotary embedding, in place");
  m.def("write_kv", &pagedllm::write_kv, "write key/value rows into their cache slots");
  m.def("argmax_rows", &pagedllm::argmax_rows, "index of the first maximum of each float32 row");
}
