// The CPU decode linear: the base matmul of a linear with its LoRA inside the same call (fp32, few tokens).
//
//   y = x @ W.T;  y[t, off_p : off_p + out_p] += (x[t] @ A_p[first : first + rank].T) @ Bt_p[first : first + rank]
//   for every run and every part p of every group (as lora_apply).
//
// At decode's few tokens the base matmul streams W once and is bound by its FMAs and W's bytes; the LoRA's bytes are
// ~2 % of W's per adapter, but as a separate call they come cold from memory after W has gone through the caches.
// Here W is streamed in tiles of kTile output columns: each tile's base dot products (2 W rows × 8 tokens per pass,
// one 16-way reduction), then its expand from the tile's Bt columns, prefetched one tile ahead; the shrink runs after
// each thread's first tiles, whose W row pairs prefetched its A rows. The LoRA's reads overlap W's. One call per
// linear, no second pass over y.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::expand_tile;
using adapter_manager_cpu::kPairTokens;
using adapter_manager_cpu::kShrinkRows;
using adapter_manager_cpu::kTile;
using adapter_manager_cpu::pair_dots;
using adapter_manager_cpu::parse_runs;
using adapter_manager_cpu::Run;
using adapter_manager_cpu::shrink_block;
using adapter_manager_cpu::shrink_pairs;

constexpr int64_t kLinearTokens = 16;  // tokens per call: 8 per pass over a W row pair, from L1 the second time

struct Part {
  int64_t col0, cols;  // the part's columns of y
  const float* a;      // its A rows: row i at a + i·as
  int64_t as;
  const float* bt;  // its Bt rows: row i at bt + i·bs
  int64_t bs;
};

struct Tile {
  int64_t c0, cols, part;  // part -1: base only
};

at::Tensor lora_linear_body(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
                       at::IntArrayRef offsets, const at::Tensor& runs) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "lora_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "lora_linear: fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) <= kLinearTokens,
              "lora_linear: x must be [T <= ", kLinearTokens, ", in] with unit inner stride");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous(),
              "lora_linear: w must be a contiguous [out, in] with in = ", x.size(1));
  TORCH_CHECK(a_groups.size() == offsets.size(), "lora_linear: one column offset per group");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  std::vector<Part> parts;
  int64_t rows = -1;
  size_t b = 0;
  for (size_t g = 0; g < a_groups.size(); ++g) {
    const at::Tensor& a = a_groups[g];
    TORCH_CHECK(a.dim() == 3 && a.size(2) == K && a.stride(2) == 1 && a.scalar_type() == at::kFloat &&
                    a.device().is_cpu(),
                "lora_linear: every A group must be an fp32 [N, P, in] with unit inner stride, in = ", K);
    TORCH_CHECK(rows < 0 || a.size(0) == rows, "lora_linear: every group's rows must be the pool's N");
    rows = a.size(0);
    int64_t col = offsets[g];
    for (int64_t p = 0; p < a.size(1); ++p, ++b) {
      TORCH_CHECK(b < bts.size(), "lora_linear: one Bt per part of every group");
      const at::Tensor& bt = bts[b];
      TORCH_CHECK(bt.dim() == 2 && bt.size(0) == rows && bt.stride(1) == 1 && bt.scalar_type() == at::kFloat &&
                      bt.device().is_cpu(),
                  "lora_linear: every Bt must be an fp32 [N, out] with N = ", rows, " and unit inner stride");
      TORCH_CHECK(col >= 0 && col + bt.size(1) <= N, "lora_linear: part columns [", col, ", ", col + bt.size(1),
                  ") outside y's ", N);
      TORCH_CHECK(parts.empty() || col >= parts.back().col0 + parts.back().cols,
                  "lora_linear: parts must be in column order and must not overlap");
      parts.push_back({col, bt.size(1), a.data_ptr<float>() + p * a.stride(1), a.stride(0), bt.data_ptr<float>(),
                       bt.stride(0)});
      col += bt.size(1);
    }
  }
  TORCH_CHECK(b == bts.size(), "lora_linear: ", bts.size(), " Bt for ", b, " parts");
  const std::vector<Run> list = parts.empty() ? std::vector<Run>{} : parse_runs("lora_linear", runs, T, rows);
  const bool lora = !list.empty();
  auto y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);

  const int64_t nr = static_cast<int64_t>(list.size()), np = static_cast<int64_t>(parts.size());
  std::vector<int64_t> hoff(nr + 1, 0);
  for (int64_t k = 0; k < nr; ++k) hoff[k + 1] = hoff[k] + list[k].count * list[k].rank;
  const int64_t hpart = hoff[nr];
  std::vector<float> h(lora ? static_cast<size_t>(np * hpart) : 0);
  std::vector<std::array<int64_t, 3>> shrink_items;  // (run, part, first row of a kShrinkRows block)
  for (int64_t k = 0; k < nr; ++k)
    for (int64_t p = 0; p < np; ++p)
      for (int64_t j = 0; j < list[k].rank; j += kShrinkRows) shrink_items.push_back({k, p, j});
  std::vector<Tile> tiles;  // y's columns in order, cut at every part's edges
  auto cut = [&](int64_t from, int64_t to, int64_t part) {
    for (int64_t c = from; c < to; c += kTile) tiles.push_back({c, std::min(kTile, to - c), part});
  };
  int64_t col = 0;
  for (int64_t p = 0; p < (lora ? np : 0); ++p) {
    cut(col, parts[p].col0, -1);
    cut(parts[p].col0, parts[p].col0 + parts[p].cols, p);
    col = parts[p].col0 + parts[p].cols;
  }
  cut(col, N, -1);
  const int64_t nt = static_cast<int64_t>(tiles.size());
  // Bt lines of a tile, one prefetch each (64-byte lines), for the tile after the one being computed
  auto prefetch_bt = [&](int64_t i) {
    if (i >= nt || tiles[i].part < 0) return;
    const Part& part = parts[tiles[i].part];
    const int64_t c = tiles[i].c0 - part.col0;
    for (const Run& run : list)
      for (int64_t j = 0; j < run.rank; ++j) {
        const float* row = part.bt + (run.first + j) * part.bs + c;
        for (int64_t e = 0; e < tiles[i].cols; e += 16) __builtin_prefetch(row + e, 0, 3);
      }
  };
  const int threads = at::get_num_threads();
  const bool parallel = threads > 1 && nt > 1;
  const int64_t ni = static_cast<int64_t>(shrink_items.size());
  // the shrink of item i into h (its A rows × the run's tokens)
  auto shrink = [&](int64_t i) {
    const auto [k, p, j0] = shrink_items[i];
    const Run& run = list[k];
    float* hk = h.data() + p * hpart + hoff[k];
    if (run.count < kPairTokens) {
      shrink_block(xp, xs, parts[p].a, parts[p].as, K, run, j0, hk);
      return;
    }
    shrink_pairs(xp, xs, parts[p].a, parts[p].as, K, run, j0, hk);
  };
