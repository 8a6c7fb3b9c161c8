// Decode on tensor cores for float32, with the 3xTF32 split (float32
// accuracy): FlashDecoding with the query rows of one GQA group (at most 8)
// in rows 0-7 of mma.sync m16n8k8 (TF32 operands, float32 accumulation).
// Dispatched when no key inside the range is hidden (no mask, or causal with
// one query position: mlx-lm's generation, the patch's float32 path) and a
// group has at most 8 rows; decode.cu takes the other float32 decode cases.
//
// Why: decode.cu scores a key per lane with scalar FMA against queries in
// shared memory, one warp per scheduler, and waits on its own dependent
// instructions (Nsight Compute); it was slower than MLX's decode.
//
// Grid as decode_mma.cu's: (splits x threads, H_kv, batch). A block of W
// warps (decode_shapes.h) takes one (batch, KV head) group and one split of
// the keys; each warp walks chunks of KC = 1024 / E keys (4 KB of K and 4 of
// V), U of them at once (a pass: all U chunks' loads issued, then computed).
// K and V go from global memory straight into fragments, each lane loading
// 16 contiguous bytes of a row:
//
//   S = Q K^T   k-step (b, j) of 8 dims: slot t is dim 16b + 4t + 2j, slot
//               t + 4 is dim 16b + 4t + 2j + 1 (the head-dim sum runs in a
//               permuted order; the query fragments use the same). Column n
//               of an 8-key tile is key (n >> 1) + 4 (n & 1), so that the
//               accumulator's columns 2t, 2t + 1 (keys t, t + 4) are already
//               P's A fragment for P V.
//   softmax     online, on the accumulators (row g per thread; rows 8-15
//               of the tiles are zero and dropped)
//   O += P V    lane (g, t) loads dims [32b + 4g, +4) of keys t and t + 4 of
//               the tile: output dim 32b + 4n + i lands in tile 4b + i,
//               column n.
//
// Each product is hi*hi + hi*lo + lo*hi (mma.cuh's split_tf32). The query
// and P take split_tf32_query, whose parts are both nonzero for a nonzero
// finite value: an infinite key or value element then meets no 0 (0 x inf
// would be NaN where float64 gives +-inf), so NaN and Inf follow the
// reference as in the scalar kernels. Keys past the split's end load as
// zeros and are masked (P = 0 multiplies only zeros). The warps' (m, l, o)
// are combined through shared memory (decode_combine.cuh).

#include "decode_combine.cuh"
#include "decode_shapes.h"
#include "decode_walk.cuh"
#include "kv_rows.cuh"
#include "mma.cuh"
#include "unit.cuh"

