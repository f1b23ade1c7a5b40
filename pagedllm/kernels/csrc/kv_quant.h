// Writes into an 8-bit KV cache (attention/kv_quant.py is the reference, byte for byte): each
// token's K and V row of each kv head gets scale = bfloat16(max|x| / qmax) and is stored as
// x / scale, clamped to +-qmax, rounded half to even (int8) or by the fp8 conversion (c10's, the
// one torch's .to() uses).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "vec.h"

namespace pagedllm {
namespace kvq {

template <typename T>
inline T encode(float y);
template <>
inline int8_t encode<int8_t>(float y) { return static_cast<int8_t>(std::nearbyint(y)); }
template <>
inline c10::Float8_e4m3fn encode<c10::Float8_e4m3fn>(float y) { return c10::Float8_e4m3fn(y); }
template <>
inline c10::Float8_e5m2 encode<c10::Float8_e5m2>(float y) { return c10::Float8_e5m2(y); }

template <typename X, typename T>
inline void quantize_row(const X* x, int64_t D, float qmax, T* dst, c10::BFloat16* scale) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const c10::BFloat16 sb(amax / qmax);
  const float s = static_cast<float>(sb);
  *scale = sb;
  for (int64_t d = 0; d < D; ++d) {
    const float y = s > 0.0f ? to_float(x[d]) / s : 0.0f;
    dst[d] = encode<T>(std::min(std::max(y, -qmax), qmax));
  }
}

template <typename X, typename T>
void write(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor k_scales, torch::Tensor v_scales,
           torch::Tensor key, torch::Tensor value, const int64_t* slots, int64_t T_, float qmax) {
  const int64_t Hkv = key.size(1), D = key.size(2);
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  c10::BFloat16* ksc = k_scales.data_ptr<c10::BFloat16>();
  c10::BFloat16* vsc = v_scales.data_ptr<c10::BFloat16>();
  const X* kp = key.data_ptr<X>();
  const X* vp = value.data_ptr<X>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
#pragma omp parallel for if (T_ * Hkv * D >= (1 << 15))
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding rows
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t row = slot * Hkv + h;
      quantize_row(kp + t * ks + h * D, D, qmax, kc + row * D, ksc + row);
      quantize_row(vp + t * vs + h * D, D, qmax, vc + row * D, vsc + row);
    }
  }
}

}  // namespace kvq

inline void write_kv_quant(torch::Tensor key_cache,    // [num_blocks, block_size, Hkv, D] int8 / fp8
                           torch::Tensor value_cache,  // same
                           torch::Tensor k_scales,     // [num_blocks, block_size, Hkv] bfloat16
                           torch::Tensor v_scales,
                           torch::Tensor key,          // [>= T, Hkv, D] float32/bfloat16, heads contiguous
                           torch::Tensor value,
                           torch::Tensor slot_mapping) {  // [T] int64, negative: skipped
  const auto ct = key_cache.scalar_type(), xt = key.scalar_type();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && k_scales.is_contiguous() &&
              v_scales.is_contiguous(), "write_kv_quant: contiguous caches and scales expected");
  TORCH_CHECK(value_cache.scalar_type() == ct && (ct == at::kChar || ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2),
              "write_kv_quant: int8 or fp8 caches expected");
  TORCH_CHECK(k_scales.scalar_type() == at::kBFloat16 && v_scales.scalar_type() == at::kBFloat16,
              "write_kv_quant: bfloat16 scales expected");
  TORCH_CHECK((xt == torch::kFloat32 || xt == torch::kBFloat16) && value.scalar_type() == xt,
              "write_kv_quant: float32 or bfloat16 key/value");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "write_kv_quant: int64 slot_mapping");
  const int64_t T_ = slot_mapping.numel();
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) >= T_ && value.size(0) >= T_ &&
              value.sizes() == key.sizes(), "write_kv_quant: key/value [T, Hkv, D]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "write_kv_quant: each token's heads must be contiguous");
  const int64_t Hkv = key.size(1), D = key.size(2);
  TORCH_CHECK(key_cache.size(-1) == D && key_cache.size(-2) == Hkv && value_cache.numel() == key_cache.numel() &&
              k_scales.numel() * D == key_cache.numel() && v_scales.numel() == k_scales.numel(),
              "write_kv_quant: cache / scales shape");
  const int64_t num_slots = key_cache.numel() / (Hkv * D);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(slots[t] < num_slots, "write_kv_quant: slot ", slots[t], " out of range");
  const float qmax = ct == at::kChar ? 127.0f : ct == at::kFloat8_e4m3fn ? 448.0f : 57344.0f;
  const auto with_x = [&](auto x) {
    using X = decltype(x);
    if (ct == at::kChar) kvq::write<X, int8_t>(key_cache, value_cache, k_scales, v_scales, key, value, slots, T_, qmax);
    else if (ct == at::kFloat8_e4m3fn)
      kvq::write<X, c10::Float8_e4m3fn>(key_cache, value_cache, k_scales, v_scales, key, value, slots, T_, qmax);
    else kvq::write<X, c10::Float8_e5m2>(key_cache, value_cache, k_scales, v_scales, key, value, slots, T_, qmax);
  };
  if (xt == torch::kFloat32) with_x(float{});
  else with_x(c10::BFloat16{});
}

}  // namespace pagedllm
