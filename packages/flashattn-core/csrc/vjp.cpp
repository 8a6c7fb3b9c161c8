// Gradients of flash_attention. On the CPU the fused backward
// (FlashAttentionVJP, cpu/backward.cpp) serves them from the forward's
// log-sum-exp, never building an L x S array; on CUDA and Metal fused
// kernels attached in ops.cpp do. For the gradient of an additive mask, and
// a GPU call those kernels cannot take, attention_vjp recomputes attention
// with MLX operations in float32: exact, but it materialises the L x S
// probabilities.
//
// With P = softmax(scale Q K^T + mask) over visible keys and O = P V:
//   dV = P^T dO         dP = dO V^T         D = rowsum(dO * O)
//   dS = P * (dP - D)   dQ = scale dS K     dK = scale dS^T Q
// An additive mask receives dS; a boolean one has no gradient. A cotangent g
// of the forward's log-sum-exp output (log2 domain; the CPU's attention sinks
// use it) adds g p / ln 2 to dS, that is, D becomes D - g log2(e). A sink
// (one logit per query head, a key with no value) joins P's denominator; the
// formulas above hold with that P, and the sink's own gradient is
// -sum over rows of p_sink D.

#include <algorithm>
#include <limits>
#include <mutex>
#include <optional>

#include "cpu/causal.h"
#include "flash_attention.h"

