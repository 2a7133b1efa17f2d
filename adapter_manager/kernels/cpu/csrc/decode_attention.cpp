// decode_attention: the CPU decode step's attention in one call: RoPE on q and k, the step's keys and values written
// into the paged KV cache, and causal GQA attention of every token over its row's blocks (one pass over each row's
// keys, block by block: a block's positions are contiguous).
// With add_rms_norm.cpp and silu_mul.cpp it is the decode layer's glue between its weight matmuls: a handful of
// calls instead of ~35 small torch ops (each a Python call, a dispatch and an allocation).
//
// Semantics are the torch forms' (kernels/layer_reference.py), computed in fp32 and rounded to the model dtype where
// the torch forms round.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_common.h"
#include "vec16.h"

namespace {

using adapter_manager_cpu::exp_poly;
using adapter_manager_cpu::kReduceOrder;
using adapter_manager_cpu::load16;
using adapter_manager_cpu::load8;
using adapter_manager_cpu::reduce16;
using adapter_manager_cpu::round_to;
using adapter_manager_cpu::sum8;
using adapter_manager_cpu::v16;
using adapter_manager_cpu::v8;


// The scores of keys [from, keys) one at a time (what a vector form's passes leave over).
template <int64_t kDim>
void scores_tail(const float* q, const float* kbase, int64_t stride, int64_t from, int64_t keys, int64_t pstride,
                 float scale, float* p) {
  for (int64_t j = from; j < keys; ++j) {
    const float* key = kbase + j * stride;
    for (int64_t r = 0; r < 4; ++r) {
      float s = 0.f;
      for (int64_t i = 0; i < kDim; ++i) s += q[r * kDim + i] * key[i];
      p[r * pstride + j] = s * scale;
    }
  }
}

#if defined(__AVX512F__)
// Scores p[r·pstride + j] = q_r · key_j · scale for 4 query heads (q: 4 rows of kDim) over keys [0, keys) of one
// block (key j at kbase + j·stride): 4 keys × 4 heads per pass, 16 dot products reduced together.
template <int64_t kDim>
void scores4(const float* q, const float* kbase, int64_t stride, int64_t keys, int64_t pstride, float scale, float* p) {
  int64_t j = 0;
  for (; j + 4 <= keys; j += 4) {
    v16 t[16] = {};
    for (int64_t c = 0; c < kDim; c += 16) {
      const v16 q0 = load16(q + c), q1 = load16(q + kDim + c), q2 = load16(q + 2 * kDim + c),
                q3 = load16(q + 3 * kDim + c);
      for (int k = 0; k < 4; ++k) {
        const v16 kv = load16(kbase + (j + k) * stride + c);
        t[4 * k] += q0 * kv, t[4 * k + 1] += q1 * kv, t[4 * k + 2] += q2 * kv, t[4 * k + 3] += q3 * kv;
      }
    }
    const v16 sums = reduce16(t);
    for (int lane = 0; lane < 16; ++lane) {
      const int n = kReduceOrder[lane];  // input n = 4·key + head
      p[(n % 4) * pstride + j + n / 4] = sums[lane] * scale;
    }
  }
  scores_tail<kDim>(q, kbase, stride, j, keys, pstride, scale, p);
}
#else
// Without AVX-512 the 16 accumulators of 16 floats above are 32 of AVX2's 16 vector registers (they spill): 2 keys ×
// 4 heads of 8 floats (8 registers), each dot product reduced on its own.
template <int64_t kDim>
void scores4(const float* q, const float* kbase, int64_t stride, int64_t keys, int64_t pstride, float scale, float* p) {
  int64_t j = 0;
  for (; j + 2 <= keys; j += 2) {
    v8 t[2][4] = {};
    const float *k0 = kbase + j * stride, *k1 = k0 + stride;
    for (int64_t c = 0; c < kDim; c += 8) {
      const v8 a = load8(k0 + c), b = load8(k1 + c);
      for (int r = 0; r < 4; ++r) {
        const v8 qv = load8(q + r * kDim + c);
        t[0][r] += qv * a, t[1][r] += qv * b;
      }
    }
    for (int r = 0; r < 4; ++r) p[r * pstride + j] = sum8(t[0][r]) * scale, p[r * pstride + j + 1] = sum8(t[1][r]) * scale;
  }
  scores_tail<kDim>(q, kbase, stride, j, keys, pstride, scale, p);
}
#endif

// Ask for the next block's `n` rows of kDim floats (stride apart) while this one is computed: the hardware
// prefetcher follows a stride, and a row's blocks are not one stride apart.
template <int64_t kDim>
inline void prefetch_rows(const float* base, int64_t stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < kDim; c += 16) __builtin_prefetch(base + i * stride + c);
}

