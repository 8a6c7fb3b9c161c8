// FlashAttention-2 forward for float32 at float32 accuracy, E = 80, 96 and
// 128, where a block may take 133-208 KB (tf32_shapes.h): prefill_tf32.cu's
// 3xTF32 products on mma.sync m16n8k8, with each K and V element split into
// TF32 parts once per block instead of once for every warp that reads it.
//
// prefill_tf32.cu (4 warps x 16 rows over raw float32 tiles) issues about 8
// instructions per mma.sync (Nsight Compute): every warp splits each K and
// V element it uses, after a scalar shared-memory load. Here 8 warps x 16
// rows share 64-key tiles, which the block loads, splits and stores with
// the high and low parts side by side, in the order the fragments are read,
// so that one 16-byte load gives a product's two B registers in both parts:
//   - K, row c: per pair of head-dim columns (e, e + 1), e even, (hi e,
//     hi e + 1, lo e, lo e + 1) at 2e. Step kk of S = Q K^T takes column
//     8 kk + 2t as its k slot t and 8 kk + 2t + 1 as slot t + 4 (a sum's
//     order is free); Q's A fragment takes the same columns, a pair of raw
//     floats from its row, split in registers.
//   - V^T, row e: per pair of keys (c, c + 1), c even, (hi c, hi c + 1,
//     lo c, lo c + 1) at 2c. Step kb of P V takes key 8 kb + 2t as slot t
//     and 8 kb + 2t + 1 as slot t + 4: the keys that S's accumulator leaves
//     in each thread, so P enters the A operand without shuffles.
// Two barriers a tile: every warp is done with the tile before the next is
// stored over it, and the next is stored before any warp reads it. (Loading
// the next tile into registers during the products gained nothing, 8.99
// against 8.97 ms at hd128 causal 8K on an H100, prefill-pairs-probe.cu, and
// cost 64 registers and a spill.)

#include "mma.cuh"
#include "pv_fma.cuh"
#include "tf32_shapes.h"
#include "unit.cuh"

namespace fa {

namespace tp = tf32_shapes::pairs;

template <int E>
struct PairsSmem {
  static constexpr int LDQ = tp::ld_q(E), LDK = tp::ld_k(E);
  float q[tp::kRows * LDQ];      // Q as it is
  float k[tp::kKeys * LDK];      // K, (hi, hi, lo, lo) a column pair
  float vt[E * tp::kLdVt];       // V^T, (hi, hi, lo, lo) a key pair
};
static_assert(sizeof(PairsSmem<80>) == tp::smem_bytes(80) && sizeof(PairsSmem<96>) == tp::smem_bytes(96) &&
                  sizeof(PairsSmem<128>) == tp::smem_bytes(128),
              "the planner's shared memory");

// Where x's high part lies in a row of (hi, hi, lo, lo) pairs; its low part
// is 2 further.
__device__ __forceinline__ int pair_at(int x) { return 2 * (x & ~1) + (x & 1); }

// (hi, hi, lo, lo) of the pairs (a, b) and (c, d), in that order, stored at
// row + at and row + at + 4, the first store at row + at + 4 first_b where
// first_b says so: lanes whose rows differ in bank by 16 then start on
// different halves, and a 16-byte store of 8 lanes hits 32 banks.
__device__ __forceinline__ void store_pairs(float* row, int at, const float (&x)[4], bool first_b) {
  uint32_t h[4], l[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) split_tf32(x[j], h[j], l[j]);
  const float4 a = make_float4(__uint_as_float(h[0]), __uint_as_float(h[1]), __uint_as_float(l[0]),
                               __uint_as_float(l[1]));
  const float4 b = make_float4(__uint_as_float(h[2]), __uint_as_float(h[3]), __uint_as_float(l[2]),
                               __uint_as_float(l[3]));
  *reinterpret_cast<float4*>(row + at + (first_b ? 4 : 0)) = first_b ? b : a;
  *reinterpret_cast<float4*>(row + at + (first_b ? 0 : 4)) = first_b ? a : b;
}

// c += a b in 3xTF32 (lo hi + hi lo + hi hi): a split in registers, b's two
// registers as (hi, hi, lo, lo) at `pair`, one 16-byte load.
__device__ __forceinline__ void mma_pairs(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                          const float* pair) {
  const float4 b = *reinterpret_cast<const float4*>(pair);
  const uint32_t bh0 = __float_as_uint(b.x), bh1 = __float_as_uint(b.y);
  mma1688_tf32(c, al, bh0, bh1);
  mma1688_tf32(c, ah, __float_as_uint(b.z), __float_as_uint(b.w));
  mma1688_tf32(c, ah, bh0, bh1);
}

// One thread's part of a K tile (64 keys x E columns as float4), in
// registers between its load and its split. 8 lanes take 4 float4 of each
// of two rows (lane bits 0, 1: the float4, bit 2: the row): a 16-byte store
// of theirs meets every bank, and each row is read 64 contiguous bytes at a
// time from global memory. Unit u (lane bits 3, 4 and the warp's piece
// i * 8 + w) is row pair u / (E / 16), float4 4 (u % (E / 16)) on.
template <int E>
struct KPairs {
  static constexpr int N = tp::kKeys * E / 4 / tp::kThreads, kUnitsARow = E / 16;
  static_assert(tp::kKeys * E / 4 % tp::kThreads == 0, "the tile divides over the block");
  float x[N][4];

