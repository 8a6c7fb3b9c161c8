// The decode kernel: a work item whose R <= 8 query rows (the query heads of
// one GQA group, a few positions) meet a long range of keys, the case
// mlx-lm runs for every generated token. Memory-bound in principle (each
// key and value row is read once and used by R rows), so the layout is
// chosen to keep the arithmetic below the time it takes to stream K and V:
//
//   S = Q K^T   head-dim-vectorised: each K row is loaded once into
//               registers and meets the R query rows with full-width
//               products; the 8-lane partial sums of 8 keys are then folded
//               into one vector of 8 scores (a transposing reduction).
//   softmax     per row over 8-key vectors, m / l as scalars.
//   O += P V    head-dim-vectorised: each value row is loaded once and meets
//               the R rows' broadcast probabilities; o stays in registers for
//               64 columns at a time (16-lane vectors) when R <= 7, 32 when
//               R = 8.
//
// The row-vectorised layout of attend.h needs a broadcast per multiply-add
// in both products, and broadcast operands run at half rate on some cores
// (Zen 4); here none is needed in S = Q K^T, and in P V one probability
// serves four 16-lane multiply-adds for up to 7 rows (all 32 registers
// hold accumulators and the value row, so it is broadcast from memory inside
// them: on the CI machine one pass over each value row this way beat two
// passes of 32 columns by ~15% at S = 131072). Keys and values stream
// through the caches once: they are asked for into L2 64 KiB ahead, row by
// row as rows are used, which keeps the stream ahead of the 4 KiB-page limit
// of the hardware prefetchers. float16 / bfloat16 rows are converted in
// registers.
//
// Quantized keys and values (both) are dequantized a tile at a time into
// float32 rows the products then read as they would read float32 inputs.
// 4-bit rows go paired: each 32-element block's 16 bytes widen to 16 lanes
// whose low nibbles are the block's even elements and high nibbles its odd
// ones, stored in that order (evens, then odds) with no shuffle; the
// queries take the same order once an item (Q K^T sums over dims in any
// shared order) and o is put back in order at its end (P V keeps each
// column's order). 8-bit rows widen 16 bytes to 16 lanes in order. perf had
// dequantization at a third of the 4-bit decode's samples, its 16-element
// vectors built by broadcasts and blends.
//
// Needs 32 vector registers (AVX-512), E a multiple of 8 up to 256, key and
// value rows contiguous, and no array mask (none or causal); the planner's
// other cases take attend.h.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../causal.h"
#include "../kernels.h"
#include "../problem.h"
#include "../softmax.h"
#include "../tiles.h"
#include "../work.h"
#include "convert.h"
#include "dequantize.h"
#include "exp2.h"

namespace flashattn::cpu::FLASHATTN_ISA {

namespace decode_detail {

constexpr int kMaxE = 256;
// Bytes ahead of the current row that the key and value streams are asked for.
constexpr int64_t kPrefetchBytes = 64 * 1024;

inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// Lane i of the result is the sum of the 8 lanes of vector i (x + i * stride).
// Unpacks and shuffles with adds rather than horizontal adds: the same work
// in fewer micro-ops on some cores (Zen 4).
inline __m256 transpose_sum8(const float* x, int64_t stride) {
  auto at = [&](int i) { return _mm256_load_ps(x + i * stride); };
  // Lanes (0 1 2 3 | 4 5 6 7) of the pair's sums: (a0+a2 b0+b2 a1+a3 b1+b3 | ...)
  auto pair = [&](int i) {
    const __m256 a = at(i), b = at(i + 1);
    return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  };
  // Each 128-bit half: the four vectors' sums over that half.
  auto quad = [](__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
  };
  const __m256 u0 = quad(pair(0), pair(2)), u1 = quad(pair(4), pair(6));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The cache lines of one key or value row, into L2.
inline void prefetch_row(const char* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) {
    _mm_prefetch(row + b, _MM_HINT_T1);
  }
}

// Where the stream of key or value rows is asked for ahead of use.
struct Ahead {
  const char* rows; // the row kPrefetchBytes of rows ahead of the tile's first
  int64_t step; // bytes between rows
  int64_t bytes; // bytes of one row