#if defined(__AVX512F__)
// out_r = sum_j p[r·keys + j] · value_j for 4 heads, 64 columns at a time held in 16 registers across the keys;
// value j at vbase + blocks[j / bs]·bstride + (j % bs)·stride, walked block by block.
template <int64_t kDim>
void weighted4(const float* p, const float* vbase, const int64_t* blocks, int64_t bs, int64_t bstride, int64_t stride,
               int64_t keys, float* out) {
  for (int64_t c = 0; c < kDim; c += 64) {
    v16 acc[4][4] = {};
    for (int64_t b = 0, j0 = 0; j0 < keys; ++b, j0 += bs) {
      const float* block = vbase + blocks[b] * bstride + c;
      const int64_t n = std::min(bs, keys - j0);
      if (j0 + bs < keys) prefetch_rows<64>(vbase + blocks[b + 1] * bstride + c, stride, std::min(bs, keys - j0 - bs));
      for (int64_t i = 0; i < n; ++i) {
        const float* value = block + i * stride;
        const v16 v0 = load16(value), v1 = load16(value + 16), v2 = load16(value + 32), v3 = load16(value + 48);
        for (int r = 0; r < 4; ++r) {
          const float w = p[r * keys + j0 + i];
          acc[r][0] += w * v0, acc[r][1] += w * v1, acc[r][2] += w * v2, acc[r][3] += w * v3;
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 4; ++i) std::memcpy(out + r * kDim + c + 16 * i, &acc[r][i], sizeof(v16));
  }
}
#else
// AVX2: 16 columns at a time for the 4 heads (8 registers of 8 floats), kDim / 16 passes over the row's values.
template <int64_t kDim>
void weighted4(const float* p, const float* vbase, const int64_t* blocks, int64_t bs, int64_t bstride, int64_t stride,
               int64_t keys, float* out) {
  for (int64_t c = 0; c < kDim; c += 16) {
    v8 acc[4][2] = {};
    for (int64_t b = 0, j0 = 0; j0 < keys; ++b, j0 += bs) {
      const float* block = vbase + blocks[b] * bstride + c;
      const int64_t n = std::min(bs, keys - j0);
      if (c == 0 && j0 + bs < keys)
        prefetch_rows<kDim>(vbase + blocks[b + 1] * bstride, stride, std::min(bs, keys - j0 - bs));
      for (int64_t i = 0; i < n; ++i) {
        const float* value = block + i * stride;
        const v8 v0 = load8(value), v1 = load8(value + 8);
        for (int r = 0; r < 4; ++r) {
          const float w = p[r * keys + j0 + i];
          acc[r][0] += w * v0, acc[r][1] += w * v1;
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 2; ++i) std::memcpy(out + r * kDim + c + 8 * i, &acc[r][i], sizeof(v8));
  }
}
#endif

// p[r·keys + j] = softmax over j of row r, for `rows` rows of `keys` scores
inline void softmax_rows(float* p, int64_t rows, int64_t keys) {
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = p + r * keys;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j) top = std::max(top, pr[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < keys; ++j) {
      pr[j] = exp_poly(pr[j] - top);
      sum += pr[j];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < keys; ++j) pr[j] *= inv;
  }
}

template <typename scalar_t>
inline void store_heads(const float* acc, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(acc[i]);
}

template <typename scalar_t>
void rope_into(float* out, const scalar_t* x, const float* cos, const float* sin, int64_t half) {
  // out = cat(x1·cos - x2·sin, x2·cos + x1·sin), each product and sum rounded as the torch form's ops are
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    out[i] = round_to<scalar_t>(round_to<scalar_t>(x1 * cos[i]) - round_to<scalar_t>(x2 * sin[i]));
    out[i + half] = round_to<scalar_t>(round_to<scalar_t>(x2 * cos[i]) + round_to<scalar_t>(x1 * sin[i]));
  }
}

// kDim: the head dim as a compile-time constant (64, 128: the per-key loops unroll fully), or 0 to read it at run time
template <typename scalar_t, int64_t kDim>
void attention_impl(const at::Tensor& qkv, const at::Tensor& table, at::Tensor& kc, at::Tensor& vc,
                    const int64_t* tables, int64_t width, const int64_t* rows, const int64_t* pos, int64_t heads,
                    int64_t kv_heads, at::Tensor& out) {
  const int64_t tokens = qkv.size(0), dim = kDim ? kDim : kc.size(3), half = dim / 2, rep = heads / kv_heads;
  const int64_t qs = qkv.stride(0), ts = table.stride(0), os = out.stride(0);
  const int64_t bs = kc.size(1), block_stride = kc.stride(0), cache_pos = kc.stride(1);  // contiguous [NB, BS, KV, D]
  // token t's position p: block tables[rows[t]·width + p / bs], offset p % bs
  auto at_pos = [&](int64_t t, int64_t p) { return tables[rows[t] * width + p / bs] * block_stride + (p % bs) * cache_pos; };
  const scalar_t* qp = qkv.data_ptr<scalar_t>();
  const float* tp = table.data_ptr<float>();
  scalar_t* kp = kc.data_ptr<scalar_t>();
  scalar_t* vp = vc.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  // cos / sin per token, cast to the model dtype first (rope_factors)
  std::vector<float> trig(static_cast<size_t>(tokens * dim));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < dim; ++i) trig[t * dim + i] = round_to<scalar_t>(tp[pos[t] * ts + i]);
  // 1. every token's rotated key and its value into the cache (before any token reads its row)
  std::vector<float> rotated(static_cast<size_t>(dim));
  for (int64_t t = 0; t < tokens; ++t) {
    const float *cos = trig.data() + t * dim, *sin = cos + half;
    for (int64_t g = 0; g < kv_heads; ++g) {
      rope_into<scalar_t>(rotated.data(), qp + t * qs + (heads + g) * dim, cos, sin, half);
      scalar_t* kdst = kp + at_pos(t, pos[t]) + g * dim;
      for (int64_t i = 0; i < dim; ++i) kdst[i] = static_cast<scalar_t>(rotated[i]);
      const scalar_t* vsrc = qp + t * qs + (heads + kv_heads + g) * dim;
      std::copy(vsrc, vsrc + dim, vp + at_pos(t, pos[t]) + g * dim);
    }
  }
  // 2. one work item per (token, KV head): its `rep` query heads against keys 0..pos of the token's row
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  const int64_t items = tokens * kv_heads;
  int64_t longest = 0;
  for (int64_t t = 0; t < tokens; ++t) longest = std::max(longest, pos[t] + 1);
  const bool parallel = items > 1 && items * longest * dim > 16384;
#pragma omp parallel if (parallel)
  {
    std::vector<float> q(static_cast<size_t>(rep * dim)), p(static_cast<size_t>(rep * longest)),
        acc(static_cast<size_t>(rep * dim));
#pragma omp for schedule(static)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t t = w / kv_heads, g = w % kv_heads, keys = pos[t] + 1;
      const float *cos = trig.data() + t * dim, *sin = cos + half;
      for (int64_t r = 0; r < rep; ++r)
        rope_into<scalar_t>(q.data() + r * dim, qp + t * qs + (g * rep + r) * dim, cos, sin, half);
      const int64_t* blocks = tables + rows[t] * width;
      const scalar_t* kbase = kp + g * dim;
      const scalar_t* vbase = vp + g * dim;
      constexpr bool kVector = std::is_same_v<scalar_t, float> && kDim > 0 && kDim % 64 == 0;
      if constexpr (kVector) {
        if (rep % 4 == 0) {
          for (int64_t b = 0, j0 = 0; j0 < keys; ++b, j0 += bs) {
            if (j0 + bs < keys)
              prefetch_rows<kDim>(kbase + blocks[b + 1] * block_stride, cache_pos, std::min(bs, keys - j0 - bs));
            for (int64_t r = 0; r < rep; r += 4)
              scores4<kDim>(q.data() + r * dim, kbase + blocks[b] * block_stride, cache_pos, std::min(bs, keys - j0),
                            keys, scale, p.data() + r * keys + j0);
          }
          softmax_rows(p.data(), rep, keys);
          for (int64_t r = 0; r < rep; r += 4)
            weighted4<kDim>(p.data() + r * keys, vbase, blocks, bs, block_stride, cache_pos, keys, acc.data() + r * dim);
          store_heads<scalar_t>(acc.data(), op + t * os + g * rep * dim, rep * dim);
          continue;
        }
      }
      for (int64_t j = 0; j < keys; ++j) {
        const scalar_t* key = kbase + blocks[j / bs] * block_stride + (j % bs) * cache_pos;
        int64_t r = 0;
        for (; r + 4 <= rep; r += 4) {  // four query heads per pass over the key: four reductions side by side
          const float *q0 = q.data() + r * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
          float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
          for (int64_t i = 0; i < dim; ++i) {
            const float kv = static_cast<float>(key[i]);
            s0 += q0[i] * kv, s1 += q1[i] * kv, s2 += q2[i] * kv, s3 += q3[i] * kv;
          }
          p[r * keys + j] = s0 * scale, p[(r + 1) * keys + j] = s1 * scale;
          p[(r + 2) * keys + j] = s2 * scale, p[(r + 3) * keys + j] = s3 * scale;
        }
        for (; r < rep; ++r) {
          const float* qr = q.data() + r * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim; ++i) s += qr[i] * static_cast<float>(key[i]);
          p[r * keys + j] = s * scale;
        }
      }
      softmax_rows(p.data(), rep, keys);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < keys; ++j) {
        const scalar_t* value = vbase + blocks[j / bs] * block_stride + (j % bs) * cache_pos;
        int64_t r = 0;
        for (; r + 4 <= rep; r += 4) {  // four heads' accumulators per pass over the value
          const float p0 = p[r * keys + j], p1 = p[(r + 1) * keys + j], p2 = p[(r + 2) * keys + j],
                      p3 = p[(r + 3) * keys + j];
          float *a0 = acc.data() + r * dim, *a1 = a0 + dim, *a2 = a1 + dim, *a3 = a2 + dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) {
            const float vv = static_cast<float>(value[i]);
            a0[i] += p0 * vv, a1[i] += p1 * vv, a2[i] += p2 * vv, a3[i] += p3 * vv;
          }
        }
        for (; r < rep; ++r) {
          const float pj = p[r * keys + j];
          float* ar = acc.data() + r * dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) ar[i] += pj * static_cast<float>(value[i]);
        }
      }
      store_heads<scalar_t>(acc.data(), op + t * os + g * rep * dim, rep * dim);
    }
  }
}

