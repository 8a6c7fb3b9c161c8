// Quantized keys and values on MLX's CUDA backend. These kernels read the
// packed rows in place (K and V quantized alike with 4 or 8 bits, scales
// and biases in the queries' dtype):
//  - a decode that a tensor-core decode takes (no mask or causal with one
//    query position, E = 64 or 128, with or without sinks): attention in
//    the queries' 16-bit dtype, at most 16 query rows a KV head,
//    fa_decode_mmaq<bits>_ (decode_rows.cuh expands each fragment in registers);
//    float32 attention, at most 8, fa_decode_tf32q_ (decode_tf32.cu,
//    likewise);
//  - a prefill (L > 8) with float32 attention (dtype=float32 over 16-bit
//    queries, the patch's default, or float32 inputs): fa_prefill_wgq_ on
//    Hopper at E = 64, else fa_prefill_tf32q_ (kv_rows.cuh expands each key
//    and value tile as it is stored to shared memory).
// Every other call is dequantized (mx.dequantize, into the queries' dtype
// or float32) and handed to the ordinary kernels: a transient
// full-precision copy of the keys and values a layer reads, O(S), never an
// L x S matrix. (A kernel that dequantized each element as it read it, one
// warp a query row, took 0.69 ms for a 4-bit qwen05b decode over 32K keys
// and 2.1 s for an hd128 8K prefill on an H100, where the tensor-core
// kernels on the unquantized cache take 0.037 ms and 1.0 ms. The mma.sync
// 16-bit prefill reading the codes in place took 1.3-4.3x the copy's time:
// docs/cuda.md, quantized caches.)

#include "cuda/dispatch.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "cuda/call_plan.h"
#include "cuda/mask_args.h"
#include "cuda/planner.h"
#include "cuda/primitive.h"

namespace flashattn::cuda {

namespace {

// The quantized kernels' node, when one takes the call.
std::optional<mx::array> quantized_in_place(const AttentionCall& call, bool widen) {
  const KVQuantization& qz = call.quantization;
  const QuantizedArray *kq = call.k_quantized, *vq = call.v_quantized;
  const mx::array& q = call.q;
  if (!kq || !vq || qz.k_bits != qz.v_bits || qz.k_group_size != qz.v_group_size ||
      kq->scales.dtype() != q.dtype() || vq->scales.dtype() != q.dtype() || kq->biases.dtype() != q.dtype() ||
      vq->biases.dtype() != q.dtype()) {
    return std::nullopt;
  }
  // Strides reach the kernels as 32-bit launch arguments: larger caches take
  // the other route, whose kernels refuse them by name.
  const int64_t head_elements = static_cast<int64_t>(std::max(q.shape(-2), call.k.shape(-2))) * q.shape(-1);
  if (head_elements * std::max(q.shape(-3), call.k.shape(-3)) > std::numeric_limits<int>::max()) {
    return std::nullopt;
  }
  const MaskArgs m = mask_args(q, call.mask_kind, call.mask, call.sinks, call.window, call.stream);
  Dims d = call_dims(call, m, widen);
  d.quant_bits = qz.k_bits, d.quant_group = qz.k_group_size;
  const std::shared_ptr<const std::optional<Planned>> planned =
      recent_plan(d, q.dtype(), q.shape(), call.stream.device.index);
  if (!planned->has_value()) return std::nullopt;
  const Planned& plan = **planned;
  std::vector<mx::array> inputs = {q, kq->packed, vq->packed, kq->scales, kq->biases, vq->scales, vq->biases};
  const Step& attend = plan.plan.aligned.attend;
  if (m.inputs && (attend.mask_inputs || attend.sinks_input)) inputs.insert(inputs.end(), {m.data, m.base});
  auto node = std::make_shared<Attention>(call.stream, std::shared_ptr<const Plan>(planned, &plan.plan));
  return mx::array::make_arrays(plan.shapes, plan.dtypes, std::move(node), inputs)[0];
}

}  // namespace

mx::array quantized_attention(const AttentionCall& call, bool widen) {
  if (auto out = quantized_in_place(call, widen)) return *out;
  const KVQuantization& qz = call.quantization;
  // float32 attention dequantizes into float32 (exactly the format's values)
  // and runs the float32 kernels; otherwise the queries' dtype throughout.
  const mx::Dtype dtype = widen ? mx::float32 : call.q.dtype();
  // The scales and biases in that dtype too: MLX's CUDA dequantize computes
  // in theirs and casts after, which rounded a float32 dequantization of
  // bfloat16 scales to bfloat16 (1.8e-3 off the format's values).
  auto plain = [&](const QuantizedArray* x, int bits, int group_size, const mx::array& array) {
    if (!x) return mx::astype(array, dtype, call.stream);
    return mx::dequantize(x->packed, mx::astype(x->scales, dtype, call.stream),
                          mx::astype(x->biases, dtype, call.stream), group_size, bits, "affine", std::nullopt, dtype,
                          call.stream);
  };
  const mx::array q = mx::astype(call.q, dtype, call.stream);
  const mx::array k = plain(call.k_quantized, qz.k_bits, qz.k_group_size, call.k);
  const mx::array v = plain(call.v_quantized, qz.v_bits, qz.v_group_size, call.v);
  return flash_attention(
      {q, k, v, call.scale, call.mask_kind, call.mask, call.stream, call.window, nullptr, nullptr, {}, call.sinks});
}

}  // namespace flashattn::cuda
