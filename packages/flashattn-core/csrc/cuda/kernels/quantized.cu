// Attention over quantized keys and values (MLX's affine format, as
// mx.quantize returns it and mlx-lm's QuantizedKVCache holds it): the generic
// kernel's layout, one warp per query row with lane i holding head-dim
// elements i, i + 32, ..., each lane dequantizing its own elements of a key
// or value row as it reads them (a packed uint32 field, shifted and masked,
// times its group's float32 scale plus its bias). Keys are split across
// grid.y and every split writes its partial (o, m, l); fa_merge_<dtype>
// (generic.cu) combines them (FlashDecoding). No full-precision copy of the
// cache and no L x S matrix exist.
//
//   grid.x: query rows (B x H_q x L) / 4 warps a block; grid.y: key splits

#include "generic_walk.cuh"
#include "unit.cuh"

namespace fa {

// Rows of quantized keys or values (B x H_kv x S rows, row contiguous).
struct QuantizedRows {
  const uint32_t* words;
  const float* scales;
  const float* biases;
  int bits, group_size, E;

  __device__ __forceinline__ float at(int64_t row, int e) const {
    const int per_word = 32 / bits;
    const uint32_t w = words[row * (E / per_word) + e / per_word];
    const uint32_t q = (w >> ((e % per_word) * bits)) & ((1u << bits) - 1u);
    const int64_t g = row * (E / group_size) + e / group_size;
    return scales[g] * (float)q + biases[g];
  }
};

template <typename T, int EPT>
__device__ __forceinline__ void quantized_attend(
    const T* __restrict__ q, QuantizedRows k, QuantizedRows v, const void* mask_data,
    const int64_t* __restrict__ mask_base, float* __restrict__ o_part, float* __restrict__ ml_part, int B,
    int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs, int mask_cs, int keys_per_split,
    float scale_log2) {
  const GenericRow r(B, H_q, H_kv, L);
  if (!r.exists()) return;
  const int lane = r.lane;
  const T* q_row = q + r.row * E;  // row contiguous: row = n L + l
  float qv[EPT], o[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = lane + 32 * i;
    qv[i] = e < E ? to_f(q_row[e]) * scale_log2 : 0.0f;
    o[i] = 0.0f;
  }
  Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const int c_begin = r.split * keys_per_split;
  const int c_end = mask.key_end(r.l, min(S, c_begin + keys_per_split));
  const bool masked = mask.is_array();
  const int64_t rb = masked ? mask.row_base(r.n, r.l) : 0;
  const int64_t head = ((int64_t)r.b * H_kv + r.g) * S;  // this KV head's first key row

  // A group of G keys: their K and V fields read together, their scores
  // reduced side by side (generic.cu's reasoning).
  constexpr int G = 8;
  float m = FA_NEG_INF, l_sum = 0.0f;
  for (int c0 = c_begin; c0 < c_end; c0 += G) {
    float vr[G][EPT], s[G], add[G];
    bool seen[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int c = c0 + j;
      seen[j] = c < c_end;
      add[j] = masked && seen[j] ? mask.term(rb, c) : 0.0f;
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const int e = lane + 32 * i;
        const bool here = seen[j] && e < E;
        dot += here ? qv[i] * k.at(head + c, e) : 0.0f;
        vr[j][i] = here ? v.at(head + c, e) : 0.0f;
      }
      s[j] = dot;
    }
#pragma unroll
    for (int o_ = 16; o_ > 0; o_ >>= 1)
#pragma unroll
      for (int j = 0; j < G; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], o_);
    add_key_group(s, seen, add, m, l_sum, o, [&](int j, int i) { return vr[j][i]; });
  }

  const int64_t slot = (int64_t)r.split * r.rows + r.row;
  if (lane == 0) {
    ml_part[slot * 2] = m;
    ml_part[slot * 2 + 1] = l_sum;
  }
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = lane + 32 * i;
    if (e < E) o_part[slot * E + e] = o[i];
  }
}

}  // namespace fa

// fa_quantized_<dtype>_<EPT> (-DFA_DTYPE, -DFA_EPT): inputs, outputs, then
// scalars, as MLX passes them.
extern "C" __global__ void __launch_bounds__(128) FA_CAT5(fa_quantized_, FA_TNAME, _, FA_EPT, )(
    const FA_T* q, const uint32_t* k, const float* k_scales, const float* k_biases, const uint32_t* v,
    const float* v_scales, const float* v_biases, const void* mask, const int64_t* mask_base, float* o_part,
    float* ml_part, int B, int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs, int mask_cs,
    int keys_per_split, float scale_log2, int k_bits, int k_group_size, int v_bits, int v_group_size) {
  fa::quantized_attend<FA_T, FA_EPT>(q, fa::QuantizedRows{k, k_scales, k_biases, k_bits, k_group_size, E},
                                     fa::QuantizedRows{v, v_scales, v_biases, v_bits, v_group_size, E}, mask,
                                     mask_base, o_part, ml_part, B, H_q, H_kv, L, S, E, mask_kind, mask_rs, mask_cs,
                                     keys_per_split, scale_log2);
}
