// The flash_attention operation: every check happens here (quantized keys
// and values: quantized.cpp), before the lazy array exists, so bad input
// becomes a Python ValueError at the call site rather than a failure deep
// inside mx.eval.

#include <cmath>
#include <functional>
#include <string>
#include <stdexcept>
#include <type_traits>
#include <variant>

#include "cuda/dispatch.h"
#include "flash_attention.h"
#include "messages.h"
#include "metal/emulated.h"
#include "metal/launch_metal.h"
#include "mlx/backend/cuda/cuda.h"
#include "mlx/backend/metal/metal.h"
#include "mlx/device.h"
#include "mlx/transforms.h"
#include "quantized.h"

namespace flashattn {

const char* reason_name(Reason reason) {
  switch (reason) {
    case Reason::head_dim: return "unsupported_head_dim";
    case Reason::dtype: return "unsupported_dtype";
    case Reason::mask: return "unsupported_mask";
    case Reason::no_gpu_kernel: return "no_gpu_kernel";
    case Reason::quantized: return "quantized_kv_cache";
    case Reason::input: break;
  }
  return "unsupported_input";
}

namespace {

constexpr int kMaxHeadDim = 256;

void check_ranks_and_shapes(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v) {
  if (q.ndim() < 3) {
    fail(Reason::input, "queries must have shape (B..., H_q, L, E) with rank >= 3; got shape " +
        shape_str(q.shape()));
  }
  for (auto [name, a] : {std::pair{"keys", &k}, std::pair{"values", &v}}) {
    if (a->ndim() != q.ndim()) {
      fail(Reason::input, std::string(name) + " must have the rank of queries (" +
          std::to_string(q.ndim()) + ", shape (B..., H_kv, S, E)); got shape " +
          shape_str(a->shape()));
    }
  }
  int nd = q.ndim();
  for (int d = 0; d < nd - 3; ++d) {
    if (k.shape(d) != q.shape(d) || v.shape(d) != q.shape(d)) {
      fail(Reason::input, "batch dimensions must match: queries " + shape_str(q.shape()) +
          ", keys " + shape_str(k.shape()) + ", values " +
          shape_str(v.shape()));
    }
  }
  int E = q.shape(-1);
  if (E < 1 || E > kMaxHeadDim) {
    fail(Reason::head_dim, "head dimension must be between 1 and " + std::to_string(kMaxHeadDim) +
        "; queries have shape " + shape_str(q.shape()) + " (E = " +
        std::to_string(E) + ")");
  }
  if (k.shape(-1) != E || v.shape(-1) != E) {
    fail(Reason::input, "keys and values must have the queries' head dimension E = " +
        std::to_string(E) + "; got keys " + shape_str(k.shape()) +
        ", values " + shape_str(v.shape()));
  }
  if (k.shape(-3) != v.shape(-3) || k.shape(-2) != v.shape(-2)) {
    fail(Reason::input, "keys and values must have the same shape (B..., H_kv, S, E); got keys " +
        shape_str(k.shape()) + ", values " + shape_str(v.shape()));
  }
  int H_q = q.shape(-3), H_kv = k.shape(-3);
  if (H_kv == 0 ? H_q != 0 : H_q % H_kv != 0) {
    fail(Reason::input, "the number of query heads (" + std::to_string(H_q) +
        ") must be a multiple of the number of key/value heads (" +
        std::to_string(H_kv) + "); queries " + shape_str(q.shape()) +
        ", keys " + shape_str(k.shape()));
  }
}

void check_dtypes(const mx::array& q, const mx::array& k, const mx::array& v) {
  if (!is_supported_float(q.dtype())) {
    fail(Reason::dtype, "queries must be float32, float16 or bfloat16; got " +
        dtype_str(q.dtype()));
  }
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype()) {
    fail(Reason::dtype, "queries, keys and values must share one dtype; got " +
        dtype_str(q.dtype()) + ", " + dtype_str(k.dtype()) + ", " +
        dtype_str(v.dtype()));
  }
}

// The shape every mask is broadcast to: (B..., H_q, L, S).
mx::Shape mask_target_shape(const mx::array& q, const mx::array& k) {
  mx::Shape shape(q.shape().begin(), q.shape().end() - 1);
  shape.push_back(k.shape(-2));
  return shape;
}

MaskKind check_mask(
    const std::string& mask_mode,
    const std::optional<mx::array>& mask_arr,
    const mx::Shape& target) {
  if (mask_mode.empty()) {
    return MaskKind::none;
  }
  if (mask_mode == "causal") {
    return MaskKind::causal;
  }
  if (mask_mode != "array") {
    fail(Reason::mask, "mask must be None, \"causal\" or an array; got the string \"" +
        mask_mode + "\"");
  }
  if (!mask_arr) {
    fail(Reason::mask, "mask mode \"array\" needs a mask array");
  }
  const auto& m = *mask_arr;
  bool boolean = m.dtype() == mx::bool_;
  if (!boolean && !is_supported_float(m.dtype())) {
    fail(Reason::mask, "mask must be boolean (True = attend) or additive float32 / float16 / "
        "bfloat16; got dtype " +
        dtype_str(m.dtype()));
  }
  bool broadcastable = m.ndim() <= target.size();
  for (int d = 1; broadcastable && d <= int(m.ndim()); ++d) {
    int have = m.shape(-d), want = target[target.size() - d];
    broadcastable = have == want || have == 1;
  }
  if (!broadcastable) {
    fail(Reason::mask, "mask of shape " + shape_str(m.shape()) +
        " does not broadcast to (B..., H_q, L, S) = " + shape_str(target));
  }
  return boolean ? MaskKind::boolean : MaskKind::additive;
}

// The device a stream argument names, found without creating a stream: MLX
// itself throws a terse error when asked for a GPU stream it cannot make.
mx::Device requested_device(const mx::StreamOrDevice& s) {
  return std::visit(
      [](const auto& x) -> mx::Device {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, std::monostate>) {
          return mx::default_device();
        } else if constexpr (std::is_same_v<X, mx::Device>) {
          return x;
        } else if constexpr (std::is_same_v<X, mx::Device::DeviceType>) {
          return mx::Device(x);
        } else {
          return x.device; // Stream, ThreadLocalStream
        }
      },
      s);
}

