// One work item: a row tile of RB query rows (the query heads of one GQA
// group, position-major) against a range of keys, FlashAttention-2 style.
//
//   Q_i^T <- the rows' queries, times scale * log2(e)       (E x RB)
//   m_i = -inf, l_i = 0, o_i^T = 0
//   for each key tile j of Bc keys in the range:
//     K_j, V_j: read in place (float32 full tiles) or converted/padded
//               (quantized ones dequantized)
//     S_ij^T = K_j Q_i^T; hide masked scores; online softmax -> P_ij^T
//     o_i^T += V_j^T P_ij^T
//   O_i = o_i / l_i into the output, or (m_i, l_i, o_i^T) into the plan's
//   partials when the keys are split (merged afterwards).

#pragma once

#include <cstdint>
#include <limits>

#include "../causal.h"
#include "../kernels.h"
#include "../problem.h"
#include "../softmax.h"
#include "../tiles.h"
#include "../work.h"
#include "convert.h"
#include "dequantize.h"
#include "micro_kernels.h"
#include "online_softmax.h"

namespace flashattn::cpu::FLASHATTN_ISA {

namespace attend_detail {
// Where a plan streams the keys and values once (narrow: few query rows a KV
// head), their tiles are asked for this many tiles ahead of use, into every
// cache level (locality 3). Prefill plans ask for nothing: each row tile of
// a group reads the same tiles, which stay in L2, and the non-temporal hint
// (locality 0) there made them miss to L3: head dim 128 took 1.7-2.5x as
// long on an Intel Xeon (docs/cpu.md).
constexpr int kPrefetchTiles = 2;
constexpr int kPrefetchLocality = 3;
} // namespace attend_detail

template <typename Cfg, typename T>
struct Attend {
  static constexpr int W = Cfg::W, RV = Cfg::RV, RB = Cfg::RB;
  static constexpr int KB = Cfg::KB, EB = Cfg::EB;
  using S = Simd<W>;
  using vf = typename S::vf;
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  const AttentionProblem& p;
  WorkPlan& plan;
  const WorkItem& item;
  ScratchView s;
  int rows = 0; // valid rows of this tile
  int64_t l_first = 0, l_last = 0; // query positions of the first/last row

  // Copies `count` rows (c0.. of a K or V slice) into dst (Bc x E, rows
  // beyond count zeroed), converting to float32.
  void pack_rows(const StridedOperand& x, int64_t c0, int count, float* dst) {
    const T* src = static_cast<const T*>(x.data) + x.base[item.group];
    const int E = p.E;
    for (int c = 0; c < count; ++c) {
      const T* row = src + (c0 + c) * x.row_stride;
      float* d = dst + c * E;
      int e = 0;
      if (x.col_stride == 1) {
        for (; e + W <= E; e += W) {
          S::store(d + e, Convert<W, T>::load(row + e));
        }
      }
      for (; e < E; ++e) {
        d[e] = to_float(row[e * x.col_stride]);
      }
    }
    for (int c = count; c < Bc; ++c) {
      for (int e = 0; e < E; ++e) {
        dst[c * E + e] = 0.0f;
      }
    }
  }

  // K_j or V_j into dst (Bc x E): converted, or dequantized.
  void load_tile(const StridedOperand& x, const Quantized& qz, int64_t c0, int count, float* dst) {
    if (qz.bits == 0) {
      pack_rows(x, c0, count, dst);
      return;
    }
    dequantize_rows(x, qz, item.group, c0, count, p.E, dst);
    for (int64_t i = int64_t(count) * p.E; i < int64_t(Bc) * p.E; ++i) {
      dst[i] = 0.0f;
    }
  }

  // Asks for the key/value rows [c0, c0 + count) ahead of use: decode streams
  // K and V from memory once, and the hardware prefetchers lose track of
  // the KB rows a register block walks at once. Always inlined: GCC deems a
  // function of nothing but prefetches free of effects and drops its calls.
  __attribute__((always_inline)) inline void prefetch_rows(const StridedOperand& x, int64_t c0, int count) {
    if (x.col_stride != 1 || p.quantized()) {
      return;
    }
    const char* src = static_cast<const char*>(x.data) +
        (x.base[item.group] + c0 * x.row_stride) * int64_t(sizeof(T));
    const int64_t row_bytes = int64_t(p.E) * sizeof(T);
    const int64_t stride = x.row_stride * int64_t(sizeof(T));
    for (int c = 0; c < count; ++c) {
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(src + c * stride + b, 0, attend_detail::kPrefetchLocality);
      }
    }
  }

