// eval_cpu: FlashAttention-2 forward, tiled, online softmax, float32
// accumulation, for float32 / float16 / bfloat16 inputs.
//
//   for each (n, i):            n = (batch, query head), i = query tile
//     Q_i  <- Br x E queries, scaled by scale * log2(e)
//     m_i = -inf, l_i = 0, o_i = 0
//     for each key tile j visible to Q_i:
//       S_ij = Q_i K_j^T      (Br x Bc)
//       mask S_ij, update m_i, l_i, rescale o_i, P_ij = exp2(S_ij - m_i)
//       o_i += P_ij V_j
//     O_i = o_i / l_i
//
// Scratch per (n, i) is Br x E + Br x Bc + Bc x E floats: never L x S.

#include <vector>

#include "../flash_attention.h"
#include "mask.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "online_softmax.h"
#include "problem.h"
#include "tile_io.h"
#include "tiles.h"

namespace flashattn::cpu {

namespace {

template <typename T, typename M>
void apply_mask_tile(
    const AttentionProblem& p,
    int64_t n,
    float* s,
    int r0,
    int rows,
    int c0,
    int cols) {
  apply_array_mask<M>(
      s,
      Bc,
      static_cast<const M*>(p.mask.data),
      p.mask.base[n],
      p.mask.row_stride,
      p.mask.col_stride,
      r0,
      rows,
      c0,
      cols);
}

template <typename T>
void mask_scores(
    const AttentionProblem& p,
    int64_t n,
    float* s,
    int r0,
    int rows,
    int c0,
    int cols,
    TileVisibility visibility) {
  switch (p.mask_kind) {
    case MaskKind::none:
      return;
    case MaskKind::causal:
      if (visibility == TileVisibility::partial) {
        apply_causal_mask(s, Bc, r0, rows, c0, cols, p.S - p.L);
      }
      return;
    case MaskKind::boolean:
      return apply_mask_tile<T, bool>(p, n, s, r0, rows, c0, cols);
    case MaskKind::additive:
      if (p.mask_dtype == mx::float32) {
        return apply_mask_tile<T, float>(p, n, s, r0, rows, c0, cols);
      } else if (p.mask_dtype == mx::float16) {
        return apply_mask_tile<T, mx::float16_t>(p, n, s, r0, rows, c0, cols);
      } else {
        return apply_mask_tile<T, mx::bfloat16_t>(p, n, s, r0, rows, c0, cols);
      }
  }
}

// One (batch x query head, query tile) work item.
template <typename T>
void attend_query_tile(
    const AttentionProblem& p,
    int64_t n,
    int i,
    std::vector<float>& scratch) {
  const int E = p.E;
  float* Q_i = scratch.data();
  float* K_j = Q_i + Br * E;
  float* V_j = K_j + Bc * E;
  float* S_ij = V_j + Bc * E;
  float* o_i = S_ij + Br * Bc;
  float* m_i = o_i + Br * E;
  float* l_i = m_i + Br;

  const int64_t b = n / p.H_q;
  const int h = int(n % p.H_q);
  const int64_t n_kv = b * p.H_kv + h / p.q_kv_heads_ratio;
  const int r0 = i * Br;
  const int rows = std::min(Br, p.L - r0);
  const int offset = p.S - p.L;

  load_tile(
      static_cast<const T*>(p.q.data),
      p.q.base[n],
      p.q.row_stride,
      p.q.col_stride,
      r0,
      rows,
      E,
      p.scale * kLog2e,
      Q_i,
      E,
      Br);
  for (int r = 0; r < Br; ++r) {
    m_i[r] = kNegInf;
    l_i[r] = 0.0f;
  }
  std::fill(o_i, o_i + Br * E, 0.0f);

  int key_end = p.mask_kind == MaskKind::causal
      ? causal_key_end(r0 + rows, offset, p.S)
      : p.S;
  int Tc = ceil_div(key_end, Bc);
  for (int j = 0; j < Tc; ++j) {
    const int c0 = j * Bc;
    const int cols = std::min(Bc, p.S - c0);
    auto visibility = p.mask_kind == MaskKind::causal
        ? causal_visibility(r0, r0 + rows, c0, c0 + cols, offset)
        : TileVisibility::visible;
    if (visibility == TileVisibility::hidden) {
      continue;
    }
    load_tile(
        static_cast<const T*>(p.k.data),
        p.k.base[n_kv],
        p.k.row_stride,
        p.k.col_stride,
        c0,
        cols,
        E,
        1.0f,
        K_j,
        E,
        Bc);
    load_tile(
        static_cast<const T*>(p.v.data),
        p.v.base[n_kv],
        p.v.row_stride,
        p.v.col_stride,
        c0,
        cols,
        E,
        1.0f,
        V_j,
        E,
        Bc);

    // S_ij = Q_i K_j^T
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) {
        float acc = 0.0f;
        for (int e = 0; e < E; ++e) {
          acc += Q_i[r * E + e] * K_j[c * E + e];
        }
        S_ij[r * Bc + c] = acc;
      }
    }
    mask_scores<T>(p, n, S_ij, r0, rows, c0, cols, visibility);
    online_softmax_update(S_ij, Bc, rows, cols, m_i, l_i, o_i, E, E);

    // o_i += P_ij V_j
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) {
        float p_rc = S_ij[r * Bc + c];
        for (int e = 0; e < E; ++e) {
          o_i[r * E + e] += p_rc * V_j[c * E + e];
        }
      }
    }
  }
  T* out = static_cast<T*>(p.out) + (n * p.L + r0) * int64_t(E);
  store_output(o_i, E, l_i, rows, E, out);
}

template <typename T>
void run(const AttentionProblem& p) {
  const int E = p.E;
  std::vector<float> scratch(
      Br * E + 2 * Bc * E + Br * Bc + Br * E + 2 * Br);
  const int Tr = ceil_div(p.L, Br);
  for (int64_t n = 0; n < p.batch * p.H_q; ++n) {
    for (int i = 0; i < Tr; ++i) {
      attend_query_tile<T>(p, n, i, scratch);
    }
  }
}

} // namespace

} // namespace flashattn::cpu

namespace flashattn {

void FlashAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  auto problem = cpu::describe_problem(inputs, out, scale_, mask_kind_);
  encoder.dispatch([p = std::move(problem)]() {
    if (p.dtype == mx::float32) {
      cpu::run<float>(p);
    } else if (p.dtype == mx::float16) {
      cpu::run<mx::float16_t>(p);
    } else {
      cpu::run<mx::bfloat16_t>(p);
    }
  });
}

} // namespace flashattn
