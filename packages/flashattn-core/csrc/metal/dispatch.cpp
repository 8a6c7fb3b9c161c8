// Which Metal kernel runs, and its launch: the one place that decides.
//
//   L <= 8 and the GQA group's rows (H_q / H_kv x L) fit one threadgroup:
//       flash_decode (keys split across threadgroups) + flash_merge, or
//       flash_rows when one split suffices
//   E in {64, 80, 96, 128}: flash_mma (SIMD-group matrices)
//   everything else: flash_rows
//   gradients: flash_backward_rows (dQ and each row's statistics, from the
//       log-sum-exp the forward's *_lse kernels kept where they ran), then
//       flash_backward_keys (dK, dV)
//
// Every array reaches a kernel flat, row-contiguous and with at least 8
// elements: MLX passes smaller inputs in the constant address space, which
// the kernels' device pointers would not accept. Masks go in as float32
// additive terms (a boolean mask becomes 0 / -inf) in their own shape
// (mask_layout.h).

#include "metal/dispatch.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <stdexcept>

#include "mask_layout.h"
#include "metal/kernels.h"
#include "metal/kernels/params.h"

namespace flashattn::metal {

namespace {

constexpr int kMinElements = 8;

using namespace fa;  // Param, MaskKind and the tile sizes (kernels/params.h)

int elements_per_thread(int E) {  // EPT: head-dim elements per lane
  return E <= 64 ? 2 : (E <= 128 ? 4 : 8);
}
bool has_matrix_kernel(int E) {
  return E == 64 || E == 80 || E == 96 || E == 128;
}

// Decode: split the keys until about this many threadgroups are in flight
// (Apple GPUs have up to 80 cores), never below this many keys per split.
constexpr int64_t kTargetThreadgroups = 256;
constexpr int kMinKeysPerSplit = 512;

const mx::Dtype kDtypes[] = {mx::float32, mx::float16, mx::bfloat16};
const int kEpts[] = {2, 4, 8};
const int kMatrixDims[] = {64, 80, 96, 128};

mx::array flat_at_least_8(const mx::array& x, mx::Stream s) {
  mx::array flat = mx::reshape(x, {-1}, s);
  if (flat.size() >= kMinElements) return flat;
  return mx::concatenate({flat, mx::zeros({kMinElements - static_cast<int>(flat.size())}, x.dtype(), s)}, 0, s);
}

// One float32 logit per query head, -inf where the call has no sinks.
mx::array sinks_input(const AttentionCall& call, int H_q) {
  if (call.sinks) return flat_at_least_8(mx::astype(*call.sinks, mx::float32, call.stream), call.stream);
  return mx::full({std::max(H_q, kMinElements)}, -std::numeric_limits<float>::infinity(), mx::float32, call.stream);
}

int ceil_div(int64_t a, int64_t b) {
  return static_cast<int>((a + b - 1) / b);
}

int checked_int(int64_t x, const char* what) {
  if (x > std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input, std::string("flash_attention: too many ") + what + " for one Metal launch");
  }
  return static_cast<int>(x);
}

}  // namespace

std::string msl_type(mx::Dtype t) {
  if (t == mx::float32) return "float";
  if (t == mx::float16) return "float16_t";
  if (t == mx::bfloat16) return "bfloat16_t";
  if (t == mx::int32) return "int32_t";
  if (t == mx::int64) return "int64_t";
  if (t == mx::uint32) return "uint32_t";
  throw std::logic_error("flash_attention: no MSL type for this dtype");
}

std::string instance_name(const std::string& kernel, const TemplateArgs& args) {
  std::string out = kernel + "<";
  for (size_t i = 0; i < args.size(); ++i) {
    if (i) out += ", ";
    const auto& a = args[i].second;
    if (auto* t = std::get_if<mx::Dtype>(&a)) out += msl_type(*t);
    if (auto* n = std::get_if<int>(&a)) out += std::to_string(*n);
    if (auto* b = std::get_if<bool>(&a)) out += *b ? "true" : "false";
  }
  return out + ">";
}