  void load_rows() {
    const int ratio = p.q_kv_heads_ratio;
    const int64_t b = item.group / p.H_kv, g = item.group % p.H_kv;
    const int first = item.row_tile * RB;
    rows = std::min(RB, plan.rows_per_group - first);
    const float q_scale = p.scale * kLog2e;
    const T* q = static_cast<const T*>(p.q.data);
    for (int r = 0; r < RB; ++r) {
      if (r >= rows) {
        for (int e = 0; e < p.E; ++e) {
          s.Qt[e * RB + r] = 0.0f;
        }
        s.first[r] = 0.0f;
        s.limit[r] = 0.0f;
        continue;
      }
      int64_t l = (first + r) / ratio;
      int64_t n = b * p.H_q + g * ratio + (first + r) % ratio;
      const T* q_row = q + p.q.base[n] + l * p.q.row_stride;
      for (int e = 0; e < p.E; ++e) {
        s.Qt[e * RB + r] = to_float(q_row[e * p.q.col_stride]) * q_scale;
      }
      s.out_off[r] = (n * p.L + l) * p.E;
      if (p.mask_kind == MaskKind::boolean || p.mask_kind == MaskKind::additive) {
        s.mask_off[r] = p.mask.base[n] + l * p.mask.row_stride;
      }
      const CausalRule causal = p.causal();
      s.first[r] = float(std::max<int64_t>(causal.first_key(l), -1));
      s.limit[r] = float(causal.last_key(l));
    }
    l_first = first / ratio;
    l_last = (first + rows - 1) / ratio;
  }

  template <typename M>
  void apply_array_mask(float* St, int64_t c0, int cols) {
    const M* mask = static_cast<const M*>(p.mask.data);
    const int64_t cs = p.mask.col_stride;
    for (int r = 0; r < rows; ++r) {
      const M* m_row = mask + s.mask_off[r] + c0 * cs;
      for (int c = 0; c < cols; ++c) {
        M value = m_row[c * cs];
        if constexpr (std::is_same_v<M, bool>) {
          if (!value) {
            St[c * RB + r] = kNegInf;
          }
        } else {
          // An additive -inf hides the key outright, as a boolean mask does:
          // adding it to a NaN score would keep the NaN.
          float m = to_float(value);
          St[c * RB + r] = m == kNegInf ? kNegInf : St[c * RB + r] + m * kLog2e;
        }
      }
    }
  }

  // Hides masked scores (-inf). Returns whether the tile may hide any key.
  bool mask_scores(float* St, int64_t c0, int cols, TileVisibility visibility) {
    const vf neg_inf = S::splat(kNegInf);
    for (int c = cols; c < Bc; ++c) { // padding keys past the range
      for (int v = 0; v < RV; ++v) {
        S::store(St + c * RB + v * W, neg_inf);
      }
    }
    switch (p.mask_kind) {
      case MaskKind::none:
        return false;
      case MaskKind::causal:
        if (visibility == TileVisibility::partial) {
          for (int c = 0; c < cols; ++c) {
            vf key = S::splat(float(c0 + c));
            for (int v = 0; v < RV; ++v) {
              vf sc = S::load(St + c * RB + v * W);
              vf limit = S::load(s.limit + v * W);
              vf first = S::load(s.first + v * W);
              sc = S::select(key > limit, neg_inf, sc);
              S::store(St + c * RB + v * W, S::select(first > key, neg_inf, sc));
            }
          }
        }
        return visibility == TileVisibility::partial;
      case MaskKind::boolean:
        apply_array_mask<bool>(St, c0, cols);
        return true;
      case MaskKind::additive:
        if (p.mask_dtype == mx::float32) {
          apply_array_mask<float>(St, c0, cols);
        } else if (p.mask_dtype == mx::float16) {
          apply_array_mask<mx::float16_t>(St, c0, cols);
        } else {
          apply_array_mask<mx::bfloat16_t>(St, c0, cols);
        }
        return true;
    }
    return true;
  }

  static bool all_finite(const float* V, int64_t rs, int64_t cs, int rows, int E) {
    unsigned bad = 0;
    for (int c = 0; c < rows; ++c) {
      for (int e = 0; e < E; ++e) {
        unsigned bits;
        __builtin_memcpy(&bits, V + c * rs + e * cs, sizeof(bits));
        bad |= (bits & 0x7f800000u) == 0x7f800000u;
      }
    }
    return !bad;
  }

  // o_i^T += V_j^T P_ij^T over visible keys only: the path for a tile whose
  // values hold NaN or Inf where some row cannot see them (0 x NaN is NaN).
  void pv_visible_only(const float* V, int64_t rs, int64_t cs, int cols) {
    for (int c = 0; c < cols; ++c) {
      for (int r = 0; r < RB; ++r) {
        if (s.hidden[c * RB + r] != 0.0f) {
          continue;
        }
        float pr = s.St[c * RB + r];
        for (int e = 0; e < p.E; ++e) {
          s.Ot[e * RB + r] += pr * V[c * rs + e * cs];
        }
      }
    }
  }

