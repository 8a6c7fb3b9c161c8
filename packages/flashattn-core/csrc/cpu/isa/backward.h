// The FlashAttention-2 backward (Algorithm 2) on the CPU, one instruction set.
//
// With s = scale Q K^T + mask over visible keys, P = exp(s - lse) recomputed
// tile by tile from the forward's log-sum-exp, and D = rowsum(dO * O):
//   dV = P^T dO     dP = dO V^T     dS = P * (dP - D)
//   dK = scale dS^T Q               dQ = scale dS K
// Every output element has one writer and no thread waits on another. Where
// there are enough KV heads (batch x H_kv) to keep every thread busy, one
// work item a KV head makes all three gradients of its group:
//   group      (one work item per KV head): query rows in blocks of Br,
//              outer, key tiles inner; dQ_i is done when its row block is,
//              dK and dV accumulate over the whole walk in float32 (the
//              outputs themselves where they are float32 rows of Ep, else
//              a buffer of 2 S x Ep floats the item holds): five matrix
//              products a tile pair.
// Otherwise two passes split the work finer:
//   key pass   (one work item per KV head and key tile of Bc keys): dK_j and
//              dV_j accumulate over every query row of the GQA group that
//              sees the tile, rows in blocks of Br;
//   query pass (one work item per query head and block of Br rows): dQ_i
//              accumulates over the key tiles the rows see.
// The query pass recomputes S, P and dP: seven matrix products a tile pair
// instead of five, for no atomics and no per-thread copies of dQ.
//
// Every product is C += A B with B's rows contiguous (gemm_acc): S = Q K^T
// and dP = dO V^T read K and V transposed (E x Bc), dV += P^T dO and dK +=
// dS^T Q read P and dS as they are, broadcasting A's elements in transposed
// order. Tiles are float32, the head dim padded to Ep (a multiple of the
// vector width) with zeros, so padding adds nothing.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>

#include "../backward.h"
#include "../causal.h"
#include "../tiles.h"
#include "convert.h"
#include "exp2.h"
#include "simd.h"

namespace flashattn::cpu::FLASHATTN_ISA {

namespace backward_detail {

// C[M x N] += A[M x K] B[K x N], N a multiple of W. MR rows of C and NR
// vectors of a row stay in registers while k runs. A's element (i, k) lies
// at A[i lda + k], or with kTransA at A[k lda + i] (A stored transposed:
// its elements are broadcast one at a time, so either layout reads alike).
template <int W, int MR, int NR, bool kTransA, bool kSet>
inline void gemm_block(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int K) {
  using S = Simd<W>;
  using vf = typename S::vf;
  const int si = kTransA ? 1 : lda, sk = kTransA ? lda : 1;
  vf acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      acc[i][j] = kSet ? S::splat(0.0f) : S::load(C + i * ldc + j * W);
    }
  }
  for (int k = 0; k < K; ++k) {
    vf b[NR];
    for (int j = 0; j < NR; ++j) {
      b[j] = S::load(B + int64_t(k) * ldb + j * W);
    }
    for (int i = 0; i < MR; ++i) {
      const vf a = S::splat(A[i * si + k * sk]);
      for (int j = 0; j < NR; ++j) {
        acc[i][j] += a * b[j];
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      S::store(C + i * ldc + j * W, acc[i][j]);
    }
  }
}

template <int W, int MR, int NR, bool kTransA, bool kSet>
inline void gemm_rows(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int K, int N) {
  int j = 0;
  for (; j + NR * W <= N; j += NR * W) {
    gemm_block<W, MR, NR, kTransA, kSet>(A, lda, B + j, ldb, C + j, ldc, K);
  }
  for (; j < N; j += W) {
    gemm_block<W, MR, 1, kTransA, kSet>(A, lda, B + j, ldb, C + j, ldc, K);
  }
}

template <int W, int MR, int NR, bool kTransA = false, bool kSet = false>
inline void gemm_acc(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M, int K, int N) {
  const int si = kTransA ? 1 : lda;  // A's step from one row of C to the next
  int i = 0;
  for (; i + MR <= M; i += MR) {
    gemm_rows<W, MR, NR, kTransA, kSet>(A + i * si, lda, B, ldb, C + i * ldc, ldc, K, N);
  }
  for (; i < M; ++i) {
    gemm_rows<W, 1, NR, kTransA, kSet>(A + i * si, lda, B, ldb, C + i * ldc, ldc, K, N);
  }
}

// gemm_acc for a B that holds a value that is not finite: A's zeros
// skipped, so that a value a row (or key) cannot see never meets its zero
// weight (0 x inf is NaN). Rare: no register blocking.
template <int W, bool kTransA = false>
inline void gemm_acc_skipping_zeros(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M, int K,
                                    int N) {
  using S = Simd<W>;
  const int si = kTransA ? 1 : lda, sk = kTransA ? lda : 1;
  for (int i = 0; i < M; ++i) {
    for (int k = 0; k < K; ++k) {
      const float a = A[i * si + k * sk];
      if (a == 0.0f) continue;
      const auto av = S::splat(a);
      for (int j = 0; j < N; j += W) {
        S::store(C + i * ldc + j, S::load(C + i * ldc + j) + av * S::load(B + int64_t(k) * ldb + j));
      }
    }
  }
}

// C += A B, by gemm_acc where B is all finite (b_finite), else skipping A's zeros.
template <int W, int MR, int NR, bool kTransA = false>
inline void gemm_acc_guarded(bool b_finite, const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M,
                             int K, int N) {
  if (b_finite) {
    gemm_acc<W, MR, NR, kTransA>(A, lda, B, ldb, C, ldc, M, K, N);
  } else {
    gemm_acc_skipping_zeros<W, kTransA>(A, lda, B, ldb, C, ldc, M, K, N);
  }
}

// C[M x N] = A B (C's old contents not read).
template <int W, int MR, int NR>
inline void gemm_set(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M, int K, int N) {
  gemm_acc<W, MR, NR, false, true>(A, lda, B, ldb, C, ldc, M, K, N);
}

} // namespace backward_detail

