// FlashAttention-2 forward on tensor cores for float16 / bfloat16 inputs
// (mma.sync m16n8k16, float32 accumulation), one unit per (dtype, E).
//
// A block of W warps takes Br = 16 W query rows of one (batch, query head);
// warp w owns rows 16w..16w+15 (W = 8 for E = 64, 4 above, where registers
// run short, and 8 in the wide block at E = 256: f16_shapes.h). Every K/V
// tile loaded serves all W warps. Key/value tiles of Bc = 64 rows stream
// through shared memory (cp.async):
//
//   S = Q_i K_j^T     ldmatrix Q (A, row) and K (B, col = K row-major)
//   mask, online softmax on the accumulators (rows g and g + 8 per thread)
//   O += P V          P re-packed from the S accumulators as the A operand,
//                     V through ldmatrix.trans
//
// Key/value tiles are double-buffered: tile j + 1 is in flight while tile j
// is computed. Q fragments stay in registers for E <= 128. Shared rows are
// padded by 16 bytes, which keeps ldmatrix free of bank conflicts for every E. Causal masks skip hidden tiles; the heaviest row
// tiles launch first. A tile that hides some keys whose values hold NaN or
// Inf takes a scalar P V over visible keys only (0 x NaN would leak them).
//
// kF32 (-DFA_F32=1, fa_prefill32_*): float32 attention over the 16-bit
// inputs with a float32 output, as prefill_f16_wg.cu's kF32 on Hopper: S is
// float32-exact already (16-bit products, float32 sums), P enters P V as
// PSplit's two terms (two products a tile), and each tile's P V goes into a
// fresh accumulator, 16 columns at a time, that is added to o in float32
// (the tensor cores' own sums over every tile drift: docs/cuda.md). Off
// Hopper it is every such prefill; on Hopper E = 256, which no wgmma
// prefill takes.

#include "f16_shapes.h"
#include "mma.cuh"
#include "store_output.cuh"
#include "unit.cuh"

namespace fa {

constexpr int kBc = f16_shapes::kBc;

template <typename T, int E, bool kWide = false>
struct PrefillSmem {
  static constexpr int kBr = f16_shapes::rows(E, kWide), THREADS = f16_shapes::threads(E, kWide);
  static constexpr int LD = f16_shapes::ld(E);  // elements per padded row
  T q[kBr * LD];
  T k[2][kBc * LD];  // after S = Q K^T, also P's staging on the rare non-finite path
  T v[2][kBc * LD];
};
static_assert(sizeof(PrefillSmem<unsigned short, 64>) == f16_shapes::smem_bytes(64) &&
                  sizeof(PrefillSmem<unsigned short, 256>) == f16_shapes::smem_bytes(256) &&
                  sizeof(PrefillSmem<unsigned short, 256, true>) == f16_shapes::smem_bytes(256, true),
              "f16_shapes.h sizes the shared memory the planner asks for");

// rows x E elements from src rows first.., rows past count zero-filled.
template <typename T, int E, bool kWide>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t stride, int first, int rows, int count,
                                          int tid) {
  constexpr int LD = PrefillSmem<T, E, kWide>::LD, CHUNKS = E / 8, THREADS = PrefillSmem<T, E, kWide>::THREADS;
  for (int idx = tid; idx < rows * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, c8 = idx % CHUNKS;
    const bool valid = r < count;
    cp_async16(dst + r * LD + c8 * 8, valid ? src + (first + r) * stride + c8 * 8 : src, valid);
  }
}

template <typename T, int E, bool kWide>
__device__ __forceinline__ bool tile_has_nonfinite(const T* tile, int count, int tid) {
  constexpr int LD = PrefillSmem<T, E, kWide>::LD, THREADS = PrefillSmem<T, E, kWide>::THREADS;
  bool bad = false;
  for (int idx = tid; idx < count * E; idx += THREADS) {
    bad |= !isfinite(to_f(tile[(idx / E) * LD + idx % E]));
  }
  return __syncthreads_or(bad);
}

// kF32's P V for one tile: o += P V with P in PSplit's terms (a[term][kk]:
// P V's A operand for keys 16 kk ..), each 16 output columns summed over
// the tile's keys in a fresh accumulator first.
template <typename T, int E, int kTerms>
__device__ __forceinline__ void pv_terms(float (&o)[E / 8][4], const uint32_t (&a)[kTerms][kBc / 16][4],
                                         const T* sv, int lane) {
  constexpr int LD = PrefillSmem<T, E>::LD;  // the same for either block
#pragma unroll
  for (int eb2 = 0; eb2 < E / 16; ++eb2) {
    float acc[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, &sv[(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + eb2 * 16 + (lane >> 4) * 8]);
#pragma unroll
      for (int term = 0; term < kTerms; ++term) {
        mma16816<T>(acc[0], a[term][kk], bv[0], bv[1]);
        mma16816<T>(acc[1], a[term][kk], bv[2], bv[3]);
      }
    }
    add_fresh(o[2 * eb2], acc[0]);
    add_fresh(o[2 * eb2 + 1], acc[1]);
  }
}

