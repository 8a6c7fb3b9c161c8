// How one attention problem is cut into work items for the threads.
//
// Query rows of one (batch, KV head) group are numbered r = l * ratio + hh
// (position-major over the ratio = H_q / H_kv query heads that share the KV
// head), so GQA heads share every K/V tile they read, and decode (L = 1)
// still gives a row tile `ratio` rows. A work item is one row tile against
// a range of keys. When there are too few row tiles to feed every thread
// (decode, short prompts against a long cache) the keys are split too and
// the partial (m, l, o) of each split are merged afterwards: FlashDecoding.

#pragma once

#include <cstdint>
#include <vector>

#include "problem.h"

namespace flashattn::cpu {

struct WorkItem {
  int64_t group = 0; // b * H_kv + kv head
  int row_tile = 0;
  int split = 0; // which key range of the row tile (0 when keys are not split)
  int key_begin = 0, key_end = 0; // keys [key_begin, key_end)
  int64_t cost = 0;
};

// One key split's partial result, in the layout merge_partials reads:
// m_i[RB], l_i[RB], then o_i^T (E x RB, head-dim-major).
struct Partial {
  float* data;
  int RB;

  float& m(int r) const {
    return data[r];
  }
  float& l(int r) const {
    return data[RB + r];
  }
  float& o(int e, int r) const {
    return data[2 * RB + int64_t(e) * RB + r];
  }
};

struct WorkPlan {
  int RB = 0; // query rows per row tile
  bool narrow = false; // the kernel variant for few rows per group
  int64_t groups = 0; // batch x H_kv
  int rows_per_group = 0; // ratio x L
  int row_tiles = 0; // per group
  int splits = 1; // key ranges per row tile
  std::vector<WorkItem> items; // most expensive first

  // Partial results of split items, one Partial each.
  std::vector<float> partials;
  int64_t partial_floats = 0;

  // Split `split` of row tile `tile` (group * row_tiles + row_tile).
  Partial partial(int64_t tile, int split) {
    return {partials.data() + (tile * splits + split) * partial_floats, RB};
  }
  Partial partial(const WorkItem& item) {
    return partial(item.group * row_tiles + item.row_tile, item.split);
  }
};

// threads: how many workers may take items. wide_rows / narrow_rows: RB of
// the kernel variants the chosen instruction set offers.
WorkPlan plan_work(
    const AttentionProblem& p,
    int wide_rows,
    int narrow_rows,
    int threads);

} // namespace flashattn::cpu
