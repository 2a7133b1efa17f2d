// add_rms_norm: the decode layer's residual add (in place) and the next RMSNorm in one call:
//   h += delta (when given);  out = weight · round(h / sqrt(mean(h²) + eps))   (fp32 math, rounded as the torch form)
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "decode_common.h"

namespace {

using adapter_manager_cpu::round_to;

template <typename scalar_t>
void norm_impl(at::Tensor& h, const at::Tensor* delta, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t tokens = h.size(0), width = h.size(1), hs = h.stride(0), os = out.stride(0);
  scalar_t* hp = h.data_ptr<scalar_t>();
  const scalar_t* dp = delta ? delta->data_ptr<scalar_t>() : nullptr;
  const int64_t ds = delta ? delta->stride(0) : 0;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
#pragma omp parallel for if (tokens * width > 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    scalar_t* row = hp + t * hs;
    if (dp) {
      const scalar_t* add = dp + t * ds;
      for (int64_t i = 0; i < width; ++i) row[i] = static_cast<scalar_t>(static_cast<float>(row[i]) + static_cast<float>(add[i]));
    }
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
    scalar_t* dst = op + t * os;
    for (int64_t i = 0; i < width; ++i)
      dst[i] = static_cast<scalar_t>(round_to<scalar_t>(static_cast<float>(row[i]) * inv) * static_cast<float>(wp[i]));
  }
}

at::Tensor add_rms_norm(at::Tensor h, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.device().is_cpu() && h.dim() == 2 && h.stride(1) == 1,
              "add_rms_norm: h must be a CPU [T, H] tensor with unit inner stride, got ", h.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == h.scalar_type(),
              "add_rms_norm: weight must be a contiguous [H = ", h.size(1), "] in h's dtype, got ", weight.sizes());
  if (delta) {
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->stride(1) == 1 && delta->scalar_type() == h.scalar_type() &&
                    delta->device().is_cpu(),
                "add_rms_norm: delta must match h ", h.sizes(), " with unit inner stride, got ", delta->sizes());
  }
  auto out = at::empty(h.sizes(), h.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    norm_impl<scalar_t>(h, delta ? &*delta : nullptr, weight, eps, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("add_rms_norm", &add_rms_norm); }
