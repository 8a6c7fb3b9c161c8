#include "work.h"

#include <algorithm>
#include <utility>

#include "causal.h"
#include "tiles.h"

namespace flashattn::cpu {

namespace {

// A split below this many keys costs more in merging than it gains.
constexpr int kMinKeysPerSplit = 1024;

// Keys [begin, end) that the rows of one row tile may see.
std::pair<int, int> row_tile_keys(const AttentionProblem& p, int RB, int row_tile) {
  if (p.mask_kind != MaskKind::causal) {
    return {0, p.S};
  }
  const int ratio = p.q_kv_heads_ratio;
  const int first_row = row_tile * RB;
  const int last_row = std::min(first_row + RB, ratio * p.L) - 1;
  const CausalRule causal = p.causal();
  const int end = causal.key_end(last_row / ratio, p.S);
  return {std::min(causal.key_begin(first_row / ratio, p.S), end), end};
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
  // The keys a row tile sees at most: a sliding window bounds them.
  const int64_t keys = p.mask_kind == MaskKind::causal && p.window > 0
      ? std::min<int64_t>(p.S, int64_t(p.window) + p.L)
      : p.S;
  if (threads > 1 && row_items < 2 * threads && keys >= 2 * kMinKeysPerSplit) {
    int64_t wanted = ceil_div(4 * threads, int(row_items));
    plan.splits = int(std::min<int64_t>(wanted, keys / kMinKeysPerSplit));
  }

  plan.items.reserve(row_items * plan.splits);
  for (int64_t group = 0; group < plan.groups; ++group) {
    for (int t = 0; t < plan.row_tiles; ++t) {
      auto [key_begin, key_end] = row_tile_keys(p, plan.RB, t);
      // Each split takes its share of the keys this row tile sees.
      int keys_per_split = round_up(ceil_div(key_end - key_begin, plan.splits), Bc);
      int rows = std::min(plan.RB, plan.rows_per_group - t * plan.RB);
      for (int s = 0; s < plan.splits; ++s) {
        WorkItem item;
        item.group = group;
        item.row_tile = t;
        item.split = s;
        item.key_begin = std::min(key_begin + s * keys_per_split, key_end);
        item.key_end = std::min(key_begin + (s + 1) * keys_per_split, key_end);
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
