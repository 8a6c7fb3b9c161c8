// The float32 keys pass with dQ (backward.cu's fa_backward_keysq) on Hopper
// (sm_90a), E = 64: four of its five products on wgmma (3xTF32), dQ on
// mma.sync as there.
//
// With mma.sync every warp loads and splits each Q and dO element it reads,
// for each 16 keys of its own (Nsight Compute: 6.6 issued instructions a
// TF32 mma). Here a warpgroup's products read their shared-memory operands
// as TF32 in wgmma's K-major core-matrix layout (wgmma.cuh): each tile's
// float32 values themselves (wgmma takes a float32 word's upper 19 bits, its
// TF32 high part) and the low parts beside them, made once as a tile lands.
// TF32 operands must be K-major, so each row tile of Q and dO lies twice:
// along the head dim (the B operand of S^T = K Q^T and dP^T = V dO^T) and
// along the rows (of dK += dS^T Q and dV += P^T dO), its rows there in
// paired order (within each 8, slots 2t and 2t + 1... see CopyT) so that the
// accumulators of S^T and dP^T are, as they stand, the A operands of dV and
// dK (P^T and dS^T split in registers, no shuffles).
//
// Block: two warpgroups x 64 keys... the same 64 keys: K and V with their
// low parts (64 KB) shared, each warpgroup taking every other row tile of
// 32 with its own tiles (64 KB) and dS^T (10 KB) and named barriers, their
// dK and dV sums meeting at the end. dQ += dS K on mma.sync from dS^T in
// shared memory runs while dV's and dK's products do. A tile that holds a
// value that is not finite takes its score products in float32 FMA (IEEE's
// infinities and NaN, as the reference) and backward.cu's guarded sums.

#include "backward_tf32.cuh"
#include "pingpong.cuh"
#include "wgmma.cuh"

namespace fa {

namespace keys_wg32 {

constexpr int E = 64, BK = bs::kKeys, BR = bs::kRowTile, LDS = bs::ld_ds(BR), NB = BR / 8, NO = E / 8;
constexpr int kGroups = 2, kGroupThreads = 128, kThreads = kGroups * kGroupThreads;
static_assert(BK == 64, "a warpgroup's 64 keys");

// A warpgroup's row tile: Q and dO along the head dim, and along the rows
// (qt, dot: E rows x BR in paired order, CopyT), each with its low parts;
// after the last tile, the warpgroup's dK and dV sums (2 NO x 4 a thread)
// for the first warpgroup to add.
struct Group {
  union {
    struct {
      float q[BR * E], q_lo[BR * E], d_out[BR * E], do_lo[BR * E];
    };
    float sums[2 * NO * 4 * kGroupThreads];
  };
  float qt[E * BR], qt_lo[E * BR], dot[E * BR], dot_lo[E * BR];
  float ds[BK * LDS];  // dS^T: a key's rows LDS apart
  float lse[BR], d[BR];
};
struct Smem {
  float k[BK * E], k_lo[BK * E], v[BK * E], v_lo[BK * E];
  Group group[kGroups];
};

// Element (row, col) of a K-major tile of E columns: core matrices of 8 rows
// x 4 columns (128 bytes), row-major over (row / 8, col / 4).
__device__ __forceinline__ int at(int row, int col) {
  return ((row >> 3) * (E / 4) + (col >> 2)) * 32 + (row & 7) * 4 + (col & 3);
}

// Element (t, g) of a tile in that layout, lane = 4 g + t: the B operand
// fragment's (k, n) of mma.sync m16n8k8, whose other elements lie at
// constant offsets from it (row + 8 j: 32 E / 4 j; column + 8 i: 64 i; row
// + 4: 16).
__device__ __forceinline__ int lane_at(int lane) { return at(lane & 3, lane >> 2); }

// x less its TF32 high part (its upper 19 bits, as wgmma reads it).
__device__ __forceinline__ float low_part(float x) {
  uint32_t hi, lo;
  split_finite(x, hi, lo);
  return __uint_as_float(lo);
}

// A tile of ROWS rows from src (rows ld apart, count of them; zeros past
// them) into dst by cp.async: 16-byte chunk idx is core-matrix row idx % 8
// of core matrix idx / 8, so that 8 neighbouring threads fill one core
// matrix (no bank conflicts) and chunk idx lands at dst + 4 idx.
template <int ROWS, int THREADS = kGroupThreads>
struct Copy {
  static constexpr int PER = ROWS * E / 4 / THREADS;
  static __device__ __forceinline__ int row(int idx) { return ((idx >> 3) / (E / 4)) * 8 + (idx & 7); }
  static __device__ __forceinline__ void issue(float* dst, const float* src, int64_t ld, int count, int tid) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int idx = tid + i * THREADS, r = row(idx);
      const bool valid = r < count;
      cp_async16(dst + 4 * idx, valid ? src + r * ld + ((idx >> 3) % (E / 4)) * 4 : src, valid);
    }
  }
  // After cp_async_wait_all: this thread's chunks' low parts into lo;
  // whether one of them holds a value that is not finite.
  static __device__ __forceinline__ bool split(const float* tile, float* lo, int tid) {
    bool bad = false;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int idx = tid + i * THREADS;
      const float4 x = *reinterpret_cast<const float4*>(tile + 4 * idx);
      bad |= !(isfinite(x.x) && isfinite(x.y) && isfinite(x.z) && isfinite(x.w));
      *reinterpret_cast<float4*>(lo + 4 * idx) = make_float4(low_part(x.x), low_part(x.y), low_part(x.z), low_part(x.w));
    }
    return bad;
  }
};