  // (unsigned: a power-of-two divisor then takes a shift)
  __device__ __forceinline__ static unsigned unit(int i, int w, int lane) {
    return unsigned((i * 8 + w) * 4 + (lane >> 3));
  }
  __device__ __forceinline__ static int row(int i, int w, int lane) {
    return int(unit(i, w, lane) / kUnitsARow) * 2 + ((lane >> 2) & 1);
  }
  __device__ __forceinline__ static int col(int i, int w, int lane) {
    return (int(unit(i, w, lane) % kUnitsARow) * 4 + (lane & 3)) * 4;
  }
  // Keys first.. of src (row stride `stride`), zeros from count on.
  __device__ __forceinline__ void load(const float* src, int64_t stride, int first, int count, int w, int lane) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int r = row(i, w, lane);
      const float4 v = r < count ? *reinterpret_cast<const float4*>(src + (first + r) * stride + col(i, w, lane))
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      x[i][0] = v.x, x[i][1] = v.y, x[i][2] = v.z, x[i][3] = v.w;
    }
  }
  __device__ __forceinline__ void store(float* k_s, int w, int lane) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int r = row(i, w, lane);
      store_pairs(k_s + r * PairsSmem<E>::LDK, 2 * col(i, w, lane), x[i], r & 1);
    }
  }
};

// One thread's part of a V tile: 4 consecutive keys of one column, E / 16
// times (E columns x 16 key quads). Piece p = i * 8 + warp covers 8 columns
// (block p % (E / 8)) x 4 quads (block p / (E / 8)): lane bits 0, 3, 4 pick
// the column (32 contiguous bytes a key row from global memory), bits 1, 2
// the quad.
template <int E>
struct VPairs {
  static constexpr int N = E * tp::kKeys / 4 / tp::kThreads;
  static_assert(E * tp::kKeys / 4 % tp::kThreads == 0, "the tile divides over the block");
  float x[N][4];