at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& table, at::Tensor k_cache, at::Tensor v_cache,
                            const at::Tensor& block_tables, const at::Tensor& rows, const at::Tensor& positions,
                            int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "decode_attention: heads (", heads,
              ") must be a positive multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.size(2) == kv_heads,
              "decode_attention: k_cache and v_cache must be contiguous [NB, BS, KV=", kv_heads, ", D], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t dim = k_cache.size(3);
  TORCH_CHECK(dim % 2 == 0, "decode_attention: head_dim must be even, got ", dim);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "decode_attention: qkv must be [T, (H + 2·KV)·D = ", (heads + 2 * kv_heads) * dim,
              "] with unit inner stride, got ", qkv.sizes());
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "decode_attention: qkv and the caches must share one dtype");
  TORCH_CHECK(table.dim() == 3 && table.size(1) == 2 && table.size(2) == dim / 2 && table.is_contiguous() &&
                  table.scalar_type() == at::kFloat && table.device().is_cpu(),
              "decode_attention: the rope table must be a contiguous fp32 [P, 2, D/2 = ", dim / 2, "], got ",
              table.sizes());
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && rows.dim() == 1 &&
                  positions.dim() == 1 && rows.size(0) == tokens && positions.size(0) == tokens &&
                  rows.device().is_cpu() && positions.device().is_cpu(),
              "decode_attention: rows and positions must be int64 [T = ", tokens, "] CPU tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.device().is_cpu(),
              "decode_attention: block_tables must be an int64 [R, MB] CPU tensor, got ", block_tables.sizes());
  const auto bt = block_tables.contiguous(), r = rows.contiguous(), p = positions.contiguous();
  const int64_t *tp = bt.data_ptr<int64_t>(), *rp = r.data_ptr<int64_t>(), *pp = p.data_ptr<int64_t>();
  const int64_t width = bt.size(1), bs = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(rp[t] >= 0 && rp[t] < bt.size(0), "decode_attention: token ", t, " names table row ", rp[t], " of ",
                bt.size(0));
    TORCH_CHECK(pp[t] >= 0 && pp[t] < width * bs && pp[t] < table.size(0), "decode_attention: token ", t,
                " is at position ", pp[t], ", beyond its table (", width, " blocks of ", bs, ") or the rope table (",
                table.size(0), ")");
    for (int64_t b = 0; b <= pp[t] / bs; ++b) {
      const int64_t block = tp[rp[t] * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "decode_attention: token ", t, " reads block ", block,
                  " (entry ", b, " of table row ", rp[t], "), beyond the cache's ", num_blocks, " blocks");
    }
  }
  auto out = at::empty({tokens, heads * dim}, qkv.options());
  if (tokens == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_attention", [&] {
    if (dim == 64) {
      attention_impl<scalar_t, 64>(qkv, table, k_cache, v_cache, tp, width, rp, pp, heads, kv_heads, out);
    } else if (dim == 128) {
      attention_impl<scalar_t, 128>(qkv, table, k_cache, v_cache, tp, width, rp, pp, heads, kv_heads, out);
    } else {
      attention_impl<scalar_t, 0>(qkv, table, k_cache, v_cache, tp, width, rp, pp, heads, kv_heads, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adapter_manager, m) {
  m.def(
      "decode_attention(Tensor qkv, Tensor rope_table, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, "
      "Tensor rows, Tensor positions, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(adapter_manager, CPU, m) { m.impl("decode_attention", &decode_attention); }
