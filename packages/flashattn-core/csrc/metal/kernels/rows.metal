// The rows kernel: the course design (one SIMD group per query row, lane j
// holding key j of each 32-key tile), for every head dim and dtype. It runs
// prefill where the matrix kernel has no variant, and decode: a threadgroup
// holds the rows of one KV head's query heads (the GQA group reads each key
// once), and keys may be split across threadgroups, each writing a partial
// (o_i, m_i, l_i) that flash_merge (common.metal) combines (FlashDecoding).
//
//   threadgroup (x: row chunk, y: batch x KV head, z: key split)
//   SIMD group sg -> query row chunk * Br + sg of the group
//     (query head = KV head x ratio + row / L, row within the head = row % L)
//   key tile of 32: lane j scores key j (Q row in threadgroup memory, K from
//     device memory), simd_max gives the tile max, P goes through
//     threadgroup memory, then lane j accumulates head-dim elements
//     j, j + 32, ... of o_i in registers (EPT of them).
//
// Threadgroup memory: Br x 32 x EPT floats of queries + Br x 32 of P, with
// Br = rows_per_threadgroup(EPT): 20 KiB at most.

namespace fa {

// Br = rows_per_threadgroup(EPT) (params.h).

// The query row a SIMD group holds and the keys it walks.
struct RowTask {
  bool valid;      // false for the padding SIMD groups of the last chunk
  int64_t n_q;     // batch x H_q + query head
  int64_t n_kv;    // batch x H_kv + KV head
  int row;         // within the head, 0 <= row < L
  int key_begin;   // [key_begin, key_end): this split's keys the row sees
  int key_end;
};

inline RowTask row_task(const device int* params, uint3 group, uint sg) {
  const int H_q = params[kHeadsQ], H_kv = params[kHeadsKV], L = params[kL], S = params[kS];
  const int ratio = H_q / H_kv;
  const int r = int(group.x) * params[kRowsPerGroup] + int(sg);
  RowTask t;
  t.valid = r < ratio * L;
  const int rr = t.valid ? r : 0;
  t.n_kv = group.y;
  t.n_q = (t.n_kv / H_kv) * H_q + (t.n_kv % H_kv) * ratio + rr / L;
  t.row = rr % L;
  t.key_begin = int(group.z) * params[kKeysPerSplit];
  t.key_end = min(S, t.key_begin + params[kKeysPerSplit]);
  if (params[kMaskKind] == kMaskCausal) {
    t.key_begin = max(t.key_begin, causal_key_begin(t.row, L, S, params[kWindow]));
    t.key_end = min(t.key_end, causal_key_end(t.row + 1, L, S));
  }
  t.key_end = max(t.key_end, t.key_begin);
  if (!t.valid) t.key_end = t.key_begin;
  return t;
}

// Per lane: o_i for head-dim elements lane + 32 i; m_i; l_i (after the final
// simd_sum, the row's whole sum; before it, this lane's share).
template <int EPT>
struct RowState {
  float o[EPT];
  float m;
  float l;
};

template <typename T, int EPT, typename KV>
RowState<EPT> attend_row(
    const device T* q, KV k, KV v, Mask mask, const device int* params,
    RowTask t, uint lane, threadgroup float* q_row, threadgroup float* p_row) {
  const int L = params[kL], S = params[kS], E = params[kE];
  const bool masked = params[kMaskKind] == kMaskAdditive;
  const device T* q_i = q + (t.n_q * L + t.row) * E;
  for (int e = int(lane); e < E; e += 32) {
    q_row[e] = t.valid ? load(q_i, e) * scale_log2(params) : 0.0f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  RowState<EPT> st;
  for (int i = 0; i < EPT; ++i) st.o[i] = 0.0f;
  st.m = -INFINITY;
  st.l = 0.0f;
  const int64_t kv_row0 = t.n_kv * S;  // this KV head's first key row
  const int64_t mask_row = masked ? mask.row_base(t.n_q, t.row) : 0;

  for (int c0 = t.key_begin; c0 < t.key_end; c0 += 32) {
    // S_ij for key c = c0 + lane; hidden keys score -inf and are skipped below.
    const int c = c0 + int(lane);
    bool hidden = c >= t.key_end;
    float s = -INFINITY;
    if (!hidden) {
      const float add = masked ? mask.term(mask_row, c) : 0.0f;
      hidden = add == -INFINITY;
      if (!hidden) {
        float dot = 0.0f;
        for (int e = 0; e < E; ++e) dot += q_row[e] * k.at(kv_row0 + c, e);
        s = dot + add;
      }
    }
    float m_use;
    const float alpha = online_softmax_step(st.m, simd_max(isnan(s) ? -INFINITY : s), m_use);
    const float p = hidden ? 0.0f : exp2(s - m_use);
    st.l = st.l * alpha + p;
    p_row[lane] = hidden ? -1.0f : p;  // -1 marks a hidden key
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // o_i = alpha o_i + P_ij V_j over the visible keys only: a hidden key's
    // value never reaches the row, even when it holds NaN (0 x NaN is NaN).
    for (int i = 0; i < EPT; ++i) st.o[i] *= alpha;
    const int n = min(32, t.key_end - c0);
    for (int j = 0; j < n; ++j) {
      const float p_j = p_row[j];
      if (p_j < 0.0f) continue;
      for (int i = 0; i < EPT; ++i) {
        const int e = int(lane) + 32 * i;
        if (e < E) st.o[i] += p_j * v.at(kv_row0 + c0 + j, e);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // p_row is rewritten next tile
  }
  st.l = simd_sum(st.l);
  return st;
}

// Prefill (and unsplit decode): the normalised output row; lse (not null: a
// gradient will be taken): the row's log-sum-exp too, as the backward's
// rows pass would take it again.
// TO, the output's type: T, or float for float32 attention over 16-bit
// inputs (flash_rows_f32).
template <typename T, int EPT, typename KV, typename TO>
void flash_rows(
    const device T* q, KV k, KV v, const device float* mask_data,
    const device int64_t* mask_base, const device int* params, const device float* sinks, device TO* out,
    device float* lse, uint3 group, uint sg, uint lane, threadgroup float* q_tile, threadgroup float* p_tile) {
  const RowTask t = row_task(params, group, sg);
  const RowState<EPT> st = attend_row<T, EPT, KV>(
      q, k, v, make_mask(mask_data, mask_base, params), params, t, lane, q_tile + sg * 32 * EPT,
      p_tile + sg * 32);
  if (!t.valid) return;
  const int L = params[kL], E = params[kE];
  const float sink = sink_term(sinks, int(t.n_q % params[kHeadsQ]), st.m);
  const float inv = inverse_sum(st.l + sink);
  if (lse != nullptr && lane == 0) {
    lse[t.n_q * L + t.row] = row_lse(st.m, st.l, sink);
  }
  device TO* o = out + (t.n_q * L + t.row) * E;
  for (int i = 0; i < EPT; ++i) {
    const int e = int(lane) + 32 * i;
    if (e < E) store(o, e, st.o[i] * inv);
  }
}

// Decode with keys split across threadgroups: this split's unnormalised o_i
// and its (m_i, l_i), in slot split x rows_total + (n_q x L + row).
template <typename T, int EPT, typename KV>
void flash_decode(
    const device T* q, KV k, KV v, const device float* mask_data,
    const device int64_t* mask_base, const device int* params, device float* o_part,
    device float* ml_part, uint3 group, uint sg, uint lane, threadgroup float* q_tile,
    threadgroup float* p_tile) {
  const RowTask t = row_task(params, group, sg);
  const RowState<EPT> st = attend_row<T, EPT, KV>(
      q, k, v, make_mask(mask_data, mask_base, params), params, t, lane, q_tile + sg * 32 * EPT,
      p_tile + sg * 32);
  if (!t.valid) return;
  const int L = params[kL], E = params[kE];
  const int64_t slot = int64_t(group.z) * params[kRowsTotal] + t.n_q * L + t.row;
  for (int i = 0; i < EPT; ++i) {
    const int e = int(lane) + 32 * i;
    if (e < E) o_part[slot * E + e] = st.o[i];
  }
  if (lane == 0) {
    ml_part[2 * slot] = st.m;
    ml_part[2 * slot + 1] = st.l;
  }
}

}  // namespace fa
