// FlashAttention-2 forward as an MLX operation and primitive.
//
// The operation validates its inputs, settles the output shape and dtype and
// builds the lazy array; the primitive holds the arithmetic, one source file
// per backend (cpu/, ...).

#pragma once

#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace flashattn {

namespace mx = mlx::core;

enum class MaskKind { none, causal, boolean, additive };

// Scores are kept in the log2 domain (exp2 is the cheap exponential): scale
// and mask terms are multiplied by log2(e), and so is the log-sum-exp.
inline constexpr float kLog2e = 1.4426950408889634f;

// Why a call was refused, decided where it is checked: callers that fall back
// (mlxlm-flash-patch) count by it instead of reading the message.
enum class Reason { input, head_dim, dtype, mask, no_gpu_kernel, quantized };

// "unsupported_input", "unsupported_head_dim", ..., "no_gpu_kernel",
// "quantized_kv_cache".
const char* reason_name(Reason reason);

// The error every check throws: a std::invalid_argument (Python ValueError)
// that carries its Reason.
class Unsupported : public std::invalid_argument {
 public:
  Unsupported(Reason reason, const std::string& message)
      : std::invalid_argument(message), reason_(reason) {}
  Reason reason() const {
    return reason_;
  }

 private:
  Reason reason_;
};

///////////////////////////////////////////////////////////////////////////////
// Operation
///////////////////////////////////////////////////////////////////////////////

// Keys or values in MLX's affine quantized form, as mx.quantize returns them
// and mlx-lm's QuantizedKVCache holds them: packed uint32 (B..., H_kv, S,
// E * bits / 32) and scales and biases (B..., H_kv, S, E / group_size); the
// element e of a row is scales[e / group_size] * q_e + biases[e / group_size].
struct QuantizedArray {
  mx::array packed;
  mx::array scales;
  mx::array biases;
};
using KeysOrValues = std::variant<mx::array, QuantizedArray>;

// How the kernels read keys and values: bits = 0 for a plain array.
struct KVQuantization {
  int k_bits = 0, k_group_size = 0;
  int v_bits = 0, v_group_size = 0;
  bool any() const {
    return k_bits != 0 || v_bits != 0;
  }
  bool operator==(const KVQuantization&) const = default;
};

/**
 * softmax(scale * Q K^T + mask) V, computed tile by tile with an online
 * softmax, never materialising the L x S score matrix.
 *
 *   queries: (B..., H_q, L, E)   keys, values: (B..., H_kv, S, E)
 *   returns: (B..., H_q, L, E) in the queries' dtype
 *
 * mask_mode is "" (no mask), "causal" (bottom-right aligned: row i sees key j
 * iff j <= i + S - L; with window > 0 also j > i + S - L - window, a sliding
 * window whose hidden tiles are skipped) or "array" (mask_arr, boolean or
 * additive, broadcastable to (B..., H_q, L, S)). dtype: unset or the queries' dtype, or float32 with
 * float16 / bfloat16 inputs: attention in float32 and a float32 result, as if
 * the inputs had been cast to float32 first (on CUDA the 16-bit decode does
 * it without the casts' copies). sinks: one logit per query head (H_q,) that
 * joins every row's softmax denominator and adds no value (MLX's SDPA
 * `sinks`), differentiable on every backend. out_dtype: the result's dtype,
 * unset (dtype's) or the inputs' dtype where dtype is float32 (float32
 * attention rounded to 16 bits once, as a cast of the float32 result: on
 * Hopper GPUs the prefill kernels store it so, without the float32 copy). keys
 * and values may each be quantized (on the CPU): the kernels dequantize them
 * tile by tile; group_size and bits, when given, must agree with their
 * shapes. Bad input throws Unsupported.
 */
mx::array flash_attention(
    const mx::array& queries,
    const KeysOrValues& keys,
    const KeysOrValues& values,
    std::optional<float> scale,
    const std::string& mask_mode,
    std::optional<mx::array> mask_arr,
    mx::StreamOrDevice s = {},
    std::optional<mx::Dtype> dtype = std::nullopt,
    std::optional<mx::array> sinks = std::nullopt,
    std::optional<int> window = std::nullopt,
    std::optional<int> group_size = std::nullopt,
    std::optional<int> bits = std::nullopt,
    std::optional<mx::Dtype> out_dtype = std::nullopt);

// The causal rule (with a sliding window of `window` keys when > 0) as a
// boolean (L, S) array, True where a row sees a key.
mx::array causal_mask_array(int L, int S, int window, mx::Stream s);