std::vector<Instance> instances() {
  std::vector<Instance> out;
  for (mx::Dtype t : kDtypes) {
    const std::string T = msl_type(t);
    const std::vector<std::string> attention_inputs = {T, T, T, "float", "int64_t", "int32_t", "float"};
    const std::vector<std::string> quantized_inputs = {
        T, "uint32_t", "float", "float", "uint32_t", "float", "float", "float", "int64_t", "int32_t", "float"};
    for (int ept : kEpts) {
      out.push_back({"flash_rows", {{"T", t}, {"EPT", ept}}, attention_inputs, {T}});
      out.push_back({"flash_rows_lse", {{"T", t}, {"EPT", ept}}, attention_inputs, {T, "float"}});
      out.push_back({"flash_decode", {{"T", t}, {"EPT", ept}}, attention_inputs, {"float", "float"}});
      out.push_back({"flash_rows_q", {{"T", t}, {"EPT", ept}}, quantized_inputs, {T}});
      out.push_back({"flash_decode_q", {{"T", t}, {"EPT", ept}}, quantized_inputs, {"float", "float"}});
      if (t != mx::float32) out.push_back({"flash_rows_f32", {{"T", t}, {"EPT", ept}}, attention_inputs, {"float"}});
    }
    out.push_back({"flash_merge", {{"T", t}}, {"float", "float", "int32_t", "float"}, {T}});
    for (int ept : kEpts) {
      // The rows pass takes the sinks (its log-sum-exp counts them) and the
      // forward's log-sum-exp last.
      std::vector<std::string> rows_inputs(attention_inputs.begin(), attention_inputs.end() - 1);
      std::vector<std::string> keys_inputs = rows_inputs;
      rows_inputs.insert(rows_inputs.end(), {T, T, "float", "float"});  // o, d_out, sinks, lse_kept
      keys_inputs.insert(keys_inputs.end(), {T, "float"});     // d_out, stats
      out.push_back({"flash_backward_rows", {{"T", t}, {"EPT", ept}}, rows_inputs, {T, "float"}});
      out.push_back({"flash_backward_keys", {{"T", t}, {"EPT", ept}}, keys_inputs, {T, T}});
    }
    for (int E : kMatrixDims) {
      out.push_back({"flash_mma", {{"T", t}, {"E", E}}, attention_inputs, {T}});
      out.push_back({"flash_mma_lse", {{"T", t}, {"E", E}}, attention_inputs, {T, "float"}});
      out.push_back({"flash_mma_q", {{"T", t}, {"E", E}}, quantized_inputs, {T}});
      if (t != mx::float32) out.push_back({"flash_mma_f32", {{"T", t}, {"E", E}}, attention_inputs, {"float"}});
    }
  }
  return out;
}

