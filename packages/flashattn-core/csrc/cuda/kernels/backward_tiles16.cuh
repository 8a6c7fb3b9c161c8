// Tiles of the 16-bit backward's kernels (backward_f16.cu, backward_wg.cu):
// their copies into shared memory (row-padded, or in wgmma's swizzled
// layout), the scan for values that are not finite, the warp's S = A B^T on
// mma.sync, the rows' D and flags, and a row tile's dQ (mma.sync, float32
// atomics).

#pragma once

#include <cstdint>

#include "backward_parts.cuh"
#include "backward_shapes.h"
#include "mma.cuh"
#include "swizzle.cuh"

namespace fa {

namespace bs = backward_shapes;

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}

template <typename T>
__device__ __forceinline__ uint32_t bits16(T x) {
  return *reinterpret_cast<const unsigned short*>(&x);
}

// Element (r, c) of a tile of ROWS rows of EB columns: rows ld16(EB) apart,
// or (SW) in wgmma's swizzled layout (swizzle.cuh).
template <int EB, int ROWS, bool SW>
__device__ __forceinline__ int tile_at(int r, int c) {
  if constexpr (SW) {
    return sw_at<ROWS>(r, c);
  } else {
    return r * bs::ld16(EB) + c;
  }
}

// ROWS rows of E elements (from src, rows ld elements apart) into dst
// (tile_at's layout), zeros past `count` rows and E columns, in 16-byte
// chunks. A thread copies chunks threadIdx.x + i THREADS: by cp.async when
// `vec`, else element by element and stored at once, so that either way the
// chunks a thread scans (tile_nonfinite) are its own.
template <typename T, int EB, int ROWS, int THREADS, bool SW = false>
__device__ __forceinline__ void copy_tile(T* dst, const T* src, int count, int E, int ld, bool vec) {
  constexpr int CH = EB / 8, STEP = THREADS / CH;
  static_assert(ROWS * CH % THREADS == 0 && THREADS % CH == 0, "whole chunks a thread, one column a thread");
  // The thread's column c and first row r0, then rows STEP apart: one
  // pointer stepped, where the row stride is known only at run time.
  const int r0 = threadIdx.x / CH, c = threadIdx.x % CH;
  const T* at = src + int64_t{r0} * ld + c * 8;
  const int64_t step = int64_t{STEP} * ld;
#pragma unroll
  for (int i = 0; i < ROWS * CH / THREADS; ++i, at += step) {
    const int r = r0 + i * STEP;
    T* d = dst + tile_at<EB, ROWS, SW>(r, c * 8);
    if (vec) {
      const bool ok = r < count && c * 8 < E;
      cp_async16(d, ok ? at : src, ok);
    } else {
      uint32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int e = c * 8 + 2 * j;
        const T lo = r < count && e < E ? at[2 * j] : from_f<T>(0.0f);
        const T hi = r < count && e + 1 < E ? at[2 * j + 1] : from_f<T>(0.0f);
        x[j] = bits16(lo) | bits16(hi) << 16;
      }
      *reinterpret_cast<uint4*>(d) = make_uint4(x[0], x[1], x[2], x[3]);
    }
  }
}

// A row tile's statistics (stats: its first row's (lse, D) pairs) into
// lse_s and d_s by the block's first ROWS threads: lse = +inf and D = 0
// past `count` rows (P = 0 there).
template <int ROWS>
__device__ __forceinline__ void copy_row_stats(float* lse_s, float* d_s, const float* stats, int count) {
  if (threadIdx.x < ROWS) {
    const int j = threadIdx.x;
    if (j < count) {
      cp_async4(lse_s + j, stats + j * 2);
      cp_async4(d_s + j, stats + j * 2 + 1);
    } else {
      lse_s[j] = INFINITY;
      d_s[j] = 0.0f;
    }
  }
}

// Whether the chunks this thread copied into a tile hold a value that is not
// finite (read once its copies have landed).
template <typename T, int EB, int ROWS, int THREADS, bool SW = false>
__device__ __forceinline__ bool tile_nonfinite(const T* tile) {
  constexpr int CH = EB / 8;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < ROWS * CH / THREADS; ++i) {
    const int idx = threadIdx.x + i * THREADS;
    const uint4 w = *reinterpret_cast<const uint4*>(tile + tile_at<EB, ROWS, SW>(idx / CH, (idx % CH) * 8));
    bad |= pair_nonfinite<T>(w.x) | pair_nonfinite<T>(w.y) | pair_nonfinite<T>(w.z) | pair_nonfinite<T>(w.w);
  }
  return bad;
}