  void fetch(int c) const {
    prefetch_row(rows + c * step, bytes);
  }
};

} // namespace decode_detail

// T: the queries' and the output's dtype; KV: what the products read K and V
// as (T itself, or float32 rows dequantized from a quantized cache).
template <int R, typename T, typename KV = T>
struct Decode {
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  const AttentionProblem& p;
  WorkPlan& plan;
  const WorkItem& item;
  // Whether keys / values dequantize paired (above): 4 bits, E a multiple
  // of 32, a row's words contiguous.
  const bool k_paired, v_paired;

  static bool pairs(const AttentionProblem& p, const StridedOperand& x, const Quantized& qz) {
    return std::is_same_v<KV, float> && qz.bits == 4 && p.E % 32 == 0 && x.col_stride == 1;
  }

  Decode(const AttentionProblem& p_, WorkPlan& plan_, const WorkItem& item_)
      : p(p_), plan(plan_), item(item_), k_paired(pairs(p_, p_.k, p_.k_quantized)),
        v_paired(pairs(p_, p_.v, p_.v_quantized)) {}

  // Paired position j of a 32-element block holds element paired_element(j).
  static int paired_element(int j) {
    return j < 16 ? 2 * j : 2 * (j - 16) + 1;
  }

  // Keys or values [c0, c0 + cols) of 4- or 8-bit rows into dst: each 16
  // bytes widen to 16 lanes, two 4-bit codes a lane (stored paired, above)
  // or one 8-bit code (in order). Row pointers are stepped, not recomputed
  // (the row's set-up outweighed its two blocks at E = 64).
  template <int Bits, typename Sc>
  void dequantize_widened(const StridedOperand& x, const Quantized& qz, int64_t c0, int cols, float* dst) const {
    constexpr int kPerLoad = Bits == 4 ? 32 : 16;  // elements in 16 bytes
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(static_cast<const uint32_t*>(x.data) + x.base[item.group]);
    const Sc* scales = static_cast<const Sc*>(qz.scales.data) + qz.scales.base[item.group];
    const Sc* biases = static_cast<const Sc*>(qz.biases.data) + qz.biases.base[item.group];
    const int groups = p.E / qz.group_size, loads_per_group = qz.group_size / kPerLoad;
    const int64_t group_stride = qz.scales.col_stride, row_bytes = x.row_stride * 4;
    const int64_t s_stride = qz.scales.row_stride, b_stride = qz.biases.row_stride;
    const __m512i low = _mm512_set1_epi32(15);
    const uint8_t* next_row = bytes + c0 * row_bytes;
    const Sc* s = scales + c0 * s_stride;
    const Sc* b = biases + c0 * b_stride;
    float* d = dst;
    for (int c = 0; c < cols; ++c, next_row += row_bytes, s += s_stride, b += b_stride) {
      const uint8_t* row = next_row;
      for (int g = 0; g < groups; ++g) {
        const __m512 scale = _mm512_set1_ps(to_float(s[g * group_stride]));
        const __m512 bias = _mm512_set1_ps(to_float(b[g * group_stride]));
        for (int i = 0; i < loads_per_group; ++i, row += 16, d += kPerLoad) {
          const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
          if constexpr (Bits == 4) {
            const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(w, low));
            const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
            _mm512_store_ps(d, _mm512_fmadd_ps(even, scale, bias));
            _mm512_store_ps(d + 16, _mm512_fmadd_ps(odd, scale, bias));
          } else {
            _mm512_store_ps(d, _mm512_fmadd_ps(_mm512_cvtepi32_ps(w), scale, bias));
          }
        }
      }
    }
  }

  // A quantized tile's keys or values into kv_tile: 4-bit rows paired
  // (above), 8-bit rows byte by byte, others by dequantize.h.
  void dequantize_tile(const StridedOperand& x, const Quantized& qz, bool paired, int64_t c0, int cols) {
    const bool bytes = qz.bits == 8 && p.E % 16 == 0 && x.col_stride == 1;
    if (!paired && !bytes) {
      return dequantize_rows(x, qz, item.group, c0, cols, p.E, kv_tile);
    }
    auto run = [&](auto scale_type) {
      using Sc = decltype(scale_type);
      if (paired) {
        dequantize_widened<4, Sc>(x, qz, c0, cols, kv_tile);
      } else {
        dequantize_widened<8, Sc>(x, qz, c0, cols, kv_tile);
      }
    };
    if (qz.dtype == mx::float32) {
      run(float{});
    } else if (qz.dtype == mx::float16) {
      run(mx::float16_t{});
    } else {
      run(mx::bfloat16_t{});
    }
  }

