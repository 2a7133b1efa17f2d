// The CPU LoRA kernel: one call applies a fused linear's LoRA (every part that shares the input x) to every run of
// tokens of one step, reading each active adapter's pool rows in place (no gather, no padding past its rank).
//
//   y[t, off_p : off_p + out_p] += (x[t] @ A_p[first : first + rank].T) @ Bt_p[first : first + rank]
//   for every run (start, count, first, rank) and every t in [start, start + count), every part p;
//   tokens in no run are left alone (slot -1: exactly zero LoRA).
//
// Shrink and expand are both bandwidth-bound at decode's few tokens per adapter: each A row is read once per run
// and dotted with the run's tokens (8 rows at a time, so x is read once per 8 rows); each Bt row chunk (1024
// columns, 4 rows at a time) is read once per token and accumulated in fp32 before one add into y. h (the rank-space
// activations) never leaves the call. The block sizes and the forms measured against these loops: docs/cpu.md. The
// linears that hold their base matmul too call these loops after it (lora_onednn.cpp, lora_blocked.cpp at decode);
// lora_linear.cpp interleaves its own with the matmul.
// One OpenMP region per call (dynamic schedule over (run, part, block) items; its barrier orders shrink before
// expand); a call with at most two items runs on one thread.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::kShrinkRows;
using adapter_manager_cpu::parse_runs;
using adapter_manager_cpu::Run;
using adapter_manager_cpu::shrink_block;

constexpr int64_t kRows = 4;        // Bt rows per expand inner loop
constexpr int64_t kChunk = 1024;    // output columns per expand work item
constexpr int64_t kMinChunk = 256;  // the narrowest chunk a call with few items splits down to

template <typename scalar_t>
void apply_impl(at::Tensor& y, int64_t col0, const at::Tensor& x, const at::Tensor& a, at::TensorList bts,
                const std::vector<Run>& runs) {
  const int64_t in = x.size(1), parts = a.size(1), xs = x.stride(0), as = a.stride(0), ps = a.stride(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* ap = a.data_ptr<scalar_t>();
  const int64_t nr = static_cast<int64_t>(runs.size());
  std::vector<int64_t> hoff(nr + 1, 0);  // run k's h: [count, rank] floats at hoff[k] of each part's block
  for (int64_t k = 0; k < nr; ++k) hoff[k + 1] = hoff[k] + runs[k].count * runs[k].rank;
  const int64_t hpart = hoff[nr];
  std::vector<float> h(static_cast<size_t>(parts * hpart));

  std::vector<std::array<int64_t, 3>> shrink_items;  // (run, part, first row of a kRows block)
  for (int64_t k = 0; k < nr; ++k)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t j = 0; j < runs[k].rank; j += kShrinkRows) shrink_items.push_back({k, p, j});
  scalar_t* yp = y.data_ptr<scalar_t>() + col0;  // the parts' columns start at col0
  const int64_t ys = y.stride(0);
  std::vector<int64_t> yoff(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p) yoff[p + 1] = yoff[p] + bts[p].size(1);
  // (run, part, first column of a chunk): kChunk columns, or narrower when that leaves the threads too few items
  // (one adapter's q|k|v: 1024 + 256 + 256 columns would be one item of 4 rows' work beside two of one)
  const int threads = at::get_num_threads();
  int64_t chunk = kChunk;
  auto count_items = [&](int64_t width) {
    int64_t items = 0;
    for (int64_t p = 0; p < parts; ++p) items += (bts[p].size(1) + width - 1) / width;
    return items * nr;
  };
  while (chunk > kMinChunk && count_items(chunk) < 4 * threads) chunk /= 2;
  std::vector<std::array<int64_t, 3>> expand_items;
  for (int64_t k = 0; k < nr; ++k)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t c = 0; c < bts[p].size(1); c += chunk) expand_items.push_back({k, p, c});
  // one parallel region: the shrink items, the loop's barrier (every h written), then the expand items
  const bool parallel = threads > 1 && shrink_items.size() + expand_items.size() > 2;
