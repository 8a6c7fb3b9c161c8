// What the generic kernels (generic.cu, generic_vec.cu) share: a warp's
// query row, and one group of keys into its online softmax (so that both
// keep the same semantics for hidden keys and non-finite scores).

#pragma once

#include "softmax.cuh"

namespace fa {

// The query row of this thread's warp (a warp a row, rows in B x H_q x L
// order; grid.y the key split) and its head's K / V rows.
struct GenericRow {
  int64_t rows, row, n, b;  // n = b * H_q + h
  int lane, split, l, h, g;

  __device__ __forceinline__ GenericRow(int B, int H_q, int H_kv, int L)
      : rows((int64_t)B * H_q * L),
        row(((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5),
        n(row / L),
        b(n / H_q),
        lane(threadIdx.x & 31),
        split(blockIdx.y),
        l((int)(row % L)),
        h((int)(n % H_q)),
        g(h / (H_q / H_kv)) {}
  __device__ __forceinline__ bool exists() const { return row < rows; }
  template <typename T>
  __device__ __forceinline__ const T* q_row(const T* q, const Layout& lay) const { return q + lay.q.at(b, h, l); }
  template <typename T>
  __device__ __forceinline__ const T* k_head(const T* k, const Layout& lay) const { return k + lay.k.at(b, g, 0); }
  template <typename T>
  __device__ __forceinline__ const T* v_head(const T* v, const Layout& lay) const { return v + lay.v.at(b, g, 0); }
};

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
  float m_use;
  const float alpha = online_rescale<false>(m, m_new, m_use);
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
}

}  // namespace fa