template <typename Cfg, typename T>
struct Backward {
  static constexpr int W = Cfg::W;
  // Register blocks of C: MR rows x NR vectors (AVX-512 has 32 registers,
  // AVX2 and SSE2 16).
  static constexpr int MR = 4, NR = W >= 16 ? 4 : 2;
  static constexpr int Br = kBackwardRows;
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  using S = Simd<W>;

  const BackwardProblem& bp;
  const AttentionProblem& p;
  BackwardScratch s;
  int Ep;

  Backward(const BackwardProblem& bp_, void* scratch)
      : bp(bp_), p(bp_.fwd), s(scratch, bp_.fwd.E, W), Ep(round_up(bp_.fwd.E, W)) {}

  // Whether the rows x Ep floats at x are all finite.
  bool all_finite(const float* x, int rows) const {
    bool finite = true;
    for (int64_t i = 0; i < int64_t(rows) * Ep; ++i) finite &= std::isfinite(x[i]);
    return finite;
  }

  // rows x E of a strided (B..., H, rows, E) operand into dst (rows x Ep),
  // float32, head-dim padding zeroed; whether they are all finite.
  template <typename U>
  bool load_rows(const StridedOperand& x, int64_t n, int64_t row0, int rows, float* dst) {
    const U* src = static_cast<const U*>(x.data) + x.base[n];
    for (int r = 0; r < rows; ++r) {
      const U* row = src + (row0 + r) * x.row_stride;
      float* d = dst + r * Ep;
      for (int e = 0; e < p.E; ++e) {
        d[e] = to_float(row[e * x.col_stride]);
      }
      for (int e = p.E; e < Ep; ++e) {
        d[e] = 0.0f;
      }
    }
    return all_finite(dst, rows);
  }

  // Row-contiguous (rows of E) into dst (rows x Ep); whether all finite.
  template <typename U>
  bool load_contiguous(const U* src, int rows, float* dst) {
    for (int r = 0; r < rows; ++r) {
      for (int e = 0; e < p.E; ++e) {
        dst[r * Ep + e] = to_float(src[int64_t(r) * p.E + e]);
      }
      for (int e = p.E; e < Ep; ++e) {
        dst[r * Ep + e] = 0.0f;
      }
    }
    return all_finite(dst, rows);
  }

  // K_j (Bc x Ep, rows past cols zeroed) and its transpose (Ep x Bc, row
  // stride ldt); whether K_j is all finite.
  bool load_key_tile(const StridedOperand& x, int64_t g, int64_t c0, int cols, float* rows, float* t,
                     int ldt = Bc) {
    const bool finite = load_rows<T>(x, g, c0, cols, rows);
    std::fill(rows + int64_t(cols) * Ep, rows + int64_t(Bc) * Ep, 0.0f);
    for (int c = 0; c < Bc; ++c) {
      for (int e = 0; e < Ep; ++e) {
        t[int64_t(e) * ldt + c] = rows[c * Ep + e];
      }
    }
    return finite;
  }