enum class Backend { cpu, cuda, metal };

// Where the call runs. A GPU that this MLX build lacks, or whose kernels this
// build does not have, is refused here rather than at evaluation time.
Backend backend_for(const mx::Device& device) {
  if (device.type != mx::Device::gpu) {
    return Backend::cpu;
  }
  if (!mx::is_available(device)) {
    fail(Reason::no_gpu_kernel, "stream is on the GPU, but this MLX build has no GPU backend "
        "(on Linux install mlx[cuda13] for NVIDIA GPUs); use stream=mx.cpu");
  }
  if (mx::cu::is_available()) {
    if (!cuda::kernels_available()) {
      fail(Reason::no_gpu_kernel, "this build of flashattn-core has no CUDA kernels (nvcc was not "
          "found when it was built); rebuild it with nvcc on the PATH, or use "
          "stream=mx.cpu");
    }
    return Backend::cuda;
  }
  return Backend::metal;
}

// What every call settles before choosing a backend.
struct Checked {
  float scale;
  MaskKind mask_kind;
  mx::Shape mask_target;
  std::optional<mx::array> mask; // boolean and additive masks
};

Checked check_call(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    std::optional<float> scale,
    const std::string& mask_mode,
    const std::optional<mx::array>& mask_arr) {
  check_ranks_and_shapes(queries, keys, values);
  check_dtypes(queries, keys, values);
  auto target = mask_target_shape(queries, keys);
  MaskKind mask_kind = check_mask(mask_mode, mask_arr, target);
  float softmax_scale =
      scale.value_or(1.0f / std::sqrt(static_cast<float>(queries.shape(-1))));
  if (!std::isfinite(softmax_scale)) {
    fail(Reason::input, "scale must be a finite number; got " + std::to_string(softmax_scale));
  }
  std::optional<mx::array> mask;
  if (mask_kind == MaskKind::boolean || mask_kind == MaskKind::additive) mask = mask_arr;
  return {softmax_scale, mask_kind, target, mask};
}