#pragma omp parallel num_threads(threads) if (parallel)
  {
    // Each thread takes a contiguous range of tiles (W streams in order) and every nth shrink item. It computes its
    // first tiles' base dot products while their W row pairs prefetch its items' A rows (one A row per pair), then
    // its shrink items from the cache; after the barrier (every h written) the expand of those first tiles, then
    // the rest of its tiles with their expand.
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = tid * nt / nth, hi = (tid + 1) * nt / nth;
    std::vector<const float*> fetch;  // this thread's A rows, in the order its items read them
    for (int64_t i = tid; i < ni; i += nth) {
      const auto [k, p, j0] = shrink_items[i];
      for (int64_t j = j0; j < std::min(j0 + kShrinkRows, list[k].rank); ++j)
        fetch.push_back(parts[p].a + (list[k].first + j) * parts[p].as);
    }
    size_t fetched = 0;
    float out[16];
    const float* xr[8];
    auto base_tile = [&](int64_t i) {
      const Tile& tile = tiles[i];
      for (int64_t t0 = 0; t0 < T; t0 += 8) {  // 8 tokens per pass (a short block repeats its first token)
        const int64_t tb = std::min<int64_t>(8, T - t0);
        for (int t = 0; t < 8; ++t) xr[t] = xp + (t0 + (t < tb ? t : 0)) * xs;
        for (int64_t c = 0; c < tile.cols; c += 2) {
          const int64_t n = tile.c0 + c;
          const bool two = c + 1 < tile.cols;
          const float* w0 = wp + n * K;
          const float* w1 = two ? w0 + K : w0;
          const int64_t next = std::min(n + 2, N - 1);
          const float* ahead0 = wp + next * K;
          const float* ahead1 = wp + std::min(next + 1, N - 1) * K;
          pair_dots(xr, w0, w1, K, ahead0, ahead1, out, fetched < fetch.size() ? fetch[fetched++] : nullptr);
          for (int64_t t = 0; t < tb; ++t) {
            yp[(t0 + t) * N + n] = out[t];
            if (two) yp[(t0 + t) * N + n + 1] = out[8 + t];
          }
        }
      }
    };
    auto expand = [&](int64_t i) {
      const Tile& tile = tiles[i];
      if (tile.part < 0) return;
      const Part& part = parts[tile.part];
      const int64_t c = tile.c0 - part.col0;
      for (int64_t k = 0; k < nr; ++k) {
        const Run& run = list[k];
        expand_tile(h.data() + tile.part * hpart + hoff[k], run, part.bt + run.first * part.bs + c, part.bs,
                    yp + tile.c0, N, tile.cols);
      }
    };
    int64_t lead = lo;
    if (lora) {
      while (lead < hi && fetched < fetch.size()) base_tile(lead++);
      for (int64_t i = tid; i < ni; i += nth) shrink(i);
      for (int64_t i = lo; i < lead; ++i) prefetch_bt(i);
    }
#pragma omp barrier
    for (int64_t i = lo; i < lead; ++i) expand(i);
    for (int64_t i = lead; i < hi; ++i) {
      if (lora) prefetch_bt(i + 1);
      base_tile(i);
      expand(i);
    }
  }
  return y;
}

// lora_linear, then a LoRA variant's vector epilogue on its output (kernels/vectors.py).
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
                       at::IntArrayRef offsets, const at::Tensor& runs,
                       at::TensorList vectors, at::IntArrayRef vector_starts, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& scale) {
  at::Tensor y = lora_linear_body(x, w, a_groups, bts, offsets, runs);
  adapter_manager_cpu::apply_vector_groups("lora_linear", y, vectors, vector_starts, bias, scale);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("lora_linear(Tensor x, Tensor w, Tensor[] a_groups, Tensor[] bts, int[] offsets, Tensor runs"
        ", Tensor[] vectors, int[] vector_starts, Tensor? bias, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("lora_linear", &lora_linear); }
