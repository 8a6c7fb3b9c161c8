// The merge of partial online-softmax states (o_s, m_s, l_s) of one row,
// once for every CUDA kernel that splits a row's keys (across blocks, key
// pieces or lanes) or leaves a row's state in several warps:
//
//   out = sum_s 2^(m_s - m) o_s / sum_s 2^(m_s - m) l_s,   m = max_s m_s
//
// with softmax.cuh's rules: where no part saw a visible key, every weight is
// 0 and the row is zeros.

#pragma once

#include "softmax.cuh"

namespace fa {

// Part s's weight, where base = exp_base(the largest m_s).
template <bool kFast = false>
__device__ __forceinline__ float merge_weight(float m_s, float base) {
  return exp2_of<kFast>(m_s - base);
}

// Two states into one: (m, l) becomes the merge's, and a, b weigh the first
// state's and the second's o (o = a o + b o_p).
template <bool kFast = false>
__device__ __forceinline__ void merge_pair(float& m, float& l, float m_p, float l_p, float& a, float& b) {
  const float m_new = fmaxf(m, m_p);
  const float base = exp_base(m_new);
  a = merge_weight<kFast>(m, base);
  b = merge_weight<kFast>(m_p, base);
  l = l * a + l_p * b;
  m = m_new;
}

}  // namespace fa