bool has_mask_array(MaskKind kind) {
  return kind == MaskKind::boolean || kind == MaskKind::additive;
}

// Whether a transformation (grad, vjp, vmap, compile) is tracing any of them.
bool any_tracer(const std::vector<mx::array>& arrays) {
  for (const auto& x : arrays) {
    if (x.is_tracer()) return true;
  }
  return false;
}

// A GPU kernel launch (MLX's custom-kernel primitives have no gradient)
// with a vjp attached: the fused backward (CUDA, Metal), or attention_vjp's
// recomputation counted under `backend` where there is none. forward takes
// {q, k, v[, mask][, sinks]} and gives the output and, where its kernels
// keep it, each row's log-sum-exp (for the fused backward only); fused takes
// the inputs, the forward's outputs and the output's cotangent and gives
// dQ, dK, dV and, with sinks, theirs.
using Forward = std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;
using Fused = std::function<std::vector<mx::array>(const std::vector<mx::array>&, const std::vector<mx::array>&,
                                                   const mx::array&)>;

mx::array with_attention_vjp(
    const Forward& forward,
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const std::optional<mx::array>& mask_arr,
    const std::optional<mx::array>& sinks,
    float scale,
    MaskKind mask_kind,
    int window,
    mx::Stream stream,
    const char* backend,
    const Fused& fused = nullptr) {
  const int sinks_arg = sinks ? (has_mask_array(mask_kind) ? 4 : 3) : -1;
  auto backward = [=](const std::vector<mx::array>& primals,
                      const std::vector<mx::array>& all_cotangents,
                      const std::vector<mx::array>& all_outputs) {
    // The attention output's alone: the log-sum-exp is the backward's, no
    // output of the call.
    const std::vector<mx::array> cotangents = {all_cotangents[0]}, outputs = {all_outputs[0]};
    auto recompute = [&](const char* reason) {
      std::vector<int> argnums(primals.size());
      for (size_t i = 0; i < argnums.size(); ++i) argnums[i] = static_cast<int>(i);
      count_gradient(reason);
      return attention_vjp(primals, cotangents, argnums, outputs, scale, mask_kind, stream, window, sinks_arg);
    };
    if (!fused) return recompute(backend);
    std::vector<mx::array> grads;
    try {
      grads = fused(primals, all_outputs, cotangents[0]);
    } catch (const Unsupported& e) {  // e.g. a GPU with too little shared memory a block
      return recompute(reason_name(e.reason()));
    }
    count_gradient(nullptr);
    if (has_mask_array(mask_kind)) {
      // custom_vjp asks for every input's cotangent; an additive mask's is dS
      // itself (L x S), recomputed, and evaluated only if used (MLX is lazy).
      grads.insert(grads.begin() + 3, mask_kind == MaskKind::additive
          ? attention_vjp(primals, cotangents, {3}, outputs, scale, mask_kind, stream, window, sinks_arg)[0]
          : mx::zeros_like(primals[3], stream));
    }
    return grads;
  };
  std::vector<mx::array> in = {queries, keys, values};
  if (has_mask_array(mask_kind)) in.push_back(*mask_arr);
  if (sinks) in.push_back(*sinks);
  return mx::custom_vjp(forward, backward)(in)[0];
}

// The Metal backward through `launch` (an Apple GPU's or the emulator's).
Fused metal_backward(float scale, MaskKind mask_kind, int window, mx::Stream stream, metal::Launcher launch) {
  return [=](const std::vector<mx::array>& in, const std::vector<mx::array>& out, const mx::array& d_out) {
    const int mask_arg = has_mask_array(mask_kind) ? 1 : 0;
    std::optional<mx::array> m, sinks, lse;
    if (mask_arg) m = in[3];
    if (static_cast<int>(in.size()) > 3 + mask_arg) sinks = in.back();
    if (out.size() > 1) lse = out[1];
    return metal::flash_attention_backward(
        {in[0], in[1], in[2], scale, mask_kind, m, stream, window, nullptr, nullptr, {}, sinks}, out[0], d_out,
        launch, lse);
  };
}

