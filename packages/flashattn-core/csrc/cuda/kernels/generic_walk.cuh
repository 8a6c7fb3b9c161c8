// One group of keys into a query row's online softmax, as the generic
// kernels (generic.cu, generic_vec.cu) walk them: shared so that both keep
// the same semantics for hidden keys and non-finite scores.

#pragma once

#include "common.cuh"

namespace fa {

// The group's scores s (log2 units, before the mask's terms `add`) into the
// row's running max m, sum l_sum and output o (N elements of this lane);
// value(j, i): element i of key j's value row. Keys not seen, or that an
// array mask hides (-inf), never reach the row, even with a NaN value.
// fmaxf drops a NaN score; exp2 of it still carries the NaN to the output.
template <int G, int N, typename Value>
__device__ __forceinline__ void add_key_group(float (&s)[G], bool (&seen)[G], const float (&add)[G], float& m,
                                              float& l_sum, float (&o)[N], Value value) {
  float m_new = m;
#pragma unroll
  for (int j = 0; j < G; ++j) {
    seen[j] = seen[j] && add[j] != FA_NEG_INF;  // hidden: never reaches the output
    s[j] += add[j];
    if (seen[j]) m_new = fmaxf(m_new, s[j]);
  }
  const float m_use = m_new == FA_NEG_INF ? 0.0f : m_new;
  const float alpha = exp2f(m - m_use);
  l_sum *= alpha;
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] *= alpha;
#pragma unroll
  for (int j = 0; j < G; ++j) {
    if (!seen[j]) continue;
    const float p = exp2f(s[j] - m_use);
    l_sum += p;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] += p * value(j, i);
  }
  m = m_new;
}

}  // namespace fa
