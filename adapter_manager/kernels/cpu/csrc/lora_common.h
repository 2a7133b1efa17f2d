// What the CPU LoRA kernels share (lora_apply.cpp: lora_apply, whose loops lora_onednn.cpp and lora_blocked.cpp call
// after their matmul; lora_linear.cpp: lora_linear): a step's runs of tokens, and the shrink / expand inner loops over
// the pool's rows.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec16.h"

namespace adapter_manager_cpu {

constexpr int64_t kShrinkRows = 8;  // A rows per shrink work item, one pass over x (a short last block: row by row)

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
#if defined(__AVX512F__)
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
#else
// Without AVX-512 the 16 accumulators of 16 floats above are 32 of the 16 vector registers (they spill):
// one row at a time, 8 token accumulators of 8 floats (one 256-bit register each).

inline void pair_dots(const float* const* xr, const float* w0, const float* w1, int64_t K, const float* ahead0,
                      const float* ahead1, float* out, const float* extra = nullptr) {
  const int64_t K8 = K - K % 8;
  const float* fetch = extra != nullptr ? extra : ahead0;
  for (int r = 0; r < 2; ++r) {
    const float* w = r == 0 ? w0 : w1;
    const float* ahead = r == 0 ? ahead0 : ahead1;
    v8 acc[8] = {};
    for (int64_t k = 0; k < K8; k += 8) {
      if (k % 16 == 0) {
        __builtin_prefetch(ahead + k, 0, 3);
        if (r == 0) __builtin_prefetch(fetch + k, 0, 2);
      }
      const v8 a = load8(w + k);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) acc[t] += a * load8(xr[t] + k);
    }
    for (int t = 0; t < 8; ++t) {
      float sum = sum8(acc[t]);
      for (int64_t k = K8; k < K; ++k) sum += w[k] * xr[t][k];
      out[8 * r + t] = sum;
    }
  }
}
#endif

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

// The runs (start, count, first row, rank) of an int64 [R, 4] tensor, each checked against T tokens and N pool rows;
// empty ones dropped.
inline std::vector<Run> parse_runs(const char* op, const at::Tensor& runs, int64_t tokens, int64_t rows) {
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

// lora_apply.cpp: the checks of lora_apply's operands (y's columns from col0 on), and its loops over the runs.
void check_apply(const at::Tensor& y, int64_t col0, const at::Tensor& x, const at::Tensor& a, at::TensorList bts);
void apply_runs(at::Tensor& y, int64_t col0, const at::Tensor& x, const at::Tensor& a, at::TensorList bts,
                const std::vector<Run>& list);
// Each group's lora_apply onto y's columns from offsets[g] on (group g: its parts a_groups[g] [N, P_g, in], their Bt
// the next P_g of bts), every run of `runs`; `op` names the caller in its errors.
void apply_groups(const char* op, at::Tensor& y, const at::Tensor& x, at::TensorList a_groups, at::TensorList bts,
                  at::IntArrayRef offsets, const at::Tensor& runs);
// vector_epilogue.cpp: a LoRA variant's vectors on y, per token (kernels/vectors.py's semantics): group g's vectors
// [S + 1, columns] onto y's columns from starts[g] on, rows bias[t] added, then scale[t]'s multiplied in; fp32,
// rounded once. Nothing without groups or without either index. The one-call linears end with it.
void apply_vector_groups(const char* op, at::Tensor& y, at::TensorList vectors, at::IntArrayRef starts,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale);

}  // namespace adapter_manager_cpu
