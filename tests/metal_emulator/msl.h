// Metal Shading Language on the CPU, for the emulator: enough of MSL's types,
// address spaces and builtins to compile the kernels flashattn-core ships as
// C++20 with clang, and to run them lane by lane (runtime.h).
//
//   address spaces   device / constant / threadgroup become clang address
//                    spaces 1 / 2 / 3: distinct pointer types, so a kernel
//                    that mixes them fails to compile here as on Metal
//   half, bfloat     16-bit storage with round-to-nearest-even conversions
//   SIMD functions   simd_sum / max / min / shuffle / broadcast /
//                    shuffle_xor, simdgroup_barrier: the 32 lanes meet
//   threadgroup_barrier   every thread of the threadgroup meets
//   simdgroup_matrix float 8 x 8 only: each lane holds two elements (MLX's
//                    layout); loads and stores touch only those, the product
//                    gathers the 32 lanes
//
// Everything else (textures, atomics, half-precision matrices, quad
// functions) is absent: a kernel that uses it fails to compile here. One
// concession to flashattn-core: see fa::load / fa::store at the end.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "runtime.h"

#define FA_EMU_DEVICE __attribute__((address_space(1)))
#define FA_EMU_CONSTANT __attribute__((address_space(2)))
#define FA_EMU_THREADGROUP __attribute__((address_space(3)))
// The call site of a SIMD-group operation: lanes of a group must meet at one.
#define FA_EMU_SITE __builtin_return_address(0)
#define FA_EMU_COLLECTIVE __attribute__((noinline))

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

///////////////////////////////////////////////////////////////////////////////
// 16-bit floats
///////////////////////////////////////////////////////////////////////////////