  // The query rows [l0, l0 + rows) of head slice n: Q, dO, lse and D, and
  // whether Q's and dO's are all finite (q_finite, do_finite).
  bool q_finite = true, do_finite = true;
  void load_query_block(int64_t n, int64_t l0, int rows) {
    q_finite = load_rows<T>(p.q, n, l0, rows, s.Q);
    const int64_t first = n * p.L + l0;
    do_finite = load_contiguous(static_cast<const T*>(bp.d_out) + first * p.E, rows, s.dO);
    for (int r = 0; r < rows; ++r) {
      s.lse[r] = bp.lse[first + r];
      s.D[r] = bp.D[first + r];
    }
  }

  // P (Br x Bc) of rows [l0, l0 + rows) of head slice n against keys
  // [c0, c0 + cols), and dS (Br x Bc) from dP = dO V^T. K_t and V_t hold
  // the key tile transposed (E rows of stride ldt, zeros past cols). Hidden
  // keys, padding rows and columns get P = dS = 0 exactly (a select, not a
  // product, so a NaN there stays out).
  void probabilities_and_dS(int64_t n, int64_t l0, int rows, int64_t c0, int cols, const float* K_t,
                            const float* V_t, int ldt) {
    using namespace backward_detail;
    gemm_set<W, MR, NR>(s.Q, Ep, K_t, ldt, s.P, Bc, rows, p.E, Bc);
    gemm_set<W, MR, NR>(s.dO, Ep, V_t, ldt, s.dS, Bc, rows, p.E, Bc);
    const float qk_scale = p.scale * kLog2e;
    const CausalRule causal = p.causal();
    for (int r = 0; r < rows; ++r) { // padding rows are never read: the products sum over rows
      float* P = s.P + r * Bc;
      float* dS = s.dS + r * Bc;
      const int64_t l = l0 + r;
      // Keys [begin, visible) of the tile are the row's (a window hides the
      // keys before begin).
      int begin = 0, visible = cols;
      if (p.mask_kind == MaskKind::causal) {
        begin = int(std::clamp<int64_t>(causal.key_begin(l, p.S) - c0, 0, cols));
        visible = int(std::clamp<int64_t>(causal.key_end(l, p.S) - c0, 0, cols));
      }
      for (int c = 0; c < Bc; ++c) {
        P[c] = c >= begin && c < visible ? P[c] * qk_scale : kNegInf;
      }
      if (p.mask_kind == MaskKind::boolean) {
        apply_array_mask<bool>(n, l, c0, visible, P);
      } else if (p.mask_kind == MaskKind::additive) {
        if (p.mask_dtype == mx::float32) {
          apply_array_mask<float>(n, l, c0, visible, P);
        } else if (p.mask_dtype == mx::float16) {
          apply_array_mask<mx::float16_t>(n, l, c0, visible, P);
        } else {
          apply_array_mask<mx::bfloat16_t>(n, l, c0, visible, P);
        }
      }
      const auto lse = S::splat(s.lse[r]);
      const auto D = S::splat(s.D[r]);
      const auto neg_inf = S::splat(kNegInf);
      for (int c = 0; c < Bc; c += W) {
        const auto x = S::load(P + c);
        const auto hidden = x == neg_inf;
        const auto prob = S::select(hidden, S::splat(0.0f), exp2<W>(x - lse));
        S::store(P + c, prob);
        S::store(dS + c, S::select(hidden, S::splat(0.0f), prob * (S::load(dS + c) - D)));
      }
    }
  }

  template <typename M>
  void apply_array_mask(int64_t n, int64_t l, int64_t c0, int cols, float* P) {
    const M* m = static_cast<const M*>(p.mask.data) + p.mask.base[n] + l * p.mask.row_stride +
        c0 * p.mask.col_stride;
    for (int c = 0; c < cols; ++c) {
      const M value = m[c * p.mask.col_stride];
      if constexpr (std::is_same_v<M, bool>) {
        if (!value) P[c] = kNegInf;
      } else {
        const float add = to_float(value);
        P[c] = add == kNegInf ? kNegInf : P[c] + add * kLog2e;
      }
    }
  }

  template <typename U>
  void store_rows(const float* src, float factor, int rows, U* dst) {
    for (int r = 0; r < rows; ++r) {
      for (int e = 0; e < p.E; ++e) {
        dst[int64_t(r) * p.E + e] = static_cast<U>(src[r * Ep + e] * factor);
      }
    }
  }

