// Which CUDA kernel runs, and its launch: the one place that decides.
//
//   L <= 8, ratio x L <= 16 query rows per KV head, E in {64, 96, 128}:
//       decode (FlashDecoding: keys split across blocks, then merged; up to
//       1024 keys one block per group, no merge)
//   float16 / bfloat16, E in {64, 80, 96, 128, 256}, L > 8: tensor-core prefill
//   float32, E in {64, 80, 96, 128}, L > 8: 3xTF32 tensor-core prefill
//   everything else: the generic kernel (keys split and merged when the
//       query rows are few)
//
// Inputs reach the kernels row-contiguous (MLX copies strided views first).
// A mask keeps its own shape: the kernels address it through per-(batch,
// query head) base offsets and row/column strides that are 0 where it
// broadcasts, so a broadcast mask is never materialised.

#include "cuda/dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <variant>

#include "cuda/kernel_images.h"
#include "mask_layout.h"
#include "mlx/backend/gpu/device_info.h"
#include "mlx/fast.h"

namespace flashattn::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 128;
constexpr int kMergeThreads = 512;  // kMergeThreads in generic.cu
constexpr int kPrefillRows32 = 64;  // Br of the float32 prefill kernel

// Warps (16 query rows each) of the float16 / bfloat16 prefill kernel.
int prefill_warps(int E) {
  return E <= 64 ? 8 : 4;
}
constexpr int kMinPrefillL = 9;   // below: the decode path
// Warps that keep a large GPU busy; decode splits its keys until there are
// about this many.
constexpr int kTargetWarps = 4096;
constexpr int kMinKeysPerSplit = 256;

const char* dtype_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  return "bfloat16";
}

const std::string& image_of(const std::string& kernel, const mx::Stream& s) {
  const std::string* image = find_image(kernel, s.device.index);
  if (!image) {
    throw std::runtime_error("flash_attention: no CUDA kernel " + kernel + " in this build");
  }
  return *image;
}

using Scalar = std::variant<bool, int, float>;

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
  return t == mx::float32 ? kPrefillRows32 : 16 * prefill_warps(E);
}

int prefill_threads(mx::Dtype t, int E) {
  return t == mx::float32 ? kThreads : 32 * prefill_warps(E);
}

int prefill_smem_bytes(mx::Dtype t, int E) {
  if (t == mx::float32) {  // Q, K (rows padded by 4 floats), V (by 8)
    return (2 * kPrefillRows32 * (E + 4) + kPrefillRows32 * (E + 8)) * 4;
  }
  constexpr int kBc = 64;  // Q, then two buffers of K and V
  return (prefill_rows(t, E) + 4 * kBc) * (E + 8) * 2;
}

// Decode splits hold at least one chunk of 32 keys per warp. A decode block
// is latency-bound (each warp walks its chunks one after another), so the
// keys are split until about kDecodeTargetBlocks blocks fill the GPU (Nsight
// Compute on an H200, qwen05b S = 32768: splits of 512 keys gave 128 blocks,
// one per SM, 54 us).
constexpr int kDecodeMaxRows = 16, kDecodeKeysPerBlockStep = 128, kDecodeMinKeysPerSplit = 128;
// Query rows of one decode block (kMaxRows in decode.cu): groups with more
// rows (up to kDecodeMaxRows) take several blocks.
constexpr int kDecodeBlockRows = 8;
// Up to this many keys one block per group walks them all and writes the
// output: one launch, no merge. In one H200 run (qwen05b / hd128) that took
// S = 256-1024 from 27-46 to 19-36 us a call and made S >= 2048 slower; calls
// this short vary by up to +-50% between runs, so the threshold is rough.
constexpr int kDecodeOneSplitMaxKeys = 1024;
constexpr int kMaxSplits = 1024;
// Blocks that keep a large GPU busy in decode. With this constant set to 512,
// 264 and 132 in turn, timed as scripts/overhead-probe.py times calls, on an
// H200 (qwen05b S = 1024-32768, hd128 S = 32768, two runs each): the three
// were within run-to-run noise for qwen05b; 132 was 8% faster for hd128 and
// up to 40% slower for qwen05b.
constexpr int kDecodeTargetBlocks = 512;

bool has_decode_kernel(int E) {
  return E == 64 || E == 96 || E == 128;
}

bool has_prefill_kernel(mx::Dtype t, int E) {
  if (t == mx::float32) return E == 64 || E == 80 || E == 96 || E == 128;
  return E == 64 || E == 80 || E == 96 || E == 128 || E == 256;
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
  return runs_sm90(device_index) ? &it->second->sm90 : &it->second->ptx;
}

bool kernels_available() {
  return !kernel_images().empty();
}

