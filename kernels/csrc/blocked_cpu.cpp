// The CPU linear on our own blocked weight layout, with its LoRA in the same call (fp32).
//
//   wb [NB, K, 32]: wb[b, k, c] = W[32·b + c, k] (zero past N);  y = x @ W.T  (y [T, N]), then for every run and
//   every part p of every group y[t, off_p : off_p + out_p] += (x[t] @ A_p[first : first + rank].T) @ Bt_p[...]
//   (lora_apply's loops, lora_cpu.cpp).
//
// A block's 32 columns are one contiguous stream of K × 128 bytes: per k, two vectors of W times each token's x[t, k]
// broadcast (8 tokens: 16 FMAs per two loads, no horizontal sums), so a thread streams its blocks in order near the
// read pass's rate, W prefetched non-temporally a few rows ahead (oneDNN's packed linear takes ~1.25x as long for the
// decode step's matmuls here, measured side by side: scripts/bench_layout.py). x is packed once per call as [K][TT]
// tiles of TT tokens, so the broadcasts read one line per k. Prefill's many tokens take the same loop in tiles of 12
// (24 accumulators): every tile of x passes over a block while it sits in L2 (at 1024 tokens 0.91–1.04x oneDNN's
// time per projection of the bench model, 1.04–1.09x over two layers' chain, measured side by side; passes of 128–512
// k with y accumulating, 1.21–1.39x, or panels of 8–48 tiles over each thread's blocks, 1.10–1.17x, were slower).
//
// The LoRA follows the matmul, as lora_onednn's does. Tried and measured slower on the bench model's decode step
// (scripts/bench_layout.py, LoRA cost over the blocked base step, this way: one adapter +5.3 %, eight +15.1 %):
// - the expand inside the block loop, h laned per token against each block's Bt rows: +9.0 % and +27.6 % (each block
//   reads 2 lines of every active Bt row: 128 scattered streams at eight adapters);
// - the matmul's loops prefetching the LoRA's rows (A, then Bt; one line every few k, up to 768 KB a thread), so
//   that lora_apply finds them in cache: +11.6 % and +27.4 %.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::apply_runs;
using adapter_manager_cpu::check_apply;
using adapter_manager_cpu::load16;
using adapter_manager_cpu::parse_runs;
using adapter_manager_cpu::Run;
using adapter_manager_cpu::v16;

constexpr int64_t kBlock = 32;              // columns per block of the layout
constexpr int64_t kDecodeTokens = 16;       // up to this many tokens: tiles of 8 (or 1, 2, 4), one block at a time
constexpr int64_t kGemmTile = 12;           // more tokens: tiles of 12, 24 accumulators
constexpr int64_t kAhead = 16;              // W rows (of 128 bytes) a block's loop prefetches ahead

// y rows [0, tb) of one block (ys apart; `cols` of its 32 columns) = x tile · W block; TT tokens in xt [K][TT].
template <int TT>
void block_kernel(const float* xt, const float* wb, int64_t K, float* y, int64_t ys, int64_t tb, int64_t cols) {
  v16 a0[TT] = {}, a1[TT] = {};
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (TT <= 8) {  // decode: W streams once, non-temporal (prefill's tiles reuse it from L2: no hint)
      __builtin_prefetch(wb + (k + kAhead) * kBlock, 0, 0);
      __builtin_prefetch(wb + (k + kAhead) * kBlock + 16, 0, 0);
    }
    const v16 w0 = load16(wb + k * kBlock), w1 = load16(wb + k * kBlock + 16);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      const float xv = xt[k * TT + t];
      a0[t] += xv * w0;
      a1[t] += xv * w1;
    }
  }
  if (cols == kBlock) {
    for (int64_t t = 0; t < tb; ++t) std::memcpy(y + t * ys, &a0[t], 64), std::memcpy(y + t * ys + 16, &a1[t], 64);
    return;
  }
  for (int64_t t = 0; t < tb; ++t) {  // the last block, cut at N
    float full[kBlock];
    std::memcpy(full, &a0[t], 64), std::memcpy(full + 16, &a1[t], 64);
    std::memcpy(y + t * ys, full, cols * sizeof(float));
  }
}

using Kernel = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, int64_t);

// The tile width for T tokens and its kernel.
int64_t tile_width(int64_t T) {
  return T > kDecodeTokens ? kGemmTile : T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;
}

Kernel kernel_for(int64_t width) {
  switch (width) {
    case 1: return &block_kernel<1>;
    case 2: return &block_kernel<2>;
    case 4: return &block_kernel<4>;
    case 8: return &block_kernel<8>;
    default: return &block_kernel<kGemmTile>;
  }
}

