// The online softmax's numerical rules (FlashAttention-2, in the log2
// domain), once for every CUDA kernel: what a row's exponents subtract, how a
// new maximum rescales what the row has summed, 1 / l at the end, and the
// whole step on mma accumulators. (The merge of partial states built on the
// same rules is combine.cuh's.)

#pragma once

#include "common.cuh"

namespace fa {

// 2^x on the special-function unit alone. Subnormal results flush to 0, which
// exp2f spends three more instructions per call to avoid; a probability below
// 2^-126 changes no float32 sum it joins.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <bool kFast>
__device__ __forceinline__ float exp2_of(float x) {
  if constexpr (kFast) {
    return fast_exp2(x);
  } else {
    return exp2f(x);
  }
}

// What a row's exponents subtract: its running maximum m, or 0 while it has
// seen no visible key (m = -inf), so that 2^(-inf - base) is 0, never NaN.
__device__ __forceinline__ float exp_base(float m) { return m == FA_NEG_INF ? 0.0f : m; }

// A row's maximum m meets a tile whose largest score is tile_max: m moves to
// the larger, base is what the tile's exponents now subtract, and the factor
// returned rescales what the row summed before (l and o). fmaxf drops a NaN
// score, so a NaN reaches the output through its own exponent, not the max.
// kFast: fast_exp2 (the tensor-core kernels) or exp2f.
template <bool kFast>
__device__ __forceinline__ float online_rescale(float& m, float tile_max, float& base) {
  const float m_new = fmaxf(m, tile_max);
  base = exp_base(m_new);
  const float alpha = exp2_of<kFast>(m - base);
  m = m_new;
  return alpha;
}

// An attention sink (a logit per query head, here in the log2 domain, that
// joins each row's softmax denominator: a key whose value is zero): the
// row's state (m, l) takes it in, and the factor returned rescales its o.
// Without a sink (sink2 = -inf) m and l stay as they are and the factor is
// 1 (0 for a row that saw no key, whose o is 0).
__device__ __forceinline__ float add_sink(float& m, float& l, float sink2) {
  const float m_new = fmaxf(m, sink2);
  const float base = exp_base(m_new);
  const float a = exp2f(m - base);
  l = l * a + exp2f(sink2 - base);
  m = m_new;
  return a;
}

// 1 / l for a row's output: 0 for a row that saw no visible key (l = 0),
// whose output is zeros, never NaN.
__device__ __forceinline__ float inverse_sum(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }

// A row's log-sum-exp (log2 domain) from its final m and l (the sink's term
// in l where there is one): +inf for a row that saw no visible key (seen:
// its sum before any sink was not 0), so that every P = 2^(s - lse) the
// backward recomputes for it is 0.
__device__ __forceinline__ float row_lse(bool seen, float m, float l) {
  return seen ? exp_base(m) + log2f(l) : INFINITY;
}

// Row rr's scores of this thread (accumulator layout) become P = 2^(x mul -
// base); returns their sum, in C independent chains (one chain of 2 NB
// dependent additions would wait out each one's latency).
template <int NB>
__device__ __forceinline__ float exp_row(float (&s)[NB][4], int rr, float mul, float base) {
  constexpr int C = 2 * NB < 4 ? 2 * NB : 4;
  float part[C];
#pragma unroll
  for (int k = 0; k < 2 * NB; ++k) {
    float& x = s[k >> 1][2 * rr + (k & 1)];
    x = fast_exp2(fmaf(x, mul, -base));
    part[k % C] = k < C ? x : part[k % C] + x;
  }
#pragma unroll
  for (int w = 1; w < C; w *= 2)
#pragma unroll
    for (int k = 0; k + w < C; k += 2 * w) part[k] += part[k + w];
  return part[0];
}

// Masks the scores of one warp's 16 rows x NB*8 keys (accumulator layout),
// scales them into the log2 domain, and runs the online-softmax step:
// s becomes P, m_i / l_i are updated, and each row's rescale factor for o
// is left in alpha (softmax_step below applies it at once; a caller whose o
// is still being written by a product in flight, prefill_f16_wg.cu, applies
// it with rescale_rows once the product is done). Row ra = first row + g,
// rb = ra + 8 (positions in the sequence); keys from c0. Rows at or past L
// (the last tile's padding) are fully hidden: their mask rows do not exist.
// PairedKeys: the accumulator's columns 2t, 2t + 1 of
// each 8-key block hold keys t, t + 4 (K's rows permuted so that P is already
// in the A-operand layout of the P V product: prefill_tf32_wg.cu).
// RowShift, where shift_rows: in row_shift[rr] the power of two e (0 to
// 100) that takes the largest P of the tile's row rr to (1/2, 1], else 0; s
// and l_i as without. P on float16 (the split-query prefill,
// prefill_f16_wg.cu's kQS) takes P 2^e, and o that product's sum 2^-e:
// P in tiles far under the row's maximum would otherwise lose its bits
// below float16's range, and those tiles carry the output where their
// values are that much larger.
template <int NB, bool PairedKeys = false, bool RowShift = false>
__device__ __forceinline__ void softmax_scores(float (&s)[NB][4], float (&alpha)[2], float* m_i, float* l_i,
                                               const Mask& mask, int64_t n, int ra, int L, int S, int c0,
                                               float scale_log2, bool need_mask, int lane,
                                               int* row_shift = nullptr, bool shift_rows = false) {
  const int t = lane & 3;
  if (need_mask) {
    const bool array_mask = mask.is_array();
    int64_t rb_a = 0, rb_b = 0;
    if (array_mask) {
      rb_a = ra < L ? mask.row_base(n, ra) : 0;
      rb_b = ra + 8 < L ? mask.row_base(n, ra + 8) : 0;
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = c0 + nb * 8 + (PairedKeys ? t + 4 * (i & 1) : 2 * t + (i & 1));
        const int r = ra + (i >> 1) * 8;
        float term = 0.0f;
        if (c >= S || r >= L || mask.causal_hides(r, c)) {
          term = FA_NEG_INF;
        } else if (array_mask) {
          term = mask.term(i >> 1 ? rb_b : rb_a, c);
        }
        s[nb][i] = term == FA_NEG_INF ? FA_NEG_INF : s[nb][i] * scale_log2 + term;
      }
    }
  }
  // Unmasked tiles (most of them) keep the raw scores when the scale is
  // positive: the largest raw score times scale * log2(e) is the largest
  // scaled one, and each exponent becomes one fused multiply-add.
  float mul = 1.0f;
  if (!need_mask) {
    if (scale_log2 > 0.0f) {
      mul = scale_log2;
    } else {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nb][i] *= scale_log2;
    }
  }
  // A row's maximum over this thread's 2 NB scores runs in C independent
  // chains, as exp_row's sum.
  constexpr int C = 2 * NB < 4 ? 2 * NB : 4;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float part[C];
