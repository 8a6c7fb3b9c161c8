// The causal rule and its sliding window, in plain C++ so that host and
// device share them: the kernels hide keys by it (Mask, common.cuh), the
// prefill and backward kernels walk only the tiles inside its bounds and the
// launch model (wg_launch.cpp) counts the same tiles, so none of them can
// disagree.

#pragma once

#if defined(__CUDACC__)
#define FA_HOST_DEVICE __host__ __device__
#else
#define FA_HOST_DEVICE
#endif

namespace fa {

FA_HOST_DEVICE constexpr int clamp_int(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// Queries are the last L of S positions (bottom-right aligned, as mlx-lm's
// KV cache): query row r sees key c iff 0 <= r + causal_offset(L, S) - c <
// window, the sliding window's keys (kNoWindow: none). One unsigned compare
// tests both ends, as cheap as the causal rule alone: the kernels' registers
// had no room for another live value.
constexpr int kNoWindow = 0x7fffffff;
FA_HOST_DEVICE constexpr int causal_offset(int L, int S) { return S - L; }
FA_HOST_DEVICE constexpr bool causal_hides(int r, int c, int offset, int window = kNoWindow) {
  return unsigned(r + offset - c) >= unsigned(window);
}

// Whether some key of the tile c0 .. c0 + keys - 1 may be hidden from some
// row of r0 .. r0 + rows - 1. Every row sees every key iff the first row
// sees the tile's last key with (rows - 1) + (keys - 1) of its window to
// spare (the last row then sees the first key): one compare, as
// causal_hides (two made the 16-bit wgmma prefill 4-5% slower).
FA_HOST_DEVICE constexpr bool causal_tile_hides(int r0, int rows, int c0, int keys, int offset, int window) {
  const int spare = window - (rows - 1) - (keys - 1);
  return causal_hides(r0, c0 + keys - 1, offset, spare > 0 ? spare : 0);
}

// Rows l0 .. l0 + rows - 1 (clipped at L) see keys [0, end).
FA_HOST_DEVICE constexpr int causal_kv_end(int l0, int rows, int L, int S) {
  return clamp_int(l0 + (rows < L - l0 ? rows : L - l0) + causal_offset(L, S), 0, S);
}

// Rows from l0 on see no key before this one (row l0's window's first; 0
// where the window covers every key).
FA_HOST_DEVICE constexpr int causal_kv_begin(int l0, int L, int S, int window) {
  return window >= S ? 0 : clamp_int(l0 + causal_offset(L, S) - window + 1, 0, S);
}

// Keys c0 .. c0 + keys - 1 are seen by rows [causal_row_begin, causal_row_end) at most.
FA_HOST_DEVICE constexpr int causal_row_begin(int c0, int L, int S) {
  return clamp_int(c0 - causal_offset(L, S), 0, L);
}
FA_HOST_DEVICE constexpr int causal_row_end(int c0, int keys, int L, int S, int window) {
  return window >= S ? L : clamp_int(c0 + keys - 1 - causal_offset(L, S) + window, 0, L);
}

}  // namespace fa
