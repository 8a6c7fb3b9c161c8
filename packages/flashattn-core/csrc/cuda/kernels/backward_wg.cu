// The 16-bit backward on Hopper (sm_90a): the statistics pass with Q K^T on
// wgmma (backward_stats16.cuh), and backward_f16.cu's
// fa_backward_keysq with four of its five products on warpgroup
// instructions (wgmma.cuh), which read their shared-memory operands once a
// warpgroup instead of once a warp: with mma.sync every warp loaded the
// whole row tile by ldmatrix for each of S^T, dP^T, dV and dK, and the
// loads, not the tensor cores, set the pace (Nsight Compute: HMMA waiting on
// LDSM, LDSM on the memory pipe's queue).
//
// Block: 128 keys, two warpgroups of 64 (warp w: keys 16 w .., as in
// backward_f16.cu, so the softmax step and the accumulator layouts are
// that kernel's). Per row tile, each warpgroup:
//   S^T = K Q^T and dP^T = V dO^T: E / 16 wgmma each, both operands in
//     shared memory (K-major);
//   P^T and dS^T (backward_parts.cuh's key_tile_ds) from the accumulators;
//   dV += P^T dO and dK += dS^T Q: BR / 16 wgmma each, P^T / dS^T from
//     registers, dO / Q read MN-major from the same tiles;
// then dQ += dS K on mma.sync from dS^T in shared memory, as
// backward_f16.cu, added into float32 by atomics, or (kBulkDq: the units
// compiled for their head dim, E = EB) staged in shared memory and added by
// one bulk reduce a row tile, which the copy engine performs while the
// block goes on. K, V, Q and dO lie in
// wgmma's 128-byte swizzled layout (swizzle.cuh). Two barriers a row tile:
// the next tile's copy starts once every warp is past the tile before. The
// statistics pass flags the rows whose Q or dO is not finite: a tile with
// one takes guarded products (a zero weight never meets it).

#include <cstdint>

#include "backward_parts.cuh"
#include "backward_shapes.h"
#include "backward_stats16.cuh"
#include "backward_tiles16.cuh"
#include "tma.cuh"
#include "unit.cuh"
#include "wgmma.cuh"

