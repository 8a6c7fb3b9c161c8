// Decode (FlashDecoding): few query rows per KV head against many keys.
//
// A block of 4 warps takes one (batch, KV head) group, up to 8 of its
// ratio x L query rows (rows ordered head-major: r = hh * L + l; a group with
// more has several row blocks, which read its keys once each), and one split
// of the keys; the splits are merged by fa_merge_* (or normalised here when
// there is one split). Each warp walks chunks of 32 keys, asking L2 for its
// next chunks' rows ahead of use:
//
//   QK: lane j scores key j of the chunk against all R rows (K row read once,
//       16-byte loads; the rows' queries are broadcast from shared memory)
//   online softmax per row across the warp (shuffles)
//   PV: lanes split the head dim (E / 32 consecutive elements each, one
//       vector load per row); P of the chunk is broadcast from shared
//       memory, each V row read once, coalesced, 8 rows' loads at a time
//
// Keys a row cannot see get P = 0 and are skipped in P V (never 0 x NaN).

#include <type_traits>

#include "decode_combine.cuh"
#include "unit.cuh"

namespace fa {

constexpr int kDecWarps = 4, kMaxRows = 8;
// Chunks ahead of the current one whose rows a warp has asked into L2.
constexpr int kAhead = 2;
// The fused merge's o loads a thread issues at once (decode_combine.cuh): few
// enough that the merge does not raise the kernel's registers (80 at E = 64).
constexpr int kDecMergeBatch = 8;

template <typename T>
struct Vec16;  // 16 bytes of T, as floats
template <>
struct Vec16<float> {
  static constexpr int N = 4;
  __device__ static void load(const float* p, float* out) {
    float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
};
template <typename H>
struct Vec16Half {
  static constexpr int N = 8;
  __device__ static void load(const H* p, float* out) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const H* h = reinterpret_cast<const H*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = to_f(h[i]);
  }
};
template <>
struct Vec16<__half> : Vec16Half<__half> {};
template <>
struct Vec16<__nv_bfloat16> : Vec16Half<__nv_bfloat16> {};

// EL consecutive elements of T as floats (zeros when !valid): one vector load
// where EL elements make 4, 8 or 16 aligned bytes.
template <typename T, int EL>
__device__ __forceinline__ void load_el(const T* p, bool valid, float* out) {
  constexpr int kBytes = EL * (int)sizeof(T);
  if (!valid) {
#pragma unroll
    for (int i = 0; i < EL; ++i) out[i] = 0.0f;
  } else if constexpr (kBytes == 4 || kBytes == 8 || kBytes == 16) {
    using Raw = typename std::conditional<kBytes == 4, uint32_t,
                typename std::conditional<kBytes == 8, uint2, uint4>::type>::type;
    const Raw raw = *reinterpret_cast<const Raw*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < EL; ++i) out[i] = to_f(h[i]);
  } else {
#pragma unroll
    for (int i = 0; i < EL; ++i) out[i] = to_f(p[i]);
  }
}

template <typename T, int E>
struct DecodeSmem {
  // The queries (scaled into the log2 domain) while keys are walked, then
  // the per-warp outputs while the warps are combined.
  union {
    float q[kMaxRows][E];
    float o[kDecWarps][kMaxRows][E];
  };
  float p[kDecWarps][kMaxRows][32];  // P of each warp's current chunk
  float m[kDecWarps][kMaxRows], l[kDecWarps][kMaxRows];
};

