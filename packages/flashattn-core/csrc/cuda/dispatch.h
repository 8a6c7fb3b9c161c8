// flash_attention on MLX's CUDA backend: the kernels embedded as PTX,
// launched through MLX's custom-kernel API (fast::precompiled_cuda_kernel),
// which allocates outputs on MLX's stream-ordered allocator and orders the
// launch in MLX's graph.

#pragma once

#include <optional>
#include <vector>

#include "../flash_attention.h"

namespace flashattn::cuda {

// Whether this build embedded CUDA kernels (nvcc was present).
bool kernels_available();

// widen: float32 attention over float16 / bfloat16 inputs, a float32 result
// (the kernels that plan.cpp lists read the 16-bit inputs in place; other
// calls run the float32 kernels on cast inputs). out16 (with widen): the
// inputs' dtype is wanted instead; the result is in it where the planned
// kernels store it so (plan.cpp), else float32, and the caller casts.
mx::array flash_attention(const AttentionCall& call, bool widen = false, bool out16 = false);

// The same, and where lse (a gradient may be taken) and the planned kernels
// keep it, each row's log-sum-exp as a second array (q's shape but E;
// log2 domain, the sink in it, +inf for a row that sees no key); the
// decodes keep none.
std::vector<mx::array> flash_attention_outputs(const AttentionCall& call, bool widen, bool lse, bool out16 = false);

// Quantized keys and values (quantized.cpp: dequantized for the ordinary
// kernels): call.k_quantized / v_quantized hold them, call.k / v
// placeholders of their logical shape. out16 as above: the two-term prefill
// on Hopper stores it (quantized.cpp's split_terms), else float32.
mx::array quantized_attention(const AttentionCall& call, bool widen = false, bool out16 = false);

// The fused backward (backward.cpp): dQ, dK and dV of `call` from its
// output and the output's cotangent, never an L x S array; with sinks also
// their gradient. lse: the forward's (flash_attention_outputs), which the
// backward then does not take again.
std::vector<mx::array> flash_attention_backward(const AttentionCall& call, const mx::array& out,
                                                const mx::array& d_out,
                                                const std::optional<mx::array>& lse = std::nullopt);

}  // namespace flashattn::cuda