namespace fa {

// W (16 x NB*8 a warp, accumulator layout) rounded to T as wgmma's A operand:
// one 16-column block a K step.
template <typename T, int NB>
__device__ __forceinline__ void pack_terms(uint32_t (&a)[NB / 2][4], const float (&w)[NB][4]) {
#pragma unroll
  for (int kb = 0; kb < NB / 2; ++kb) {
    a[kb][0] = pack2<T>(w[2 * kb][0], w[2 * kb][1]);
    a[kb][1] = pack2<T>(w[2 * kb][2], w[2 * kb][3]);
    a[kb][2] = pack2<T>(w[2 * kb + 1][0], w[2 * kb + 1][1]);
    a[kb][3] = pack2<T>(w[2 * kb + 1][2], w[2 * kb + 1][3]);
  }
}

template <typename T, int EB, bool kBulkDq>
__device__ __forceinline__ void backward_keys_wg(const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ v, const T* __restrict__ d_out,
                                                 const float* __restrict__ stats, const int* __restrict__ flags,
                                                 const void* mask_data, const int64_t* __restrict__ mask_base,
                                                 void* dk, void* dv, float* __restrict__ dq, int64_t slices, int H_q, int H_kv, int L,
                                                 int S, int E, int mask_kind, int mask_rs, int mask_cs,
                                                 float scale_log2, float scale, const BackwardLayout& lay) {
  constexpr int BK = bs::kKeys16, BR = bs::row_tile16(EB), NB = BR / 8, NO = EB / 8;
  constexpr int TH = bs::kKeysThreads16, LDS = bs::ld_ds16(EB), WN = EB / 32;
  static_assert(BR / 16 * WN == TH / 32, "dQ's 16 x 32 blocks, one a warp");
  extern __shared__ __align__(1024) unsigned char smem_sw[];  // (its own name: the alignment differs)
  T* k_s = reinterpret_cast<T*>(smem_sw);  // tiles on 1024-byte boundaries (the swizzle)
  T* v_s = k_s + BK * EB;
  T* q_s = v_s + BK * EB;        // two buffers
  T* do_s = q_s + 2 * BR * EB;   // two buffers
  T* ds_s = do_s + 2 * BR * EB;  // dS^T: BK keys x BR rows, rows LDS apart
  float* lse_s = reinterpret_cast<float*>(ds_s + BK * LDS);  // two buffers
  float* d_s = lse_s + 2 * BR;                                // two buffers
  int* flag_s = reinterpret_cast<int*>(d_s + 2 * BR);         // two buffers
  float* dq_stage = reinterpret_cast<float*>(smem_sw + bs::keys_smem_bytes_wg(EB));  // two tiles (kBulkDq)
  if (smem_u32(smem_sw) & 1023) __trap();
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wg = w >> 2;

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

  // Row tile i (rows row_begin + i BR ...) into buffer b: Q, dO, the rows'
  // (lse, D), lse = +inf past L (P = 0), and their flags (the statistics
  // pass's: Q or dO not finite).
  auto copy_rows = [&](int i, int b) {
    const int r0 = row_begin + i * BR, count = min(BR, L - r0);
    copy_tile<T, EB, BR, TH, true>(q_s + b * BR * EB, q_head + r0 * (int64_t)lay.q.sr, count, E, lay.q.sr, vec);
    copy_tile<T, EB, BR, TH, true>(do_s + b * BR * EB, do_head + r0 * (int64_t)lay.d_out.sr, count, E, lay.d_out.sr,
                                   vec);
    if (threadIdx.x < BR) {
      const int j = threadIdx.x;
      if (j < count) {
        cp_async4(lse_s + b * BR + j, stats + (n * L + r0 + j) * 2);
        cp_async4(d_s + b * BR + j, stats + (n * L + r0 + j) * 2 + 1);
        cp_async4(flag_s + b * BR + j, flags + n * L + r0 + j);
      } else {
        lse_s[b * BR + j] = INFINITY;
        d_s[b * BR + j] = 0.0f;
        flag_s[b * BR + j] = 0;
      }
    }
  };

  // Thread 0: row tile i's staged share of dQ added into the sums.
  auto flush_dq = [&](int i) {
    const int r0 = row_begin + i * BR, count = min(BR, L - r0);
    bulk_reduce_add_f32(dq + (n * L + r0) * EB, dq_stage + (i & 1) * BR * EB, uint32_t(count) * EB * 4);
    bulk_commit();
  };

  const int kc = min(BK, S - c0);
  copy_tile<T, EB, BK, TH, true>(k_s, head_of(k, lay.k, kv_slice, H_kv) + c0 * (int64_t)lay.k.sr, kc, E, lay.k.sr,
                                 vec);
  copy_tile<T, EB, BK, TH, true>(v_s, head_of(v, lay.v, kv_slice, H_kv) + c0 * (int64_t)lay.v.sr, kc, E, lay.v.sr,
                                 vec);
  if (tiles > 0) copy_rows(0, 0);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();  // cp.async writes, read by wgmma (the async proxy)
  const bool guard_k = __syncthreads_or(tile_nonfinite<T, EB, BK, TH, true>(k_s));

  // Descriptors (16-byte units): K and V K-major from this warpgroup's 64
  // keys; Q and dO K-major for S^T and dP^T, MN-major (column blocks BR rows
  // apart) for dK and dV. A K step of E moves 32 bytes in a column block,
  // then to the next block; a K step of rows moves 16 rows (2048 bytes).
  const WgDesc d_k(wgmma_desc_sw128(k_s + wg * 64 * 64, 16, 1024));
  const WgDesc d_v(wgmma_desc_sw128(v_s + wg * 64 * 64, 16, 1024));
  const WgDesc d_q(wgmma_desc_sw128(q_s, 16, 1024));
  const WgDesc d_do(wgmma_desc_sw128(do_s, 16, 1024));
  const WgDesc d_qt(wgmma_desc_sw128(q_s, BR * 128, 1024));
  const WgDesc d_dot(wgmma_desc_sw128(do_s, BR * 128, 1024));
  auto step_e = [](int rows, int kk) { return uint32_t((kk >> 2) * rows * 8 + (kk & 3) * 2); };
  constexpr uint32_t kStepRows = 2048 >> 4, kStepBuf = (BR * EB * 2) >> 4;

  const int ka = c0 + w * 16 + g;  // this thread's keys: ka, ka + 8
  const int wm = w / WN, wn = w % WN;  // this warp's dQ block: rows 16 wm, columns 32 wn
  float dk_acc[NO][4], dv_acc[NO][4];
  zero(dk_acc);
  zero(dv_acc);
  for (int i = 0; i < tiles; ++i) {
    const int b = i & 1, r0 = row_begin + i * BR;
    const T* q_t = q_s + b * BR * EB;
    const T* do_t = do_s + b * BR * EB;
    // Every warp is past tile i - 1 (its buffers and dS^T are free) and
    // tile i has landed (each thread waited for its copies at the end of
    // tile i - 1).
    const bool guard = __syncthreads_or(threadIdx.x < BR && flag_s[b * BR + threadIdx.x] != 0);
    if (i + 1 < tiles) copy_rows(i + 1, b ^ 1);
    cp_async_commit();

    const uint32_t off = b * kStepBuf;
    float p[NB][4], ds[NB][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < EB / 16; ++kk)
      wgmma16_ss<T, BR>(p, d_k.at(step_e(BK, kk)), d_q.at(off + step_e(BR, kk)), kk > 0);  // S^T
#pragma unroll
    for (int kk = 0; kk < EB / 16; ++kk)
      wgmma16_ss<T, BR>(ds, d_v.at(step_e(BK, kk)), d_do.at(off + step_e(BR, kk)), kk > 0);  // dP^T
    wgmma_commit();
    if constexpr (kBulkDq) {
      // Tile i - 1's dQ, staged and fenced before the barrier above; then the
      // stage this tile writes (tile i - 2's) read out before the barrier
      // that precedes those writes.
      if (threadIdx.x == 0 && i > 0) {
        flush_dq(i - 1);
        bulk_wait_read<1>();
      }
    }
    wgmma_wait<0>();
    fence_fragments(p);
    fence_fragments(ds);
    key_tile_ds<NB, true>(p, ds, mask, n, ka, r0, mask.tile_hides(c0, BK, r0, BR, S), lse_s + b * BR, d_s + b * BR,
                          scale_log2, t, L, S);
    uint32_t pa[NB / 2][4], dsa[NB / 2][4];
    pack_terms<T, NB>(pa, p);
    pack_terms<T, NB>(dsa, ds);
    if (guard) {
      // Q or dO not finite in some row: the guarded products, read swizzled.
      accumulate_guarded_at<NB, NO>(dv_acc, p, [&](int k, int c) { return to_f(do_t[sw_at<BR>(k, c)]); }, lane);
      accumulate_guarded_at<NB, NO>(dk_acc, ds, [&](int k, int c) { return to_f(q_t[sw_at<BR>(k, c)]); }, lane);
    } else {
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < NB / 2; ++kb) wgmma16_rs_t<T, EB>(dv_acc, pa[kb], d_dot.at(off + kb * kStepRows));
#pragma unroll
      for (int kb = 0; kb < NB / 2; ++kb) wgmma16_rs_t<T, EB>(dk_acc, dsa[kb], d_qt.at(off + kb * kStepRows));
      wgmma_commit();
    }
    // dS^T to shared memory (rows ka, ka + 8: pairs of rows 16 kb + 2t ..).
#pragma unroll
    for (int kb = 0; kb < NB / 2; ++kb) {
      T* at = ds_s + (w * 16 + g) * LDS + kb * 16 + 2 * t;
      *reinterpret_cast<uint32_t*>(at) = dsa[kb][0];
      *reinterpret_cast<uint32_t*>(at + 8 * LDS) = dsa[kb][1];
      *reinterpret_cast<uint32_t*>(at + 8) = dsa[kb][2];
      *reinterpret_cast<uint32_t*>(at + 8 * LDS + 8) = dsa[kb][3];
    }
    __syncthreads();
    // dQ += dS K for this tile (K swizzled).
    float qa[4][4];
    dq_products16<T, EB, BK, LDS, true>(qa, ds_s, k_s, guard_k, wm, wn, lane);
    // The next tile's copies landed and made visible to wgmma before dQ's
    // atomics go out: the fence waits for every earlier memory access of
    // the thread, and the atomics' would be the slowest.
    if constexpr (kBulkDq) stage_dq16<EB>(qa, dq_stage + b * BR * EB, wm, wn, scale, lane);
    cp_async_wait<0>();
    fence_proxy_async();  // (the staged dQ too, read by the bulk reduce)
    if constexpr (!kBulkDq) add_dq16(qa, dq, n, L, E, r0, wm, wn, scale, lane);
    // dV and dK's products read this tile's buffers and P^T / dS^T's
    // registers: done before the barrier that frees them.
    wgmma_wait<0>();
    fence_fragments(dv_acc);
    fence_fragments(dk_acc);
    fence_fragments(pa);
    fence_fragments(dsa);
  }
  cp_async_wait<0>();
  if constexpr (kBulkDq) {
    __syncthreads();  // the last tile's dQ staged by every thread
    if (threadIdx.x == 0) {
      if (tiles > 0) flush_dq(tiles - 1);
      bulk_wait<0>();
    }
  }

