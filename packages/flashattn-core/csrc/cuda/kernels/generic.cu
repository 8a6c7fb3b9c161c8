// The generic kernel: any head dim up to 256, any dtype, every mask; also
// the decode path (few query rows, keys split across blocks: FlashDecoding)
// and the merge of split partials.
//
// One warp per query row; lane i holds head-dim elements i, i + 32, ...
// (EPT = ceil(E / 32) of them). Keys are walked a group at a time: scores by
// warp reductions, online softmax in registers, o += p v. Keys a row cannot
// see are skipped outright, so they never reach its output (even NaN).
//
//   grid.x: query rows (B x H_q x L) / warps per block; grid.y: key splits

#include "combine.cuh"
#include "generic_walk.cuh"
#include "merge_shapes.h"
#include "unit.cuh"

namespace fa {

template <typename T, int EPT, bool kPartial>
__device__ __forceinline__ void generic_attend(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const void* mask_data, const int64_t* __restrict__ mask_base,
    T* __restrict__ out, float* __restrict__ o_part, float* __restrict__ ml_part,
    int B, int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs, int mask_cs,
    int keys_per_split, float scale_log2, Layout lay) {
  const GenericRow r(B, H_q, H_kv, L);
  if (!r.exists()) return;
  const int64_t rows = r.rows, row = r.row, n = r.n;
  const int lane = r.lane, split = r.split, l = r.l;
  const T *q_row = r.q_row(q, lay), *k_head = r.k_head(k, lay), *v_head = r.v_head(v, lay);

  float qv[EPT], o[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    int e = lane + 32 * i;
    qv[i] = e < E ? to_f(q_row[e]) * scale_log2 : 0.0f;
    o[i] = 0.0f;
  }
  Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const int c_begin = mask.key_begin(l, split * keys_per_split);
  const int c_end = mask.key_end(l, min(S, split * keys_per_split + keys_per_split));
  const bool masked = mask.is_array();
  const int64_t rb = masked ? mask.row_base(n, l) : 0;

  // Keys go in groups of G: the group's K and V loads (and mask terms) are
  // issued together and its G scores reduced side by side, so a warp waits
  // about one memory latency a group, not two a key. The split kernel
  // (decode: few rows, each warp's latency is the call's) takes
  // G x EPT <= 32, the group's K and V in 64 registers; the other (many
  // rows: enough warps to hide latency) half that, as more registers cost it
  // warps (measured slower).
  constexpr int G = (EPT <= 2 ? 16 : EPT <= 4 ? 8 : 4) / (kPartial ? 1 : 2);
  float m = FA_NEG_INF, l_sum = 0.0f;
  for (int c0 = c_begin; c0 < c_end; c0 += G) {
    // Every key of the range is read (it lies in K and V whether hidden or
    // not), but a hidden key's score and values never reach the output.
    T kr[G][EPT], vr[G][EPT];
    float add[G];
    bool seen[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int c = c0 + j;
      seen[j] = c < c_end;
      add[j] = masked && seen[j] ? mask.term(rb, c) : 0.0f;
      const T* k_row = k_head + (int64_t)c * lay.k.sr;
      const T* v_row = v_head + (int64_t)c * lay.v.sr;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const int e = lane + 32 * i;
        kr[j][i] = seen[j] && e < E ? k_row[e] : from_f<T>(0.0f);
        vr[j][i] = seen[j] && e < E ? v_row[e] : from_f<T>(0.0f);
      }
    }
    float s[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < EPT; ++i) dot += qv[i] * to_f(kr[j][i]);
      s[j] = dot;
    }
#pragma unroll
    for (int o_ = 16; o_ > 0; o_ >>= 1)
#pragma unroll
      for (int j = 0; j < G; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], o_);
    add_key_group(s, seen, add, m, l_sum, o, [&](int j, int i) { return to_f(vr[j][i]); });
  }

  // The head's sink joins the row once: in the whole row, or in split 0's
  // state (the merge then weighs it like any split's).
  if (!kPartial || split == 0) {
    const float a = add_sink(m, l_sum, sink_log2(mask_kind, mask_base, int(n % H_q)));
#pragma unroll
    for (int i = 0; i < EPT; ++i) o[i] *= a;
  }
  if (kPartial) {
    const int64_t slot = (int64_t)split * rows + row;
    if (lane == 0) {
      ml_part[slot * 2] = m;
      ml_part[slot * 2 + 1] = l_sum;
    }
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      int e = lane + 32 * i;
      if (e < E) o_part[slot * E + e] = o[i];
    }
  } else {
    // Rows that saw no visible key (l = 0) are zeros, never NaN.
    const float inv = inverse_sum(l_sum);
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      int e = lane + 32 * i;
      if (e < E) out[row * E + e] = from_f<T>(o[i] * inv);
    }
  }
}

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* scratch) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  if (lane == 0) scratch[w] = x;
  __syncthreads();
  x = is_max ? FA_NEG_INF : 0.0f;
  for (int i = 0; i < nw; ++i) x = is_max ? fmaxf(x, scratch[i]) : x + scratch[i];
  __syncthreads();
  return x;
}

