// The causal mask as MLX defines it, bottom-right aligned: query position l
// sees key c iff c <= l + (S - L). Integer arithmetic only, shared by the
// planner and every kernel variant.

#pragma once

#include <algorithm>
#include <cstdint>

namespace flashattn::cpu {

enum class TileVisibility { hidden, partial, visible };

// The offset of the rule: L query positions against S keys.
inline int64_t causal_offset(int64_t L, int64_t S) {
  return S - L;
}

// The last key query position l sees (negative when it sees none).
inline int64_t causal_last_key(int64_t l, int64_t offset) {
  return l + offset;
}

// Query positions [l_min, l_max] against keys [c0, c1).
inline TileVisibility causal_visibility(
    int64_t l_min,
    int64_t l_max,
    int64_t c0,
    int64_t c1,
    int64_t offset) {
  if (c0 > causal_last_key(l_max, offset)) {
    return TileVisibility::hidden;
  }
  if (c1 - 1 <= causal_last_key(l_min, offset)) {
    return TileVisibility::visible;
  }
  return TileVisibility::partial;
}

// Keys [0, end) hold every key that query positions <= l_max may see.
inline int causal_key_end(int64_t l_max, int64_t offset, int S) {
  return int(std::clamp<int64_t>(causal_last_key(l_max, offset) + 1, 0, S));
}

// The first of L query positions that sees key c (L when none does).
inline int64_t causal_first_row(int64_t c, int64_t offset, int L) {
  return std::clamp<int64_t>(c - offset, 0, L);
}

} // namespace flashattn::cpu
