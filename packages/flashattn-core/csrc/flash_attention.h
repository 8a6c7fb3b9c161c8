// FlashAttention-2 forward as an MLX operation and primitive.
//
// The operation validates its inputs, settles the output shape and dtype and
// builds the lazy array; the primitive holds the arithmetic, one source file
// per backend (cpu/, ...).

#pragma once

#include <optional>
#include <stdexcept>
#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace flashattn {

namespace mx = mlx::core;

enum class MaskKind { none, causal, boolean, additive };

// Why a call was refused, decided where it is checked: callers that fall back
// (mlxlm-flash-patch) count by it instead of reading the message.
enum class Reason { input, head_dim, dtype, mask, no_gpu_kernel };

// "unsupported_input", "unsupported_head_dim", ..., "no_gpu_kernel".
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

/**
 * softmax(scale * Q K^T + mask) V, computed tile by tile with an online
 * softmax, never materialising the L x S score matrix.
 *
 *   queries: (B..., H_q, L, E)   keys, values: (B..., H_kv, S, E)
 *   returns: (B..., H_q, L, E) in the queries' dtype
 *
 * mask_mode is "" (no mask), "causal" (bottom-right aligned: row i sees key j
 * iff j <= i + S - L) or "array" (mask_arr, boolean or additive, broadcastable
 * to (B..., H_q, L, S)). dtype: unset or the queries' dtype, or float32 with
 * float16 / bfloat16 inputs: attention in float32 and a float32 result, as if
 * the inputs had been cast to float32 first (on CUDA the 16-bit decode does
 * it without the casts' copies). Bad input throws Unsupported.
 */
mx::array flash_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    std::optional<float> scale,
    const std::string& mask_mode,
    std::optional<mx::array> mask_arr,
    mx::StreamOrDevice s = {},
    std::optional<mx::Dtype> dtype = std::nullopt);

// Gradients of softmax(scale Q K^T + mask) V with respect to the primals
// {queries, keys, values[, mask]} named in argnums, by recomputation through
// MLX operations (vjp.cpp). A mask primal may be in its own broadcastable
// shape; its gradient comes back in that shape.
std::vector<mx::array> attention_vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs,
    float scale,
    MaskKind mask_kind,
    mx::Stream stream);

///////////////////////////////////////////////////////////////////////////////
// Primitive
///////////////////////////////////////////////////////////////////////////////

/**
 * Inputs: queries, keys, values and, for boolean / additive masks, the mask
 * broadcast (without a copy) to (B..., H_q, L, S). The output is row
 * contiguous.
 */
class FlashAttention : public mx::UnaryPrimitive {
 public:
  FlashAttention(mx::Stream stream, float scale, MaskKind mask_kind)
      : mx::UnaryPrimitive(stream), scale_(scale), mask_kind_(mask_kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out)
      override;

  // Gradients by recomputation through MLX operations (vjp.cpp).
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "FlashAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  float scale() const {
    return scale_;
  }
  MaskKind mask_kind() const {
    return mask_kind_;
  }

 private:
  float scale_;
  MaskKind mask_kind_;
};

} // namespace flashattn
