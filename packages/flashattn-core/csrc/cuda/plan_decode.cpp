// The decode kernels' launches (decode.cu; on tensor cores decode_mma.cu
// and decode_tf32.cu): FlashDecoding, the keys split across blocks and
// merged in the same launch by the block that finds its group done.

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "cuda/kernels/decode_shapes.h"
#include "cuda/planner.h"

namespace flashattn::cuda {

namespace {

// Decode splits hold at least one chunk of 32 keys per warp. A decode block
// is latency-bound (each warp walks its chunks one after another), so the
// keys are split until about kDecodeTargetBlocks blocks fill the GPU.
constexpr int kDecodeMaxRows = 16, kDecodeKeysPerBlockStep = 128, kDecodeMinKeysPerSplit = 128;
// Query rows of one decode block (kMaxRows in decode.cu): groups with more
// rows (up to kDecodeMaxRows) take several blocks.
constexpr int kDecodeBlockRows = 8;
// Query rows of a tensor-core decode block (the M of mma.sync m16n8k16;
// decode_mma.cu packs a group into them).
constexpr int kMmaDecodeRows = 16;
// The float32 one (decode_tf32.cu) uses rows 0-7 of m16n8k8 (TF32).
constexpr int kTf32DecodeRows = 8;
// Up to this many keys one block per group walks them all and writes the
// output: faster than splitting up to here, slower beyond (a rough threshold:
// calls this short vary much between runs).
constexpr int kDecodeOneSplitMaxKeys = 1024;
// Blocks that keep a large GPU busy in decode: a few an SM (one an SM cost
// qwen05b far more than it gained hd128: docs/cuda.md).
constexpr int kDecodeTargetBlocks = 512;
// The tensor-core decode's fused merge (one launch: a block that finds its
// group done merges its splits; decode_combine.cuh) wants fewer, longer
// splits: its merge runs in one block per group, at the end. About this many
// blocks, splits of at least kFusedMinKeysPerSplit keys, for the float32
// kernel; the 16-bit one aims at its own count (decode_shapes.h:
// mma_target_blocks).
constexpr int kFusedTargetBlocks = 128, kFusedMinKeysPerSplit = 256;
constexpr int kFusedMaxSplits = 64;  // of the kernel's 128 (decode_combine.cuh)
// decode.cu's fused decode (float32, masks, L > 1) is bound by its
// arithmetic (scalar FMA, a lane per key), not by the merge: it wants many
// blocks (the rule above was far slower for it). So for it: about
// kDecodeTargetBlocks blocks, splits of at least kDecodeMinKeysPerSplit keys,
// at most the kernel's 128 splits.
constexpr int kScalarFusedMaxSplits = 128;

// How a decode kernel splits its keys: up to one_split_max_keys one block per
// group (no merge); above, about target_blocks blocks, splits of at least
// min_keys keys, at most max_splits (then the same launch merges them).
struct SplitRule {
  int one_split_max_keys, target_blocks, min_keys, max_splits;
};
constexpr SplitRule kScalarSplits{kDecodeOneSplitMaxKeys, kDecodeTargetBlocks, kDecodeMinKeysPerSplit,
                                  kScalarFusedMaxSplits};
// The 16-bit one aims at its own block count a call (decode_shapes.h: two
// blocks an SM at E = 128).
constexpr SplitRule mma_splits(int E) {
  return {kDecodeOneSplitMaxKeys, fa::decode_shapes::mma_target_blocks(E), kFusedMinKeysPerSplit, kFusedMaxSplits};
}
// The float32 tensor-core decode reads twice the bytes a key and its block
// covers at most 256 keys a pass (64 at E = 128), so it splits sooner and
// finer than the 16-bit one (docs/cuda.md).
constexpr SplitRule kTf32Splits{256, kFusedTargetBlocks, 128, kFusedMaxSplits};

bool has_decode_kernel(int E) {
  return E == 64 || E == 96 || E == 128;
}

// The tensor-core decode kernels: E = 64 or 128, no key inside the range
// hidden (no mask, or causal with one query position), and one block's rows
// hold the group's: 16 for float16 / bfloat16 (decode_mma.cu), 8 for float32
// (decode_tf32.cu). The family's name; empty: decode.cu takes the call.
// Widened, the 16-bit one's float32 variant (decode_mma.cu: fa_decode_mma32_).
// With sinks, the *_sinks_ kernels (the sinks their fourth input).
std::string tensor_core_decode(const Dims& d, int rows_per_group) {
  const bool hides_none = d.kind == static_cast<int>(MaskKind::none) ||
      (d.kind == static_cast<int>(MaskKind::causal) && d.L == 1 && (d.window() == 0 || d.window() >= d.S));
  if (!hides_none || (d.E != 64 && d.E != 128)) return "";
  const std::string sinks = d.sinks() ? "sinks_" : "";
  // Quantized rows read in place: the 16-bit kernel's fa_decode_mmaq<bits>_ for
  // attention in the queries' 16-bit dtype, the float32 one's
  // fa_decode_tf32q_ for float32 attention (widened, or float32 inputs).
  if (d.quantized()) {
    if (d.quant_bits != 4 && d.quant_bits != 8) return "";
    if (d.dt == "float32" || d.widen) return rows_per_group <= kTf32DecodeRows ? "fa_decode_tf32q_" + sinks : "";
    return rows_per_group <= kMmaDecodeRows ? "fa_decode_mmaq" + std::to_string(d.quant_bits) + "_" + sinks : "";
  }
  if (d.dt == "float32") return rows_per_group <= kTf32DecodeRows ? "fa_decode_tf32_" + sinks : "";
  if (rows_per_group > kMmaDecodeRows) return "";
  return (d.widen ? "fa_decode_mma32_" : "fa_decode_mma_") + sinks;
}

// Whether a decode kernel takes the call (the tensor-core ones or
// decode.cu, by head dim). decode.cu's lanes take a key each and a block
// shares each K / V row among its rows; with one row a group (multi-head
// attention) there is nothing to share, and at E = 96 (Phi-3-mini: 32 / 32
// heads) the generic kernel's grouped walk (a warp a row) is faster.
bool decode_takes(const Dims& d, int rows_per_group) {
  return has_decode_kernel(d.E) && !(d.E == 96 && rows_per_group == 1);
}

}  // namespace

std::optional<Launches> decode_launches(const Dims& d, int& splits) {
  const int rows_per_group = (d.H_q / d.H_kv) * d.L;
  const std::string tensor_core = tensor_core_decode(d, rows_per_group);
  const bool mma = !tensor_core.empty();
  // widened or quantized: the tensor-core decode only
  if ((d.widen || d.quantized()) && !mma) return std::nullopt;
  const int row_blocks = mma ? 1 : (rows_per_group + kDecodeBlockRows - 1) / kDecodeBlockRows;
  if (d.L >= kMinPrefillL || rows_per_group > kDecodeMaxRows || !decode_takes(d, rows_per_group) ||
      d.batch > 65535 || d.H_kv * row_blocks > 65535) {
    return std::nullopt;
  }
  const int64_t groups = d.batch * d.H_kv;
  const bool tf32 = tensor_core.rfind("fa_decode_tf32", 0) == 0;
  const SplitRule rule = tf32 ? kTf32Splits : mma ? mma_splits(d.E) : kScalarSplits;
  const bool fused = d.S > rule.one_split_max_keys;
  splits = static_cast<int>(std::clamp<int64_t>((rule.target_blocks + groups - 1) / groups, 1,
                                                (d.S + rule.min_keys - 1) / rule.min_keys));
  splits = std::min(splits, rule.max_splits);
  if (!fused) splits = 1;
  int keys_per_split = (d.S + splits - 1) / splits;
  keys_per_split = (keys_per_split + kDecodeKeysPerBlockStep - 1) / kDecodeKeysPerBlockStep * kDecodeKeysPerBlockStep;
  splits = (d.S + keys_per_split - 1) / keys_per_split;
  // The tensor-core decodes take no mask (decode_mma.cu, decode_tf32.cu).
  const bool masks = !mma;
  std::vector<Scalar> scalars = {d.H_q, d.H_kv, d.L, d.S};
  if (masks) scalars.insert(scalars.end(), {d.kind_arg, d.mask_rs, d.mask_cs});
  scalars.insert(scalars.end(), {keys_per_split, d.scale_log2});
  if (d.quantized()) scalars.insert(scalars.end(), {d.quant_bits, d.quant_group_shift()});
  const std::string suffix = d.dt + "_" + std::to_string(d.E);
  const std::string family = mma ? tensor_core : "fa_decode_";
  // Past one split the keys are always merged in the same launch (splits
  // stay within every rule's max_splits).
  const char* variant = splits == 1 ? "" : "fused_";
  const int threads = !mma ? kThreads
      : tf32 ? 32 * fa::decode_shapes::tf32_warps(d.E) : 32 * fa::decode_shapes::mma_warps(d.E);
  Step attend{family + variant + suffix, scalars,
              {splits * threads, d.H_kv * row_blocks, static_cast<int>(d.batch)}, {threads, 1, 1}, 0, masks,
              mma && d.sinks(), d.quantized()};
  if (splits == 1) return Launches{attend, std::nullopt};
  // the fused kernel's scratch past the m / l partials: a ticket word per
  // group, 8 bytes (decode_combine.cuh)
  return Launches{attend, std::nullopt, 2 * groups * row_blocks};
}

}  // namespace flashattn::cuda
