// Reading float32 / float16 / bfloat16 inputs as float32, W lanes at a time:
// the conversion happens in registers as tiles are read, never as a pass
// over whole inputs.

#pragma once

#include "simd.h"

namespace flashattn::cpu::FLASHATTN_ISA {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <int W, typename T>
struct Convert;

template <int W>
struct Convert<W, float> {
  static inline typename Simd<W>::vf load(const float* p) {
    return Simd<W>::load(p);
  }
};

// bfloat16 is the top half of a float32.
template <int W>
struct Convert<W, mx::bfloat16_t> {
  static inline typename Simd<W>::vf load(const mx::bfloat16_t* p) {
    typename Simd<W>::vu16 h;
    __builtin_memcpy(&h, p, sizeof(h));
    auto u = __builtin_convertvector(h, typename Simd<W>::vu) << 16;
    typename Simd<W>::vf v;
    __builtin_memcpy(&v, &u, sizeof(v));
    return v;
  }
};

template <int W>
struct Convert<W, mx::float16_t> {
  static inline typename Simd<W>::vf load(const mx::float16_t* p) {
    typename Simd<W>::vf v;
#if defined(__x86_64__) && defined(FLASHATTN_HAS_F16C)
    if constexpr (W == 16) {
      __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      __builtin_memcpy(&v, &x, sizeof(v));
      return v;
    } else if constexpr (W == 8) {
      __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
      __builtin_memcpy(&v, &x, sizeof(v));
      return v;
    }
#elif defined(__aarch64__)
    typedef __fp16 vh __attribute__((vector_size(W * 2), aligned(2)));
    vh h;
    __builtin_memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, typename Simd<W>::vf);
#endif
    float tmp[W];
    for (int i = 0; i < W; ++i) {
      tmp[i] = static_cast<float>(p[i]);
    }
    __builtin_memcpy(&v, tmp, sizeof(v));
    return v;
  }
};

} // namespace flashattn::cpu::FLASHATTN_ISA