namespace fa {

constexpr int kTf32DecodeRows = 8;  // rows g of the m16 tile; rows g + 8 stay zero
constexpr int kTf32Ahead = 2;       // chunks ahead of the current one asked into L2 (U = 1)

template <int E, int W>
struct Tf32DecodeSmem {
  float o[W][kTf32DecodeRows][E];
  float m[W][kTf32DecodeRows], l[W][kTf32DecodeRows];
};

// The column where a warp leaves dim e of row r of its o: e's low three
// bits XOR r, so that one accumulator register's 32 stores (rows g, dims
// 32b + 8t + 4c + i) fall in 32 banks rather than 4.
struct Tf32DecodeColumn {
  __device__ __forceinline__ int operator()(int r, int e) const { return e ^ (r & 7); }
};

__device__ __forceinline__ float4 load4(const float* p, bool valid) {
  return valid ? *reinterpret_cast<const float4*>(p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Where the decode reads a KV head's rows from, 4 elements (col a multiple
// of 4) at a time: float32 rows, or MLX's affine-quantized rows
// (kv_rows.cuh), whose raw words, scales and biases a warp holds from a
// pass's loads until it expands each where it is used. No L2 prefetch of
// quantized rows ahead (ChunkWalk asks for rows of floats).
// kAlignedQueries: whether the queries' rows are 16-byte aligned (the
// planner checks it for the plain kernel; the quantized one reads them
// element by element, from anywhere).
struct F32DecodeRows {
  using Raw = float4;
  static constexpr bool kPrefetch = true, kAlignedQueries = true;
  const float* head;
  int64_t sr;
  // Dims [d0 + d1, +4) of row `key` (d0 a constant of the unrolled loops:
  // added to the pointer apart, it folds into the load's offset).
  __device__ __forceinline__ Raw load(int key, int d0, int d1, bool valid) const {
    return load4(head + key * sr + d0 + d1, valid);
  }
  __device__ __forceinline__ float4 expand(const Raw& r, int) const { return r; }
};
__device__ __forceinline__ const float* prefetch_head(const F32DecodeRows& r) { return r.head; }
__device__ __forceinline__ int64_t prefetch_stride(const F32DecodeRows& r) { return r.sr; }
template <typename T>
struct QuantDecodeRows;
template <typename T>
__device__ __forceinline__ const float* prefetch_head(const QuantDecodeRows<T>&) { return nullptr; }
template <typename T>
__device__ __forceinline__ int64_t prefetch_stride(const QuantDecodeRows<T>&) { return 0; }
template <typename T>
struct QuantDecodeRows {
  using Raw = QuantRaw<T>;
  static constexpr bool kPrefetch = false, kAlignedQueries = false;
  QuantHead<T> h;
  __device__ __forceinline__ Raw load(int key, int d0, int d1, bool valid) const {
    return valid ? load_quant4(h, key, d0 + d1) : Raw{0u, T(0.0f), T(0.0f)};
  }
  __device__ __forceinline__ float4 expand(const Raw& r, int col) const { return expand_quant4(r, col, h.bits); }
};

__device__ __forceinline__ float lane_of(const float4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

// c += a b on rows 0-7 of m16n8k8: c holds row g's two columns (2t,
// 2t + 1); rows 8-15 of A are zero and their results dropped, so they take
// no registers across calls.
__device__ __forceinline__ void mma_top_rows(float (&c)[2], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "{\n.reg .f32 d2, d3;\n"
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, d2, d3}, {%2, %3, %4, %5}, "
      "{%6, %7}, {%8, %9, %10, %11};\n}\n"
      : "=f"(c[0]), "=f"(c[1])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(0.0f), "f"(0.0f));
}

// A row's A fragment (slots t and t + 4 of a k-step), split for 3xTF32.
struct SplitPair {
  uint32_t hi0, lo0, hi1, lo1;
};

// c += (a_hi + a_lo) (b_hi + b_lo), the lo x lo term dropped; b0 / b1 split
// here (split_tf32: an infinite element has hi = +-inf and lo = 0).
__device__ __forceinline__ void mma_3xtf32(float (&c)[2], const SplitPair& a, float b0, float b1) {
  uint32_t h0, l0, h1, l1;
  split_tf32(b0, h0, l0);
  split_tf32(b1, h1, l1);
  mma_top_rows(c, a.lo0, a.lo1, h0, h1);
  mma_top_rows(c, a.hi0, a.hi1, l0, l1);
  mma_top_rows(c, a.hi0, a.hi1, h0, h1);
}

// The online-softmax step for row g over a chunk's scores s[nt][h] (key
// c0 + 8 nt + t + 4 h), as mma.cuh's softmax_scores does for two rows: keys
// at or past c_end hidden (only the split's last chunk has any), s becomes
// P, m / l are updated and o rescaled.
template <int NT, int NO>
__device__ __forceinline__ void softmax_row(float (&s)[NT][2], float (&o)[NO][2], float& m_i, float& l_i, int c0,
                                            int c_end, float scale_log2, int t) {
  if (c0 + 8 * NT > c_end) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (c0 + 8 * nt + t + 4 * h >= c_end) s[nt][h] = FA_NEG_INF;
  }
  // Raw scores when the scale is positive (the largest raw score times the
  // scale is the largest scaled one): each exponent one fused multiply-add.
  float mul = scale_log2;
  if (scale_log2 <= 0.0f) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] *= scale_log2, s[nt][1] *= scale_log2;
    mul = 1.0f;
  }
  float mx = FA_NEG_INF;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][0], s[nt][1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  float m_use;
  const float alpha = online_rescale<true>(m_i, mx * mul, m_use);
  float sum = 0.0f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s[nt][h] = fast_exp2(fmaf(s[nt][h], mul, -m_use));
      sum += s[nt][h];
    }
  l_i = l_i * alpha + sum;  // this thread's part; the quad sums at the end
  if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i][0] *= alpha, o[i][1] *= alpha;
  }
}

