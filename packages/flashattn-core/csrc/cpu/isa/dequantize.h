// Rows of quantized keys or values (MLX's affine format, problem.h) into
// float32, as a key/value tile is read: one packed word at a time, its
// 32 / Bits elements shifted out, masked and scaled in one vector.

#pragma once

#include <cstdint>

#include "../problem.h"
#include "convert.h"
#include "simd.h"

namespace flashattn::cpu::FLASHATTN_ISA {

namespace dequantize_detail {

// Elements e of one row: scales[g] * q_e + biases[g], g = e / group_size.
template <int Bits, typename Sc>
inline void row(const uint32_t* words, int64_t word_stride, const Sc* scales, const Sc* biases,
                int64_t group_stride, int E, int group_size, float* dst) {
  constexpr int N = 32 / Bits; // elements a word holds; a group holds whole words
  using S = Simd<N>;
  using vu = typename S::vu;
  using vi = typename S::vi;
  using vf = typename S::vf;
  vu shifts;
  for (int j = 0; j < N; ++j) shifts[j] = unsigned(j * Bits);
  const vu low = vu{} + ((1u << Bits) - 1);
  const int words_per_group = group_size / N;
  for (int g = 0; g < E / group_size; ++g) {
    const vf scale = S::splat(to_float(scales[g * group_stride]));
    const vf bias = S::splat(to_float(biases[g * group_stride]));
    for (int i = g * words_per_group; i < (g + 1) * words_per_group; ++i) {
      const vu q = ((vu{} + words[i * word_stride]) >> shifts) & low;
      // Values below 2^8 convert exactly through the signed conversion
      // every instruction set has.
      const vf x = __builtin_convertvector((vi)q, vf);
      S::store(dst + i * N, x * scale + bias);
    }
  }
}

template <int Bits, typename Sc>
inline void rows(const StridedOperand& x, const Quantized& qz, int64_t slice, int64_t c0, int count, int E,
                 float* dst) {
  const uint32_t* words = static_cast<const uint32_t*>(x.data) + x.base[slice];
  const Sc* scales = static_cast<const Sc*>(qz.scales.data) + qz.scales.base[slice];
  const Sc* biases = static_cast<const Sc*>(qz.biases.data) + qz.biases.base[slice];
  for (int c = 0; c < count; ++c) {
    const int64_t key = c0 + c;
    row<Bits>(words + key * x.row_stride, x.col_stride, scales + key * qz.scales.row_stride,
              biases + key * qz.biases.row_stride, qz.scales.col_stride, E, qz.group_size, dst + int64_t(c) * E);
  }
}

template <typename Sc>
inline void rows_of(const StridedOperand& x, const Quantized& qz, int64_t slice, int64_t c0, int count, int E,
                    float* dst) {
  switch (qz.bits) {
    case 2: return rows<2, Sc>(x, qz, slice, c0, count, E, dst);
    case 4: return rows<4, Sc>(x, qz, slice, c0, count, E, dst);
    default: return rows<8, Sc>(x, qz, slice, c0, count, E, dst);
  }
}

} // namespace dequantize_detail

// Keys [c0, c0 + count) of (batch x KV head) slice `slice` into dst (count x
// E, row contiguous).
inline void dequantize_rows(const StridedOperand& x, const Quantized& qz, int64_t slice, int64_t c0, int count,
                            int E, float* dst) {
  using namespace dequantize_detail;
  if (qz.dtype == mx::float32) {
    rows_of<float>(x, qz, slice, c0, count, E, dst);
  } else if (qz.dtype == mx::float16) {
    rows_of<mx::float16_t>(x, qz, slice, c0, count, E, dst);
  } else {
    rows_of<mx::bfloat16_t>(x, qz, slice, c0, count, E, dst);
  }
}

} // namespace flashattn::cpu::FLASHATTN_ISA
