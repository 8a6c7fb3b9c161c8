// One attention problem as the CPU kernel sees it: raw pointers and element
// strides, so that strided views (transposes, slices of mlx-lm's KV cache,
// broadcast masks) are read in place without a copy.

#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../flash_attention.h"
#include "causal.h"
#include "softmax.h"
#include "mlx/backend/cpu/encoder.h"

namespace flashattn::cpu {

// A (B..., H, rows, cols) array read through its strides. base[n] is the
// element offset of slice n of the flattened (B..., H) leading dimensions.
struct StridedOperand {
  const void* data = nullptr;
  std::vector<int64_t> base;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

// Keys or values in MLX's affine quantized form (bits 0: a plain array):
// their operand holds the packed uint32 words, strides in words; element e
// of a row is scales[e / group_size] * q_e + biases[e / group_size].
struct Quantized {
  int bits = 0;
  int group_size = 0;
  mx::Dtype dtype = mx::float32; // of scales and biases
  StridedOperand scales, biases;
};

struct AttentionProblem {
  mx::Dtype dtype = mx::float32; // of queries, keys and values
  int64_t batch = 0; // product of the leading batch dimensions B...
  int H_q = 0, H_kv = 0, L = 0, S = 0, E = 0;
  int q_kv_heads_ratio = 1; // query head h reads key/value head h / ratio
  float scale = 1.0f;
  MaskKind mask_kind = MaskKind::none;
  int window = 0; // causal masks: a sliding window of this many keys (0: none)
  mx::Dtype mask_dtype = mx::bool_;

  StridedOperand q, k, v, mask; // mask only for boolean / additive masks
  Quantized k_quantized, v_quantized;
  void* out = nullptr; // row contiguous (B..., H_q, L, E)
  // The output's: dtype, or float32 for float32 attention over 16-bit
  // inputs (the 16-bit kernels compute in float32: only the store differs).
  mx::Dtype out_dtype = mx::float32;
  // Row contiguous (B..., H_q, L), float32: each row's log-sum-exp (log2
  // domain, softmax.h), written only when a gradient will be taken.
  float* lse = nullptr;

  CausalRule causal() const {
    return {L, S, window};
  }
  bool quantized() const {
    return k_quantized.bits != 0 || v_quantized.bits != 0;
  }
};

// A row's output at element offset `off` of the output (store_row), in the
// problem's output dtype; T is the inputs' dtype.
template <typename T>
inline void store_output_row(const AttentionProblem& p, int64_t off, const float* o, int64_t stride, float m, float l,
                             float* lse) {
  if (!std::is_same_v<T, float> && p.out_dtype == mx::float32) {
    store_row(static_cast<float*>(p.out) + off, o, stride, p.E, m, l, lse);
  } else {
    store_row(static_cast<T*>(p.out) + off, o, stride, p.E, m, l, lse);
  }
}

// Describe inputs {queries, keys, values[, mask]} (keys and values each as
// packed, scales, biases where `quantization` says so) and the allocated
// output (and log-sum-exp, when given).
AttentionProblem describe_problem(
    const std::vector<mx::array>& inputs,
    mx::array& out,
    float scale,
    MaskKind mask_kind,
    int window = 0,
    mx::array* lse = nullptr,
    const KVQuantization& quantization = {});

// Allocates the outputs and registers inputs and outputs with the stream's
// CPU command encoder, as every CPU primitive does before it dispatches.
mx::cpu::CommandEncoder& start_encoding(
    mx::Stream stream,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

} // namespace flashattn::cpu