// W warps; each warp loads U chunks at once (a pass), then computes them.
// Tq: the queries' dtype (float32, or a quantized cache's 16-bit one).
template <int E, typename Tq, class KV, int W = decode_shapes::tf32_warps(E),
          int U = decode_shapes::tf32_chunks_in_flight(E), int kMergeBatch = decode_shapes::tf32_merge_batch(E)>
__device__ __forceinline__ void decode_tf32(const Tq* __restrict__ q, const KV& k_rows, const KV& v_rows,
                                            float* __restrict__ out,
                                            float* __restrict__ o_part, float* __restrict__ ml_part, bool fused,
                                            unsigned long long tag, int H_q, int H_kv, int L, int S,
                                            int keys_per_split, float scale_log2, Layout lay,
                                            const float* __restrict__ sinks = nullptr) {
  static_assert(E == 64 || E == 128, "the float32 tensor-core decode takes E = 64 or 128");
  constexpr bool kPrefetch = KV::kPrefetch;
  constexpr int KC = 1024 / E;  // keys per chunk: what the registers hold
  constexpr int NT = KC / 8, QB = E / 16, VB = E / 32, NO = 4 * VB;
  __shared__ Tf32DecodeSmem<E, W> sm;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int ratio = H_q / H_kv, R = ratio * L;  // R <= 8 (the dispatch's condition)
  const int split = blockIdx.x, kvh = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int c_begin = split * keys_per_split;
  const int c_end = min(S, c_begin + keys_per_split);
  const int key_g = (g >> 1) + 4 * (g & 1);  // the key of column g of an 8-key tile

  const ChunkWalk<float, E, W, U, KC, kTf32Ahead> walk{
      prefetch_head(k_rows), prefetch_head(v_rows), prefetch_stride(k_rows), prefetch_stride(v_rows), c_begin, c_end,
      w, lane};
  if constexpr (kPrefetch) walk.prefetch_start();

  // Row g's query fragments, split once: slot t of k-step (qb, j) is
  // element 2j of the float4 at dim 16 qb + 4t, slot t + 4 element 2j + 1.
  SplitPair qf[QB][2];
  {
    const Tq* q_row = q + lay.q.at(b, kvh * ratio + g / L, g % L);
#pragma unroll
    for (int qb = 0; qb < QB; ++qb) {
      float4 x;
      if constexpr (KV::kAlignedQueries) {
        x = load4(q_row + 16 * qb + 4 * t, g < R);
      } else {  // read once a block: element by element, so no alignment is asked
        const Tq* p = q_row + 16 * qb + 4 * t;
        x = g < R ? make_float4(to_f(p[0]), to_f(p[1]), to_f(p[2]), to_f(p[3])) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        split_tf32_query(lane_of(x, 2 * j), qf[qb][j].hi0, qf[qb][j].lo0);
        split_tf32_query(lane_of(x, 2 * j + 1), qf[qb][j].hi1, qf[qb][j].lo1);
      }
    }
  }

  float o[NO][2] = {};  // tile 4 vb + i: dims 32 vb + 4 n + i (n: the fragment's column)
  float m_i = FA_NEG_INF, l_i = 0.0f;
  for (int base = c_begin; base < c_end; base += walk.PASS) {
    if constexpr (kPrefetch) walk.prefetch_ahead(base);
    typename KV::Raw kf[U][NT][QB], vf[U][NT][2][VB];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c0 = walk.chunk_at(base, u);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int key = c0 + 8 * nt + key_g;
#pragma unroll
        for (int qb = 0; qb < QB; ++qb) kf[u][nt][qb] = k_rows.load(key, 16 * qb, 4 * t, key < c_end);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int vkey = c0 + 8 * nt + t + 4 * h;
#pragma unroll
          for (int vb = 0; vb < VB; ++vb)
            vf[u][nt][h][vb] = v_rows.load(vkey, 32 * vb, 4 * g, vkey < c_end);
        }
      }
    }
    // The group's ticket armed while the first pass's loads are in flight.
    if (fused && tid == 0 && base == c_begin) arm_group_ticket(ml_part, (int64_t)gridDim.z * H_q * L, tag);

