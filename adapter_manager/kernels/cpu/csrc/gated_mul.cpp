// The gated MLP activations over the fused gate|up output, one call each: out = round(act(gate)) · up.
//   silu_mul:      act = silu (SwiGLU)
//   gelu_tanh_mul: act = torch's gelu(approximate="tanh"): 0.5·g·(1 + tanh(u)), u = √(2/π)·(g + 0.044715·g³) (GeGLU),
//                  computed as g / (1 + exp(-2u)) (the same function: 1 + tanh(u) = 2·sigmoid(2u)) with the branch-free
//                  exp, so the loop vectorizes as silu's does and never cancels where tanh(u) nears -1
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>

#include "decode_common.h"

namespace {

using adapter_manager_cpu::exp_poly;
using adapter_manager_cpu::round_to;

struct Silu {
  static float apply(float g) { return g / (1.f + exp_poly(-g)); }
};

struct GeluTanh {
  static float apply(float g) {
    constexpr float kTwoBeta = 1.5957691216057308f, kKappa = 0.044715f;  // 2·√(2/π)
    return g / (1.f + exp_poly(-kTwoBeta * (g + kKappa * g * g * g)));
  }
};

template <typename scalar_t, typename Act>
void gated_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t tokens = gate_up.size(0), width = gate_up.size(1) / 2, gs = gate_up.stride(0);
  const scalar_t* gp = gate_up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
#pragma omp parallel for if (tokens * width > 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    const scalar_t *gate = gp + t * gs, *up = gate + width;
    scalar_t* dst = op + t * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float act = round_to<scalar_t>(Act::apply(static_cast<float>(gate[i])));
      dst[i] = static_cast<scalar_t>(act * static_cast<float>(up[i]));
    }
  }
}

template <typename Act>
at::Tensor gated_mul(const at::Tensor& gate_up, const char* name) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              name, ": gate_up must be a CPU [T, 2·I] tensor with unit inner stride, got ", gate_up.sizes());
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "gated_mul",
                                  [&] { gated_impl<scalar_t, Act>(gate_up, out); });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated_mul<Silu>(gate_up, "silu_mul"); }

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gated_mul<GeluTanh>(gate_up, "gelu_tanh_mul"); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
}
