// The CPU linear on our own blocked weight layout, with its LoRA in the same call (fp32).
//
//   wb [NB, K, 32]: wb[b, k, c] = W[32·b + c, k] (zero past N);  y = x @ W.T  (y [T, N]), plus for every run and
//   every part p of every group y[t, off_p : off_p + out_p] += (x[t] @ A_p[first : first + rank].T) @ Bt_p[...].
//
// Each block's 32 columns are one contiguous stream of W, read against tiles of x packed once per call (8 tokens at
// decode, 12 at prefill, in panels of kPanelBytes past that size). Decode's LoRA (runs under kFuseMin tokens) follows
// the whole matmul as lora_apply's loops (an expand adds onto columns another thread's GEMM may not have written yet,
// so no work queue without a barrier); a prefill's long runs take their LoRA inside the GEMM (FusedLoRA below). The
// layout, the loop orders and the measurements behind them: docs/cpu.md.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::apply_runs;
using adapter_manager_cpu::check_apply;
using adapter_manager_cpu::load16;
using adapter_manager_cpu::parse_runs;
using adapter_manager_cpu::transpose16;
using adapter_manager_cpu::Run;
using adapter_manager_cpu::v16;

constexpr int64_t kBlock = 32;              // columns per block of the layout
constexpr int64_t kDecodeTokens = 16;       // up to this many tokens: tiles of 8 (or 1, 2, 4), one block at a time
constexpr int64_t kGemmTile = 12;           // more tokens: tiles of 12, 24 accumulators
constexpr int64_t kAhead = 16;              // W rows (of 128 bytes) a block's loop prefetches ahead
constexpr int64_t kFuseMin = 16;            // runs of at least this many tokens (prefill): the LoRA inside the GEMM
constexpr int64_t kPanelBytes = 8 << 20;    // x's packed tiles per pass over a thread's blocks (a long prefill)

// One run's expand onto one block of a tile: acc[t] += Σ_j h[j · TT + t] · Bt[first + j, the block's 32 columns].
struct Expand {
  const float* h;   // [rank][TT]: the run's shrink for the tile's tokens, zero for the tile's tokens outside the run
  const float* bt;  // Bt row `first`, at the block's first column
  int64_t bs, rank;
};

// y rows [0, tb) of one block (ys apart; `cols` of its 16·V columns) = x tile · W block (+ each expand); TT tokens
// in xt [K][TT]; W block rows kBlock apart (V = 1: the first 16 columns of each).
template <int TT, int V = 2>
void block_kernel(const float* xt, const float* wb, int64_t K, float* y, int64_t ys, int64_t tb, int64_t cols,
                  const Expand* ex = nullptr, int64_t nex = 0) {
  v16 a0[TT] = {}, a1[TT] = {};
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (TT <= 8) {  // decode: W streams once, non-temporal (prefill's tiles reuse it from L2: no hint)
      __builtin_prefetch(wb + (k + kAhead) * kBlock, 0, 0);
      __builtin_prefetch(wb + (k + kAhead) * kBlock + 16, 0, 0);
    }
    const v16 w0 = load16(wb + k * kBlock);
    const v16 w1 = V == 2 ? load16(wb + k * kBlock + 16) : v16{};
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      const float xv = xt[k * TT + t];
      a0[t] += xv * w0;
      if constexpr (V == 2) a1[t] += xv * w1;
    }
  }
  for (int64_t e = 0; e < nex; ++e) {  // the LoRA's expand: rank more steps of the same loop
    const float *h = ex[e].h, *bt = ex[e].bt;
    for (int64_t j = 0; j < ex[e].rank; ++j) {
      const v16 w0 = load16(bt + j * ex[e].bs), w1 = load16(bt + j * ex[e].bs + 16);
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        const float hv = h[j * TT + t];
        a0[t] += hv * w0;
        a1[t] += hv * w1;
      }
    }
  }
  if (cols == 16 * V) {
    for (int64_t t = 0; t < tb; ++t) {
      std::memcpy(y + t * ys, &a0[t], 64);
      if constexpr (V == 2) std::memcpy(y + t * ys + 16, &a1[t], 64);
    }
    return;
  }
  for (int64_t t = 0; t < tb; ++t) {  // the last block, cut at N
    float full[kBlock];
    std::memcpy(full, &a0[t], 64), std::memcpy(full + 16, &a1[t], 64);
    std::memcpy(y + t * ys, full, cols * sizeof(float));
  }
}

