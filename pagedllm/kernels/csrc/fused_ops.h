// Fused elementwise CPU ops: one pass over memory instead of the 4-8 torch ops (and as many
// temporaries) each replaces. Arithmetic in float32; values are rounded to the tensor dtype
// where the HF reference rounds them (the residual sum, the normalised row before the weight).
#pragma once

#include <cstring>
#include <type_traits>

#include "vec.h"

namespace pagedllm {
namespace fused {

constexpr int64_t kParallelElems = 1 << 15;  // below this a single thread is faster than a fork

template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else if (dtype == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 expected, got ", dtype);
  }
}

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-D tensor with contiguous rows expected");
}

template <typename T>
float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef PAGEDLLM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += to_float(x[i]) * to_float(x[i]);
  return s;
}

// out = T(T(x * inv_rms) * w)
template <typename T>
void normalize_row(T* out, const T* x, const T* w, float inv, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX512  // elementwise, so 16 lanes give the 8-lane loop's values
  const __m512 iv16 = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16)
    store16_as8(out + i, _mm512_mul_ps(round16(out, _mm512_mul_ps(load16(x + i), iv16)), load16(w + i)));
#endif
#ifdef PAGEDLLM_AVX2
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    __m256 y = _mm256_mul_ps(load8(x + i), iv);
    if constexpr (!std::is_same_v<T, float>) {  // HF rounds the normalised row before the weight
      alignas(32) T tmp[8];
      store8(tmp, y);
      y = load8(tmp);
    }
    store8(out + i, _mm256_mul_ps(y, load8(w + i)));
  }
#endif
  for (; i < n; ++i) out[i] = from_float<T>(to_float(from_float<T>(to_float(x[i]) * inv)) * to_float(w[i]));
}

}  // namespace fused

// out[i] = rms_norm(x[i]) * weight
inline void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  fused::check_rows(x, "rms_norm");
  fused::check_rows(out, "rms_norm");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.numel() == x.size(1) && weight.is_contiguous(), "rms_norm: shapes");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "rms_norm: dtypes differ");
  const int64_t N = x.size(0), H = x.size(1), xs = x.stride(0), os = out.stride(0);
  fused::dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
#pragma omp parallel for if (N * H >= fused::kParallelElems)
    for (int64_t r = 0; r < N; ++r) {
      const float inv = 1.0f / std::sqrt(fused::sum_squares(xp + r * xs, H) / H + static_cast<float>(eps));
      fused::normalize_row(op + r * os, xp + r * xs, wp, inv, H);
    }
  });
}

// residual += x (rounded to the dtype); x = rms_norm(residual) * weight. Both in place.
inline void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  fused::check_rows(x, "fused_add_rms_norm");
  fused::check_rows(residual, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.numel() == x.size(1) && weight.is_contiguous(),
              "fused_add_rms_norm: shapes");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: dtypes differ");
  const int64_t N = x.size(0), H = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  fused::dispatch(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
#pragma omp parallel for if (N * H >= fused::kParallelElems)
    for (int64_t r = 0; r < N; ++r) {
      T* xr = xp + r * xs;
      T* rr = rp + r * rs;
      int64_t i = 0;
#ifdef PAGEDLLM_AVX512
      for (; i + 16 <= H; i += 16) store16_as8(rr + i, _mm512_add_ps(load16(rr + i), load16(xr + i)));
#endif
#ifdef PAGEDLLM_AVX2
      for (; i + 8 <= H; i += 8) store8(rr + i, _mm256_add_ps(load8(rr + i), load8(xr + i)));
#endif
      for (; i < H; ++i) rr[i] = from_float<T>(to_float(rr[i]) + to_float(xr[i]));
      const float inv = 1.0f / std::sqrt(fused::sum_squares(rr, H) / H + static_cast<float>(eps));
      fused::normalize_row(xr, rr, wp, inv, H);
    }
  });
}

