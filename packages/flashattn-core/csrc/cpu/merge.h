// The split merge (FlashDecoding): a row tile whose keys were split into
// ranges has one partial (o_s, m_s, l_s) per range; combined exactly as
//   m = max_s m_s,  l = sum_s 2^(m_s - m) l_s,  O = sum_s 2^(m_s - m) o_s / l
// (0 where l = 0: no range saw a visible key).

#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "problem.h"
#include "softmax.h"
#include "work.h"

namespace flashattn::cpu {

template <typename T>
void merge_partials(const AttentionProblem& p, WorkPlan& plan, int64_t tile) {
  const int RB = plan.RB, E = p.E, ratio = p.q_kv_heads_ratio;
  const int64_t group = tile / plan.row_tiles;
  const int row_tile = int(tile % plan.row_tiles);
  const int64_t b = group / p.H_kv, g = group % p.H_kv;
  const int first = row_tile * RB;
  const int rows = std::min(RB, plan.rows_per_group - first);
  for (int r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < plan.splits; ++s) {
      m = std::max(m, plan.partial(tile, s).m(r));
    }
    const float base = softmax_base(m);
    float l = 0.0f;
    float o[256] = {};
    for (int s = 0; s < plan.splits; ++s) {
      const Partial part = plan.partial(tile, s);
      float w = std::exp2(part.m(r) - base);
      l += w * part.l(r);
      for (int e = 0; e < E; ++e) {
        o[e] += w * part.o(e, r);
      }
    }
    int64_t l_pos = (first + r) / ratio;
    int64_t n = b * p.H_q + g * ratio + (first + r) % ratio;
    store_output_row<T>(p, (n * p.L + l_pos) * E, o, 1, m, l, p.lse ? p.lse + n * p.L + l_pos : nullptr);
  }
}

template <typename T>
void merge_all(const AttentionProblem& p, WorkPlan& plan) {
  for (int64_t tile = 0; tile < plan.groups * plan.row_tiles; ++tile) {
    merge_partials<T>(p, plan, tile);
  }
}

} // namespace flashattn::cpu