#pragma omp parallel num_threads(threads) if (parallel)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < static_cast<int64_t>(shrink_items.size()); ++w) {
      const auto [k, p, j0] = shrink_items[w];
      const Run& run = runs[k];
      shrink_block(xp, xs, ap + p * ps, as, in, run, j0, h.data() + p * hpart + hoff[k]);
    }
    float acc[kChunk];
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < static_cast<int64_t>(expand_items.size()); ++w) {
      const auto [k, p, c0] = expand_items[w];
      const Run& run = runs[k];
      const int64_t cols = std::min(chunk, bts[p].size(1) - c0), bs = bts[p].stride(0);
      const scalar_t* b0 = bts[p].data_ptr<scalar_t>() + run.first * bs + c0;
      const float* hk = h.data() + p * hpart + hoff[k];
      for (int64_t t = 0; t < run.count; ++t) {
        const float* ht = hk + t * run.rank;
        std::fill(acc, acc + cols, 0.f);
        int64_t j = 0;
        for (; j + kRows <= run.rank; j += kRows) {
          const float h0 = ht[j], h1 = ht[j + 1], h2 = ht[j + 2], h3 = ht[j + 3];
          const scalar_t* q0 = b0 + j * bs;
          const scalar_t *q1 = q0 + bs, *q2 = q0 + 2 * bs, *q3 = q0 + 3 * bs;
#pragma omp simd
          for (int64_t i = 0; i < cols; ++i)
            acc[i] += h0 * static_cast<float>(q0[i]) + h1 * static_cast<float>(q1[i]) +
                      h2 * static_cast<float>(q2[i]) + h3 * static_cast<float>(q3[i]);
        }
        for (; j < run.rank; ++j) {
          const float hv = ht[j];
          const scalar_t* q = b0 + j * bs;
#pragma omp simd
          for (int64_t i = 0; i < cols; ++i) acc[i] += hv * static_cast<float>(q[i]);
        }
        scalar_t* yt = yp + (run.start + t) * ys + yoff[p] + c0;
        for (int64_t i = 0; i < cols; ++i) yt[i] = static_cast<scalar_t>(static_cast<float>(yt[i]) + acc[i]);
      }
    }
  }
}

}  // namespace

namespace adapter_manager_cpu {

void check_apply(const at::Tensor& y, int64_t col0, const at::Tensor& x, const at::Tensor& a, at::TensorList bts) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && a.device().is_cpu(), "lora_apply: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_apply: x must be [T, in] with unit inner stride");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1,
              "lora_apply: y must be [T, sum(out)] with unit inner stride, T = ", x.size(0));
  TORCH_CHECK(a.dim() == 3 && a.size(2) == x.size(1) && a.stride(2) == 1,
              "lora_apply: a must be [N, P, in] with unit inner stride, in = ", x.size(1));
  TORCH_CHECK(static_cast<int64_t>(bts.size()) == a.size(1), "lora_apply: one Bt per part: ", a.size(1), " parts, ",
              bts.size(), " Bt");
  int64_t out = 0;
  for (const auto& bt : bts) {
    TORCH_CHECK(bt.device().is_cpu() && bt.dim() == 2 && bt.size(0) == a.size(0) && bt.stride(1) == 1,
                "lora_apply: every Bt must be [N, out] with N = ", a.size(0), " and unit inner stride");
    TORCH_CHECK(bt.scalar_type() == x.scalar_type(), "lora_apply: Bt dtype differs from x");
    out += bt.size(1);
  }
  TORCH_CHECK(col0 >= 0 && col0 + out <= y.size(1), "lora_apply: the parts' columns [", col0, ", ", col0 + out,
              ") exceed y's ", y.size(1));
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type(), "lora_apply: one dtype");
}

void apply_runs(at::Tensor& y, int64_t col0, const at::Tensor& x, const at::Tensor& a, at::TensorList bts,
                const std::vector<Run>& list) {
  if (list.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply",
                                  [&] { apply_impl<scalar_t>(y, col0, x, a, bts, list); });
}

void apply_groups(const char* op, at::Tensor& y, const at::Tensor& x, at::TensorList a_groups, at::TensorList bts,
                  at::IntArrayRef offsets, const at::Tensor& runs) {
  TORCH_CHECK(a_groups.size() == offsets.size(), op, ": one column offset per group");
  std::vector<Run> list;
  if (!a_groups.empty()) list = parse_runs(op, runs, x.size(0), a_groups[0].size(0));
  size_t next = 0;  // the first Bt of the group
  for (size_t g = 0; g < a_groups.size(); ++g) {
    const at::Tensor& a = a_groups[g];
    const size_t count = static_cast<size_t>(a.size(1));
    TORCH_CHECK(next + count <= bts.size(), op, ": group ", g, " has ", count, " parts, past the ", bts.size(), " Bt");
    const at::TensorList group = bts.slice(next, count);
    TORCH_CHECK(a.size(0) == a_groups[0].size(0), op, ": every group's A has the same rows");
    check_apply(y, offsets[g], x, a, group);  // no narrow of y: one operator call per linear in a profile
    apply_runs(y, offsets[g], x, a, group, list);
    next += count;
  }
  TORCH_CHECK(next == bts.size(), op, ": ", bts.size(), " Bt for ", next, " parts");
}

}  // namespace adapter_manager_cpu

namespace {

using adapter_manager_cpu::apply_runs;
using adapter_manager_cpu::check_apply;

void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& a, at::TensorList bts, const at::Tensor& runs) {
  check_apply(y, 0, x, a, bts);
  apply_runs(y, 0, x, a, bts, parse_runs("lora_apply", runs, x.size(0), a.size(0)));
}

}  // namespace

TORCH_LIBRARY(adapter_manager, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor[] bts, Tensor runs) -> ()");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("lora_apply", &lora_apply); }
