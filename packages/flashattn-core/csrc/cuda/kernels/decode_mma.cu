// Decode on tensor cores for float16 / bfloat16: FlashDecoding with the
// query rows of one GQA group packed into the 16 rows of mma.sync m16n8k16
// (float32 accumulation). Dispatched when no key inside the range is hidden
// (no mask, or causal with one query position) and a group has at most 16
// rows; decode.cu takes the other decode cases and float32.
//
// Grid as decode.cu's: (splits x threads, H_kv, batch). A block of W warps
// (decode_shapes.h: 8 for E = 64, 4 for E = 128) takes one (batch, KV head)
// group (ratio x L rows, the rest of the 16 zero) and one split of the keys;
// the warps walk chunks of KC keys (32 for E = 64, 16 for E = 128), U of
// them a warp at once (a pass: all U chunks' loads issued, then computed).
// K and V go from global memory straight into mma fragments, each lane
// loading 16 contiguous bytes of a row (every sector read whole, no
// shared-memory staging), the rows of the next chunks asked into L2:
//
//   S = Q K^T   lane (g, t) loads dims [32b + 8t, +8) of key g of an 8-key
//               tile. The head-dim sum runs in a permuted order (k-step
//               (b, j): slot 2t + i is dim 32b + 8t + 4j + i, slot 2t + 8 + i
//               is dim 32b + 8t + 4j + 2 + i); the query fragments use the same.
//   softmax     online, on the accumulators (rows g and g + 8 per thread)
//   O += P V    P re-packed from S as the A operand; lane (g, t) loads dims
//               [64d + 8g, +8) of keys 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-key
//               step and pairs them into B fragments, so output dim
//               64d + 8n + i lands in tile i, column n.
//
// Quantized keys and values (kernels fa_decode_mmaq4_* and fa_decode_mmaq8_*,
// MLX's affine format) go the same way, but a lane loads a contiguous run of
// each row (a quarter of a key's dims; an eighth of a value's at E = 128,
// o's dims put back in order at the end) in one or two loads with its
// group's scale and bias, and expands it to 16-bit values in registers just
// before the product (decode_rows.cuh).
//
// Keys past the split's end load as zeros (P = 0 multiplies only zeros), so
// no hidden value reaches a row. The warps' (m, l, o) are combined through
// shared memory (decode_combine.cuh).
//
// Float32 attention over 16-bit inputs (kF32, fa_decode_mma32_*: what the
// patch's default asks of a 16-bit model, without casting K and V to float32
// first): the scores are already float32-exact (16-bit products are exact in
// float32 and accumulate in float32); P goes into P V not rounded to 16 bits
// but as PSplit's terms (mma.cuh), whose sum is P to float32 accuracy; the output is
// float32.

#include "decode_combine.cuh"
#include "decode_rows.cuh"
#include "decode_shapes.h"
#include "decode_walk.cuh"
#include "mma.cuh"
#include "unit.cuh"

