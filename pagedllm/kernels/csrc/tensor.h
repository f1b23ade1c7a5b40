// The part of torch the kernel translation units need: at::Tensor, TORCH_CHECK, the factory
// functions they call, and the torch:: spellings the headers use (torch::Tensor, torch::kFloat32).
// Including <torch/extension.h> instead takes ~25 s per translation unit; this takes ~2 s. A
// kernel that needs another ATen function includes its <ATen/ops/NAME.h> here.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Exception.h>

#include <optional>

namespace pagedllm_torch_names {  // what torch/types.h adds to torch:: (used only where it is not included)
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace pagedllm_torch_names

namespace torch {
// Qualified lookup in torch:: finds its own declarations first (those of torch/types.h, where a
// translation unit includes it as well) and only then these namespaces, so both can coexist.
using namespace at;                     // NOLINT
using namespace pagedllm_torch_names;  // NOLINT
}  // namespace torch
