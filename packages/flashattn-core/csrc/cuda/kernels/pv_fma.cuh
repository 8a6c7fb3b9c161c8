// The float32 prefills' rare path for O += P V (mma.sync accumulator layout:
// prefill_tf32.cu, prefill_tf32_pairs.cu).

#pragma once

#include "common.cuh"

namespace fa {

// O += P V for a tile whose values hold +-inf, or NaN that some row cannot
// see: in float32 FMA, a key at a time, over the keys each row can see
// only, so a hidden value never reaches a row and a visible infinite one
// meets P as it is (no split term 0 x inf = NaN). Key c's P for the
// thread's two rows comes from the lane that holds it (accumulator_column);
// this thread adds it into its own o columns. v_at(c, e): key c's value at column e,
// wherever the kernel keeps the tile. Not unrolled over keys: this path
// would otherwise be most of the module, which MLX copies and hashes on
// every launch.
template <int NB, int NO, typename VAt>
__device__ __forceinline__ void add_pv_fma(float (&o)[NO][4], const float (&s)[NB][4], VAt v_at, const Mask& mask,
                                           int64_t n, int ra, int L, int S, int c0, int count, int lane) {
  const int t = lane & 3;
  const int64_t rb[2] = {mask.is_array() && ra < L ? mask.row_base(n, ra) : 0,
                         mask.is_array() && ra + 8 < L ? mask.row_base(n, ra + 8) : 0};
#pragma unroll 1
  for (int c = 0; c < count; ++c) {
    float p[2];
    accumulator_column(s, c, lane, p);
    bool sees[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) sees[rr] = !mask.hides(rb[rr], ra + 8 * rr, c0 + c, L, S);
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (sees[i >> 1]) o[eb][i] = fmaf(p[i >> 1], v_at(c, eb * 8 + 2 * t + (i & 1)), o[eb][i]);
  }
}

}  // namespace fa