// x rows [t0, t0 + tb) as [K][width] (zero past tb), 16 k at a time: each chunk reads one line of each row and
// writes width lines (row by row instead, rows 4 KB apart alias in L1's sets).
void pack_tile(const float* xp, int64_t xs, int64_t K, int64_t t0, int64_t tb, int64_t width, float* out) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t k1 = std::min(K, k0 + 16);
    for (int64_t t = 0; t < width; ++t) {
      const float* row = xp + (t0 + t) * xs;
      for (int64_t k = k0; k < k1; ++k) out[k * width + t] = t < tb ? row[k] : 0.f;
    }
  }
}

// y = x @ W.T: each thread a contiguous range of blocks.
void gemm(const at::Tensor& x, const float* wp, int64_t N, float* yp) {
  const int64_t T = x.size(0), K = x.size(1), xs = x.stride(0), nb = (N + kBlock - 1) / kBlock;
  const float* xp = x.data_ptr<float>();
  const int64_t width = tile_width(T), tiles = (T + width - 1) / width;
  std::vector<float> xt(static_cast<size_t>(tiles * width * K));
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      pack_tile(xp, xs, K, i * width, std::min(width, T - i * width), width, xt.data() + i * width * K);
  });
  const Kernel kernel = kernel_for(width);
#pragma omp parallel num_threads(at::get_num_threads()) if (nb > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = tid * nb / nth, hi = (tid + 1) * nb / nth;
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t i = 0; i < tiles; ++i)
        kernel(xt.data() + i * width * K, wp + b * K * kBlock, K, yp + i * width * N + b * kBlock, N,
               std::min(width, T - i * width), std::min(kBlock, N - b * kBlock));
  }
}

at::Tensor lora_blocked(const at::Tensor& x, const at::Tensor& wb, int64_t n, at::TensorList a_groups,
                        at::TensorList bts, at::IntArrayRef offsets, const at::Tensor& runs) {
  TORCH_CHECK(x.device().is_cpu() && wb.device().is_cpu(), "lora_blocked: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wb.scalar_type() == at::kFloat, "lora_blocked: fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_blocked: x must be [T, in] with unit inner stride");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(wb.dim() == 3 && wb.size(1) == K && wb.size(2) == kBlock && wb.is_contiguous(),
              "lora_blocked: wb must be a contiguous [NB, ", K, ", ", kBlock, "], got ", wb.sizes());
  TORCH_CHECK(n > (wb.size(0) - 1) * kBlock && n <= wb.size(0) * kBlock, "lora_blocked: ", wb.size(0),
              " blocks hold ", (wb.size(0) - 1) * kBlock + 1, " to ", wb.size(0) * kBlock, " columns, not ", n);
  TORCH_CHECK(a_groups.size() == offsets.size(), "lora_blocked: one column offset per group");
  auto y = at::empty({T, n}, x.options());
  int64_t rows = -1, end = 0;
  size_t next = 0;  // the first Bt of the group
  for (size_t g = 0; g < a_groups.size(); ++g) {
    const at::Tensor& a = a_groups[g];
    const size_t count = a.dim() == 3 ? static_cast<size_t>(a.size(1)) : 0;
    TORCH_CHECK(next + count <= bts.size(), "lora_blocked: group ", g, " has ", count, " parts, past the ",
                bts.size(), " Bt");
    TORCH_CHECK(rows < 0 || a.size(0) == rows, "lora_blocked: every group's A has the same rows");
    TORCH_CHECK(offsets[g] >= end, "lora_blocked: groups must be in column order and must not overlap");
    check_apply(y, offsets[g], x, a, bts.slice(next, count));
    rows = a.size(0);
    end = offsets[g];
    for (size_t p = 0; p < count; ++p) end += bts[next + p].size(1);
    next += count;
  }
  TORCH_CHECK(next == bts.size(), "lora_blocked: ", bts.size(), " Bt for ", next, " parts");
  const std::vector<Run> list = a_groups.empty() ? std::vector<Run>{} : parse_runs("lora_blocked", runs, T, rows);
  if (T == 0) return y;
  gemm(x, wb.data_ptr<float>(), n, y.data_ptr<float>());
  size_t first = 0;
  for (size_t g = 0; g < a_groups.size() && !list.empty(); ++g) {
    const size_t count = static_cast<size_t>(a_groups[g].size(1));
    apply_runs(y, offsets[g], x, a_groups[g], bts.slice(first, count), list);
    first += count;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("lora_blocked(Tensor x, Tensor wb, int n, Tensor[] a_groups, Tensor[] bts, int[] offsets, Tensor runs) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("lora_blocked", &lora_blocked); }
