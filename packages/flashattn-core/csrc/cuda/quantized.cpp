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
// Except: a prefill of bfloat16 queries with float32 attention at E = 64 or
// 128 (the patch's default on a bfloat16 model) reads the cache as two
// bfloat16 terms a row (split_terms below), at 2E.
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
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/call_plan.h"
#include "cuda/kernel_images.h"
#include "cuda/mask_args.h"
#include "cuda/planner.h"
#include "cuda/primitive.h"
#include "mlx/fast.h"

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

// Rows of queries from which a prefill takes split_terms: fewer read the
// codes in place (the split writes 4 bytes an element of the whole cache).
constexpr int kSplitMinRows = 64;
// The largest two-term copy of a call's keys and values (bytes): a longer
// cache is read in place, so that the copy stays a small part of what a
// quantized cache saves.
constexpr int64_t kSplitMaxBytes = int64_t(256) << 20;

// float32 attention over a bfloat16 model's quantized cache, prefill: each
// key and value row as two bfloat16 terms side by side, [hi | lo]
// (kernels/quant_split.cu, hi + lo within 2^-17 of the format's value). The
// float32 attention over 16-bit inputs (Q K^T exact on the 16-bit tensor
// cores, P in two terms) at head dim 2E then takes each query row twice,
// so each score is q . (hi + lo), and adds P hi and P lo into an output E
// wide: on Hopper the two-term wgmma units (fa_prefill_wg32t_) read the
// queries twice themselves; elsewhere the queries go in as [q | q] and the
// kernels add the output's halves as they store it (kFold). The 3xTF32
// kernels that expand the codes in place take each product three times, on
// TF32 tensor cores of half the rate.
std::optional<mx::array> split_terms(const AttentionCall& call, bool widen, bool out16) {
  const mx::array& q = call.q;
  const KVQuantization& qz = call.quantization;
  const QuantizedArray *kq = call.k_quantized, *vq = call.v_quantized;
  const int E = q.shape(-1), bits = qz.k_bits, group = qz.k_group_size;
  const mx::Stream s = call.stream;
  auto bf16 = [](const mx::array& x) { return x.dtype() == mx::bfloat16; };
  if (!widen || !bf16(q) || !kq || !vq || q.shape(-2) < kSplitMinRows || (E != 64 && E != 128) ||
      qz.v_bits != bits || qz.v_group_size != group || (bits != 4 && bits != 8) || (group & (group - 1)) != 0 ||
      !bf16(kq->scales) || !bf16(kq->biases) || !bf16(vq->scales) || !bf16(vq->biases)) {
    return std::nullopt;
  }
  // FLASHATTN_CUDA_QUANT_SPLIT=0: the codes read in place instead (tests, comparisons).
  if (const char* e = std::getenv("FLASHATTN_CUDA_QUANT_SPLIT"); e && std::string(e) == "0") return std::nullopt;
  const std::string kernel = "fa_quant_split_bfloat16";
  const std::string* image = find_image(kernel, s.device.index);
  if (!image) return std::nullopt;
  const int64_t k_rows = kq->packed.size() / kq->packed.shape(-1), v_rows = vq->packed.size() / vq->packed.shape(-1);
  // Strides reach the kernels as 32-bit launch arguments, at 2E.
  const int64_t head_elements = static_cast<int64_t>(std::max(q.shape(-2), call.k.shape(-2))) * 2 * E;
  if (head_elements * std::max(q.shape(-3), call.k.shape(-3)) > std::numeric_limits<int>::max() ||
      std::max(k_rows, v_rows) * (E / 8) > std::numeric_limits<int>::max() ||
      (k_rows + v_rows) * 2 * E * 2 > kSplitMaxBytes) {
    return std::nullopt;
  }
  auto wide = [&](mx::Shape shape) {
    shape.back() = 2 * E;
    return shape;
  };
  // The plan first (the keys and values only by their shapes): the split's
  // node is never made where it is not used. Hopper's two-term units, else
  // [q | q] with the halves added as stored. The mask's arguments depend on
  // the queries' shape alone, which [q | q] keeps but for E.
  const MaskArgs m = mask_args(q, call.mask_kind, call.mask, call.sinks, call.window, s);
  auto plan_for = [&](const mx::Shape& q_shape, bool two_terms) {
    Dims d = call_dims(call, m, true);
    d.E = 2 * E, d.fold = true, d.two_terms = two_terms, d.out16 = out16;
    return recent_plan(d, q.dtype(), q_shape, s.device.index);
  };
  auto planned = plan_for(q.shape(), true);
  const bool two_terms = planned->has_value();
  if (!two_terms) {
    mx::Shape doubled = q.shape();
    doubled.back() = 2 * E;
    planned = plan_for(doubled, false);
    if (!planned->has_value()) return std::nullopt;
  }
  const mx::array queries = two_terms ? q : mx::concatenate({q, q}, -1, s);
  constexpr int kThreads = 256;
  const int64_t chunks = std::max(k_rows, v_rows) * (E / 8);
  const int blocks = static_cast<int>(std::min<int64_t>((chunks + kThreads - 1) / kThreads, 4096));
  const std::vector<mx::fast::ScalarArg> scalars = {static_cast<int>(k_rows), static_cast<int>(v_rows), E, bits,
                                                     __builtin_ctz(group)};
  const std::vector<mx::array> kv = mx::fast::precompiled_cuda_kernel(
      kernel, *image, {kq->packed, kq->scales, kq->biases, vq->packed, vq->scales, vq->biases},
      {wide(kq->packed.shape()), wide(vq->packed.shape())}, {mx::bfloat16, mx::bfloat16}, scalars,
      {blocks * kThreads, 1, 1}, {kThreads, 1, 1}, 0, std::nullopt, /* ensure_row_contiguous */ true, s);
  return attention_node(
      {queries, kv[0], kv[1], call.scale, call.mask_kind, call.mask, s, call.window, nullptr, nullptr, {}, call.sinks}, m,
      planned)[0];
}

}  // namespace

mx::array quantized_attention(const AttentionCall& call, bool widen, bool out16) {
  if (auto out = split_terms(call, widen, out16)) return *out;
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
