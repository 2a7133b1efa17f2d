// vector_epilogue: a LoRA variant's per-output vectors on a linear's output, per token, in one call per group of
// adjacent parts (DoRA's scale, LoRA's bias; kernels/vectors.py has the semantics and the torch forms):
//   y[t, start + j] += vectors[bias[t], j];  y[t, start + j] += y[t, start + j] * vectors[scale[t], j]
// in fp32, rounded once to y's dtype. A token's result reads only its own row and its own vector rows, in an order
// fixed by the column, so it is the same bits in any batch (the deterministic mode's rule).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>

#include "lora_common.h"

namespace {

template <typename scalar_t>
void epilogue_impl(at::Tensor& y, int64_t start, const at::Tensor& vectors, const int64_t* bias, const int64_t* scale) {
  const int64_t tokens = y.size(0), width = vectors.size(1), ys = y.stride(0), vs = vectors.stride(0);
  scalar_t* yp = y.data_ptr<scalar_t>() + start;
  const scalar_t* vp = vectors.data_ptr<scalar_t>();
#pragma omp parallel for if (tokens * width > 262144)
  for (int64_t t = 0; t < tokens; ++t) {
    scalar_t* row = yp + t * ys;
    const scalar_t* add = bias ? vp + bias[t] * vs : nullptr;
    const scalar_t* mul = scale ? vp + scale[t] * vs : nullptr;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) {
      float value = static_cast<float>(row[j]);
      if (add) value += static_cast<float>(add[j]);
      if (mul) value += value * static_cast<float>(mul[j]);
      row[j] = static_cast<scalar_t>(value);
    }
  }
}

const int64_t* index_of(const c10::optional<at::Tensor>& index, int64_t tokens, int64_t rows, const char* name) {
  if (!index.has_value()) return nullptr;
  const at::Tensor& i = *index;
  TORCH_CHECK(i.device().is_cpu() && i.scalar_type() == at::kLong && i.dim() == 1 && i.size(0) == tokens &&
                  i.is_contiguous(),
              "vector_epilogue: ", name, " must be a contiguous CPU int64 [", tokens, "] tensor, got ", i.sizes(), " ",
              i.scalar_type());
  const int64_t* p = i.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(0 <= p[t] && p[t] < rows, "vector_epilogue: ", name, "[", t, "] = ", p[t], " is outside 0..", rows - 1);
  return p;
}

void vector_epilogue(at::Tensor y, int64_t start, const at::Tensor& vectors, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& scale) {
  adapter_manager_cpu::apply_vector_groups("vector_epilogue", y, {vectors}, {start}, bias, scale);
}

}  // namespace

namespace adapter_manager_cpu {

void apply_vector_groups(const char* op, at::Tensor& y, at::TensorList vectors, at::IntArrayRef starts,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(vectors.size() == starts.size(), op, ": ", vectors.size(), " vector groups but ", starts.size(),
              " starts");
  if (vectors.empty() || (!bias.has_value() && !scale.has_value())) return;
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.stride(1) == 1, op, ": y must be a CPU [T, out] tensor with "
              "unit inner stride, got ", y.sizes());
  for (size_t g = 0; g < vectors.size(); ++g) {
    const at::Tensor& v = vectors[g];
    const int64_t start = starts[g];
    TORCH_CHECK(v.device().is_cpu() && v.dim() == 2 && v.stride(1) == 1 && v.scalar_type() == y.scalar_type(), op,
                ": vectors must be a CPU [S + 1, columns] ", y.scalar_type(), " tensor with unit inner stride, got ",
                v.sizes(), " ", v.scalar_type());
    TORCH_CHECK(0 <= start && start + v.size(1) <= y.size(1), op, ": columns [", start, ", ", start + v.size(1),
                ") are outside y's ", y.size(1));
    const int64_t* b = index_of(bias, y.size(0), v.size(0), "bias");
    const int64_t* s = index_of(scale, y.size(0), v.size(0), "scale");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "vector_epilogue",
                                    [&] { epilogue_impl<scalar_t>(y, start, v, b, s); });
  }
}

}  // namespace adapter_manager_cpu

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("vector_epilogue(Tensor(a!) y, int start, Tensor vectors, Tensor? bias, Tensor? scale) -> ()");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("vector_epilogue", &vector_epilogue); }