#pragma unroll
    for (int k = 0; k < 2 * NB; ++k) {
      const float x = s[k >> 1][2 * rr + (k & 1)];
      part[k % C] = k < C ? x : fmaxf(part[k % C], x);
    }
#pragma unroll
    for (int w = 1; w < C; w *= 2)
#pragma unroll
      for (int k = 0; k + w < C; k += 2 * w) part[k] = fmaxf(part[k], part[k + w]);
    float mx = part[0];
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float m_use;
    alpha[rr] = online_rescale<true>(m_i[rr], mx * mul, m_use);
    if constexpr (RowShift) {
      const float d = m_use - mx * mul;  // the tile's largest P is 2^-d (NaN: no key yet)
      row_shift[rr] = shift_rows && d >= 1.0f ? (d < 100.0f ? int(d) : 100) : 0;
    }
    l_i[rr] = l_i[rr] * alpha[rr] + exp_row(s, rr, mul, m_use);  // this thread's part; the quad sums at the end
  }
}

// softmax_scores against the row's running base instead of the tile's
// maximum, with no maximum taken: the exponents, then each thread's sum of
// its row's P, which bounds every P in it. Where a sum is at most 2^8 (the
// common case: a row's scores seldom rise far above the maximum of the
// tiles before), P goes on as it is, up to 2^8. Elsewhere the warp takes
// the tile's largest P of each row and moves the row's base up by its
// exponent, so that P (and the tile's sum) is scaled by a power of two, at
// most 1 after. Returns true, having changed nothing of the row's state,
// where a P reached 2^64 or was not finite (it may have overflowed): the
// caller computes the tile's scores again and takes softmax_scores. Only for
// unmasked tiles after a row's first (its base finite), and only where P
// reaches P V as it is or in bfloat16 terms (a float16 P scaled by 2^15
// would overflow past 2).
constexpr float kStaleSumMax = 256.0f, kStaleRedoP = 18446744073709551616.0f;  // 2^8, 2^64
template <int NB>
__device__ __forceinline__ bool softmax_scores_stale(float (&s)[NB][4], float (&alpha)[2], float* m_i, float* l_i,
                                                     float scale_log2) {
  const float mul = scale_log2;  // raw scores times scale * log2(e), as the step's unmasked tiles take them
  float sum[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) sum[rr] = exp_row(s, rr, mul, m_i[rr]);
  alpha[0] = alpha[1] = 1.0f;
  if (__any_sync(0xffffffffu, !(sum[0] <= kStaleSumMax && sum[1] <= kStaleSumMax))) {
    float top[2];
    bool redo = false;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      top[rr] = 0.0f;
#pragma unroll
      for (int k = 0; k < 2 * NB; ++k) top[rr] = fmaxf(top[rr], s[k >> 1][2 * rr + (k & 1)]);
      top[rr] = fmaxf(top[rr], __shfl_xor_sync(0xffffffffu, top[rr], 1));
      top[rr] = fmaxf(top[rr], __shfl_xor_sync(0xffffffffu, top[rr], 2));
      redo |= !(top[rr] < kStaleRedoP && sum[rr] < INFINITY);  // fmaxf drops a NaN P; the sum keeps it
    }
    if (__any_sync(0xffffffffu, redo)) return true;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      if (top[rr] > 1.0f) {
        int e;
        frexpf(top[rr], &e);  // top = f 2^e, f in [0.5, 1)
        alpha[rr] = ldexpf(1.0f, -e);
        m_i[rr] += float(e);  // rounded: P after off by up to |m + e| 2^-24 relative, far under 16 bits
        sum[rr] *= alpha[rr];
#pragma unroll
        for (int k = 0; k < 2 * NB; ++k) s[k >> 1][2 * rr + (k & 1)] *= alpha[rr];
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) l_i[rr] = l_i[rr] * alpha[rr] + sum[rr];
  return false;
}

// o's rows (accumulator layout) times their factors. Past the first tiles a
// row's maximum rarely moves (alpha = 1 exactly): the warp skips the rescale
// when none of its rows' did.
template <int NO>
__device__ __forceinline__ void rescale_rows(float (&o)[NO][4], const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int eb = 0; eb < NO; ++eb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[eb][i] *= alpha[i >> 1];
    }
  }
}

// The whole step: softmax_scores, then o (NO accumulator tiles) rescaled.
template <int NB, int NO, bool PairedKeys = false>
__device__ __forceinline__ void softmax_step(float (&s)[NB][4], float (&o)[NO][4], float* m_i,
                                             float* l_i, const Mask& mask, int64_t n, int ra,
                                             int L, int S, int c0, float scale_log2,
                                             bool need_mask, int lane) {
  float alpha[2];
  softmax_scores<NB, PairedKeys>(s, alpha, m_i, l_i, mask, n, ra, L, S, c0, scale_log2, need_mask, lane);
  rescale_rows(o, alpha);
}

}  // namespace fa