namespace {

// What every launch of a call reads besides Q, K and V: the parameters, and
// the mask as float32 additive terms in its own layout (or a dummy).
struct Setup {
  std::vector<int32_t> p;
  mx::array mask_data;
  mx::array mask_base;
  int64_t batch;
};

Setup setup(const AttentionCall& call) {
  const mx::array &q = call.q, &k = call.k;
  const mx::Stream s = call.stream;
  const int nd = q.ndim();
  int64_t batch = 1;
  for (int d = 0; d < nd - 3; ++d) batch *= q.shape(d);
  std::vector<int32_t> p(kParamCount, 0);
  p[kHeadsQ] = q.shape(-3);
  p[kHeadsKV] = k.shape(-3);
  p[kL] = q.shape(-2);
  p[kS] = k.shape(-2);
  p[kE] = q.shape(-1);
  p[kMaskKind] = static_cast<int>(call.mask_kind);
  p[kScaleLog2] = std::bit_cast<int32_t>(call.scale * kLog2e);
  p[kScale] = std::bit_cast<int32_t>(call.scale);
  p[kWindow] = call.window;
  p[kRowsTotal] = checked_int(batch * q.shape(-3) * q.shape(-2), "query rows");

  mx::array mask_data = mx::zeros({kMinElements}, mx::float32, s);
  std::vector<int64_t> mask_base(kMinElements, 0);
  if (call.mask_kind == MaskKind::boolean || call.mask_kind == MaskKind::additive) {
    const mx::array additive = call.mask_kind == MaskKind::boolean
        ? mx::where(*call.mask, mx::array(0.0f), mx::array(-std::numeric_limits<float>::infinity()), s)
        : mx::astype(*call.mask, mx::float32, s);
    MaskLayout layout = mask_layout(q, additive, s);
    mask_data = flat_at_least_8(layout.data, s);
    mask_base = layout.base;
    mask_base.resize(std::max<size_t>(mask_base.size(), kMinElements), 0);
    p[kMaskKind] = kMaskAdditive;
    p[kMaskRowStride] = layout.row_stride;
    p[kMaskColStride] = layout.col_stride;
  }
  mx::array base(mask_base.data(), {static_cast<int>(mask_base.size())}, mx::int64);
  return {std::move(p), std::move(mask_data), std::move(base), batch};
}

struct KeyValueInputs {
  std::vector<mx::array> arrays;  // k, v; or k, k_scales, k_biases, v, v_scales, v_biases
  bool quantized = false;
};

// Quantized keys and values read in place when both are quantized alike;
// otherwise a quantized one is dequantized (mx.dequantize) for the plain
// kernels. Scales and biases go in as float32 (a group's worth of a row).
KeyValueInputs key_value_inputs(const AttentionCall& call, std::vector<int32_t>& p) {
  const mx::Stream s = call.stream;
  const KVQuantization& qz = call.quantization;
  auto flat = [&](const mx::array& x) { return flat_at_least_8(x, s); };
  auto as_f32 = [&](const mx::array& x) { return flat(mx::astype(x, mx::float32, s)); };
  if (call.k_quantized && call.v_quantized && qz.k_bits == qz.v_bits && qz.k_group_size == qz.v_group_size) {
    p[kKVBits] = qz.k_bits;
    p[kKVGroupSize] = qz.k_group_size;
    const QuantizedArray &kq = *call.k_quantized, &vq = *call.v_quantized;
    return {{flat(kq.packed), as_f32(kq.scales), as_f32(kq.biases), flat(vq.packed), as_f32(vq.scales),
             as_f32(vq.biases)},
            true};
  }
  auto plain = [&](const QuantizedArray* x, int bits, int group_size, const mx::array& array) {
    if (!x) return flat(array);
    return flat(mx::dequantize(x->packed, x->scales, x->biases, group_size, bits, "affine", std::nullopt,
                               call.q.dtype(), s));
  };
  return {{plain(call.k_quantized, qz.k_bits, qz.k_group_size, call.k),
           plain(call.v_quantized, qz.v_bits, qz.v_group_size, call.v)},
          false};
}

}  // namespace

mx::array flash_attention(const AttentionCall& call, const Launcher& launch, Choice choice, bool widen) {
  return flash_attention_outputs(call, launch, choice, false, widen)[0];
}

