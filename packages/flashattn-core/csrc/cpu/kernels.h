// The per-instruction-set kernels and the choice between them, made once per
// process from what the CPU supports.

#pragma once

#include <cstddef>
#include <cstdint>

#include "backward.h"
#include "problem.h"
#include "tiles.h"
#include "work.h"

namespace flashattn::cpu {

// A work item's scratch, carved from one per-thread buffer:
// Q_i^T and o_i^T (E x RB), S_ij^T and its hidden flags (Bc x RB), K_j and
// V_j (Bc x E), m_i, l_i and the causal limits (first and last key a row
// sees; RB each), and per-row offsets (RB each).
struct ScratchView {
  float *Qt, *Ot, *St, *K, *V, *m_i, *l_i, *first, *limit;
  float* hidden; // Bc x RB: 1 where a score is masked (rare NaN/Inf path)
  int64_t *out_off, *mask_off;

  static size_t bytes(int E, int RB) {
    size_t floats = size_t(2) * E * RB + size_t(2) * Bc * RB +
        size_t(2) * Bc * E + 4 * size_t(RB);
    return floats * sizeof(float) + 2 * size_t(RB) * sizeof(int64_t) + 64;
  }

  ScratchView(void* buffer, int E, int RB) {
    auto* p = reinterpret_cast<int64_t*>(
        (reinterpret_cast<uintptr_t>(buffer) + 63) & ~uintptr_t(63));
    out_off = p;
    mask_off = p + RB;
    float* f = reinterpret_cast<float*>(p + 2 * RB);
    Qt = f, f += size_t(E) * RB;
    Ot = f, f += size_t(E) * RB;
    St = f, f += size_t(Bc) * RB;
    hidden = f, f += size_t(Bc) * RB;
    K = f, f += size_t(Bc) * E;
    V = f, f += size_t(Bc) * E;
    m_i = f, f += RB;
    l_i = f, f += RB;
    first = f, f += RB;
    limit = f;
  }
};

using AttendFn = void (*)(const AttentionProblem&, WorkPlan&, const WorkItem&, void*);

struct Kernels {
  const char* isa; // "avx512", "avx2", "baseline"
  int wide_rows, narrow_rows; // RB of each variant
  AttendFn wide, narrow;
  // For narrow plans the decode kernel takes (isa/decode.h), where this
  // instruction set has one; null otherwise.
  AttendFn decode = nullptr;
  // The fused backward (isa/backward.h) and its vector width.
  BackwardFn backward = nullptr;
  int backward_width = 0;
};

// Whether the decode kernel takes a narrow plan of this problem: head dim a
// multiple of 8 up to 256, key and value rows contiguous, no array mask.
bool decode_kernel_fits(const AttentionProblem& p);

// Defined by kernel_<isa>.cpp; avx512/avx2 only on x86-64.
Kernels avx512_kernels();
Kernels avx2_kernels();
Kernels baseline_kernels();

// The best set this CPU runs; FLASHATTN_ISA=avx2|baseline narrows the choice.
const Kernels& select_kernels();

} // namespace flashattn::cpu