namespace flashattn {

namespace {

std::mutex g_counts_mutex;
GradientCounts g_counts;

mx::Shape grouped(const mx::array& q, int H_kv) {
  // (B..., H_q, L, X) -> (B..., H_kv, ratio, L, X)
  mx::Shape shape(q.shape().begin(), q.shape().end() - 3);
  int H_q = q.shape(-3);
  shape.push_back(H_kv);
  shape.push_back(H_q / H_kv);
  shape.push_back(q.shape(-2));
  shape.push_back(q.shape(-1));
  return shape;
}

} // namespace

void count_gradient(const char* recomputed_reason) {
  std::lock_guard<std::mutex> lock(g_counts_mutex);
  if (recomputed_reason) {
    ++g_counts.recomputed[recomputed_reason];
  } else {
    ++g_counts.fused;
  }
}

GradientCounts gradient_counts() {
  std::lock_guard<std::mutex> lock(g_counts_mutex);
  return g_counts;
}

void reset_gradient_counts() {
  std::lock_guard<std::mutex> lock(g_counts_mutex);
  g_counts = {};
}

// Sums g over the axes where `shape` broadcasts (size 1, or missing in front).
mx::array sum_to_shape(mx::array g, const mx::Shape& shape, mx::Stream s) {
  int lead = g.ndim() - static_cast<int>(shape.size());
  std::vector<int> axes;
  for (int d = 0; d < static_cast<int>(g.ndim()); ++d) {
    if (d < lead || (shape[d - lead] == 1 && g.shape(d) != 1)) axes.push_back(d);
  }
  if (!axes.empty()) g = mx::sum(g, axes, /* keepdims */ true, s);
  return mx::reshape(g, shape, s);
}

mx::array causal_mask_array(int L, int S, int window, mx::Stream s) {
  const cpu::CausalRule causal(L, S, window);
  auto rows = mx::reshape(mx::arange(L, mx::int32, s), {L, 1}, s);
  auto cols = mx::reshape(mx::arange(S, mx::int32, s), {1, S}, s);
  auto shifted = mx::subtract(cols, rows, s); // c - l
  auto visible = mx::less_equal(shifted, mx::array(int(causal.offset)), s);
  if (window > 0) {
    visible = mx::logical_and(visible, mx::greater(shifted, mx::array(int(causal.offset) - window), s), s);
  }
  return visible;
}

std::vector<mx::array> attention_vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs,
    float scale_,
    MaskKind mask_kind_,
    mx::Stream s,
    int window,
    int sinks_arg) {
  const auto f32 = mx::float32;
  const auto& q = primals[0];
  const auto& k = primals[1];
  const int H_kv = k.shape(-3), L = q.shape(-2), S = k.shape(-2);

  // Query heads grouped by the KV head they read; keys broadcast over them.
  auto qg = mx::reshape(mx::astype(q, f32, s), grouped(q, H_kv), s);
  auto kg = mx::expand_dims(mx::astype(k, f32, s), -3, s);
  auto vg = mx::expand_dims(mx::astype(primals[2], f32, s), -3, s);
  auto scores = mx::multiply(
      mx::matmul(qg, mx::swapaxes(kg, -1, -2, s), s), mx::array(scale_, f32), s);
  auto score_shape = scores.shape();

  auto neg_inf = mx::array(-std::numeric_limits<float>::infinity(), f32);
  std::optional<mx::array> visible, mask_full;
  if (mask_kind_ == MaskKind::causal) {
    visible = causal_mask_array(L, S, window, s);
  } else if (mask_kind_ == MaskKind::boolean || mask_kind_ == MaskKind::additive) {
    // The mask may come in its own (broadcastable) shape.
    mx::Shape target(q.shape().begin(), q.shape().end() - 1);
    target.push_back(S);
    mask_full = mx::broadcast_to(primals[3], target, s);
  }
  if (mask_kind_ == MaskKind::boolean) {
    visible = mx::reshape(*mask_full, score_shape, s);
  } else if (mask_kind_ == MaskKind::additive) {
    auto add = mx::reshape(mx::astype(*mask_full, f32, s), score_shape, s);
    visible = mx::not_equal(add, neg_inf, s);
    scores = mx::add(scores, add, s);
  }
  if (visible) {
    scores = mx::where(*visible, scores, neg_inf, s);
  }
  auto m = mx::max(scores, -1, /* keepdims */ true, s);
  std::optional<mx::array> sink;
  if (sinks_arg >= 0) {
    // (H_q,) -> (H_kv, ratio, 1, 1), beside the grouped scores.
    mx::Shape shape = {H_kv, q.shape(-3) / H_kv, 1, 1};
    sink = mx::reshape(mx::astype(primals[sinks_arg], f32, s), shape, s);
    m = mx::maximum(m, *sink, s);
  }
  m = mx::where(mx::isneginf(m, s), mx::array(0.0f), m, s);
  auto p = mx::exp(mx::subtract(scores, m, s), s);
  auto l = mx::sum(p, -1, true, s);
  std::optional<mx::array> p_sink;
  if (sink) {
    auto e = mx::exp(mx::subtract(*sink, m, s), s);
    l = mx::add(l, e, s);
    p_sink = mx::divide(e, l, s);
  }
  auto zero = mx::array(0.0f);
  // Rows that see no key have P = 0 (and O = 0), as in the forward pass.
  auto P = mx::where(mx::equal(l, zero, s), zero, mx::divide(p, l, s), s);

  auto dO = mx::reshape(mx::astype(cotangents[0], f32, s), grouped(q, H_kv), s);
  auto O = mx::reshape(mx::astype(outputs[0], f32, s), grouped(q, H_kv), s);
  auto dP = mx::matmul(dO, mx::swapaxes(vg, -1, -2, s), s);
  auto D = mx::sum(mx::multiply(dO, O, s), -1, true, s);
  if (cotangents.size() > 1) {
    auto shape = grouped(q, H_kv);
    shape.back() = 1;
    auto d_lse = mx::reshape(mx::astype(cotangents[1], f32, s), shape, s);
    D = mx::subtract(D, mx::multiply(d_lse, mx::array(kLog2e, f32), s), s);
  }
  auto dS = mx::multiply(P, mx::subtract(dP, D, s), s);
  auto scale = mx::array(scale_, f32);

  std::vector<mx::array> grads;
  for (int arg : argnums) {
    const auto& primal = primals[arg];
    if (arg == 0) {
      auto dQ = mx::multiply(mx::matmul(dS, kg, s), scale, s);
      grads.push_back(mx::astype(mx::reshape(dQ, q.shape(), s), q.dtype(), s));
    } else if (arg == 1) {
      auto dK = mx::matmul(mx::swapaxes(dS, -1, -2, s), qg, s);
      dK = mx::multiply(mx::sum(dK, -3, false, s), scale, s);
      grads.push_back(mx::astype(dK, k.dtype(), s));
    } else if (arg == 2) {
      auto dV = mx::sum(mx::matmul(mx::swapaxes(P, -1, -2, s), dO, s), -3, false, s);
      grads.push_back(mx::astype(dV, primal.dtype(), s));
    } else if (arg == sinks_arg) {
      // -p_sink D summed over every row of the head (batch dims and L).
      auto g = mx::negative(mx::multiply(*p_sink, D, s), s);  // (B..., H_kv, ratio, L, 1)
      std::vector<int> axes;
      const int rank = static_cast<int>(g.ndim());
      for (int d = 0; d < rank; ++d) {
        if (d < rank - 4 || d >= rank - 2) axes.push_back(d);
      }
      g = mx::reshape(mx::sum(g, axes, false, s), primal.shape(), s);
      grads.push_back(mx::astype(g, primal.dtype(), s));
    } else if (mask_kind_ == MaskKind::additive) {
      auto dM = mx::reshape(dS, mask_full->shape(), s);
      grads.push_back(mx::astype(sum_to_shape(dM, primal.shape(), s), primal.dtype(), s));
    } else {
      grads.push_back(mx::zeros_like(primal, s)); // boolean masks
    }
  }
  return grads;
}