std::vector<mx::array> flash_attention_outputs(const AttentionCall& call, const Launcher& launch, Choice choice,
                                               bool lse, bool widen) {
  const mx::array &q = call.q, &k = call.k;
  const mx::Stream s = call.stream;
  const int H_q = q.shape(-3), H_kv = k.shape(-3), L = q.shape(-2), S = k.shape(-2), E = q.shape(-1);
  const int ratio = H_q / H_kv;
  Setup c = setup(call);
  std::vector<int32_t>& p = c.p;
  const int64_t batch = c.batch;
  const mx::array& mask_data = c.mask_data;
  const mx::array& base = c.mask_base;
  const int ept = elements_per_thread(E);
  const int rows_max = rows_per_threadgroup(ept);
  const int group_rows = checked_int(int64_t(ratio) * L, "query rows per KV head");
  Variant variant = choice.variant;
  if (variant == Variant::automatic) {
    if (L <= 8 && group_rows <= rows_max) {
      variant = Variant::decode;
    } else {
      variant = has_matrix_kernel(E) ? Variant::matrix : Variant::rows;
    }
  }
  if (variant == Variant::matrix && !has_matrix_kernel(E)) {
    throw Unsupported(Reason::head_dim,
        "flash_attention: the Metal matrix kernel takes head dims 64, 80, 96 and 128; got " + std::to_string(E));
  }

  // Keys and values: plain arrays, or (both quantized alike) their packed
  // words with float32 scales and biases for the *_q kernels.
  const KeyValueInputs kv = key_value_inputs(call, p);
  const std::string suffix = kv.quantized ? "_q" : "";
  // For a gradient the prefill kernels (and an unsplit decode) also write
  // each row's log-sum-exp (the *_lse kernels; never over quantized keys,
  // which take no gradient).
  lse = lse && !kv.quantized;
  if (widen && (lse || kv.quantized || q.dtype() == mx::float32)) {
    throw std::logic_error("flash_attention: the Metal *_f32 kernels take plain 16-bit inputs, no log-sum-exp");
  }
  // widen: the *_f32 kernels (a float32 output) and the merge's float32 instance.
  const mx::Dtype out_dtype = widen ? mx::float32 : q.dtype();
  const std::vector<mx::Shape> shapes = lse ? std::vector<mx::Shape>{q.shape(), mx::Shape(q.shape().begin(), q.shape().end() - 1)}
                                            : std::vector<mx::Shape>{q.shape()};
  const std::vector<mx::Dtype> dtypes = lse ? std::vector<mx::Dtype>{q.dtype(), mx::float32}
                                            : std::vector<mx::Dtype>{out_dtype};
  const std::string out_suffix = lse ? "_lse" : (widen ? "_f32" : "");
  const mx::array sinks = sinks_input(call, H_q);
  auto inputs = [&](const std::vector<int32_t>& params) {
    std::vector<mx::array> in = {flat_at_least_8(q, s)};
    in.insert(in.end(), kv.arrays.begin(), kv.arrays.end());
    in.insert(in.end(), {mask_data, base, mx::array(params.data(), {kParamCount}, mx::int32), sinks});
    return in;
  };

  if (variant == Variant::matrix) {
    KernelCall call{"flash_mma" + suffix + out_suffix, {{"T", q.dtype()}, {"E", E}}, inputs(p), shapes, dtypes,
                    {checked_int(int64_t(ceil_div(L, mma_rows())) * kMmaThreads, "query tiles"),
                     checked_int(batch * H_q, "heads"), 1},
                    {kMmaThreads, 1, 1}};
    return launch(call);
  }

  // flash_rows / flash_decode: a threadgroup holds up to rows_max rows of
  // one KV head's group, a SIMD group per row.
  const int tg_rows = std::min(rows_max, group_rows);
  const int chunks = ceil_div(group_rows, tg_rows);
  p[kRowsPerGroup] = tg_rows;
  int splits = 1;
  if (variant == Variant::decode) {
    if (choice.splits > 0) {  // forced (tests): any split size
      splits = std::min(choice.splits, S);
      p[kKeysPerSplit] = ceil_div(S, splits);
    } else {
      const int64_t groups = int64_t(chunks) * batch * H_kv;
      splits = static_cast<int>(std::clamp<int64_t>(
          (kTargetThreadgroups + groups - 1) / groups, 1, ceil_div(S, kMinKeysPerSplit)));
      p[kKeysPerSplit] = ceil_div(ceil_div(S, splits), 32) * 32;
    }
    splits = ceil_div(S, p[kKeysPerSplit]);
  } else {
    p[kKeysPerSplit] = S;
  }
  p[kSplits] = splits;
  const TemplateArgs rows_args = {{"T", q.dtype()}, {"EPT", ept}};
  const std::tuple<int, int, int> grid = {
      chunks * 32 * tg_rows, checked_int(batch * H_kv, "heads"), splits};
  const std::tuple<int, int, int> threadgroup = {32 * tg_rows, 1, 1};
  if (variant == Variant::rows || (splits == 1 && choice.splits == 0)) {
    return launch({"flash_rows" + suffix + out_suffix, rows_args, inputs(p), shapes, dtypes, grid, threadgroup});
  }
  const int64_t rows = p[kRowsTotal];
  const int part = checked_int(std::max<int64_t>(splits * rows * E, kMinElements), "partial outputs");
  const int ml = checked_int(std::max<int64_t>(splits * rows * 2, kMinElements), "partial outputs");
  auto parts = launch({"flash_decode" + suffix, rows_args, inputs(p), {{part}, {ml}}, {mx::float32, mx::float32},
                       grid, threadgroup});
  const mx::array params(p.data(), {kParamCount}, mx::int32);
  return {launch({"flash_merge", {{"T", out_dtype}}, {parts[0], parts[1], params, sinks}, {q.shape()}, {out_dtype},
                  {checked_int(32 * rows, "query rows"), 1, 1}, {32, 1, 1}})[0]};
}

