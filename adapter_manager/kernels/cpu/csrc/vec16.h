// Float vectors of 16 lanes for the CPU kernels' inner loops (GCC/Clang vector extensions: AVX-512 registers here,
// pairs of AVX2 or four NEON registers elsewhere).
#pragma once

#include <cstring>

namespace adapter_manager_cpu {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 8 lanes (one AVX2 register): the loops' forms for CPUs without AVX-512, where 16 accumulators of 16 floats spill.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float sum8(v8 v) {
  const v8 h = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  const v8 q = h + __builtin_shufflevector(h, h, 2, 3, 0, 1, 6, 7, 4, 5);
  return q[0] + q[1];
}

// [sum(t[n]) for n in kReduceOrder]: 16 horizontal sums in one vector (4 levels of pairwise shuffles and adds, 2 ops
// per sum instead of the 8 of one reduction each).
constexpr int kReduceOrder[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline v16 reduce16(v16* t) {
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)
    l1[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(t[2 * i], t[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    l3[i] = __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(l3[0], l3[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(l3[0], l3[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// r[i][j] <- r[j][i]: a 16 × 16 block transposed in registers (4 levels: 8 × 8 quadrants swapped, then 4 × 4, 2 × 2,
// 1 × 1 blocks within them; 2 shuffles per row pair per level).
inline void transpose16(v16* r) {
  for (int i = 0; i < 8; ++i) {
    const v16 a = r[i], b = r[i + 8];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    r[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int g = 0; g < 16; g += 8)
    for (int i = g; i < g + 4; ++i) {
      const v16 a = r[i], b = r[i + 4];
      r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      r[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
  for (int g = 0; g < 16; g += 4)
    for (int i = g; i < g + 2; ++i) {
      const v16 a = r[i], b = r[i + 2];
      r[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int i = 0; i < 16; i += 2) {
    const v16 a = r[i], b = r[i + 1];
    r[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    r[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
}

}  // namespace adapter_manager_cpu