template <typename T, int E>
__device__ __forceinline__ void decode(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const void* mask_data,
                                       const int64_t* __restrict__ mask_base, T* __restrict__ out,
                                       float* __restrict__ o_part, float* __restrict__ ml_part,
                                       bool fused, unsigned long long tag,
                                       int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs,
                                       int mask_cs, int keys_per_split, float scale_log2,
                                       Layout lay) {
  // P V: lane j holds head-dim elements [EL j, EL j + EL) (one vector load
  // per value row), kVRows value rows' loads in flight together.
  constexpr int EL = E / 32;  // E % 32 == 0
  constexpr int kVRows = 8;
  using V16 = Vec16<T>;
  __shared__ DecodeSmem<T, E> sm;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
  // grid.y: KV heads x row blocks (a group's rows, kMaxRows at a time).
  const int ratio = H_q / H_kv, rows_per_group = ratio * L;
  const int row_blocks = (rows_per_group + kMaxRows - 1) / kMaxRows;
  const int split = blockIdx.x, g = blockIdx.y / row_blocks, r0 = blockIdx.y % row_blocks * kMaxRows;
  const int R = min(kMaxRows, rows_per_group - r0);
  const int64_t b = blockIdx.z;
  const T* k_head = k + lay.k.at(b, g, 0);
  const T* v_head = v + lay.v.at(b, g, 0);
  const int64_t ks = lay.k.sr, vs = lay.v.sr;
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const bool array_mask = mask.is_array();
  // Row r of the block, r0 + r of the group: query head g * ratio + (r0 + r) / L,
  // position (r0 + r) % L.
  auto head = [&](int r) { return g * ratio + (r0 + r) / L; };
  auto row_n = [&](int r) { return b * H_q + head(r); };
  auto pos = [&](int r) { return (r0 + r) % L; };

  const int c_begin = split * keys_per_split;
  const int c_end = min(S, c_begin + keys_per_split);
  // Key c's K and V rows, asked into L2 ahead of use: each warp keeps its
  // next kAhead chunks in flight while it works on one (a warp's own loads
  // would otherwise wait a full memory latency per chunk, for K and again
  // for V).
  auto prefetch_rows = [&](int c) {
    if (c < c_end) {
      const char* k_row = reinterpret_cast<const char*>(k_head + c * ks);
      const char* v_row = reinterpret_cast<const char*>(v_head + c * vs);
#pragma unroll
      for (int b = 0; b < E * (int)sizeof(T); b += 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(k_row + b));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(v_row + b));
      }
    }
  };
#pragma unroll
  for (int a = 0; a <= kAhead; ++a) prefetch_rows(c_begin + (a * kDecWarps + w) * 32 + lane);
  // The group's ticket armed while those rows are on their way.
  if (fused && tid == 0) arm_group_ticket(ml_part, (int64_t)gridDim.z * H_q * L, tag);

  for (int i = tid; i < R * E; i += kDecWarps * 32) {
    const int r = i / E, e = i % E;
    sm.q[r][e] = to_f(q[lay.q.at(b, head(r), pos(r)) + e]) * scale_log2;
  }
  __syncthreads();

  float m_i[kMaxRows], l_i[kMaxRows], o[kMaxRows][EL];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    m_i[r] = FA_NEG_INF, l_i[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < EL; ++i) o[r][i] = 0.0f;
  }

  for (int c0 = c_begin + w * 32; c0 < c_end; c0 += kDecWarps * 32) {
    const int c = c0 + lane;
    prefetch_rows(c + (kAhead + 1) * kDecWarps * 32);
    float s[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) s[r] = 0.0f;
    if (c < c_end) {
      const T* k_row = k_head + c * ks;
#pragma unroll
      for (int e0 = 0; e0 < E; e0 += V16::N) {
        float kv[V16::N];
        V16::load(k_row + e0, kv);
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < R) {
#pragma unroll
            for (int i = 0; i < V16::N; ++i) s[r] += sm.q[r][e0 + i] * kv[i];
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= R) break;
      const int l = pos(r);
      bool hidden = c >= c_end || mask.causal_hides(l, c);
      if (!hidden && array_mask) {
        const float t = mask.term(mask.row_base(row_n(r), l), c);
        hidden = t == FA_NEG_INF;
        s[r] += t;
      }
      if (hidden) s[r] = FA_NEG_INF;
      float mx = s[r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      float m_use;
      const float alpha = online_rescale<false>(m_i[r], mx, m_use);
      const float p = exp2f(s[r] - m_use);
      sm.p[w][r][lane] = p;
      const float sum = warp_sum(p);
      l_i[r] = l_i[r] * alpha + sum;
#pragma unroll
      for (int i = 0; i < EL; ++i) o[r][i] *= alpha;
    }
    __syncwarp();
    // P V, kVRows value rows at a time: all their loads are issued before
    // the first is used, so a chunk costs 32 / kVRows memory latencies, not
    // one per key (the V rows were never read before: HBM, not cache).
    const int keys = min(32, c_end - c0);
#pragma unroll
    for (int j0 = 0; j0 < 32; j0 += kVRows) {
      if (j0 >= keys) break;
      float vv[kVRows][EL];
#pragma unroll
      for (int j = 0; j < kVRows; ++j) {
        const T* v_row = v_head + (c0 + j0 + j) * vs;
        load_el<T, EL>(v_row + EL * lane, j0 + j < keys, vv[j]);
      }
#pragma unroll
      for (int j = 0; j < kVRows; ++j) {
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r >= R) break;
          const float p = sm.p[w][r][j0 + j];  // 0 past keys: set so above
          if (p != 0.0f) {  // hidden keys (p = 0) never reach the output
#pragma unroll
            for (int i = 0; i < EL; ++i) o[r][i] += p * vv[j][i];
          }
        }
      }
    }
    __syncwarp();
  }

  // Combine the 4 warps: m = max, weights 2^(m_w - m).
  __syncthreads();  // every warp is done with the queries: their space holds o now
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= R) break;
    if (lane == 0) sm.m[w][r] = m_i[r], sm.l[w][r] = l_i[r];
