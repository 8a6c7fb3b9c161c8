// fa_backward_keyswgsc_float32_64: the float32 keys pass (dQ, dK, dV) at
// float32 accuracy on Hopper's float16 tensor cores, head dim 64, under a
// causal mask (its window an argument). fa_f32_split4_64 (f32_split.cu) has
// made K and V two float16 terms a row, every 128-row tile scaled by a power
// of two of its own, and found the shifts of Q's and dO's tiles too; the
// pass splits each row tile of Q and dO itself, from float32 rows it copies
// (as terms in memory they held 56 MiB more at qwen05b 8K). Each of the five
// products then takes three: A B = A hi B hi + A hi B lo + A lo B hi, as
// 3xTF32 does on TF32 tensor cores of half the rate (the forward's
// prefill_f32s_wg.cu does the same).
//
// backward_wg.cu's block: 128 keys, two warpgroups of 64, row tiles of 64;
// S^T = K Q^T and dP^T = V dO^T on wgmma from shared memory, dV += P^T dO
// and dK += dS^T Q with P^T / dS^T from registers, dQ += dS K on mma.sync
// from dS^T in shared memory, added into dQ by atomics. Scales:
//   - S^T and dP^T come out scaled by their tiles' shifts, undone in float32
//     (the softmax scale; dP^T multiplied) before P^T and dS^T;
//   - dS^T has no bound: the block's largest |dS| sets a power of two c
//     (its largest to [2^14, 2^15)), dS 2^c goes to shared memory for dQ,
//     whose sums take 2^-c back before the atomics;
//   - dK and dV are summed over row tiles of different shifts, in units of
//     a power of two (Ak, Av) that only falls: a tile whose terms would pass
//     float16's range lowers it (the sums rescaled), a tile of smaller
//     values enters scaled down (what it then loses is below the float32
//     rounding of the larger terms already in the sums).
// A tile marked bad (a value that is not finite: the split's kBad) takes its
// products in plain float32 from the float32 inputs, into the sums in their
// units, skipping zero weights (a value a row cannot see never meets its
// zero weight); rare and slow (scalar loads).

#include <climits>
#include <cstdint>

#include "backward_parts.cuh"
#include "backward_shapes.h"
#include "backward_tiles16.cuh"
#include "f32_split.cuh"
#include "unit.cuh"
#include "wgmma.cuh"

#if FA_DTYPE != 0 || FA_E != 64 || !defined(FA_KIND)
#error "backward_f32s_wg.cu: float32, FA_E 64 and FA_KIND"
#endif

namespace fa {
namespace {

constexpr int kE = bs::kF32sE, kE2 = 2 * kE;  // the head dim, a stored row's halves ([hi | lo])
constexpr int BK = bs::kKeys16, BR = bs::kF32sRows, NB = BR / 8, NO = kE / 8, TH = bs::kKeysThreads16;
constexpr int LDS = BR + 8;       // dS^T's rows (halves or floats)
constexpr int kUnset = INT_MAX / 4;  // a sum's unit before its first tile

// x 2^e for e far outside float32's exponents (shifts of two tiles summed):
// two factors, each within range.
struct Pow2 {
  float a, b;
  __device__ __forceinline__ explicit Pow2(int e) {
    const int e1 = e / 2, e2 = e - e1;
    a = f32_split::pow2(max(-126, min(127, e1)));
    b = f32_split::pow2(max(-126, min(127, e2)));
  }
};

template <int N>
__device__ __forceinline__ void scale_by(float (&x)[N][4], float f) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) x[i][j] *= f;
}

// A sum in units of 2^unit (acc = sum x 2^unit) into units of 2^to (a sum
// not begun holds zeros and takes `to` as it is).
template <int N>
__device__ __forceinline__ void to_unit(float (&acc)[N][4], int& unit, int to) {
  if (unit != kUnset) {
    const Pow2 f(to - unit);
    scale_by(acc, f.a);
    scale_by(acc, f.b);
  }
  unit = to;
}

