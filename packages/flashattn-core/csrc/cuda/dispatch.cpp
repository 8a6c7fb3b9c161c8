// flash_attention on MLX's CUDA backend: the call's plan (plan.cpp), kept
// for the thread's next calls of the same shape (recent.h), and its graph
// node (primitive.cpp), which runs the launches once the inputs exist, with
// their strides: strided views (mlx-lm's KV cache, transposed queries) are
// read in place. A mask keeps its own shape: the kernels address it through
// per-(batch, query head) base offsets and row/column strides that are 0
// where it broadcasts, so a broadcast mask is never materialised.

#include "cuda/dispatch.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/call_plan.h"
#include "cuda/kernel_images.h"
#include "cuda/kernels/wg_shapes.h"
#include "cuda/mask_args.h"
#include "cuda/planner.h"
#include "cuda/primitive.h"
#include "cuda/recent.h"
#include "mlx/fast.h"

namespace flashattn::cuda {

namespace {

// What a call's planning depends on beyond Dims' derived values: the
// queries' shape (the output's), the dtype and the device.
struct PlanKey {
  mx::Shape q_shape;
  int H_kv, S, dtype, kind, mask_rs, mask_cs, quant_bits, quant_group;
  float scale_log2;
  bool widen, lse, fold, two_terms, out16;
  int device;
  bool operator==(const PlanKey&) const = default;
};

}  // namespace

Dims call_dims(const AttentionCall& call, const MaskArgs& m, bool widen) {
  const mx::array &q = call.q, &k = call.k;
  const int nd = static_cast<int>(q.ndim());
  int64_t batch = 1;
  for (int d = 0; d < nd - 3; ++d) batch *= q.shape(d);
  return Dims{batch, q.shape(-3), k.shape(-3), q.shape(-2), k.shape(-2), q.shape(-1), dtype_name(q.dtype()),
              static_cast<int>(call.mask_kind), m.row_stride, m.col_stride, call.scale * kLog2e, widen, m.kind};
}

std::shared_ptr<const std::optional<Planned>> recent_plan(const Dims& d, mx::Dtype dtype, const mx::Shape& q_shape,
                                                          int device_index) {
  // A model repeats its calls (recent.h): each thread keeps its last few
  // plans, and that a call has none.
  const PlanKey key{q_shape, d.H_kv, d.S, static_cast<int>(dtype.val()), d.kind_arg, d.mask_rs, d.mask_cs,
                    d.quant_bits, d.quant_group, d.scale_log2, d.widen, d.lse, d.fold, d.two_terms, d.out16,
                    device_index};
  thread_local Recent<PlanKey, std::optional<Planned>, 8> recent;
  std::shared_ptr<const std::optional<Planned>> planned = recent.find(key);
  if (!planned) planned = recent.put(key, plan_call(d, dtype, q_shape, device_index));
  return planned;
}

namespace {

// q, k and v as two float16 terms a row and their tiles' shifts
// (kernels/f32_split.cu, one launch), for the split-query float32 prefill
// (plan.h's split_inputs). Row-contiguous inputs: MLX copies views first.
std::vector<mx::array> split_terms_f32(const AttentionCall& call) {
  const mx::array &q = call.q, &k = call.k, &v = call.v;
  const std::string kernel = "fa_f32_split_64";
  const std::string* image = find_image(kernel, call.stream.device.index);
  if (!image) throw std::runtime_error("flash_attention: the CUDA kernel " + kernel + " is missing");
  const int L = q.shape(-2), S = k.shape(-2), E = q.shape(-1);
  const int64_t q_slices = q.size() / (static_cast<int64_t>(L) * E), kv_slices = k.size() / (static_cast<int64_t>(S) * E);
  constexpr int kRows = fa::wg_shapes::kF32sSplitRows, kThreads = fa::wg_shapes::kF32sSplitThreads;
  const int64_t tq = (L + kRows - 1) / kRows, tk = (S + kRows - 1) / kRows;
  const int64_t blocks = q_slices * tq + 2 * kv_slices * tk;
  if (blocks * kThreads > std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input, "flash_attention: too many rows for one CUDA float32 prefill call");
  }
  auto wide = [&](mx::Shape shape) {
    shape.back() *= 2;
    return shape;
  };
  const std::vector<mx::fast::ScalarArg> scalars = {static_cast<int>(q_slices), static_cast<int>(kv_slices), L, S};
  return mx::fast::precompiled_cuda_kernel(
      kernel, *image, {q, k, v}, {wide(q.shape()), wide(k.shape()), wide(v.shape()), {static_cast<int>(blocks)}},
      {mx::float16, mx::float16, mx::float16, mx::int32}, scalars, {static_cast<int>(blocks) * kThreads, 1, 1},
      {kThreads, 1, 1}, 0, std::nullopt, /* ensure_row_contiguous */ true, call.stream);
}

}  // namespace

