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
// activations) never leaves the call. Block sizes measured on the bench model's decode (8 adapters, T = 8): 1024
// columns × 8 rows reached the read pass's bandwidth (44 vs 35-39 GB/s for 512 × 4 or 256 × 4). (lora_linear's
// pair_dots / expand_tile forms in lora_apply, measured in one run: one adapter +3.4 -> +3.2 %, eight +14.4 -> +15.0 %
// over the base matmuls: no gain, not taken.)
// One OpenMP region per call (dynamic schedule over (run, part, block) items; its barrier orders shrink before
// expand); a call with at most two items runs on one thread.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace {

using adapter_manager_cpu::kReduceOrder;
using adapter_manager_cpu::load16;
using adapter_manager_cpu::reduce16;
using adapter_manager_cpu::v16;

constexpr int64_t kRows = 4;        // Bt rows per expand inner loop
constexpr int64_t kShrinkRows = 8;  // A rows per shrink work item, one pass over x (a short last block: row by row)
constexpr int64_t kChunk = 1024;    // output columns per expand work item
constexpr int64_t kMinChunk = 256;  // the narrowest chunk a call with few items splits down to

struct Run {
  int64_t start, count, first, rank;
};

// h[t · rank + j] = x[start + t] · A[first + j] for the run's tokens t and rows j in [j0, j0 + kShrinkRows) ∩ [0, rank):
// 8 rows per pass over x (a short last block: row by row). A row i is at a + i·as.
template <typename scalar_t>
void shrink_block(const scalar_t* xp, int64_t xs, const scalar_t* a, int64_t as, int64_t in, const Run& run,
                  int64_t j0, float* hk) {
  const int64_t rows = std::min(kShrinkRows, run.rank - j0);
  const scalar_t* q0 = a + (run.first + j0) * as;
  for (int64_t t = 0; t < run.count; ++t) {
    const scalar_t* xt = xp + (run.start + t) * xs;
    float* out = hk + t * run.rank + j0;
    if (rows == kShrinkRows) {
      const scalar_t *q1 = q0 + as, *q2 = q0 + 2 * as, *q3 = q0 + 3 * as, *q4 = q0 + 4 * as, *q5 = q0 + 5 * as,
                     *q6 = q0 + 6 * as, *q7 = q0 + 7 * as;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f, s5 = 0.f, s6 = 0.f, s7 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
      for (int64_t i = 0; i < in; ++i) {
        const float v = static_cast<float>(xt[i]);
        s0 += v * static_cast<float>(q0[i]);
        s1 += v * static_cast<float>(q1[i]);
        s2 += v * static_cast<float>(q2[i]);
        s3 += v * static_cast<float>(q3[i]);
        s4 += v * static_cast<float>(q4[i]);
        s5 += v * static_cast<float>(q5[i]);
        s6 += v * static_cast<float>(q6[i]);
        s7 += v * static_cast<float>(q7[i]);
      }
      out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3, out[4] = s4, out[5] = s5, out[6] = s6, out[7] = s7;
    } else {
      for (int64_t jj = 0; jj < rows; ++jj) {
        const scalar_t* q = q0 + jj * as;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < in; ++i) s += static_cast<float>(xt[i]) * static_cast<float>(q[i]);
        out[jj] = s;
      }
    }
  }
}

constexpr int64_t kTile = 64;       // expand columns per block; lora_linear's output columns per tile
constexpr int64_t kPairTokens = 4;  // a run of at least this many tokens shrinks in pair_dots' form (fp32)

// out[r·8 + t] = W row r · x[t] for the row pair (w0, w1) and 8 token rows xr (K % 16 == 0 here; the tail apart).
inline void pair_dots(const float* const* xr, const float* w0, const float* w1, int64_t K, const float* ahead0,
                      const float* ahead1, float* out, const float* extra = nullptr) {
  const int64_t K16 = K - K % 16;
  const float* fetch = extra != nullptr ? extra : ahead0;  // a row of K floats to bring into L2 meanwhile
  v16 acc[16] = {};
  for (int64_t k = 0; k < K16; k += 16) {
    __builtin_prefetch(ahead0 + k, 0, 3);  // the next pair's rows: W's stream crosses a page at every row
    __builtin_prefetch(ahead1 + k, 0, 3);
    __builtin_prefetch(fetch + k, 0, 2);
    const v16 a = load16(w0 + k), b = load16(w1 + k);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const v16 xv = load16(xr[t] + k);
      acc[t] += a * xv;
      acc[8 + t] += b * xv;
    }
  }
  const v16 sums = reduce16(acc);
  for (int i = 0; i < 16; ++i) out[kReduceOrder[i]] = sums[i];
  for (int64_t k = K16; k < K; ++k)
    for (int t = 0; t < 8; ++t) out[t] += w0[k] * xr[t][k], out[8 + t] += w1[k] * xr[t][k];
}