// Two float16 terms (hi, lo) of each value times 2^e (Pow2's two factors):
// hi + lo scaled and split again, so that dS need not stay in registers.
template <int NK>
__device__ __forceinline__ void rescale_terms(uint32_t (&t)[2][NK][4], const Pow2& f) {
#pragma unroll
  for (int kk = 0; kk < NK; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float a = (unpack_half<__half>(t[0][kk][j], 0) + unpack_half<__half>(t[1][kk][j], 0)) * f.a * f.b;
      const float b = (unpack_half<__half>(t[0][kk][j], 1) + unpack_half<__half>(t[1][kk][j], 1)) * f.a * f.b;
      t[0][kk][j] = pack2<__half>(a, b);
      t[1][kk][j] = pack2<__half>(a - unpack_half<__half>(t[0][kk][j], 0), b - unpack_half<__half>(t[0][kk][j], 1));
    }
}

// A staged row tile (BR x E float32, rows contiguous) as two float16 terms
// a row ([hi | lo], swizzled) scaled by 2^shift, as the split makes them:
// 16 bytes of each term a store. (A bad tile's values that are not finite
// stay so; its products are plain float32 anyway.)
__device__ __forceinline__ void to_terms(__half* dst, const float* src, int shift) {
  const Pow2 f(shift);
#pragma unroll
  for (int k = 0; k < BR * kE / 8 / TH; ++k) {
    const int idx = threadIdx.x + k * TH, r = idx / (kE / 8), c = idx % (kE / 8) * 8;
    const float4 x0 = *reinterpret_cast<const float4*>(src + r * kE + c);
    const float4 x1 = *reinterpret_cast<const float4*>(src + r * kE + c + 4);
    const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float a = x[2 * j] * f.a * f.b, b = x[2 * j + 1] * f.a * f.b;
      hi[j] = pack2<__half>(a, b);
      lo[j] = pack2<__half>(a - unpack_half<__half>(hi[j], 0), b - unpack_half<__half>(hi[j], 1));
    }
    *reinterpret_cast<uint4*>(dst + sw_at<BR>(r, c)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(dst + sw_at<BR>(r, kE + c)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
}

// dQ's block of this warp (rows 16 wm .., columns 32 wn ..) of dS K over the
// block's keys, in three products of float16 terms: dS^T's two (hi, lo:
// BK x LDS each) and K's ([hi | lo] swizzled).
__device__ __forceinline__ void dq_terms(float (&qa)[4][4], const __half* ds_hi, const __half* ds_lo,
                                         const __half* k_s, int wm, int wn, int lane) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) qa[nt][j] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    const int at = (kk * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + wm * 16 + ((lane >> 3) & 1) * 8;
    uint32_t ah[4], al[4];
    ldmatrix_x4_trans(ah, ds_hi + at);
    ldmatrix_x4_trans(al, ds_lo + at);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const int r = kk * 16 + (lane & 15), c = wn * 32 + np * 16 + (lane >> 4) * 8;
      uint32_t bh[4], bl[4];
      ldmatrix_x4_trans(bh, k_s + sw_at<BK>(r, c));
      ldmatrix_x4_trans(bl, k_s + sw_at<BK>(r, kE + c));
      mma16816<__half>(qa[2 * np], ah, bh[0], bh[1]);
      mma16816<__half>(qa[2 * np + 1], ah, bh[2], bh[3]);
      mma16816<__half>(qa[2 * np], ah, bl[0], bl[1]);
      mma16816<__half>(qa[2 * np + 1], ah, bl[2], bl[3]);
      mma16816<__half>(qa[2 * np], al, bh[0], bh[1]);
      mma16816<__half>(qa[2 * np + 1], al, bh[2], bh[3]);
    }
  }
}

// This thread's share of S^T (or dP^T) of a bad tile in plain float32: keys
// ka, ka + 8 (rows of a, from a_row(key)) against rows r0 + j (b_row(row)),
// zeros past S and L.
template <typename ARow, typename BRow>
__device__ __forceinline__ void plain_products(float (&s)[NB][4], ARow a_row, BRow b_row, int ka, int r0, int t,
                                               int L, int S) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = ka + 8 * (i >> 1), r = r0 + nb * 8 + 2 * t + (i & 1);
      float x = 0.0f;
      if (c < S && r < L) {
        const float* a = a_row(c);
        const float* b = b_row(r);
#pragma unroll 1
        for (int e = 0; e < kE; ++e) x = fmaf(a[e], b[e], x);
      }
      s[nb][i] = x;
    }
}

