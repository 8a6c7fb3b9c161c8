// The launch arguments of the kernels that read keys and values in MLX's
// affine format in place (fa_decode_mmaq<bits>_, fa_decode_tf32q_, fa_prefill_wgq_,
// fa_prefill_tf32q_), in the order primitive.cpp's quantized_inputs passes
// them: K's and V's packed codes, K's scales and biases, V's (FA_T: the
// unit's dtype, the queries' and the scales'); after the scale, the bits and
// log2 of the group size; after the layout (K's and V's rows: the codes', in
// words), the scales' rows (the biases lie alike). A unit includes this only
// where it reads quantized rows (FA_QUANT).

#pragma once

#define FA_QUANT_KV_PARAMS                                                                                  \
  const uint32_t *k, const uint32_t *v, const FA_T *k_scales, const FA_T *k_biases, const FA_T *v_scales, \
      const FA_T *v_biases
#define FA_QUANT_SCALARS int bits, int group_shift,
#define FA_QUANT_LAYOUT , int ks_sb, int ks_sh, int ks_sr, int vs_sb, int vs_sh, int vs_sr

// The float32 prefills' arguments (the queries, the above, the mask's two
// pointers, the output and the rows' log-sum-exp, then the scalars), and
// their row source (kv_rows.cuh) made of them.
#define FA_QUANT_PREFILL_PARAMS                                                                                   \
  const FA_T *q, FA_QUANT_KV_PARAMS, const void *mask, const int64_t *mask_base, float *out, float *lse, int H_q, \
      int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, float scale_log2,                          \
      FA_QUANT_SCALARS FA_LAYOUT_PARAMS FA_QUANT_LAYOUT
#define FA_QUANT_PREFILL_ROWS                                                                                 \
  fa::Tf32QuantRows<FA_T> {                                                                                   \
    q, k, v, k_scales, k_biases, v_scales, v_biases, FA_LAYOUT, {ks_sb, ks_sh, ks_sr}, {vs_sb, vs_sh, vs_sr}, \
        bits, group_shift                                                                                     \
  }
