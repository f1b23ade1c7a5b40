// The steady decode step of a Llama-shaped decoder (pre-norm RMSNorm, fused q/k/v with neox
// rotary, paged attention, o projection, SiLU-gated MLP) over every layer in one native call:
// the same kernels the Python layers call (ops.h), in the same order and dtypes, so the result is
// the Python path's bit for bit, without ~10 interpreter round trips per layer.
//
// A DecodeStack is built once per model (models/decode_stack.py) from each layer's norm weights,
// its four linear layers -- each a list of row segments, every segment one of the weight forms
// the Python layers multiply (pagedllm's packed float panels, quantized-GEMM panels, GGUF blocks
// or a plain dense weight) -- and its KV cache planes, with the model's rotary cos/sin tables, and
// where it can, its token embedding table and LM head. run() takes the step's token ids (or their
// embedded rows), positions and paged-attention metadata and returns the final-normed hidden
// states; logits() multiplies them by the LM head.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"
#include "tensor.h"

namespace pagedllm {
namespace stack {

using at::Tensor;

enum SegKind : int64_t { kPackedFloat = 0, kQuantPanels = 1, kGGUF = 2, kDense = 3 };

// (kind, row_offset, rows, a, b, c, p0, p1): kPackedFloat a = packed panels; kQuantPanels a =
// packed codes, b = scales, c = zeros, p0 = kind code, p1 = group size; kGGUF a = blocks, p0 =
// ggml type; kDense a = weight [rows, K].
using SegSpec = std::tuple<int64_t, int64_t, int64_t, Tensor, std::optional<Tensor>, std::optional<Tensor>, int64_t,
                           int64_t>;

struct Segment {
  int64_t kind, row_offset, rows;
  Tensor a;
  std::optional<Tensor> b, c;
  int64_t p0, p1;
};

// One layer's product as the Python layers compute it (layers/cpu_gemm.linear, qgemm's
// _cpu_linear, quantization/gguf.gguf_linear): a single packed or dense segment takes the bias in
// its kernel (float32) or in F.linear; GGUF blocks and several segments add it afterwards.
struct Linear {
  std::vector<Segment> segs;
  int64_t out_features = 0;
  std::optional<Tensor> bias, bias_f32;

  Tensor segment(const Segment& s, const Tensor& x, const std::optional<Tensor>& b) const {
    switch (s.kind) {
      case kPackedFloat: return ops::packed_linear(x, s.a, s.rows, b);
      case kQuantPanels: return ops::quant_linear(x, s.a, s.p0, *s.b, s.c, s.rows, s.p1, std::nullopt, b);
      default: TORCH_CHECK(false, "decode stack: unknown segment kind ", s.kind);
    }
    return Tensor();
  }

  // out: a buffer for y (contiguous [B, out_features] of x's dtype) where the product can write
  // into one (quantized panels, GGUF blocks; no bias), else y is a new tensor.
  Tensor operator()(const Tensor& x, const Tensor* out = nullptr) const {
    if (segs.size() == 1 && segs[0].kind == kDense) return at::linear(x, segs[0].a, bias);
    Tensor y;
    if (segs.size() == 1 && segs[0].kind != kGGUF) {
      const Segment& s = segs[0];
      if (out != nullptr && s.kind == kQuantPanels && !bias)
        return ops::quant_linear_out(*out, x, s.a, s.p0, *s.b, s.c, s.rows, s.p1);
      y = segment(s, x, bias_f32);
      return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
    }
    y = out != nullptr && !bias ? *out : at::empty({x.size(0), out_features}, x.options());
    for (const Segment& s : segs) {
      Tensor part = y.narrow(1, s.row_offset, s.rows);
      if (s.kind == kGGUF)
        ops::gguf_linear(part, x, s.a, s.p0);
      else if (s.kind == kDense)
        part.copy_(at::linear(x, s.a));
      else
        part.copy_(segment(s, x, std::nullopt));
    }
    if (bias) y = y + bias->to(y.scalar_type());
    return y;
  }
};

Linear make_linear(const std::vector<SegSpec>& specs, int64_t out_features, std::optional<Tensor> bias) {
  Linear l;
  l.out_features = out_features;
  l.bias = bias;
  if (bias) l.bias_f32 = bias->to(at::kFloat).contiguous();
  int64_t covered = 0;
  for (const auto& [kind, off, rows, a, b, c, p0, p1] : specs) {
    TORCH_CHECK(kind >= kPackedFloat && kind <= kDense, "decode stack: segment kind ", kind);
    TORCH_CHECK(kind != kQuantPanels || b.has_value(), "decode stack: quantized panels need scales");
    l.segs.push_back(Segment{kind, off, rows, a, b, c, p0, p1});
    covered += rows;
  }
  TORCH_CHECK(covered == out_features, "decode stack: segments cover ", covered, " of ", out_features, " rows");
  return l;
}

// The token embedding as the Python layers look it up (layers/embedding.py): a dense table's rows
// as F.embedding copies them; a GGUF table's quantized panels dequantized as
// quantization/gguf_panels.panel_rows does, (code - zero) * scale in float32 (zero: the stored
// one, else 8 for int4 codes and none for int8), or its GGUF blocks as gguf_dequantize does; the
// quantized forms' float32 rows then rounded to the model's dtype.
struct Embedding {
  int64_t kind = -1;  // -1: none (run() takes embedded rows)
  Tensor a;
  std::optional<Tensor> scales, zeros;
  int64_t p0 = 0, p1 = 0, rows = 0, K = 0;
  at::ScalarType dtype = at::kFloat;