  // dK_j and dV_j of KV head slice g, keys [c0, c0 + cols).
  void key_item(int64_t g, int64_t c0, int cols) {
    using namespace backward_detail;
    load_key_tile(p.k, g, c0, cols, s.K, s.K_t);
    load_key_tile(p.v, g, c0, cols, s.V, s.V_t);
    std::fill(s.dK, s.dK + int64_t(Bc) * Ep, 0.0f);
    std::fill(s.dV, s.dV + int64_t(Bc) * Ep, 0.0f);
    const int ratio = p.q_kv_heads_ratio;
    const int64_t b = g / p.H_kv, kv_head = g % p.H_kv;
    // Causal: the rows that see any key of the tile.
    const bool causal = p.mask_kind == MaskKind::causal;
    const int64_t l_begin = causal ? p.causal().first_row(c0, p.L) : 0;
    const int64_t l_end = causal ? p.causal().row_end(c0 + cols - 1, p.L) : p.L;
    for (int hh = 0; hh < ratio; ++hh) {
      const int64_t n = b * p.H_q + kv_head * ratio + hh;
      for (int64_t l0 = l_begin; l0 < l_end; l0 += Br) {
        const int rows = int(std::min<int64_t>(Br, l_end - l0));
        load_query_block(n, l0, rows);
        probabilities_and_dS(n, l0, rows, c0, cols, s.K_t, s.V_t, Bc);
        // dV_j += P^T dO_i, dK_j += dS^T Q_i (P and dS read transposed).
        gemm_acc_guarded<W, MR, NR, true>(do_finite, s.P, Bc, s.dO, Ep, s.dV, Ep, cols, rows, Ep);
        gemm_acc_guarded<W, MR, NR, true>(q_finite, s.dS, Bc, s.Q, Ep, s.dK, Ep, cols, rows, Ep);
      }
    }
    const int64_t first = (g * p.S + c0) * p.E;
    store_rows(s.dK, p.scale, cols, static_cast<T*>(bp.dk) + first);
    store_rows(s.dV, 1.0f, cols, static_cast<T*>(bp.dv) + first);
  }

  // The row stride of the head's K^T and V^T: S rounded up to whole tiles,
  // plus one cache line, so that the E rows a tile reads (a power of two
  // apart otherwise) do not all fall in the same cache sets.
  static int transposed_stride(int S) { return round_up(S, Bc) + 16; }

  // Floats group_item needs beside the scratch: the head's K rows (Sp x
  // Ep, Sp = S rounded up to whole tiles), K^T and V^T (Ep rows of
  // transposed_stride); and dK and dV accumulators (S x Ep each) unless they
  // are the outputs themselves.
  static int64_t group_floats(const AttentionProblem& p, int Ep, bool direct) {
    const int64_t Sp = round_up(p.S, Bc), ld = transposed_stride(p.S);
    return Sp * Ep + 2 * ld * Ep + (direct ? 0 : 2 * int64_t(p.S) * Ep);
  }

  // dQ, dK and dV of KV head slice g (the group item above). buffer:
  // group_floats() floats, zeros. direct: dK and dV accumulate in the
  // outputs (float32 rows of Ep = E, zeros).
  void group_item(int64_t g, float* buffer, bool direct) {
    using namespace backward_detail;
    const int Sp = int(round_up(p.S, Bc)), ld = transposed_stride(p.S);
    float* K = buffer;                   // Sp x Ep
    float* K_t = K + int64_t(Sp) * Ep;   // Ep x ld
    float* V_t = K_t + int64_t(ld) * Ep;  // Ep x ld
    float* dk_acc = V_t + int64_t(ld) * Ep;
    float* dv_acc = dk_acc + int64_t(p.S) * Ep;
    if (direct) {
      dk_acc = static_cast<float*>(bp.dk) + g * p.S * p.E;
      dv_acc = static_cast<float*>(bp.dv) + g * p.S * p.E;
    }
    // The head's keys and values once, transposed for S = Q K^T and dP = dO
    // V^T; whether its keys are all finite (else dQ's products skip zeros).
    bool k_finite = true;
    for (int64_t c0 = 0; c0 < p.S; c0 += Bc) {
      const int cols = int(std::min<int64_t>(Bc, p.S - c0));
      k_finite &= load_key_tile(p.k, g, c0, cols, K + c0 * Ep, K_t + c0, ld);
      load_key_tile(p.v, g, c0, cols, s.V, V_t + c0, ld);
    }
    const int ratio = p.q_kv_heads_ratio;
    const int64_t b = g / p.H_kv, kv_head = g % p.H_kv;
    const bool causal = p.mask_kind == MaskKind::causal;
    for (int hh = 0; hh < ratio; ++hh) {
      const int64_t n = b * p.H_q + kv_head * ratio + hh;
      for (int64_t l0 = 0; l0 < p.L; l0 += Br) {
        const int rows = int(std::min<int64_t>(Br, p.L - l0));
        int64_t key_begin = 0, key_end = p.S;
        if (causal) {
          key_begin = p.causal().key_begin(l0, p.S);
          key_end = p.causal().key_end(l0 + rows - 1, p.S);
        }
        if (key_begin >= key_end) continue;  // rows that see no key: dQ stays 0
        load_query_block(n, l0, rows);
        std::fill(s.dQ, s.dQ + int64_t(Br) * Ep, 0.0f);
        for (int64_t c0 = key_begin; c0 < key_end; c0 += Bc) {
          const int cols = int(std::min<int64_t>(Bc, p.S - c0));
          probabilities_and_dS(n, l0, rows, c0, cols, K_t + c0, V_t + c0, ld);
          gemm_acc_guarded<W, MR, NR>(k_finite, s.dS, Bc, K + c0 * Ep, Ep, s.dQ, Ep, rows, Bc, Ep);
          gemm_acc_guarded<W, MR, NR, true>(do_finite, s.P, Bc, s.dO, Ep, dv_acc + c0 * Ep, Ep, cols, rows, Ep);
          gemm_acc_guarded<W, MR, NR, true>(q_finite, s.dS, Bc, s.Q, Ep, dk_acc + c0 * Ep, Ep, cols, rows, Ep);
        }
        store_rows(s.dQ, p.scale, rows, static_cast<T*>(bp.dq) + (n * p.L + l0) * p.E);
      }
    }
    if (direct) {  // float32 rows of Ep = E: dK only lacks its scale
      for (int64_t i = 0; i < int64_t(p.S) * p.E; ++i) dk_acc[i] *= p.scale;
    } else {
      store_rows(dk_acc, p.scale, p.S, static_cast<T*>(bp.dk) + g * p.S * p.E);
      store_rows(dv_acc, 1.0f, p.S, static_cast<T*>(bp.dv) + g * p.S * p.E);
    }
  }