// out = silu(x[:, :I]) * x[:, I:]
inline void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  fused::check_rows(x, "silu_and_mul");
  fused::check_rows(out, "silu_and_mul");
  const int64_t N = x.size(0), I = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * I && out.size(0) == N, "silu_and_mul: x must be [N, 2 * I] for out [N, I]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: dtypes differ");
  const int64_t xs = x.stride(0), os = out.stride(0);
  fused::dispatch(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
#pragma omp parallel for if (N * I >= fused::kParallelElems)
    for (int64_t r = 0; r < N; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + I;
      T* o = op + r * os;
      int64_t i = 0;
#ifdef PAGEDLLM_AVX512  // exp16 is exp8 on 16 lanes: the same values
      for (; i + 16 <= I; i += 16) {
        const __m512 gv = load16(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        store16_as8(o + i, _mm512_mul_ps(s, load16(u + i)));
      }
#endif
#ifdef PAGEDLLM_AVX2
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        store8(o + i, _mm256_mul_ps(s, load8(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float gv = to_float(g[i]);
        o[i] = from_float<T>(gv / (1.0f + std::exp(-gv)) * to_float(u[i]));
      }
    }
  });
}

// Neox-style rotary embedding in place: x [T, H, D] (rows may be strided, heads contiguous),
// cos/sin [T, D] contiguous with both halves filled (HF layout).
inline void rotary_inplace(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_inplace: x [T, H, D] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, xs = x.stride(0);
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rotary_inplace: cos/sin [T, D] expected");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rotary_inplace: dtypes differ");
  fused::dispatch(x.scalar_type(), "rotary_inplace", [&](auto tag) {
    using T_ = decltype(tag);
    T_* xp = x.data_ptr<T_>();
    const T_* cp = cos.data_ptr<T_>();
    const T_* sp = sin.data_ptr<T_>();
#pragma omp parallel for if (T * H * D >= fused::kParallelElems)
    for (int64_t t = 0; t < T; ++t) {
      const T_* c = cp + t * D;
      const T_* s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) {
        T_* a = xp + t * xs + h * D;
        T_* b = a + half;
        int64_t i = 0;
#ifdef PAGEDLLM_AVX2
        for (; i + 8 <= half; i += 8) {
          const __m256 av = load8(a + i), bv = load8(b + i);
          store8(a + i, _mm256_fmsub_ps(av, load8(c + i), _mm256_mul_ps(bv, load8(s + i))));
          store8(b + i, _mm256_fmadd_ps(bv, load8(c + half + i), _mm256_mul_ps(av, load8(s + half + i))));
        }
#endif
        for (; i < half; ++i) {
          const float av = to_float(a[i]), bv = to_float(b[i]);
          a[i] = from_float<T_>(av * to_float(c[i]) - bv * to_float(s[i]));
          b[i] = from_float<T_>(bv * to_float(c[half + i]) + av * to_float(s[half + i]));
        }
      }
    }
  });
}

// out[r] = index of the first maximum of logits[r] (a NaN counts as the maximum, as in
// torch.argmax): one vectorised max pass and one compare pass that stops at the first hit.
// float32 or bfloat16 rows (bf16 widens exactly, so a bf16 model's logits need no float copy).
template <typename T>
inline void argmax_rows_impl(const T* xp, int64_t N, int64_t V, int64_t xs, int64_t* op) {
#pragma omp parallel for if (N * V >= fused::kParallelElems)
  for (int64_t r = 0; r < N; ++r) {
    const T* x = xp + r * xs;
    float m = -INFINITY;
    bool has_nan = false;
    int64_t i = 0;
#ifdef PAGEDLLM_AVX2
    __m256 mv = _mm256_set1_ps(-INFINITY), nan_v = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
      const __m256 v = load8(x + i);
      mv = _mm256_max_ps(mv, v);
      nan_v = _mm256_or_ps(nan_v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    m = hmax(mv);
    has_nan = _mm256_movemask_ps(nan_v) != 0;
#endif
    for (; i < V; ++i) {
      const float xi = to_float(x[i]);
      if (std::isnan(xi)) has_nan = true;
      else if (xi > m) m = xi;
    }
    int64_t best = 0;
    if (has_nan) {
      while (!std::isnan(to_float(x[best]))) ++best;
    } else {
      i = 0;
#ifdef PAGEDLLM_AVX2
      const __m256 target = _mm256_set1_ps(m);
      for (; i + 8 <= V; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), target, _CMP_EQ_OQ));
        if (hits) break;
      }
#endif
      while (i < V && to_float(x[i]) != m) ++i;
      best = i;
    }
    op[r] = best;
  }
}

#ifdef PAGEDLLM_AVX512
// bfloat16 rows on 32 int16 lanes: the bits b of a bfloat16 map to k = b ^ ((b >> 15) & 0x7FFF), an
// int16 ordered as the values are (-0 just below +0); a NaN shows as |b| > 0x7F80. The first
// maximum is then the first lane equal to the maximum's bits, or to either zero where the maximum
// is a zero (-0 == +0, as torch compares). Lanes past the row's end read as -inf and never match.
// The largest of 32 signed int16 lanes: halves folded to 8 lanes, then phminposuw on 0x7FFF - x
// (unsigned, that order is the reverse of x's signed one).
inline int16_t hmax_epi16(__m512i v) {
  const __m256i h = _mm256_max_epi16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  const __m128i q = _mm_max_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  const __m128i top = _mm_set1_epi16(0x7FFF);
  return static_cast<int16_t>(0x7FFF - (_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_sub_epi16(top, q))) & 0xFFFF));
}

