// The causal rule, in plain C++ so that host and device share it: the
// kernels hide keys by it (Mask, common.cuh), the prefill kernels stop at
// its bound and the launch model (wg_launch.cpp) counts the key tiles before
// that bound, so none of them can disagree.

#pragma once

#include <algorithm>

#if defined(__CUDACC__)
#define FA_HOST_DEVICE __host__ __device__
#else
#define FA_HOST_DEVICE
#endif

namespace fa {

// Queries are the last L of S positions (bottom-right aligned, as mlx-lm's
// KV cache): query row r sees key c iff c <= r + causal_offset(L, S).
FA_HOST_DEVICE constexpr int causal_offset(int L, int S) { return S - L; }
FA_HOST_DEVICE constexpr bool causal_hides(int r, int c, int offset) { return c > r + offset; }

// Rows l0 .. l0 + rows - 1 (clipped at L) see keys [0, end).
FA_HOST_DEVICE constexpr int causal_kv_end(int l0, int rows, int L, int S) {
#if defined(__CUDA_ARCH__)
  return max(0, min(S, min(l0 + rows, L) + causal_offset(L, S)));
#else
  return std::max(0, std::min(S, std::min(l0 + rows, L) + causal_offset(L, S)));
#endif
}

}  // namespace fa
