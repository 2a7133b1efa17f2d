// The CPU linear on our own blocked weight layout, with its LoRA inside the same call at decode (fp32).
//
//   wb [NB, K, 32]: wb[b, k, c] = W[32·b + c, k] (zero past N);  y = x @ W.T  (y [T, N])
//   T <= kDecodeTokens, with runs: y[t, off_p : off_p + out_p] += (x[t] @ A_p[first : first + rank].T) @ Bt_p[...]
//   (as lora_apply); more tokens: the base GEMM, then lora_apply's loops per group.
//
// A block's 32 columns are one contiguous stream of K × 128 bytes: per k, two vectors of W times each token's x[t, k]
// broadcast (8 tokens: 16 FMAs per two loads, no horizontal sums), so a thread streams its blocks in order at the read
// pass's rate (oneDNN's packed linear reads ~25 % slower at M = 8 here, measured side by side). x is packed once per
// call as [K][TT] tiles, so the broadcasts read one line per k. The LoRA rides on the same loop: a block inside one
// part continues its k loop over the step's Bt rows of that part (two vectors of each row at the block's columns)
// against h laned per token ([J][TT], zero where a token is not in the row's run): J rows of FMAs per block, so one
// adapter adds rank rows to a 1024-row loop. Each thread computes its first blocks while their loop prefetches the A
// rows of its shrink items, shrinks from the cache, and after the barrier (every h written) adds the expand of those
// first blocks; every later block prefetches the next block's Bt lines.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "lora_common.h"

namespace {

using adapter_manager_cpu::apply_runs;
using adapter_manager_cpu::check_apply;
using adapter_manager_cpu::kPairTokens;
using adapter_manager_cpu::kShrinkRows;
using adapter_manager_cpu::load16;
using adapter_manager_cpu::parse_runs;
using adapter_manager_cpu::Run;
using adapter_manager_cpu::shrink_block;
using adapter_manager_cpu::shrink_pairs;
using adapter_manager_cpu::v16;

constexpr int64_t kBlock = 32;          // columns per block of the layout
constexpr int64_t kDecodeTokens = 16;   // tokens the fused decode path takes (tiles of 8)
constexpr int64_t kGemmTile = 12;       // tokens per GEMM tile: 24 accumulators
constexpr int64_t kGroupBytes = 512 << 10;  // a GEMM thread's blocks per pass over x: this much of W stays in L2

// The LoRA a block adds: J rows of Bt (each at the block's column) against h laned per token ([J][TT]).
struct Expand {
  const float* const* rows = nullptr;
  const float* h = nullptr;
  int64_t count = 0;
};

// Rows to prefetch while a block's k loop runs: one 64-byte line per k, row after row.
struct Fetch {
  const float* const* rows = nullptr;
  int64_t count = 0, lines = 0;  // lines per row
};

// y rows [0, tb) of one block (ys apart) = (load ? y : 0) + (base ? xt · wb : 0) + the expand; TT tokens in xt [K][TT].
template <int TT>
void block_kernel(const float* xt, const float* wb, int64_t K, bool base, bool load, const Expand& ex,
                  const Fetch& fetch, float* y, int64_t ys, int64_t tb, int64_t cols) {
  v16 a0[TT] = {}, a1[TT] = {};
  if (load)
    for (int64_t t = 0; t < tb; ++t) a0[t] = load16(y + t * ys), a1[t] = load16(y + t * ys + 16);
  if (base) {
    int64_t row = 0, line = 0;
    for (int64_t k = 0; k < K; ++k) {
      if (row < fetch.count) {
        __builtin_prefetch(fetch.rows[row] + 16 * line, 0, 3);
        if (++line == fetch.lines) line = 0, ++row;
      }
      const v16 w0 = load16(wb + k * kBlock), w1 = load16(wb + k * kBlock + 16);
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        const float xv = xt[k * TT + t];
        a0[t] += xv * w0;
        a1[t] += xv * w1;
      }
    }
  }
  for (int64_t j = 0; j < ex.count; ++j) {
    const v16 w0 = load16(ex.rows[j]), w1 = load16(ex.rows[j] + 16);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      const float hv = ex.h[j * TT + t];
      a0[t] += hv * w0;
      a1[t] += hv * w1;
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

using Kernel = void (*)(const float*, const float*, int64_t, bool, bool, const Expand&, const Fetch&, float*, int64_t,
                        int64_t, int64_t);

// The narrowest tile width of block_kernel that holds tb tokens (kernels for 1, 2, 4, 8 and kGemmTile tokens).
int64_t tile_width(int64_t tb) { return tb <= 1 ? 1 : tb <= 2 ? 2 : tb <= 4 ? 4 : tb <= 8 ? 8 : kGemmTile; }

Kernel kernel_for(int64_t width) {
  switch (width) {
    case 1: return &block_kernel<1>;
    case 2: return &block_kernel<2>;
    case 4: return &block_kernel<4>;
    case 8: return &block_kernel<8>;
    default: return &block_kernel<kGemmTile>;
  }
}

// x rows [t0, t0 + tb) as [K][width] (zero past tb).
void pack_tile(const float* xp, int64_t xs, int64_t K, int64_t t0, int64_t tb, int64_t width, float* out) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t t = 0; t < width; ++t) out[k * width + t] = t < tb ? xp[(t0 + t) * xs + k] : 0.f;
}