  store_dk_dv16<T, NO>(dk_acc, dv_acc, dk, dv, dq, lay, slices, H_q, H_kv, L, S, E, kv_slice, tiles > 0, ka, scale,
                       lane);
}

}  // namespace fa

// The extern "C" entry points of one unit (-DFA_DTYPE 1 | 2, -DFA_E 64 | 128,
// -DFA_PASS=0 stats | 1 keys): fa_backward_statswg_<dtype>_<E> (the
// arguments of backward_f16.cu's fa_backward_stats_*) and
// fa_backward_keyswg_<dtype>_<E> (fa_backward_keysq's, and the statistics
// pass's flags after its statistics); both end in FA_BACKWARD_LAYOUT_PARAMS.
#if !defined(FA_E) || !defined(FA_PASS) || FA_DTYPE == 0 || FA_E > 128
#error "backward_wg.cu: a 16-bit dtype, FA_E 64 or 128, and FA_PASS"
#endif
#if FA_PASS == 0
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(fa_backward_statswg_, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* o, const FA_T* d_out, const void* mask, const int64_t* mask_base,
    float* stats, int* flags, float* dq, int slices, int H_q, int H_kv, int L, int S, int E, int mask_kind,
    int mask_rs, int mask_cs, float scale_log2, float, FA_BACKWARD_LAYOUT_PARAMS) {
  fa::backward_stats16<FA_T, FA_E, true>(q, k, o, d_out, mask, mask_base, stats, flags, dq, slices, H_q, H_kv, L, S, E,
                                         mask_kind, mask_rs, mask_cs, scale_log2, FA_BACKWARD_LAYOUT);
}
#else
// -DFA_KIND=0 | 1: fa_backward_keyswgn_ / fa_backward_keyswgc_, the same
// arguments for calls with no mask or a causal one (its window still an
// argument) at E = FA_E exactly: the mask's kind and the head dim fixed at
// compile time, so that the array mask's per-element code and the partial
// columns' are compiled out. Taken at runtime, they cost this pass 1.26x
// (hd128) and 1.5x (qwen05b) of its time at 8K (H200,
// benchmarks/cuda-probes/backward-probe-f16.cu).
#if defined(FA_KIND)
#define FA_KEYS_FAMILY FA_CAT3(fa_backward_keyswg, FA_KIND_LETTER, _)
#define FA_KEYS_E FA_E
#define FA_KEYS_KIND FA_KIND
#define FA_KEYS_BULK true
#else
#define FA_KEYS_FAMILY fa_backward_keyswg_
#define FA_KEYS_E E
#define FA_KEYS_KIND mask_kind
#define FA_KEYS_BULK false
#endif
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kKeysThreads16, 1)
    FA_CAT5(FA_KEYS_FAMILY, FA_TNAME, _, FA_E, )(const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* d_out,
                                                 const float* stats, const int* flags, const void* mask,
                                                 const int64_t* mask_base, float* dq, void* dk, void* dv, int slices,
                                                 int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs,
                                                 int mask_cs, float scale_log2, float scale,
                                                 FA_BACKWARD_LAYOUT_PARAMS) {
  fa::backward_keys_wg<FA_T, FA_E, FA_KEYS_BULK>(q, k, v, d_out, stats, flags, mask, mask_base, dk, dv, dq, slices, H_q, H_kv, L, S,
                                   FA_KEYS_E, FA_KEYS_KIND, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT);
}
#endif
