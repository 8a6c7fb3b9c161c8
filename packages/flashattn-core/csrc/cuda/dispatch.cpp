// Which CUDA kernel runs, and its launch: the one place that decides.
//
//   L <= 8, ratio x L <= 16 query rows per KV head, E in {64, 96, 128}
//       (at E = 96 at least two rows per KV head):
//       decode (FlashDecoding: keys split across blocks and merged in the
//       same launch by a block that finds its group done; up to 1024 keys one block
//       per group, no merge); on tensor cores
//       (decode_mma.cu) for float16 / bfloat16, E in {64, 128} when no key
//       in the range is hidden (no mask, or causal with L = 1); so too for
//       float32 with at most 8 rows per KV head, with the 3xTF32 split
//       (decode_tf32.cu)
//   float16 / bfloat16, E in {64, 80, 96, 128, 256}, L > 8: tensor-core prefill;
//       for E in {64, 80, 96, 128} on Hopper, on wgmma (prefill_f16_wg.cu;
//       80 and 96 in the 128 kernel's tiles)
//   float32, E in {64, 80, 96, 128, 256}, L > 8: 3xTF32 tensor-core prefill;
//       for E = 64 on Hopper, on wgmma (prefill_tf32_wg.cu)
//       (a prefill kernel whose block needs more shared memory than the GPU
//       has, 16-bit E = 256 or float32 E = 128 on sm_86 / sm_89: the
//       generic kernel)
//   everything else: the generic kernel (keys split and merged when the
//       query rows are few; split, with 16-byte loads where the rows allow:
//       generic_vec.cu)
//   widened (dtype=float32 over float16 / bfloat16 inputs): the float32
//       variants of the 16-bit tensor-core decode and (Hopper) wgmma
//       prefill; other decode calls (L <= 8) the generic kernel's split form
//       (its arithmetic is float32 whatever the inputs), reading the 16-bit
//       cache in place; other prefill calls run the float32 path on cast
//       inputs
//
// The launches are planned here, when the graph is built; they run in the
// primitive (primitive.cpp) once the inputs exist, with their strides:
// strided views (mlx-lm's KV cache, transposed queries) are read in place.
// A mask keeps its own shape: the kernels address it through per-(batch,
// query head) base offsets and row/column strides that are 0 where it
// broadcasts, so a broadcast mask is never materialised.

#include "cuda/dispatch.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "cuda/driver.h"
#include "cuda/kernel_images.h"
#include "cuda/kernels/decode_shapes.h"
#include "cuda/kernels/merge_shapes.h"
#include "cuda/kernels/partials.h"
#include "cuda/kernels/tf32_shapes.h"
#include "cuda/kernels/wg_shapes.h"
#include "cuda/plan.h"
#include "cuda/primitive.h"
#include "cuda/recent.h"
#include "cuda/wg_launch.h"
#include "mask_layout.h"
#include "mlx/backend/gpu/device_info.h"

namespace flashattn::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 128;
constexpr int kMergeThreads = fa::merge_shapes::kThreads;

// Warps (16 query rows each) of the float16 / bfloat16 prefill kernel.
int prefill_warps(int E) {
  return E <= 64 ? 8 : 4;
}
constexpr int kMinPrefillL = 9;   // below: the decode path
// Warps that keep a large GPU busy; decode splits its keys until there are
// about this many.
constexpr int kTargetWarps = 4096;
// Keys a generic split takes at least: 64 (four groups of its walk,
// generic.cu) keeps a decode's warps many enough to hide their latency.
constexpr int kMinKeysPerSplit = 64;

const char* dtype_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  return "bfloat16";
}


// The mask as the kernels read it: (data, per-(b, h_q) base offsets, row
// stride, column stride). Without an array mask the kernels never read
// either pointer, so the queries stand in (no extra arrays, no extra work).
struct MaskArgs {
  mx::array data, base;
  int row_stride = 0, col_stride = 0;
};

