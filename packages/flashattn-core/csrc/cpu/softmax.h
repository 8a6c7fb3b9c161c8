// The rule every online-softmax step and the split merge share: a row's
// probabilities are taken as exp2(s - base) against its running maximum m,
// except that a row which has seen only hidden keys (m = -inf) uses base 0,
// so that exp2(-inf - 0) = 0 where -inf - (-inf) would be NaN. Such a row
// ends with l = 0 and gives zeros.
//
// When a gradient will be taken the forward also keeps each row's
// log-sum-exp, in the same log2 domain as the scores (scale * log2(e) folded
// in): lse = m + log2(l). The backward recomputes P = exp2(s - lse) from it.
// A row that saw no key stores +inf, so that its P is exactly 0.

#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace flashattn::cpu {

inline float softmax_base(float m) {
  return m == -std::numeric_limits<float>::infinity() ? 0.0f : m;
}

// 1 / l for a row's output: 0 for a row that saw no visible key (l = 0),
// whose output is zeros, never NaN.
inline float inverse_sum(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }

inline float row_lse(float m, float l) {
  return l == 0.0f ? std::numeric_limits<float>::infinity() : m + std::log2(l);
}

// A row's output O = o / l to dst (o's element e at o[e * stride]), and its
// log-sum-exp to *lse when the forward keeps it (lse not null).
template <typename T>
inline void store_row(T* dst, const float* o, int64_t stride, int E, float m, float l, float* lse) {
  const float inv = inverse_sum(l);
  for (int e = 0; e < E; ++e) {
    dst[e] = static_cast<T>(o[e * stride] * inv);
  }
  if (lse) {
    *lse = row_lse(m, l);
  }
}

} // namespace flashattn::cpu
