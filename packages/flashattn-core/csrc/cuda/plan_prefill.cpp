// The tensor-core prefills' launches: on Hopper the wgmma kernels
// (prefill_f16_wg.cu, prefill_tf32_wg.cu; the 16-bit one shaped by the
// launch model, wg_launch.h), elsewhere the mma.sync ones (prefill_f16.cu,
// prefill_tf32.cu), each where its block fits the GPU's shared memory;
// float32 attention over 16-bit inputs: the 16-bit kernels' float32
// variants; quantized keys and values: the float32 ones' quantized variants.
// The launch models that shape some of them: wg_launch.h, wide_pays below.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/driver.h"
#include "cuda/kernel_images.h"
#include "cuda/kernels/causal.h"
#include "cuda/kernels/f16_shapes.h"
#include "cuda/kernels/tf32_shapes.h"
#include "cuda/kernels/wg_shapes.h"
#include "cuda/planner.h"
#include "cuda/sm_queue.h"
#include "cuda/wg_launch.h"

namespace flashattn::cuda {

namespace {

int prefill_rows(mx::Dtype t, int E) {
  return t == mx::float32 ? fa::tf32_shapes::rows(E) : fa::f16_shapes::rows(E);
}

int prefill_threads(mx::Dtype t, int E) {
  return t == mx::float32 ? fa::tf32_shapes::threads(E) : fa::f16_shapes::threads(E);
}

int prefill_smem_bytes(mx::Dtype t, int E) {
  return t == mx::float32 ? fa::tf32_shapes::smem_bytes(E) : fa::f16_shapes::smem_bytes(E);
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
// FLASHATTN_CUDA_WIDE=1 or 0 (tests): the wide mma.sync block at E = 256
// for every call it fits, or for none (unset: wide_pays decides).
int forced_wide() {
  static const int value = forced("FLASHATTN_CUDA_WIDE");
  return value;
}

// prefill_f16.cu at E = 256: whether its wide block (8 warps, 128 rows) ends
// the launch sooner than the 4-warp one (64 rows), by a model of the launch:
// blocks heaviest first (PrefillBlock's order) onto the first free SM, one
// block an SM either way, each a fixed part plus its key tiles times a key
// tile's time. The figures (us, chained calls) fit H100 times of causal 2K /
// 4K / 8K prompts and a chunk of 2,048 rows over 8,192 keys, 8 heads, to
// within 7% (benchmarks/cuda-probes/wg32-probe.py hd256, 2026-11-27). The
// wide block wins wherever the launch has more than about a wave of its
// blocks; with fewer (a short causal prompt, few heads) the narrow block's
// twice as many blocks do.
bool wide_pays(const Dims& d, int sms) {
  namespace fs = fa::f16_shapes;
  struct Cost {
    double fixed, per_tile;
  };
  const Cost narrow = d.widen ? Cost{28, 4.8} : Cost{24, 2.9}, wide = d.widen ? Cost{36, 6.2} : Cost{28, 4.2};
  const int64_t slices = d.batch * d.H_q;
  const bool causal = d.kind == static_cast<int>(MaskKind::causal);
  const int wide_rows = fs::rows(d.E, true);
  if (sms <= 0) return false;
  if (slices * ((d.L + wide_rows - 1) / wide_rows) > 4 * int64_t(sms)) return true;  // several waves: no tail to weigh
  auto span = [&](int rows, Cost cost) {
    SmQueue queue(sms);
    for (int t = (d.L + rows - 1) / rows - 1; t >= 0; --t) {
      const int kv_end = causal ? fa::causal_kv_end(t * rows, rows, d.L, d.S) : d.S;
      const int kv_begin = d.window() > 0 ? fa::causal_kv_begin(t * rows, d.L, d.S, d.window()) : 0;
      const int tiles = (kv_end + fs::kBc - 1) / fs::kBc - kv_begin / fs::kBc;
      for (int64_t slice = 0; slice < slices; ++slice) queue.run(cost.fixed + cost.per_tile * tiles);
    }
    return queue.end();
  };
  return span(wide_rows, wide) < span(fs::rows(d.E), narrow);
}

// Quantized keys and values (alike, 4 or 8 bits) under float32 attention
// (widened, or float32 inputs): the float32 kernels' quantized variants,
// which expand each tile as they read it (kernels/kv_rows.cuh): on Hopper
// at E = 64 prefill_tf32_wg.cu's fa_prefill_wgq_, else prefill_tf32.cu's
// fa_prefill_tf32q_. (prefill_tf32_pairs.cu's loads wait for their tile:
// over quantized rows it took 18.6 ms for an hd128 8K prefill on an H100,
// fa_prefill_tf32q_ 12.9, the plain pairs kernel 9.3.) Attention in 16
// bits: none (the caller dequantizes).
std::optional<Launches> quantized_prefill_launches(const Dims& d, int device_index) {
  namespace ts = fa::tf32_shapes;
  namespace ws = fa::wg_shapes;
  if (!(d.widen || d.dt == "float32") || (d.quant_bits != 4 && d.quant_bits != 8)) return std::nullopt;
  const std::string suffix = d.dt + "_" + std::to_string(d.E);
  const int limit = shared_memory_limit(device_index);
  std::string kernel;
  int rows = 0, threads = 0, smem = 0;
  if (d.E == ws::kTf32E && find_image("fa_prefill_wgq_" + suffix, device_index)) {
    kernel = "fa_prefill_wgq_" + suffix, rows = ws::kTf32Rows, threads = ws::kTf32Threads, smem = ws::kTf32SmemBytes;
  } else {
    kernel = "fa_prefill_tf32q_" + suffix, rows = ts::rows(d.E), threads = ts::threads(d.E), smem = ts::smem_bytes(d.E);
  }
  if (smem > limit || !find_image(kernel, device_index)) return std::nullopt;
  const int tiles = (d.L + rows - 1) / rows;
  const std::vector<Scalar> scalars = {d.H_q, d.H_kv, d.L, d.S, d.kind_arg | (d.lse ? fa::kLse : 0), d.mask_rs,
                                       d.mask_cs, d.scale_log2, d.quant_bits, d.quant_group_shift()};
  Step attend{kernel, scalars, {tiles * threads, d.H_q, static_cast<int>(d.batch)}, {threads, 1, 1}, smem};
  attend.quantized = true;
  attend.lse_output = true;
  return Launches{attend, std::nullopt};
}

// quantized.cpp's two terms on Hopper (fa_prefill_wg32t_: E twice the
// queries' width; fa_prefill_wg32th_ storing a bfloat16 output): a grid of
// row tiles, no schedule and no key splits.
std::optional<Launches> two_term_launches(const Dims& d, mx::Dtype dtype, int device_index) {
  namespace ws = fa::wg_shapes;
  if (!d.widen || dtype != mx::bfloat16) return std::nullopt;
  const std::string suffix = d.dt + "_" + std::to_string(d.E);
  // The bfloat16-output unit where it is asked for and built, else the float32 one.
  std::string kernel = "fa_prefill_wg32th_" + suffix;
  const bool out16 = d.out16 && find_image(kernel, device_index);
  if (!out16) {
    kernel = "fa_prefill_wg32t_" + suffix;
    if (!find_image(kernel, device_index)) return std::nullopt;
  }
  const std::vector<int>& maps = map_template(dtype);
  const int rows = ws::f16_rows(d.E), threads = ws::f16_threads(d.E);
  const int smem = ws::f16_smem_bytes(d.E, false, true);
  if (maps.empty() || smem > shared_memory_limit(device_index)) return std::nullopt;
  const int tiles = (d.L + rows - 1) / rows;
  const std::vector<Scalar> scalars = {d.H_q,     d.H_kv,    d.L, d.S, d.kind_arg | (d.lse ? fa::kLse : 0),
                                       d.mask_rs, d.mask_cs, d.scale_log2, 0, 0, 0};
  Step attend{kernel, scalars, {tiles * threads, d.H_q, static_cast<int>(d.batch)}, {threads, 1, 1}, smem};
  attend.lse_output = true;
  Launches out{attend, std::nullopt, 0, maps};
  out.out16 = out16;
  return out;
}

// float32 at head dim 64 on Hopper, on float16 tensor cores: q, k and v as
// two float16 terms a row, every 128-row tile scaled by a power of two
// (kernels/f32_split.cu, made before the node: dispatch.cpp), then
// fa_prefill_wgs_float32_64 (three products for Q K^T and three for P V at
// twice TF32's rate; H200, qwen05b causal 8K: 0.73 ms a call with the split
// against 1.28-1.30 for the 3xTF32 wgmma kernel, 1.5e-7 to 8e-7 off float64
// against its 4e-7 to 1.2e-6: docs/cuda.md).
// A grid of row tiles. FLASHATTN_CUDA_F32_SPLIT=0: the 3xTF32 kernels
// (tests, comparisons).
std::optional<Launches> split_query_launches(const Dims& d, mx::Dtype dtype, int device_index) {
  namespace ws = fa::wg_shapes;
  if (dtype != mx::float32 || d.widen || d.fold || d.quantized() || d.E != ws::kF32sE) return std::nullopt;
  if (const char* e = std::getenv("FLASHATTN_CUDA_F32_SPLIT"); e && std::string(e) == "0") return std::nullopt;
  const std::string kernel = "fa_prefill_wgs_float32_64";
  const std::vector<int>& maps = map_template(mx::float16);
  const int smem = ws::f32s_smem_bytes(), threads = ws::f16_threads(ws::kF32sStoredE);
  const int rows = ws::f16_rows(ws::kF32sStoredE);
  if (maps.empty() || smem > shared_memory_limit(device_index) || !find_image(kernel, device_index) ||
      !find_image("fa_f32_split_64", device_index)) {
    return std::nullopt;
  }
  // The two-term rows' strides (2E) reach the kernel as 32-bit arguments.
  if (static_cast<int64_t>(std::max(d.L, d.S)) * 2 * d.E * std::max(d.H_q, d.H_kv) >
      std::numeric_limits<int>::max()) {
    return std::nullopt;
  }
  const int tiles = (d.L + rows - 1) / rows;
  const std::vector<Scalar> scalars = {d.H_q,     d.H_kv,    d.L, d.S, d.kind_arg | (d.lse ? fa::kLse : 0),
                                       d.mask_rs, d.mask_cs, d.scale_log2};
  Step attend{kernel, scalars, {tiles * threads, d.H_q, static_cast<int>(d.batch)}, {threads, 1, 1}, smem};
  attend.lse_output = true;
  attend.split_inputs = true;
  return Launches{attend, std::nullopt, 0, maps};
}

}  // namespace

std::optional<Launches> prefill_launches(const Dims& d, mx::Dtype dtype, int device_index) {
  if (d.L < kMinPrefillL || !has_prefill_kernel(d.E) || d.batch > 65535 || d.H_q > 65535) {
    return std::nullopt;
  }
  if (d.quantized()) return quantized_prefill_launches(d, device_index);
  if (d.two_terms) return two_term_launches(d, dtype, device_index);
  if (auto split = split_query_launches(d, dtype, device_index)) return split;
  std::string kernel = "fa_prefill_" + d.dt + "_" + std::to_string(d.E);
  int rows = prefill_rows(dtype, d.E), threads = prefill_threads(dtype, d.E), smem = prefill_smem_bytes(dtype, d.E);
  if (smem > shared_memory_limit(device_index)) return std::nullopt;  // it would not launch: the generic kernel
  // float32 at E = 80, 96 and 128: prefill_tf32_pairs.cu where its block fits
  // (on Hopper at E = 128 the wgmma kernel below).
  namespace tp = fa::tf32_shapes::pairs;
  if (dtype == mx::float32 && tp::has(d.E) && tp::smem_bytes(d.E) <= shared_memory_limit(device_index)) {
    const std::string pairs_kernel = "fa_prefill_pairs_float32_" + std::to_string(d.E);
    if (find_image(pairs_kernel, device_index)) {
      kernel = pairs_kernel, rows = tp::kRows, threads = tp::kThreads, smem = tp::smem_bytes(d.E);
    }
  }
  // Hopper: the wgmma kernels (only sm_90a images exist: find_image finds none elsewhere).
  // Widened, the 16-bit one's float32 variant (fa_prefill_wg32_) or none. A
  // folded call ([q | q], quantized.cpp's route where the two-term units are
  // missing) takes the mma.sync float32 variant, the only one that folds.
  namespace ws = fa::wg_shapes;
  const std::string wg_suffix = d.dt + "_" + std::to_string(d.E);
  std::string wg_kernel = (d.widen ? "fa_prefill_wg32_" : "fa_prefill_wg_") + wg_suffix;
  // A 16-bit output asked for: the unit that stores it, where built.
  const std::string out16_kernel = "fa_prefill_wg32h_" + wg_suffix;
  const bool out16 = d.out16 && find_image(out16_kernel, device_index);
  if (out16) wg_kernel = out16_kernel;
  // The 16-bit ones copy with tensor maps: without them, the mma.sync kernel.
  const bool needs_maps = dtype != mx::float32;
  const std::vector<int> maps = needs_maps ? map_template(dtype) : std::vector<int>{};
  const bool wg = !d.fold && (!needs_maps || !maps.empty()) &&
                  (needs_maps || ws::tf32_smem_bytes(d.E) <= shared_memory_limit(device_index)) &&
                  find_image(wg_kernel, device_index);
  WgLaunch wg_launch;
  std::optional<std::tuple<int, int, int>> grid;
  int schedule_slices = 0;
  int64_t split_bytes = 0;
  if (wg) {
    kernel = wg_kernel;
    if (dtype == mx::float32) {
      rows = ws::kTf32Rows, threads = ws::kTf32Threads, smem = ws::tf32_smem_bytes(d.E);
    } else {
      const std::string wg2_kernel = "fa_prefill_wg2_" + d.dt + "_64";
      const int sms = multiprocessors(device_index);
      const int64_t slices = d.batch * d.H_q;
      const int wide_rows = ws::f16_rows(d.E);
      const int64_t wide_units = slices * ((d.L + wide_rows - 1) / wide_rows);
      // Scheduled (prefill_f16_wg.cu, E = 128): one block per SM takes a
      // share of all row tiles, when there are enough of them; otherwise a
      // row tile a block, shaped by the launch model.
      const bool scheduled = ws::f16_items(d.E) == 2 && sms > 0 && wide_units >= ws::kF16ScheduleMinTiles &&
                             slices <= std::numeric_limits<int>::max();
      if (!scheduled) {
        const WgProblem problem{slices, d.L, d.S, d.E, d.kind == static_cast<int>(MaskKind::causal), d.widen,
                                d.window()};
        wg_launch = plan_wg_launch(problem, sms, find_image(wg2_kernel, device_index) != nullptr, forced_narrow(),
                                   forced_splits());
      }
      if (wg_launch.narrow) kernel = wg2_kernel;
      rows = ws::f16_rows(d.E, wg_launch.narrow), threads = ws::f16_threads(d.E, wg_launch.narrow),
      smem = ws::f16_smem_bytes(d.E, wg_launch.narrow);
      const int64_t units = slices * ((d.L + rows - 1) / rows);
      if (scheduled) {
        schedule_slices = static_cast<int>(slices);
        grid = {static_cast<int>(std::min<int64_t>(units, sms)) * threads, 1, 1};
      } else if (wg_launch.splits > 1) {
        schedule_slices = static_cast<int>(slices);
        grid = {static_cast<int>(wg_launch.blocks) * threads, 1, 1};
        split_bytes = ws::split_scratch_bytes(units - wg_launch.split_from, wg_launch.splits, d.E,
                                              ws::f16_groups(d.E, wg_launch.narrow));
      }
    }
  } else if (dtype != mx::float32) {
    // The mma.sync prefill. Widened, its float32 variant (E = 256 on Hopper,
    // every head dim elsewhere; without its image, the caller casts). At E =
    // 256 its wide block where it fits and the model says it pays.
    namespace fs = fa::f16_shapes;
    const std::string family = d.widen ? "fa_prefill32_" : "fa_prefill_";
    kernel = family + d.dt + "_" + std::to_string(d.E);
    if (d.widen && !find_image(kernel, device_index)) return std::nullopt;
    const std::string wide_kernel = family + "wide_" + d.dt + "_" + std::to_string(d.E);
    if (fs::has_wide(d.E) && fs::smem_bytes(d.E, true) <= shared_memory_limit(device_index) &&
        find_image(wide_kernel, device_index) &&
        (forced_wide() >= 0 ? forced_wide() == 1 : wide_pays(d, multiprocessors(device_index)))) {
      kernel = wide_kernel, rows = fs::rows(d.E, true), threads = fs::threads(d.E, true),
      smem = fs::smem_bytes(d.E, true);
    }
  }
  const int tiles = (d.L + rows - 1) / rows;
  // Every one of them takes an output for the rows' log-sum-exp, which it
  // writes for a gradient (kLse).
  const int kind_arg = d.kind_arg | (d.lse ? fa::kLse : 0) | (d.fold ? fa::kFold : 0);
  std::vector<Scalar> scalars = {d.H_q, d.H_kv, d.L, d.S, kind_arg, d.mask_rs, d.mask_cs, d.scale_log2};
  if (!grid) grid = {tiles * threads, d.H_q, static_cast<int>(d.batch)};
  if (wg && dtype != mx::float32) {
    // The 16-bit kernels' slices (the scheduled or split launch's; 0 for a
    // grid of row tiles x heads x batch) and key splits (wg_launch.h).
    const bool split = wg_launch.splits > 1;
    scalars.insert(scalars.end(), {schedule_slices, split ? static_cast<int>(wg_launch.split_from) : 0,
                                   split ? wg_launch.splits : 0});
  }
  Step attend{kernel, scalars, *grid, {threads, 1, 1}, smem};
  attend.lse_output = true;
  Launches out{attend, std::nullopt, 0, wg ? maps : std::vector<int>{}};
  out.split_bytes = split_bytes;
  out.out16 = wg && out16;
  return out;
}

}  // namespace flashattn::cuda
