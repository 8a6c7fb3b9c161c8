// The two matrix products of FlashAttention-2 on one tile, vectorised over
// query rows. Tiles are kept transposed (one row of Q_i^T, S_ij^T, o_i^T per
// key or head-dim index, RB query rows across it), so K and V are read as
// scalars broadcast to all lanes, straight from the (possibly strided)
// input: no transposition of K or V, ever.
//
//   S_ij^T[c][r]  = sum_e K_j[c][e] * Q_i^T[e][r]      qk_block: KB keys
//   o_i^T[e][r]  += sum_c V_j[c][e] * P_ij^T[c][r]     pv_block: EB columns
//
// Each block keeps KB x RV (or EB x RV) vector accumulators in registers.

#pragma once

#include <cstdint>

#include "simd.h"

#if defined(__clang__)
#define FLASHATTN_UNROLL _Pragma("unroll")
#else
#define FLASHATTN_UNROLL _Pragma("GCC unroll 16")
#endif

namespace flashattn::cpu::FLASHATTN_ISA {

// St[kk][.] = Q_i^T . K[kk][.] for KB keys; K rows rs apart, columns cs.
template <int W, int RV, int KB>
inline void qk_block(
    const float* __restrict Qt,
    const float* __restrict K,
    int64_t rs,
    int64_t cs,
    int E,
    float* __restrict St) {
  using S = Simd<W>;
  using vf = typename S::vf;
  constexpr int RB = W * RV;
  vf acc[KB][RV];
  FLASHATTN_UNROLL
  for (int kk = 0; kk < KB; ++kk) {
    FLASHATTN_UNROLL
    for (int v = 0; v < RV; ++v) {
      acc[kk][v] = vf{};
    }
  }
  for (int e = 0; e < E; ++e) {
    vf q[RV];
    FLASHATTN_UNROLL
    for (int v = 0; v < RV; ++v) {
      q[v] = S::load(Qt + e * RB + v * W);
    }
    const float* k = K + e * cs;
    FLASHATTN_UNROLL
    for (int kk = 0; kk < KB; ++kk) {
      float k_e = k[kk * rs];
      FLASHATTN_UNROLL
      for (int v = 0; v < RV; ++v) {
        acc[kk][v] += q[v] * k_e;
      }
    }
  }
  FLASHATTN_UNROLL
  for (int kk = 0; kk < KB; ++kk) {
    FLASHATTN_UNROLL
    for (int v = 0; v < RV; ++v) {
      S::store(St + kk * RB + v * W, acc[kk][v]);
    }
  }
}

// Ot[ee][.] += sum_c V[c][ee] * Pt[c][.] for EB head-dim columns.
template <int W, int RV, int EB>
inline void pv_block(
    const float* __restrict Pt,
    int cols,
    const float* __restrict V,
    int64_t rs,
    int64_t cs,
    float* __restrict Ot) {
  using S = Simd<W>;
  using vf = typename S::vf;
  constexpr int RB = W * RV;
  vf acc[EB][RV];
  FLASHATTN_UNROLL
  for (int ee = 0; ee < EB; ++ee) {
    FLASHATTN_UNROLL
    for (int v = 0; v < RV; ++v) {
      acc[ee][v] = S::load(Ot + ee * RB + v * W);
    }
  }
  for (int c = 0; c < cols; ++c) {
    vf p[RV];
    FLASHATTN_UNROLL
    for (int v = 0; v < RV; ++v) {
      p[v] = S::load(Pt + c * RB + v * W);
    }
    const float* v_c = V + c * rs;
    FLASHATTN_UNROLL
    for (int ee = 0; ee < EB; ++ee) {
      float v_ce = v_c[ee * cs];
      FLASHATTN_UNROLL
      for (int v = 0; v < RV; ++v) {
        acc[ee][v] += p[v] * v_ce;
      }
    }
  }
  FLASHATTN_UNROLL
  for (int ee = 0; ee < EB; ++ee) {
    FLASHATTN_UNROLL
    for (int v = 0; v < RV; ++v) {
      S::store(Ot + ee * RB + v * W, acc[ee][v]);
    }
  }
}

} // namespace flashattn::cpu::FLASHATTN_ISA
