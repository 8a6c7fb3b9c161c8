// The CUDA launches of one flash_attention call, decided when the graph is
// built (from shapes, dtypes and the mask) and run when the inputs exist
// (primitive.cpp), which is when their strides are known.

#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "../flash_attention.h"

namespace flashattn::cuda {

using Scalar = std::variant<bool, int, float>;

// One kernel launch through MLX's custom-kernel API. An attention kernel
// takes {q, k, v, mask data, mask base offsets} (mask_inputs) or {q, k, v}
// (the tensor-core decodes, which no array mask reaches: two inputs fewer
// for MLX to handle on every call) and, after `scalars`, the inputs'
// layout (9 strides); the merge takes the attention kernel's partials.
struct Step {
  std::string kernel;
  std::vector<Scalar> scalars;
  std::tuple<int, int, int> grid;  // threads, as MLX counts them
  std::tuple<int, int, int> block;
  int smem = 0;
  bool mask_inputs = true;
  // the tensor-core decodes' *_sinks_* kernels: the sinks as a fourth input
  // (the quantized ones': after V's biases)
  bool sinks_input = false;
  // The quantized decode (fa_decode_mmaq<bits>_*): it takes {q, K's codes, V's,
  // K's scales, biases, V's scales, biases}, and after the layout the
  // scales' rows (6 strides).
  bool quantized = false;
  // The tensor-core prefills and fa_merge_lse_: the rows' log-sum-exp as an
  // output after the attention output (the primitive's second), written
  // where the mask_kind argument has kLse (kernels/mask_bits.h).
  bool lse_output = false;
  // The split-query float32 prefill (fa_prefill_wgs_float32_64): after the
  // mask's two inputs it takes q, k and v as two float16 terms a row and
  // their tiles' shifts (kernels/f32_split.cu, which dispatch.cpp runs
  // first: the node's last four inputs).
  bool split_inputs = false;
};

// An attention kernel, and the merge when it split the keys (its partials
// (o, and m / l per row) are the primitive's last two outputs).
// fused: when not 0, the attention kernel splits the keys and merges them
// itself: its one output is the primitive's second to last (its attention
// output, then the partials as scratch, followed by `fused` floats of
// tickets, one 8-byte word per group: kernels/partials.h), the primitive's
// output a view of its start; it takes the call's tag as two last arguments
// (decode_combine.cuh).
// map_template: when not empty, the attention kernel copies with the Tensor
// Memory Accelerator (prefill_f16_wg.cu): it takes scratch for its tensor
// maps as a second output (the primitive's) and, as last arguments, the
// call's tag and these 32 words (the maps' template); strides must not be
// negative.
// split_bytes: the wgmma prefill's key-split scratch past the tensor maps'
// (wg_shapes.h's split_scratch_bytes), in the same output.
struct Launches {
  Step attend;
  std::optional<Step> merge;
  int64_t fused = 0;
  std::vector<int> map_template;
  int64_t split_bytes = 0;
  // The attention output is in the inputs' 16-bit dtype though the call is
  // widened (Dims' out16, taken by fa_prefill_wg32h_ and fa_prefill_wg32th_).
  bool out16 = false;
  // Its one launch is a prefill (fa_prefill*, storing through store_rows):
  // the output may lie in the queries' layout (primitive.cpp); otherwise
  // it is row-contiguous.
  bool out_anywhere = false;
  bool tma() const { return !map_template.empty(); }
};

struct Plan {
  // Launches for inputs whose rows start on 16-byte boundaries (the fast
  // kernels' vector loads), and the generic kernel's for any others; both
  // write partials with the same splits, or none.
  Launches aligned, any;
};

}  // namespace flashattn::cuda