using Kernel = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, int64_t, const Expand*,
                        int64_t);

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

// 16 rows' (row i at rows[i], nullptr: zeros) k0 .. k0 + 16 as 16 vectors over the rows: r[k][i] = rows[i][k0 + k].
inline void columns16(const float* const* rows, int64_t k0, v16* r) {
  for (int i = 0; i < 16; ++i) r[i] = rows[i] != nullptr ? load16(rows[i] + k0) : v16{};
  transpose16(r);
}

// x rows [t0, t0 + tb) as [K][width] (zero past tb; width <= 16): 16 k at a time, transposed in registers.
void pack_tile(const float* xp, int64_t xs, int64_t K, int64_t t0, int64_t tb, int64_t width, float* out) {
  const float* rows[16];
  for (int64_t t = 0; t < 16; ++t) rows[t] = t < tb ? xp + (t0 + t) * xs : nullptr;
  const int64_t K16 = K - K % 16;
  v16 r[16];
  for (int64_t k0 = 0; k0 < K16; k0 += 16) {
    columns16(rows, k0, r);
    for (int64_t k = 0; k < 16; ++k) std::memcpy(out + (k0 + k) * width, &r[k], width * sizeof(float));
  }
  for (int64_t k = K16; k < K; ++k)
    for (int64_t t = 0; t < width; ++t) out[k * width + t] = t < tb ? rows[t][k] : 0.f;
}

// A LoRA part as the fused GEMM sees it: its columns of y and its Bt rows.
struct Part {
  int64_t col0, cols;  // y columns [col0, col0 + cols)
  const float* bt;     // Bt row 0
  int64_t bs;          // Bt row stride
};

// The tokens [lo, hi) of a tile (relative to it) that belong to one long run; h: [Q][rank][TT] floats (Q: every
// group's parts in order), the run's shrink for the tile's tokens, zero outside [lo, hi).
struct Segment {
  int64_t tile, lo, hi;
  const Run* run;
  float* h;
};

// The runs of at least kFuseMin tokens (prefill) take their LoRA inside the GEMM (Σ over groups, parts):
//   1. each run's A rows of each group, packed as the layout's blocks of 32 (A rows as columns: h = x · A.T);
//   2. the shrink per (tile, run, group, block of A rows): the GEMM's own kernel on the packed x tile, the result
//      transposed into the segment's h;
//   3. the GEMM: a block inside one part adds each segment's expand in the kernel's loop (rank more steps); a block
//      a part covers only in part (a part's edge off the block grid, or the last block cut at N) adds it afterwards.
struct FusedLoRA {
  std::vector<Part> parts;                           // every group's parts, in column order
  std::vector<Segment> segments;                     // each long run's tiles
  std::vector<std::vector<int64_t>> tile_segments;   // per tile, its segments' indices
  std::vector<float> h;                              // every segment's h
  std::vector<int64_t> group_part0;                  // per group its first part (one more entry: the part count)
  std::vector<int64_t> a_off;                        // per (run, group): its packed A rows' offset in a_packed
  std::vector<std::array<int64_t, 3>> pack_items;    // phase 1's work: (run, group, A block)
  std::vector<std::array<int64_t, 3>> shrink_items;  // phase 2's work: (segment, group, A block)
  std::unique_ptr<float[]> a_packed;                 // every run's A rows of every group, [blocks][K][32]
  std::vector<int64_t> full_part;                    // per block of y: the part covering it whole, or -1
  std::vector<std::array<int64_t, 4>> edges;         // (block, part, first column, end column) of partial covers
};

