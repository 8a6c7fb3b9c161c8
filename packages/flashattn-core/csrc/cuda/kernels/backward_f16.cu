// FlashAttention-2's backward for float16 and bfloat16 at head dims up to
// 128, on 16-bit tensor cores (mma.sync m16n8k16). backward.cu's header has
// the algebra; here, as in FlashAttention-2, one pass over the keys makes all
// three gradients, dQ added into float32 by atomics:
//   fa_backward_stats: 4 warps x 16 query rows; each row's log-sum-exp (a
//     walk over the K tiles: the forward kernels do not keep it) and D
//     (backward_stats16.cuh).
//   fa_backward_keysq: 8 warps x 16 keys against one query head's rows, a
//     row tile at a time: S^T, dP^T, then dV += P^T dO and dK += dS^T Q in
//     registers, and dQ += dS K from dS^T put in shared memory, added to the
//     float32 dQ (zeros before the launch).
// Tiles stay 16-bit in shared memory, fragments are read by ldmatrix, and a
// loop's next tile is copied by cp.async while this one's products run. P and
// dS enter their products rounded to the inputs' dtype, as in
// FlashAttention-2; products accumulate in float32. Inputs are read where
// they lie (BackwardLayout, backward_tiles16.cuh); rows whose E is a multiple
// of 8, 16-byte aligned, are copied 16 bytes at a time, others element by
// element.

#include <cstdint>

#include "backward_parts.cuh"
#include "backward_shapes.h"
#include "backward_stats16.cuh"
#include "backward_tiles16.cuh"
#include "mma.cuh"
#include "unit.cuh"

namespace fa {

namespace bs = backward_shapes;

// acc (16 x NO*8) += W X, W (16 x NB*8, accumulator layout: P or dS) rounded
// to T as the A operand (two accumulator blocks make one 16 x 16 block), X's
// NB*8 rows in shared memory read transposed by ldmatrix (rows lane % 16,
// column half lane / 16).
template <typename T, int NB, int NO, int EB>
__device__ __forceinline__ void accumulate16(float (&acc)[NO][4], const float (&w)[NB][4], const T* x_rows,
                                             int lane) {
  constexpr int LD = bs::ld16(EB);
  static_assert(NB % 2 == 0 && NO % 2 == 0, "blocks in pairs");
  uint32_t a[NB / 2][4];
#pragma unroll
  for (int kb = 0; kb < NB / 2; ++kb) {
    a[kb][0] = pack2<T>(w[2 * kb][0], w[2 * kb][1]);
    a[kb][1] = pack2<T>(w[2 * kb][2], w[2 * kb][3]);
    a[kb][2] = pack2<T>(w[2 * kb + 1][0], w[2 * kb + 1][1]);
    a[kb][3] = pack2<T>(w[2 * kb + 1][2], w[2 * kb + 1][3]);
  }
  const T* x = x_rows + (lane & 15) * LD + (lane >> 4) * 8;
  // Column blocks inner: NO independent accumulators between two products
  // into one (k inner chained them, and the warps stalled on the tensor
  // cores' latency).
#pragma unroll
  for (int kb = 0; kb < NB / 2; ++kb)
#pragma unroll
    for (int eb = 0; eb < NO; eb += 2) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, x + kb * 16 * LD + eb * 8);
      mma16816<T>(acc[eb], a[kb], bf[0], bf[1]);
      mma16816<T>(acc[eb + 1], a[kb], bf[2], bf[3]);
    }
}