  // A row of E elements from natural into paired order (to) or back.
  void reorder(float* row, bool to_paired) const {
    alignas(64) float block[32];
    for (int e0 = 0; e0 < p.E; e0 += 32) {
      for (int j = 0; j < 32; ++j) {
        if (to_paired) {
          block[j] = row[e0 + paired_element(j)];
        } else {
          block[paired_element(j)] = row[e0 + j];
        }
      }
      std::copy(block, block + 32, row + e0);
    }
  }

  alignas(64) float q[R][decode_detail::kMaxE]; // scaled by scale * log2(e)
  alignas(64) float o[R][decode_detail::kMaxE];
  alignas(64) float partial[Bc][R][8]; // Q K^T partial sums per (key, row)
  alignas(64) float prob[R][Bc]; // scores, then P
  float m_i[R], l_i[R];
  int64_t out_off[R], limit[R]; // limit: the last key the causal mask shows
  // A quantized tile's keys, then its values, dequantized (rows of E floats)
  // just before the products read them. Untouched for plain inputs.
  alignas(64) float kv_tile[Bc * decode_detail::kMaxE];

  void load_rows() {
    const int ratio = p.q_kv_heads_ratio;
    const int64_t b = item.group / p.H_kv, g = item.group % p.H_kv;
    const int first = item.row_tile * plan.RB;
    const float q_scale = p.scale * kLog2e;
    const T* qp = static_cast<const T*>(p.q.data);
    for (int r = 0; r < R; ++r) {
      int64_t l = (first + r) / ratio;
      int64_t n = b * p.H_q + g * ratio + (first + r) % ratio;
      const T* row = qp + p.q.base[n] + l * p.q.row_stride;
      for (int e = 0; e < p.E; ++e) {
        q[r][e] = to_float(row[e * p.q.col_stride]) * q_scale;
      }
      if (k_paired) {
        reorder(q[r], true);
      }
      out_off[r] = (n * p.L + l) * p.E;
      limit[r] = p.causal().last_key(l);
      m_i[r] = kNegInf;
      l_i[r] = 0.0f;
      for (int e = 0; e < p.E; ++e) {
        o[r][e] = 0.0f;
      }
    }
  }

