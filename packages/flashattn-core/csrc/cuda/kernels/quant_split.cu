// fa_quant_split_<dtype>: MLX's affine-quantized rows (packed uint32 codes,
// a scale and a bias per group, 4 or 8 bits) as two 16-bit terms side by
// side, each row [hi | lo] (2E elements): hi the format's value (scale *
// code + bias, one float32 FMA) rounded to the dtype, lo what hi left,
// rounded. hi + lo holds the value to 2^-17 of itself, so the float32
// attention over 16-bit inputs reads a quantized cache at float32 accuracy:
// each query row taken twice against keys [hi | lo] gives q . (hi + lo),
// and P times values [hi | lo] gives P hi and P lo, added into the output
// (prefill_f16_wg.cu's two-term units on Hopper, prefill_f16.cu's kFold
// elsewhere: cuda/quantized.cpp). Keys and values in one launch; the inputs
// row-contiguous (MLX copies views first).

#include <cstdint>

#include "unit.cuh"

#if FA_DTYPE == 0
#error "quant_split.cu: a 16-bit dtype"
#endif

namespace {

// rows x E elements of one array, each thread 8 elements (a word at 4 bits,
// two at 8) at a time.
__device__ __forceinline__ void split_rows(const uint32_t* __restrict__ packed, const FA_T* __restrict__ scales,
                                           const FA_T* __restrict__ biases, FA_T* __restrict__ out, int64_t rows,
                                           int E, int bits, int group_shift) {
  const int chunks = E / 8, words = E * bits / 32, groups = E >> group_shift;
  const int64_t n = rows * chunks, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / chunks;
    const int dim = static_cast<int>(i % chunks) * 8;
    const uint32_t* p = packed + r * words + ((dim * bits) >> 5);
    const uint32_t w0 = p[0], w1 = bits == 8 ? p[1] : 0u;
    const int64_t gi = r * groups + (dim >> group_shift);
    const float scale = fa::to_f(scales[gi]), bias = fa::to_f(biases[gi]);
    union {
      FA_T t[8];
      uint4 u;
    } hi, lo;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t code = bits == 4 ? (w0 >> (4 * j)) & 0xFu : ((j < 4 ? w0 : w1) >> (8 * (j & 3))) & 0xFFu;
      const float x = fmaf(scale, float(code), bias);
      hi.t[j] = fa::from_f<FA_T>(x);
      const float h = fa::to_f(hi.t[j]);
      // An infinite value keeps a zero low term (inf - inf would be NaN).
      lo.t[j] = fa::from_f<FA_T>(isinf(h) ? 0.0f : x - h);
    }
    FA_T* row = out + r * 2 * E;
    *reinterpret_cast<uint4*>(row + dim) = hi.u;
    *reinterpret_cast<uint4*>(row + E + dim) = lo.u;
  }
}

}  // namespace

// Keys' and values' rows (k_rows, v_rows: batch x heads x S) into k_out and
// v_out (row-contiguous, 2E a row); E a multiple of 8, both arrays of one
// bit width and group size (1 << group_shift).
extern "C" __global__ void FA_CAT3(fa_quant_split_, FA_TNAME, )(
    const uint32_t* __restrict__ k_packed, const FA_T* __restrict__ k_scales, const FA_T* __restrict__ k_biases,
    const uint32_t* __restrict__ v_packed, const FA_T* __restrict__ v_scales, const FA_T* __restrict__ v_biases,
    FA_T* __restrict__ k_out, FA_T* __restrict__ v_out, int k_rows, int v_rows, int E, int bits,
    int group_shift) {
  split_rows(k_packed, k_scales, k_biases, k_out, k_rows, E, bits, group_shift);
  split_rows(v_packed, v_scales, v_biases, v_out, v_rows, E, bits, group_shift);
}