// One block: 128 keys against the rows of one query head. dK and dV in T
// without GQA; with it, float32 sums of the group's heads (zeros before the
// launch). dQ: every block adds its keys' share into float32 (zeros before
// the launch).
template <typename T, int EB>
__device__ __forceinline__ void backward_keysq16(const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ v, const T* __restrict__ d_out,
                                                 const float* __restrict__ stats, const void* mask_data,
                                                 const int64_t* __restrict__ mask_base, void* dk, void* dv,
                                                 float* __restrict__ dq, int64_t slices, int H_q, int H_kv, int L,
                                                 int S, int E, int mask_kind, int mask_rs, int mask_cs,
                                                 float scale_log2, float scale, const BackwardLayout& lay) {
  constexpr int LD = bs::ld16(EB), BK = bs::kKeys16, BR = bs::row_tile16(EB), NB = BR / 8, NO = EB / 8;
  constexpr int TH = bs::kKeysThreads16, LDS = bs::ld_ds16(EB), WN = EB / 32;  // dQ: warps across 32-column blocks
  static_assert(BR / 16 * WN == TH / 32, "dQ's 16 x 32 blocks, one a warp");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + BK * LD;
  T* q_s = v_s + BK * LD;       // two buffers
  T* do_s = q_s + 2 * BR * LD;  // two buffers
  T* ds_s = do_s + 2 * BR * LD;  // dS^T: BK keys x BR rows
  float* lse_s = reinterpret_cast<float*>(ds_s + BK * LDS);  // two buffers
  float* d_s = lse_s + 2 * BR;                                // two buffers
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  const BackwardBlock blk(slices, EB);
  const int64_t n = blk.slice;  // b H_q + h
  const int c0 = blk.tile * BK;  // the first keys first: under a causal mask they have the most rows
  const int ratio = H_q / H_kv;
  const int64_t kv_slice = n / H_q * H_kv + n % H_q / ratio;
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  // Rows outside [row_begin, row_end) see none of the block's keys.
  const int row_begin = mask.row_begin(c0, L, S), row_end = mask.row_end(c0, BK, L, S);
  const int tiles = row_begin < row_end ? (row_end - row_begin + BR - 1) / BR : 0;
  const bool vec = vector_copies(E, q, k, v, d_out, lay.rows16());
  const T* q_head = head_of(q, lay.q, n, H_q);
  const T* do_head = head_of(d_out, lay.d_out, n, H_q);

  // Row tile i (rows row_begin + i BR ...) into buffer b: Q, dO and the rows'
  // (lse, D), lse = +inf past L (P = 0).
  auto copy_rows = [&](int i, int b) {
    const int r0 = row_begin + i * BR, count = min(BR, L - r0);
    copy_tile<T, EB, BR, TH>(q_s + b * BR * LD, q_head + r0 * (int64_t)lay.q.sr, count, E, lay.q.sr, vec);
    copy_tile<T, EB, BR, TH>(do_s + b * BR * LD, do_head + r0 * (int64_t)lay.d_out.sr, count, E, lay.d_out.sr, vec);
    copy_row_stats<BR>(lse_s + b * BR, d_s + b * BR, stats + (n * L + r0) * 2, count);
  };

  const int kc = min(BK, S - c0);
  copy_tile<T, EB, BK, TH>(k_s, head_of(k, lay.k, kv_slice, H_kv) + c0 * (int64_t)lay.k.sr, kc, E, lay.k.sr, vec);
  copy_tile<T, EB, BK, TH>(v_s, head_of(v, lay.v, kv_slice, H_kv) + c0 * (int64_t)lay.v.sr, kc, E, lay.v.sr, vec);
  cp_async_commit();
  if (tiles > 0) copy_rows(0, 0);
  cp_async_commit();
  cp_async_wait<1>();
  const bool guard_k = __syncthreads_or(tile_nonfinite<T, EB, BK, TH>(k_s));

  const int ka = c0 + w * 16 + g;  // this thread's keys: ka, ka + 8
  const T* k_w = k_s + w * 16 * LD;
  const T* v_w = v_s + w * 16 * LD;
  const int wm = w / WN, wn = w % WN;  // this warp's dQ block: rows 16 wm, columns 32 wn
  float dk_acc[NO][4], dv_acc[NO][4];
  zero(dk_acc);
  zero(dv_acc);
  for (int i = 0; i < tiles; ++i) {
    if (i + 1 < tiles) copy_rows(i + 1, (i + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    const int b = i & 1, r0 = row_begin + i * BR;
    const T* q_t = q_s + b * BR * LD;
    const T* do_t = do_s + b * BR * LD;
    const bool guard = __syncthreads_or(tile_nonfinite<T, EB, BR, TH>(q_t) | tile_nonfinite<T, EB, BR, TH>(do_t));
    float p[NB][4], ds[NB][4];
    scores16<T, NB, EB>(p, k_w, q_t, lane);    // S^T: keys x rows
    scores16<T, NB, EB>(ds, v_w, do_t, lane);  // dP^T
    key_tile_ds<NB, true>(p, ds, mask, n, ka, r0, mask.tile_hides(c0, BK, r0, BR, S), lse_s + b * BR, d_s + b * BR,
                    scale_log2, t, L, S);
    if (guard) {
      accumulate_guarded<T, LD, NB, NO>(dv_acc, p, do_t, 0, lane);
      accumulate_guarded<T, LD, NB, NO>(dk_acc, ds, q_t, 0, lane);
    } else {
      accumulate16<T, NB, NO, EB>(dv_acc, p, do_t, lane);
      accumulate16<T, NB, NO, EB>(dk_acc, ds, q_t, lane);
    }
    // dS^T to shared memory, rounded as dK's product took it.
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      T* at = ds_s + (w * 16 + g) * LDS + nb * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(at) = pack2<T>(ds[nb][0], ds[nb][1]);
      *reinterpret_cast<uint32_t*>(at + 8 * LDS) = pack2<T>(ds[nb][2], ds[nb][3]);
    }
    __syncthreads();
    // dQ += dS K for this tile.
    float qa[4][4];
    dq_products16<T, EB, BK, LDS, false>(qa, ds_s, k_s, guard_k, wm, wn, lane);
    add_dq16(qa, dq, n, L, E, r0, wm, wn, scale, lane);
    __syncthreads();  // the buffers this tile read are the next copy's
  }
  cp_async_wait<0>();

  store_dk_dv16<T, NO>(dk_acc, dv_acc, dk, dv, dq, lay, slices, H_q, H_kv, L, S, E, kv_slice, tiles > 0, ka, scale,
                       lane);
}

}  // namespace fa