// 4 bytes global -> shared, asynchronously; zero when !valid.
__device__ __forceinline__ void cp_async4_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0));
}

// A row tile (BR rows of src, rows ld apart, count of them; zeros past
// them) transposed: E rows of BR, K-major along the rows (core matrices of 8
// head-dim columns x 4 slots), each 8 rows in paired order: slots 0-3 hold
// rows 0, 2, 4, 6 and slots 4-7 rows 1, 3, 5, 7, so that slot t and t + 4
// are the rows 2t and 2t + 1 whose scores a thread holds (wgmma.cuh's D
// and A layouts). Each thread copies 4 floats into each of its chunks by
// 4-byte cp.async (a warp's loads: 32 consecutive columns of a row).
struct CopyT {
  static constexpr int PER = E * BR / 4 / kGroupThreads;
  // chunk c: column c % E, slots 4 (c / E) .. + 3
  static __device__ __forceinline__ int chunk(int c) {
    const int e = c % E, s4 = c / E;
    return ((e >> 3) * (BR / 4) + s4) * 32 + (e & 7) * 4;
  }
  static __device__ __forceinline__ void issue(float* dst, const float* src, int64_t ld, int count, int tid) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = tid + i * kGroupThreads, e = c % E, s4 = c / E;
      const int r0 = (s4 >> 1) * 8 + (s4 & 1);  // the chunk's first row; then + 2, + 4, + 6
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = r0 + 2 * j;
        const bool valid = r < count;
        cp_async4_zfill(dst + chunk(c) + j, valid ? src + r * ld + e : src, valid);
      }
    }
  }
  static __device__ __forceinline__ void split(const float* tile, float* lo, int tid) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int at = chunk(tid + i * kGroupThreads);
      const float4 x = *reinterpret_cast<const float4*>(tile + at);
      *reinterpret_cast<float4*>(lo + at) = make_float4(low_part(x.x), low_part(x.y), low_part(x.z), low_part(x.w));
    }
  }
};

