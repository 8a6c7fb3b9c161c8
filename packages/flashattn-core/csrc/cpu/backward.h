// The fused backward on the CPU: what the kernels (isa/backward.h) read and
// write, their work items and scratch, and the entry point.

#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "problem.h"
#include "tiles.h"

namespace flashattn::cpu {

// Query rows per block of the backward (keys per tile: Bc). 64 rather than
// 32: dV += P^T dO and dK += dS^T Q then sum 64 rows per pass over their
// accumulators (the backward 5-10% faster; docs/cpu.md).
constexpr int kBackwardRows = 64;

struct BackwardProblem {
  // q, k, v, mask as in the forward; fwd.out is unused.
  AttentionProblem fwd;
  const void* d_out = nullptr; // dO, row contiguous (B..., H_q, L, E), fwd.dtype
  const float* lse = nullptr; // the forward's, row contiguous (B..., H_q, L)
  const float* D = nullptr; // rowsum(dO * O), same layout
  const float* d_lse = nullptr; // optional: the cotangent of lse, same layout (folded into D)
  void *dq = nullptr, *dk = nullptr, *dv = nullptr; // row contiguous, fwd.dtype
};

// keys: dK, dV of KV head slice `slice` (b x H_kv + head), keys
// [first, first + count). queries: dQ of query head slice `slice`, rows
// [first, first + count). group: dQ, dK and dV of KV head slice `slice`
// and its group of query heads (first and count unused).
struct BackwardItem {
  enum Pass { keys, queries, group } pass;
  int64_t slice;
  int64_t first;
  int count;
  int64_t cost;
};

// One thread's scratch (float32): Q, dO, dQ (Br x Ep); K, V, dK, dV (Bc x
// Ep); K^T, V^T (Ep x Bc); P, dS (Br x Bc); lse, D (Br).
struct BackwardScratch {
  float *Q, *dO, *dQ, *K, *V, *dK, *dV, *K_t, *V_t, *P, *dS, *lse, *D;

  static size_t bytes(int E, int W) {
    const size_t Ep = round_up(E, W), Br = kBackwardRows;
    return (3 * Br * Ep + 6 * size_t(Bc) * Ep + 2 * Br * Bc + 2 * Br) * sizeof(float) + 64;
  }

  BackwardScratch(void* buffer, int E, int W) {
    const size_t Ep = round_up(E, W), Br = kBackwardRows;
    float* f = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer) + 63) & ~uintptr_t(63));
    for (float** t : {&Q, &dO, &dQ}) *t = f, f += Br * Ep;
    for (float** t : {&K, &V, &dK, &dV, &K_t, &V_t}) *t = f, f += size_t(Bc) * Ep;
    for (float** t : {&P, &dS}) *t = f, f += Br * Bc;
    lse = f, f += Br;
    D = f;
  }
};

using BackwardFn = void (*)(const BackwardProblem&, const BackwardItem&, void*);

// Runs both passes on all cores; D is computed here.
void run_backward(BackwardProblem p);

} // namespace flashattn::cpu