// The fused LoRA of the long runs of T tokens × K features into N columns of y: its parts (each group's Bt, from the
// group's column offset on), each run's segments per tile of kGemmTile with room for their h, the work items of the
// A packing and of the shrink, and per block of y the part that covers it whole or the edges parts cover in part.
FusedLoRA make_fused(int64_t T, int64_t K, int64_t N, at::TensorList a_groups, at::TensorList bts,
                     at::IntArrayRef offsets, const std::vector<Run>& long_runs) {
  FusedLoRA f;
  const int64_t groups = static_cast<int64_t>(a_groups.size()), nr = static_cast<int64_t>(long_runs.size());
  f.group_part0.assign(groups + 1, 0);
  size_t first = 0;
  for (int64_t g = 0; g < groups; ++g) {
    f.group_part0[g + 1] = f.group_part0[g] + a_groups[g].size(1);
    for (int64_t p = 0; p < a_groups[g].size(1); ++p, ++first) {
      const at::Tensor& bt = bts[first];
      const int64_t col0 = p == 0 ? offsets[g] : f.parts.back().col0 + f.parts.back().cols;
      f.parts.push_back(Part{col0, bt.size(1), bt.data_ptr<float>(), bt.stride(0)});
    }
  }
  const int64_t tiles = (T + kGemmTile - 1) / kGemmTile, Q = static_cast<int64_t>(f.parts.size());
  f.tile_segments.resize(tiles);
  std::vector<size_t> h_off;
  size_t h_size = 0;
  for (const Run& run : long_runs)
    for (int64_t i = run.start / kGemmTile; i * kGemmTile < run.start + run.count; ++i) {
      const int64_t lo = std::max<int64_t>(0, run.start - i * kGemmTile);
      const int64_t hi = std::min<int64_t>(kGemmTile, run.start + run.count - i * kGemmTile);
      f.tile_segments[i].push_back(static_cast<int64_t>(f.segments.size()));
      f.segments.push_back(Segment{i, lo, hi, &run, nullptr});
      h_off.push_back(h_size);
      h_size += static_cast<size_t>(Q * run.rank * kGemmTile);
    }
  f.h.resize(h_size);
  for (size_t s = 0; s < f.segments.size(); ++s) f.segments[s].h = f.h.data() + h_off[s];
  f.a_off.assign(nr * groups + 1, 0);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t rows = a_groups[g].size(1) * long_runs[r].rank, blocks = (rows + kBlock - 1) / kBlock;
      f.a_off[r * groups + g + 1] = f.a_off[r * groups + g] + blocks * K * kBlock;
      for (int64_t ab = 0; ab < blocks; ++ab) f.pack_items.push_back({r, g, ab});
    }
  f.a_packed.reset(new float[f.a_off.back()]);  // no zero fill: the packing writes every lane the shrink reads
  for (int64_t s = 0; s < static_cast<int64_t>(f.segments.size()); ++s)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t ab = 0; ab * kBlock < a_groups[g].size(1) * f.segments[s].run->rank; ++ab)
        f.shrink_items.push_back({s, g, ab});
  const int64_t nb = (N + kBlock - 1) / kBlock;
  f.full_part.assign(nb, -1);
  for (int64_t q = 0; q < Q; ++q) {
    const Part& part = f.parts[q];
    const int64_t end = part.col0 + part.cols;
    for (int64_t b = part.col0 / kBlock; b * kBlock < end; ++b) {
      const int64_t lo = std::max(part.col0, b * kBlock), hi = std::min(end, std::min(N, (b + 1) * kBlock));
      if (lo == b * kBlock && hi == (b + 1) * kBlock)
        f.full_part[b] = q;
      else
        f.edges.push_back({b, q, lo, hi});
    }
  }
  return f;
}

// y = x @ W.T (plus the long runs' LoRA, `fused` non-null): each thread a contiguous range of blocks.
void gemm(const at::Tensor& x, const float* wp, int64_t N, float* yp, at::TensorList a_groups,
          const std::vector<Run>& long_runs, FusedLoRA* fused) {
  const int64_t T = x.size(0), K = x.size(1), xs = x.stride(0), nb = (N + kBlock - 1) / kBlock;
  const float* xp = x.data_ptr<float>();
  const int64_t width = tile_width(T), tiles = (T + width - 1) / width;
  std::unique_ptr<float[]> xt(new float[tiles * width * K]);  // no zero fill: pack_tile writes every lane
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      pack_tile(xp, xs, K, i * width, std::min(width, T - i * width), width, xt.get() + i * width * K);
  });
  const Kernel kernel = kernel_for(width);
  const int64_t groups = static_cast<int64_t>(a_groups.size());
  // tiles per panel: x's packed tiles stream past every block, so a long prefill passes over them a panel at a time
  const int64_t panel = std::max<int64_t>(1, kPanelBytes / (width * K * static_cast<int64_t>(sizeof(float))));
  const int64_t threads = at::get_num_threads();