inline int64_t argmax_bf16_row(const c10::BFloat16* x, int64_t V) {
  const __m512i sign_off = _mm512_set1_epi16(0x7FFF), ninf = _mm512_set1_epi16(static_cast<short>(0xFF80));
  const auto key_of = [&](__m512i b) {
    return _mm512_xor_si512(b, _mm512_and_si512(_mm512_srai_epi16(b, 15), sign_off));
  };
  __m512i k0 = _mm512_set1_epi16(-32768), k1 = k0, a0 = _mm512_setzero_si512(), a1 = a0;
  int64_t i = 0;
  for (; i + 64 <= V; i += 64) {  // two independent chains
    const __m512i b0 = _mm512_loadu_si512(x + i), b1 = _mm512_loadu_si512(x + i + 32);
    k0 = _mm512_max_epi16(k0, key_of(b0)), k1 = _mm512_max_epi16(k1, key_of(b1));
    a0 = _mm512_max_epi16(a0, _mm512_and_si512(b0, sign_off));
    a1 = _mm512_max_epi16(a1, _mm512_and_si512(b1, sign_off));
  }
  for (; i < V; i += 32) {
    const __mmask32 m = V - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (V - i)) - 1;
    const __m512i b = _mm512_mask_loadu_epi16(ninf, m, x + i);
    k0 = _mm512_max_epi16(k0, key_of(b)), a0 = _mm512_max_epi16(a0, _mm512_and_si512(b, sign_off));
  }
  const __m512i mk = _mm512_max_epi16(k0, k1), mabs = _mm512_max_epi16(a0, a1);
  const int16_t key = hmax_epi16(mk), top_abs = hmax_epi16(mabs);
  const bool nan = top_abs > 0x7F80, zero = key == 0 || key == -1;
  const int16_t bits = static_cast<int16_t>(key ^ ((key >> 15) & 0x7FFF));  // the map is its own inverse
  const __m512i target = nan ? _mm512_set1_epi16(0x7F80) : zero ? _mm512_setzero_si512() : _mm512_set1_epi16(bits);
  for (i = 0; i < V; i += 32) {
    const __mmask32 m = V - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (V - i)) - 1;
    __m512i b = _mm512_maskz_loadu_epi16(m, x + i);
    if (nan || zero) b = _mm512_and_si512(b, sign_off);
    const __mmask32 hit = nan ? _mm512_mask_cmpgt_epi16_mask(m, b, target) : _mm512_mask_cmpeq_epi16_mask(m, b, target);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is some lane's
}
#endif

inline void argmax_rows(torch::Tensor out, torch::Tensor logits) {
  fused::check_rows(logits, "argmax_rows");
  TORCH_CHECK((logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) && logits.size(1) > 0,
              "argmax_rows: non-empty float32 or bfloat16 rows expected");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == logits.size(0),
              "argmax_rows: int64 out [rows] expected");
  const int64_t N = logits.size(0), V = logits.size(1), xs = logits.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat) {
    argmax_rows_impl(logits.data_ptr<float>(), N, V, xs, op);
  } else {
#ifdef PAGEDLLM_AVX512
    const c10::BFloat16* xp = logits.data_ptr<c10::BFloat16>();
#pragma omp parallel for if (N * V >= fused::kParallelElems)
    for (int64_t r = 0; r < N; ++r) op[r] = argmax_bf16_row(xp + r * xs, V);
#else
    argmax_rows_impl(logits.data_ptr<c10::BFloat16>(), N, V, xs, op);
#endif
  }
}

// Writes each token's key and value rows into their cache slots (slot < 0: skipped).
inline void write_kv(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key, torch::Tensor value,
                     torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "write_kv: contiguous caches expected");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "write_kv: int64 slot_mapping");
  const int64_t T = slot_mapping.numel();
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) >= T && value.size(0) >= T, "write_kv: key/value [T, Hkv, D]");
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "write_kv: each token's heads must be contiguous");
  TORCH_CHECK(key_cache.numel() % row == 0 && value_cache.numel() == key_cache.numel(), "write_kv: cache shape");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
              "write_kv: dtypes differ");
  const int64_t num_slots = key_cache.numel() / row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] < num_slots, "write_kv: slot ", slots[t], " out of range");
  if (key.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kBFloat16) {
    // a bfloat16 cache under a float32 model: each row rounded to nearest even as it is stored
    const float* kp = key.data_ptr<float>();
    const float* vp = value.data_ptr<float>();
    c10::BFloat16* kc = key_cache.data_ptr<c10::BFloat16>();
    c10::BFloat16* vc = value_cache.data_ptr<c10::BFloat16>();
    const int64_t ks = key.stride(0), vs = value.stride(0);
#pragma omp parallel for if (T * row >= fused::kParallelElems)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t i = 0; i < row; ++i) {
        kc[slot * row + i] = c10::BFloat16(kp[t * ks + i]);
        vc[slot * row + i] = c10::BFloat16(vp[t * vs + i]);
      }
    }
    return;
  }
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(), "write_kv: dtypes differ (a float32 key and value may go "
              "into a bfloat16 cache; otherwise the cache's dtype)");
  const int64_t elem = key.element_size();
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * elem, vs = value.stride(0) * elem, bytes = row * elem;
#pragma omp parallel for if (T * row >= fused::kParallelElems)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * bytes, kp + t * ks, bytes);
    std::memcpy(vc + slot * bytes, vp + t * vs, bytes);
  }
}

}  // namespace pagedllm
