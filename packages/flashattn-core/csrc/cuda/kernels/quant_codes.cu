// fa_quant_codes_<dtype>: MLX's affine-quantized keys and values (packed
// uint32 codes, 4 or 8 bits; one group a row: a scale and a bias per row) as
// what prefill_f16_wg.cu's codes units (kQC) read: the codes themselves in
// the dtype (exact: at most 255), E a row, and each key's scales and biases
// in float32, (K's scale, bias, V's scale, bias) a key, a (batch, KV head)'s
// keys padded with zeros to a whole number of the kernel's tiles. Half the
// bytes of quant_split.cu's two terms, and one Q K^T product instead of
// two. The inputs row-contiguous (MLX copies views first).

#include <cstdint>

#include "unit.cuh"

#if FA_DTYPE == 0
#error "quant_codes.cu: a 16-bit dtype"
#endif

namespace {

// rows x E codes of one array into out, each thread 8 (a word at 4 bits, two
// at 8) at a time.
__device__ __forceinline__ void codes_rows(const uint32_t* __restrict__ packed, FA_T* __restrict__ out,
                                           int64_t rows, int E, int bits) {
  const int chunks = E / 8, words = E * bits / 32;
  const int64_t n = rows * chunks, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / chunks;
    const int dim = static_cast<int>(i % chunks) * 8;
    const uint32_t* p = packed + r * words + ((dim * bits) >> 5);
    const uint32_t w0 = p[0], w1 = bits == 8 ? p[1] : 0u;
    union {
      FA_T t[8];
      uint4 u;
    } c;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t code = bits == 4 ? (w0 >> (4 * j)) & 0xFu : ((j < 4 ? w0 : w1) >> (8 * (j & 3))) & 0xFFu;
      c.t[j] = fa::from_f<FA_T>(float(code));
    }
    *reinterpret_cast<uint4*>(out + r * E + dim) = c.u;
  }
}

}  // namespace

// heads: batch x KV heads; S keys each, padded to s_pad in `scales`
// (heads x s_pad float4). K and V of one shape, E a multiple of 8.
extern "C" __global__ void FA_CAT3(fa_quant_codes_, FA_TNAME, )(
    const uint32_t* __restrict__ k_packed, const FA_T* __restrict__ k_scales, const FA_T* __restrict__ k_biases,
    const uint32_t* __restrict__ v_packed, const FA_T* __restrict__ v_scales, const FA_T* __restrict__ v_biases,
    FA_T* __restrict__ k_out, FA_T* __restrict__ v_out, float4* __restrict__ scales, int heads, int S, int s_pad,
    int E, int k_bits, int v_bits) {
  const int64_t rows = static_cast<int64_t>(heads) * S;
  codes_rows(k_packed, k_out, rows, E, k_bits);
  codes_rows(v_packed, v_out, rows, E, v_bits);
  const int64_t n = static_cast<int64_t>(heads) * s_pad, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t h = i / s_pad;
    const int key = static_cast<int>(i % s_pad);
    float4 x = {0.0f, 0.0f, 0.0f, 0.0f};
    if (key < S) {
      const int64_t r = h * S + key;
      x = {fa::to_f(k_scales[r]), fa::to_f(k_biases[r]), fa::to_f(v_scales[r]), fa::to_f(v_biases[r])};
    }
    scales[i] = x;
  }
}