// The CUDA backward (cuda/backward.cpp).
Fused cuda_backward(float scale, MaskKind mask_kind, int window, mx::Stream stream) {
  return [=](const std::vector<mx::array>& in, const std::vector<mx::array>& out, const mx::array& d_out) {
    const int mask_arg = has_mask_array(mask_kind) ? 1 : 0;
    std::optional<mx::array> m, sinks, lse;
    if (mask_arg) m = in[3];
    if (static_cast<int>(in.size()) > 3 + mask_arg) sinks = in.back();
    if (out.size() > 1) lse = out[1];
    return cuda::flash_attention_backward(
        {in[0], in[1], in[2], scale, mask_kind, m, stream, window, nullptr, nullptr, {}, sinks}, out[0], d_out, lse);
  };
}

// Attention sinks: one float logit per query head, on every backend, under
// a gradient too.
void check_sinks(const mx::array& sinks, const mx::array& queries) {
  const int H_q = queries.shape(-3);
  if (sinks.ndim() != 1 || sinks.shape(0) != H_q) {
    fail(Reason::input, "sinks must have shape (H_q,) = (" + std::to_string(H_q) + ",), one logit per query head; got " +
        shape_str(sinks.shape()));
  }
  if (!is_supported_float(sinks.dtype())) {
    fail(Reason::input, "sinks must be float32, float16 or bfloat16; got " + dtype_str(sinks.dtype()));
  }
}

// softmax over the keys and a sink: with the row's (natural) log-sum-exp
// lse, out = sum_j e^(s_j) v_j / (e^lse + e^sink) = o x sigmoid(lse - sink),
// o the attention without it. lse2 is the forward's, in the log2 domain
// (+inf for a row that sees no key: its o is 0 either way).
mx::array with_sinks(const mx::array& o, const mx::array& lse2, const mx::array& sinks, mx::Stream s) {
  const auto f32 = mx::float32;
  const int H_q = sinks.shape(0);
  auto sink = mx::reshape(mx::astype(sinks, f32, s), {H_q, 1}, s);
  auto lse = mx::divide(lse2, mx::array(kLog2e, f32), s);
  auto keep = mx::expand_dims(mx::sigmoid(mx::subtract(lse, sink, s), s), -1, s);
  return mx::astype(mx::multiply(mx::astype(o, f32, s), keep, s), o.dtype(), s);
}

// A sliding window: a positive number of keys, on a causal mask.
int check_window(std::optional<int> window, MaskKind mask_kind) {
  if (!window) return 0;
  if (*window < 1) {
    fail(Reason::mask, "window must be a positive number of keys; got " + std::to_string(*window));
  }
  if (mask_kind != MaskKind::causal) {
    fail(Reason::mask, "window needs mask=\"causal\" (a sliding window over the causal mask); got window=" +
         std::to_string(*window) + " with " + (mask_kind == MaskKind::none ? "no mask" : "a mask array"));
  }
  return *window;
}

// Whether dtype asks for float32 attention over float16 / bfloat16 inputs;
// any dtype but the inputs' own or float32 is refused.
bool widens(const mx::array& queries, std::optional<mx::Dtype> dtype) {
  if (!dtype || *dtype == queries.dtype()) return false;
  if (*dtype != mx::float32) {
    fail(Reason::dtype, "dtype must be None, the inputs' dtype (" + dtype_str(queries.dtype()) + ") or float32; got " +
         dtype_str(*dtype));
  }
  return true;
}

