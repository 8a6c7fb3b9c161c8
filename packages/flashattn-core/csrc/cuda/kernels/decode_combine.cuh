// The end of a decode block (decode.cu, decode_mma.cu): its warps' online-
// softmax states (m, l, o), left in shared memory per warp and row, combined
// into the block's result for its R rows: the output itself when the keys
// were not split, or (fused) this split's partials and then, in the block
// that finds its group done and claims it, the merge. (Partials alone, for a
// separate fa_merge_* launch: scripts/decode-probe.cu's comparison.)

#pragma once

#include "common.cuh"

namespace fa {

// Where a warp left row r's dim e in shared memory: the column itself.
struct SameColumn {
  __device__ __forceinline__ int operator()(int, int e) const { return e; }
};

// m = max over warps, weights 2^(m_w - m). row_of(r): row r's index among
// the batch x H_q x L output rows (rows_total of them); col_of(r, e): the
// column of o[w][r] that holds dim e.
template <int W, int ROWS, int E, typename T, typename RowOf, typename ColOf>
__device__ __forceinline__ void combine_decode_warps(const float (&o)[W][ROWS][E], const float (&m)[W][ROWS],
                                                     const float (&l)[W][ROWS], int R, RowOf row_of, ColOf col_of,
                                                     T* out, float* o_part, float* ml_part, int split,
                                                     int64_t rows_total) {
  for (int i = threadIdx.x; i < R * E; i += blockDim.x) {
    const int r = i / E, e = i % E;
    float m_max = FA_NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) m_max = fmaxf(m_max, m[w][r]);
    const float m_use = m_max == FA_NEG_INF ? 0.0f : m_max;
    float l_sum = 0.0f, acc = 0.0f;
    const int col = col_of(r, e);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wgt = exp2f(m[w][r] - m_use);
      l_sum += wgt * l[w][r];
      acc += wgt * o[w][r][col];
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
// partials, then its flag, then reads its group's flags; of the blocks that
// find them all set, the first to claim the group merges it.
//
// The flags and claims follow the m / l partials in the same output, which
// MLX allocates uninitialised for every call. So a flag is set to the call's
// tag (48 bits that the host never repeats: primitive.cpp), and any other
// value is whatever lay there before. One word per split, no counter: a
// shared counter took one atomic round trip per split in series.
constexpr int kFusedMaxSplits = 128;  // the merge's weights sit in shared memory
constexpr int kFusedMaxRows = 16;     // rows of one decode block

// This block's group's flags (gridDim.x of them) and, after every group's
// flags, its claim word: groups are (batch, grid.y) pairs in both decode
// kernels. The scratch holds 2 (gridDim.x + 1) floats a group past the m / l
// partials (dispatch.cpp).
__device__ __forceinline__ unsigned long long* split_flags(float* ml_part, int64_t rows_total) {
  const int64_t group = (int64_t)blockIdx.z * gridDim.y + blockIdx.y;
  return reinterpret_cast<unsigned long long*>(ml_part + 2 * (int64_t)gridDim.x * rows_total) +
         group * gridDim.x;
}
__device__ __forceinline__ unsigned long long* group_claim(float* ml_part, int64_t rows_total) {
  const int64_t groups = (int64_t)gridDim.z * gridDim.y, group = (int64_t)blockIdx.z * gridDim.y + blockIdx.y;
  return reinterpret_cast<unsigned long long*>(ml_part + 2 * (int64_t)gridDim.x * rows_total) +
         groups * gridDim.x + group;
}

// Sets this split's flag; whether this block merges the group: every split
// has set its flag (then every split's partials are visible to this block)
// and this block claimed the merge first. Blocks that finish together often
// all find the flags set (about half of a qwen05b decode's 128 blocks on an
// H200), and each merging the group read the partials that many times over
// (5-11 MB through L2, ~3 us); the claim is an exchange of the group's word
// for the tag, won by the one block that gets another value back.
__device__ __forceinline__ bool claims_merge(unsigned long long* flags, unsigned long long* claim,
                                             unsigned long long tag) {
  __shared__ int done;
  __syncthreads();  // the block's partials are written (thread 0's release below covers them)
  FA_MARK(6);
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(flags + blockIdx.x), "l"(tag) : "memory");
    }
    __syncwarp();
    // The flag before reading the others' (store, then load: only a
    // sequentially consistent fence makes a block finishing alongside see it).
    asm volatile("fence.sc.gpu;" ::: "memory");
    bool mine = true;
    for (int s = threadIdx.x; s < static_cast<int>(gridDim.x); s += 32) {
      mine &= *reinterpret_cast<volatile unsigned long long*>(flags + s) == tag;
    }
    const bool all = __all_sync(0xffffffffu, mine);
    FA_MARK(7);
    if (threadIdx.x == 0) done = all && atomicExch(claim, tag) != tag;
  }
  __syncthreads();
  if (done) asm volatile("fence.acq_rel.gpu;" ::: "memory");  // the others' partials after their flags
  return done;
}