// A part of y's columns with LoRA: its A rows (row i at a + i·as) and Bt rows (row i at bt + i·bs).
struct Part {
  int64_t col0, cols;
  const float* a;
  int64_t as;
  const float* bt;
  int64_t bs;
};

// The base GEMM for any T: each thread's blocks in groups that stay in L2, x in tiles of kGemmTile tokens.
void gemm(const float* xp, int64_t xs, const float* wp, int64_t T, int64_t K, int64_t N, float* yp) {
  const int64_t nb = (N + kBlock - 1) / kBlock;
  const int64_t width = T <= kDecodeTokens ? tile_width(std::min<int64_t>(T, 8)) : kGemmTile;
  const int64_t tiles = (T + width - 1) / width;
  std::vector<float> xt(static_cast<size_t>(tiles * width * K));
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      pack_tile(xp, xs, K, i * width, std::min(width, T - i * width), width, xt.data() + i * width * K);
  });
  const Kernel kernel = kernel_for(width);
  const int64_t group = T <= kDecodeTokens ? 1 : std::max<int64_t>(1, kGroupBytes / (K * kBlock * 4));
  const Expand none;
  const Fetch nothing;
#pragma omp parallel num_threads(at::get_num_threads()) if (nb > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = tid * nb / nth, hi = (tid + 1) * nb / nth;
    for (int64_t g = lo; g < hi; g += group)
      for (int64_t i = 0; i < tiles; ++i)
        for (int64_t b = g; b < std::min(hi, g + group); ++b)
          kernel(xt.data() + i * width * K, wp + b * K * kBlock, K, true, false, none, nothing,
                 yp + i * width * N + b * kBlock, N, std::min(width, T - i * width), std::min(kBlock, N - b * kBlock));
  }
}

