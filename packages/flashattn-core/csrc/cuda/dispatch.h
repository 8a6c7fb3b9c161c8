// flash_attention on MLX's CUDA backend: the kernels embedded as PTX,
// launched through MLX's custom-kernel API (fast::precompiled_cuda_kernel),
// which allocates outputs on MLX's stream-ordered allocator and orders the
// launch in MLX's graph.

#pragma once

#include <optional>

#include "../flash_attention.h"

namespace flashattn::cuda {

// Whether this build embedded CUDA kernels (nvcc was present).
bool kernels_available();

// Inputs already validated by the operation; L and S are non-zero. widen:
// float32 attention over float16 / bfloat16 inputs, a float32 result (the
// tensor-core decode reads the 16-bit inputs; every other call runs the
// float32 kernels on cast inputs).
mx::array flash_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    MaskKind mask_kind,
    const std::optional<mx::array>& mask,
    mx::Stream stream,
    bool widen = false);

}  // namespace flashattn::cuda
