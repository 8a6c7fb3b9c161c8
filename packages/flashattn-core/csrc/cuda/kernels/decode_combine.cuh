// The end of a decode block (decode.cu, decode_mma.cu): its warps' online-
// softmax states (m, l, o), left in shared memory per warp and row, combined
// into the block's result for its R rows: the output itself when the keys
// were not split, or this split's partials for fa_merge_*, or (fused) the
// partials and then, in the last block of the group to finish, the merge.

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

// The fused decode: one launch instead of split + merge (a decode call is
// bound by the fixed cost of each launch). Each block writes its split's
// partials, then its flag, then reads its group's flags: a block that finds
// them all set merges every split into the output. At least one block finds
// them all (the last to set its flag, or several if they finish together:
// they write the same values).
//
// The flags follow the m / l partials in the same output, which MLX
// allocates uninitialised for every call. So a flag is set to the call's tag
// (48 bits that the host never repeats: primitive.cpp), and any other value
// is whatever lay there before. One word per split, no counter: a shared
// counter took one atomic round trip per split in series.
constexpr int kFusedMaxSplits = 128;  // the merge's weights sit in shared memory
constexpr int kFusedMaxRows = 16;     // rows of one decode block

// This block's group's flags (gridDim.x of them): groups are (batch,
// grid.y) pairs in both decode kernels.
__device__ __forceinline__ unsigned long long* split_flags(float* ml_part, int64_t rows_total) {
  const int64_t group = (int64_t)blockIdx.z * gridDim.y + blockIdx.y;
  return reinterpret_cast<unsigned long long*>(ml_part + 2 * (int64_t)gridDim.x * rows_total) +
         group * gridDim.x;
}

// Sets this split's flag; whether every split of the group has set its own,
// and then every split's partials are visible to this block.
__device__ __forceinline__ bool all_splits_done(unsigned long long* flags, unsigned long long tag) {
  __shared__ int done;
  __threadfence();  // this thread's partials before the flag
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(flags + blockIdx.x) = tag;
    __syncwarp();
    __threadfence();  // the flag before reading the others' (a block finishing alongside sees it)
    bool mine = true;
    for (int s = threadIdx.x; s < static_cast<int>(gridDim.x); s += 32) {
      mine &= *reinterpret_cast<volatile unsigned long long*>(flags + s) == tag;
    }
    const bool all = __all_sync(0xffffffffu, mine);
    if (threadIdx.x == 0) done = all;
  }
  __syncthreads();
  if (done) __threadfence();  // the others' partials after their flags
  return done;
}

// The fused decode's merge, in a block that found its group done: its R rows' outputs
// from the gridDim.x splits' partials (read through L2, where the other
// blocks left them), as fa_merge_* would: out = sum_s 2^(m_s - m) o_s /
// sum_s 2^(m_s - m) l_s, m = max_s m_s.
template <int E, typename T, typename RowOf>
__device__ __forceinline__ void merge_group(const float* o_part, const float* ml_part, int R, RowOf row_of,
                                            T* out, int64_t rows_total) {
  static_assert(E % 4 == 0, "float4 reads of the partials");
  __shared__ float weight[kFusedMaxRows][kFusedMaxSplits];
  __shared__ float inv_l[kFusedMaxRows];
  const int splits = gridDim.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
  // Per row (a warp each): every split's (m, l) read at once, 4 per lane.
  for (int r = w; r < R; r += warps) {
    const int64_t row = row_of(r);
    constexpr int kPerLane = kFusedMaxSplits / 32;
    float2 ml[kPerLane];
    float m = FA_NEG_INF;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = lane + 32 * j;
      ml[j] = s < splits ? __ldcg(reinterpret_cast<const float2*>(ml_part + (s * rows_total + row) * 2))
                         : make_float2(FA_NEG_INF, 0.0f);
      m = fmaxf(m, ml[j].x);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float m_use = m == FA_NEG_INF ? 0.0f : m;
    float l_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = lane + 32 * j;
      const float wgt = exp2f(ml[j].x - m_use);
      if (s < splits) weight[r][s] = wgt;
      l_sum += wgt * ml[j].y;
    }
    l_sum = warp_sum(l_sum);
    if (lane == 0) inv_l[r] = l_sum == 0.0f ? 0.0f : 1.0f / l_sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < R * (E / 4); i += blockDim.x) {
    const int r = i / (E / 4), e = 4 * (i % (E / 4));
    const int64_t row = row_of(r);
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16  // the splits' loads in flight together
    for (int s = 0; s < splits; ++s) {
      const float4 o = __ldcg(reinterpret_cast<const float4*>(o_part + (s * rows_total + row) * E + e));
      const float wgt = weight[r][s];
      acc.x += wgt * o.x, acc.y += wgt * o.y, acc.z += wgt * o.z, acc.w += wgt * o.w;
    }
    const float inv = inv_l[r];
    T* dst = out + row * E + e;
    dst[0] = from_f<T>(acc.x * inv), dst[1] = from_f<T>(acc.y * inv);
    dst[2] = from_f<T>(acc.z * inv), dst[3] = from_f<T>(acc.w * inv);
  }
}

// The end of a decode block, after its warps have left (m, l, o) in shared
// memory: combined into the output or this split's partials, and in the
// fused decode (fused: o_part and ml_part are the call's scratch, tag its
// tag) merged too, by a block that finds its group done.
template <int E, int W, int ROWS, typename T, typename RowOf>
__device__ __forceinline__ void finish_decode_block(const float (&o)[W][ROWS][E], const float (&m)[W][ROWS],
                                                    const float (&l)[W][ROWS], int R, RowOf row_of, T* out,
                                                    float* o_part, float* ml_part, int64_t rows_total,
                                                    bool fused, unsigned long long tag) {
  combine_decode_warps(o, m, l, R, row_of, out, o_part, ml_part, blockIdx.x, rows_total);
  if (fused && all_splits_done(split_flags(ml_part, rows_total), tag)) {
    merge_group<E>(o_part, ml_part, R, row_of, out, rows_total);
  }
}

}  // namespace fa
