// lora_onednn: a linear on a oneDNN-packed weight with its LoRA, in one call from Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::apply_runs;
using adapter_manager_cpu::check_apply;
using adapter_manager_cpu::parse_runs;
using adapter_manager_cpu::Run;

// A decode linear on a oneDNN-packed weight with its LoRA, in one call from Python: oneDNN's linear (the op
// packed_linear calls, reached through the dispatcher: the wheel ships no oneDNN headers) writes y, then each group's
// lora_apply adds onto its columns. The same work as packed_linear + one lora_apply per group, without a Python layer
// and a dispatch per group (docs/cpu.md).
at::Tensor lora_onednn(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
                       at::IntArrayRef offsets, const at::Tensor& runs) {
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  TORCH_CHECK(a_groups.size() == offsets.size(), "lora_onednn: one column offset per group");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_onednn: x must be [T, in] with unit inner stride");
  at::Tensor y = linear.call(x, w, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(), "");
  std::vector<Run> list;
  if (!a_groups.empty()) list = parse_runs("lora_onednn", runs, x.size(0), a_groups[0].size(0));
  size_t next = 0;  // the first Bt of the group
  for (size_t g = 0; g < a_groups.size(); ++g) {
    const at::Tensor& a = a_groups[g];
    const size_t count = static_cast<size_t>(a.size(1));
    TORCH_CHECK(next + count <= bts.size(), "lora_onednn: group ", g, " has ", count, " parts, past the ", bts.size(),
                " Bt");
    const at::TensorList group = bts.slice(next, count);
    TORCH_CHECK(a.size(0) == a_groups[0].size(0), "lora_onednn: every group's A has the same rows");
    check_apply(y, offsets[g], x, a, group);  // no narrow of y: one operator call per linear in a profile
    apply_runs(y, offsets[g], x, a, group, list);
    next += count;
  }
  TORCH_CHECK(next == bts.size(), "lora_onednn: ", bts.size(), " Bt for ", next, " parts");
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("lora_onednn(Tensor x, Tensor w, Tensor[] a_groups, Tensor[] bts, int[] offsets, Tensor runs) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("lora_onednn", &lora_onednn); }

// a packed weight is an opaque oneDNN tensor: calls with one dispatch on its key
TORCH_LIBRARY_IMPL(adapter_manager, MkldnnCPU, m) { m.impl("lora_onednn", &lora_onednn); }
