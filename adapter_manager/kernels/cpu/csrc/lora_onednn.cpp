// lora_onednn: a linear on a oneDNN-packed weight with its LoRA, in one call from Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::apply_groups;

// A decode linear on a oneDNN-packed weight with its LoRA, in one call from Python: oneDNN's linear (the op
// packed_linear calls, reached through the dispatcher: the wheel ships no oneDNN headers) writes y, then each group's
// lora_apply adds onto its columns. The same work as packed_linear + one lora_apply per group, without a Python layer
// and a dispatch per group (docs/cpu.md).
at::Tensor lora_onednn_body(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
                       at::IntArrayRef offsets, const at::Tensor& runs) {
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_onednn: x must be [T, in] with unit inner stride");
  at::Tensor y = linear.call(x, w, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(), "");
  apply_groups("lora_onednn", y, x, a_groups, bts, offsets, runs);
  return y;
}

// lora_onednn, then a LoRA variant's vector epilogue on its output (kernels/vectors.py).
at::Tensor lora_onednn(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
                       at::IntArrayRef offsets, const at::Tensor& runs,
                       at::TensorList vectors, at::IntArrayRef vector_starts, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& scale) {
  at::Tensor y = lora_onednn_body(x, w, a_groups, bts, offsets, runs);
  adapter_manager_cpu::apply_vector_groups("lora_onednn", y, vectors, vector_starts, bias, scale);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("lora_onednn(Tensor x, Tensor w, Tensor[] a_groups, Tensor[] bts, int[] offsets, Tensor runs"
        ", Tensor[] vectors, int[] vector_starts, Tensor? bias, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("lora_onednn", &lora_onednn); }

// a packed weight is an opaque oneDNN tensor: calls with one dispatch on its key
TORCH_LIBRARY_IMPL(adapter_manager, MkldnnCPU, m) { m.impl("lora_onednn", &lora_onednn); }