#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c0 = walk.chunk_at(base, u);
      if (c0 >= c_end) break;  // past the split's end: this warp's later chunks too
      // S = Q K^T
      float sc[NT][2] = {};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int qb = 0; qb < QB; ++qb) {
          const float4 kx = k_rows.expand(kf[u][nt][qb], 16 * qb + 4 * t);
#pragma unroll
          for (int j = 0; j < 2; ++j) mma_3xtf32(sc[nt], qf[qb][j], lane_of(kx, 2 * j), lane_of(kx, 2 * j + 1));
        }
      // Rows at or past R have zero queries and are never stored.
      softmax_row(sc, o, m_i, l_i, c0, c_end, scale_log2, t);

      // O += P V
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        SplitPair p;
        split_tf32_query(sc[nt][0], p.hi0, p.lo0);  // P[g][key t]
        split_tf32_query(sc[nt][1], p.hi1, p.lo1);  // P[g][key t + 4]
#pragma unroll
        for (int vb = 0; vb < VB; ++vb) {
          const float4 v0 = v_rows.expand(vf[u][nt][0][vb], 32 * vb + 4 * g);
          const float4 v1 = v_rows.expand(vf[u][nt][1][vb], 32 * vb + 4 * g);
#pragma unroll
          for (int i = 0; i < 4; ++i) mma_3xtf32(o[4 * vb + i], p, lane_of(v0, i), lane_of(v1, i));
        }
      }
    }
  }

  // This warp's row g into shared memory (l summed over the quad).
  l_i += __shfl_xor_sync(0xffffffffu, l_i, 1);
  l_i += __shfl_xor_sync(0xffffffffu, l_i, 2);
  if (t == 0) sm.m[w][g] = m_i, sm.l[w][g] = l_i;
#pragma unroll
  for (int vb = 0; vb < VB; ++vb)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = 32 * vb + 4 * (2 * t + c) + i;
        sm.o[w][g][Tf32DecodeColumn{}(g, e)] = o[4 * vb + i][c];
      }
  __syncthreads();

  auto row_of = [&](int r) { return (b * H_q + kvh * ratio + r / L) * L + r % L; };
  finish_decode_block<E, kMergeBatch>(sm.o, sm.m, sm.l, R, row_of, out, o_part, ml_part,
                                      (int64_t)gridDim.z * H_q * L, fused, GroupSinks{sinks, kvh * ratio, 0, L},
                                      Tf32DecodeColumn{});
}

}  // namespace fa

// fa_decode_tf32_float32_<E>: grid (splits x threads, H_kv, batch), threads
// = 32 decode_shapes::tf32_warps(E), one split; fa_decode_tf32_fused_float32_<E>:
// several, merged in the same launch. The arguments are q, k, v (no mask
// reaches here), then the output (the fused kernel's scratch past it:
// fused_scratch in decode_combine.cuh), then scalars. -DFA_SINKS=1:
// fa_decode_tf32_sinks_*, which take the sinks (one a query head) as a
// fourth input. -DFA_QUANT=1: fa_decode_tf32q_<dtype>_<E> (and _fused_),
// queries of the unit's dtype and keys and values in MLX's affine format
// read in place, with decode_mma.cu's fa_decode_mmaq<bits>_ arguments; a float32
// output; with -DFA_SINKS=1 too, fa_decode_tf32q_sinks_*, the sinks after
// V's biases.
#if !defined(FA_E) || !defined(FA_PARTIAL)
#error "define FA_E and FA_PARTIAL"
#endif
#define FA_DECODE_TF32_THREADS (32 * fa::decode_shapes::tf32_warps(FA_E))
#if defined(FA_QUANT) && FA_QUANT
#define FA_TF32_Q FA_T
#define FA_TF32_NAME FA_TNAME
#if defined(FA_SINKS) && FA_SINKS
#define FA_SINKS_PARAM const float* sinks,
#define FA_SINKS_ARG sinks
#define FA_TF32_FAMILY fa_decode_tf32q_sinks_
#else
#define FA_SINKS_PARAM
#define FA_SINKS_ARG nullptr
#define FA_TF32_FAMILY fa_decode_tf32q_
#endif
#include "quant_args.h"
#define FA_KV_PARAMS FA_QUANT_KV_PARAMS
// This block's KV head's rows (the biases lie as the scales).
#define FA_KV_ROWS                                                                                           \
  using Rows = fa::QuantDecodeRows<FA_T>;                                                                    \
  const int64_t b = blockIdx.z;                                                                              \
  const int kvh = blockIdx.y;                                                                                \
  const int64_t ks_at = fa::Rows{ks_sb, ks_sh, ks_sr}.at(b, kvh, 0);                                         \
  const int64_t vs_at = fa::Rows{vs_sb, vs_sh, vs_sr}.at(b, kvh, 0);                                         \
  const Rows k_rows{{k + fa::Rows{k_sb, k_sh, k_sr}.at(b, kvh, 0), k_scales + ks_at, k_biases + ks_at, k_sr,  \
                     ks_sr, bits, group_shift}};                                                             \
  const Rows v_rows{{v + fa::Rows{v_sb, v_sh, v_sr}.at(b, kvh, 0), v_scales + vs_at, v_biases + vs_at, v_sr,  \
                     vs_sr, bits, group_shift}};