// Whether every input can be copied 16 bytes at a time (pointers and rows).
__device__ __forceinline__ bool vector_copies(int E, const void* a, const void* b, const void* c, const void* d,
                                              bool rows16 = true) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                         reinterpret_cast<uintptr_t>(c) | reinterpret_cast<uintptr_t>(d);
  return E % 8 == 0 && (bits & 15) == 0 && rows16;
}

// x (a pair of dQ's columns e, e + 1) added into row-contiguous float32 dQ;
// one 8-byte atomic where the pair is whole and aligned (sm_90).
__device__ __forceinline__ void add_pair(float* dst, float x0, float x1, int e, int E) {
#if __CUDA_ARCH__ >= 900
  if (e + 1 < E && E % 2 == 0) {
    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x0, x1));
    return;
  }
#endif
  atomicAdd(dst, x0);
  if (e + 1 < E) atomicAdd(dst + 1, x1);
}

// A statistics block's rows of Q, O and dO (head n from row l0): each
// array's first row and its row stride.
template <typename T>
struct RowBlock {
  const T *q, *o, *d_out;
  int q_ld, o_ld, d_ld;
  __device__ __forceinline__ RowBlock(const T* q_, const T* o_, const T* d_, const BackwardLayout& lay, int64_t n,
                                      int H_q, int l0)
      : q(head_of(q_, lay.q, n, H_q) + int64_t{l0} * lay.q.sr),
        o(head_of(o_, lay.o, n, H_q) + int64_t{l0} * lay.o.sr),
        d_out(head_of(d_, lay.d_out, n, H_q) + int64_t{l0} * lay.d_out.sr),
        q_ld(lay.q.sr),
        o_ld(lay.o.sr),
        d_ld(lay.d_out.sr) {}
};

// The statistics pass's per-row part, a warp a row: D = rowsum(dO * O)
// into stats (lse, D) and whether the row's Q or dO holds a value that is
// not finite into flags; the block's rows, first .. first + count of all.
template <typename T>
__device__ __forceinline__ void row_d_flags(const RowBlock<T>& x, float* __restrict__ stats, int* __restrict__ flags,
                                            int64_t first, int count, int E) {
  const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < count; r += warps) {
    float d = 0.0f;
    bool bad = false;
    for (int e = lane; e < E; e += 32) {
      const float y = to_f(x.d_out[int64_t{r} * x.d_ld + e]);
      d += y * to_f(x.o[int64_t{r} * x.o_ld + e]);
      bad |= !isfinite(y) || !isfinite(to_f(x.q[int64_t{r} * x.q_ld + e]));
    }
    d = warp_sum(d);
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
      stats[(first + r) * 2 + 1] = d;
      flags[first + r] = bad;
    }
  }
}

// The same where every input can be read 16 bytes at a time
// (vector_copies): EB / 8 lanes a row, every load of the thread's rows
// issued before the first sum (a warp a row, 2 bytes a load, left the pass
// waiting on memory: 0.20 ms at hd128 8K).
template <typename T, int EB, int ROWS, int THREADS>
__device__ __forceinline__ void row_d_flags16(const RowBlock<T>& rows, float* __restrict__ stats,
                                              int* __restrict__ flags, int64_t first, int count, int E) {
  constexpr int CH = EB / 8, N = ROWS * CH / THREADS;
  static_assert(32 % CH == 0 && ROWS * CH % THREADS == 0, "a row's lanes within one warp, whole chunks a thread");
  uint4 x[N], y[N], z[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int idx = threadIdx.x + i * THREADS, r = idx / CH, c = idx % CH;
    const bool ok = r < count && c * 8 < E;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    x[i] = ok ? *reinterpret_cast<const uint4*>(rows.d_out + int64_t{r} * rows.d_ld + c * 8) : zero;
    y[i] = ok ? *reinterpret_cast<const uint4*>(rows.o + int64_t{r} * rows.o_ld + c * 8) : zero;
    z[i] = ok ? *reinterpret_cast<const uint4*>(rows.q + int64_t{r} * rows.q_ld + c * 8) : zero;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint32_t xs[4] = {x[i].x, x[i].y, x[i].z, x[i].w}, ys[4] = {y[i].x, y[i].y, y[i].z, y[i].w},
                   zs[4] = {z[i].x, z[i].y, z[i].z, z[i].w};
    float d = 0.0f;
    int bad = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      d += unpack_half<T>(xs[j], 0) * unpack_half<T>(ys[j], 0) + unpack_half<T>(xs[j], 1) * unpack_half<T>(ys[j], 1);
      bad |= pair_nonfinite<T>(xs[j]) | pair_nonfinite<T>(zs[j]);
    }
#pragma unroll
    for (int off = CH / 2; off > 0; off >>= 1) {
      d += __shfl_xor_sync(0xffffffffu, d, off);
      bad |= __shfl_xor_sync(0xffffffffu, bad, off);
    }
    const int idx = threadIdx.x + i * THREADS, r = idx / CH;
    if (idx % CH == 0 && r < count) {
      stats[(first + r) * 2 + 1] = d;
      flags[first + r] = bad;
    }
  }
}

