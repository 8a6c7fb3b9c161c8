// The causal mask as MLX defines it, bottom-right aligned: query position l
// sees key c iff c <= l + (S - L); with a sliding window of W keys, also
// c > l + (S - L) - W (mlx-lm's create_causal_mask with window_size = W).
// Integer arithmetic only, shared by the planner and every kernel variant.

#pragma once

#include <algorithm>
#include <cstdint>

namespace flashattn::cpu {

enum class TileVisibility { hidden, partial, visible };

struct CausalRule {
  int64_t offset = 0; // S - L
  int64_t window = 0; // keys a row sees at most; 0: no window

  CausalRule(int64_t L, int64_t S, int64_t window = 0) : offset(S - L), window(window) {}

  // The last key query position l sees (negative when it sees none).
  int64_t last_key(int64_t l) const {
    return l + offset;
  }

  // The first key query position l may see (negative: from key 0).
  int64_t first_key(int64_t l) const {
    return window > 0 ? l + offset - window + 1 : INT64_MIN / 4;
  }

  // Query positions [l_min, l_max] against keys [c0, c1).
  TileVisibility visibility(int64_t l_min, int64_t l_max, int64_t c0, int64_t c1) const {
    if (c0 > last_key(l_max) || c1 - 1 < first_key(l_min)) {
      return TileVisibility::hidden;
    }
    if (c1 - 1 <= last_key(l_min) && c0 >= first_key(l_max)) {
      return TileVisibility::visible;
    }
    return TileVisibility::partial;
  }

  // Keys [key_begin(l_min), key_end(l_max)) hold every key that query
  // positions l_min..l_max may see.
  int key_begin(int64_t l_min, int S) const {
    return int(std::clamp<int64_t>(first_key(l_min), 0, S));
  }
  int key_end(int64_t l_max, int S) const {
    return int(std::clamp<int64_t>(last_key(l_max) + 1, 0, S));
  }

  // Query positions [first_row(c), row_end(c)) of L see key c.
  int64_t first_row(int64_t c, int L) const {
    return std::clamp<int64_t>(c - offset, 0, L);
  }
  int64_t row_end(int64_t c, int L) const {
    return window > 0 ? std::clamp<int64_t>(c - offset + window, 0, L) : L;
  }
};

} // namespace flashattn::cpu