  void run() {
    const int E = p.E;
    load_rows();
    for (int r = 0; r < RB; ++r) {
      s.m_i[r] = kNegInf;
      s.l_i[r] = 0.0f;
    }
    for (int i = 0; i < E * RB; ++i) {
      s.Ot[i] = 0.0f;
    }
    const CausalRule causal = p.causal();
    for (int64_t c0 = item.key_begin; c0 < item.key_end; c0 += Bc) {
      const int cols = int(std::min<int64_t>(Bc, item.key_end - c0));
      auto visibility = p.mask_kind == MaskKind::causal
          ? causal.visibility(l_first, l_last, c0, c0 + cols)
          : TileVisibility::visible;
      if (visibility == TileVisibility::hidden) {
        continue;
      }
      const int64_t ahead = c0 + attend_detail::kPrefetchTiles * Bc;
      if (plan.narrow && ahead < item.key_end) {
        int next = int(std::min<int64_t>(Bc, item.key_end - ahead));
        prefetch_rows(p.k, ahead, next);
        prefetch_rows(p.v, ahead, next);
      }
      // K_j and V_j: in place when they are float32 full tiles.
      const float *K, *V;
      int64_t k_rs, k_cs, v_rs, v_cs;
      if (std::is_same_v<T, float> && cols == Bc && !plan.narrow && !p.quantized()) {
        K = static_cast<const float*>(p.k.data) + p.k.base[item.group] + c0 * p.k.row_stride;
        V = static_cast<const float*>(p.v.data) + p.v.base[item.group] + c0 * p.v.row_stride;
        k_rs = p.k.row_stride, k_cs = p.k.col_stride;
        v_rs = p.v.row_stride, v_cs = p.v.col_stride;
      } else {
        load_tile(p.k, p.k_quantized, c0, cols, s.K);
        load_tile(p.v, p.v_quantized, c0, cols, s.V);
        K = s.K, V = s.V;
        k_rs = v_rs = E, k_cs = v_cs = 1;
      }
      for (int c = 0; c < Bc; c += KB) {
        qk_block<W, RV, KB>(s.Qt, K + c * k_rs, k_rs, k_cs, E, s.St + c * RB);
      }
      bool may_hide = mask_scores(s.St, c0, cols, visibility);
      // Keys a row cannot see never reach its output, even when their values
      // are NaN or Inf (the fast P V below would turn 0 x NaN into NaN).
      bool guard = may_hide && !all_finite(V, v_rs, v_cs, cols, E);
      if (guard) {
        for (int i = 0; i < Bc * RB; ++i) {
          s.hidden[i] = s.St[i] == kNegInf ? 1.0f : 0.0f;
        }
      }
      online_softmax_update<W, RV>(s.St, s.m_i, s.l_i, s.Ot, E);
      if (guard) {
        pv_visible_only(V, v_rs, v_cs, cols);
        continue;
      }
      int e = 0;
      for (; e + EB <= E; e += EB) {
        pv_block<W, RV, EB>(s.St, cols, V + e * v_cs, v_rs, v_cs, s.Ot + e * RB);
      }
      for (; e < E; ++e) {
        pv_block<W, RV, 1>(s.St, cols, V + e * v_cs, v_rs, v_cs, s.Ot + e * RB);
      }
    }
    if (plan.splits > 1) {
      store_partial();
    } else {
      store_output();
    }
  }

  // O_i = o_i / l_i; rows that saw no visible key (l_i = 0) are zeros.
  void store_output() {
    for (int r = 0; r < rows; ++r) {
      store_output_row<T>(p, s.out_off[r], s.Ot + r, RB, s.m_i[r], s.l_i[r],
                          p.lse ? p.lse + s.out_off[r] / p.E : nullptr);
    }
  }

  void store_partial() {
    const Partial dst = plan.partial(item);
    for (int r = 0; r < RB; ++r) {
      dst.m(r) = s.m_i[r];
      dst.l(r) = s.l_i[r];
    }
    for (int e = 0; e < p.E; ++e) {
      for (int r = 0; r < RB; ++r) {
        dst.o(e, r) = s.Ot[e * RB + r];
      }
    }
  }
};

template <typename Tiles>
void attend_item_t(
    const AttentionProblem& p,
    WorkPlan& plan,
    const WorkItem& item,
    void* scratch) {
  constexpr int RB = Tiles::RB;
  ScratchView s(scratch, p.E, RB);
  if (p.dtype == mx::float32) {
    Attend<Tiles, float>{p, plan, item, s}.run();
  } else if (p.dtype == mx::float16) {
    Attend<Tiles, mx::float16_t>{p, plan, item, s}.run();
  } else {
    Attend<Tiles, mx::bfloat16_t>{p, plan, item, s}.run();
  }
}

} // namespace flashattn::cpu::FLASHATTN_ISA