// acc (64 keys x E) = W X over the row tile in 3xTF32: W (P^T or dS^T) in
// the accumulator layout, which is the A layout of the paired slots, split
// here; X (dO or Q) transposed in shared memory with its low parts (CopyT).
// Issued, not waited for; wh and wl hold W's parts until the wait.
__device__ __forceinline__ void products_t(float (&acc)[NO][4], uint32_t (&wh)[NB][4], uint32_t (&wl)[NB][4],
                                           const float (&w)[NB][4], const float* x, const float* x_lo) {
  constexpr uint32_t kLbo = 128, kSbo = 8 * BR * 4;
  constexpr uint64_t kStep = 256 >> 4;
#pragma unroll
  for (int kb = 0; kb < NB; ++kb) {
    split_tf32(w[kb][0], wh[kb][0], wl[kb][0]);  // key g, slot t (row 2t)
    split_tf32(w[kb][2], wh[kb][1], wl[kb][1]);  // key g + 8
    split_tf32(w[kb][1], wh[kb][2], wl[kb][2]);  // key g, slot t + 4 (row 2t + 1)
    split_tf32(w[kb][3], wh[kb][3], wl[kb][3]);
  }
  const uint64_t dx = wgmma_desc(x, kLbo, kSbo), dxl = wgmma_desc(x_lo, kLbo, kSbo);
#pragma unroll
  for (int kb = 0; kb < NB; ++kb) {
    wgmma_64x64x8_rs(acc, wl[kb], dx + kb * kStep, kb > 0);
    wgmma_64x64x8_rs(acc, wh[kb], dxl + kb * kStep);
    wgmma_64x64x8_rs(acc, wh[kb], dx + kb * kStep);
  }
}

// d (64 keys x 32 rows) = A B^T over E in 3xTF32, A (the warpgroup's keys)
// and B (the row tile) with their low parts, all in shared memory.
__device__ __forceinline__ void scores_wg(float (&d)[NB][4], const float* a, const float* a_lo, const float* b,
                                          const float* b_lo) {
  constexpr uint32_t kLbo = 128, kSbo = 8 * E * 4;
  constexpr uint64_t kStep = 256 >> 4;  // 8 columns: two core matrices
  const uint64_t da = wgmma_desc(a, kLbo, kSbo), dal = wgmma_desc(a_lo, kLbo, kSbo);
  const uint64_t db = wgmma_desc(b, kLbo, kSbo), dbl = wgmma_desc(b_lo, kLbo, kSbo);
#pragma unroll
  for (int kk = 0; kk < E / 8; ++kk) {
    wgmma_tf32_ss(d, dal + kk * kStep, db + kk * kStep, kk > 0);
    wgmma_tf32_ss(d, da + kk * kStep, dbl + kk * kStep, 1);
    wgmma_tf32_ss(d, da + kk * kStep, db + kk * kStep, 1);
  }
}

// The same in float32 FMA for a tile pair that holds a value that is not
// finite (rare): keys ka - c0 (+ 8) of this thread against rows 2t (+ 1) of
// each 8.
__device__ __forceinline__ void scores_fma(float (&d)[NB][4], const float* a, const float* b, int w, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = w * 16 + g + 8 * (i >> 1), row = nb * 8 + 2 * t + (i & 1);
      float x = 0.0f;
#pragma unroll 1
      for (int e = 0; e < E; ++e) x = fmaf(a[at(key, e)], b[at(row, e)], x);
      d[nb][i] = x;
    }
}

