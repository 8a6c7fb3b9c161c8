// The rule every online-softmax step and the split merge share: a row's
// probabilities are taken as exp2(s - base) against its running maximum m,
// except that a row which has seen only hidden keys (m = -inf) uses base 0,
// so that exp2(-inf - 0) = 0 where -inf - (-inf) would be NaN. Such a row
// ends with l = 0 and gives zeros.

#pragma once

#include <limits>

namespace flashattn::cpu {

inline float softmax_base(float m) {
  return m == -std::numeric_limits<float>::infinity() ? 0.0f : m;
}

} // namespace flashattn::cpu