// The CPU primitive over the queries, the keys' and values' arrays as
// unpacked (quantized ones as packed, scales, biases) and the mask; its
// output in the queries' dtype, or float32 (widen: float32 attention over
// 16-bit inputs, which the 16-bit kernels compute in float32 anyway).
mx::array cpu_attention(
    const mx::array& queries,
    const KeysValues& kv,
    const Checked& c,
    int window,
    const std::optional<mx::array>& sinks,
    mx::Stream stream,
    bool widen = false) {
  const mx::Dtype out_dtype = widen ? mx::float32 : queries.dtype();
  std::vector<mx::array> inputs = {queries};
  inputs.insert(inputs.end(), kv.inputs.begin(), kv.inputs.end());
  if (has_mask_array(c.mask_kind)) {
    // broadcast_to shares the buffer (stride 0 on broadcast axes): no copy.
    inputs.push_back(mx::broadcast_to(*c.mask, c.mask_target, stream));
  }
  // Under a transformation a gradient may be asked for: the forward then also
  // keeps each row's log-sum-exp for the fused backward (L floats a head).
  // Sinks read it always.
  const bool with_lse = sinks || any_tracer(inputs);
  auto primitive =
      std::make_shared<FlashAttention>(stream, c.scale, c.mask_kind, window, with_lse, kv.quantization);
  if (!with_lse) {
    return mx::array(queries.shape(), out_dtype, std::move(primitive), std::move(inputs));
  }
  auto shapes = primitive->output_shapes(inputs);
  auto outputs = mx::array::make_arrays(
      std::move(shapes), {out_dtype, mx::float32}, std::move(primitive), std::move(inputs));
  return sinks ? with_sinks(outputs[0], outputs[1], *sinks, stream) : outputs[0];
}

// Quantized keys and values on a GPU: `run` launches the call (Metal's *_q
// kernels, CUDA's quantized kernel; either dequantizes a quantized key whose
// partner is not quantized alike). No gradient flows through them: asking
// for one is refused when the backward is built.
mx::array quantized_gpu_attention(
    const mx::array& queries,
    const KeysOrValues& keys,
    const KeysOrValues& values,
    const KeysValues& kv,
    const Checked& c,
    int window,
    const std::optional<mx::array>& sinks,
    const std::function<mx::array(const AttentionCall&)>& run,
    mx::Stream stream) {
  const QuantizedArray* kq = std::get_if<QuantizedArray>(&keys);
  const QuantizedArray* vq = std::get_if<QuantizedArray>(&values);
  // A plain partner in the queries' dtype (float32 attention casts it too).
  const mx::array k = kq ? kv.k : mx::astype(kv.k, queries.dtype(), stream);
  const mx::array v = vq ? kv.v : mx::astype(kv.v, queries.dtype(), stream);
  auto forward = [=](const std::vector<mx::array>& in) {
    std::optional<mx::array> m;
    if (has_mask_array(c.mask_kind)) m = c.mask;
    return std::vector<mx::array>{
        run({in[0], k, v, c.scale, c.mask_kind, m, stream, window, kq, vq, kv.quantization, sinks})};
  };
  // No transformation can ask for a gradient: the launch alone (a decode
  // step calls this once a layer, and each graph node costs host time).
  if (!queries.is_tracer()) return forward({queries})[0];
  auto refuse = [](const std::vector<mx::array>&, const std::vector<mx::array>&,
                   const std::vector<mx::array>&) -> std::vector<mx::array> {
    throw std::invalid_argument(
        "flash_attention: no gradient through quantized keys or values; dequantize them (mx.dequantize) first");
  };
  return mx::custom_vjp(forward, refuse)({queries})[0];
}

// The result's dtype: out_dtype, or by default the attention's (float32
// where widen, else the inputs'); only the inputs' dtype may replace float32.
mx::Dtype result_dtype(const mx::array& queries, bool widen, std::optional<mx::Dtype> out_dtype) {
  const mx::Dtype computed = widen ? mx::float32 : queries.dtype();
  if (!out_dtype || *out_dtype == computed) return computed;
  if (!widen || *out_dtype != queries.dtype()) {
    fail(Reason::dtype, "out_dtype must be None, the inputs' dtype (" + dtype_str(queries.dtype()) + ") or dtype (" +
         dtype_str(computed) + "); got " + dtype_str(*out_dtype));
  }
  return *out_dtype;
}

// out in dtype want: itself where it already is (no copy in the graph).
mx::array cast_to(const mx::array& out, mx::Dtype want, const mx::Stream& s) {
  return out.dtype() == want ? out : mx::astype(out, want, s);
}

