// fixed_linear: the deterministic mode's linear. Every output is summed in one fixed order whatever else shares the
// call (fp32, bf16, fp16), then each group's LoRA is added as lora_apply's loops.
//
//   y[t, n] = Σ_k x[t, k] · W[n, k]     16 lane sums over k (lane = k mod 16), one fixed tree over the lanes, then the
//                                       k past the last multiple of 16 in order; fp32 throughout, rounded once to y
//   y[t, off_p : off_p + out_p] += (x[t] @ A_p[rows].T) @ Bt_p[rows]   per run and part, as lora_apply
//
// Nothing in that order depends on how many tokens the call has, on which tokens share it, or on the threads: tokens
// go 8 at a time (a short last tile repeats its first row and drops those results), W rows two at a time
// (pair_dots, lora_common.h), each thread a static share of panels of kPanel rows (a bf16 / fp16 panel converted to
// fp32 once, then read from L2 by every tile of tokens). lora_apply's loops are per token already: each token's
// shrink is one reduction over its own x row, its expand one fp32 sum per column before one add into y.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::apply_groups;
using adapter_manager_cpu::pair_dots;

constexpr int64_t kPanel = 32;  // W rows per work item (its fp32 copy: 32 · in floats, in L2)
constexpr int64_t kTokens = 8;  // tokens per pass over a pair of W rows (pair_dots' width)

// y[t, n0 + r] for every token t and the panel's rows r (fp32 at wf, K apart).
template <typename scalar_t>
void panel(const float* xp, int64_t xs, int64_t T, const float* wf, int64_t K, int64_t rows, scalar_t* y, int64_t ys,
           int64_t n0) {
  const float* xr[kTokens];
  float dots[2 * kTokens];
  for (int64_t t0 = 0; t0 < T; t0 += kTokens) {
    const int64_t tb = std::min(kTokens, T - t0);
    for (int64_t t = 0; t < kTokens; ++t) xr[t] = xp + (t0 + (t < tb ? t : 0)) * xs;
    for (int64_t r = 0; r < rows; r += 2) {
      const bool two = r + 1 < rows;
      const float* w0 = wf + r * K;
      const float* w1 = two ? w0 + K : w0;
      const float* ahead0 = r + 2 < rows ? w0 + 2 * K : w0;
      const float* ahead1 = r + 3 < rows ? w0 + 3 * K : ahead0;
      pair_dots(xr, w0, w1, K, ahead0, ahead1, dots);
      for (int64_t t = 0; t < tb; ++t) {
        scalar_t* yt = y + (t0 + t) * ys + n0 + r;
        yt[0] = static_cast<scalar_t>(dots[t]);
        if (two) yt[1] = static_cast<scalar_t>(dots[kTokens + t]);
      }
    }
  }
}

template <typename scalar_t>
void fixed_matmul(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // [T, K] fp32, unit inner stride
  const float* xp = xf.data_ptr<float>();
  const int64_t xs = xf.stride(0), panels = (N + kPanel - 1) / kPanel;
  const scalar_t* wp = w.data_ptr<scalar_t>();
  scalar_t* yp = y.data_ptr<scalar_t>();
  const bool parallel = panels > 1 && at::get_num_threads() > 1;
#pragma omp parallel num_threads(at::get_num_threads()) if (parallel)
  {
    std::unique_ptr<float[]> buffer;
    if constexpr (!std::is_same_v<scalar_t, float>) buffer.reset(new float[kPanel * K]);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanel, rows = std::min(kPanel, N - n0);
      const float* wf;
      if constexpr (std::is_same_v<scalar_t, float>) {
        wf = wp + n0 * K;
      } else {
        const scalar_t* src = wp + n0 * K;
        for (int64_t i = 0; i < rows * K; ++i) buffer[i] = static_cast<float>(src[i]);
        wf = buffer.get();
      }
      panel<scalar_t>(xp, xs, T, wf, K, rows, yp, N, n0);
    }
  }
}

at::Tensor fixed_linear_body(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
                        at::IntArrayRef offsets, const at::Tensor& runs) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "fixed_linear: CPU tensors only");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "fixed_linear: float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "fixed_linear: x must be [T, in] with unit inner stride, got ",
              x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1) && w.scalar_type() == dtype,
              "fixed_linear: w must be a contiguous [out, ", x.size(1), "] of x's dtype, got ", w.sizes(), " ",
              w.scalar_type());
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return y;
  if (dtype == at::kFloat)
    fixed_matmul<float>(x, w, y);
  else if (dtype == at::kBFloat16)
    fixed_matmul<at::BFloat16>(x, w, y);
  else
    fixed_matmul<at::Half>(x, w, y);
  apply_groups("fixed_linear", y, x, a_groups, bts, offsets, runs);
  return y;
}

// fixed_linear, then a LoRA variant's vector epilogue on its output (kernels/vectors.py).
at::Tensor fixed_linear(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
                        at::IntArrayRef offsets, const at::Tensor& runs,
                        at::TensorList vectors, at::IntArrayRef vector_starts, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& scale) {
  at::Tensor y = fixed_linear_body(x, w, a_groups, bts, offsets, runs);
  adapter_manager_cpu::apply_vector_groups("fixed_linear", y, vectors, vector_starts, bias, scale);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("fixed_linear(Tensor x, Tensor w, Tensor[] a_groups, Tensor[] bts, int[] offsets, Tensor runs"
        ", Tensor[] vectors, int[] vector_starts, Tensor? bias, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("fixed_linear", &fixed_linear); }