mx::array flash_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    MaskKind mask_kind,
    const std::optional<mx::array>& mask,
    mx::Stream s) {
  const int nd = q.ndim();
  const int H_q = q.shape(-3), H_kv = k.shape(-3), L = q.shape(-2), S = k.shape(-2), E = q.shape(-1);
  int64_t batch = 1;
  for (int d = 0; d < nd - 3; ++d) batch *= q.shape(d);
  const std::string dt = dtype_name(q.dtype());
  const int kind = static_cast<int>(mask_kind);
  const float scale_log2 = scale * kLog2e;
  MaskArgs m = mask_args(q, mask_kind, mask, s);
  // FLASHATTN_CUDA_POISON=1 (tests) fills outputs with NaN before the
  // kernels run, so an element a kernel forgets to write cannot pass.
  static const bool poison = std::getenv("FLASHATTN_CUDA_POISON") != nullptr;
  const std::optional<float> init = poison ? std::optional<float>(std::nanf("")) : std::nullopt;
  std::vector<mx::array> inputs = {q, k, v, m.data, m.base};

  const int rows_per_group = (H_q / H_kv) * L;
  if (L < kMinPrefillL && rows_per_group <= kDecodeMaxRows && has_decode_kernel(E) && batch <= 65535 &&
      H_kv * ((rows_per_group + kDecodeBlockRows - 1) / kDecodeBlockRows) <= 65535) {
    const int64_t groups = batch * H_kv;
    int splits = static_cast<int>(std::clamp<int64_t>(
        (kDecodeTargetBlocks + groups - 1) / groups, 1, (S + kDecodeMinKeysPerSplit - 1) / kDecodeMinKeysPerSplit));
    splits = std::min(splits, kMaxSplits);
    if (S <= kDecodeOneSplitMaxKeys) splits = 1;
    int keys_per_split = (S + splits - 1) / splits;
    keys_per_split = (keys_per_split + kDecodeKeysPerBlockStep - 1) / kDecodeKeysPerBlockStep * kDecodeKeysPerBlockStep;
    splits = (S + keys_per_split - 1) / keys_per_split;
    std::vector<Scalar> scalars = {H_q, H_kv, L, S, kind, m.row_stride, m.col_stride, keys_per_split, scale_log2};
    const int row_blocks = (rows_per_group + kDecodeBlockRows - 1) / kDecodeBlockRows;
    const std::tuple<int, int, int> grid = {splits * kThreads, H_kv * row_blocks, static_cast<int>(batch)};
    const std::string suffix = dt + "_" + std::to_string(E);
    if (splits == 1) {
      const std::string name = "fa_decode_" + suffix;
      return mx::fast::precompiled_cuda_kernel(
          name, image_of(name, s), inputs, {q.shape()}, {q.dtype()}, scalars, grid, {kThreads, 1, 1}, 0,
          init, true, s)[0];
    }
    const int rows = static_cast<int>(batch * H_q * L);
    const std::string name = "fa_decode_split_" + suffix;
    auto parts = mx::fast::precompiled_cuda_kernel(
        name, image_of(name, s), inputs, {{splits, rows, E}, {splits, rows, 2}}, {mx::float32, mx::float32},
        scalars, grid, {kThreads, 1, 1}, 0, init, true, s);
    const std::string merge = "fa_merge_" + dt;
    return mx::fast::precompiled_cuda_kernel(
        merge, image_of(merge, s), parts, {q.shape()}, {q.dtype()}, {rows, E, splits},
        {rows * kMergeThreads, 1, 1}, {kMergeThreads, 1, 1}, 0, init, true, s)[0];
  }

  if (L >= kMinPrefillL && has_prefill_kernel(q.dtype(), E) && batch <= 65535 && H_q <= 65535) {
    const std::string name = "fa_prefill_" + dt + "_" + std::to_string(E);
    const int rows = prefill_rows(q.dtype(), E), threads = prefill_threads(q.dtype(), E);
    const int tiles = (L + rows - 1) / rows;
    std::vector<Scalar> scalars = {H_q, H_kv, L, S, kind, m.row_stride, m.col_stride, scale_log2};
    return mx::fast::precompiled_cuda_kernel(
        name, image_of(name, s), inputs, {q.shape()}, {q.dtype()}, scalars,
        {tiles * threads, H_q, static_cast<int>(batch)}, {threads, 1, 1},
        prefill_smem_bytes(q.dtype(), E), init, /* ensure_row_contiguous */ true, s)[0];
  }

  // Generic kernel: one warp per query row; split the keys when rows are few.
  const int64_t rows = batch * H_q * L;
  const int ept = (E + 31) / 32;
  int splits = 1;
  if (rows < kTargetWarps && S >= 2 * kMinKeysPerSplit) {
    splits = static_cast<int>(std::min<int64_t>((kTargetWarps + rows - 1) / rows, S / kMinKeysPerSplit));
    splits = std::min(splits, kMaxSplits);
  }
  const int keys_per_split = (S + splits - 1) / splits;
  const int64_t threads = ((rows * 32 + kThreads - 1) / kThreads) * kThreads;
  if (threads > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("flash_attention: too many query rows for one CUDA launch");
  }
  std::vector<Scalar> scalars = {static_cast<int>(batch), H_q, H_kv, L, S, E, kind,
                                 m.row_stride, m.col_stride, keys_per_split, scale_log2};
  const std::string suffix = dt + "_" + std::to_string(ept);
  if (splits == 1) {
    const std::string name = "fa_generic_" + suffix;
    return mx::fast::precompiled_cuda_kernel(
        name, image_of(name, s), inputs, {q.shape()}, {q.dtype()}, scalars,
        {static_cast<int>(threads), 1, 1}, {kThreads, 1, 1}, 0, init, true, s)[0];
  }
  const std::string name = "fa_generic_split_" + suffix;
  const int r = static_cast<int>(rows);
  auto parts = mx::fast::precompiled_cuda_kernel(
      name, image_of(name, s), inputs, {{splits, r, E}, {splits, r, 2}}, {mx::float32, mx::float32},
      scalars, {static_cast<int>(threads), splits, 1}, {kThreads, 1, 1}, 0, init, true, s);
  const std::string merge = "fa_merge_" + dt;
  return mx::fast::precompiled_cuda_kernel(
      merge, image_of(merge, s), parts, {q.shape()}, {q.dtype()}, {r, E, splits},
      {r * kMergeThreads, 1, 1}, {kMergeThreads, 1, 1}, 0, init, true, s)[0];
}

}  // namespace flashattn::cuda
