// The CPU linear on an int8 weight with one scale per output row (weight-only quantization), any number of tokens:
//
//   y[t, n] = scales[n] · sum_k x[t, k] · q[n, k]          (fp32 x, y; W = q · scales[:, None] dequantized)
//
// q is held blocked (kernels/cpu/linear_ops.py: q8_block): qb[b, k, c] = q[kQ8Block·b + c, k], zero past N, so a
// block's k-th row is kQ8Block consecutive bytes. Each thread takes whole blocks; per block, a panel of kPanel rows
// of k is converted to fp32 once into an L1 buffer (a quarter of fp32's bytes come from memory), then every pass
// of kTokens tokens runs over it: each k broadcasts one x value per token and adds it times the panel row's column
// vectors (one at a time) into kTokens × kVecs = 12 accumulators, which stay in registers with the broadcasts and
// the column vector (15 of AVX2's 16, 17 of AVX-512's 32). No horizontal sums, the scale applied once at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQ8Block = 48;  // output columns per block (q8_block's in linear_ops.py)
constexpr int64_t kPanel = 128;   // k rows per fp32 panel: 128 × 48 × 4 B = 24 KB, in L1
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kTokens = 4;
#else
constexpr int kLanes = 8;
constexpr int kTokens = 2;
#endif
constexpr int kVecs = kQ8Block / kLanes;  // column vectors per panel row
typedef float vf __attribute__((vector_size(kLanes * 4)));

inline vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// kLanes int8 values at p as floats (sign-extended, converted exactly)
inline vf load_q8(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// acc[t][j] (+)= sum over the panel's k of x[t][k] · panel[k][j·kLanes ...], stored to tile rows (kQ8Block floats).
template <int kT>
inline void panel_pass(const float* const* xr, const float* panel, int64_t rows, bool first, float* tile) {
  vf acc[kT][kVecs];
  for (int t = 0; t < kT; ++t)
    for (int j = 0; j < kVecs; ++j) acc[t][j] = first ? vf{} : loadf(tile + t * kQ8Block + j * kLanes);
  for (int64_t k = 0; k < rows; ++k) {
    float xv[kT];
    for (int t = 0; t < kT; ++t) xv[t] = xr[t][k];
#pragma GCC unroll 6
    for (int j = 0; j < kVecs; ++j) {
      const vf w = loadf(panel + k * kQ8Block + j * kLanes);
      for (int t = 0; t < kT; ++t) acc[t][j] += xv[t] * w;
    }
  }
  for (int t = 0; t < kT; ++t)
    for (int j = 0; j < kVecs; ++j) storef(tile + t * kQ8Block + j * kLanes, acc[t][j]);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qb, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && qb.device().is_cpu() && scales.device().is_cpu(), "q8_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && qb.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "q8_linear: x and scales fp32, the weight int8");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "q8_linear: x must be [T, in] with unit inner stride");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(qb.dim() == 3 && qb.is_contiguous() && qb.size(1) == K && qb.size(2) == kQ8Block,
              "q8_linear: the weight must be a contiguous blocked [ceil(out / ", kQ8Block, "), in = ", K, ", ",
              kQ8Block, "]");
  const int64_t nb = qb.size(0);
  TORCH_CHECK(n > (nb - 1) * kQ8Block && n <= nb * kQ8Block, "q8_linear: out = ", n, " does not fit ", nb,
              " blocks of ", kQ8Block);
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.is_contiguous(), "q8_linear: scales must be [", n,
              "]");
  auto y = at::empty({T, n}, x.options());
  if (T == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qb.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const int64_t tcap = std::min<int64_t>(T, 256);  // tokens per tile: longer steps take several token ranges
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float panel[kPanel * kQ8Block];
    std::vector<float> tile(static_cast<size_t>(tcap * kQ8Block));
    const float* xr[kTokens];
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* qblock = qp + b * K * kQ8Block;
      const int64_t c0 = b * kQ8Block, cols = std::min(kQ8Block, n - c0);
      for (int64_t r0 = 0; r0 < T; r0 += tcap) {
        const int64_t tr = std::min(tcap, T - r0);
        for (int64_t k0 = 0; k0 < K; k0 += kPanel) {
          const int64_t rows = std::min(kPanel, K - k0);
          const int8_t* src = qblock + k0 * kQ8Block;
          for (int64_t e = 0; e < rows * kQ8Block; e += 64) {  // one cache line a step, the one 8 KB on prefetched
            __builtin_prefetch(src + e + 8192, 0, 3);
            for (int64_t i = e; i < std::min(e + 64, rows * kQ8Block); i += kLanes) storef(panel + i, load_q8(src + i));
          }
          for (int64_t t0 = 0; t0 < tr; t0 += kTokens) {
            const int64_t tb = std::min<int64_t>(kTokens, tr - t0);
            for (int t = 0; t < kTokens; ++t) xr[t] = xp + (r0 + t0 + (t < tb ? t : 0)) * xs + k0;
            float* out = tile.data() + t0 * kQ8Block;
            if (tb == kTokens) {
              panel_pass<kTokens>(xr, panel, rows, k0 == 0, out);
            } else {
              for (int64_t t = 0; t < tb; ++t) panel_pass<1>(xr + t, panel, rows, k0 == 0, out + t * kQ8Block);
            }
          }
        }
        for (int64_t t = 0; t < tr; ++t)
          for (int64_t c = 0; c < cols; ++c) yp[(r0 + t) * n + c0 + c] = tile[t * kQ8Block + c] * sp[c0 + c];
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) { m.def("q8_linear(Tensor x, Tensor qb, Tensor scales, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("q8_linear", &q8_linear); }
