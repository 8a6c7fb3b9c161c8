// Vectorised 2^x for the online softmax, x <= 0 or NaN (scores minus their
// running maximum). Relative error about 1e-7 (a degree-6 polynomial fitted
// to 2^f on [-1/2, 1/2]); x <= -127, and so -inf, gives exactly 0, which is
// what keeps hidden keys out of the sums; NaN stays NaN.

#pragma once

#include "simd.h"

namespace flashattn::cpu::FLASHATTN_ISA {

template <int W>
inline typename Simd<W>::vf exp2(typename Simd<W>::vf x) {
  using S = Simd<W>;
  using vf = typename S::vf;
  using vi = typename S::vi;
  const vf lo = S::splat(-127.0f);
  x = S::select(x < lo, lo, x); // NaN compares false and passes through
  // Round to nearest integer n with the 1.5 * 2^23 trick; f in [-1/2, 1/2].
  const vf magic = S::splat(12582912.0f);
  vf n = (x + magic) - magic;
  vf f = x - n;
  vf p = S::splat(1.5345810970757157e-04f);
  p = p * f + 1.3399930903688073e-03f;
  p = p * f + 9.6184890717267990e-03f;
  p = p * f + 5.5503286421298980e-02f;
  p = p * f + 2.4022646248340607e-01f;
  p = p * f + 6.9314718246459960e-01f;
  p = p * f + 1.0f;
  // 2^n from the exponent bits; n = -127 gives a zero exponent field: 0.
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * S::bits_to_float(e);
}

} // namespace flashattn::cpu::FLASHATTN_ISA