// y[start + t, 0 : cols] += h[t] @ Bt[0 : rank, 0 : cols] for the run's tokens (h: [count, rank]; Bt row j at b + j·bs;
// y row t at y + t·ys), cols <= kTile: 2 tokens × 4 column vectors of accumulators, so that the rank loop's FMAs are
// 8 independent chains.
inline void expand_tile(const float* h, const Run& run, const float* b, int64_t bs, float* y, int64_t ys,
                        int64_t cols) {
  const int64_t vecs = cols / 16, rank = run.rank;
  int64_t t = 0;
  if (vecs == kTile / 16) {
    for (; t + 2 <= run.count; t += 2) {
      const float *h0 = h + t * rank, *h1 = h0 + rank;
      v16 a0[4] = {}, a1[4] = {};
      for (int64_t j = 0; j < rank; ++j) {
        const float* bj = b + j * bs;
        const float u = h0[j], v = h1[j];
#pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) {
          const v16 bv = load16(bj + 16 * e);
          a0[e] += u * bv;
          a1[e] += v * bv;
        }
      }
      float* y0 = y + (run.start + t) * ys;
      float* y1 = y0 + ys;
      for (int e = 0; e < 4; ++e) {
        const v16 s0 = load16(y0 + 16 * e) + a0[e], s1 = load16(y1 + 16 * e) + a1[e];
        std::memcpy(y0 + 16 * e, &s0, sizeof s0);
        std::memcpy(y1 + 16 * e, &s1, sizeof s1);
      }
    }
  }
  if (vecs == kTile / 16 && t < run.count) {  // a last odd token (a run of one at 8 adapters' decode): even and odd
    const float* ht = h + t * rank;           // rows in separate accumulators, 8 chains again
    v16 a0[4] = {}, a1[4] = {};
    int64_t j = 0;
    for (; j + 2 <= rank; j += 2) {
      const float* bj = b + j * bs;
      const float u = ht[j], v = ht[j + 1];
#pragma GCC unroll 4
      for (int e = 0; e < 4; ++e) {
        a0[e] += u * load16(bj + 16 * e);
        a1[e] += v * load16(bj + bs + 16 * e);
      }
    }
    if (j < rank)
      for (int e = 0; e < 4; ++e) a0[e] += ht[j] * load16(b + j * bs + 16 * e);
    float* yt = y + (run.start + t) * ys;
    for (int e = 0; e < 4; ++e) {
      const v16 sum = load16(yt + 16 * e) + (a0[e] + a1[e]);
      std::memcpy(yt + 16 * e, &sum, sizeof sum);
    }
    ++t;
  }
  for (; t < run.count; ++t) {  // a tile cut short by a part's edge
    const float* ht = h + t * rank;
    float* yt = y + (run.start + t) * ys;
    for (int64_t e = 0; e < 16 * vecs; e += 16) {
      v16 acc = {};
      for (int64_t j = 0; j < rank; ++j) acc += ht[j] * load16(b + j * bs + e);
      const v16 sum = load16(yt + e) + acc;
      std::memcpy(yt + e, &sum, sizeof sum);
    }
    for (int64_t e = 16 * vecs; e < cols; ++e) {
      float acc = 0.f;
      for (int64_t j = 0; j < rank; ++j) acc += ht[j] * b[j * bs + e];
      yt[e] += acc;
    }
  }
}

