// The shape of the 16-bit wgmma prefill's launch of a row tile a block
// (prefill_f16_wg.cu without its one-block-per-SM schedule): two consumers
// or three at E = 64, and whether the last row tiles' keys are split
// (key_split.cuh). Decided by a model of the launch: blocks taken in launch
// order by whichever SM is free first, each costing a fixed part plus its
// key tiles times the cycles a key tile took in H200 block timelines
// (benchmarks/cuda-probes/prefill-timeline.cu).

#pragma once

#include <cstdint>

namespace flashattn::cuda {

struct WgProblem {
  int64_t slices;  // batch x query heads
  int L, S, E;
  bool causal, widen;
  int window = 0;  // a causal mask's sliding window (0: none)
};

struct WgLaunch {
  bool narrow = false;     // fa_prefill_wg2_* (row tiles of 128 at E = 64)
  int64_t split_from = 0;  // blocks that take a whole row tile, heaviest first
  int splits = 1;          // > 1: every later row tile in this many key pieces, a block each
  int64_t blocks = 0;      // the launch's blocks
};

// sms: the GPU's multiprocessors (0: unknown, nothing is modelled).
// narrow_ok: fa_prefill_wg2_* exists for the call. forced_narrow /
// forced_splits: -1 to let the model decide, else what tests and probes ask
// for (forced splits cut the second half of the row tiles).
WgLaunch plan_wg_launch(const WgProblem& p, int sms, bool narrow_ok, int forced_narrow, int forced_splits);

}  // namespace flashattn::cuda
