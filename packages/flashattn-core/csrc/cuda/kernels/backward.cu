// FlashAttention-2's backward (Algorithm 2) on TF32 tensor cores
// (mma.sync m16n8k8), for every dtype, mask and head dim up to 256. With
// P = softmax(S), S = scale Q K^T + mask over the visible keys:
//   dV = P^T dO    dP = dO V^T    D = rowsum(dO * O)    dS = P * (dP - D)
//   dQ = scale dS K    dK = scale dS^T Q
// Two passes, so that dQ and dK / dV each have one writer a block:
//   fa_backward_rows: 4 warps x 16 query rows. A row's log-sum-exp (the
//     forward's where the launch has it, kLse; else a first walk over the
//     keys takes it again), D, and dQ; writes (lse, D) per row for
//   fa_backward_keys: 4 warps x 16 keys against one query head's rows. dK
//     and dV; under GQA each head of a group adds its share (float32
//     atomics, K and V never repeated).
// Both recompute P from the scores and the row's log-sum-exp; never an
// L x S buffer. Where the forward kept the log-sum-exp and E <= 128, the
// keys pass makes dQ too (fa_backward_keysq: FlashAttention-2's dQ += dS K
// by float32 atomics into zeros) after fa_backward_d has written (lse, D):
// the rows pass's second walk of S and dP, three products of seven, saved
// for one.
//
// float32 inputs take the 3xTF32 split (hi*hi + hi*lo + lo*hi: float32
// accuracy, mma.cuh); float16 and bfloat16 values are exact in TF32, so their
// products take one term, with P and dS rounded to TF32 (10 bits, more than
// either 16-bit type keeps). The kernels read Q, K, V, O and dO where they
// lie and store dQ, dK and dV laid out as them (BackwardLayout and dQ's
// rows, the launches' last arguments; cuda/backward_node.cpp).

#include "backward_tf32.cuh"

// The extern "C" entry points of one unit (-DFA_DTYPE, -DFA_E: the head-dim
// bucket, -DFA_PASS=0 rows | 1 keys | 2 D | 3 keys with dQ):
// fa_backward_rows_<dtype>_<E>, fa_backward_keys_<dtype>_<E>,
// fa_backward_d_<dtype>_<E>, fa_backward_keysq_<dtype>_<E> (dq: float32
// zeros, the stats fa_backward_d's). Inputs, then outputs, then scalars, as MLX
// passes them; the scalars end in the arrays' rows (BackwardLayout, then
// dQ's). The rows pass's lse input is the forward's log-sum-exp where
// mask_kind has kLse (mask_bits.h), else any array, never read. The keys
// pass's dK and dV are T without GQA, float32 sums with it.
#if !defined(FA_E) || !defined(FA_PASS)
#error "define FA_E and FA_PASS"
#endif
#define FA_BACKWARD_SCALARS                                                                                  \
  int slices, int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs, int mask_cs, float scale_log2, \
      float scale, FA_BACKWARD_LAYOUT_PARAMS, int dq_sb, int dq_sh, int dq_sr
#define FA_DQ_ROWS \
  fa::Rows { dq_sb, dq_sh, dq_sr }

// -DFA_KIND=0 | 1: fa_backward_rows<n|c>_ and fa_backward_keys<n|c>_, the
// same arguments for calls with no mask or a causal one at E = FA_E exactly:
// the mask's kind and the head dim fixed at compile time (as
// backward_wg.cu's fa_backward_keyswg<n|c>_; the kind's other bits, sinks
// and kLse, stay arguments).
#if defined(FA_KIND)
#define FA_ROWS_FAMILY FA_CAT3(fa_backward_rows, FA_KIND_LETTER, _)
#define FA_KEYS_FAMILY FA_CAT3(fa_backward_keys, FA_KIND_LETTER, _)
#define FA_KEYSQ_FAMILY FA_CAT3(fa_backward_keysq, FA_KIND_LETTER, _)
#define FA_PASS_E FA_E
#define FA_PASS_KIND (FA_KIND | (mask_kind & ~fa::kKindBits))
#else
#define FA_ROWS_FAMILY fa_backward_rows_
#define FA_KEYS_FAMILY fa_backward_keys_
#define FA_KEYSQ_FAMILY fa_backward_keysq_
#define FA_PASS_E E
#define FA_PASS_KIND mask_kind
#endif
#if FA_PASS == 2
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(fa_backward_d_, FA_TNAME, _, FA_E, )(
    const FA_T* o, const FA_T* d_out, const float* lse, float* stats, FA_BACKWARD_SCALARS) {
  fa::backward_d<FA_T, FA_E>(o, d_out, lse, stats, slices, H_q, L, E, FA_BACKWARD_LAYOUT);
}
#elif FA_PASS == 0
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads, fa::backward_shapes::min_blocks(FA_E)) FA_CAT5(FA_ROWS_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* o, const FA_T* d_out, const void* mask,
    const int64_t* mask_base, const float* lse, FA_T* dq, float* stats, FA_BACKWARD_SCALARS) {
  fa::backward_rows<FA_T, FA_E>(q, k, v, o, d_out, mask, mask_base, lse, dq, stats, slices, H_q, H_kv, L, S, FA_PASS_E,
                                FA_PASS_KIND, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT, FA_DQ_ROWS);
}
#elif FA_PASS == 3
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(FA_KEYSQ_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* d_out, const float* stats, const void* mask,
    const int64_t* mask_base, void* dk, void* dv, float* dq, FA_BACKWARD_SCALARS) {
  fa::backward_keys<FA_T, FA_E, true>(q, k, v, d_out, stats, mask, mask_base, dk, dv, dq, slices, H_q, H_kv, L, S,
                                      FA_PASS_E, FA_PASS_KIND, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT,
                                      FA_DQ_ROWS);
}
#else
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(FA_KEYS_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* d_out, const float* stats, const void* mask,
    const int64_t* mask_base, void* dk, void* dv, FA_BACKWARD_SCALARS) {
  fa::backward_keys<FA_T, FA_E>(q, k, v, d_out, stats, mask, mask_base, dk, dv, nullptr, slices, H_q, H_kv, L, S, FA_PASS_E,
                                FA_PASS_KIND, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT, FA_DQ_ROWS);
}
#endif