template <typename T, int E, bool kF32 = false, bool kWide = false,
          typename TO = std::conditional_t<kF32, float, T>>
__device__ __forceinline__ void prefill(const T* __restrict__ q, const T* __restrict__ k,
                                        const T* __restrict__ v, const void* mask_data,
                                        const int64_t* __restrict__ mask_base, TO* __restrict__ out,
                                        float* __restrict__ lse,
                                        int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs,
                                        int mask_cs, float scale_log2, Layout lay) {
  using Smem = PrefillSmem<T, E, kWide>;
  constexpr int LD = Smem::LD, KS = E / 16, NB = kBc / 8, NO = E / 8;
  constexpr int kBr = Smem::kBr;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const PrefillBlock blk(kBr, H_q, H_kv, L, S, mask_kind, mask_cs);
  const int64_t n = blk.n;
  const int l0 = blk.l0, kv_end = blk.kv_end;
  const int j0 = blk.kv_begin / kBc;  // tile j holds keys (j0 + j) kBc ...
  const T* q_head = q + lay.q.at(blk.b, blk.h, 0);
  const T* k_head = k + lay.k.at(blk.b, blk.g, 0);
  const T* v_head = v + lay.v.at(blk.b, blk.g, 0);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const bool array_mask = mask.is_array();

  constexpr bool kQInRegs = E <= 128;
  using Split = PSplit<T, 2>;  // two terms, as the wgmma prefill's (wg_shapes.h)
  constexpr int kTerms = Split::kTerms;
  constexpr float kPScale = kF32 ? Split::kScale : 1.0f;
  const int n_tiles = (kv_end + kBc - 1) / kBc - j0;
  const int ra = l0 + w * 16 + g;  // this thread's rows: ra and ra + 8

  load_tile<T, E, kWide>(sm.q, q_head, lay.q.sr, l0, kBr, min(kBr, L - l0), tid);
  cp_async_commit();
  if (n_tiles > 0) {
    load_tile<T, E, kWide>(sm.k[0], k_head, lay.k.sr, j0 * kBc, kBc, min(kBc, S - j0 * kBc), tid);
    load_tile<T, E, kWide>(sm.v[0], v_head, lay.v.sr, j0 * kBc, kBc, min(kBc, S - j0 * kBc), tid);
  }
  cp_async_commit();

  float o[NO][4] = {};
  float m_i[2] = {FA_NEG_INF, FA_NEG_INF}, l_i[2] = {0.0f, 0.0f};
  uint32_t qf[kQInRegs ? KS : 1][4];

  for (int j = 0; j < n_tiles; ++j) {
    const int c0 = (j0 + j) * kBc, buf = j & 1;
    const int count = min(kBc, S - c0);
    if (j + 1 < n_tiles) {  // the next tile flies while this one is computed
      const int c1 = c0 + kBc, n1 = min(kBc, S - c1);
      load_tile<T, E, kWide>(sm.k[buf ^ 1], k_head, lay.k.sr, c1, kBc, n1, tid);
      load_tile<T, E, kWide>(sm.v[buf ^ 1], v_head, lay.v.sr, c1, kBc, n1, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();
    const T* sk = sm.k[buf];
    const T* sv = sm.v[buf];
    if (kQInRegs && j == 0) {
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
        ldmatrix_x4(qf[kQInRegs ? kk : 0], &sm.q[(w * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8]);
    }

    // S = Q K^T for this warp's 16 rows and the tile's 64 keys.
    float s[NB][4] = {};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t a_smem[4];
      if (!kQInRegs) ldmatrix_x4(a_smem, &sm.q[(w * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8]);
      const uint32_t* a = kQInRegs ? qf[kQInRegs ? kk : 0] : a_smem;
#pragma unroll
      for (int nb2 = 0; nb2 < NB / 2; ++nb2) {
        uint32_t bk[4];
        ldmatrix_x4(bk, &sk[(nb2 * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8]);
        mma16816<T>(s[2 * nb2], a, bk[0], bk[1]);
        mma16816<T>(s[2 * nb2 + 1], a, bk[2], bk[3]);
      }
    }
    const bool need_mask = mask.tile_hides(c0, kBc, l0, kBr, S);
    softmax_step<NB, NO>(s, o, m_i, l_i, mask, n, ra, L, S, c0, scale_log2, need_mask, lane);

    if constexpr (kF32) {
      uint32_t a[kTerms][kBc / 16][4];  // P's terms (times kPScale), P V's A operand
      pack_p_terms<T>(a, s, kPScale);
      if (need_mask && tile_has_nonfinite<T, E, kWide>(sv, count, tid)) {
        rare_pv<T>(o, a, [&](int c, int col) { return sv[c * LD + col]; }, mask, n, ra, L, S, c0, count, lane);
      } else {
        pv_terms<T, E, kTerms>(o, a, sv, lane);
      }
      __syncthreads();  // the load issued next overwrites this buffer
      continue;
    }

    if (need_mask && tile_has_nonfinite<T, E, kWide>(sv, count, tid)) {
      // Rare: P V over visible keys only (0 x NaN would leak hidden values).
      // Every warp is past its S = Q K^T (the barrier in the test above), so
      // P is staged where Q was (Q lives in registers by now) or, for E = 256,
      // where this tile's K was. Never in the other K/V buffers: the next
      // tile is landing there.
      static_assert(kQInRegs ? kBr * LD >= kBr * kBc : kBc * LD >= kBr * kBc, "P staging must fit");
      T* p_stage = (kQInRegs ? sm.q : sm.k[buf]) + w * 16 * kBc;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          p_stage[(g + (i >> 1) * 8) * kBc + nb * 8 + 2 * t + (i & 1)] = from_f<T>(s[nb][i]);
      __syncwarp();
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = ra + rr * 8;
        if (r >= L) continue;  // padding rows: never stored
        const int64_t rbase = array_mask ? mask.row_base(n, r) : 0;
        for (int c = 0; c < count; ++c) {
          const int key = c0 + c;
          if (mask.causal_hides(r, key)) continue;
          if (array_mask && mask.term(rbase, key) == FA_NEG_INF) continue;
          const float p = to_f(p_stage[(g + rr * 8) * kBc + c]);
#pragma unroll
          for (int eb = 0; eb < NO; ++eb) {
            o[eb][2 * rr] += p * to_f(sv[c * LD + eb * 8 + 2 * t]);
            o[eb][2 * rr + 1] += p * to_f(sv[c * LD + eb * 8 + 2 * t + 1]);
          }
        }
      }
      __syncthreads();
      continue;
    }

    // O += P V
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int eb2 = 0; eb2 < E / 16; ++eb2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, &sv[(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + eb2 * 16 + (lane >> 4) * 8]);
        mma16816<T>(o[2 * eb2], a, bv[0], bv[1]);
        mma16816<T>(o[2 * eb2 + 1], a, bv[2], bv[3]);
      }
    }
    __syncthreads();  // the load issued next overwrites this buffer
  }

  cp_async_wait_all();  // nothing may be in flight at exit (no key tiles: Q only)

  if constexpr (kPScale != 1.0f) {
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[eb][c] *= 1.0f / kPScale;
  }
  store_output<TO, NO, kF32>(o, m_i, l_i, sink_log2(mask_kind, mask_base, int(n % H_q)),
                             out_rows(out, lay.o, n, H_q, L, lse_of(mask_kind, lse)), L, E, ra, t, mask_kind);
}

}  // namespace fa