  __device__ __forceinline__ static int col(int i, int w, int lane) {
    return int(unsigned(i * 8 + w) % (E / 8)) * 8 + (lane & 1) + ((lane >> 3) << 1);
  }
  __device__ __forceinline__ static int quad(int i, int w, int lane) {
    return int(unsigned(i * 8 + w) / (E / 8)) * 4 + ((lane >> 1) & 3);
  }
  __device__ __forceinline__ void load(const float* src, int64_t stride, int first, int count, int w, int lane) {
    const bool full = count >= tp::kKeys;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = col(i, w, lane), c = quad(i, w, lane) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) x[i][j] = full || c + j < count ? src[(first + c + j) * stride + e] : 0.0f;
    }
  }
  // bad: set when a value is +-inf, or not finite in a tile with hidden
  // keys (masked): the rare path (pv_fma.cuh).
  __device__ __forceinline__ void store(float* vt_s, int w, int lane, bool masked, bool& bad) const {
    float big = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = col(i, w, lane);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (masked) bad |= !isfinite(x[i][j]);
        big = fmaxf(big, fabsf(x[i][j]));
      }
      store_pairs(vt_s + e * tp::kLdVt, 8 * quad(i, w, lane), x[i], e & 1);
    }
    bad |= big == INFINITY;
  }
};