MaskArgs mask_args(const mx::array& q, MaskKind kind, const std::optional<mx::array>& mask, mx::Stream s) {
  MaskArgs args{q, q};
  if (kind != MaskKind::boolean && kind != MaskKind::additive) {
    return args;
  }
  MaskLayout layout = mask_layout(q, kind == MaskKind::boolean ? *mask : mx::astype(*mask, mx::float32, s), s);
  args.data = layout.data;
  args.base = mx::array(layout.base.data(), {static_cast<int>(layout.base.size())}, mx::int64);
  args.row_stride = layout.row_stride;
  args.col_stride = layout.col_stride;
  return args;
}

int prefill_rows(mx::Dtype t, int E) {
  return t == mx::float32 ? fa::tf32_shapes::rows(E) : 16 * prefill_warps(E);
}

int prefill_threads(mx::Dtype t, int E) {
  return t == mx::float32 ? fa::tf32_shapes::threads(E) : 32 * prefill_warps(E);
}

int prefill_smem_bytes(mx::Dtype t, int E) {
  if (t == mx::float32) return fa::tf32_shapes::smem_bytes(E);
  constexpr int kBc = 64;  // Q, then two buffers of K and V
  return (prefill_rows(t, E) + 4 * kBc) * (E + 8) * 2;
}

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
constexpr int kMaxSplits = fa::merge_shapes::kMaxSplits;  // what a merge takes
// Blocks that keep a large GPU busy in decode: one an SM gained 8% at hd128
// on an H200 but cost qwen05b up to 40%.
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
// blocks (the rule above took up to 2.4x its time). So for it: about
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
// finer (with the 16-bit kernel's rule it ran at about half MLX's speed at
// S = 1024-2048).
constexpr SplitRule kTf32Splits{256, kFusedTargetBlocks, 128, kFusedMaxSplits};

bool has_decode_kernel(int E) {
  return E == 64 || E == 96 || E == 128;
}

bool has_prefill_kernel(int E) {
  return E == 64 || E == 80 || E == 96 || E == 128 || E == 256;
}

// Shared memory a block may have on the device: what it says, or, when the
// driver cannot say, the least of any GPU the kernels are built for (sm_86
// and sm_89's 99 KB). The mma.sync prefills at 16 bits and E = 256 (165 KB)
// and at float32 and E = 128 (100 KB) take more: where they do not fit, the
// generic kernel runs instead of a launch that fails.
int shared_memory_limit(int device_index) {
  constexpr int kLeastOptIn = 99 * 1024;
  const int limit = max_shared_memory_per_block(device_index);
  return limit > 0 ? limit : kLeastOptIn;
}

}  // namespace

namespace {

// Whether the GPU runs the sm_90 machine code (compute capability 9.0 exactly:
// sm_90 cubins load nowhere else), asked of MLX once per device.
// FLASHATTN_CUDA_IMAGE=ptx takes the PTX modules everywhere (tests of that
// path on a Hopper GPU).
bool runs_sm90(int device_index) {
  static const bool forced_ptx = [] {
    const char* image = std::getenv("FLASHATTN_CUDA_IMAGE");
    return image != nullptr && std::string(image) == "ptx";
  }();
  if (forced_ptx) return false;
  static std::mutex mutex;
  static std::unordered_map<int, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device_index);
  if (it != known.end()) return it->second;
  const auto& info = mx::gpu::device_info(device_index);
  auto cc = [&](const char* key) -> size_t {
    auto f = info.find(key);
    return f != info.end() && std::holds_alternative<size_t>(f->second) ? std::get<size_t>(f->second) : 0;
  };
  const bool sm90 = cc("compute_capability_major") == 9 && cc("compute_capability_minor") == 0;
  known[device_index] = sm90;
  return sm90;
}

}  // namespace