// s = A B^T for the warp's 16 rows of A (a_rows) against NB x 8 rows of B
// (b_rows), both 16-bit in shared memory, inner dim EB. ldmatrix lanes: A's
// 16 x 16 blocks as rows lane % 16, column half lane / 16; B's two 8-row
// blocks as rows lane % 8 (+ 8 from lane 16), column half (lane / 8) % 2.
template <typename T, int NB, int EB>
__device__ __forceinline__ void scores16(float (&s)[NB][4], const T* a_rows, const T* b_rows, int lane) {
  constexpr int LD = bs::ld16(EB);
  static_assert(NB % 2 == 0, "key blocks in pairs");
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nb][i] = 0.0f;
  const T* a = a_rows + (lane & 15) * LD + (lane >> 4) * 8;
  const T* b = b_rows + ((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < EB / 16; ++kk) {
    uint32_t af[4];
    ldmatrix_x4(af, a + kk * 16);
#pragma unroll
    for (int nb = 0; nb < NB; nb += 2) {
      uint32_t bf[4];
      ldmatrix_x4(bf, b + nb * 8 * LD + kk * 16);
      mma16816<T>(s[nb], af, bf[0], bf[1]);
      mma16816<T>(s[nb + 1], af, bf[2], bf[3]);
    }
  }
}

// A row tile's dQ block for this warp: rows 16 wm .., columns 32 wn .. (four
// 8-column blocks) of dS K over BK keys into qa, dS read transposed from
// dS^T (BK keys x rows, rows LDS apart), K (BK keys x EB, tile_at's layout)
// transposed; a key tile that is not finite (guard_k) in float32 FMA
// skipping zero weights.
template <typename T, int EB, int BK, int LDS, bool SW>
__device__ __forceinline__ void dq_products16(float (&qa)[4][4], const T* ds_s, const T* k_s, bool guard_k, int wm,
                                              int wn, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) qa[nt][j] = 0.0f;
  if (!guard_k) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, ds_s + (kk * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + wm * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, k_s + tile_at<EB, BK, SW>(kk * 16 + (lane & 15), wn * 32 + np * 16 + (lane >> 4) * 8));
        mma16816<T>(qa[2 * np], a, bf[0], bf[1]);
        mma16816<T>(qa[2 * np + 1], a, bf[2], bf[3]);
      }
    }
  } else {
#pragma unroll 1
    for (int kk = 0; kk < BK; ++kk)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float x = to_f(ds_s[kk * LDS + wm * 16 + g + 8 * (j >> 1)]);
          if (x != 0.0f)
            qa[nt][j] = fmaf(x, to_f(k_s[tile_at<EB, BK, SW>(kk, wn * 32 + nt * 8 + 2 * t + (j & 1))]), qa[nt][j]);
        }
  }
}

