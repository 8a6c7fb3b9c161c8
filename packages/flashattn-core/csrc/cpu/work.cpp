#include "work.h"

#include <algorithm>

#include "causal.h"
#include "tiles.h"

namespace flashattn::cpu {

namespace {

// A split below this many keys costs more in merging than it gains.
constexpr int kMinKeysPerSplit = 1024;

// Key range the rows of one row tile may see.
int row_tile_key_end(const AttentionProblem& p, int RB, int row_tile) {
  if (p.mask_kind != MaskKind::causal) {
    return p.S;
  }
  int rows = p.q_kv_heads_ratio * p.L;
  int last_row = std::min((row_tile + 1) * RB, rows) - 1;
  return causal_key_end(last_row / p.q_kv_heads_ratio, causal_offset(p.L, p.S), p.S);
}

} // namespace

WorkPlan plan_work(
    const AttentionProblem& p,
    int wide_rows,
    int narrow_rows,
    int threads) {
  WorkPlan plan;
  plan.groups = p.batch * p.H_kv;
  plan.rows_per_group = p.q_kv_heads_ratio * p.L;
  plan.narrow = plan.rows_per_group <= narrow_rows;
  plan.RB = plan.narrow ? narrow_rows : wide_rows;
  plan.row_tiles = ceil_div(plan.rows_per_group, plan.RB);

  int64_t row_items = plan.groups * plan.row_tiles;
  if (threads > 1 && row_items < 2 * threads && p.S >= 2 * kMinKeysPerSplit) {
    int64_t wanted = ceil_div(4 * threads, int(row_items));
    plan.splits = int(std::min<int64_t>(wanted, p.S / kMinKeysPerSplit));
  }
  int keys_per_split = round_up(ceil_div(p.S, plan.splits), Bc);

  plan.items.reserve(row_items * plan.splits);
  for (int64_t group = 0; group < plan.groups; ++group) {
    for (int t = 0; t < plan.row_tiles; ++t) {
      int key_end = row_tile_key_end(p, plan.RB, t);
      int rows = std::min(plan.RB, plan.rows_per_group - t * plan.RB);
      for (int s = 0; s < plan.splits; ++s) {
        WorkItem item;
        item.group = group;
        item.row_tile = t;
        item.split = s;
        item.key_begin = std::min(s * keys_per_split, key_end);
        item.key_end = std::min((s + 1) * keys_per_split, key_end);
        item.cost = int64_t(rows) * (item.key_end - item.key_begin + Bc);
        plan.items.push_back(item);
      }
    }
  }
  // Longest first: with dynamic assignment this balances causal masks,
  // whose later row tiles see more keys.
  std::stable_sort(
      plan.items.begin(), plan.items.end(), [](const auto& a, const auto& b) {
        return a.cost > b.cost;
      });
  if (plan.splits > 1) {
    plan.partial_floats = int64_t(2 + p.E) * plan.RB;
    plan.partials.resize(
        size_t(row_items * plan.splits * plan.partial_floats));
  }
  return plan;
}

} // namespace flashattn::cpu