const std::string* find_image(const std::string& kernel, int device_index) {
  static std::once_flag once;
  static std::unordered_map<std::string, const KernelImage*> index;
  std::call_once(once, [] {
    for (const auto& m : kernel_images()) index[m.kernel] = &m;
  });
  auto it = index.find(kernel);
  if (it == index.end()) return nullptr;
  const std::string* image = runs_sm90(device_index) ? &it->second->sm90 : &it->second->ptx;
  return image->empty() ? nullptr : image;  // e.g. a Hopper-only kernel elsewhere
}

bool kernels_available() {
  return !kernel_images().empty();
}

namespace {

// What the launches depend on, from the shapes.
struct Dims {
  int64_t batch;
  int H_q, H_kv, L, S, E;
  std::string dt;
  int kind, mask_rs, mask_cs;
  float scale_log2;
  bool widen;  // float32 attention over 16-bit inputs, float32 output
};

// Widened, the merge writes float32 (its partials are float32 for every dtype).
Step merge_step(const Dims& d, int rows, int splits) {
  return {"fa_merge_" + (d.widen ? std::string("float32") : d.dt), {rows, d.E, splits}, {rows * kMergeThreads, 1, 1}, {kMergeThreads, 1, 1}, 0};
}

// The generic kernel's key splits when it is the planned kernel: as many as
// keep the GPU busy when the rows are few.
int generic_splits(const Dims& d) {
  const int64_t rows = d.batch * d.H_q * d.L;
  if (rows >= kTargetWarps || d.S < 2 * kMinKeysPerSplit) return 1;
  const int splits = static_cast<int>(std::min<int64_t>((kTargetWarps + rows - 1) / rows, d.S / kMinKeysPerSplit));
  return std::min(splits, kMaxSplits);
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

// The generic kernel: one warp per query row, any head dim, any strides.
// Widened (16-bit inputs, float32 output) always in its split form, even
// with one split: its partials are float32, and fa_merge_float32 writes a
// float32 output. aligned: every row starts on a 16-byte boundary, so the
// split form may take 16-byte loads (generic_vec.cu; the same partials).
Launches generic_launches(const Dims& d, int splits, bool aligned = false) {
  const int64_t rows = d.batch * d.H_q * d.L;
  const int keys_per_split = (d.S + splits - 1) / splits;
  const int64_t threads = ((rows * 32 + kThreads - 1) / kThreads) * kThreads;
  if (threads > std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input, "flash_attention: too many query rows for one CUDA launch");
  }
  std::vector<Scalar> scalars = {static_cast<int>(d.batch), d.H_q, d.H_kv, d.L, d.S, d.E, d.kind,
                                 d.mask_rs, d.mask_cs, keys_per_split, d.scale_log2};
  const std::string suffix = d.dt + "_" + std::to_string((d.E + 31) / 32);
  const bool split = splits > 1 || d.widen;
  const int lanes = aligned && split ? vec_lanes(d) : 0;
  const std::string kernel = lanes > 0 ? "fa_generic_vsplit_" + d.dt + "_" + std::to_string(lanes)
                             : split   ? "fa_generic_split_" + suffix
                                       : "fa_generic_" + suffix;
  Step attend{kernel, scalars, {static_cast<int>(threads), splits, 1}, {kThreads, 1, 1}, 0};
  if (!split) return {attend, std::nullopt};
  return {attend, merge_step(d, static_cast<int>(rows), splits)};
}

// The tensor-core decode kernels: E = 64 or 128, no key inside the range
// hidden (no mask, or causal with one query position), and one block's rows
// hold the group's: 16 for float16 / bfloat16 (decode_mma.cu), 8 for float32
// (decode_tf32.cu). The family's name; empty: decode.cu takes the call.
// Widened, the 16-bit one's float32 variant (decode_mma.cu: fa_decode_mma32_).
std::string tensor_core_decode(const Dims& d, int rows_per_group) {
  const bool hides_none = d.kind == static_cast<int>(MaskKind::none) ||
      (d.kind == static_cast<int>(MaskKind::causal) && d.L == 1);
  if (!hides_none || (d.E != 64 && d.E != 128)) return "";
  if (d.dt == "float32") return rows_per_group <= kTf32DecodeRows ? "fa_decode_tf32_" : "";
  if (rows_per_group > kMmaDecodeRows) return "";
  return d.widen ? "fa_decode_mma32_" : "fa_decode_mma_";
}

// Whether a decode kernel takes the call (the tensor-core ones or
// decode.cu, by head dim). decode.cu's lanes take a key each and a block
// shares each K / V row among its rows; with one row a group (multi-head
// attention) there is nothing to share, and at E = 96 (Phi-3-mini: 32 / 32
// heads) the generic kernel's grouped walk (a warp a row) was faster, up to
// 2x at S = 32768 on an H200.
bool decode_takes(const Dims& d, int rows_per_group) {
  return has_decode_kernel(d.E) && !(d.E == 96 && rows_per_group == 1);
}

// The decode launches, when decode takes the call; splits: the key splits chosen.
std::optional<Launches> decode_launches(const Dims& d, int& splits) {
  const int rows_per_group = (d.H_q / d.H_kv) * d.L;
  const std::string tensor_core = tensor_core_decode(d, rows_per_group);
  const bool mma = !tensor_core.empty();
  if (d.widen && !mma) return std::nullopt;  // widened: the tensor-core decode only
  const int row_blocks = mma ? 1 : (rows_per_group + kDecodeBlockRows - 1) / kDecodeBlockRows;
  if (d.L >= kMinPrefillL || rows_per_group > kDecodeMaxRows || !decode_takes(d, rows_per_group) ||
      d.batch > 65535 || d.H_kv * row_blocks > 65535) {
    return std::nullopt;
  }
  const int64_t groups = d.batch * d.H_kv;
  const bool tf32 = mma && d.dt == "float32";
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
  if (masks) scalars.insert(scalars.end(), {d.kind, d.mask_rs, d.mask_cs});
  scalars.insert(scalars.end(), {keys_per_split, d.scale_log2});
  const std::string suffix = d.dt + "_" + std::to_string(d.E);
  const std::string family = mma ? tensor_core : "fa_decode_";
  // Past one split the keys are always merged in the same launch (splits
  // stay within every rule's max_splits).
  const char* variant = splits == 1 ? "" : "fused_";
  const int threads = !mma ? kThreads
      : tf32 ? 32 * fa::decode_shapes::tf32_warps(d.E) : 32 * fa::decode_shapes::mma_warps(d.E);
  Step attend{family + variant + suffix, scalars,
              {splits * threads, d.H_kv * row_blocks, static_cast<int>(d.batch)}, {threads, 1, 1}, 0, masks};
  if (splits == 1) return Launches{attend, std::nullopt};
  // the fused kernel's scratch past the m / l partials: a ticket word per
  // group, 8 bytes (decode_combine.cuh)
  return Launches{attend, std::nullopt, 2 * groups * row_blocks};
}

// The tensor-map template of the 16-bit wgmma kernels (tma.cuh) as 32
// launch arguments, made once per dtype; empty without tensor maps.
const std::vector<int>& map_template(mx::Dtype t) {
  static std::mutex mutex;
  static std::map<bool, std::vector<int>> made;
  std::lock_guard<std::mutex> lock(mutex);
  const bool float16 = t == mx::float16;
  auto it = made.find(float16);
  if (it == made.end()) {
    std::vector<int> words;
    if (const auto map = tensor_map_template(float16)) {
      for (uint32_t w : *map) words.push_back(static_cast<int>(w));
    }
    it = made.emplace(float16, std::move(words)).first;
  }
  return it->second;
}

// FLASHATTN_CUDA_NARROW=1 or 0 (tests, probes): two consumers at E = 64 for
// every 16-bit prefill the wgmma kernels take a row tile a block, or for
// none. FLASHATTN_CUDA_SPLITS=n > 1: the second half of those launches' row
// tiles in n key pieces each (key_split.cuh); 0 or 1: no splits. Unset (-1),
// the launch model decides (wg_launch.h).
int forced(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return -1;
  try {
    return std::max(0, std::stoi(v));
  } catch (const std::exception&) {
    throw std::invalid_argument(std::string(name) + " must be a non-negative integer; got '" + v + "'");
  }
}
int forced_narrow() {
  static const int value = forced("FLASHATTN_CUDA_NARROW");
  return value;
}
int forced_splits() {
  static const int value = forced("FLASHATTN_CUDA_SPLITS");
  return value;
}

std::optional<Launches> prefill_launches(const Dims& d, mx::Dtype dtype, int device_index) {
  if (d.L < kMinPrefillL || !has_prefill_kernel(d.E) || d.batch > 65535 || d.H_q > 65535) {
    return std::nullopt;
  }
  std::string kernel = "fa_prefill_" + d.dt + "_" + std::to_string(d.E);
  int rows = prefill_rows(dtype, d.E), threads = prefill_threads(dtype, d.E), smem = prefill_smem_bytes(dtype, d.E);
  if (smem > shared_memory_limit(device_index)) return std::nullopt;  // it would not launch: the generic kernel
  // Hopper: the wgmma kernels (only sm_90a images exist: find_image finds none elsewhere).
  // Widened, the 16-bit one's float32 variant (fa_prefill_wg32_) or none.
  namespace ws = fa::wg_shapes;
  const std::string wg_kernel = (d.widen ? "fa_prefill_wg32_" : "fa_prefill_wg_") + d.dt + "_" + std::to_string(d.E);
  // The 16-bit ones copy with tensor maps: without them, the mma.sync kernel.
  const bool needs_maps = dtype != mx::float32;
  const std::vector<int> maps = needs_maps ? map_template(dtype) : std::vector<int>{};
  const bool wg = (!needs_maps || !maps.empty()) && find_image(wg_kernel, device_index);
  WgLaunch wg_launch;
  std::optional<std::tuple<int, int, int>> grid;
  int schedule_slices = 0;
  int64_t split_bytes = 0;
  if (wg) {
    kernel = wg_kernel;
    if (dtype == mx::float32) {
      rows = ws::kTf32Rows, threads = ws::kTf32Threads, smem = ws::kTf32SmemBytes;
    } else {
      const std::string wg2_kernel = "fa_prefill_wg2_" + d.dt + "_64";
      const int sms = multiprocessors(device_index);
      const int64_t slices = d.batch * d.H_q;
      const int wide_rows = ws::f16_rows(d.E, d.widen);
      const int64_t wide_units = slices * ((d.L + wide_rows - 1) / wide_rows);
      // Scheduled (prefill_f16_wg.cu, E = 128): one block per SM takes a
      // share of all row tiles, when there are enough of them; otherwise a
      // row tile a block, shaped by the launch model.
      const bool scheduled = ws::f16_items(d.E) == 2 && sms > 0 && wide_units >= ws::kF16ScheduleMinTiles &&
                             slices <= std::numeric_limits<int>::max();
      if (!scheduled) {
        const WgProblem problem{slices, d.L, d.S, d.E, d.kind == static_cast<int>(MaskKind::causal), d.widen};
        wg_launch = plan_wg_launch(problem, sms, find_image(wg2_kernel, device_index) != nullptr, forced_narrow(),
                                   forced_splits());
      }
      if (wg_launch.narrow) kernel = wg2_kernel;
      rows = ws::f16_rows(d.E, d.widen, wg_launch.narrow), threads = ws::f16_threads(d.E, d.widen, wg_launch.narrow),
      smem = ws::f16_smem_bytes(d.E, d.widen, wg_launch.narrow);
      const int64_t units = slices * ((d.L + rows - 1) / rows);
      if (scheduled) {
        schedule_slices = static_cast<int>(slices);
        grid = {static_cast<int>(std::min<int64_t>(units, sms)) * threads, 1, 1};
      } else if (wg_launch.splits > 1) {
        schedule_slices = static_cast<int>(slices);
        grid = {static_cast<int>(wg_launch.blocks) * threads, 1, 1};
        split_bytes = ws::split_scratch_bytes(units - wg_launch.split_from, wg_launch.splits, d.E,
                                              ws::f16_groups(d.E, d.widen, wg_launch.narrow));
      }
    }
  } else if (d.widen) {
    return std::nullopt;
  }
  const int tiles = (d.L + rows - 1) / rows;
  std::vector<Scalar> scalars = {d.H_q, d.H_kv, d.L, d.S, d.kind, d.mask_rs, d.mask_cs, d.scale_log2};
  if (!grid) grid = {tiles * threads, d.H_q, static_cast<int>(d.batch)};
  if (wg && dtype != mx::float32) {
    // The 16-bit kernels' slices (the scheduled or split launch's; 0 for a
    // grid of row tiles x heads x batch) and key splits (wg_launch.h).
    const bool split = wg_launch.splits > 1;
    scalars.insert(scalars.end(), {schedule_slices, split ? static_cast<int>(wg_launch.split_from) : 0,
                                   split ? wg_launch.splits : 0});
  }
  Step attend{kernel, scalars, *grid, {threads, 1, 1}, smem};
  Launches out{attend, std::nullopt, 0, wg ? maps : std::vector<int>{}};
  out.split_bytes = split_bytes;
  return out;
}

// What a call's planning depends on beyond Dims' derived values: the
// queries' shape (the output's), the dtype and the device.
struct PlanKey {
  mx::Shape q_shape;
  int H_kv, S, dtype, kind, mask_rs, mask_cs;
  float scale_log2;
  bool widen;
  int device;
  bool operator==(const PlanKey&) const = default;
};

// A call's launches and its primitive's outputs (the attention output, then
// scratch: the tensor maps', the partials).
struct Planned {
  Plan plan;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
};

// nullopt: a widened call that no kernel takes as it is (the caller casts).
std::optional<Planned> plan_call(const Dims& d, mx::Dtype dtype, const mx::Shape& q_shape, int device_index) {
  Planned out;
  Plan& plan = out.plan;
  int splits = 0;
  auto decode = decode_launches(d, splits);
  auto prefill = decode ? std::nullopt : prefill_launches(d, dtype, device_index);
  // A widened decode that no tensor-core decode takes (other head dims, an
  // array mask) goes to the generic kernel on the 16-bit inputs: a cast would
  // copy the whole cache to float32 on every call. A widened prefill goes to
  // the float32 kernels on cast inputs, far faster than the generic one.
  if (d.widen && !decode && !prefill && d.L >= kMinPrefillL) return std::nullopt;
  if (decode) {
    plan.aligned = *decode;
  } else if (prefill) {
    plan.aligned = *prefill;
    splits = 1;
  } else {
    splits = generic_splits(d);
    plan.aligned = generic_launches(d, splits, true);
  }
  // The same splits: the partials (outputs of the primitive) have one shape.
  plan.any = generic_launches(d, splits);
  const int rows = static_cast<int>(d.batch * d.H_q * d.L);
  std::vector<mx::Shape>& shapes = out.shapes;
  std::vector<mx::Dtype>& dtypes = out.dtypes;
  shapes = {q_shape};
  dtypes = {d.widen ? mx::float32 : dtype};
  if (plan.aligned.tma()) {  // scratch for the tensor maps
    namespace ws = fa::wg_shapes;
    const int64_t words = (ws::kMapSlots * ws::kMapSlotBytes + plan.aligned.split_bytes) / 4;
    if (words > std::numeric_limits<int>::max()) {
      throw Unsupported(Reason::input, "flash_attention: too many query rows for one CUDA prefill call");
    }
    shapes.push_back({static_cast<int>(words)});
    dtypes.push_back(mx::uint32);
  }
  if (plan.aligned.merge || plan.aligned.fused || plan.any.merge) {
    // The partials, always the last two outputs (primitive.cpp): o, then m /
    // l per split and row. The fused decode takes the first as its one
    // output (kernels/partials.h: its attention output, then its partials
    // and tickets), which the generic kernel of plan.any, writing o from its
    // start, would share.
    namespace fp = fa::partials;
    int64_t o_floats = static_cast<int64_t>(splits) * rows * d.E;
    if (plan.aligned.fused) {
      const int64_t out_bytes = static_cast<int64_t>(rows) * d.E * (d.widen ? 4 : dtype.size());
      o_floats = fp::fused_offset_floats(out_bytes) + fp::floats(splits, rows, d.E) + plan.aligned.fused;
    }
    const int64_t ml_floats = static_cast<int64_t>(splits) * rows * 2;
    if (o_floats > std::numeric_limits<int>::max()) {
      throw Unsupported(Reason::input, "flash_attention: too many query rows for one CUDA decode call");
    }
    if (plan.aligned.fused) {
      shapes.push_back({static_cast<int>(o_floats)});
    } else {
      shapes.push_back({splits, rows, d.E});
    }
    shapes.push_back({static_cast<int>(ml_floats)});
    dtypes.insert(dtypes.end(), {mx::float32, mx::float32});
  }
  return out;
}

}  // namespace

