// Shared by every flashattn-core Metal kernel: the launch parameters, the
// masks (additive and causal), the online-softmax step and the split merge. Kernels see row-contiguous arrays:
// queries and output (B x H_q, L, E), keys and values (B x H_kv, S, E).
// Scores are kept in the log2 domain (the scale is multiplied by log2(e)),
// so every exponential is an exp2.

#include <metal_stdlib>
using namespace metal;

namespace fa {

// Param (launch parameter indices) and MaskKind come from params.h, which
// CMake embeds ahead of this file.

constant constexpr float kLog2e = 1.4426950408889634f;

// Every input element is read, and every output element written, through
// these two: the one place a dtype is converted (arithmetic is float32).
template <typename T>
inline float load(const device T* p, int64_t i) {
  return float(p[i]);
}
template <typename T>
inline void store(device T* p, int64_t i, float x) {
  p[i] = T(x);
}

// Where the kernels read key and value rows: an array of T, (B x H_kv x S,
// E) row contiguous, or the same rows quantized in MLX's affine format
// (packed uint32 fields, lowest bits first, and a float32 scale and bias
// per group of elements), dequantized element by element as they are read.
template <typename T>
struct PlainRows {
  const device T* data;
  int E;
  float at(int64_t row, int e) const {
    return load(data, row * E + e);
  }
};

struct QuantizedRows {
  const device uint32_t* words;
  const device float* scales;
  const device float* biases;
  int E, bits, group_size;
  float at(int64_t row, int e) const {
    const int per_word = 32 / bits;
    const uint32_t w = words[row * (E / per_word) + e / per_word];
    const uint32_t q = (w >> uint32_t((e % per_word) * bits)) & ((1u << uint32_t(bits)) - 1u);
    const int64_t g = row * (E / group_size) + e / group_size;
    return scales[g] * float(q) + biases[g];
  }
};

inline float scale_log2(const device int* params) {
  return as_type<float>(params[kScaleLog2]);
}

// The additive mask, in its own row-contiguous shape: base[n_q] is the offset
// of (batch, query head) n_q; the strides are 0 where it broadcasts.
struct Mask {
  const device float* data;
  const device int64_t* base;
  int row_stride;
  int col_stride;

  int64_t row_base(int64_t n_q, int row) const {
    return base[n_q] + int64_t(row) * row_stride;
  }
  // log2-domain term for key c of a row; -inf hides the key.
  float term(int64_t row_base, int c) const {
    const float a = data[row_base + int64_t(c) * col_stride];
    return a == -INFINITY ? -INFINITY : a * kLog2e;
  }
};

inline Mask make_mask(const device float* data, const device int64_t* base, const device int* params) {
  return Mask{data, base, params[kMaskRowStride], params[kMaskColStride]};
}

// The causal rule, bottom-right aligned as MLX defines it: row `row` of L
// queries sees key c of S iff c <= row + S - L; with a sliding window of W
// keys (W > 0), also c > row + S - L - W.
inline bool causal_hides(int row, int c, int L, int S, int W) {
  return c > row + S - L || (W > 0 && c <= row + S - L - W);
}

// Keys [0, end) hold every key that rows below row_end may see.
inline int causal_key_end(int row_end, int L, int S) {
  return min(S, row_end + S - L);
}

// Keys from causal_key_begin(row) on hold every key that rows from `row` on
// may see.
inline int causal_key_begin(int row, int L, int S, int W) {
  return W > 0 ? clamp(row + S - L - W + 1, 0, S) : 0;
}

// Rows [causal_first_row(c), causal_row_end(c)) see key c.
inline int causal_first_row(int c, int L, int S) {
  return max(0, c - (S - L));
}
inline int causal_row_end(int c, int L, int S, int W) {
  return W > 0 ? clamp(c - (S - L) + W, 0, L) : L;
}

// What a row's exponents subtract: its running max m, or 0 while it has seen
// no visible key (m = -inf), so that exp2(-inf - base) is 0, never NaN.
inline float exp_base(float m) { return m == -INFINITY ? 0.0f : m; }

// One step of the online softmax for a row: m_i is the running max, the tile
// brings m_tile (the max of its visible scores, NaN excluded). Returns the
// factor alpha that rescales the row's earlier l_i and o_i, and sets m_use,
// the max the tile's probabilities are taken against (0 while the row has
// seen no visible key, so that exp2(-inf - m_use) stays 0, never NaN).
inline float online_softmax_step(thread float& m_i, float m_tile, thread float& m_use) {
  const float m_new = max(m_i, m_tile);
  m_use = exp_base(m_new);
  const float alpha = exp2(m_i - m_use);
  m_i = m_new;
  return alpha;
}

// 1 / l for a row's output: 0 for a row that saw no visible key (l = 0),
// whose output is zeros, never NaN.
inline float inverse_sum(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }

// An attention sink's share of a row's softmax denominator (MLX's SDPA
// sinks=: one logit per query head that adds no value): 2^(sink log2(e) - m)
// beside the row's l, taken against its exponent base m. A sink of -inf,
// which is what calls without sinks pass, adds nothing.
inline float sink_term(const device float* sinks, int head, float m) {
  const float sink = sinks[head];
  return sink == -INFINITY ? 0.0f : exp2(sink * kLog2e - exp_base(m));
}

// A row's log-sum-exp (log2 domain) from its final m and l and its sink's
// term: +inf for a row that saw no visible key (l = 0), so that every
// P = 2^(s - lse) the backward recomputes for it is 0.
inline float row_lse(float m, float l, float sink) { return l == 0.0f ? INFINITY : exp_base(m) + log2(l + sink); }

// The split merge (FlashDecoding): out = sum_s 2^(m_s - m) o_s / sum_s
// 2^(m_s - m) l_s with m = max_s m_s, over the partials (o_s, m_s, l_s) the
// key splits wrote in slot split x rows + row, and the row's sink once. One
// SIMD group per output row, lanes over the head dim; a row no split saw a
// key of gives zeros.
template <typename T>
void flash_merge(
    const device float* o_part, const device float* ml_part, const device int* params,
    const device float* sinks, device T* out, uint row, uint lane) {
  const int E = params[kE], splits = params[kSplits];
  const int64_t rows = params[kRowsTotal];
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = max(m, ml_part[2 * (s * rows + row)]);
  const float m_use = exp_base(m);
  float l = 0.0f;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // E <= 256
  for (int s = 0; s < splits; ++s) {
    const int64_t slot = s * rows + row;
    const float w = exp2(ml_part[2 * slot] - m_use);
    l += w * ml_part[2 * slot + 1];
    for (int i = 0; i < 8; ++i) {
      const int e = int(lane) + 32 * i;
      if (e < E) acc[i] += w * o_part[slot * E + e];
    }
  }
  const int head = (int(row) / params[kL]) % params[kHeadsQ];
  const float inv = inverse_sum(l + sink_term(sinks, head, m));
  for (int i = 0; i < 8; ++i) {
    const int e = int(lane) + 32 * i;
    if (e < E) store(out, int64_t(row) * E + e, acc[i] * inv);
  }
}

}  // namespace fa