// fa_prefill_<dtype>_<E>: grid (row tiles x threads, H_q, batch), 32 x
// f16_shapes::warps(E) threads, dynamic shared memory sizeof(PrefillSmem).
// Outputs: the attention output and each row's log-sum-exp (written where
// mask_kind has kLse: mask_bits.h). -DFA_F32=1: fa_prefill32_<dtype>_<E>,
// float32 attention over the 16-bit inputs (kF32 above), a float32 output;
// -DFA_WIDE=1: fa_prefill[32]_wide_<dtype>_256, the wide block
// (f16_shapes.h); the same arguments otherwise.
#if !defined(FA_E)
#error "define FA_E"
#endif
#if FA_DTYPE == 0
#error "prefill_f16.cu takes float16 or bfloat16; float32 has prefill_tf32.cu"
#endif
#if defined(FA_WIDE) && FA_WIDE
#define FA_P_WIDE true
#define FA_P_SHAPE wide_
#else
#define FA_P_WIDE false
#define FA_P_SHAPE
#endif
#if defined(FA_F32) && FA_F32
#define FA_P_F32 true
#define FA_P_OUT float
#define FA_P_FAMILY fa_prefill32_
#else
#define FA_P_F32 false
#define FA_P_OUT FA_T
#define FA_P_FAMILY fa_prefill_
#endif
extern "C" __global__ void __launch_bounds__(fa::PrefillSmem<FA_T, FA_E, FA_P_WIDE>::THREADS)
    FA_CAT5(FA_P_FAMILY, FA_P_SHAPE, FA_TNAME, _, FA_E)(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base,
    FA_P_OUT* out, float* lse, int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs,
    float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill<FA_T, FA_E, FA_P_F32, FA_P_WIDE>(q, k, v, mask, mask_base, out, lse, H_q, H_kv, L, S, mask_kind,
                                               mask_rs, mask_cs, scale_log2, FA_LAYOUT);
}