mx::array flash_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    MaskKind mask_kind,
    const std::optional<mx::array>& mask,
    mx::Stream s,
    bool widen) {
  // Widened prefill calls that neither the tensor-core decode nor the Hopper
  // prefill takes are the float32 kernels' on cast inputs.
  auto cast = [&] {
    auto f32 = [&](const mx::array& x) { return mx::astype(x, mx::float32, s); };
    return flash_attention(f32(q), f32(k), f32(v), scale, mask_kind, mask, s);
  };
  const bool mask_array = mask_kind == MaskKind::boolean || mask_kind == MaskKind::additive;
  const int nd = q.ndim();
  int64_t batch = 1;
  for (int d = 0; d < nd - 3; ++d) batch *= q.shape(d);
  MaskArgs m = mask_args(q, mask_kind, mask, s);
  const Dims d{batch, q.shape(-3), k.shape(-3), q.shape(-2), k.shape(-2), q.shape(-1), dtype_name(q.dtype()),
               static_cast<int>(mask_kind), m.row_stride, m.col_stride, scale * kLog2e, widen};
  // Strides reach the kernels as 32-bit launch arguments.
  const int64_t head_elements = static_cast<int64_t>(std::max(d.L, d.S)) * d.E;
  if (head_elements * std::max(d.H_q, d.H_kv) > std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input,
        "flash_attention: on CUDA one batch element of queries, keys or values must hold fewer than 2^31 "
        "elements; got (H_q, H_kv, L, S, E) = (" + std::to_string(d.H_q) + ", " + std::to_string(d.H_kv) +
        ", " + std::to_string(d.L) + ", " + std::to_string(d.S) + ", " + std::to_string(d.E) + ")");
  }

  // A model repeats its calls (recent.h): each thread keeps its last few plans,
  // and that a widened call is cast (nullopt: no plan).
  const PlanKey key{q.shape(), d.H_kv, d.S, static_cast<int>(q.dtype().val()), d.kind, d.mask_rs, d.mask_cs,
                    d.scale_log2, widen, s.device.index};
  thread_local Recent<PlanKey, std::optional<Planned>, 8> recent;
  std::shared_ptr<const std::optional<Planned>> planned = recent.find(key);
  if (!planned) planned = recent.put(key, plan_call(d, q.dtype(), q.shape(), s.device.index));
  if (!planned->has_value()) return cast();
  const Planned& plan = **planned;
  std::vector<mx::array> inputs = {q, k, v};
  if (mask_array) inputs.insert(inputs.end(), {m.data, m.base});
  // The node shares the cached plan (an aliasing pointer into `planned`).
  auto node = std::make_shared<Attention>(s, std::shared_ptr<const Plan>(planned, &plan.plan));
  auto outputs = mx::array::make_arrays(plan.shapes, plan.dtypes, std::move(node), inputs);
  return outputs[0];
}

}  // namespace flashattn::cuda