mx::array sinks_gradient(const mx::array& stats, const mx::array& sinks, const mx::array& q, mx::Stream s) {
  const auto f32 = mx::float32;
  const int H_q = q.shape(-3), L = q.shape(-2);
  const int rows = static_cast<int>(q.size() / q.shape(-1));
  auto st = mx::reshape(mx::slice(stats, {0}, {2 * rows}, s), {rows / (H_q * L), H_q, L, 2}, s);
  auto lse2 = mx::squeeze(mx::slice(st, {0, 0, 0, 0}, {rows / (H_q * L), H_q, L, 1}, s), -1, s);
  auto D = mx::squeeze(mx::slice(st, {0, 0, 0, 1}, {rows / (H_q * L), H_q, L, 2}, s), -1, s);
  // e^(sink - lse ln 2): 0 for a row that sees no key (its D is 0 too).
  auto sink = mx::reshape(mx::astype(sinks, f32, s), {1, H_q, 1}, s);
  auto p_sink = mx::exp(mx::subtract(sink, mx::multiply(lse2, mx::array(1.0f / kLog2e, f32), s), s), s);
  auto g = mx::negative(mx::sum(mx::multiply(p_sink, D, s), std::vector<int>{0, 2}, false, s), s);
  return mx::astype(g, sinks.dtype(), s);
}

std::vector<mx::array> FlashAttention::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  const auto s = stream();
  if (quantization_.any()) {
    throw std::invalid_argument(
        "flash_attention: no gradient through quantized keys or values; dequantize them (mx.dequantize) first");
  }
  // The fused backward gives dQ, dK and dV; an additive mask's gradient is
  // dS itself, an L x S array, which the recomputation below provides.
  const bool wants_mask_grad =
      mask_kind_ == MaskKind::additive && std::find(argnums.begin(), argnums.end(), 3) != argnums.end();
  if (!with_lse_ || wants_mask_grad) {
    count_gradient(wants_mask_grad ? "mask_gradient" : "no_saved_statistics");
    return attention_vjp(primals, cotangents, argnums, outputs, scale_, mask_kind_, s, window_);
  }
  count_gradient(nullptr);
  const auto& q = primals[0];
  std::vector<mx::array> inputs = primals;
  inputs.push_back(outputs[0]);
  inputs.push_back(mx::contiguous(mx::astype(cotangents[0], q.dtype(), s), false, s));
  inputs.push_back(outputs[1]);
  const bool lse_grad = cotangents.size() > 1;
  if (lse_grad) inputs.push_back(mx::contiguous(mx::astype(cotangents[1], mx::float32, s), false, s));
  auto grads = mx::array::make_arrays(
      {q.shape(), primals[1].shape(), primals[2].shape()},
      {q.dtype(), q.dtype(), q.dtype()},
      std::make_shared<FlashAttentionVJP>(s, scale_, mask_kind_, window_, lse_grad),
      std::move(inputs));
  std::vector<mx::array> out;
  for (int arg : argnums) {
    out.push_back(arg < 3 ? grads[arg] : mx::zeros_like(primals[arg], s)); // a boolean mask
  }
  return out;
}

} // namespace flashattn