// The decode path: T <= kDecodeTokens with runs (see the file's comment).
void decode(const float* xp, int64_t xs, const float* wp, int64_t T, int64_t K, int64_t N, float* yp,
            const std::vector<Part>& parts, const std::vector<Run>& list) {
  const int64_t nb = (N + kBlock - 1) / kBlock, width = tile_width(std::min<int64_t>(T, 8));
  const int64_t tiles = (T + width - 1) / width, np = static_cast<int64_t>(parts.size());
  const int64_t nr = static_cast<int64_t>(list.size());
  std::vector<float> xt(static_cast<size_t>(tiles * width * K));
  for (int64_t i = 0; i < tiles; ++i)
    pack_tile(xp, xs, K, i * width, std::min(width, T - i * width), width, xt.data() + i * width * K);
  std::vector<int64_t> hoff(nr + 1, 0);  // run k's h: [count, rank] floats at hoff[k] of each part's block
  for (int64_t k = 0; k < nr; ++k) hoff[k + 1] = hoff[k] + list[k].count * list[k].rank;
  const int64_t hpart = hoff[nr];
  std::vector<float> h(static_cast<size_t>(np * hpart));
  std::vector<std::array<int64_t, 3>> shrink_items;  // (run, part, first row of a kShrinkRows block)
  for (int64_t k = 0; k < nr; ++k)
    for (int64_t p = 0; p < np; ++p)
      for (int64_t j = 0; j < list[k].rank; j += kShrinkRows) shrink_items.push_back({k, p, j});
  // per (part, tile): the runs' rows that touch the tile, as row offsets into Bt and h laned per token [J][width]
  std::vector<int64_t> jbase(np * tiles + 1, 0);
  std::vector<std::vector<int64_t>> tile_rows(np * tiles);  // Bt row index of each lane row
  for (int64_t p = 0; p < np; ++p)
    for (int64_t i = 0; i < tiles; ++i) {
      auto& rows = tile_rows[p * tiles + i];
      for (const Run& run : list)
        if (run.start < (i + 1) * width && run.start + run.count > i * width)
          for (int64_t j = 0; j < run.rank; ++j) rows.push_back(run.first + j);
      jbase[p * tiles + i + 1] = jbase[p * tiles + i] + static_cast<int64_t>(rows.size());
    }
  std::vector<float> hx(static_cast<size_t>(jbase.back() * width), 0.f);
  // which part holds a block whole (-1: base only or straddling; such blocks add their LoRA by a plain loop)
  std::vector<int64_t> owner(nb, -1);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t p = 0; p < np; ++p)
      if (b * kBlock >= parts[p].col0 && (b + 1) * kBlock <= parts[p].col0 + parts[p].cols) owner[b] = p;
  const Kernel kernel = kernel_for(width);
  const int64_t ni = static_cast<int64_t>(shrink_items.size());

#pragma omp parallel num_threads(at::get_num_threads()) if (nb > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = tid * nb / nth, hi = (tid + 1) * nb / nth;
    std::vector<const float*> fetch;  // this thread's A rows, in the order its items read them
    for (int64_t i = tid; i < ni; i += nth) {
      const auto [k, p, j0] = shrink_items[i];
      for (int64_t j = j0; j < std::min(j0 + kShrinkRows, list[k].rank); ++j)
        fetch.push_back(parts[p].a + (list[k].first + j) * parts[p].as);
    }
    const int64_t lines = (K + 15) / 16;
    std::vector<const float*> ptrs;
    // one block: its base (unless done) and its LoRA, or its base only (lora false), fetching meanwhile
    auto run_block = [&](int64_t b, bool base, bool lora, const Fetch& fetching) {
      const int64_t cols = std::min(kBlock, N - b * kBlock), p = owner[b];
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t tb = std::min(width, T - i * width);
        Expand ex;
        if (lora && p >= 0) {
          const auto& rows = tile_rows[p * tiles + i];
          ptrs.resize(rows.size());
          const int64_t c = b * kBlock - parts[p].col0;
          for (size_t j = 0; j < rows.size(); ++j) ptrs[j] = parts[p].bt + rows[j] * parts[p].bs + c;
          ex = Expand{ptrs.data(), hx.data() + jbase[p * tiles + i] * width, static_cast<int64_t>(rows.size())};
        }
        if (base || ex.count > 0)
          kernel(xt.data() + i * width * K, wp + b * K * kBlock, K, base, !base, ex, i == 0 ? fetching : Fetch{},
                 yp + i * width * N + b * kBlock, N, tb, cols);
      }
      if (!lora || p >= 0) return;
      for (int64_t q = 0; q < np; ++q) {  // a block that is not inside one part: each part's columns in it, plainly
        const Part& part = parts[q];
        const int64_t c0 = std::max(b * kBlock, part.col0), c1 = std::min(b * kBlock + cols, part.col0 + part.cols);
        for (int64_t k = 0; k < nr && c0 < c1; ++k) {
          const Run& run = list[k];
          for (int64_t t = run.start; t < run.start + run.count; ++t) {
            const float* ht = h.data() + q * hpart + hoff[k] + (t - run.start) * run.rank;
            for (int64_t c = c0; c < c1; ++c) {
              float acc = 0.f;
              for (int64_t j = 0; j < run.rank; ++j) acc += ht[j] * part.bt[(run.first + j) * part.bs + c - part.col0];
              yp[t * N + c] += acc;
            }
          }
        }
      }
    };
    auto prefetch_bt = [&](int64_t b) {
      if (b >= hi || owner[b] < 0) return;
      const int64_t p = owner[b], c = b * kBlock - parts[p].col0;
      for (int64_t i = 0; i < tiles; ++i)
        for (const int64_t row : tile_rows[p * tiles + i]) {
          const float* line = parts[p].bt + row * parts[p].bs + c;
          __builtin_prefetch(line, 0, 3);
          __builtin_prefetch(line + 16, 0, 3);
        }
    };
    // the first blocks, base only, while their loops prefetch this thread's A rows (16 rows per block of K lines)
    int64_t lead = lo;
    size_t fetched = 0;
    while (lead < hi && fetched < fetch.size()) {
      const int64_t count = std::min<int64_t>(static_cast<int64_t>(fetch.size() - fetched), K / lines);
      run_block(lead++, true, false, Fetch{fetch.data() + fetched, count, lines});
      fetched += static_cast<size_t>(count);
    }
    for (int64_t i = tid; i < ni; i += nth) {
      const auto [k, p, j0] = shrink_items[i];
      const Run& run = list[k];
      float* hk = h.data() + p * hpart + hoff[k];
      if (run.count < kPairTokens)
        shrink_block(xp, xs, parts[p].a, parts[p].as, K, run, j0, hk);
      else
        shrink_pairs(xp, xs, parts[p].a, parts[p].as, K, run, j0, hk);
    }