template <int E>
__device__ __forceinline__ void prefill_tf32_pairs(const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ v, const void* mask_data,
                                                   const int64_t* __restrict__ mask_base, float* __restrict__ out,
                                                   float* __restrict__ lse, int H_q, int H_kv, int L, int S,
                                                   int mask_kind, int mask_rs, int mask_cs, float scale_log2,
                                                   Layout lay) {
  constexpr int BR = tp::kRows, BC = tp::kKeys, NB = BC / 8, NO = E / 8;
  using Smem = PairsSmem<E>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const PrefillBlock blk(BR, H_q, H_kv, L, S, mask_kind, mask_cs);
  const int64_t n = blk.n;
  const int l0 = blk.l0;
  const float* k_head = k + lay.k.at(blk.b, blk.g, 0);
  const float* v_head = v + lay.v.at(blk.b, blk.g, 0);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};

  {
    const float* q_rows = q + lay.q.at(blk.b, blk.h, 0);
    const int count = min(BR, L - l0);
    for (int idx = tid; idx < BR * E / 4; idx += tp::kThreads) {
      const int r = idx / (E / 4), c4 = idx % (E / 4);
      const bool valid = r < count;
      cp_async16(sm.q + r * Smem::LDQ + c4 * 4, valid ? q_rows + int64_t(l0 + r) * lay.q.sr + c4 * 4 : q_rows, valid);
    }
    cp_async_commit();
  }

  const int c_begin = blk.kv_begin / BC * BC;
  const int tiles = c_begin < blk.kv_end ? (blk.kv_end - c_begin + BC - 1) / BC : 0;
  KPairs<E> kt;
  VPairs<E> vt;
  auto load = [&](int c0) {
    const int count = min(BC, S - c0);
    kt.load(k_head, lay.k.sr, c0, count, w, lane);
    vt.load(v_head, lay.v.sr, c0, count, w, lane);
  };
  auto store = [&](int c0) {
    bool bad = false;
    kt.store(sm.k, w, lane);
    vt.store(sm.vt, w, lane, mask.tile_hides(c0, BC, l0, BR, S), bad);
    return bad;
  };
  bool bad = false;
  if (tiles > 0) {
    load(c_begin);
    bad = store(c_begin);
  }
  cp_async_wait_all();
  bool guard = __syncthreads_or(bad);

  const int ra = l0 + w * 16 + g;
  const float* q_a = sm.q + (w * 16 + g) * Smem::LDQ + 2 * t;  // row g; row g + 8 lies 8 rows on
  float o[NO][4] = {};
  float m_i[2] = {FA_NEG_INF, FA_NEG_INF}, l_i[2] = {0.0f, 0.0f};

  for (int j = 0; j < tiles; ++j) {
    const int c0 = c_begin + j * BC;
    float s[NB][4] = {};
#pragma unroll
    for (int kk = 0; kk < E / 8; ++kk) {
      const float2 qa = *reinterpret_cast<const float2*>(q_a + kk * 8);
      const float2 qb = *reinterpret_cast<const float2*>(q_a + 8 * Smem::LDQ + kk * 8);
      uint32_t ah[4], al[4];
      split_tf32_query(qa.x, ah[0], al[0]);  // row g, slot t
      split_tf32_query(qb.x, ah[1], al[1]);  // row g + 8, slot t
      split_tf32_query(qa.y, ah[2], al[2]);  // row g, slot t + 4
      split_tf32_query(qb.y, ah[3], al[3]);  // row g + 8, slot t + 4
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        mma_pairs(s[nb], ah, al, sm.k + (nb * 8 + g) * Smem::LDK + kk * 16 + 4 * t);
      }
    }
    softmax_step<NB, NO>(s, o, m_i, l_i, mask, n, ra, L, S, c0, scale_log2, mask.tile_hides(c0, BC, l0, BR, S),
                         lane);

    if (!guard) {
      // The tile's P V in a fresh accumulator, added to o in float32 once
      // the tile is done (mma.cuh's add_fresh). A fresh one every 8 keys
      // took 1.26-1.27x the time at E = 128 (its accumulators spilled).
      float pv[NO][4] = {};
#pragma unroll
      for (int kb = 0; kb < NB; ++kb) {
        uint32_t ah[4], al[4];
        split_finite(s[kb][0], ah[0], al[0]);  // row g, key 8 kb + 2t (slot t)
        split_finite(s[kb][2], ah[1], al[1]);  // row g + 8
        split_finite(s[kb][1], ah[2], al[2]);  // row g, key 8 kb + 2t + 1 (slot t + 4)
        split_finite(s[kb][3], ah[3], al[3]);  // row g + 8
#pragma unroll
        for (int eb = 0; eb < NO; ++eb) {
          mma_pairs(pv[eb], ah, al, sm.vt + (eb * 8 + g) * tp::kLdVt + kb * 16 + 4 * t);
        }
      }
#pragma unroll
      for (int eb = 0; eb < NO; ++eb) add_fresh(o[eb], pv[eb]);
    } else {
      // split_tf32 kept lo = 0 beside an infinite hi: hi + lo is the value.
      auto v_at = [&](int c, int e) {
        const float* at = sm.vt + e * tp::kLdVt + pair_at(c);
        return at[0] + at[2];
      };
      add_pv_fma<NB, NO>(o, s, v_at, mask, n, ra, L, S, c0, min(BC, S - c0), lane);
    }
    __syncthreads();  // every warp is done with the tile
    bad = false;
    if (j + 1 < tiles) {
      load(c0 + BC);
      bad = store(c0 + BC);
    }
    guard = __syncthreads_or(bad);
  }

  store_rows<float, NO>(o, m_i, l_i, sink_log2(mask_kind, mask_base, int(n % H_q)),
                        out_rows(out, lay.o, n, H_q, L, lse_of(mask_kind, lse)), L, E, ra, t);
}

}  // namespace fa

// fa_prefill_pairs_float32_<E>: outputs the attention output and each row's
// log-sum-exp (written where mask_kind has kLse: mask_bits.h).
#if FA_DTYPE != 0 || !(FA_E == 80 || FA_E == 96 || FA_E == 128)
#error "prefill_tf32_pairs.cu takes float32 at E = 80, 96 or 128"
#endif
extern "C" __global__ void __launch_bounds__(fa::tf32_shapes::pairs::kThreads, 1)
    FA_CAT3(fa_prefill_pairs_float32_, FA_E, )(const float* q, const float* k, const float* v, const void* mask,
                                               const int64_t* mask_base, float* out, float* lse, int H_q, int H_kv,
                                               int L, int S, int mask_kind, int mask_rs, int mask_cs,
                                               float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_tf32_pairs<FA_E>(q, k, v, mask, mask_base, out, lse, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs,
                               scale_log2, FA_LAYOUT);
}
