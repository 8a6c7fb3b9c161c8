// Rows of quantized keys or values (MLX's affine format, problem.h) into
// float32, as a key/value tile is read: 16 elements a vector (one word of
// 2-bit fields, two of 4-bit, four of 8-bit), shifted out, masked and
// scaled at once. What a row's loop needs is worked out once a tile: per
// row, a division (E / group size) and the pointers' set-up took longer
// than the row's 4 to 16 vectors (perf, qwen05b 4-bit decode).

#pragma once

#include <cstdint>

#include "../problem.h"
#include "convert.h"
#include "simd.h"

namespace flashattn::cpu::FLASHATTN_ISA {

namespace dequantize_detail {

// Elements e of one row: scales[g] * q_e + biases[g], g = e / group_size,
// `groups` groups of `words_per_group` words.
template <int Bits, typename Sc>
inline void row(const uint32_t* words, int64_t word_stride, const Sc* scales, const Sc* biases,
                int64_t group_stride, int groups, int words_per_group, float* dst) {
  constexpr int N = 32 / Bits;  // elements a word holds; a group (32 or more) holds whole words
  constexpr int W = 16;         // elements a vector: the words of one, W / N, lie in one group
  constexpr int words_per_vector = W / N;
  using S = Simd<W>;
  using vu = typename S::vu;
  using vi = typename S::vi;
  using vf = typename S::vf;
  vu shifts, word_of;  // a lane's shift, and which of the vector's words it takes
  for (int j = 0; j < W; ++j) shifts[j] = unsigned(j % N * Bits), word_of[j] = unsigned(j / N);
  const vu low = vu{} + ((1u << Bits) - 1);
  for (int g = 0; g < groups; ++g) {
    const vf scale = S::splat(to_float(scales[g * group_stride]));
    const vf bias = S::splat(to_float(biases[g * group_stride]));
    for (int i = g * words_per_group; i < (g + 1) * words_per_group; i += words_per_vector) {
      // Each word broadcast and blended into its lanes: lane by lane, the
      // compiler built the vector through the stack (a store-forwarding stall).
      vu w = vu{} + words[i * word_stride];
      for (int k = 1; k < words_per_vector; ++k) {
        const vu mine = (vu)(word_of == unsigned(k));
        w = (mine & (vu{} + words[(i + k) * word_stride])) | (~mine & w);
      }
      const vu q = (w >> shifts) & low;
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
  const int groups = E / qz.group_size, words_per_group = qz.group_size / (32 / Bits);
  const int64_t word_stride = x.col_stride, group_stride = qz.scales.col_stride;
  for (int c = 0; c < count; ++c) {
    const int64_t key = c0 + c;
    row<Bits>(words + key * x.row_stride, word_stride, scales + key * qz.scales.row_stride,
              biases + key * qz.biases.row_stride, group_stride, groups, words_per_group, dst + int64_t(c) * E);
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
