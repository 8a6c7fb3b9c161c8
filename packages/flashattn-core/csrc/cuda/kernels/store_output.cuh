// The 16-bit prefills' output (prefill_f16.cu, prefill_f16_wg.cu):
// store_rows (mma.cuh), or with kFold (mask_bits.h) the sum of o's two
// halves, E / 2 columns, where the P V products of each key and value row's
// two bfloat16 terms [hi | lo] land (cuda/quantized.cpp). FOLDABLE:
// prefill_f16.cu's float32 variants (kF32), the only kernels whose launches
// set kFold (on Hopper the two-term units read the queries twice instead,
// and a folded call never takes the wgmma kernels: plan_prefill.cpp).

#pragma once

#include "mma.cuh"

namespace fa {

template <typename TO, int NO, bool FOLDABLE>
__device__ __forceinline__ void store_output(float (&o)[NO][4], const float* m_i, const float* l_i, float sink2,
                                             const OutRows<TO>& rows, int L, int E, int ra, int t, int mask_kind) {
  if constexpr (FOLDABLE && NO % 2 == 0) {
    if (mask_kind & kFold) {
      constexpr int NH = NO / 2;
#pragma unroll
      for (int eb = 0; eb < NH; ++eb)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[eb][c] += o[eb + NH][c];
      store_rows<TO, NH>(reinterpret_cast<const float(&)[NH][4]>(o), m_i, l_i, sink2, rows, L, E / 2, ra, t);
      return;
    }
  }
  store_rows<TO, NO>(o, m_i, l_i, sink2, rows, L, E, ra, t);
}

}  // namespace fa