  // dQ_i of query head slice n, rows [l0, l0 + rows).
  void query_item(int64_t n, int64_t l0, int rows) {
    using namespace backward_detail;
    load_query_block(n, l0, rows);
    std::fill(s.dQ, s.dQ + int64_t(Br) * Ep, 0.0f);
    const int64_t b = n / p.H_q, h = n % p.H_q;
    const int64_t g = b * p.H_kv + h / p.q_kv_heads_ratio;
    int64_t key_begin = 0, key_end = p.S;
    if (p.mask_kind == MaskKind::causal) {
      key_begin = p.causal().key_begin(l0, p.S);
      key_end = p.causal().key_end(l0 + rows - 1, p.S);
    }
    for (int64_t c0 = key_begin; c0 < key_end; c0 += Bc) {
      const int cols = int(std::min<int64_t>(Bc, p.S - c0));
      const bool k_finite = load_key_tile(p.k, g, c0, cols, s.K, s.K_t);
      load_key_tile(p.v, g, c0, cols, s.V, s.V_t);
      probabilities_and_dS(n, l0, rows, c0, cols, s.K_t, s.V_t, Bc);
      gemm_acc_guarded<W, MR, NR>(k_finite, s.dS, Bc, s.K, Ep, s.dQ, Ep, rows, Bc, Ep);
    }
    store_rows(s.dQ, p.scale, rows, static_cast<T*>(bp.dq) + (n * p.L + l0) * p.E);
  }
};

template <typename Cfg>
void backward_item_t(const BackwardProblem& bp, const BackwardItem& item, void* scratch) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Backward<Cfg, T> kernel(bp, scratch);
    if (item.pass == BackwardItem::keys) {
      kernel.key_item(item.slice, item.first, item.count);
    } else if (item.pass == BackwardItem::queries) {
      kernel.query_item(item.slice, item.first, item.count);
    } else {
      // dK and dV accumulate in the outputs where they are float32 rows of
      // Ep (zeros: run_backward cleared them). The head's K, K^T, V^T (and
      // else the accumulators) live in a buffer held for the item: O(S),
      // freed after it.
      const bool direct = std::is_same_v<T, float> && kernel.Ep == bp.fwd.E;
      std::unique_ptr<float[]> buffer(new float[Backward<Cfg, T>::group_floats(bp.fwd, kernel.Ep, direct)]());
      kernel.group_item(item.slice, buffer.get(), direct);
    }
  };
  const mx::Dtype dtype = bp.fwd.dtype;
  if (dtype == mx::float32) {
    run(float{});
  } else if (dtype == mx::float16) {
    run(mx::float16_t{});
  } else {
    run(mx::bfloat16_t{});
  }
}

} // namespace flashattn::cpu::FLASHATTN_ISA
