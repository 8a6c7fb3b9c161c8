// The causal mask's bound on a row tile's keys, in plain C++: the prefill
// kernels stop at it and the launch model (wg_launch.cpp) counts the key
// tiles before it, so the two cannot disagree.

#pragma once

#include <algorithm>

namespace fa {

// Queries are the last L of S positions (bottom-right aligned, as mlx-lm's
// KV cache): rows l0 .. l0 + rows - 1 (clipped at L) see keys [0, end).
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int causal_kv_end(int l0, int rows, int L, int S) {
#if defined(__CUDA_ARCH__)
  return max(0, min(S, min(l0 + rows, L) + (S - L)));
#else
  return std::max(0, std::min(S, std::min(l0 + rows, L) + (S - L)));
#endif
}

}  // namespace fa
