// The online-softmax step of FlashAttention-2 (Algorithm 1, lines 9-10) for
// one Br x Bc score tile, in the log2 domain (scores carry a factor log2(e),
// so exp becomes exp2).
//
// Running state per query row: m_i (maximum so far), l_i (sum of exp2 so
// far), o_i (unnormalised output). A row that has seen only hidden keys keeps
// m_i = -inf; the guard below keeps it at l_i = 0, o_i = 0 instead of NaN.

#pragma once

#include <cmath>

#include "mask.h"

namespace flashattn::cpu {

// Turns the scores s (rows x ld, cols valid) into P_ij in place, updates m_i
// and l_i, and rescales o_i (rows x E) by exp2(m_old - m_new).
inline void online_softmax_update(
    float* s,
    int ld,
    int rows,
    int cols,
    float* m_i,
    float* l_i,
    float* o_i,
    int ld_o,
    int E) {
  for (int r = 0; r < rows; ++r) {
    float* s_r = s + r * ld;
    float m_tile = kNegInf;
    for (int c = 0; c < cols; ++c) {
      // NaN scores propagate into the maximum and from there to the output.
      m_tile = (s_r[c] > m_tile || std::isnan(s_r[c])) ? s_r[c] : m_tile;
    }
    float m_new = std::isnan(m_tile) ? m_tile : std::max(m_i[r], m_tile);
    // Nothing visible yet: subtract 0 so that exp2(-inf - 0) = 0, not NaN.
    float m_use = (m_new == kNegInf) ? 0.0f : m_new;
    float alpha = std::exp2(m_i[r] - m_use);
    float row_sum = 0.0f;
    for (int c = 0; c < cols; ++c) {
      s_r[c] = std::exp2(s_r[c] - m_use);
      row_sum += s_r[c];
    }
    l_i[r] = alpha * l_i[r] + row_sum;
    m_i[r] = m_new;
    float* o_r = o_i + r * ld_o;
    for (int e = 0; e < E; ++e) {
      o_r[e] *= alpha;
    }
  }
}

} // namespace flashattn::cpu
