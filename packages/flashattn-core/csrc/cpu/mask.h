// Masking of one Br x Bc score tile, shared by every CPU kernel variant.
//
// Causal masks are bottom-right aligned as in MLX: query row r sees key c
// iff c <= r + (S - L). Tiles are classified so that fully hidden tiles are
// skipped and fully visible tiles skip the mask work.

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "tiles.h"

namespace flashattn::cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

enum class TileVisibility { hidden, partial, visible };

// Rows [r0, r1) against keys [c0, c1) under a causal mask with
// offset = S - L.
inline TileVisibility causal_visibility(
    int r0,
    int r1,
    int c0,
    int c1,
    int offset) {
  if (c0 > (r1 - 1) + offset) {
    return TileVisibility::hidden;
  }
  if ((c1 - 1) <= r0 + offset) {
    return TileVisibility::visible;
  }
  return TileVisibility::partial;
}

// Number of keys any of rows [r0, r1) may see under a causal mask: keys at or
// past it are hidden from all of them.
inline int causal_key_end(int r1, int offset, int S) {
  int64_t end = int64_t(r1 - 1) + offset + 1;
  return int(std::clamp<int64_t>(end, 0, S));
}

// s: rows x ld scores of rows r0.. and keys c0..; hide what the causal mask
// hides.
inline void apply_causal_mask(
    float* s,
    int ld,
    int r0,
    int rows,
    int c0,
    int cols,
    int offset) {
  for (int r = 0; r < rows; ++r) {
    // Keys c0 + c with c > r0 + r + offset - c0 are hidden.
    int64_t first_hidden = int64_t(r0) + r + offset - c0 + 1;
    for (int c = int(std::max<int64_t>(first_hidden, 0)); c < cols; ++c) {
      s[r * ld + c] = kNegInf;
    }
  }
}

// Boolean mask: false hides the key. Additive mask: added to the score in
// float32; scores are kept in the log2 domain, hence the factor log2(e).
template <typename M>
void apply_array_mask(
    float* s,
    int ld,
    const M* mask,
    int64_t base,
    int64_t row_stride,
    int64_t col_stride,
    int r0,
    int rows,
    int c0,
    int cols) {
  for (int r = 0; r < rows; ++r) {
    const M* row = mask + base + int64_t(r0 + r) * row_stride +
        int64_t(c0) * col_stride;
    for (int c = 0; c < cols; ++c) {
      M value = row[int64_t(c) * col_stride];
      if constexpr (std::is_same_v<M, bool>) {
        if (!value) {
          s[r * ld + c] = kNegInf;
        }
      } else {
        s[r * ld + c] += static_cast<float>(value) * kLog2e;
      }
    }
  }
}

} // namespace flashattn::cpu
