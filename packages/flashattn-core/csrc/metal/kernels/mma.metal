// The matrix kernel: FlashAttention-2 prefill with Q K^T and P V on SIMD-group
// matrices (simdgroup_float8x8), for head dims 64, 80, 96 and 128 in every
// dtype (tiles are float32 in threadgroup memory; inputs are converted as
// they are staged).
//
//   threadgroup (x: query tile of Br = 32 rows, y: batch x query head)
//   4 SIMD groups, SIMD group sg owns rows 8 sg .. 8 sg + 7 of the tile:
//     its Q fragments stay in registers (E / 8 matrices);
//     per key tile of Bc keys (32, or 16 at E = 128):
//       K tile -> S = Q K^T (8 x Bc per SIMD group) -> online softmax, lane j
//       on key j, simd_max per row -> V tile (over K) -> O = diag(alpha) O +
//       P V, O in threadgroup memory.
//   Causal masks stop at the tile's last diagonal key.
//
// Threadgroup memory (floats): O 32 x E, K/V Bc x E, S/P 32 x 32, plus
// alpha and hidden flags: at most 29.2 KiB (E = 96, E = 128).

namespace fa {

// Br = mma_rows(), Bc = mma_keys(E), kMmaThreads threads (params.h).

// TO, the output's type: T, or float for float32 attention over 16-bit
// inputs (flash_mma_f32; the arithmetic is float32 either way).
template <typename T, int E, typename KV, typename TO>
void flash_mma(
    const device T* q, KV k, KV v, const device float* mask_data,
    const device int64_t* mask_base, const device int* params, const device float* sinks, device TO* out,
    device float* lse, uint3 group, uint sg, uint lane, uint tid, threadgroup float* o_tile, threadgroup float* kv_tile,
    threadgroup float* s_tile, threadgroup float* alpha_tile, threadgroup uchar* hidden_tile,
    threadgroup int* flags) {
  constexpr int Br = mma_rows(), Bc = mma_keys(E), D = E / 8, KB = Bc / 8, kThreads = kMmaThreads;
  const int H_q = params[kHeadsQ], H_kv = params[kHeadsKV], L = params[kL], S = params[kS];
  const int kind = params[kMaskKind];
  const Mask mask = make_mask(mask_data, mask_base, params);
  const int64_t n_q = group.y;
  const int64_t n_kv = (n_q / H_q) * H_kv + (n_q % H_q) / (H_q / H_kv);
  const int row0 = int(group.x) * Br;
  const device T* q_h = q + n_q * L * E;
  const int64_t kv_row0 = n_kv * S;  // this KV head's first key row
  threadgroup float* o_sg = o_tile + sg * 8 * E;
  threadgroup float* s_sg = s_tile + sg * 8 * 32;

  // Q, scaled, staged through the O tile into this SIMD group's fragments.
  const float scale = scale_log2(params);
  for (int i = int(tid); i < Br * E; i += kThreads) {
    const int r = i / E;
    o_tile[i] = row0 + r < L ? load(q_h, int64_t(row0 + r) * E + i % E) * scale : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 q_frag[D];
  for (int d = 0; d < D; ++d) simdgroup_load(q_frag[d], o_sg + d * 8, E);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(lane); i < 8 * E; i += 32) o_sg[i] = 0.0f;  // own rows: no barrier

  // Per lane, for each of the SIMD group's 8 rows: m_i and this lane's share of l_i.
  float m_i[8], l_i[8];
  for (int r = 0; r < 8; ++r) {
    m_i[r] = -INFINITY;
    l_i[r] = 0.0f;
  }
  const int W = params[kWindow];
  int key_begin = 0, key_end = S;
  if (kind == kMaskCausal) {
    key_begin = causal_key_begin(row0, L, S, W);
    key_end = causal_key_end(min(row0 + Br, L), L, S);
  }

  for (int c0 = key_begin; c0 < key_end; c0 += Bc) {
    if (tid == 0) flags[0] = 0;
    for (int i = int(tid); i < Bc * E; i += kThreads) {
      const int j = i / E;
      kv_tile[i] = c0 + j < S ? k.at(kv_row0 + c0 + j, i % E) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S_ij = Q_i K_j^T: K fragments loaded transposed.
    for (int kb = 0; kb < KB; ++kb) {
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < D; ++d) {
        simdgroup_float8x8 k_frag;
        simdgroup_load(k_frag, kv_tile + kb * 8 * E + d * 8, E, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(acc, q_frag[d], k_frag, acc);
      }
      simdgroup_store(acc, s_sg + kb * 8, 32);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // Online softmax, lane j on key c0 + j: P_ij over S_ij, hidden keys 0.
    bool any_hidden = false;
    const int c = c0 + int(lane);
    for (int r = 0; r < 8; ++r) {
      const int row = row0 + int(sg) * 8 + r;
      bool hidden = int(lane) >= Bc || c >= S || row >= L || (kind == kMaskCausal && causal_hides(row, c, L, S, W));
      float s = -INFINITY;
      if (!hidden) {
        s = s_sg[r * 32 + lane];
        if (kind == kMaskAdditive) {
          const float add = mask.term(mask.row_base(n_q, row), c);
          hidden = add == -INFINITY;
          s += add;
        }
      }
      float m_use;
      const float alpha = online_softmax_step(m_i[r], simd_max(hidden || isnan(s) ? -INFINITY : s), m_use);
      const float p = hidden ? 0.0f : exp2(s - m_use);
      l_i[r] = l_i[r] * alpha + p;
      if (int(lane) < Bc) {
        s_sg[r * 32 + lane] = p;
        hidden_tile[(sg * 8 + r) * 32 + lane] = hidden ? 1 : 0;
        any_hidden = any_hidden || hidden;
      }
      if (lane == 0) alpha_tile[sg * 8 + r] = alpha;
    }
    any_hidden = simd_any(any_hidden);

    // V tile over the K tile, once every SIMD group is done with K.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = int(tid); i < Bc * E; i += kThreads) {
      const int j = i / E;
      const float x = c0 + j < S ? v.at(kv_row0 + c0 + j, i % E) : 0.0f;
      kv_tile[i] = x;
      if (!isfinite(x)) flags[0] = 1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // O_i = diag(alpha) O_i + P_ij V_j.
    for (int i = int(lane); i < 8 * E; i += 32) o_sg[i] *= alpha_tile[sg * 8 + i / E];
    simdgroup_barrier(mem_flags::mem_threadgroup);
    if (flags[0] != 0 && any_hidden) {
      // Rare: values hold NaN or Inf where some row cannot see them; P V over
      // visible keys only, since the matrix product would turn 0 x NaN into NaN.
      for (int i = int(lane); i < 8 * E; i += 32) {
        const int r = i / E, e = i % E;
        float acc = 0.0f;
        for (int j = 0; j < Bc; ++j) {
          if (!hidden_tile[(sg * 8 + r) * 32 + j]) acc += s_sg[r * 32 + j] * kv_tile[j * E + e];
        }
        o_sg[i] += acc;
      }
    } else {
      simdgroup_float8x8 p_frag[KB];
      for (int kb = 0; kb < KB; ++kb) simdgroup_load(p_frag[kb], s_sg + kb * 8, 32);
      for (int d = 0; d < D; ++d) {
        simdgroup_float8x8 o_frag;
        simdgroup_load(o_frag, o_sg + d * 8, E);
        for (int kb = 0; kb < KB; ++kb) {
          simdgroup_float8x8 v_frag;
          simdgroup_load(v_frag, kv_tile + kb * 8 * E + d * 8, E);
          simdgroup_multiply_accumulate(o_frag, p_frag[kb], v_frag, o_frag);
        }
        simdgroup_store(o_frag, o_sg + d * 8, E);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // V and P read before the next tile
  }

  // out_i = O_i / l_i; rows that saw no visible key are zeros. lse (not
  // null: a gradient will be taken): each row's log-sum-exp too, as the
  // backward's rows pass would take it again.
  simdgroup_barrier(mem_flags::mem_threadgroup);
  float inv[8];
  for (int r = 0; r < 8; ++r) {
    const float l = simd_sum(l_i[r]);
    const float sink = sink_term(sinks, int(n_q % H_q), m_i[r]);
    inv[r] = inverse_sum(l + sink);
    const int row = row0 + int(sg) * 8 + r;
    if (lse != nullptr && lane == 0 && row < L) {
      lse[n_q * L + row] = row_lse(m_i[r], l, sink);
    }
  }
  for (int i = int(lane); i < 8 * E; i += 32) {
    const int r = i / E, row = row0 + int(sg) * 8 + r;
    if (row < L) store(out, (n_q * L + row) * E + i % E, o_sg[i] * inv[r]);
  }
}

}  // namespace fa