std::vector<mx::array> attention_node(const AttentionCall& call, const MaskArgs& m,
                                      const std::shared_ptr<const std::optional<Planned>>& planned) {
  const Planned& plan = **planned;
  std::vector<mx::array> inputs = {call.q, call.k, call.v};
  if (m.inputs) inputs.insert(inputs.end(), {m.data, m.base});
  if (plan.plan.aligned.attend.split_inputs) {
    const std::vector<mx::array> terms = split_terms_f32(call);
    inputs.insert(inputs.end(), terms.begin(), terms.end());
  }
  // The node shares the cached plan (an aliasing pointer into `planned`).
  auto node = std::make_shared<Attention>(call.stream, std::shared_ptr<const Plan>(planned, &plan.plan));
  auto outputs = mx::array::make_arrays(plan.shapes, plan.dtypes, std::move(node), inputs);
  if (plan.lse) return {outputs[0], outputs[1]};
  return {outputs[0]};
}

std::vector<mx::array> flash_attention_outputs(const AttentionCall& call, bool widen, bool lse, bool out16) {
  const mx::array &q = call.q, &k = call.k, &v = call.v;
  const mx::Stream s = call.stream;
  // Widened prefill calls that neither the tensor-core decode nor the Hopper
  // prefill takes are the float32 kernels' on cast inputs.
  auto cast = [&] {
    auto f32 = [&](const mx::array& x) { return mx::astype(x, mx::float32, s); };
    return flash_attention_outputs(
        {f32(q), f32(k), f32(v), call.scale, call.mask_kind, call.mask, s, call.window, nullptr, nullptr, {},
         call.sinks},
        false, lse);
  };
  const MaskArgs m = mask_args(q, call.mask_kind, call.mask, call.sinks, call.window, s);
  Dims d = call_dims(call, m, widen);
  d.lse = lse;
  d.out16 = widen && out16;
  // Strides reach the kernels as 32-bit launch arguments.
  const int64_t head_elements = static_cast<int64_t>(std::max(d.L, d.S)) * d.E;
  if (head_elements * std::max(d.H_q, d.H_kv) > std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input,
        "flash_attention: on CUDA one batch element of queries, keys or values must hold fewer than 2^31 "
        "elements; got (H_q, H_kv, L, S, E) = (" + std::to_string(d.H_q) + ", " + std::to_string(d.H_kv) +
        ", " + std::to_string(d.L) + ", " + std::to_string(d.S) + ", " + std::to_string(d.E) + ")");
  }

  // No plan: a widened call that is cast.
  const std::shared_ptr<const std::optional<Planned>> planned = recent_plan(d, q.dtype(), q.shape(), s.device.index);
  if (!planned->has_value()) return cast();
  return attention_node(call, m, planned);
}

mx::array flash_attention(const AttentionCall& call, bool widen, bool out16) {
  return flash_attention_outputs(call, widen, false, out16)[0];
}

}  // namespace flashattn::cuda