  // 8 elements of a key or value row as float32, converted in registers.
  template <typename U>
  static __m256 load8(const U* x) {
    if constexpr (std::is_same_v<U, float>) {
      return _mm256_loadu_ps(x);
    } else if constexpr (std::is_same_v<U, mx::float16_t>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    } else { // bfloat16 is the top half of a float32
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
  }

  template <typename U>
  static __m512 load16(const U* x) {
    if constexpr (std::is_same_v<U, float>) {
      return _mm512_loadu_ps(x);
    } else if constexpr (std::is_same_v<U, mx::float16_t>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    } else {
      const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
  }

  // Rows c0.. of K or V, read in place.
  const KV* rows_at(const StridedOperand& x, int64_t c0) const {
    return static_cast<const KV*>(x.data) + x.base[item.group] + c0 * x.row_stride;
  }

  // partial[c][r] = the 8-lane partial sums of q_r . K_c.
  template <int EV>
  void qk(const KV* K, int64_t ks, const decode_detail::Ahead& ahead, int cols) {
    for (int c = 0; c < cols; ++c) {
      const KV* k_row = K + c * ks;
      ahead.fetch(c);
      __m256 k[EV];
      for (int j = 0; j < EV; ++j) {
        k[j] = load8(k_row + 8 * j);
      }
      for (int r = 0; r < R; ++r) {
        __m256 a0 = _mm256_mul_ps(k[0], _mm256_load_ps(q[r]));
        __m256 a1 = _mm256_setzero_ps();
        for (int j = 1; j < EV; ++j) {
          __m256 t = _mm256_load_ps(q[r] + 8 * j);
          if (j & 1) {
            a1 = _mm256_fmadd_ps(k[j], t, a1);
          } else {
            a0 = _mm256_fmadd_ps(k[j], t, a0);
          }
        }
        _mm256_store_ps(partial[c][r], _mm256_add_ps(a0, a1));
      }
    }
  }

  void qk_any(const KV* K, int64_t ks, const decode_detail::Ahead& ahead, int cols) {
    switch (p.E / 8) {
#define FLASHATTN_QK_CASE(n) \
  case n:                    \
    return qk<n>(K, ks, ahead, cols);
      FLASHATTN_QK_CASE(1) FLASHATTN_QK_CASE(2) FLASHATTN_QK_CASE(3) FLASHATTN_QK_CASE(4)
      FLASHATTN_QK_CASE(5) FLASHATTN_QK_CASE(6) FLASHATTN_QK_CASE(7) FLASHATTN_QK_CASE(8)
      FLASHATTN_QK_CASE(9) FLASHATTN_QK_CASE(10) FLASHATTN_QK_CASE(11) FLASHATTN_QK_CASE(12)
      FLASHATTN_QK_CASE(13) FLASHATTN_QK_CASE(14) FLASHATTN_QK_CASE(15) FLASHATTN_QK_CASE(16)
#undef FLASHATTN_QK_CASE
      default: { // E in (128, 256]: K rows too long for registers, read as used
        for (int c = 0; c < cols; ++c) {
          const KV* k_row = K + c * ks;
          ahead.fetch(c);
          for (int r = 0; r < R; ++r) {
            __m256 a = _mm256_setzero_ps();
            for (int e = 0; e < p.E; e += 8) {
              a = _mm256_fmadd_ps(load8(k_row + e), _mm256_load_ps(q[r] + e), a);
            }
            _mm256_store_ps(partial[c][r], a);
          }
        }
      }
    }
  }

  // Scores -> P for every row, with the online-softmax rescale of o.
  // Returns per row the number of visible keys (causal partial tiles).
  // Two passes over the rows: scores and maxima of all rows, then P; the
  // rows' rescale factors come from one vector exp2 in between, and no row's
  // chain of dependent steps waits for the row before it.
  void softmax(int64_t c0, int cols, bool partial_tile, int* visible) {
    const int groups = ceil_div(cols, 8);
    alignas(32) float m_old[8], m_use[8];
    for (int r = 0; r < 8; ++r) {
      m_old[r] = m_use[r] = 0.0f;
    }
    for (int r = 0; r < R; ++r) {
      float* pr = prob[r];
      int vis = cols;
      if (partial_tile) {
        vis = int(std::clamp<int64_t>(limit[r] - c0 + 1, 0, cols));
      }
      visible[r] = vis;
      // Keys past cols (a last, partial group) sum stale lanes: hidden here.
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 neg_inf = _mm256_set1_ps(kNegInf);
      __m256 mx = neg_inf;
      for (int g = 0; g < groups; ++g) {
        __m256 sc = decode_detail::transpose_sum8(partial[8 * g][r], R * 8);
        if (8 * g + 8 > vis) {
          const __m256i shown = _mm256_cmpgt_epi32(_mm256_set1_epi32(vis - 8 * g), lane);
          sc = _mm256_blendv_ps(neg_inf, sc, _mm256_castsi256_ps(shown));
        }
        _mm256_store_ps(pr + 8 * g, sc);
        // max(sc, mx) is mx where sc is NaN: a NaN score is kept out of the
        // maximum (its exp2 carries it).
        mx = _mm256_max_ps(sc, mx);
      }
      const float m_new = std::max(m_i[r], decode_detail::hmax8(mx));
      m_old[r] = m_i[r];
      m_use[r] = softmax_base(m_new);
      m_i[r] = m_new;
    }
    // alpha_r = 2^(m_old - m_new): 1 when the maximum stayed, 0 from -inf.
    alignas(32) float alpha[8];
    Simd<8>::store(alpha, exp2<8>(Simd<8>::load(m_old) - Simd<8>::load(m_use)));
    for (int r = 0; r < R; ++r) {
      float* pr = prob[r];
      __m256 sum = _mm256_setzero_ps();
      const auto m_vec = Simd<8>::splat(m_use[r]);
      for (int g = 0; g < groups; ++g) {
        auto pv = exp2<8>(Simd<8>::load(pr + 8 * g) - m_vec);
        Simd<8>::store(pr + 8 * g, pv);
        __m256 pm;
        __builtin_memcpy(&pm, &pv, sizeof(pm));
        sum = _mm256_add_ps(sum, pm);
      }
      l_i[r] = l_i[r] * alpha[r] + decode_detail::hsum8(sum);
      if (alpha[r] != 1.0f) {
        const __m256 a = _mm256_set1_ps(alpha[r]);
        for (int e = 0; e < p.E; e += 8) {
          _mm256_store_ps(o[r] + e, _mm256_mul_ps(a, _mm256_load_ps(o[r] + e)));
        }
      }
    }
  }

  // o_r[e0, e0 + 16 NV) += P_r V over every key of the tile: NV 16-lane
  // vectors of every row's o stay in registers while the value rows stream.
  template <int NV>
  void pv_block(const KV* V, int64_t vs, int e0, const decode_detail::Ahead* ahead, int cols) {
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NV; ++j) {
        acc[r][j] = _mm512_load_ps(o[r] + e0 + 16 * j);
      }
    }
    for (int c = 0; c < cols; ++c) {
      if (ahead) {
        ahead->fetch(c);
      }
      const KV* v_row = V + c * vs + e0;
      __m512 v[NV];
      for (int j = 0; j < NV; ++j) {
        v[j] = load16(v_row + 16 * j);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 b = _mm512_set1_ps(prob[r][c]);
        for (int j = 0; j < NV; ++j) {
          acc[r][j] = _mm512_fmadd_ps(b, v[j], acc[r][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NV; ++j) {
        _mm512_store_ps(o[r] + e0 + 16 * j, acc[r][j]);
      }
    }
  }

  void pv(const KV* V, int64_t vs, const decode_detail::Ahead& ahead, int cols) {
    int e0 = 0;
    if constexpr (R <= 7) {
      // 64 columns of up to 7 rows in 28 accumulators, the value row in 4:
      // all 32 vector registers, each probability broadcast from memory
      // inside its multiply-add, once per key instead of once per 32 columns.
      for (; e0 + 64 <= p.E; e0 += 64) {
        pv_block<4>(V, vs, e0, e0 == 0 ? &ahead : nullptr, cols);
      }
    }
    for (; e0 + 32 <= p.E; e0 += 32) {
      pv_block<2>(V, vs, e0, e0 == 0 ? &ahead : nullptr, cols);
    }
    if (e0 + 16 <= p.E) {
      pv_block<1>(V, vs, e0, e0 == 0 ? &ahead : nullptr, cols);
      e0 += 16;
    }
    if (e0 < p.E) { // the last 8 columns (E % 16 == 8)
      __m256 acc[R];
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_load_ps(o[r] + e0);
      }
      for (int c = 0; c < cols; ++c) {
        if (e0 == 0) {
          ahead.fetch(c);
        }
        const __m256 v0 = load8(V + c * vs + e0);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(prob[r] + c), v0, acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(o[r] + e0, acc[r]);
      }
    }
  }

  // A causal tile that hides some keys from some rows: each row takes only
  // the keys it sees, so a hidden value (NaN or Inf included) never reaches
  // it (0 x NaN would).
  void pv_visible(const KV* V, int64_t vs, const int* visible) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < visible[r]; ++c) {
        const __m256 b = _mm256_broadcast_ss(prob[r] + c);
        for (int e = 0; e < p.E; e += 8) {
          _mm256_store_ps(
              o[r] + e, _mm256_fmadd_ps(b, load8(V + c * vs + e), _mm256_load_ps(o[r] + e)));
        }
      }
    }
  }

  void run() {
    load_rows();
    const CausalRule causal = p.causal();
    const int first = item.row_tile * plan.RB;
    const int64_t l_first = first / p.q_kv_heads_ratio;
    const int64_t l_last = (first + R - 1) / p.q_kv_heads_ratio;
    const bool quantized = p.quantized();
    const int64_t row_bytes = p.E * int64_t(sizeof(KV));
    const int64_t ahead_rows = decode_detail::kPrefetchBytes / row_bytes;
    auto ahead_of = [&](const StridedOperand& x, int64_t c0) {
      if (quantized) {  // the tiles are in L1; the packed stream is short
        return decode_detail::Ahead{nullptr, 0, 0};
      }
      const int64_t step = x.row_stride * int64_t(sizeof(KV));
      const char* base = static_cast<const char*>(x.data) + x.base[item.group] * int64_t(sizeof(KV));
      return decode_detail::Ahead{base + (c0 + ahead_rows) * step, step, row_bytes};
    };
    int visible[R];
    for (int64_t c0 = item.key_begin; c0 < item.key_end; c0 += Bc) {
      const int cols = int(std::min<int64_t>(Bc, item.key_end - c0));
      auto visibility = p.mask_kind == MaskKind::causal
          ? causal.visibility(l_first, l_last, c0, c0 + cols)
          : TileVisibility::visible;
      if (visibility == TileVisibility::hidden) {
        continue;
      }
      const KV* K;
      const KV* V;
      int64_t ks, vs;
      if (quantized) {
        if constexpr (std::is_same_v<KV, float>) {
          dequantize_tile(p.k, p.k_quantized, k_paired, c0, cols);
        }
        K = reinterpret_cast<const KV*>(kv_tile), V = K;
        ks = vs = p.E;
      } else {
        K = rows_at(p.k, c0), V = rows_at(p.v, c0);
        ks = p.k.row_stride, vs = p.v.row_stride;
      }
      qk_any(K, ks, ahead_of(p.k, c0), cols);
      const bool partial_tile = visibility == TileVisibility::partial;
      softmax(c0, cols, partial_tile, visible);
      if constexpr (std::is_same_v<KV, float>) {
        if (quantized) {  // the keys are done with: the values into their tile
          dequantize_tile(p.v, p.v_quantized, v_paired, c0, cols);
        }
      }
      if (partial_tile) {
        pv_visible(V, vs, visible);
      } else {
        pv(V, vs, ahead_of(p.v, c0), cols);
      }
    }
    if (v_paired) {  // o's columns back in order
      for (int r = 0; r < R; ++r) {
        reorder(o[r], false);
      }
    }
    if (plan.splits > 1) {
      store_partial();
    } else {
      store_output();
    }
  }

  void store_output() {
    for (int r = 0; r < R; ++r) {
      store_output_row<T>(p, out_off[r], o[r], 1, m_i[r], l_i[r], p.lse ? p.lse + out_off[r] / p.E : nullptr);
    }
  }

  // Rows R..RB of the plan's row tile are padding: empty states.
  void store_partial() {
    const Partial dst = plan.partial(item);
    for (int r = 0; r < plan.RB; ++r) {
      dst.m(r) = r < R ? m_i[r] : kNegInf;
      dst.l(r) = r < R ? l_i[r] : 0.0f;
      for (int e = 0; e < p.E; ++e) {
        dst.o(e, r) = r < R ? o[r][e] : 0.0f;
      }
    }
  }
};

