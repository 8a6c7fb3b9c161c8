// W-lane float vectors on the compiler's vector extensions (GCC and Clang):
// one source for AVX-512, AVX2, SSE2 and NEON. Selects are written with
// bitwise masks so that they mean the same under both compilers.

#pragma once

namespace flashattn::cpu::FLASHATTN_ISA {

template <int W>
struct Simd {
  typedef float vf __attribute__((vector_size(W * 4), aligned(4)));
  typedef int vi __attribute__((vector_size(W * 4), aligned(4)));
  typedef unsigned vu __attribute__((vector_size(W * 4), aligned(4)));
  typedef unsigned short vu16 __attribute__((vector_size(W * 2), aligned(2)));

  // Loads and stores through an unaligned type that may alias the floats.
  // (A 32-byte __builtin_memcpy became two 16-byte moves through the stack
  // under GCC's generic tuning, and a 32-byte reload of them: AVX2 ran 9x
  // slower than this.)
  typedef float vf_mem __attribute__((vector_size(W * 4), aligned(4), may_alias));

  static inline vf load(const float* p) {
    return *reinterpret_cast<const vf_mem*>(p);
  }
  static inline void store(float* p, vf v) {
    *reinterpret_cast<vf_mem*>(p) = v;
  }
  // Lane by lane, which compilers turn into one broadcast (from memory where
  // x is loaded). `vf{} + x` meant an add (0 + x is not x for x = -0, so no
  // compiler may drop it) and a register broadcast: on Intel's AVX-512 cores
  // both took the FMA ports' slots in every product.
  static inline vf splat(float x) {
    float lanes[W];
    for (int i = 0; i < W; ++i) lanes[i] = x;
    return load(lanes);
  }
  static inline vf bits_to_float(vi x) {
    vf v;
    __builtin_memcpy(&v, &x, sizeof(v));
    return v;
  }
  static inline vi float_to_bits(vf x) {
    vi v;
    __builtin_memcpy(&v, &x, sizeof(v));
    return v;
  }
  // mask lanes are all ones (true) or all zeros (false), as comparisons give.
  static inline vf select(vi mask, vf a, vf b) {
    return bits_to_float((mask & float_to_bits(a)) | (~mask & float_to_bits(b)));
  }
  // A NaN in x is ignored: only the scores' exp2 carries NaN to the output.
  // (The vector ternary compiles to one max instruction, off the critical
  // path of a long reduction; the mask-and-blend form does not.)
  static inline vf max(vf m, vf x) {
#if defined(__clang__)
    return select(x > m, x, m);
#else
    return x > m ? x : m;
#endif
  }
};

} // namespace flashattn::cpu::FLASHATTN_ISA