// The extern "C" entry points of one unit (-DFA_DTYPE 1 | 2, -DFA_E 64 | 128:
// the head-dim bucket, -DFA_PASS=0 stats | 1 keys | 2 D and flags):
// fa_backward_stats_<dtype>_<E>, fa_backward_keysq_<dtype>_<E> and
// fa_backward_dflags_<dtype>_<E> (the forward's log-sum-exp as an input).
// Inputs, then outputs, then scalars, as MLX passes them; backward.cu's
// scalars, then the arrays' rows (FA_BACKWARD_LAYOUT_PARAMS). The keys pass
// adds dQ into its float32 sums, an input.
#if !defined(FA_E) || !defined(FA_PASS) || FA_DTYPE == 0 || FA_E > 128
#error "backward_f16.cu: a 16-bit dtype, FA_E 64 or 128, and FA_PASS"
#endif
#define FA_BACKWARD_SCALARS                                                                                  \
  int slices, int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs, int mask_cs, float scale_log2, \
      float scale, FA_BACKWARD_LAYOUT_PARAMS

#if FA_PASS == 0
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(fa_backward_stats_, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* o, const FA_T* d_out, const void* mask, const int64_t* mask_base,
    float* stats, int* flags, float* dq, FA_BACKWARD_SCALARS) {
  fa::backward_stats16<FA_T, FA_E>(q, k, o, d_out, mask, mask_base, stats, flags, dq, slices, H_q, H_kv, L, S, E,
                                   mask_kind, mask_rs, mask_cs, scale_log2, FA_BACKWARD_LAYOUT);
}
#elif FA_PASS == 2
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(fa_backward_dflags_, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* o, const FA_T* d_out, const float* lse, float* stats, int* flags, float* dq,
    FA_BACKWARD_SCALARS) {
  fa::backward_d_flags16<FA_T, FA_E>(q, o, d_out, lse, stats, flags, dq, slices, H_q, H_kv, L, S, E,
                                     FA_BACKWARD_LAYOUT);
}
#else
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kKeysThreads16) FA_CAT5(fa_backward_keysq_, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* d_out, const float* stats, const void* mask,
    const int64_t* mask_base, float* dq, void* dk, void* dv, FA_BACKWARD_SCALARS) {
  fa::backward_keysq16<FA_T, FA_E>(q, k, v, d_out, stats, mask, mask_base, dk, dv, dq, slices, H_q, H_kv, L, S, E,
                                   mask_kind, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT);
}
#endif