namespace fa_emu {

inline uint32_t bits_of(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline float float_of(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline uint16_t half_from_float(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: inf
  if (a < 0x38800000u) {                        // below 2^-14: subnormal
    return sign | static_cast<uint16_t>(std::nearbyint(float_of(a) * 16777216.0f));
  }
  uint32_t h = ((((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu));
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return sign | h;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) / 16777216.0f;
    return sign ? -v : v;
  }
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t bfloat_from_float(float f) {
  const uint32_t x = bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bfloat_to_float(uint16_t b) {
  return float_of(static_cast<uint32_t>(b) << 16);
}

}  // namespace fa_emu

struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(fa_emu::half_from_float(f)) {}
  operator float() const {
    return fa_emu::half_to_float(bits);
  }
};

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) : bits(fa_emu::bfloat_from_float(f)) {}
  operator float() const {
    return fa_emu::bfloat_to_float(bits);
  }
};

typedef half float16_t;
typedef bfloat bfloat16_t;

struct uint2 {
  uint x, y;
};
struct uint3 {
  uint x, y, z;
};
struct ulong2 {
  ulong x, y;
  ulong2(ulong a, ulong b) : x(a), y(b) {}
  ulong2(int a) : x(a), y(a) {}
};

///////////////////////////////////////////////////////////////////////////////
// The metal namespace
///////////////////////////////////////////////////////////////////////////////

namespace metal {

enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}

inline void threadgroup_barrier(mem_flags) {
  fa_emu::threadgroup_barrier();
}

FA_EMU_COLLECTIVE inline void simdgroup_barrier(mem_flags) {
  fa_emu::Collective c{fa_emu::Op::simd_barrier, FA_EMU_SITE};
  fa_emu::simd_collective(c);
}

FA_EMU_COLLECTIVE inline float simd_sum(float x) {
  fa_emu::Collective c{fa_emu::Op::simd_sum, FA_EMU_SITE, x};
  fa_emu::simd_collective(c);
  return c.f_out;
}
FA_EMU_COLLECTIVE inline float simd_max(float x) {
  fa_emu::Collective c{fa_emu::Op::simd_max, FA_EMU_SITE, x};
  fa_emu::simd_collective(c);
  return c.f_out;
}
FA_EMU_COLLECTIVE inline float simd_min(float x) {
  fa_emu::Collective c{fa_emu::Op::simd_min, FA_EMU_SITE, x};
  fa_emu::simd_collective(c);
  return c.f_out;
}
FA_EMU_COLLECTIVE inline int simd_sum(int x) {
  fa_emu::Collective c{fa_emu::Op::simd_sum_int, FA_EMU_SITE, 0.0f, x};
  fa_emu::simd_collective(c);
  return static_cast<int>(c.i_out);
}
FA_EMU_COLLECTIVE inline int simd_max(int x) {
  fa_emu::Collective c{fa_emu::Op::simd_max_int, FA_EMU_SITE, 0.0f, x};
  fa_emu::simd_collective(c);
  return static_cast<int>(c.i_out);
}
FA_EMU_COLLECTIVE inline float simd_shuffle(float x, ushort lane) {
  fa_emu::Collective c{fa_emu::Op::simd_shuffle, FA_EMU_SITE, x, 0, lane};
  fa_emu::simd_collective(c);
  return c.f_out;
}
FA_EMU_COLLECTIVE inline float simd_broadcast(float x, ushort lane) {
  fa_emu::Collective c{fa_emu::Op::simd_shuffle, FA_EMU_SITE, x, 0, lane};
  fa_emu::simd_collective(c);
  return c.f_out;
}
FA_EMU_COLLECTIVE inline float simd_shuffle_xor(float x, ushort mask) {
  fa_emu::Collective c{fa_emu::Op::simd_shuffle, FA_EMU_SITE, x, 0, fa_emu::lane_in_simdgroup() ^ mask};
  fa_emu::simd_collective(c);
  return c.f_out;
}
FA_EMU_COLLECTIVE inline bool simd_any(bool x) {
  fa_emu::Collective c{fa_emu::Op::simd_max_int, FA_EMU_SITE, 0.0f, x ? 1 : 0};
  fa_emu::simd_collective(c);
  return c.i_out != 0;
}
FA_EMU_COLLECTIVE inline bool simd_all(bool x) {
  fa_emu::Collective c{fa_emu::Op::simd_sum_int, FA_EMU_SITE, 0.0f, x ? 1 : 0};
  fa_emu::simd_collective(c);
  return c.i_out == 32;
}

// Math: float and int overloads, as MSL's are.
inline float exp2(float x) { return std::exp2(x); }
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float log2(float x) { return std::log2(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float floor(float x) { return std::floor(x); }
inline float ceil(float x) { return std::ceil(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
// MSL's max / min / fmax / fmin return the other argument when one is NaN.
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline float clamp(float x, float lo, float hi) { return std::fmin(std::fmax(x, lo), hi); }
inline int clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }
namespace fast {
inline float exp2(float x) { return std::exp2(x); }
inline float exp(float x) { return std::exp(x); }
}  // namespace fast
namespace precise {
inline float exp2(float x) { return std::exp2(x); }
inline float exp(float x) { return std::exp(x); }
}  // namespace precise

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of one size");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}

///////////////////////////////////////////////////////////////////////////////
// simdgroup_matrix (float, 8 x 8)
///////////////////////////////////////////////////////////////////////////////

template <typename T, int Rows, int Cols>
struct simdgroup_matrix {
  static_assert(std::is_same_v<T, float> && Rows == 8 && Cols == 8,
                "the emulator models simdgroup_matrix<float, 8, 8> only");
  float e[2];  // this lane's elements: (frag_row, frag_col + 0 / 1)
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

template <typename T, int Rows, int Cols>
inline simdgroup_matrix<T, Rows, Cols> make_filled_simdgroup_matrix(T value) {
  return simdgroup_matrix<T, Rows, Cols>{{value, value}};
}

namespace detail {
// Offset of element (row, col) of the matrix in a source of
// elements_per_row columns; origin is (column, row) as in MSL.
inline long matrix_offset(int row, int col, ulong per_row, ulong2 origin, bool transpose) {
  if (transpose) return static_cast<long>((origin.y + col) * per_row + origin.x + row);
  return static_cast<long>((origin.y + row) * per_row + origin.x + col);
}
}  // namespace detail

#define FA_EMU_MATRIX_IO(SPACE)                                                                          \
  inline void simdgroup_load(simdgroup_float8x8& m, const SPACE float* src, ulong per_row = 8,          \
                             ulong2 origin = ulong2(0, 0), bool transpose = false) {                    \
    const int lane = fa_emu::lane_in_simdgroup();                                                        \
    const int r = fa_emu::frag_row(lane), c = fa_emu::frag_col(lane);                                   \
    for (int j = 0; j < 2; ++j) m.e[j] = src[detail::matrix_offset(r, c + j, per_row, origin, transpose)]; \
  }                                                                                                      \
  inline void simdgroup_store(const simdgroup_float8x8& m, SPACE float* dst, ulong per_row = 8,         \
                              ulong2 origin = ulong2(0, 0), bool transpose = false) {                   \
    const int lane = fa_emu::lane_in_simdgroup();                                                        \
    const int r = fa_emu::frag_row(lane), c = fa_emu::frag_col(lane);                                   \
    for (int j = 0; j < 2; ++j) dst[detail::matrix_offset(r, c + j, per_row, origin, transpose)] = m.e[j]; \
  }
FA_EMU_MATRIX_IO(FA_EMU_THREADGROUP)
FA_EMU_MATRIX_IO(FA_EMU_DEVICE)
#undef FA_EMU_MATRIX_IO

FA_EMU_COLLECTIVE inline void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_float8x8& a,
                                                            const simdgroup_float8x8& b,
                                                            const simdgroup_float8x8& c) {
  fa_emu::Collective op{fa_emu::Op::matrix_multiply_accumulate, FA_EMU_SITE};
  op.d = d.e;
  op.a = a.e;
  op.b = b.e;
  op.c = c.e;
  fa_emu::simd_collective(op);
}

inline void simdgroup_multiply(simdgroup_float8x8& d, const simdgroup_float8x8& a, const simdgroup_float8x8& b) {
  const simdgroup_float8x8 zero = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_multiply_accumulate(d, a, b, zero);
}

}  // namespace metal

// flashattn-core's element access (common.metal: fa::load, fa::store) for the
// 16-bit types. On Metal, half and bfloat are scalars; here they are classes,
// and clang cannot run a class's conversion on an object in another address
// space, so these overloads (preferred to the kernels' templates) convert the
// bits directly.
namespace fa {
inline float load(const FA_EMU_DEVICE half* p, int64_t i) {
  return fa_emu::half_to_float(((const uint16_t*)p)[i]);
}
inline float load(const FA_EMU_DEVICE bfloat* p, int64_t i) {
  return fa_emu::bfloat_to_float(((const uint16_t*)p)[i]);
}
inline void store(FA_EMU_DEVICE half* p, int64_t i, float x) {
  ((uint16_t*)p)[i] = fa_emu::half_from_float(x);
}
inline void store(FA_EMU_DEVICE bfloat* p, int64_t i, float x) {
  ((uint16_t*)p)[i] = fa_emu::bfloat_from_float(x);
}
}  // namespace fa

// MSL's address-space and function qualifiers. Last, so that no standard
// header above sees them.
#define device FA_EMU_DEVICE
#define constant FA_EMU_CONSTANT const
#define threadgroup FA_EMU_THREADGROUP
#define thread
#define kernel