// Gradients of softmax(scale Q K^T + mask) V with respect to the primals
// {queries, keys, values[, mask][, sinks]} named in argnums, by recomputation
// through MLX operations (vjp.cpp). A mask primal may be in its own
// broadcastable shape; its gradient comes back in that shape. sinks_arg:
// the index of attention sinks among the primals (-1: none).
std::vector<mx::array> attention_vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs,
    float scale,
    MaskKind mask_kind,
    mx::Stream stream,
    int window = 0,
    int sinks_arg = -1);

// The gradient of attention sinks (H_q,) from a GPU backward's row
// statistics: stats holds (lse, D) per query row of q (B..., H_q, L), rows in
// order, lse in the log2 domain and counting the sink, +inf for a row that
// sees no key; its length may be padded past them. d sink = -sum over a
// head's rows of p_sink D, p_sink = e^sink / 2^lse.
mx::array sinks_gradient(const mx::array& stats, const mx::array& sinks, const mx::array& q, mx::Stream s);

// How gradients were taken since the last reset: by the fused backward, or
// by recomputation (attention_vjp) per reason ("mask_gradient": an additive
// mask's gradient was asked for; "no_gpu_kernel": a GPU call the fused
// kernels cannot take, such as too little shared memory a block;
// "no_saved_statistics": a forward built outside any transformation).
struct GradientCounts {
  size_t fused = 0;
  std::map<std::string, size_t> recomputed;
};
void count_gradient(const char* recomputed_reason); // nullptr: fused
GradientCounts gradient_counts();
void reset_gradient_counts();

// One call as the operation hands it to a GPU backend (cuda/dispatch.h,
// metal/dispatch.h): inputs already validated, L and S non-zero, mask set
// for boolean and additive masks only. It refers to the caller's arrays, so
// it lives no longer than the call it is built for.
struct AttentionCall {
  const mx::array& q;
  const mx::array& k;
  const mx::array& v;
  float scale;
  MaskKind mask_kind;
  const std::optional<mx::array>& mask;
  mx::Stream stream;
  int window = 0; // causal masks: a sliding window of this many keys (0: none)
  // Quantized keys / values (Metal): k and v are then placeholders of their
  // logical shape, these the arrays to read.
  const QuantizedArray* k_quantized = nullptr;
  const QuantizedArray* v_quantized = nullptr;
  KVQuantization quantization = {};
  // Attention sinks (the GPUs' kernels): (H_q,), one logit per query head.
  std::optional<mx::array> sinks = std::nullopt;
};

///////////////////////////////////////////////////////////////////////////////
// Primitive
///////////////////////////////////////////////////////////////////////////////

/**
 * Inputs: queries, keys, values (each one array, or packed, scales and biases
 * when quantized) and, for boolean / additive masks, the mask broadcast
 * (without a copy) to (B..., H_q, L, S). Outputs: the attention,
 * row contiguous, and, when built with_lse (a gradient may be taken), each
 * row's log-sum-exp (B..., H_q, L) in float32 for the fused backward.
 */
class FlashAttention : public mx::Primitive {
 public:
  FlashAttention(mx::Stream stream, float scale, MaskKind mask_kind, int window, bool with_lse = false,
                 KVQuantization quantization = {})
      : mx::Primitive(stream),
        scale_(scale),
        mask_kind_(mask_kind),
        window_(window),
        with_lse_(with_lse),
        quantization_(quantization) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  // The fused backward (FlashAttentionVJP) where it serves the request,
  // else recomputation through MLX operations (vjp.cpp).
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "FlashAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  float scale() const {
    return scale_;
  }
  MaskKind mask_kind() const {
    return mask_kind_;
  }

 private:
  float scale_;
  MaskKind mask_kind_;
  int window_;
  bool with_lse_;
  KVQuantization quantization_;
};

/**
 * FlashAttention-2's backward (Algorithm 2), never an L x S buffer.
 * Inputs: queries, keys, values[, mask] as the forward took them, its output
 * O, the cotangent dO (row contiguous, O's dtype) and its log-sum-exp.
 * Outputs: dQ, dK, dV in the inputs' shapes and dtype. CPU only for now.
 */
class FlashAttentionVJP : public mx::Primitive {
 public:
  // with_lse_grad: a last input holds the cotangent of the forward's
  // log-sum-exp output (attention sinks read it), which joins dS.
  FlashAttentionVJP(mx::Stream stream, float scale, MaskKind mask_kind, int window, bool with_lse_grad = false)
      : mx::Primitive(stream), scale_(scale), mask_kind_(mask_kind), window_(window), with_lse_grad_(with_lse_grad) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "FlashAttentionVJP";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  MaskKind mask_kind_;
  int window_;
  bool with_lse_grad_;
};

} // namespace flashattn
