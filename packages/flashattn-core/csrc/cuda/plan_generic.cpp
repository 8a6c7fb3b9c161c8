// The generic kernel's launches (generic.cu, generic_vec.cu): a warp a
// query row, any head dim, dtype, mask and strides; when the rows are few,
// the keys split and merged by fa_merge_<dtype>.

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "cuda/kernels/merge_shapes.h"
#include "cuda/planner.h"

namespace flashattn::cuda {

namespace {

constexpr int kMergeThreads = fa::merge_shapes::kThreads;
// Warps that keep a large GPU busy; decode splits its keys until there are
// about this many.
constexpr int kTargetWarps = 4096;
// Keys a generic split takes at least: 64 (four groups of its walk,
// generic.cu) keeps a decode's warps many enough to hide their latency.
constexpr int kMinKeysPerSplit = 64;
constexpr int kMaxSplits = fa::merge_shapes::kMaxSplits;  // what a merge takes

// Widened, the merge writes float32 (its partials are float32 for every
// dtype), or the inputs' dtype where a 16-bit output is asked for (out16); for a
// gradient, fa_merge_lse_ also each row's log-sum-exp.
Step merge_step(const Dims& d, int rows, int splits) {
  Step merge{(d.lse ? "fa_merge_lse_" : "fa_merge_") + (d.widen && !d.out16 ? std::string("float32") : d.dt),
             {rows, d.E, splits}, {rows * kMergeThreads, 1, 1}, {kMergeThreads, 1, 1}, 0};
  merge.lse_output = d.lse;
  return merge;
}

// The lanes a key of the split kernel with 16-byte loads (generic_vec.cu:
// a power of two, at least 8, at least E / (16 / itemsize)); 0 where it
// does not take E (a multiple of 16 bytes, at most 32 lanes' worth).
int vec_lanes(const Dims& d) {
  const int per_lane = d.dt == "float32" ? 4 : 8;  // elements in 16 bytes
  if (d.E % per_lane != 0 || d.E > 32 * per_lane) return 0;
  int lanes = 8;
  while (lanes * per_lane < d.E) lanes *= 2;
  return lanes;
}

}  // namespace

int generic_splits(const Dims& d) {
  const int64_t rows = d.batch * d.H_q * d.L;
  if (rows >= kTargetWarps || d.S < 2 * kMinKeysPerSplit) return 1;
  const int splits = static_cast<int>(std::min<int64_t>((kTargetWarps + rows - 1) / rows, d.S / kMinKeysPerSplit));
  return std::min(splits, kMaxSplits);
}

Launches generic_launches(const Dims& d, int splits, bool aligned) {
  const int64_t rows = d.batch * d.H_q * d.L;
  const int keys_per_split = (d.S + splits - 1) / splits;
  const int64_t threads = ((rows * 32 + kThreads - 1) / kThreads) * kThreads;
  if (threads > std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input, "flash_attention: too many query rows for one CUDA launch");
  }
  std::vector<Scalar> scalars = {static_cast<int>(d.batch), d.H_q, d.H_kv, d.L, d.S, d.E, d.kind_arg,
                                 d.mask_rs, d.mask_cs, keys_per_split, d.scale_log2};
  const std::string suffix = d.dt + "_" + std::to_string((d.E + 31) / 32);
  // For a gradient the split form even with one split: its merge keeps the
  // rows' log-sum-exp.
  const bool split = splits > 1 || d.widen || d.lse;
  const int lanes = aligned && split ? vec_lanes(d) : 0;
  const std::string kernel = lanes > 0 ? "fa_generic_vsplit_" + d.dt + "_" + std::to_string(lanes)
                             : split   ? "fa_generic_split_" + suffix
                                       : "fa_generic_" + suffix;
  Step attend{kernel, scalars, {static_cast<int>(threads), splits, 1}, {kThreads, 1, 1}, 0};
  if (!split) return {attend, std::nullopt};
  return {attend, merge_step(d, static_cast<int>(rows), splits)};
}

}  // namespace flashattn::cuda