// dS's power of two for its terms: the block's largest finite |dS| to
// [2^14, 2^15) (c), and whether dS holds anything but zeros (a value that is
// not finite, of a row whose statistics are not or of a bad tile, goes on as
// it is). A barrier: every warp's largest through big_s.
struct DsScale {
  int c;
  bool any;
};
__device__ __forceinline__ DsScale ds_scale(const float (&ds)[NB][4], uint32_t* big_s, int w, int lane) {
  uint32_t big = 0;
  bool odd = false;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t m = __float_as_uint(ds[nb][j]) & 0x7fffffffu;
      odd |= m >= 0x7f800000u;
      big = max(big, m < 0x7f800000u ? m : 0u);
    }
  big = __reduce_max_sync(0xffffffffu, big);
  if (lane == 0) big_s[w] = big;
  odd = __syncthreads_or(odd);
#pragma unroll
  for (int j = 0; j < TH / 32; ++j) big = max(big, big_s[j]);
  int c = 0;
  if (big != 0) {
    int ex;
    frexpf(__uint_as_float(big), &ex);
    c = 15 - ex;
  }
  return {c, big != 0 || odd};
}

// dK's and dV's units lowered where this tile's terms would pass 2^15: dS^T
// 2^(Ak - sq) <= dS 2^c, P^T 2^(Av - sdo) <= 2^15 (P <= 1).
template <int N>
__device__ __forceinline__ void lower_units(float (&dk_acc)[N][4], int& unit_k, float (&dv_acc)[N][4], int& unit_v,
                                            const DsScale& d, int sq, int sdo) {
  if (unit_v > sdo + 15) to_unit(dv_acc, unit_v, sdo + 15);
  if (d.any && unit_k > d.c + sq) to_unit(dk_acc, unit_k, d.c + sq);
}

}  // namespace

