// The end of a decode block (decode.cu, decode_mma.cu): its warps' online-
// softmax states (m, l, o), left in shared memory per warp and row, combined
// into the block's result for its R rows: the output itself when the keys
// were not split, or this split's partials for fa_merge_*.

#pragma once

#include "common.cuh"

namespace fa {

// m = max over warps, weights 2^(m_w - m). row_of(r): row r's index among
// the batch x H_q x L output rows (rows_total of them).
template <int W, int ROWS, int E, typename T, typename RowOf>
__device__ __forceinline__ void combine_decode_warps(const float (&o)[W][ROWS][E], const float (&m)[W][ROWS],
                                                     const float (&l)[W][ROWS], int R, RowOf row_of, T* out,
                                                     float* o_part, float* ml_part, int split,
                                                     int64_t rows_total) {
  for (int i = threadIdx.x; i < R * E; i += blockDim.x) {
    const int r = i / E, e = i % E;
    float m_max = FA_NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) m_max = fmaxf(m_max, m[w][r]);
    const float m_use = m_max == FA_NEG_INF ? 0.0f : m_max;
    float l_sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wgt = exp2f(m[w][r] - m_use);
      l_sum += wgt * l[w][r];
      acc += wgt * o[w][r][e];
    }
    const int64_t row = row_of(r);
    if (o_part == nullptr) {
      out[row * E + e] = from_f<T>(l_sum == 0.0f ? 0.0f : acc / l_sum);
    } else {
      const int64_t slot = (int64_t)split * rows_total + row;
      o_part[slot * E + e] = acc;
      if (e == 0) ml_part[slot * 2] = m_max, ml_part[slot * 2 + 1] = l_sum;
    }
  }
}

}  // namespace fa
