// Shared by the decode glue ops (decode_attention.cpp, add_rms_norm.cpp, gated_mul.cpp): rounding to the model dtype
// as the torch forms round, and a branch-free exp (<= 2 ulp over the softmax's and silu's range) so the loops
// vectorise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace adapter_manager_cpu {

template <typename scalar_t>
inline float round_to(float v) {  // v as the model dtype would hold it
  return static_cast<float>(static_cast<scalar_t>(v));
}

// exp(x) for x in [-87, 88]: 2^k · p(r), r = x - k·ln2 in [-ln2/2, ln2/2], p the degree-7 Taylor polynomial.
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest: 1.5·2^23 trick
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace adapter_manager_cpu