namespace fa {

constexpr int kMmaAhead = 2;  // chunks ahead of the current one asked into L2 (U = 1)

template <int E, int W>
struct MmaDecodeSmem {
  float o[W][16][E];
  float m[W][16], l[W][16];
};

__device__ __forceinline__ uint32_t word(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// Element i of u and element i of v (16-bit each), as one B register: u's in
// the low half (the lower k slot).
__device__ __forceinline__ uint32_t pair(const uint4& u, const uint4& v, int i) {
  return __byte_perm(word(u, i >> 1), word(v, i >> 1), (i & 1) ? 0x7632 : 0x5410);
}

// The column where a warp leaves dim e of row r of its o in shared memory:
// e XOR-swizzled within its block of 16 so that the warp's 32 stores of one
// accumulator register (rows g, g + 8; dims 64 db + 16 t + 8 (c & 1) + i)
// fall in 32 banks. Unswizzled, the 8 rows g of a lane column hit one bank
// (16-way conflicts).
struct MmaDecodeColumn {
  __device__ __forceinline__ int operator()(int r, int e) const { return e ^ (2 * (r & 7) + ((e >> 5) & 1)); }
};

// W warps; each warp loads U chunks at once (a pass), then computes them.
// KV: where K and V rows come from (decode_rows.cuh: plain, or quantized
// and read in place); kNextPass: each pass asks the next into L2 (plain rows
// only); the loads' L2 hint is KV's (decode_shapes.h says where each pays).
// kF32: float32 attention (above), the output float32.
template <typename T, bool kF32, int E, typename KV, int W = decode_shapes::mma_warps(E),
          int U = decode_shapes::mma_chunks_in_flight(E),
          bool kNextPass = decode_shapes::mma_prefetch_next_pass(E) && KV::kPrefetch,
          int kMergeBatch = decode_shapes::mma_merge_batch(E), typename TO = std::conditional_t<kF32, float, T>>
__device__ __forceinline__ void decode_mma(const T* __restrict__ q, const KV k_rows, const KV v_rows,
                                           TO* __restrict__ out, float* __restrict__ o_part,
                                           float* __restrict__ ml_part, bool fused, unsigned long long tag, int H_q,
                                           int H_kv, int L, int S, int keys_per_split, float scale_log2,
                                           Layout lay, const float* __restrict__ sinks = nullptr) {
  static_assert(E == 64 || E == 128, "tensor-core decode takes E = 64 or 128");
  constexpr int KC = 2048 / E;  // keys per chunk: what the registers hold
  constexpr int NT = KC / 8, KB = E / 32, KS = KC / 16, DB = E / 64, NO = 8 * DB;
  __shared__ MmaDecodeSmem<E, W> sm;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int ratio = H_q / H_kv, R = ratio * L;  // R <= 16 (the dispatch's condition)
  const int split = blockIdx.x, kvh = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int c_begin = split * keys_per_split;
  const int c_end = min(S, c_begin + keys_per_split);
  auto q_row = [&](int r) { return q + lay.q.at(b, kvh * ratio + r / L, r % L); };

  const ChunkWalk<T, E, W, U, KC, kMmaAhead, kNextPass> walk{k_rows.prefetch_head(), v_rows.prefetch_head(),
                                                            k_rows.prefetch_stride(), v_rows.prefetch_stride(),
                                                            c_begin, c_end, w, lane};
  walk.prefetch_start();

  // Query fragments of rows g and g + 8 (zeros past R), per 32-dim block, in
  // the order K's expanded fragments hold their dims (arrange_query).
  uint4 qa[KB], qb[KB];
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    const int dim = KV::template key_dim<KB>(kb, t);
    qa[kb] = k_rows.arrange_query(load_query<KV::kAlignedQueries>(q_row(g) + dim, g < R));
    qb[kb] = k_rows.arrange_query(load_query<KV::kAlignedQueries>(q_row(g + 8) + dim, g + 8 < R));
  }

  // tile 8 db + i, column n: output dim KV::out_dim(db, n, i) (plain rows:
  // 64 db + 8 n + element_dim(i))
  float o[NO][4] = {};
  float m_i[2] = {FA_NEG_INF, FA_NEG_INF}, l_i[2] = {0.0f, 0.0f};
  for (int base = c_begin; base < c_end; base += walk.PASS) {
    walk.prefetch_ahead(base);
    typename KV::Raw kf[U][NT][KB], vf[U][KS][4][DB];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c0 = walk.chunk_at(base, u);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int key = c0 + 8 * nt + g;
        k_rows.template load_keys<KB>(key, t, key < c_end, kf[u][nt]);
      }
#pragma unroll
      for (int s = 0; s < KS; ++s) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = c0 + 16 * s + 2 * t + (j & 1) + (j >> 1) * 8;
          v_rows.template load_values<DB>(key, g, key < c_end, vf[u][s][j]);
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
      float sc[NT][4] = {};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
          const uint4 kx = k_rows.expand(kf[u][nt][kb]);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const uint32_t a[4] = {word(qa[kb], 2 * j), word(qb[kb], 2 * j), word(qa[kb], 2 * j + 1),
                                   word(qb[kb], 2 * j + 1)};
            mma16816<T>(sc[nt], a, word(kx, 2 * j), word(kx, 2 * j + 1));
          }
        }
      }
      // Online softmax (softmax.cuh): keys past the split's end and rows past R hidden.
      const Mask none{kNone, nullptr, nullptr, 0, 0, 0, 0};
      softmax_step<NT, NO>(sc, o, m_i, l_i, none, 0, g, R, c_end, c0, scale_log2, c0 + KC > c_end, lane);

      // O += P V: P of keys 16 s .. 16 s + 15 as the A operand (pairs of
      // sc[2 s], then sc[2 s + 1]), in 16 bits or (kF32) as PSplit's terms.
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        // V's fragments expanded where used (quantized rows are not float32
        // attention: one term, so each is expanded once).
        auto p_times_v = [&](const uint32_t (&a)[4]) {
#pragma unroll
          for (int db = 0; db < DB; ++db) {
            uint4 vx[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) vx[j] = v_rows.expand(vf[u][s][j][db]);
#pragma unroll
            for (int i = 0; i < 8; ++i)
              mma16816<T>(o[8 * db + i], a, pair(vx[0], vx[1], i), pair(vx[2], vx[3], i));
          }
        };
        float p[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) p[j] = sc[2 * s + (j >> 2)][j & 3] * (kF32 ? PSplit<T>::kScale : 1.0f);
        constexpr int kTerms = kF32 ? PSplit<T>::kTerms : 1;