  Tensor panel_rows(const Tensor& ids) const {
    const int64_t B = ids.size(0), G = K / p1;
    const bool int4 = p0 == 1;
    const int64_t pb = (int4 ? K / 2 : K) * 16;
    Tensor out = at::empty({B, K}, at::TensorOptions().dtype(at::kFloat));
    const int64_t* id = ids.data_ptr<int64_t>();
    const uint8_t* codes = static_cast<const uint8_t*>(a.data_ptr());
    const float* sc = scales->data_ptr<float>();
    const float* zp = zeros ? zeros->data_ptr<float>() : nullptr;
    float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < B; ++r, o += K) {
      const int64_t p = id[r] / 16, j = id[r] % 16;
      const uint8_t* c = codes + p * pb + j;
      const float* s = sc + p * G * 16 + j;
      const float* z = zp ? zp + p * G * 16 + j : nullptr;
      for (int64_t g = 0; g < G; ++g) {
        const float sg = s[g * 16];
        float* og = o + g * p1;
        if (int4) {
          const float zg = z ? z[g * 16] : 8.0f;
          const uint8_t* cg = c + g * (p1 / 2) * 16;
          for (int64_t i = 0; i < p1 / 2; ++i) {
            const uint8_t byte = cg[i * 16];
            og[2 * i] = (static_cast<float>(byte & 0xF) - zg) * sg;
            og[2 * i + 1] = (static_cast<float>(byte >> 4) - zg) * sg;
          }
        } else {
          const uint8_t* cg = c + g * p1 * 16;
          if (z) {
            const float zg = z[g * 16];
            for (int64_t i = 0; i < p1; ++i) og[i] = (static_cast<float>(static_cast<int8_t>(cg[i * 16])) - zg) * sg;
          } else {
            for (int64_t i = 0; i < p1; ++i) og[i] = static_cast<float>(static_cast<int8_t>(cg[i * 16])) * sg;
          }
        }
      }
    }
    return out;
  }

  Tensor operator()(const Tensor& ids) const {
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
                "decode stack: token ids must be contiguous int64 [B]");
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t r = 0; r < ids.size(0); ++r)
      TORCH_CHECK(id[r] >= 0 && id[r] < rows, "decode stack: token id ", id[r], " out of range for ", rows, " rows");
    if (kind == kDense) return at::index_select(a, 0, ids);
    Tensor out = kind == kQuantPanels ? panel_rows(ids) : ops::gguf_dequantize(a, p0, ids, K);
    return out.scalar_type() == dtype ? out : out.to(dtype);
  }
};

// The heads of a fused q/k/v product's rows [B, (H + 2 Hkv) D]: q [B, H, D], k and v [B, Hkv, D],
// and q's heads with k's after them (adjacent in each row: one rotary call for both).
struct Heads {
  Tensor q, k, v, qk;
};

