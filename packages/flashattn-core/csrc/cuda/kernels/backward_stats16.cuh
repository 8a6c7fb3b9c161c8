// The 16-bit backward's statistics pass (fa_backward_stats_*: mma.sync,
// backward_f16.cu; fa_backward_statswg_*: wgmma, backward_wg.cu): 4 warps x
// 16 query rows; each row's log-sum-exp (a walk over the K tiles), D and the
// row's flag; or, where the forward kept the log-sum-exp,
// fa_backward_dflags_* (backward_f16.cu): D and the flags alone.

#pragma once

#include "backward_parts.cuh"
#include "backward_tiles16.cuh"
#include "wgmma.cuh"

namespace fa {

// A statistics block's rows (both passes below): row tile blk.tile counted
// from the end, so the last rows, which see the most keys under a causal
// mask, go first; first is its first row of all (B H_q L).
struct StatsRows {
  int64_t slice, first;
  int l0, count;
  __device__ __forceinline__ StatsRows(int64_t slices, int EB, int L) {
    const int row_tiles = (L + bs::kRows - 1) / bs::kRows;
    const BackwardBlock blk(slices, EB);
    slice = blk.slice;
    l0 = (row_tiles - 1 - blk.tile) * bs::kRows;
    first = slice * L + l0;
    count = min(bs::kRows, L - l0);
  }
};

// Where the forward kept each row's log-sum-exp (fa_backward_dflags_*, no
// shared memory: a launch of its own, as MLX sets a kernel's shared-memory
// limit once): the statistics pass's stats with that log-sum-exp, its
// flags, and the gradients' zeroed sums (GradSums).
template <typename T, int EB>
__device__ __forceinline__ void backward_d_flags16(const T* __restrict__ q, const T* __restrict__ o,
                                                   const T* __restrict__ d_out, const float* __restrict__ lse,
                                                   float* __restrict__ stats, int* __restrict__ flags,
                                                   float* __restrict__ dq, int64_t slices, int H_q, int H_kv, int L,
                                                   int S, int E, const BackwardLayout& lay) {
  const StatsRows rows(slices, EB, L);
  const int64_t first = rows.first;
  const int count = rows.count;
  zero_rows(dq + first * E, count * E);
  const GradSums sums(slices, H_q, H_kv, L, S, E);
  zero_share(dq + sums.n_q, 2 * sums.n_kv);
  for (int r = threadIdx.x; r < count; r += blockDim.x) stats[(first + r) * 2] = lse[first + r];
  const RowBlock<T> x(q, o, d_out, lay, rows.slice, H_q, rows.l0);
  if (vector_copies(E, q, o, d_out, q, lay.rows16())) {
    row_d_flags16<T, EB, bs::kRows, bs::kThreads>(x, stats, flags, first, count, E);
  } else {
    row_d_flags(x, stats, flags, first, count, E);
  }
}

// Each row's log-sum-exp (log2 domain) and D = rowsum(dO * O), as
// (lse, D) pairs in stats; a row that sees no key gets lse = +inf. flags:
// whether the row's Q or dO holds a value that is not finite (the Hopper
// keys pass then takes its guarded products for the row's tile, instead of
// scanning every tile it copies). dq: the rows' float32 sums of dQ, zeroed
// here for the keys pass's atomics (MLX's fills of the keys pass's outputs
// took 1.6 ms of a LoRA step at 8K, H100), and under GQA dK's and dV's
// sums after them (GradSums). WG (Hopper, backward_wg.cu): Q K^T
// on wgmma, the tiles in its swizzled layout.
template <typename T, int EB, bool WG = false>
__device__ __forceinline__ void backward_stats16(const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ o, const T* __restrict__ d_out,
                                                 const void* mask_data, const int64_t* __restrict__ mask_base,
                                                 float* __restrict__ stats, int* __restrict__ flags,
                                                 float* __restrict__ dq, int64_t slices,
                                                 int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs,
                                                 int mask_cs, float scale_log2, const BackwardLayout& lay) {
  constexpr int LD = WG ? EB : bs::ld16(EB), BR = bs::kRows, BC = bs::kKeyTile16, NB = BC / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* k_s = q_s + BR * LD;  // two buffers
  if (WG && (smem_u32(smem_raw) & 1023)) __trap();  // the swizzle's tiles on 1024-byte boundaries
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  const StatsRows rows(slices, EB, L);
  const int64_t n = rows.slice;  // b H_q + h
  const int l0 = rows.l0;
  const int64_t kv_slice = n / H_q * H_kv + n % H_q / (H_q / H_kv);
  const T* k_head = head_of(k, lay.k, kv_slice, H_kv);
  const int k_ld = lay.k.sr;
  const RowBlock<T> x(q, o, d_out, lay, n, H_q, l0);
  const int64_t first = rows.first;
  const int count = rows.count;
  zero_rows(dq + first * E, count * E);
  const GradSums sums(slices, H_q, H_kv, L, S, E);
  zero_share(dq + sums.n_q, 2 * sums.n_kv);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const int j0 = mask.kv_begin(l0, L, S) / BC;  // tile i holds keys (j0 + i) BC ...
  const int tiles = (mask.kv_end(l0, BR, L, S) + BC - 1) / BC - j0;
  const bool vec = vector_copies(E, q, k, q, k, lay.rows16());

  copy_tile<T, EB, BR, bs::kThreads, WG>(q_s, x.q, count, E, x.q_ld, vec);
  if (tiles > 0) {
    copy_tile<T, EB, BC, bs::kThreads, WG>(k_s, k_head + int64_t{j0} * BC * k_ld, min(BC, S - j0 * BC), E, k_ld, vec);
  }
  cp_async_commit();
  row_d_flags(x, stats, flags, first, count, E);  // while the first tiles land

  const int ra = l0 + w * 16 + g;
  const T* q_w = q_s + w * 16 * LD;
  int64_t rb[2] = {0, 0};
  if (mask.is_array()) {
    rb[0] = ra < L ? mask.row_base(n, ra) : 0;
    rb[1] = ra + 8 < L ? mask.row_base(n, ra + 8) : 0;
  }
  // Tile i lies in buffer i % 2, copied during tile i - 1.
  float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f};
  for (int i = 0; i < tiles; ++i) {
    if (i + 1 < tiles) {
      const int c = (j0 + i + 1) * BC;
      copy_tile<T, EB, BC, bs::kThreads, WG>(k_s + ((i + 1) & 1) * BC * LD, k_head + int64_t{c} * k_ld, min(BC, S - c), E,
                                             k_ld, vec);
    }
    cp_async_commit();
    cp_async_wait<1>();
    if constexpr (WG) fence_proxy_async();  // cp.async's writes, read by wgmma
    __syncthreads();
    const int c0 = (j0 + i) * BC;
    float s[NB][4];
    if constexpr (WG) {
      // S = Q K^T for the block's 64 rows, both tiles K-major in shared memory.
      auto step_e = [](int rows, int kk) { return uint32_t((kk >> 2) * rows * 8 + (kk & 3) * 2); };
      const WgDesc d_q(wgmma_desc_sw128(q_s, 16, 1024));
      const WgDesc d_k(wgmma_desc_sw128(k_s + (i & 1) * BC * LD, 16, 1024));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < EB / 16; ++kk) wgmma16_ss<T, BC>(s, d_q.at(step_e(BR, kk)), d_k.at(step_e(BC, kk)), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_fragments(s);
    } else {
      scores16<T, NB, EB>(s, q_w, k_s + (i & 1) * BC * LD, lane);
    }
    mask_row_scores<NB>(s, mask, rb, ra, c0, mask.tile_hides(c0, BC, l0, BR, S), scale_log2, t, L, S);
    lse_step<NB, true>(s, m, l);
    __syncthreads();  // the buffer this tile read is the next copy's
  }
  cp_async_wait<0>();
  float lse[2];
  lse_final(m, l, lse, sink_log2(mask_kind, mask_base, int(n % H_q)));
  if (t == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = ra + 8 * rr;
      if (r < L) stats[(n * L + r) * 2] = lse[rr];
    }
  }
}

}  // namespace fa