#pragma omp parallel num_threads(threads) if (nb > 1 || fused != nullptr)
  {
    if (fused) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < static_cast<int64_t>(fused->pack_items.size()); ++w) {  // A rows -> [blocks][K][32]
        const auto [r, g, ab] = fused->pack_items[w];
        const at::Tensor& a = a_groups[g];
        const int64_t rank = long_runs[r].rank, rows = a.size(1) * rank, as = a.stride(0), ps = a.stride(1);
        const float* ap = a.data_ptr<float>();
        float* out = fused->a_packed.get() + fused->a_off[r * groups + g] + ab * K * kBlock;
        for (int64_t c0 = ab * kBlock; c0 < std::min(rows, (ab + 1) * kBlock); c0 += 16) {  // 16 rows at a time
          const float* src[16];
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t row = c0 + c;
            src[c] = row < rows ? ap + (long_runs[r].first + row % rank) * as + (row / rank) * ps : nullptr;
          }
          const int64_t K16 = K - K % 16, half = c0 - ab * kBlock;
          v16 cols[16];
          for (int64_t k0 = 0; k0 < K16; k0 += 16) {
            columns16(src, k0, cols);
            for (int64_t k = 0; k < 16; ++k) std::memcpy(out + (k0 + k) * kBlock + half, &cols[k], 64);
          }
          for (int64_t k = K16; k < K; ++k)
            for (int64_t c = 0; c < 16; ++c) out[k * kBlock + half + c] = src[c] != nullptr ? src[c][k] : 0.f;
        }
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < static_cast<int64_t>(fused->shrink_items.size()); ++w) {  // h = x tile · A.T
        const auto [s, g, ab] = fused->shrink_items[w];
        const Segment& seg = fused->segments[s];
        const int64_t r = seg.run - long_runs.data(), rank = seg.run->rank;
        const int64_t rows = a_groups[g].size(1) * rank, cols = std::min(kBlock, rows - ab * kBlock);
        float tmp[kGemmTile * kBlock];
        const float* ablock = fused->a_packed.get() + fused->a_off[r * groups + g] + ab * K * kBlock;
        const float* tile = xt.get() + seg.tile * kGemmTile * K;
        if (cols > 16)
          block_kernel<kGemmTile, 2>(tile, ablock, K, tmp, kBlock, kGemmTile, cols);
        else
          block_kernel<kGemmTile, 1>(tile, ablock, K, tmp, kBlock, kGemmTile, cols);
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t row = ab * kBlock + c, q = fused->group_part0[g] + row / rank;
          float* hq = seg.h + (q * rank + row % rank) * kGemmTile;
          for (int64_t t = 0; t < kGemmTile; ++t) hq[t] = t >= seg.lo && t < seg.hi ? tmp[t * kBlock + c] : 0.f;
        }
      }
    }
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = tid * nb / nth, hi = (tid + 1) * nb / nth;
    Expand ex[kGemmTile];
    for (int64_t i0 = 0; i0 < tiles; i0 += panel)
      for (int64_t b = lo; b < hi; ++b)
        for (int64_t i = i0; i < std::min(tiles, i0 + panel); ++i) {
          int64_t nex = 0;
          if (fused && fused->full_part[b] >= 0) {
            const int64_t q = fused->full_part[b];
            const Part& part = fused->parts[q];
            for (const int64_t s : fused->tile_segments[i]) {
              const Segment& seg = fused->segments[s];
              const int64_t rank = seg.run->rank;
              ex[nex++] = Expand{seg.h + q * rank * kGemmTile,
                                 part.bt + seg.run->first * part.bs + (b * kBlock - part.col0), part.bs, rank};
            }
          }
          float* yt = yp + i * width * N + b * kBlock;
          const int64_t tb = std::min(width, T - i * width);
          kernel(xt.get() + i * width * K, wp + b * K * kBlock, K, yt, N, tb, std::min(kBlock, N - b * kBlock), ex,
                 nex);
        }
  }
  if (fused && !fused->edges.empty()) {  // the parts' columns off the block grid: y += h · Bt, column by column
    at::parallel_for(0, static_cast<int64_t>(fused->edges.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t e = lo; e < hi; ++e) {
        const auto [b, q, c0, c1] = fused->edges[e];
        const Part& part = fused->parts[q];
        for (const Segment& seg : fused->segments) {
          const int64_t rank = seg.run->rank;
          const float* hq = seg.h + q * rank * kGemmTile;
          for (int64_t t = seg.lo; t < seg.hi; ++t) {
            float* yrow = yp + (seg.tile * kGemmTile + t) * N;
            for (int64_t c = c0; c < c1; ++c) {
              const float* bcol = part.bt + seg.run->first * part.bs + (c - part.col0);
              float acc = 0.f;
              for (int64_t j = 0; j < rank; ++j) acc += hq[j * kGemmTile + t] * bcol[j * part.bs];
              yrow[c] += acc;
            }
          }
        }
      }
    });
  }
}