template <int R, typename T>
void decode_rows_of(const AttentionProblem& p, WorkPlan& plan, const WorkItem& item) {
  if (p.quantized()) {
    Decode<R, T, float>(p, plan, item).run();
  } else {
    Decode<R, T>(p, plan, item).run();
  }
}

template <int R>
void decode_rows(const AttentionProblem& p, WorkPlan& plan, const WorkItem& item) {
  if (p.dtype == mx::float32) {
    decode_rows_of<R, float>(p, plan, item);
  } else if (p.dtype == mx::float16) {
    decode_rows_of<R, mx::float16_t>(p, plan, item);
  } else {
    decode_rows_of<R, mx::bfloat16_t>(p, plan, item);
  }
}

// Per-thread scratch is not needed: a Decode holds its state (~34 KiB) itself.
inline void decode_item(const AttentionProblem& p, WorkPlan& plan, const WorkItem& item, void*) {
  switch (plan.rows_per_group) {
    case 1: return decode_rows<1>(p, plan, item);
    case 2: return decode_rows<2>(p, plan, item);
    case 3: return decode_rows<3>(p, plan, item);
    case 4: return decode_rows<4>(p, plan, item);
    case 5: return decode_rows<5>(p, plan, item);
    case 6: return decode_rows<6>(p, plan, item);
    case 7: return decode_rows<7>(p, plan, item);
    default: return decode_rows<8>(p, plan, item);
  }
}

} // namespace flashattn::cpu::FLASHATTN_ISA