// The 16-bit backward's float32 sums, one buffer: dQ's (B H_q L E), then
// under GQA dK's and dV's (B H_kv S E each), which the keys pass adds its
// keys' shares into for the group's query heads. The statistics launch
// zeroes the buffer, backward_dq.cu casts it to the gradients: MLX's fills
// of dK's and dV's float32 outputs ran at a third of the memory's speed
// (0.041 ms of forward + backward at hd128 4K, H100) and their casts took a
// launch each.
struct GradSums {
  int64_t n_q, n_kv;  // dQ's elements; dK's and dV's each, 0 without GQA
  __device__ __forceinline__ GradSums(int64_t slices, int H_q, int H_kv, int L, int S, int E)
      : n_q(slices * L * E), n_kv(H_q == H_kv ? 0 : slices / H_q * H_kv * S * E) {}
};

// A keys block's dK and dV (rows ka, ka + 8 of this thread): stored in T
// where the layout puts them without GQA; under GQA added into their float32
// sums after dQ's (GradSums, row-contiguous), and then only by a block that
// saw some row (`any_rows`).
template <typename T, int NO>
__device__ __forceinline__ void store_dk_dv16(const float (&dk_acc)[NO][4], const float (&dv_acc)[NO][4], void* dk,
                                              void* dv, float* dq, const BackwardLayout& lay, int64_t slices,
                                              int H_q, int H_kv, int L, int S, int E, int64_t kv_slice,
                                              bool any_rows, int ka, float scale, int lane) {
  if (H_q == H_kv) {
    store_acc<T, NO>(dk_acc, head_of(static_cast<T*>(dk), lay.dk, kv_slice, H_kv), ka, S, E, 0, scale, lane,
                     lay.dk.sr);
    store_acc<T, NO>(dv_acc, head_of(static_cast<T*>(dv), lay.dv, kv_slice, H_kv), ka, S, E, 0, 1.0f, lane,
                     lay.dv.sr);
  } else if (any_rows) {
    const GradSums sums(slices, H_q, H_kv, L, S, E);
    const int64_t at = kv_slice * S * E;
    add_acc<NO>(dk_acc, dq + sums.n_q + at, ka, S, E, 0, scale, lane, E);
    add_acc<NO>(dv_acc, dq + sums.n_q + sums.n_kv + at, ka, S, E, 0, 1.0f, lane, E);
  }
}

// n floats from dst zeroed by the block, 16 bytes a store where aligned.
__device__ __forceinline__ void zero_rows(float* dst, int64_t n) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    for (int64_t i = threadIdx.x * 4; i + 3 < n; i += blockDim.x * 4)
      *reinterpret_cast<float4*>(dst + i) = make_float4(0, 0, 0, 0);
    for (int64_t i = n / 4 * 4 + threadIdx.x; i < n; i += blockDim.x) dst[i] = 0.0f;
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = 0.0f;
  }
}

// This block's share of n floats at dst zeroed (the statistics launch's
// blocks split dK's and dV's sums evenly, in multiples of 4 floats, so the
// shares keep dst's alignment; grid.x counts the blocks).
__device__ __forceinline__ void zero_share(float* dst, int64_t n) {
  const int64_t blocks = gridDim.x, chunk = ((n + blocks - 1) / blocks + 3) / 4 * 4, begin = blockIdx.x * chunk;
  if (begin < n) zero_rows(dst + begin, (begin + chunk < n ? begin + chunk : n) - begin);
}

// qa (dq_products16's block of rows r0 + 16 wm ..) times scale added into
// float32 dQ (row-contiguous, E columns) by atomics.
__device__ __forceinline__ void add_dq16(const float (&qa)[4][4], float* __restrict__ dq, int64_t n, int L, int E,
                                         int r0, int wm, int wn, float scale, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + wm * 16 + g + 8 * h, e = wn * 32 + nt * 8 + 2 * t;
      if (r < L && e < E) add_pair(dq + (n * L + r) * E + e, qa[nt][2 * h] * scale, qa[nt][2 * h + 1] * scale, e, E);
    }
}

// The same block of dQ times scale into a staging tile of BR x EB floats
// (rows contiguous, row 16 wm + g .. of the tile) that one bulk reduce then
// adds into dQ's sums (backward_wg.cu, E = EB).
template <int EB>
__device__ __forceinline__ void stage_dq16(const float (&qa)[4][4], float* stage, int wm, int wn, float scale,
                                           int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 16 + g + 8 * h, e = wn * 32 + nt * 8 + 2 * t;
      *reinterpret_cast<float2*>(stage + r * EB + e) = make_float2(qa[nt][2 * h] * scale, qa[nt][2 * h + 1] * scale);
    }
}

}  // namespace fa