// An output past glibc's largest mmap threshold (32 MB) is a fresh mapping at every call, first touched one 4 KB page
// fault at a time; advised into transparent huge pages before the GEMM writes it, it faults once per 2 MB. Where THP
// is off ("never") the advice is ignored. Measured: docs/cpu.md.
constexpr size_t kHugeMin = size_t{32} << 20;
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

void huge_pages(const at::Tensor& y) {
  const size_t bytes = y.nbytes();
  if (bytes < kHugeMin) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(y.data_ptr());
  const uintptr_t lo = (start + kHugePage - 1) & ~(kHugePage - 1), hi = (start + bytes) & ~(kHugePage - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // advice only: a failure changes nothing
}

at::Tensor lora_blocked_body(const at::Tensor& x, const at::Tensor& wb, int64_t n, at::TensorList a_groups,
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
  huge_pages(y);
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
  // prefill's long runs: the LoRA inside the GEMM; the others (and every run at decode's few tokens): lora_apply's
  // loops afterwards
  std::vector<Run> long_runs, short_runs;
  for (const Run& run : list) (T > kDecodeTokens && run.count >= kFuseMin ? long_runs : short_runs).push_back(run);
  FusedLoRA fused;
  if (!long_runs.empty()) fused = make_fused(T, K, n, a_groups, bts, offsets, long_runs);
  gemm(x, wb.data_ptr<float>(), n, y.data_ptr<float>(), a_groups, long_runs, long_runs.empty() ? nullptr : &fused);
  size_t first = 0;
  for (size_t g = 0; g < a_groups.size() && !short_runs.empty(); ++g) {
    const size_t count = static_cast<size_t>(a_groups[g].size(1));
    apply_runs(y, offsets[g], x, a_groups[g], bts.slice(first, count), short_runs);
    first += count;
  }
  return y;
}

// lora_blocked, then a LoRA variant's vector epilogue on its output (kernels/vectors.py).
at::Tensor lora_blocked(const at::Tensor& x, const at::Tensor& wb, int64_t n, at::TensorList a_groups,
                        at::TensorList bts, at::IntArrayRef offsets, const at::Tensor& runs,
                        at::TensorList vectors, at::IntArrayRef vector_starts, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& scale) {
  at::Tensor y = lora_blocked_body(x, wb, n, a_groups, bts, offsets, runs);
  adapter_manager_cpu::apply_vector_groups("lora_blocked", y, vectors, vector_starts, bias, scale);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def("lora_blocked(Tensor x, Tensor wb, int n, Tensor[] a_groups, Tensor[] bts, int[] offsets, Tensor runs"
        ", Tensor[] vectors, int[] vector_starts, Tensor? bias, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("lora_blocked", &lora_blocked); }