// The fused decode's merge, in the block that claimed it: the group's R
// rows of output from the gridDim.x splits' partials (read through L2, where
// the other blocks left them), as fa_merge_* would: out = sum_s 2^(m_s - m)
// o_s / sum_s 2^(m_s - m) l_s, m = max_s m_s.
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
  FA_MARK(9);
  auto store_item = [&](int i, const float4& acc) {
    const int r = i / (E / 4), e = 4 * (i % (E / 4));
    const float inv = inv_l[r];
    T* dst = out + row_of(r) * E + e;
    dst[0] = from_f<T>(acc.x * inv), dst[1] = from_f<T>(acc.y * inv);
    dst[2] = from_f<T>(acc.z * inv), dst[3] = from_f<T>(acc.w * inv);
  };
  // Item i (4 dims of a row): its splits from `part`, every
  // `parts`-th, summed in batches of kBatch loads issued together (a loop
  // with a bound known only at run time kept them one after another).
  constexpr int kBatch = 16;
  auto sum_item = [&](int i, int part, int parts) {
    const int r = i / (E / 4), e = 4 * (i % (E / 4));
    const float* o_row = o_part + row_of(r) * E + e;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = part; s0 < splits; s0 += kBatch * parts) {
      float4 o[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int s = s0 + j * parts;
        o[j] = s < splits ? __ldcg(reinterpret_cast<const float4*>(o_row + s * rows_total * E))
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int s = s0 + j * parts;
        const float wgt = s < splits ? weight[r][s] : 0.0f;
        acc.x += wgt * o[j].x, acc.y += wgt * o[j].y, acc.z += wgt * o[j].z, acc.w += wgt * o[j].w;
      }
    }
    return acc;
  };
  // Items in rounds of `span` (one round unless a block has fewer threads
  // than items); each item's splits in `parts` interleaved shares, as many
  // threads (fewer loads in series a thread), the shares added through
  // shared memory. One call of sum_item: its unrolled loads are most of the
  // merge's machine code, and MLX hashes a kernel's module on every launch.
  constexpr int kShare = 256;
  __shared__ float4 share[kShare];
  const int threads = blockDim.x, items = R * (E / 4), span = min(items, threads);
  const int parts = items > threads ? 1 : min(threads / items, kShare / items + 1);
  for (int base = 0; base < items; base += span) {
    const int i = base + static_cast<int>(threadIdx.x) % span, part = threadIdx.x / span;
    const bool active = i < items && part < parts;
    float4 acc = active ? sum_item(i, part, parts) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (parts > 1) {
      if (active && part > 0) share[(part - 1) * items + i] = acc;
      __syncthreads();
      if (active && part == 0) {
        for (int p = 1; p < parts; ++p) {
          const float4 x = share[(p - 1) * items + i];
          acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
      }
    }
    if (active && part == 0) store_item(i, acc);
  }
}

// The end of a decode block, after its warps have left (m, l, o) in shared
// memory: combined into the output or this split's partials, and in the
// fused decode (fused: o_part and ml_part are the call's scratch, tag its
// tag) merged too, by a block that finds its group done.
template <int E, int W, int ROWS, typename T, typename RowOf, typename ColOf = SameColumn>
__device__ __forceinline__ void finish_decode_block(const float (&o)[W][ROWS][E], const float (&m)[W][ROWS],
                                                    const float (&l)[W][ROWS], int R, RowOf row_of, T* out,
                                                    float* o_part, float* ml_part, int64_t rows_total,
                                                    bool fused, unsigned long long tag, ColOf col_of = {}) {
  combine_decode_warps(o, m, l, R, row_of, col_of, out, o_part, ml_part, blockIdx.x, rows_total);
  FA_MARK(3);
  if (fused && claims_merge(split_flags(ml_part, rows_total), group_claim(ml_part, rows_total), tag)) {
    FA_MARK(4);
    merge_group<E>(o_part, ml_part, R, row_of, out, rows_total);
    FA_MARK(5);
  }
}

}  // namespace fa