__device__ __forceinline__ void backward_keys_f32s(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ d_out, const float* __restrict__ stats, const void* mask_data,
    const int64_t* __restrict__ mask_base, const __half* __restrict__ k2, const __half* __restrict__ v2,
    const int* __restrict__ shifts, float* dk,
    float* dv, float* dq, int64_t slices, int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs,
    float scale_log2, float scale, const BackwardLayout& lay, const Rows& dq_rows) {
  extern __shared__ __align__(1024) unsigned char smem_sw[];
  __half* k_s = reinterpret_cast<__half*>(smem_sw);  // BK x [hi | lo], swizzled
  __half* v_s = k_s + BK * kE2;
  __half* q_s = v_s + BK * kE2;   // BR x [hi | lo]
  __half* do_s = q_s + BR * kE2;
  float* stage = reinterpret_cast<float*>(do_s + BR * kE2);  // the next row tile's Q, then dO (BR x E each)
  __half* ds_s = reinterpret_cast<__half*>(stage + 2 * BR * kE);  // dS^T's hi, then lo (BK x LDS each); float32 in a bad tile
  float* ds_f = reinterpret_cast<float*>(ds_s);
  float* lse_s = reinterpret_cast<float*>(ds_s + 2 * BK * LDS);  // two buffers
  float* d_s = lse_s + 2 * BR;                                    // two buffers
  uint32_t* big_s = reinterpret_cast<uint32_t*>(d_s + 2 * BR);    // a warp's largest |dS| (bits)
  int* shift_s = reinterpret_cast<int*>(big_s + TH / 32);         // two buffers of (Q's, dO's)
  if (smem_u32(smem_sw) & 1023) __trap();
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wg = w >> 2;

  const BackwardBlock blk(slices, kE);
  const int64_t n = blk.slice;  // b H_q + h
  const int c0 = blk.tile * BK;
  const int ratio = H_q / H_kv;
  const int64_t kv_slice = n / H_q * H_kv + n % H_q / ratio;
  const RowAt row_at(n, H_q, H_kv);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  // Row tiles start on multiples of BR, so that each lies in one tile of the
  // split (rows before the first that sees a key are hidden by the mask).
  const int row_begin = mask.row_begin(c0, L, S) / BR * BR, row_end = mask.row_end(c0, BK, L, S);
  const int tiles = row_begin < row_end ? (row_end - row_begin + BR - 1) / BR : 0;
  const f32_split::Shifts shift{shifts, slices, slices / H_q * H_kv, f32_split::tiles(L), f32_split::tiles(S)};
  const int sk_at = shift.k(kv_slice)[c0 / f32_split::kRows], sv_at = shift.v(kv_slice)[c0 / f32_split::kRows];
  const bool kv_bad = f32_split::bad(sk_at) || f32_split::bad(sv_at);
  const int sk = f32_split::shift_of(sk_at), sv = f32_split::shift_of(sv_at);

  // Row tile i into the stage (its rows' statistics and shifts into buffer
  // b): Q and dO in float32, zeros past L; the rows' (lse, D), lse = +inf
  // past L (P = 0), and the tile's two shifts. Q's and dO's terms are made
  // in the block (to_terms): as terms in memory they took 56 MiB more at
  // qwen05b 8K, past the 128 MiB a gradient may take.
  auto copy_rows = [&](int i, int b) {
    const int r0 = row_begin + i * BR, count = min(BR, L - r0);
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      // (each call makes its pointers from the launch's arguments: held
      // across the loop they cost the keys pass spills)
      const float* src = a == 0 ? q + row_at(lay.q, r0) : d_out + row_at(lay.d_out, r0);
      const int ld = a == 0 ? lay.q.sr : lay.d_out.sr;
      // 16 bytes a copy where the rows allow
      const bool vec = ((reinterpret_cast<uintptr_t>(src) & 15) | (ld & 3)) == 0;
#pragma unroll
      for (int k = 0; k < BR * kE / 4 / TH; ++k) {
        const int idx = threadIdx.x + k * TH, r = idx / (kE / 4), c = idx % (kE / 4) * 4;
        float* dst = stage + a * BR * kE + r * kE + c;
        if (vec) {
          cp_async16(dst, r < count ? src + r * ld + c : src, r < count);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) dst[e] = r < count ? src[r * ld + c + e] : 0.0f;
        }
      }
    }
    copy_row_stats<BR>(lse_s + b * BR, d_s + b * BR, stats + (n * L + r0) * 2, count);
    if (threadIdx.x >= BR && threadIdx.x < BR + 2) {
      const int* from = threadIdx.x == BR ? shift.q(n) : shift.d(n);
      cp_async4(shift_s + 2 * b + threadIdx.x - BR, from + r0 / f32_split::kRows);
    }
  };

  const int kc = min(BK, S - c0);
  copy_tile<__half, kE2, BK, TH, true>(k_s, k2 + (kv_slice * S + c0) * kE2, kc, kE2, kE2, true);
  copy_tile<__half, kE2, BK, TH, true>(v_s, v2 + (kv_slice * S + c0) * kE2, kc, kE2, kE2, true);
  if (tiles > 0) copy_rows(0, 0);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();  // cp.async writes, read by wgmma (the async proxy)

  // Descriptors as backward_wg.cu's, over rows of 128 halves: a K step of
  // the head dim moves 32 bytes in a column block (hi: blocks 0 .. 3 of K,
  // lo: 4 .. 7); MN-major (dV's and dK's B), lo is the next column block.
  // Two descriptors held, the rest made from them by constant offsets in
  // their low words (16-byte units; the MN-major ones' LBO at bit 16): six
  // held cost the pass spills.
  const WgDesc d_k(wgmma_desc_sw128(k_s + wg * 64 * 64, 16, 1024));
  const WgDesc d_q(wgmma_desc_sw128(q_s, 16, 1024));
  constexpr uint32_t kV = (BK * kE2 * 2) >> 4, kDo = (BR * kE2 * 2) >> 4, kMn = ((BR * 128 - 16) >> 4) << 16;
  auto step_e = [](int rows, int kk) { return uint32_t((kk >> 2) * rows * 8 + (kk & 3) * 2); };
  constexpr uint32_t kStepRows = 2048 >> 4, kLoBlock = (BR * 128) >> 4;

  const int ka = c0 + w * 16 + g;  // this thread's keys: ka, ka + 8
  const int wm = w / 2, wn = w % 2;  // this warp's dQ block: rows 16 wm, columns 32 wn
  // A row tile's dQ block (qa) times mul added into dQ by atomics.
  float* dq_head = dq + row_at(dq_rows, 0);
  auto add_dq = [&](const float(&qa)[4][4], float mul, int r0) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + wm * 16 + g + 8 * h, e = wn * 32 + nt * 8 + 2 * t;
        if (r < L) add_pair(dq_head + int64_t{r} * dq_rows.sr + e, qa[nt][2 * h] * mul, qa[nt][2 * h + 1] * mul, e, kE);
      }
  };
  float dk_acc[NO][4], dv_acc[NO][4];
  zero(dk_acc);
  zero(dv_acc);
  int unit_k = kUnset, unit_v = kUnset;  // dK's and dV's sums: units 2^unit
  for (int i = 0; i < tiles; ++i) {
    const int b = i & 1, r0 = row_begin + i * BR;
    __syncthreads();  // every warp is past tile i - 1; tile i has landed in the stage
    const int sq = f32_split::shift_of(shift_s[2 * b]), sdo = f32_split::shift_of(shift_s[2 * b + 1]);
    to_terms(q_s, stage, sq);
    to_terms(do_s, stage + BR * kE, sdo);
    fence_proxy_async();  // the terms, read by wgmma
    __syncthreads();      // every thread's terms written; the stage free
    if (i + 1 < tiles) copy_rows(i + 1, b ^ 1);
    cp_async_commit();
    const bool plain = kv_bad || f32_split::bad(shift_s[2 * b]) || f32_split::bad(shift_s[2 * b + 1]);
    const bool need_mask = mask.tile_hides(c0, BK, r0, BR, S);

    constexpr uint32_t off = 0;  // (one buffer of terms)
    // The plain tile and the tensor cores' are two whole branches, each to
    // its last wait: where a path could pass from a product's issue to an
    // instruction that touches its accumulator (the two branches' sums
    // joined), ptxas serialises every product.
    if (plain) {
      // (No product is in flight here; ptxas sees none once it sees a wait.)
      wgmma_wait<0>();
      fence_fragments(dv_acc);
      fence_fragments(dk_acc);
      float p[NB][4], ds[NB][4], qa[4][4];
      plain_products(p, [&](int c) { return k + row_at.kv(lay.k, c); }, [&](int r) { return q + row_at(lay.q, r); },
                     ka, r0, t, L, S);
      plain_products(ds, [&](int c) { return v + row_at.kv(lay.v, c); },
                     [&](int r) { return d_out + row_at(lay.d_out, r); }, ka, r0, t, L, S);
      key_tile_ds<NB>(p, ds, mask, n, ka, r0, need_mask, lse_s + b * BR, d_s + b * BR, scale_log2, t, L, S);
      const DsScale d = ds_scale(ds, big_s, w, lane);
      lower_units(dk_acc, unit_k, dv_acc, unit_v, d, sq, sdo);
      // dS^T in float32 for dQ; dV and dK in FMA from the float32 inputs,
      // in the sums' units as the terms would be (weights P^T 2^(Av - sdo)
      // and dS^T 2^(Ak - sq), values dO 2^sdo and Q 2^sq: each within
      // 2^15 where finite), skipping zero weights.
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2*>(ds_f + (w * 16 + g + 8 * h) * LDS + nb * 8 + 2 * t) =
              make_float2(ds[nb][2 * h], ds[nb][2 * h + 1]);
      const Pow2 wv(unit_v - sdo), xv(sdo);
      scale_by(p, wv.a);
      scale_by(p, wv.b);
      accumulate_guarded_at<NB, NO>(
          dv_acc, p, [&](int kk, int e) { return d_out[row_at(lay.d_out, r0 + kk) + e] * xv.a * xv.b; }, lane);
      if (d.any) {
        const Pow2 wk(unit_k - sq), xk(sq);
        scale_by(ds, wk.a);
        scale_by(ds, wk.b);
        accumulate_guarded_at<NB, NO>(
            dk_acc, ds, [&](int kk, int e) { return q[row_at(lay.q, r0 + kk) + e] * xk.a * xk.b; }, lane);
      }
      __syncthreads();  // dS^T staged by every warp
      // dQ += dS K in FMA, skipping zero weights.
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) qa[nt][j] = 0.0f;
#pragma unroll 1
      for (int kk = 0; kk < min(BK, S - c0); ++kk) {
        const float* k_row = k + row_at.kv(lay.k, c0 + kk);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float x = ds_f[kk * LDS + wm * 16 + g + 8 * (j >> 1)];
            if (x != 0.0f) qa[nt][j] = fmaf(x, k_row[wn * 32 + nt * 8 + 2 * t + (j & 1)], qa[nt][j]);
          }
      }
      add_dq(qa, scale, r0);
      cp_async_wait<0>();
      fence_proxy_async();  // the next tile's copies, read by wgmma
    } else {
      // S^T = K Q^T and dP^T = V dO^T, three products of terms each.
      float p[NB][4], ds[NB][4], qa[4][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma16_ss<__half, BR>(p, d_k.at(step_e(BK, kk)), d_q.at(off + step_e(BR, kk)), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma16_ss<__half, BR>(p, d_k.at(step_e(BK, kk)), d_q.at(off + step_e(BR, kk + 4)), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma16_ss<__half, BR>(p, d_k.at(step_e(BK, kk + 4)), d_q.at(off + step_e(BR, kk)), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma16_ss<__half, BR>(ds, d_k.at(kV + step_e(BK, kk)), d_q.at(kDo + off + step_e(BR, kk)), kk > 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma16_ss<__half, BR>(ds, d_k.at(kV + step_e(BK, kk)), d_q.at(kDo + off + step_e(BR, kk + 4)), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma16_ss<__half, BR>(ds, d_k.at(kV + step_e(BK, kk + 4)), d_q.at(kDo + off + step_e(BR, kk)), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_fragments(p);
      fence_fragments(ds);
      const Pow2 f(-(sv + sdo));  // dP^T's scale undone
      scale_by(ds, f.a);
      scale_by(ds, f.b);
      key_tile_ds<NB>(p, ds, mask, n, ka, r0, need_mask, lse_s + b * BR, d_s + b * BR,
                      ldexpf(scale_log2, -(sk + sq)), t, L, S);
      const DsScale d = ds_scale(ds, big_s, w, lane);
      lower_units(dk_acc, unit_k, dv_acc, unit_v, d, sq, sdo);
      // dV += P^T dO: P^T 2^(Av - sdo), at most 2^15 (P <= 1). Its products
      // and dK's run on during dQ's.
      uint32_t pa[2][NB / 2][4], dsa[2][NB / 2][4];
      {
        const Pow2 fv(unit_v - sdo);
        scale_by(p, fv.a);
        pack_p_terms<__half, 2>(pa, p, fv.b);
      }
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < NB / 2; ++kb) wgmma16_rs_t<__half, kE>(dv_acc, pa[0][kb], d_q.at(kMn + kDo + off + kb * kStepRows));
#pragma unroll
      for (int kb = 0; kb < NB / 2; ++kb)
        wgmma16_rs_t<__half, kE>(dv_acc, pa[0][kb], d_q.at(kMn + kDo + off + kLoBlock + kb * kStepRows));
#pragma unroll
      for (int kb = 0; kb < NB / 2; ++kb) wgmma16_rs_t<__half, kE>(dv_acc, pa[1][kb], d_q.at(kMn + kDo + off + kb * kStepRows));
      wgmma_commit();
      // dS 2^c's terms to shared memory for dQ.
      const Pow2 fq(d.c);
      scale_by(ds, fq.a);
      scale_by(ds, fq.b);
      pack_p_terms<__half, 2>(dsa, ds, 1.0f);
#pragma unroll
      for (int term = 0; term < 2; ++term)
#pragma unroll
        for (int kb = 0; kb < NB / 2; ++kb) {
          __half* at = ds_s + term * BK * LDS + (w * 16 + g) * LDS + kb * 16 + 2 * t;
          *reinterpret_cast<uint32_t*>(at) = dsa[term][kb][0];
          *reinterpret_cast<uint32_t*>(at + 8 * LDS) = dsa[term][kb][1];
          *reinterpret_cast<uint32_t*>(at + 8) = dsa[term][kb][2];
          *reinterpret_cast<uint32_t*>(at + 8 * LDS + 8) = dsa[term][kb][3];
        }
      // dK += dS^T Q: dS^T 2^(Ak - sq), at most dS 2^c (mostly just that).
      if (d.any) {
        if (unit_k != d.c + sq) rescale_terms(dsa, Pow2(unit_k - sq - d.c));
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < NB / 2; ++kb)
          wgmma16_rs_t<__half, kE>(dk_acc, dsa[0][kb], d_q.at(kMn + off + kb * kStepRows));
#pragma unroll
        for (int kb = 0; kb < NB / 2; ++kb)
          wgmma16_rs_t<__half, kE>(dk_acc, dsa[0][kb], d_q.at(kMn + off + kLoBlock + kb * kStepRows));
#pragma unroll
        for (int kb = 0; kb < NB / 2; ++kb)
          wgmma16_rs_t<__half, kE>(dk_acc, dsa[1][kb], d_q.at(kMn + off + kb * kStepRows));
        wgmma_commit();
      }
      __syncthreads();  // dS^T staged by every warp
      // dQ += dS K, its sums taking 2^-(c + sk) back.
      dq_terms(qa, ds_s, ds_s + BK * LDS, k_s, wm, wn, lane);
      const Pow2 back(-(d.c + sk));
      add_dq(qa, scale * back.a * back.b, r0);
      cp_async_wait<0>();
      fence_proxy_async();  // the next tile's copies, read by wgmma
      // dV's and dK's products read this tile's buffers and P^T / dS^T's
      // registers: done before the barrier that frees them.
      wgmma_wait<0>();
      fence_fragments(dv_acc);
      fence_fragments(dk_acc);
      fence_terms(pa);
      fence_terms(dsa);
    }
  }
  cp_async_wait<0>();

  // The sums in true units, then stored (added under GQA).
  if (unit_k != 0) to_unit(dk_acc, unit_k, 0);
  if (unit_v != 0) to_unit(dv_acc, unit_v, 0);
  float* dk_head = dk + row_at.kv(lay.dk, 0);
  float* dv_head = dv + row_at.kv(lay.dv, 0);
  store_dk_dv<float, NO>(dk_acc, dv_acc, dk_head, dv_head, lay.dk.sr, lay.dv.sr, ratio != 1, tiles > 0, ka, S, kE, 0,
                         scale, lane);
}

}  // namespace fa

// Inputs q, k, v, dO (float32, where they lie), the rows' statistics (lse,
// D: fa_backward_d_float32_64), the mask's data and base offsets, then
// fa_f32_split4_64's k2, v2 and shifts (Q's, K's, V's, dO's); outputs dK,
// dV (float32 zeros under GQA) and dQ (float32 zeros, added into); the
// scalars and layouts of backward.cu's keys pass with dQ.
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kKeysThreads16, 1)
    FA_CAT3(fa_backward_keyswgs, FA_KIND_LETTER, _float32_64)(
        const float* q, const float* k, const float* v, const float* d_out, const float* stats, const void* mask,
        const int64_t* mask_base, const __half* k2, const __half* v2, const int* shifts, float* dk, float* dv,
        float* dq, int slices, int H_q, int H_kv, int L, int S, int E,
        int mask_kind, int mask_rs, int mask_cs, float scale_log2, float scale, FA_BACKWARD_LAYOUT_PARAMS, int dq_sb,
        int dq_sh, int dq_sr) {
  fa::backward_keys_f32s(q, k, v, d_out, stats, mask, mask_base, k2, v2, shifts, dk, dv, dq, slices, H_q,
                         H_kv, L, S, FA_KIND | (mask_kind & ~fa::kKindBits), mask_rs, mask_cs, scale_log2, scale,
                         FA_BACKWARD_LAYOUT, fa::Rows{dq_sb, dq_sh, dq_sr});
}