#pragma unroll
    for (int i = 0; i < EL; ++i) sm.o[w][r][EL * lane + i] = o[r][i];
  }
  __syncthreads();
  finish_decode_block<E, kDecMergeBatch>(sm.o, sm.m, sm.l, R, [&](int r) { return row_n(r) * L + pos(r); }, out, o_part, ml_part,
                      (int64_t)gridDim.z * H_q * L, fused, GroupSinks{sinks_of(mask_kind, mask_base), g * ratio, r0, L});
}

}  // namespace fa

// fa_decode_<dtype>_<E>: grid (splits x 128, H_kv x row blocks, batch), 128
// threads, one split; fa_decode_fused_<dtype>_<E>: several, merged in the
// same launch (decode_combine.cuh), the partials in its one output past the
// attention output (fused_scratch).
#if !defined(FA_E) || !defined(FA_PARTIAL)
#error "define FA_E and FA_PARTIAL"
#endif
#if FA_PARTIAL == 0
extern "C" __global__ void __launch_bounds__(128) FA_CAT5(fa_decode_, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base,
    FA_T* out, int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs,
    int keys_per_split, float scale_log2, FA_LAYOUT_PARAMS) {
  fa::decode<FA_T, FA_E>(q, k, v, mask, mask_base, out, nullptr, nullptr, false, 0, H_q, H_kv, L, S,
                         mask_kind, mask_rs, mask_cs, keys_per_split, scale_log2, FA_LAYOUT);
}
#else
extern "C" __global__ void __launch_bounds__(128) FA_CAT5(fa_decode_fused_, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base, FA_T* out,
    int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs, int keys_per_split, float scale_log2,
    FA_LAYOUT_PARAMS, int tag_lo, int tag_hi) {
  const fa::FusedScratch part = fa::fused_scratch<FA_E>(out, (int64_t)gridDim.z * H_q * L);
  fa::decode<FA_T, FA_E>(q, k, v, mask, mask_base, out, part.o_part, part.ml_part, true, fa::call_tag(tag_lo, tag_hi),
                         H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs, keys_per_split, scale_log2, FA_LAYOUT);
}
#endif