#pragma unroll
        for (int term = 0; term < kTerms; ++term) {
          uint32_t a[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            a[j] = pack2<T>(p[2 * j], p[2 * j + 1]);
            if (term + 1 < kTerms) p[2 * j] -= unpack_half<T>(a[j], 0), p[2 * j + 1] -= unpack_half<T>(a[j], 1);
          }
          p_times_v(a);
        }
      }
    }
  }

  if constexpr (kF32 && PSplit<T>::kScale != 1.0f) {
#pragma unroll
    for (int i = 0; i < NO; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[i][c] *= 1.0f / PSplit<T>::kScale;
  }
  // This warp's rows g and g + 8 into shared memory (l summed over the quad).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l_i[rr] += __shfl_xor_sync(0xffffffffu, l_i[rr], 1);
    l_i[rr] += __shfl_xor_sync(0xffffffffu, l_i[rr], 2);
    if (t == 0) sm.m[w][g + 8 * rr] = m_i[rr], sm.l[w][g + 8 * rr] = l_i[rr];
  }
#pragma unroll
  for (int db = 0; db < DB; ++db)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = g + 8 * (c >> 1), e = v_rows.template out_dim<DB>(db, 2 * t + (c & 1), i);
        sm.o[w][r][MmaDecodeColumn{}(r, e)] = o[8 * db + i][c];
      }
  __syncthreads();

  auto row_of = [&](int r) { return (b * H_q + kvh * ratio + r / L) * L + r % L; };
  finish_decode_block<E, kMergeBatch>(sm.o, sm.m, sm.l, R, row_of, out, o_part, ml_part,
                                      (int64_t)gridDim.z * H_q * L, fused, GroupSinks{sinks, kvh * ratio, 0, L},
                                      MmaDecodeColumn{});
}

}  // namespace fa

// fa_decode_mma_<dtype>_<E>: grid (splits x threads, H_kv, batch), threads =
// 32 decode_shapes::mma_warps(E), one split;
// fa_decode_mma_fused_<dtype>_<E>: several splits, merged in the same launch.
// -DFA_F32=1: fa_decode_mma32_<dtype>_<E> and fa_decode_mma32_fused_<dtype>_<E>,
// float32 attention (kF32 above) and a float32 output. The arguments are
// q, k, v (no mask reaches here), then the output (the fused kernel's
// scratch past it), then scalars. -DFA_SINKS=1: fa_decode_mma_sinks_* and
// fa_decode_mma32_sinks_*, which take the sinks (float32, one a query head)
// as a fourth input. -DFA_QUANT=1 -DFA_QUANT_BITS=4|8: fa_decode_mmaq4_* and
// fa_decode_mmaq8_*, keys and values in MLX's affine format of those bits
// read in place (decode_rows.cuh; the bits compiled in: with them a launch
// argument, both expansions sat in the loop, and hd128's decode over 32K
// keys took 1.2x the time): the arguments are q,
// K's and V's packed codes, K's scales and biases, V's, then the output,
// the scalars with bits and log2(group size) after the scale, the layout
// (K's and V's rows: the packed codes', in words) and the scales' rows
// (the biases lie alike); not float32 attention. -DFA_QUANT=1 -DFA_SINKS=1:
// fa_decode_mmaq<bits>_sinks_*, the sinks after V's biases (the bits
// argument stays, unread).
#if !defined(FA_E) || !defined(FA_PARTIAL)
#error "define FA_E and FA_PARTIAL"
#endif
#if FA_DTYPE == 0
#error "decode_mma.cu takes float16 or bfloat16"
#endif
#if defined(FA_SINKS) && FA_SINKS
#define FA_SINKS_PARAM const float* sinks,
#define FA_SINKS_ARG sinks
#define FA_SINKS_NAME sinks_
#else
#define FA_SINKS_PARAM
#define FA_SINKS_ARG nullptr
#define FA_SINKS_NAME
#endif
#if defined(FA_F32) && FA_F32
#define FA_MMA_F32 true
#define FA_MMA_FAMILY FA_CAT3(fa_decode_mma32_, FA_SINKS_NAME, )
#define FA_MMA_OUT float
#elif defined(FA_QUANT) && FA_QUANT
#if !defined(FA_QUANT_BITS) || (FA_QUANT_BITS != 4 && FA_QUANT_BITS != 8)
#error "define FA_QUANT_BITS as 4 or 8"
#endif
#define FA_MMA_F32 false
#define FA_MMA_FAMILY FA_CAT5(fa_decode_mmaq, FA_QUANT_BITS, _, FA_SINKS_NAME, )
#define FA_MMA_OUT FA_T
#else
#define FA_MMA_F32 false
#define FA_MMA_FAMILY FA_CAT3(fa_decode_mma_, FA_SINKS_NAME, )
#define FA_MMA_OUT FA_T
#endif
#define FA_DECODE_MMA_THREADS (32 * fa::decode_shapes::mma_warps(FA_E))
constexpr bool kFetch256 = fa::decode_shapes::mma_fetch_256(FA_E);  // the K / V loads' L2 hint
#if defined(FA_QUANT) && FA_QUANT
#include "quant_args.h"
#define FA_KV_PARAMS FA_QUANT_KV_PARAMS
// This block's KV head's rows (the biases lie as the scales).
#define FA_KV_ROWS                                                                                       \
  using Rows = fa::QuantRows16<FA_T, kFetch256, FA_QUANT_BITS>;                                          \
  const int64_t b = blockIdx.z;                                                                          \
  const int kvh = blockIdx.y;                                                                            \
  const int64_t ks_at = fa::Rows{ks_sb, ks_sh, ks_sr}.at(b, kvh, 0);                                     \
  const int64_t vs_at = fa::Rows{vs_sb, vs_sh, vs_sr}.at(b, kvh, 0);                                     \
  const Rows k_rows{k + fa::Rows{k_sb, k_sh, k_sr}.at(b, kvh, 0), k_scales + ks_at, k_biases + ks_at, k_sr, \
                    ks_sr, group_shift};                                                                 \
  const Rows v_rows{v + fa::Rows{v_sb, v_sh, v_sr}.at(b, kvh, 0), v_scales + vs_at, v_biases + vs_at, v_sr, \
                    vs_sr, group_shift};