struct Layer {
  Tensor in_norm, post_norm;
  Linear qkv, o, gate_up, down;
  Tensor k_cache, v_cache;
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, int64_t sliding_window,
              double eps, Tensor final_norm)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), scale_(scale), window_(sliding_window), eps_(eps),
        final_norm_(final_norm) {}

  void add_layer(Tensor in_norm, Tensor post_norm, std::vector<SegSpec> qkv, std::optional<Tensor> qkv_bias,
                 std::vector<SegSpec> o, std::vector<SegSpec> gate_up, std::vector<SegSpec> down,
                 int64_t intermediate, Tensor k_cache, Tensor v_cache) {
    const int64_t hidden = in_norm.numel();
    Layer l;
    l.in_norm = in_norm;
    l.post_norm = post_norm;
    l.qkv = make_linear(qkv, (H_ + 2 * Hkv_) * D_, qkv_bias);
    l.o = make_linear(o, hidden, std::nullopt);
    l.gate_up = make_linear(gate_up, 2 * intermediate, std::nullopt);
    l.down = make_linear(down, hidden, std::nullopt);
    l.k_cache = k_cache;
    l.v_cache = v_cache;
    layers_.push_back(std::move(l));
  }

  // The rotary tables [max_position, D] in the model's dtype (layers/rotary.RotaryEmbedding's),
  // whose rows run() gathers by position.
  void set_rotary(Tensor cos, Tensor sin) {
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D_ && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                    sin.is_contiguous(), "decode stack: rotary tables [max_position, head_dim] expected");
    cos_ = cos;
    sin_ = sin;
  }

  // The token embedding run() looks up (a segment spec: kDense a = table [rows, K]; kQuantPanels a =
  // panels, b = scales, c = zeros, p0 = kind code (int8 0, int4 1), p1 = group size; kGGUF a =
  // blocks, p0 = ggml type), its rows rounded to ``dtype``.
  void set_embedding(SegSpec spec, int64_t K, at::ScalarType dtype) {
    const auto& [kind, off, rows, a, b, c, p0, p1] = spec;
    TORCH_CHECK(off == 0 && (kind == kDense || kind == kGGUF || (kind == kQuantPanels && b && (p0 == 0 || p0 == 1))),
                "decode stack: an embedding of kind ", kind);
    TORCH_CHECK(kind != kQuantPanels || (p1 > 0 && K % p1 == 0 && p1 % 2 == 0 && a.size(0) * 16 >= rows),
                "decode stack: embedding panels");
    embed_ = Embedding{kind, a, b, c, p0, p1, rows, K, dtype};
  }

  // The LM head's segments over ``out_features`` rows, of which logits() keeps the first ``vocab``.
  void set_head(std::vector<SegSpec> segs, int64_t out_features, int64_t vocab) {
    head_ = make_linear(segs, out_features, std::nullopt);
    vocab_ = vocab;
  }

  bool has_embedding() const { return embed_.kind >= 0; }
  bool has_head() const { return vocab_ > 0; }

  // x [N, hidden] -> logits [N, vocab] (ParallelLMHead.forward's product on one rank).
  Tensor logits(Tensor x) const {
    TORCH_CHECK(has_head() && x.dim() == 2, "decode stack: logits() needs a head and x [N, hidden]");
    if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) x = x.to(at::kFloat);
    return head_(x.contiguous()).narrow(1, 0, vocab_);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  Heads heads(const Tensor& qkv) const {
    const int64_t B = qkv.size(0);
    return Heads{qkv.narrow(1, 0, H_ * D_).view({B, H_, D_}), qkv.narrow(1, H_ * D_, Hkv_ * D_).view({B, Hkv_, D_}),
                 qkv.narrow(1, (H_ + Hkv_) * D_, Hkv_ * D_).view({B, Hkv_, D_}),
                 qkv.narrow(1, 0, (H_ + Hkv_) * D_).view({B, H_ + Hkv_, D_})};
  }

  // Seconds spent per phase of run() since profiling was switched on (off: empty, no clock reads).
  void set_profiling(bool on) {
    profiling_ = on;
    phases_.clear();
  }
  std::map<std::string, double> phases() const { return phases_; }

  // tokens: int64 ids [B] (looked up in the embedding) or their embedded rows [B, hidden] (consumed);
  // positions int64 [B]; one decode token per request.
  Tensor run(Tensor tokens, Tensor positions, Tensor block_table, Tensor seq_lens, Tensor slot_mapping) {
    TORCH_CHECK(tokens.dim() != 1 || has_embedding(), "decode stack: token ids given, but no embedding table");
    Tensor h = tokens.dim() == 1 ? embed_(tokens) : tokens;
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode stack: h must be contiguous [B, hidden]");
    const int64_t B = h.size(0);
    TORCH_CHECK(cos_.defined(), "decode stack: no rotary tables");
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == B && positions.scalar_type() == at::kLong &&
                    positions.is_contiguous(), "decode stack: one int64 position per token");
    Tensor cos, sin;
    const int64_t pos = positions.data_ptr<int64_t>()[0];
    if (B == 1 && pos >= 0 && pos < cos_.size(0)) {  // the row itself, no gather
      cos = cos_.narrow(0, pos, 1);
      sin = sin_.narrow(0, pos, 1);
    } else {
      cos = at::index_select(cos_, 0, positions);
      sin = at::index_select(sin_, 0, positions);
    }
    // One buffer per product output, attention output and activation, reused by every layer (each
    // is consumed within its layer; x, the down products' and the result, is new per run), and the
    // heads' views of the q/k/v buffer.
    const auto opts = h.options();
    const Tensor qkv_buf = at::empty({B, (H_ + 2 * Hkv_) * D_}, opts), o_buf = at::empty({B, h.size(1)}, opts);
    const Tensor attn = at::empty({B, H_, D_}, opts), attn_rows = attn.view({B, H_ * D_});
    const Heads buf_heads = heads(qkv_buf);
    Tensor residual, gu_buf, act;
    Tensor x = h;
    auto t = std::chrono::steady_clock::now();
    const auto mark = [&](const char* phase) {
      if (!profiling_) return;
      const auto now = std::chrono::steady_clock::now();
      phases_[phase] += std::chrono::duration<double>(now - t).count();
      t = now;
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (i == 0) {
        residual = h;
        x = at::empty_like(h);
        ops::rms_norm(x, h, l.in_norm, eps_);
      } else {
        ops::fused_add_rms_norm(x, residual, l.in_norm, eps_);
      }
      mark("norm");
      const Tensor qkv = l.qkv(x, &qkv_buf);  // [B, (H + 2 Hkv) D]
      mark("qkv");
      const Heads hd = qkv.is_same(qkv_buf) ? buf_heads : heads(qkv);
      ops::rotary_inplace(hd.qk, cos, sin);
      mark("rotary");
      ops::write_kv(l.k_cache, l.v_cache, hd.k, hd.v, slot_mapping);
      ops::paged_decode_attention(attn, hd.q, l.k_cache, l.v_cache, block_table, seq_lens, scale_, window_, 0.0,
                                  std::nullopt, std::nullopt);
      mark("attention");
      Tensor o = l.o(attn_rows, &o_buf);
      mark("o");
      ops::fused_add_rms_norm(o, residual, l.post_norm, eps_);
      mark("norm");
      const int64_t inter = l.gate_up.out_features / 2;
      if (!gu_buf.defined() || gu_buf.size(1) != 2 * inter) {
        gu_buf = at::empty({B, 2 * inter}, opts);
        act = at::empty({B, inter}, opts);
      }
      Tensor gu = l.gate_up(o, &gu_buf);
      mark("gate_up");
      ops::silu_and_mul(act, gu);
      mark("silu");
      x = l.down(act, &x);
      mark("down");
    }
    ops::fused_add_rms_norm(x, residual, final_norm_, eps_);
    mark("norm");
    return x;
  }

 private:
  int64_t H_, Hkv_, D_;
  double scale_;
  int64_t window_;
  double eps_;
  Tensor final_norm_;
  Tensor cos_, sin_;
  Embedding embed_;
  Linear head_;
  int64_t vocab_ = 0;
  std::vector<Layer> layers_;
  bool profiling_ = false;
  std::map<std::string, double> phases_;
};

}  // namespace stack

