// The online-softmax step of FlashAttention-2 (Algorithm 1, lines 9-10) on
// one transposed score tile S_ij^T (Bc x RB), vectorised over query rows.
//
// Scores carry a factor log2(e) (folded into Q), so exp is exp2. Running
// state per query row: m_i (maximum so far), l_i (sum of exp2 so far) and
// o_i^T (unnormalised output, E x RB). Probabilities are taken against
// softmax_base(m_i) (../softmax.h: 0 while a row has seen only hidden keys),
// here as a vector select.

#pragma once

#include <limits>

#include "../softmax.h"
#include "../tiles.h"
#include "exp2.h"

namespace flashattn::cpu::FLASHATTN_ISA {

// Turns St into P_ij^T in place, updates m_i and l_i, rescales o_i^T.
template <int W, int RV>
inline void online_softmax_update(float* St, float* m_i, float* l_i, float* Ot, int E) {
  using S = Simd<W>;
  using vf = typename S::vf;
  constexpr int RB = W * RV;
  const vf neg_inf = S::splat(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < RV; ++v) {
    float* s = St + v * W;
    // Four running maxima: a single one would chain Bc dependent steps.
    vf m4[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
    for (int c = 0; c < Bc; c += 4) {
      for (int u = 0; u < 4; ++u) {
        m4[u] = S::max(m4[u], S::load(s + (c + u) * RB));
      }
    }
    vf m_tile = S::max(S::max(m4[0], m4[1]), S::max(m4[2], m4[3]));
    vf m_old = S::load(m_i + v * W);
    vf m_new = S::max(m_old, m_tile);
    vf m_use = S::select(m_new == neg_inf, vf{}, m_new);
    vf alpha = exp2<W>(m_old - m_use);
    vf row_sum = vf{};
    for (int c = 0; c < Bc; ++c) {
      vf p = exp2<W>(S::load(s + c * RB) - m_use);
      S::store(s + c * RB, p);
      row_sum += p;
    }
    S::store(l_i + v * W, alpha * S::load(l_i + v * W) + row_sum);
    S::store(m_i + v * W, m_new);
    float* o = Ot + v * W;
    for (int e = 0; e < E; ++e) {
      S::store(o + e * RB, alpha * S::load(o + e * RB));
    }
  }
}

} // namespace flashattn::cpu::FLASHATTN_ISA
