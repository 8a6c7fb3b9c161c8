// The backward (FlashAttention-2 Algorithm 2, split in two passes so that no
// two SIMD groups add into one gradient), for every head dim and dtype, laid
// out as the rows kernel: one SIMD group per query row (or key), lanes over
// 32-key (or 32-row) tiles for the scores, then over the head dim for the
// sums. With P = softmax(S), S = scale Q K^T + mask over the visible keys:
//   dV = P^T dO    dP = dO V^T    D = rowsum(dO * O)    dS = P * (dP - D)
//   dQ = scale dS K    dK = scale dS^T Q
//
// flash_backward_rows: a row's log-sum-exp (the forward's where it kept it,
// params[kLseKept]; else a first walk over the keys takes it again, an
// attention sink joining it, so that P is the forward's), D, and dQ; writes
// (lse, D) per row for
// flash_backward_keys: dK and dV of one key per SIMD group, walking the
// query rows of its KV head's group. The sink's own gradient,
// -sum p_sink D, is taken from (lse, D) outside.

namespace fa {

// Hidden keys (or rows) are flagged, not given P = 0: their values may hold
// NaN, which must not reach a gradient (0 x NaN is NaN).
struct ScoreFlag {
  float s;
  bool hidden;
};

// Score (log2 domain) of key c for a query row staged in q_row (scaled by
// scale x log2(e)); keys past key_end are hidden.
template <typename T>
inline ScoreFlag row_score(const device T* k, threadgroup const float* q_row, Mask mask, bool masked,
                           int64_t mask_row, int c, int key_end, int E) {
  if (c >= key_end) return {-INFINITY, true};
  const float add = masked ? mask.term(mask_row, c) : 0.0f;
  if (add == -INFINITY) return {-INFINITY, true};
  const device T* k_c = k + int64_t(c) * E;
  float dot = 0.0f;
  for (int e = 0; e < E; ++e) dot += q_row[e] * load(k_c, e);
  return {dot + add, false};
}

template <typename T, int EPT>
void flash_backward_rows(
    const device T* q, const device T* k, const device T* v, const device float* mask_data,
    const device int64_t* mask_base, const device int* params, const device T* o, const device T* d_out,
    const device float* sinks, const device float* lse_kept, device T* dq, device float* stats, uint3 group,
    uint sg, uint lane,
    threadgroup float* q_tile,
    threadgroup float* do_tile, threadgroup float* ds_tile, threadgroup uchar* hidden_tile) {
  const RowTask t = row_task(params, group, sg);
  if (!t.valid) return;  // only SIMD-group barriers below: a padding group may leave
  const int L = params[kL], S = params[kS], E = params[kE];
  const bool masked = params[kMaskKind] == kMaskAdditive;
  const Mask mask = make_mask(mask_data, mask_base, params);
  const int64_t mask_row = masked ? mask.row_base(t.n_q, t.row) : 0;
  threadgroup float* q_row = q_tile + sg * 32 * EPT;
  threadgroup float* do_row = do_tile + sg * 32 * EPT;
  threadgroup float* ds_row = ds_tile + sg * 32;
  threadgroup uchar* hidden_row = hidden_tile + sg * 32;
  const device T* k_j = k + t.n_kv * S * E;
  const device T* v_j = v + t.n_kv * S * E;
  const int64_t i = t.n_q * L + t.row;

  float D = 0.0f;
  for (int e = int(lane); e < E; e += 32) {
    q_row[e] = load(q, i * E + e) * scale_log2(params);
    const float d = load(d_out, i * E + e);
    do_row[e] = d;
    D += d * load(o, i * E + e);
  }
  D = simd_sum(D);
  simdgroup_barrier(mem_flags::mem_threadgroup);

  // The row's log-sum-exp: the forward's, or its online softmax again
  // without V. A row that sees no key: +inf, so that every P = 2^(s - lse)
  // of it is 0 (and its O and D are 0, so a sink's gradient gets nothing
  // from it). A sink joins the denominator of the others: P is then the
  // forward's.
  float lse;
  if (params[kLseKept] != 0) {
    lse = lse_kept[i];
  } else {
    float m = -INFINITY, l = 0.0f;
    for (int c0 = t.key_begin; c0 < t.key_end; c0 += 32) {
      const ScoreFlag sf = row_score(k_j, q_row, mask, masked, mask_row, c0 + int(lane), t.key_end, E);
      float m_use;
      const float alpha = online_softmax_step(m, simd_max(isnan(sf.s) ? -INFINITY : sf.s), m_use);
      l = l * alpha + (sf.hidden ? 0.0f : exp2(sf.s - m_use));
    }
    l = simd_sum(l);
    lse = row_lse(m, l, sink_term(sinks, int(t.n_q % params[kHeadsQ]), m));
  }

  float acc[EPT];
  for (int a = 0; a < EPT; ++a) acc[a] = 0.0f;
  for (int c0 = t.key_begin; c0 < t.key_end; c0 += 32) {
    const int c = c0 + int(lane);
    const ScoreFlag sf = row_score(k_j, q_row, mask, masked, mask_row, c, t.key_end, E);
    float ds = 0.0f;
    if (!sf.hidden) {
      const device T* v_c = v_j + int64_t(c) * E;
      float dp = 0.0f;
      for (int e = 0; e < E; ++e) dp += do_row[e] * load(v_c, e);
      ds = exp2(sf.s - lse) * (dp - D);
    }
    ds_row[lane] = ds;
    hidden_row[lane] = sf.hidden;
    simdgroup_barrier(mem_flags::mem_threadgroup);
    const int n = min(32, t.key_end - c0);
    for (int j = 0; j < n; ++j) {
      if (hidden_row[j]) continue;
      const float ds_j = ds_row[j];
      const device T* k_c = k_j + int64_t(c0 + j) * E;
      for (int a = 0; a < EPT; ++a) {
        const int e = int(lane) + 32 * a;
        if (e < E) acc[a] += ds_j * load(k_c, e);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // ds_row is rewritten next tile
  }
  const float scale = as_type<float>(params[kScale]);
  for (int a = 0; a < EPT; ++a) {
    const int e = int(lane) + 32 * a;
    if (e < E) store(dq, i * E + e, acc[a] * scale);
  }
  if (lane == 0) {
    stats[2 * i] = lse;
    stats[2 * i + 1] = D;
  }
}

template <typename T, int EPT>
void flash_backward_keys(
    const device T* q, const device T* k, const device T* v, const device float* mask_data,
    const device int64_t* mask_base, const device int* params, const device T* d_out,
    const device float* stats, device T* dk, device T* dv, uint3 group, uint sg, uint lane,
    threadgroup float* k_tile, threadgroup float* v_tile, threadgroup float* p_tile,
    threadgroup float* ds_tile, threadgroup uchar* hidden_tile) {
  const int H_q = params[kHeadsQ], H_kv = params[kHeadsKV], L = params[kL], S = params[kS], E = params[kE];
  const int ratio = H_q / H_kv;
  const int c = int(group.x) * params[kRowsPerGroup] + int(sg);
  if (c >= S) return;  // only SIMD-group barriers below
  const bool masked = params[kMaskKind] == kMaskAdditive;
  const Mask mask = make_mask(mask_data, mask_base, params);
  const int64_t n_kv = group.y;
  const int64_t j = n_kv * S + c;
  threadgroup float* k_row = k_tile + sg * 32 * EPT;
  threadgroup float* v_row = v_tile + sg * 32 * EPT;
  threadgroup float* p_row = p_tile + sg * 32;
  threadgroup float* ds_row = ds_tile + sg * 32;
  threadgroup uchar* hidden_row = hidden_tile + sg * 32;
  for (int e = int(lane); e < E; e += 32) {
    k_row[e] = load(k, j * E + e) * scale_log2(params);
    v_row[e] = load(v, j * E + e);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const bool causal = params[kMaskKind] == kMaskCausal;
  const int row_begin = causal ? causal_first_row(c, L, S) : 0;
  const int row_end = causal ? causal_row_end(c, L, S, params[kWindow]) : L;
  float dk_acc[EPT], dv_acc[EPT];
  for (int a = 0; a < EPT; ++a) dk_acc[a] = dv_acc[a] = 0.0f;
  for (int h = 0; h < ratio; ++h) {
    const int64_t n_q = (n_kv / H_kv) * H_q + (n_kv % H_kv) * ratio + h;
    for (int r0 = row_begin; r0 < row_end; r0 += 32) {
      const int row = r0 + int(lane);
      bool hidden = row >= row_end;
      const float add = masked && !hidden ? mask.term(mask.row_base(n_q, row), c) : 0.0f;
      hidden = hidden || add == -INFINITY;
      float p = 0.0f, ds = 0.0f;
      if (!hidden) {
        const int64_t i = n_q * L + row;
        float s = add, dp = 0.0f;
        for (int e = 0; e < E; ++e) {
          s += load(q, i * E + e) * k_row[e];
          dp += load(d_out, i * E + e) * v_row[e];
        }
        p = exp2(s - stats[2 * i]);
        ds = p * (dp - stats[2 * i + 1]);
      }
      p_row[lane] = p;
      ds_row[lane] = ds;
      hidden_row[lane] = hidden;
      simdgroup_barrier(mem_flags::mem_threadgroup);
      const int n = min(32, row_end - r0);
      for (int r = 0; r < n; ++r) {
        if (hidden_row[r]) continue;
        const int64_t i = n_q * L + r0 + r;
        const float p_r = p_row[r], ds_r = ds_row[r];
        for (int a = 0; a < EPT; ++a) {
          const int e = int(lane) + 32 * a;
          if (e < E) {
            dv_acc[a] += p_r * load(d_out, i * E + e);
            dk_acc[a] += ds_r * load(q, i * E + e);
          }
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);  // the tiles are rewritten next
    }
  }
  const float scale = as_type<float>(params[kScale]);
  for (int a = 0; a < EPT; ++a) {
    const int e = int(lane) + 32 * a;
    if (e < E) {
      store(dk, j * E + e, dk_acc[a] * scale);
      store(dv, j * E + e, dv_acc[a]);
    }
  }
}

}  // namespace fa