#else
#define FA_KV_PARAMS const FA_T *k, const FA_T *v
#define FA_QUANT_SCALARS
#define FA_QUANT_LAYOUT
#define FA_KV_ROWS                                                         \
  using Rows = fa::PlainRows16<FA_T, kFetch256>;                           \
  const int64_t b = blockIdx.z;                                            \
  const int kvh = blockIdx.y;                                              \
  const Rows k_rows{k + fa::Rows{k_sb, k_sh, k_sr}.at(b, kvh, 0), k_sr}; \
  const Rows v_rows{v + fa::Rows{v_sb, v_sh, v_sr}.at(b, kvh, 0), v_sr};
#endif
#if FA_PARTIAL == 0
extern "C" __global__ void __launch_bounds__(FA_DECODE_MMA_THREADS) FA_CAT5(FA_MMA_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, FA_KV_PARAMS, FA_SINKS_PARAM FA_MMA_OUT* out, int H_q, int H_kv, int L, int S,
    int keys_per_split, float scale_log2, FA_QUANT_SCALARS FA_LAYOUT_PARAMS FA_QUANT_LAYOUT) {
  FA_KV_ROWS
  fa::decode_mma<FA_T, FA_MMA_F32, FA_E, Rows>(q, k_rows, v_rows, out, nullptr, nullptr, false, 0, H_q, H_kv, L, S,
                                               keys_per_split, scale_log2, FA_LAYOUT, FA_SINKS_ARG);
}
#else
// The fused kernel (at most kFusedMaxSplits splits): its one output holds the
// attention output, then the splits' partials and tickets (fused_scratch in
// decode_combine.cuh). tag_lo, tag_hi: the call's tag, 24 bits each.
extern "C" __global__ void __launch_bounds__(FA_DECODE_MMA_THREADS) FA_CAT5(FA_MMA_FAMILY, fused_, FA_TNAME, _, FA_E)(
    const FA_T* q, FA_KV_PARAMS, FA_SINKS_PARAM FA_MMA_OUT* out, int H_q, int H_kv, int L, int S,
    int keys_per_split, float scale_log2, FA_QUANT_SCALARS FA_LAYOUT_PARAMS FA_QUANT_LAYOUT, int tag_lo,
    int tag_hi) {
  FA_KV_ROWS
  const fa::FusedScratch part = fa::fused_scratch<FA_E>(out, (int64_t)gridDim.z * H_q * L);
  fa::decode_mma<FA_T, FA_MMA_F32, FA_E, Rows>(q, k_rows, v_rows, out, part.o_part, part.ml_part, true,
                                               fa::call_tag(tag_lo, tag_hi), H_q, H_kv, L, S, keys_per_split,
                                               scale_log2, FA_LAYOUT, FA_SINKS_ARG);
}
#endif