// shrink_block's result for a run of several tokens (fp32): A row pairs × 8 tokens, the base matmul's own dot products
// (pair_dots), the next pair's rows prefetched meanwhile.
inline void shrink_pairs(const float* xp, int64_t xs, const float* a, int64_t as, int64_t in, const Run& run,
                         int64_t j0, float* hk) {
  const float* xq[8];
  float dots[16];
  const int64_t rows = std::min(kShrinkRows, run.rank - j0);
  for (int64_t t0 = 0; t0 < run.count; t0 += 8) {
    const int64_t tb = std::min<int64_t>(8, run.count - t0);
    for (int t = 0; t < 8; ++t) xq[t] = xp + (run.start + t0 + (t < tb ? t : 0)) * xs;
    for (int64_t j = j0; j < j0 + rows; j += 2) {
      const bool two = j + 1 < j0 + rows, more = j + 3 < j0 + rows;
      const float* a0 = a + (run.first + j) * as;
      const float* a1 = two ? a0 + as : a0;
      pair_dots(xq, a0, a1, in, more ? a0 + 2 * as : a0, more ? a1 + 2 * as : a1, dots);
      for (int64_t t = 0; t < tb; ++t) {
        hk[(t0 + t) * run.rank + j] = dots[t];
        if (two) hk[(t0 + t) * run.rank + j + 1] = dots[8 + t];
      }
    }
  }
}

template <typename scalar_t>
void apply_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, at::TensorList bts, const std::vector<Run>& runs) {
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
  scalar_t* yp = y.data_ptr<scalar_t>();
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

// The runs (start, count, first row, rank) of an int64 [R, 4] tensor, each checked against T tokens and N pool rows;
// empty ones dropped.
std::vector<Run> parse_runs(const char* op, const at::Tensor& runs, int64_t tokens, int64_t rows) {
  TORCH_CHECK(runs.device().is_cpu() && runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 4, op,
              ": runs must be an int64 [R, 4] CPU tensor (start, count, first row, rank)");
  const auto r = runs.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  std::vector<Run> list;
  list.reserve(r.size(0));
  for (int64_t k = 0; k < r.size(0); ++k) {
    const Run run{rp[4 * k], rp[4 * k + 1], rp[4 * k + 2], rp[4 * k + 3]};
    TORCH_CHECK(run.start >= 0 && run.count >= 0 && run.start + run.count <= tokens, op, ": run ", k,
                " covers tokens [", run.start, ", ", run.start + run.count, ") of ", tokens);
    TORCH_CHECK(run.first >= 0 && run.rank >= 0 && run.first + run.rank <= rows, op, ": run ", k, " reads rows [",
                run.first, ", ", run.first + run.rank, ") of ", rows);
    if (run.count > 0 && run.rank > 0) list.push_back(run);
  }
  return list;
}

void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& a, at::TensorList bts, const at::Tensor& runs) {
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
  TORCH_CHECK(out <= y.size(1), "lora_apply: the parts' outputs (", out, ") exceed y's columns (", y.size(1), ")");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type(), "lora_apply: one dtype");
  const std::vector<Run> list = parse_runs("lora_apply", runs, x.size(0), a.size(0));
  if (list.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply",
                                  [&] { apply_impl<scalar_t>(y, x, a, bts, list); });
}


// ---- lora_linear: the base matmul of a decode step's linear with its LoRA inside it (fp32, T <= kLinearTokens) ----
//
//   y = x @ W.T;  y[t, off_p : off_p + out_p] += (x[t] @ A_p[first : first + rank].T) @ Bt_p[first : first + rank]
//   for every run and every part p of every group (as lora_apply).
//
// At decode's few tokens the base matmul streams W once and is bound by its FMAs and W's bytes; the LoRA's bytes are
// ~2 % of W's per adapter, but as a separate call they come cold from memory after W has gone through the caches.
// Here the shrink runs first (one pass over the step's A rows), then W is streamed in tiles of kTile output columns:
// each tile's base dot products (2 W rows × 8 tokens per pass, one 16-way reduction), then its expand from the
// tile's Bt columns, which were prefetched one tile ahead, so their reads overlap W's. One call per linear, no
// second pass over y.
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

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& w, at::TensorList a_groups, at::TensorList bts,
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

}  // namespace

TORCH_LIBRARY(adapter_manager, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor[] bts, Tensor runs) -> ()");
  m.def("lora_linear(Tensor x, Tensor w, Tensor[] a_groups, Tensor[] bts, int[] offsets, Tensor runs) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) {
  m.impl("lora_apply", &lora_apply);
  m.impl("lora_linear", &lora_linear);
}
