// FlashAttention-2 forward for float32 inputs at float32 accuracy, on TF32
// tensor cores with the 3xTF32 split (mma.sync m16n8k8): every operand x is
// split into TF32 parts hi + lo and each product is hi*hi + hi*lo + lo*hi,
// which recovers float32's accuracy (~1e-6) at 3x the tensor work, still far
// above float32 FMA speed. One unit per E.
//
// Same blocking as prefill_f16.cu: 4 warps x 16 query rows, key/value tiles
// of 64 through shared memory (at E = 256 tiles of 32, V copied over K once
// Q K^T is done: tf32_shapes.h). Float32 rows are padded (Q, K by 4 floats,
// V by 8) so the scalar fragment loads below hit 32 different banks. P moves
// from the accumulator layout to the A-operand layout by quad shuffles.

#include "kv_rows.cuh"
#include "mma.cuh"
#include "pv_fma.cuh"
#include "tf32_shapes.h"
#include "unit.cuh"

namespace fa {

template <int E>
struct Tf32Smem {
  static constexpr int LDQ = tf32_shapes::ld_qk(E), LDV = tf32_shapes::ld_v(E), BC = tf32_shapes::keys(E);
  static constexpr int BR = tf32_shapes::rows(E), THREADS = tf32_shapes::threads(E);
  static constexpr bool SHARED_KV = tf32_shapes::shared_kv(E);
  float q[BR * LDQ];
  float kv[tf32_shapes::kv_floats(E)];  // K's tile, then V's (or V's over K's: SHARED_KV)
  __device__ __forceinline__ float* k() { return kv; }
  __device__ __forceinline__ float* v() { return SHARED_KV ? kv : kv + BC * LDQ; }
};
static_assert(sizeof(Tf32Smem<128>) == tf32_shapes::smem_bytes(128) &&
                  sizeof(Tf32Smem<256>) == tf32_shapes::smem_bytes(256),
              "the planner's shared memory");

template <int E, class Src>
__device__ __forceinline__ void prefill_tf32(const Src& src, const void* mask_data,
                                             const int64_t* __restrict__ mask_base,
                                             float* __restrict__ out, float* __restrict__ lse, int H_q, int H_kv, int L, int S,
                                             int mask_kind, int mask_rs, int mask_cs, float scale_log2) {
  using Smem = Tf32Smem<E>;
  constexpr int LDQ = Smem::LDQ, LDV = Smem::LDV, kBr32 = Smem::BR, kBc32 = Smem::BC, NB = kBc32 / 8, NO = E / 8;
  constexpr int kThreads32 = Smem::THREADS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const PrefillBlock blk(kBr32, H_q, H_kv, L, S, mask_kind, mask_cs);
  const int64_t n = blk.n;
  const int l0 = blk.l0, kv_end = blk.kv_end;
  const typename Src::Head rows = src.head(blk);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};

  rows.template load_q<E, LDQ, kBr32, kThreads32>(sm.q, l0, min(kBr32, L - l0), tid);
  cp_async_commit();