// A flash_attention call's arguments, as the public function takes them.
struct Request {
  mx::array queries;
  KeysOrValues keys, values;
  std::optional<float> scale;
  std::string mask_mode;
  std::optional<mx::array> mask;
  mx::StreamOrDevice s;
  std::optional<mx::Dtype> dtype;
  std::optional<mx::array> sinks;
  std::optional<int> window, group_size, bits;
  std::optional<mx::Dtype> out_dtype;
  // The Metal kernels run by the CPU emulator (tests), on the CPU stream,
  // through the same branches as on an Apple GPU; choice forces a kernel.
  const metal::Emulation* emulation = nullptr;
  metal::Choice choice = {};
};

mx::array as_asked(const Request& r);

// flash_attention in the attention's dtype, except where out16 (float32
// attention, a 16-bit result asked for) and a kernel stores that directly
// (a Hopper prefill, the CPU's without sinks, Metal's over plain keys and
// values); as_asked casts what remains.
mx::array attention(const Request& r) {
  const mx::array& queries = r.queries;
  const std::optional<mx::array>& sinks = r.sinks;
  const KeysValues kv =
      unpack_keys_values(r.keys, r.values, queries, r.group_size, r.bits, mx::default_stream(mx::Device::cpu));
  const mx::array &keys = kv.k, &values = kv.v;
  const Checked c = check_call(queries, keys, values, r.scale, r.mask_mode, r.mask);
  const bool widen = widens(queries, r.dtype);
  const bool out16 = result_dtype(queries, widen, r.out_dtype) != (widen ? mx::float32 : queries.dtype());
  const int window = check_window(r.window, c.mask_kind);
  const Backend backend = r.emulation ? Backend::metal : backend_for(requested_device(r.s));
  if (sinks) check_sinks(*sinks, queries);
  const mx::Stream stream = mx::to_stream(r.s);
  // Metal's launches: on an Apple GPU, or in the emulator.
  auto metal_launcher = [&]() -> metal::Launcher {
    if (r.emulation) return metal::emulated_launcher(*r.emulation, stream);
    return [stream](const metal::KernelCall& k) { return metal::launch_on_metal(k, stream); };
  };

  // Empty problems are defined without running a kernel: no queries give an
  // empty output, no keys give zeros (an empty weighted sum).
  if (queries.size() == 0 || keys.shape(-2) == 0) {
    return mx::zeros(queries.shape(), widen ? mx::float32 : queries.dtype(), stream);
  }

  const float softmax_scale = c.scale;
  const MaskKind mask_kind = c.mask_kind;
  if (window > 0 && backend == Backend::cuda) {
    // Keys before row 0's window reach no row: left out (views; the rule
    // holds for any S, queries being the last L positions). A window that
    // then covers every key hides none, and a decode's never does.
    const int L = queries.shape(-2), S = keys.shape(-2);
    const int first = std::max(0, S - L - window + 1);
    if (first > 0 || window >= S) {
      auto tail = [&](const mx::array& x) {
        mx::Shape start(x.ndim(), 0), stop = x.shape();
        start[x.ndim() - 2] = first;
        return mx::slice(x, start, stop, stream);
      };
      auto keys_from = [&](const KeysOrValues& x) -> KeysOrValues {
        if (const auto* q = std::get_if<QuantizedArray>(&x)) {
          return QuantizedArray{tail(q->packed), tail(q->scales), tail(q->biases)};
        }
        return tail(std::get<mx::array>(x));
      };
      Request rest = r;
      rest.keys = keys_from(r.keys);
      rest.values = keys_from(r.values);
      rest.scale = softmax_scale;
      rest.window = window < S - first ? std::optional<int>(window) : std::nullopt;
      return as_asked(rest);
    }
  }
  if (kv.quantization.any() && backend == Backend::cuda) {
    auto run = [widen, out16](const AttentionCall& call) { return cuda::quantized_attention(call, widen, out16); };
    return quantized_gpu_attention(queries, r.keys, r.values, kv, c, window, sinks, run, stream);
  }
  if (backend == Backend::cuda &&
      !any_tracer({queries, keys, values, r.mask.value_or(queries), sinks.value_or(queries)})) {
    // No transformation can ask for a gradient: the launch alone, one node in
    // the graph (mlx-lm's generation calls this once per layer and token).
    std::optional<mx::array> m;
    if (has_mask_array(mask_kind)) m = r.mask;
    return cuda::flash_attention(
        {queries, keys, values, softmax_scale, mask_kind, m, stream, window, nullptr, nullptr, {}, sinks}, widen,
        out16);
  }
  if (kv.quantization.any() && backend == Backend::metal) {
    auto run = [launch = metal_launcher(), choice = r.choice](const AttentionCall& call) {
      return metal::flash_attention(call, launch, choice);
    };
    return quantized_gpu_attention(widen ? mx::astype(queries, mx::float32, stream) : queries, r.keys,
                                   r.values, kv, c, window, sinks, run, stream);
  }
  const bool traced = any_tracer({queries, keys, values, r.mask.value_or(queries), sinks.value_or(queries)});
  if (widen && backend == Backend::cpu && !traced) {
    // No gradient can be asked for: the 16-bit kernels read the inputs in
    // place (quantized ones too) and store a float32 output. The cast path
    // below copied every key and value to float32 first: 3-4.6x the time of
    // a decode over 8K-32K bfloat16 keys. A 16-bit result asked for: their
    // own 16-bit output is the float32 one rounded once (they compute in
    // float32), but with sinks, whose factor MLX operations apply after it.
    return cpu_attention(queries, kv, c, window, sinks, stream, !out16 || sinks.has_value());
  }
  if (widen && backend == Backend::metal && !traced) {
    // The same on Apple GPUs: the 16-bit kernels compute in float32 and the
    // *_f32 ones store a float32 output (quantized keys and values went
    // above, with float32 queries). A 16-bit result asked for: the 16-bit
    // kernels' own, the same float32 values rounded once as they store them.
    std::optional<mx::array> m;
    if (has_mask_array(mask_kind)) m = r.mask;
    return metal::flash_attention(
        {queries, keys, values, softmax_scale, mask_kind, m, stream, window, nullptr, nullptr, {}, sinks},
        metal_launcher(), r.choice, !out16);
  }
  if (kv.quantization.any()) {
    if (!widen) return cpu_attention(queries, kv, c, window, sinks, stream);
    // The kernels dequantize K and V into float32 tiles: float32 attention
    // casts the queries and a plain key or value array only.
    auto f32 = [&](const KeysOrValues& x) -> KeysOrValues {
      if (const auto* plain = std::get_if<mx::array>(&x)) return mx::astype(*plain, mx::float32, stream);
      return x;
    };
    const auto q32 = mx::astype(queries, mx::float32, stream);
    return cpu_attention(q32, unpack_keys_values(f32(r.keys), f32(r.values), q32, r.group_size, r.bits, stream), c,
                         window, sinks, stream);
  }
  if (widen && backend != Backend::cuda) {
    // Otherwise (a gradient may be taken) float32 attention over 16-bit
    // inputs off CUDA is the float32 path on cast inputs.
    auto f32 = [&](const mx::array& x) { return mx::astype(x, mx::float32, stream); };
    Request cast = r;
    cast.queries = f32(queries);
    cast.keys = f32(keys);
    cast.values = f32(values);
    cast.scale = softmax_scale;
    cast.dtype = cast.out_dtype = std::nullopt;
    cast.group_size = cast.bits = std::nullopt;
    return as_asked(cast);
  }
  if (backend != Backend::cpu) {
    const metal::Choice choice = r.choice;
    const metal::Launcher metal_launch = backend == Backend::metal ? metal_launcher() : metal::Launcher{};
    auto forward = [=](const std::vector<mx::array>& in) {
      std::optional<mx::array> m, sk;
      if (has_mask_array(mask_kind)) m = in[3];
      if (sinks) sk = in.back();
      const AttentionCall attention{in[0], in[1], in[2], softmax_scale, mask_kind, m, stream, window,
                                    nullptr, nullptr, {}, sk};
      if (backend == Backend::cuda) {
        // The fused backward reads the forward's log-sum-exp where it is
        // kept. Float32 attention over 16-bit inputs runs its forward as
        // without a transformation and takes its gradient, which is the
        // inputs' dtype, from the 16-bit backward (cuda/backward.cpp): the
        // float32 backward on cast inputs would be several times slower for
        // a gradient rounded to 16 bits all the same (docs/cuda.md).
        return cuda::flash_attention_outputs(attention, widen, true);
      }
      // The log-sum-exp for the fused backward, where a gradient may be taken.
      return metal::flash_attention_outputs(attention, metal_launch, choice, any_tracer(in));
    };
    if (backend == Backend::cuda) {
      return with_attention_vjp(forward, queries, keys, values, r.mask, sinks, softmax_scale, mask_kind, window,
                                stream, "cuda", cuda_backward(softmax_scale, mask_kind, window, stream));
    }
    return with_attention_vjp(forward, queries, keys, values, r.mask, sinks, softmax_scale, mask_kind, window,
                              stream, "metal", metal_backward(softmax_scale, mask_kind, window, stream, metal_launch));
  }

  return cpu_attention(queries, kv, c, window, sinks, stream);
}

