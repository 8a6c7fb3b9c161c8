// The wgmma prefill's launch model (wg_launch.h).
//
// Why: a launch of a little more than a whole number of waves leaves SMs
// idle (mlx-lm's prefill chunks at qwen05b, for one: docs/cuda.md). Two
// answers, both modelled here:
// - two consumers a block (row tiles of 128: more blocks, though a key tile
//   costs more cycles a row), for launches of one to four waves of
//   three-consumer blocks;
// - the last row tiles' keys split into pieces that every SM shares once
//   the whole tiles are done (key_split.cuh); also for launches of fewer
//   blocks than SMs (a few query rows against a long cache).
// A choice is taken only where the model predicts at least 5% less time than
// three consumers and no splits.

#include "cuda/wg_launch.h"

#include <algorithm>
#include <vector>

#include "cuda/kernels/causal.h"
#include "cuda/kernels/wg_shapes.h"
#include "cuda/sm_queue.h"

namespace flashattn::cuda {

namespace {

namespace ws = fa::wg_shapes;

// Cycles, from H200 block timelines (benchmarks/cuda-probes/prefill-timeline.cu):
// a key tile of a row tile of 192 rows (three consumers at E = 64), 128 rows
// (two), 128 rows at E = 128, and (H100) of the widened kernels (float32
// over 16-bit inputs, P in two terms): 192 rows at E = 64, 128 at E = 128;
// and a block's fixed part (E = 128 blocks spent ~11,000 cycles outside
// their tile loop; the widened E = 64 ones ~15,000, fitted over a causal
// 8K launch's blocks).
double cycles_per_tile(const WgProblem& p, bool narrow) {
  if (p.widen) return p.E > 64 ? 3185 : 4215;
  if (p.E > 64) return 2900;
  return narrow ? 2491 : 2979;
}
double fixed_cycles(const WgProblem& p) { return p.E > 64 ? 11000 : p.widen ? 15000 : 3000; }
// A piece's state out and its ticket; the last piece's merge of the others
// (each ~55-70 KB from L2 through one SM).
constexpr double kPieceCycles = 1500, kMergeCyclesPerPiece = 900, kMergeCycles = 1000;
constexpr int kMaxSplits = 16;
// The pieces' states at most: scratch of the call, freed with it, a few
// times the output of the calls the splits are for (docs/cuda.md).
constexpr int64_t kMaxStateBytes = int64_t(16) << 20;

struct Shape {
  int rows, tiles;
  int64_t units;  // row tiles of all slices
};

Shape shape_of(const WgProblem& p, bool narrow) {
  const int rows = ws::f16_rows(p.E, narrow), tiles = (p.L + rows - 1) / rows;
  return {rows, tiles, p.slices * tiles};
}

// Key tiles of the row tile at launch position u (heaviest first: the
// last row tile of every slice, then the one before, ...).
int key_tiles(const WgProblem& p, const Shape& s, int64_t u) {
  const int t = s.tiles - 1 - static_cast<int>(u / p.slices);
  const int kv_end = p.causal ? fa::causal_kv_end(t * s.rows, s.rows, p.L, p.S) : p.S;
  const int kv_begin = p.causal && p.window > 0 ? fa::causal_kv_begin(t * s.rows, p.L, p.S, p.window) : 0;
  const int bc = ws::f16_bc(p.E);
  return (kv_end + bc - 1) / bc - kv_begin / bc;
}

// The launch's span in cycles: blocks in launch order onto the first free SM.
double makespan(const WgProblem& p, int sms, bool narrow, int64_t split_from, int splits) {
  const Shape s = shape_of(p, narrow);
  const double per_tile = cycles_per_tile(p, narrow), fixed = fixed_cycles(p);
  SmQueue queue(sms);
  double end = 0;
  for (int64_t u = 0; u < s.units; ++u) {
    const int n = key_tiles(p, s, u);
    if (splits <= 1 || u < split_from) {
      end = std::max(end, queue.run(fixed + per_tile * n));
      continue;
    }
    double last = 0;  // the row tile's last piece, which merges the others
    for (int piece = 0; piece < splits; ++piece) {
      const int share = ws::piece_first_tile(n, piece + 1, splits) - ws::piece_first_tile(n, piece, splits);
      last = std::max(last, queue.run(fixed + kPieceCycles + per_tile * share));
    }
    end = std::max(end, last + kMergeCycles + kMergeCyclesPerPiece * (splits - 1));
  }
  return end;
}

WgLaunch with_blocks(WgLaunch w, const WgProblem& p) {
  const int64_t units = shape_of(p, w.narrow).units;
  w.blocks = w.splits > 1 ? w.split_from + (units - w.split_from) * w.splits : units;
  return w;
}

}  // namespace

WgLaunch plan_wg_launch(const WgProblem& p, int sms, bool narrow_ok, int forced_narrow, int forced_splits) {
  narrow_ok = narrow_ok && p.E == 64 && !p.widen;
  WgLaunch w;
  const int64_t wide_units = shape_of(p, false).units;
  if (forced_narrow >= 0) w.narrow = narrow_ok && forced_narrow == 1;
  if (forced_splits > 1) {
    const int64_t units = shape_of(p, w.narrow).units;
    w.split_from = units / 2, w.splits = forced_splits;
    return with_blocks(w, p);
  }
  if (sms <= 0 || wide_units > 8 * int64_t(sms)) return with_blocks(w, p);
  const double base = makespan(p, sms, false, 0, 1);
  double best = 0.95 * base;
  std::vector<bool> variants = {w.narrow};
  // Two consumers only for one to four waves of three-consumer blocks: fewer
  // blocks than SMs keep three (the shape the rest of the planner's tests
  // cover), more waves leave little idle.
  if (forced_narrow < 0 && narrow_ok && wide_units > sms && wide_units <= 4 * int64_t(sms)) variants.push_back(true);
  for (bool narrow : variants) {
    if (narrow) {
      const double t = makespan(p, sms, true, 0, 1);
      if (t < best) best = t, w = WgLaunch{true, 0, 1};
    }
    if (forced_splits == 0 || forced_splits == 1) continue;
    const Shape s = shape_of(p, narrow);
    const int64_t state_bytes = ws::split_state_floats(p.E, ws::f16_groups(p.E, narrow)) * 4;
    // Tails: the last partial wave, or it and one whole wave, or everything.
    const int64_t rest = s.units % sms;
    for (int64_t tail : {rest, rest + sms, s.units}) {
      if (tail <= 0 || tail > s.units) continue;
      const int64_t split_from = s.units - tail;
      // The lightest row tile is the last launched: pieces of at least two key tiles.
      const int min_tiles = key_tiles(p, s, s.units - 1);
      for (int splits = 2; splits <= kMaxSplits && 2 * splits <= min_tiles && tail * splits <= 4 * int64_t(sms) &&
                           tail * splits * state_bytes <= kMaxStateBytes;
           ++splits) {
        const double t = makespan(p, sms, narrow, split_from, splits);
        if (t < best) best = t, w = WgLaunch{narrow, split_from, splits};
      }
    }
  }
  return with_blocks(w, p);
}

}  // namespace flashattn::cuda