  const int ra = l0 + w * 16 + g;
  // The warp's query fragments (A operand: rows g, g + 8; columns 8 kk + t,
  // + 4). split_tf32_query costs more than split_tf32: for E = 64 they are
  // split once and kept in registers, which beat splitting them per key
  // tile; at E = 128 the registers spill, so larger E split per tile.
  constexpr bool kQInRegs = E <= 64;
  uint32_t qh[kQInRegs ? E / 8 : 1][4], ql[kQInRegs ? E / 8 : 1][4];
  const float* qw = sm.q + (w * 16) * LDQ;
  auto split_query = [&](int kk, uint32_t (&ah)[4], uint32_t (&al)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      split_tf32_query(qw[(g + (i & 1) * 8) * LDQ + kk * 8 + t + (i >> 1) * 4], ah[i], al[i]);
  };
  if constexpr (kQInRegs) {
    cp_async_wait_all();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < E / 8; ++kk) split_query(kk, qh[kk], ql[kk]);
  }

  float o[NO][4] = {};
  float m_i[2] = {FA_NEG_INF, FA_NEG_INF}, l_i[2] = {0.0f, 0.0f};

  for (int c0 = blk.kv_begin / kBc32 * kBc32; c0 < kv_end; c0 += kBc32) {
    const int count = min(kBc32, S - c0);
    float* const k_tile = sm.k();
    float* const v_tile = sm.v();
    rows.template load_k<E, LDQ, kBc32, kThreads32>(k_tile, c0, count, tid);
    if constexpr (!Smem::SHARED_KV) rows.template load_v<E, LDV, kBc32, kThreads32>(v_tile, c0, count, tid);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();

    float s[NB][4] = {};
    auto qk_step = [&](int kk, const uint32_t (&ah)[4], const uint32_t (&al)[4]) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        uint32_t bh0, bl0, bh1, bl1;
        split_tf32(k_tile[(nb * 8 + g) * LDQ + kk * 8 + t], bh0, bl0);
        split_tf32(k_tile[(nb * 8 + g) * LDQ + kk * 8 + t + 4], bh1, bl1);
        mma1688_tf32(s[nb], al, bh0, bh1);
        mma1688_tf32(s[nb], ah, bl0, bl1);
        mma1688_tf32(s[nb], ah, bh0, bh1);
      }
    };
    if constexpr (kQInRegs) {
#pragma unroll
      for (int kk = 0; kk < E / 8; ++kk) qk_step(kk, qh[kk], ql[kk]);
    } else {
#pragma unroll 2
      for (int kk = 0; kk < E / 8; ++kk) {
        uint32_t ah[4], al[4];
        split_query(kk, ah, al);
        qk_step(kk, ah, al);
      }
    }
    if constexpr (Smem::SHARED_KV) {  // V over K once every warp is done with K, copied during the softmax
      __syncthreads();
      rows.template load_v<E, LDV, kBc32, kThreads32>(v_tile, c0, count, tid);
      cp_async_commit();
    }
    const bool need_mask = mask.tile_hides(c0, kBc32, l0, kBr32, S);
    softmax_step<NB, NO>(s, o, m_i, l_i, mask, n, ra, L, S, c0, scale_log2, need_mask, lane);
    if constexpr (Smem::SHARED_KV) {
      cp_async_wait_all();
      __syncthreads();
    }

    // Rare path: values that are +-inf (a product's low-part term would make
    // 0 x inf = NaN of them wherever P's low part is 0, as at a row's
    // maximum), or NaN where some row cannot see them.
    bool bad = false;
    for (int idx = tid; idx < count * E; idx += kThreads32) {
      const float x = v_tile[(idx / E) * LDV + idx % E];
      bad |= fabsf(x) == INFINITY || (need_mask && isnan(x));
    }
    const bool guard = __syncthreads_or(bad);

    if (guard) {
      add_pv_fma<NB, NO>(o, s, [&](int c, int e) { return v_tile[c * LDV + e]; }, mask, n, ra, L, S, c0, count, lane);
    } else {
      // P V in a fresh accumulator, added to o in float32 (mma.cuh's
      // add_fresh): the tile's up to E = 128; above, each 8 keys' (the
      // tile's would not fit in registers beside o).
      constexpr bool kTileSum = NO <= 16;
      float pv[kTileSum ? NO : 1][4] = {};  // unused above E = 128
#pragma unroll
      for (int kb = 0; kb < NB; ++kb) {
        // P (keys 8kb..8kb+7) from the accumulator layout to the A layout.
        float x[4];
        accumulator_to_a<NB>(s, kb, lane, x);
        uint32_t ah[4], al[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) split_tf32(x[i], ah[i], al[i]);
#pragma unroll
        for (int eb = 0; eb < NO; ++eb) {
          uint32_t bh0, bl0, bh1, bl1;
          split_tf32(v_tile[(kb * 8 + t) * LDV + eb * 8 + g], bh0, bl0);
          split_tf32(v_tile[(kb * 8 + t + 4) * LDV + eb * 8 + g], bh1, bl1);
          auto products = [&](float (&acc)[4]) {
            mma1688_tf32(acc, al, bh0, bh1);
            mma1688_tf32(acc, ah, bl0, bl1);
            mma1688_tf32(acc, ah, bh0, bh1);
          };
          if constexpr (kTileSum) {
            products(pv[eb]);
          } else {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            products(c);
            add_fresh(o[eb], c);
          }
        }
      }
      if constexpr (kTileSum) {
#pragma unroll
        for (int eb = 0; eb < NO; ++eb) add_fresh(o[eb], pv[eb]);
      }
    }
    __syncthreads();
  }

  store_rows<float, NO>(o, m_i, l_i, sink_log2(mask_kind, mask_base, int(n % H_q)),
                        out_rows(out, src.lay.o, n, H_q, L, lse_of(mask_kind, lse)), L, E, ra, t);
}

}  // namespace fa

// fa_prefill_float32_<E>: outputs the attention output and each row's log-sum-exp
// (written where mask_kind has kLse: mask_bits.h). -DFA_QUANT=1:
// fa_prefill_tf32q_<dtype>_<E>, queries of the unit's dtype and keys and
// values in MLX's affine format read in place (quant_args.h's arguments;
// float32 outputs).
#if !defined(FA_E)
#error "define FA_E"
#endif
#if defined(FA_QUANT) && FA_QUANT
#include "quant_args.h"
extern "C" __global__ void __launch_bounds__(fa::Tf32Smem<FA_E>::THREADS)
    FA_CAT5(fa_prefill_tf32q_, FA_TNAME, _, FA_E, )(FA_QUANT_PREFILL_PARAMS) {
  fa::prefill_tf32<FA_E>(FA_QUANT_PREFILL_ROWS, mask, mask_base, out, lse, H_q, H_kv, L, S, mask_kind, mask_rs,
                         mask_cs, scale_log2);
}
#else
#if FA_DTYPE != 0
#error "prefill_tf32.cu takes float32"
#endif
extern "C" __global__ void __launch_bounds__(fa::Tf32Smem<FA_E>::THREADS) FA_CAT3(fa_prefill_float32_, FA_E, )(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base,
    float* out, float* lse, int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs,
    float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_tf32<FA_E>(fa::Tf32Rows{q, k, v, FA_LAYOUT}, mask, mask_base, out, lse, H_q, H_kv, L, S, mask_kind,
                         mask_rs, mask_cs, scale_log2);
}
#endif