#else
#if FA_DTYPE != 0
#error "decode_tf32.cu takes float32"
#endif
#define FA_TF32_Q float
#define FA_TF32_NAME float32
#if defined(FA_SINKS) && FA_SINKS
#define FA_SINKS_PARAM const float* sinks,
#define FA_SINKS_ARG sinks
#define FA_TF32_FAMILY fa_decode_tf32_sinks_
#else
#define FA_SINKS_PARAM
#define FA_SINKS_ARG nullptr
#define FA_TF32_FAMILY fa_decode_tf32_
#endif
#define FA_KV_PARAMS const float *k, const float *v
#define FA_QUANT_SCALARS
#define FA_QUANT_LAYOUT
#define FA_KV_ROWS                                                 \
  using Rows = fa::F32DecodeRows;                                  \
  const int64_t b = blockIdx.z;                                    \
  const int kvh = blockIdx.y;                                      \
  const Rows k_rows{k + fa::Rows{k_sb, k_sh, k_sr}.at(b, kvh, 0), k_sr}; \
  const Rows v_rows{v + fa::Rows{v_sb, v_sh, v_sr}.at(b, kvh, 0), v_sr};
#endif
#if FA_PARTIAL == 0
extern "C" __global__ void __launch_bounds__(FA_DECODE_TF32_THREADS) FA_CAT5(FA_TF32_FAMILY, FA_TF32_NAME, _, FA_E, )(
    const FA_TF32_Q* q, FA_KV_PARAMS, FA_SINKS_PARAM float* out, int H_q, int H_kv, int L, int S,
    int keys_per_split, float scale_log2, FA_QUANT_SCALARS FA_LAYOUT_PARAMS FA_QUANT_LAYOUT) {
  FA_KV_ROWS
  fa::decode_tf32<FA_E>(q, k_rows, v_rows, out, nullptr, nullptr, false, 0, H_q, H_kv, L, S, keys_per_split,
                        scale_log2, FA_LAYOUT, FA_SINKS_ARG);
}
#else
// tag_lo, tag_hi: the call's tag, 24 bits each (decode_combine.cuh).
extern "C" __global__ void __launch_bounds__(FA_DECODE_TF32_THREADS) FA_CAT5(FA_TF32_FAMILY, fused_, FA_TF32_NAME, _, FA_E)(
    const FA_TF32_Q* q, FA_KV_PARAMS, FA_SINKS_PARAM float* out, int H_q, int H_kv, int L, int S,
    int keys_per_split, float scale_log2, FA_QUANT_SCALARS FA_LAYOUT_PARAMS FA_QUANT_LAYOUT, int tag_lo, int tag_hi) {
  FA_KV_ROWS
  const fa::FusedScratch part = fa::fused_scratch<FA_E>(out, (int64_t)gridDim.z * H_q * L);
  fa::decode_tf32<FA_E>(q, k_rows, v_rows, out, part.o_part, part.ml_part, true, fa::call_tag(tag_lo, tag_hi), H_q,
                        H_kv, L, S, keys_per_split, scale_log2, FA_LAYOUT, FA_SINKS_ARG);
}
#endif