#pragma omp barrier
#pragma omp single
    for (int64_t p = 0; p < np; ++p)  // h laned per token: lane row j of (part, tile) holds h[t, j] for the row's run
      for (int64_t i = 0; i < tiles; ++i) {
        float* out = hx.data() + jbase[p * tiles + i] * width;
        for (int64_t k = 0; k < nr; ++k) {
          const Run& run = list[k];
          if (!(run.start < (i + 1) * width && run.start + run.count > i * width)) continue;
          for (int64_t j = 0; j < run.rank; ++j, out += width)
            for (int64_t t = std::max(run.start, i * width); t < std::min(run.start + run.count, (i + 1) * width); ++t)
              out[t - i * width] = h[p * hpart + hoff[k] + (t - run.start) * run.rank + j];
        }
      }
    for (int64_t b = lo; b < lead; ++b) prefetch_bt(b);
    for (int64_t b = lo; b < lead; ++b) run_block(b, false, true, Fetch{});
    for (int64_t b = lead; b < hi; ++b) {
      prefetch_bt(b + 1);
      run_block(b, true, true, Fetch{});
    }
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
  std::vector<Part> parts;
  int64_t rows = -1;
  size_t next = 0;  // the first Bt of the group
  for (size_t g = 0; g < a_groups.size(); ++g) {
    const at::Tensor& a = a_groups[g];
    const size_t count = a.dim() == 3 ? static_cast<size_t>(a.size(1)) : 0;
    TORCH_CHECK(next + count <= bts.size(), "lora_blocked: group ", g, " has ", count, " parts, past the ",
                bts.size(), " Bt");
    TORCH_CHECK(rows < 0 || a.size(0) == rows, "lora_blocked: every group's A has the same rows");
    rows = a.size(0);
    const at::TensorList group = bts.slice(next, count);
    check_apply(y, offsets[g], x, a, group);
    int64_t col = offsets[g];
    for (size_t p = 0; p < count; ++p) {
      TORCH_CHECK(parts.empty() || col >= parts.back().col0 + parts.back().cols,
                  "lora_blocked: groups must be in column order and must not overlap");
      parts.push_back({col, group[p].size(1), a.data_ptr<float>() + p * a.stride(1), a.stride(0),
                       group[p].data_ptr<float>(), group[p].stride(0)});
      col += group[p].size(1);
    }
    next += count;
  }
  TORCH_CHECK(next == bts.size(), "lora_blocked: ", bts.size(), " Bt for ", next, " parts");
  const std::vector<Run> list = parts.empty() ? std::vector<Run>{} : parse_runs("lora_blocked", runs, T, rows);
  if (T == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = wb.data_ptr<float>();
  if (!list.empty() && T <= kDecodeTokens) {
    decode(xp, x.stride(0), wp, T, K, n, y.data_ptr<float>(), parts, list);
    return y;
  }
  gemm(xp, x.stride(0), wp, T, K, n, y.data_ptr<float>());
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