// backward.cu's add_dq with K in the core-matrix layout: dQ += scale dS K
// for the row tile, each warp 16 rows x half the columns, added into dq by
// atomics.
__device__ __forceinline__ void add_dq(float* __restrict__ dq, const float* ds_s, const float* k_s, bool k_finite,
                                       int ld, int count, float scale, int w, int lane) {
  constexpr int NQ = E / 16;
  const int g = lane >> 2, t = lane & 3;
  const int rq = (w & 1) * 16, cq = (w >> 1) * (E / 2);
  float acc[NQ][4];
  zero(acc);
  if (k_finite) {
    const float* kl = k_s + lane_at(lane) + (cq / 4) * 32;
#pragma unroll 2
    for (int kk = 0; kk < BK / 8; ++kk) {
      uint32_t ah[4], al[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        split_tf32(ds_s[(kk * 8 + t + (i >> 1) * 4) * LDS + rq + g + (i & 1) * 8], ah[i], al[i]);
#pragma unroll
      for (int nb = 0; nb < NQ; ++nb) {
        uint32_t bh0, bl0, bh1, bl1;
        split_finite(kl[(kk * (E / 4) + 2 * nb) * 32], bh0, bl0);  // key 8 kk + t, column cq + 8 nb + g
        split_finite(kl[(kk * (E / 4) + 2 * nb) * 32 + 16], bh1, bl1);
        mma_terms<true>(acc[nb], ah, al, bh0, bh1, bl0, bl1);
      }
    }
  } else {
    accumulate_guarded_by<BK, NQ>(
        acc, [&](int k, float (&p)[2]) { p[0] = ds_s[k * LDS + rq + g], p[1] = ds_s[k * LDS + rq + g + 8]; },
        [&](int k, int c) { return k_s[at(k, cq + c)]; }, lane);
  }
#pragma unroll
  for (int nb = 0; nb < NQ; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = rq + g + 8 * (i >> 1), e = cq + nb * 8 + 2 * t + (i & 1);
      if (r < count) atomicAdd(dq + int64_t{r} * ld + e, acc[nb][i] * scale);
    }
}

}  // namespace keys_wg32

