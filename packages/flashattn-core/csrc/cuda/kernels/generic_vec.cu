// The generic kernel's split form (generic.cu) with 16-byte loads, for rows
// that start on 16-byte boundaries (the planner's aligned plan) and a head
// dim that is a multiple of VE = 16 / sizeof(T) elements, at most 32 VE.
//
// generic.cu's lane i holds elements i, i + 32, ...: a K or V row of a key
// is EPT loads of 2 or 4 bytes a lane. Here LK lanes (a power of two, at
// least E / VE) take a key, lane i of them elements [VE i, VE i + VE) in
// one 16-byte load, and a warp's 32 / LK segments walk their own keys (key
// c0 + W j + segment of each group), each with its own online-softmax state,
// merged across the segments at the end. At Phi-2's E = 80 in bfloat16 a
// warp's load instruction then reads two keys' 320 bytes instead of 64.
//
//   grid.x: query rows (B x H_q x L) / warps per block; grid.y: key splits

#include "combine.cuh"
#include "generic_walk.cuh"
#include "unit.cuh"

namespace fa {

template <typename T, int LK>
__device__ __forceinline__ void generic_attend_vec(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const void* mask_data, const int64_t* __restrict__ mask_base,
    float* __restrict__ o_part, float* __restrict__ ml_part,
    int B, int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs, int mask_cs,
    int keys_per_split, float scale_log2, Layout lay) {
  constexpr int VE = 16 / sizeof(T), W = 32 / LK;
  // Keys a segment takes a group: their K and V loads in flight together
  // (8 x 2 x 16 bytes a lane, as generic.cu's split kernel keeps 64
  // registers of them).
  constexpr int G = 8;
  static_assert(LK >= 1 && LK <= 32 && (LK & (LK - 1)) == 0, "a power of two of lanes a key");
  const GenericRow r(B, H_q, H_kv, L);
  if (!r.exists()) return;
  const int64_t rows = r.rows, row = r.row, n = r.n;
  const int lane = r.lane, split = r.split, l = r.l;
  const T *q_row = r.q_row(q, lay), *k_head = r.k_head(k, lay), *v_head = r.v_head(v, lay);
  const int seg = lane / LK, e0 = VE * (lane % LK);
  const bool has = e0 < E;  // lanes past the head dim hold zeros

  auto load = [&](const T* p, bool valid) {
    return valid ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
  };
  auto elem = [](const uint4& u, int i) { return to_f(reinterpret_cast<const T*>(&u)[i]); };
  float qv[VE], o[VE];
  {
    const uint4 qu = load(q_row + e0, has);
#pragma unroll
    for (int i = 0; i < VE; ++i) qv[i] = elem(qu, i) * scale_log2, o[i] = 0.0f;
  }
  Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const int c_begin = mask.key_begin(l, split * keys_per_split);
  const int c_end = mask.key_end(l, min(S, split * keys_per_split + keys_per_split));
  const bool masked = mask.is_array();
  const int64_t rb = masked ? mask.row_base(n, l) : 0;

  float m = FA_NEG_INF, l_sum = 0.0f;
  for (int c0 = c_begin; c0 < c_end; c0 += G * W) {
    // As generic.cu: every key of the range is read, a hidden one's score
    // and values never reach the output.
    uint4 kr[G], vr[G];
    float add[G];
    bool seen[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int c = c0 + j * W + seg;
      seen[j] = c < c_end;
      add[j] = masked && seen[j] ? mask.term(rb, c) : 0.0f;
      kr[j] = load(k_head + (int64_t)c * lay.k.sr + e0, seen[j] && has);
      vr[j] = load(v_head + (int64_t)c * lay.v.sr + e0, seen[j] && has);
    }
    float s[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < VE; ++i) dot += qv[i] * elem(kr[j], i);
      s[j] = dot;
    }
#pragma unroll
    for (int o_ = LK / 2; o_ > 0; o_ >>= 1)  // within the segment
#pragma unroll
      for (int j = 0; j < G; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], o_);
    add_key_group(s, seen, add, m, l_sum, o, [&](int j, int i) { return elem(vr[j], i); });
  }

  // The segments' states merged (as the split merge does: weights 2^(m_s - m)).
#pragma unroll
  for (int off = LK; off < 32; off <<= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l_sum, off);
    float a, c;
    merge_pair(m, l_sum, m2, l2, a, c);
#pragma unroll
    for (int i = 0; i < VE; ++i) o[i] = o[i] * a + __shfl_xor_sync(0xffffffffu, o[i], off) * c;
  }

  // The head's sink joins split 0's state (the merge weighs it like any split's).
  if (split == 0) {
    const float a = add_sink(m, l_sum, sink_log2(mask_kind, mask_base, int(n % H_q)));
#pragma unroll
    for (int i = 0; i < VE; ++i) o[i] *= a;
  }
  const int64_t slot = (int64_t)split * rows + row;
  if (lane == 0) {
    ml_part[slot * 2] = m;
    ml_part[slot * 2 + 1] = l_sum;
  }
  if (seg == 0 && has) {
    float4* dst = reinterpret_cast<float4*>(o_part + slot * E + e0);
#pragma unroll
    for (int i = 0; i < VE / 4; ++i) dst[i] = make_float4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
  }
}

}  // namespace fa

// fa_generic_vsplit_<dtype>_<LK> (-DFA_DTYPE, -DFA_LK): the same arguments as
// fa_generic_split_<dtype>_<EPT>; the partials go to fa_merge_<dtype>.
#if !defined(FA_LK)
#error "define FA_LK"
#endif
extern "C" __global__ void __launch_bounds__(128) FA_CAT5(fa_generic_vsplit_, FA_TNAME, _, FA_LK, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base,
    float* o_part, float* ml_part, int B, int H_q, int H_kv, int L, int S, int E,
    int mask_kind, int mask_rs, int mask_cs, int keys_per_split, float scale_log2,
    FA_LAYOUT_PARAMS) {
  fa::generic_attend_vec<FA_T, FA_LK>(q, k, v, mask, mask_base, o_part, ml_part, B, H_q, H_kv, L, S, E, mask_kind,
                                      mask_rs, mask_cs, keys_per_split, scale_log2, FA_LAYOUT);
}