// The call's result in the dtype asked for.
mx::array as_asked(const Request& r) {
  // attention() first: it names a stream this build cannot serve before
  // to_stream would (MLX's own error names no argument).
  mx::array out = attention(r);
  return cast_to(out, result_dtype(r.queries, widens(r.queries, r.dtype), r.out_dtype), mx::to_stream(r.s));
}

} // namespace

mx::array flash_attention(
    const mx::array& queries,
    const KeysOrValues& keys,
    const KeysOrValues& values,
    std::optional<float> scale,
    const std::string& mask_mode,
    std::optional<mx::array> mask_arr,
    mx::StreamOrDevice s,
    std::optional<mx::Dtype> dtype,
    std::optional<mx::array> sinks,
    std::optional<int> window,
    std::optional<int> group_size,
    std::optional<int> bits,
    std::optional<mx::Dtype> out_dtype) {
  return as_asked({queries, keys, values, scale, mask_mode, mask_arr, s, dtype, sinks, window, group_size, bits,
                   out_dtype});
}

mx::array flash_attention_metal_emulated(
    const mx::array& queries,
    const KeysOrValues& keys,
    const KeysOrValues& values,
    std::optional<float> scale,
    const std::string& mask_mode,
    std::optional<mx::array> mask_arr,
    const metal::Emulation& emulation,
    metal::Choice choice,
    std::optional<int> window,
    std::optional<int> group_size,
    std::optional<int> bits,
    std::optional<mx::array> sinks,
    std::optional<mx::Dtype> dtype,
    std::optional<mx::Dtype> out_dtype) {
  Request r{queries, keys, values, scale, mask_mode, mask_arr, mx::Device(mx::Device::cpu), dtype, sinks, window,
            group_size, bits, out_dtype};
  r.emulation = &emulation;
  r.choice = choice;
  return as_asked(r);
}

bool FlashAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FlashAttention&>(other);
  return scale_ == o.scale_ && mask_kind_ == o.mask_kind_ && window_ == o.window_ && with_lse_ == o.with_lse_ &&
      quantization_ == o.quantization_;
}

std::vector<mx::Shape> FlashAttention::output_shapes(const std::vector<mx::array>& inputs) {
  if (!with_lse_) return {inputs[0].shape()};
  return {inputs[0].shape(), mx::Shape(inputs[0].shape().begin(), inputs[0].shape().end() - 1)};
}

void FlashAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  // backend_for routes GPU streams elsewhere before a FlashAttention node is built.
  throw std::runtime_error("flash_attention: no GPU kernel in this build of flashattn-core");
}

bool FlashAttentionVJP::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const FlashAttentionVJP&>(other);
  return scale_ == o.scale_ && mask_kind_ == o.mask_kind_ && window_ == o.window_ &&
      with_lse_grad_ == o.with_lse_grad_;
}

void FlashAttentionVJP::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("flash_attention: the fused backward runs on the CPU only");
}

} // namespace flashattn