// One block: 64 keys against the rows of one query head, as backward.cu's
// backward_keys<float, 64, true> (its arguments, its outputs). The block's
// three warpgroups share K and V and take every third row tile each, with
// barriers of their own; their dK and dV sums meet at the end.
__device__ __forceinline__ void backward_keys_tf32_wg(const float* __restrict__ q, const float* __restrict__ k,
                                                      const float* __restrict__ v, const float* __restrict__ d_out,
                                                      const float* __restrict__ stats, const void* mask_data,
                                                      const int64_t* __restrict__ mask_base, void* dk, void* dv,
                                                      float* __restrict__ dq, int64_t slices, int H_q, int H_kv, int L,
                                                      int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2,
                                                      float scale, const BackwardLayout& lay, const Rows& dq_rows) {
  using namespace keys_wg32;
  extern __shared__ __align__(16) float smem[];
  Smem& sm = *reinterpret_cast<Smem*>(smem);
  const int wg = threadIdx.x / kGroupThreads, tid = threadIdx.x % kGroupThreads;
  const int w = tid >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int bar = 1 + wg;  // the warpgroup's named barrier
  Group& my = sm.group[wg];

  const BackwardBlock blk(slices, E);
  const int64_t n = blk.slice;
  const int c0 = blk.tile * BK;
  const int ratio = H_q / H_kv;
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const RowAt row_at(n, H_q, H_kv);

  bool k_finite, v_finite;
  {
    // K by the first warpgroup, V by the second
    if (wg < 2) Copy<BK>::issue(wg ? sm.v : sm.k, wg ? v + row_at.kv(lay.v, c0) : k + row_at.kv(lay.k, c0),
                                wg ? lay.v.sr : lay.k.sr, min(BK, S - c0), tid);
    cp_async_commit();
    cp_async_wait_all();
    const bool bad = wg < 2 && Copy<BK>::split(wg ? sm.v : sm.k, wg ? sm.v_lo : sm.k_lo, tid);
    k_finite = !__syncthreads_or(wg == 0 && bad);
    v_finite = !__syncthreads_or(wg == 1 && bad);
  }
  const int ka = c0 + w * 16 + g;
  const int row_begin = mask.row_begin(c0, L, S), row_end = mask.row_end(c0, BK, L, S);
  // A row tile's copies: along the head dim, and transposed (the latter
  // only once dV's and dK's products are done with the last).
  auto issue_rows = [&](int r0) {
    const int count = min(BR, L - r0);
    Copy<BR>::issue(my.q, q + row_at(lay.q, r0), lay.q.sr, count, tid);
    Copy<BR>::issue(my.d_out, d_out + row_at(lay.d_out, r0), lay.d_out.sr, count, tid);
  };
  auto issue_rows_t = [&](int r0) {
    const int count = min(BR, L - r0);
    CopyT::issue(my.qt, q + row_at(lay.q, r0), lay.q.sr, count, tid);
    CopyT::issue(my.dot, d_out + row_at(lay.d_out, r0), lay.d_out.sr, count, tid);
    cp_async_commit();
  };
  constexpr int kStride = kGroups * BR;
  const int first = row_begin + wg * BR;
  if (first < row_end) {
    issue_rows(first);
    issue_rows_t(first);
  }

  float dk_acc[NO][4], dv_acc[NO][4];
  zero(dk_acc);
  zero(dv_acc);
  for (int r0 = first; r0 < row_end; r0 += kStride) {
    const int count = min(BR, L - r0);
    cp_async_wait_all();
    const bool bad_q = Copy<BR>::split(my.q, my.q_lo, tid);
    const bool bad_do = Copy<BR>::split(my.d_out, my.do_lo, tid);
    CopyT::split(my.qt, my.qt_lo, tid);
    CopyT::split(my.dot, my.dot_lo, tid);
    if (tid < BR) {
      const bool in = tid < count;  // rows past L: lse = +inf makes their P 0
      my.lse[tid] = in ? stats[(n * L + r0 + tid) * 2] : INFINITY;
      my.d[tid] = in ? stats[(n * L + r0 + tid) * 2 + 1] : 0.0f;
    }
    fence_proxy_async();  // the tiles' stores, seen by wgmma
    const bool guard_q = named_or(bar, kGroupThreads, bad_q);
    const bool guard_do = named_or(bar, kGroupThreads, bad_do);

    float p[NB][4], ds[NB][4];
    // wgmma's issue and wait stay out of branches (the compiler would
    // serialize the products): the rare tiles' float32 sums replace them.
    wgmma_fence();
    scores_wg(p, sm.k, sm.k_lo, my.q, my.q_lo);
    scores_wg(ds, sm.v, sm.v_lo, my.d_out, my.do_lo);
    wgmma_commit();
    wgmma_wait_all();
    fence_fragments(p);
    fence_fragments(ds);
    if (!(k_finite && !guard_q)) scores_fma(p, sm.k, my.q, w, lane);
    if (!(v_finite && !guard_do)) scores_fma(ds, sm.v, my.d_out, w, lane);
    key_tile_ds<NB>(p, ds, mask, n, ka, r0, mask.tile_hides(c0, BK, r0, BR, S), my.lse, my.d, scale_log2, t, L, S);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(my.ds + (w * 16 + g + 8 * h) * LDS + nb * 8 + 2 * t) =
            make_float2(ds[nb][2 * h], ds[nb][2 * h + 1]);
    if (guard_do) accumulate_guarded_at<NB, NO>(dv_acc, p, [&](int kr, int c) { return my.d_out[at(kr, c)]; }, lane);
    if (guard_q) accumulate_guarded_at<NB, NO>(dk_acc, ds, [&](int kr, int c) { return my.q[at(kr, c)]; }, lane);
    // dV and dK of the tile, each into a fresh accumulator added to the sum
    // in float32 (backward.cu's accumulate: chaining every tile through the
    // tensor cores' accumulation cost float32 accuracy).
    float dv_part[NO][4], dk_part[NO][4];
    uint32_t ph[NB][4], pl[NB][4], sh[NB][4], sl[NB][4];
    wgmma_fence();
    products_t(dv_part, ph, pl, p, my.dot, my.dot_lo);
    products_t(dk_part, sh, sl, ds, my.qt, my.qt_lo);
    wgmma_commit();
    named_sync(bar, kGroupThreads);  // every warp's dS^T staged; Q and dO along E read
    if (r0 + kStride < row_end) issue_rows(r0 + kStride);
    add_dq(dq + row_at(dq_rows, r0), my.ds, sm.k, k_finite, dq_rows.sr, count, scale, w, lane);
    wgmma_wait_all();
    fence_fragments(dv_part);
    fence_fragments(dk_part);
    fence_fragments(ph);
    fence_fragments(pl);
    fence_fragments(sh);
    fence_fragments(sl);
    if (!guard_do) {
#pragma unroll
      for (int eb = 0; eb < NO; ++eb) add_fresh(dv_acc[eb], dv_part[eb]);
    }
    if (!guard_q) {
#pragma unroll
      for (int eb = 0; eb < NO; ++eb) add_fresh(dk_acc[eb], dk_part[eb]);
    }
    named_sync(bar, kGroupThreads);  // dS^T and the transposed tiles read
    if (r0 + kStride < row_end) issue_rows_t(r0 + kStride);
  }
  // The warpgroups' sums into the first one's, in a fixed order.
  __syncthreads();
  if (wg > 0) {
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        my.sums[(eb * 4 + i) * kGroupThreads + tid] = dk_acc[eb][i];
        my.sums[((NO + eb) * 4 + i) * kGroupThreads + tid] = dv_acc[eb][i];
      }
  }
  __syncthreads();
  if (wg > 0) return;