// The splits' partials merged (combine.cuh).
// One block per query row: the split weights go to shared memory once, then
// the threads take the head dim (merge_shapes.h). lse (not null): each
// row's log-sum-exp too (log2 domain, +inf where no split saw a key; with
// a sink, which split 0 holds, the sink's row is finite: its P and D are 0
// all the same).
template <typename T>
__device__ __forceinline__ void merge_splits(
    const float* __restrict__ o_part, const float* __restrict__ ml_part, T* __restrict__ out,
    int rows, int E, int splits, float* __restrict__ lse = nullptr) {
  constexpr int kWarps = merge_shapes::kThreads / 32, kMaxEL = 8;  // E <= 256
  __shared__ float weight[merge_shapes::kMaxSplits];
  __shared__ float scratch[32];
  __shared__ float part[kWarps][kMaxEL * 32];
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (row >= rows) return;
  float m = FA_NEG_INF;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) m = fmaxf(m, ml_part[((int64_t)s * rows + row) * 2]);
  m = block_reduce(m, true, scratch);
  const float base = exp_base(m);
  float l_sum = 0.0f;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    const int64_t slot = (int64_t)s * rows + row;
    const float wgt = merge_weight(ml_part[slot * 2], base);
    weight[s] = wgt;
    l_sum += wgt * ml_part[slot * 2 + 1];
  }
  l_sum = block_reduce(l_sum, false, scratch);  // its barrier also publishes weight[]
  // Each of the 16 warps sums every 16th split (coalesced over the head dim),
  // then the warps' sums are added: a few hundred splits cost a few memory
  // latencies per warp, not a hundred.
  float acc[kMaxEL] = {};
  // Unrolled so that several splits' loads are in flight at once (one at a
  // time, a few hundred splits cost a memory latency each).
#pragma unroll 8
  for (int s = w; s < splits; s += kWarps) {
    const float* src = o_part + ((int64_t)s * rows + row) * E;
    const float wgt = weight[s];
#pragma unroll
    for (int i = 0; i < kMaxEL; ++i) {
      const int e = lane + 32 * i;
      if (e < E) acc[i] += wgt * src[e];
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxEL; ++i) part[w][lane + 32 * i] = acc[i];
  __syncthreads();
  const float inv = inverse_sum(l_sum);
  if (lse != nullptr && threadIdx.x == 0) lse[row] = row_lse(l_sum != 0.0f, m, l_sum);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float sum = 0.0f;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) sum += part[ww][e];
    out[row * E + e] = from_f<T>(sum * inv);
  }
}

}  // namespace fa

// The extern "C" entry point of one unit (-DFA_DTYPE and -DFA_EPT with
// -DFA_PARTIAL=0|1, or -DFA_MERGE[ -DFA_LSE]): fa_generic_<dtype>_<EPT>,
// fa_generic_split_<dtype>_<EPT>, fa_merge_<dtype> or fa_merge_lse_<dtype>
// (each row's log-sum-exp as a second output, for a gradient).
// Arguments: inputs, then outputs, then scalars, as MLX passes them.
#if defined(FA_EPT) && FA_PARTIAL == 0
extern "C" __global__ void __launch_bounds__(128) FA_CAT5(fa_generic_, FA_TNAME, _, FA_EPT, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base,
    FA_T* out, int B, int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs,
    int mask_cs, int keys_per_split, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::generic_attend<FA_T, FA_EPT, false>(q, k, v, mask, mask_base, out, nullptr, nullptr, B,
                                          H_q, H_kv, L, S, E, mask_kind, mask_rs, mask_cs,
                                          keys_per_split, scale_log2, FA_LAYOUT);
}
#endif

#if defined(FA_EPT) && FA_PARTIAL == 1
extern "C" __global__ void __launch_bounds__(128) FA_CAT5(fa_generic_split_, FA_TNAME, _, FA_EPT, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base,
    float* o_part, float* ml_part, int B, int H_q, int H_kv, int L, int S, int E,
    int mask_kind, int mask_rs, int mask_cs, int keys_per_split, float scale_log2,
    FA_LAYOUT_PARAMS) {
  fa::generic_attend<FA_T, FA_EPT, true>(q, k, v, mask, mask_base, nullptr, o_part, ml_part,
                                         B, H_q, H_kv, L, S, E, mask_kind, mask_rs, mask_cs,
                                         keys_per_split, scale_log2, FA_LAYOUT);
}
#endif

#if defined(FA_MERGE) && !defined(FA_LSE)
extern "C" __global__ void __launch_bounds__(fa::merge_shapes::kThreads) FA_CAT3(fa_merge_, FA_TNAME, )(
    const float* o_part, const float* ml_part, FA_T* out, int rows, int E, int splits) {
  fa::merge_splits<FA_T>(o_part, ml_part, out, rows, E, splits);
}
#elif defined(FA_MERGE)
extern "C" __global__ void __launch_bounds__(fa::merge_shapes::kThreads) FA_CAT3(fa_merge_lse_, FA_TNAME, )(
    const float* o_part, const float* ml_part, FA_T* out, float* lse, int rows, int E, int splits) {
  fa::merge_splits<FA_T>(o_part, ml_part, out, rows, E, splits, lse);
}
#endif