std::vector<mx::array> flash_attention_backward(const AttentionCall& call, const mx::array& o,
                                                const mx::array& d_out, const Launcher& launch,
                                                const std::optional<mx::array>& lse) {
  const mx::array &q = call.q, &k = call.k, &v = call.v;
  const mx::Stream s = call.stream;
  const int H_q = q.shape(-3), H_kv = k.shape(-3), L = q.shape(-2), S = k.shape(-2), E = q.shape(-1);
  Setup c = setup(call);
  const int ept = elements_per_thread(E);
  const int rows_max = backward_rows_per_threadgroup(ept);
  const int group_rows = checked_int(int64_t(H_q / H_kv) * L, "query rows per KV head");
  const int tg_rows = std::min(rows_max, group_rows);
  const int heads = checked_int(c.batch * H_kv, "heads");
  const TemplateArgs args = {{"T", q.dtype()}, {"EPT", ept}};
  auto flat = [&](const mx::array& x) { return flat_at_least_8(x, s); };
  const mx::array qf = flat(q), kf = flat(k), vf = flat(v), d_out_f = flat(mx::astype(d_out, q.dtype(), s));

  // Rows: the same threadgroups as flash_rows (row_task), every key one split.
  c.p[kRowsPerGroup] = tg_rows;
  c.p[kKeysPerSplit] = S;
  c.p[kSplits] = 1;
  c.p[kLseKept] = lse ? 1 : 0;
  const int64_t rows = c.p[kRowsTotal];
  auto dq_stats = launch({"flash_backward_rows", args,
                          {qf, kf, vf, c.mask_data, c.mask_base, mx::array(c.p.data(), {kParamCount}, mx::int32),
                           flat(mx::astype(o, q.dtype(), s)), d_out_f, sinks_input(call, H_q),
                           lse ? flat(*lse) : mx::zeros({kMinElements}, mx::float32, s)},
                          {q.shape(), {checked_int(std::max<int64_t>(2 * rows, kMinElements), "query rows")}},
                          {q.dtype(), mx::float32},
                          {ceil_div(group_rows, tg_rows) * 32 * tg_rows, heads, 1},
                          {32 * tg_rows, 1, 1}});

  // Keys: a SIMD group per key, rows_max keys a threadgroup.
  const int tg_keys = std::min(rows_max, S);
  c.p[kRowsPerGroup] = tg_keys;
  c.p[kLseKept] = 0;
  auto dk_dv = launch({"flash_backward_keys", args,
                       {qf, kf, vf, c.mask_data, c.mask_base, mx::array(c.p.data(), {kParamCount}, mx::int32),
                        d_out_f, dq_stats[1]},
                       {k.shape(), v.shape()},
                       {k.dtype(), v.dtype()},
                       {ceil_div(S, tg_keys) * 32 * tg_keys, heads, 1},
                       {32 * tg_keys, 1, 1}});
  if (!call.sinks) return {dq_stats[0], dk_dv[0], dk_dv[1]};
  return {dq_stats[0], dk_dv[0], dk_dv[1], sinks_gradient(dq_stats[1], *call.sinks, q, s)};
}

}  // namespace flashattn::metal