#pragma unroll
  for (int o = 1; o < kGroups; ++o)
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        dk_acc[eb][i] += sm.group[o].sums[(eb * 4 + i) * kGroupThreads + tid];
        dv_acc[eb][i] += sm.group[o].sums[((NO + eb) * 4 + i) * kGroupThreads + tid];
      }
  // float32 gradients, stored (no GQA) or added into the group's sums
  float* dk_head = static_cast<float*>(dk) + row_at.kv(lay.dk, 0);
  float* dv_head = static_cast<float*>(dv) + row_at.kv(lay.dv, 0);
  store_dk_dv<float, NO>(dk_acc, dv_acc, dk_head, dv_head, lay.dk.sr, lay.dv.sr, ratio != 1, row_begin < row_end, ka,
                         S, E, 0, scale, lane);
}

}  // namespace fa

// fa_backward_keysqwg<n|c>_float32_64: backward.cu's fa_backward_keysq<n|c>_
// float32_64 (the same arguments) on Hopper; -DFA_KIND=0 | 1 as there.
#if !defined(FA_KIND) || FA_E != 64 || FA_DTYPE != 0
#error "fa_backward_keysqwg: float32, E = 64, a mask kind compiled in"
#endif
extern "C" __global__ void __launch_bounds__(fa::keys_wg32::kThreads, 1)
    FA_CAT5(FA_CAT3(fa_backward_keysqwg, FA_KIND_LETTER, _), float32, _, 64, )(
        const float* q, const float* k, const float* v, const float* d_out, const float* stats, const void* mask,
        const int64_t* mask_base, void* dk, void* dv, float* dq, int slices, int H_q, int H_kv, int L, int S, int E,
        int mask_kind, int mask_rs, int mask_cs, float scale_log2, float scale, FA_BACKWARD_LAYOUT_PARAMS, int dq_sb,
        int dq_sh, int dq_sr) {
  fa::backward_keys_tf32_wg(q, k, v, d_out, stats, mask, mask_base, dk, dv, dq, slices, H_q, H_kv, L, S,
                            FA_KIND | (mask_kind & ~fa::kKindBits), mask_rs, mask_cs, scale_log2, scale,
                            FA_BACKWARD_LAYOUT, fa::Rows{dq_sb, dq_sh, dq_sr});
}