namespace ops {

void bind_decode_stack(pybind11::module_& m) {
  namespace py = pybind11;
  using pagedllm::stack::DecodeStack;
  // module_local: every ISA level's build is its own extension module, and a process may load several
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local(),
                          "the steady decode step of a Llama-shaped decoder, every layer in one native call")
      .def(py::init<int64_t, int64_t, int64_t, double, int64_t, double, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("sliding_window"), py::arg("eps"),
           py::arg("final_norm"))
      .def("add_layer", &DecodeStack::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("qkv"),
           py::arg("qkv_bias"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("intermediate"),
           py::arg("k_cache"), py::arg("v_cache"))
      .def("set_rotary", &DecodeStack::set_rotary, py::arg("cos"), py::arg("sin"))
      .def("set_embedding", &DecodeStack::set_embedding, py::arg("spec"), py::arg("k"), py::arg("dtype"))
      .def("set_head", &DecodeStack::set_head, py::arg("segments"), py::arg("out_features"), py::arg("vocab"))
      .def("run", &DecodeStack::run, py::arg("tokens"), py::arg("positions"), py::arg("block_table"),
           py::arg("seq_lens"), py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>())
      .def("logits", &DecodeStack::logits, py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def_property_readonly("has_embedding", &DecodeStack::has_embedding)
      .def_property_readonly("has_head", &DecodeStack::has_head)
      .def("set_profiling", &DecodeStack::set_profiling, py::arg("on"),
           "time run()'s phases (norm, qkv, rotary, attention, o, gate_up, silu, down) from now on")
      .def("phases", &DecodeStack::phases, "seconds per phase since set_profiling(True)");
}

}  // namespace ops
}  // namespace pagedllm
