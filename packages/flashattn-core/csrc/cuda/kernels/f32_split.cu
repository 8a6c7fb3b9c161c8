// fa_f32_split_<E>: float32 queries, keys and values as two float16 terms
// side by side, each row [hi | lo] (2E halves), for the split-query prefill
// (prefill_f32s_wg.cu): float32 attention at float32 accuracy on float16
// tensor cores, which run at twice TF32's rate. float16 keeps TF32's 11
// significant bits but not its exponent range, so every tile of 128 rows of
// a (batch, head) is first scaled by a power of two of its own, its largest
// magnitude to [2^14, 2^15): hi is the scaled value rounded to float16, lo
// what hi left, rounded. hi + lo holds each value to 2^-22 of itself, or
// to 2^-38 of its tile's largest for values 2^-16 of it and below
// (float16's subnormals). The tile's shift goes to `shifts`
// (f32_split.cuh), kBad where the tile holds a value that is not finite.
//
// One launch for all three: block b of the grid (256 threads) takes tile b
// of Q's tiles, then K's, then V's. The inputs row-contiguous (MLX copies
// views first), the outputs packed. fa_f32_split4_<E> (-DFA_SPLIT4, below)
// does the same for the backward (backward_f32s_wg.cu).

#include <cstdint>

#include "unit.cuh"
#include "f32_split.cuh"

namespace {

constexpr int kThreads = fa::wg_shapes::kF32sSplitThreads;
using fa::f32_split::kRows;

// kFlag (the backward's split): a tile with a value that is not finite
// keeps the shift of its largest finite magnitude, kBad added
// (f32_split.cuh's Shifts), so that the plain products which read it still
// know its scale; no dst: the shift alone.
template <int E, bool kFlag = false>
__device__ __forceinline__ void split_tile(const float* __restrict__ src, __half* __restrict__ dst,
                                           int* __restrict__ shift_out, int rows, int tile, int64_t ld = E) {
  constexpr int C4 = E / 4, N = kRows * C4 / kThreads;
  static_assert(kRows * C4 % kThreads == 0, "the tile divides over the block");
  const int tid = threadIdx.x, r0 = tile * kRows;
  float4 x[N];
  uint32_t big = 0;  // the largest magnitude's bits (a NaN's above +inf's; kFlag: finite ones')
  bool bad = false;   // (kFlag) a value that is not finite
  // A view may start off a 16-byte boundary (the attention kernel's generic
  // fallback takes such calls; this launch still runs): 4-byte loads there.
  const bool vec = (reinterpret_cast<uintptr_t>(src) & 15) == 0 && ld % 4 == 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int idx = tid + i * kThreads, r = r0 + idx / C4, c = (idx % C4) * 4;
    const float* at = src + int64_t(r) * ld + c;
    x[i] = r >= rows ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
           : vec     ? *reinterpret_cast<const float4*>(at)
                     : make_float4(at[0], at[1], at[2], at[3]);
    if constexpr (kFlag) {
      for (const float y : {x[i].x, x[i].y, x[i].z, x[i].w}) {
        const uint32_t m = __float_as_uint(y) & 0x7fffffffu;
        bad |= m >= 0x7f800000u;
        big = max(big, m < 0x7f800000u ? m : 0u);
      }
    } else {
      big = max(big, max(max(__float_as_uint(x[i].x) & 0x7fffffffu, __float_as_uint(x[i].y) & 0x7fffffffu),
                         max(__float_as_uint(x[i].z) & 0x7fffffffu, __float_as_uint(x[i].w) & 0x7fffffffu)));
    }
  }
  __shared__ uint32_t warp_big[kThreads / 32];
  big = __reduce_max_sync(0xffffffffu, big);
  if (tid % 32 == 0) warp_big[tid / 32] = big;
  if constexpr (kFlag) {
    bad = __syncthreads_or(bad);
  } else {
    __syncthreads();
  }
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) big = max(big, warp_big[w]);
  int shift = 0;
  if (!kFlag && big >= 0x7f800000u) {
    shift = fa::f32_split::kBad;
  } else if (big != 0) {
    int ex;
    frexpf(__uint_as_float(big), &ex);  // big in [2^(ex - 1), 2^ex)
    shift = 15 - ex;
  }
  if (tid == 0) *shift_out = bad ? shift + fa::f32_split::kBad : shift;
  if (!kFlag && shift == fa::f32_split::kBad) shift = 0;  // the tile is never read
  if (kFlag && dst == nullptr) return;                      // (the shift alone)
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int idx = tid + i * kThreads, r = r0 + idx / C4, c = (idx % C4) * 4;
    if (r >= rows) continue;
    const float y[4] = {ldexpf(x[i].x, shift), ldexpf(x[i].y, shift), ldexpf(x[i].z, shift),
                        ldexpf(x[i].w, shift)};
    union {
      __half t[4];
      uint2 u;
    } hi, lo;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      hi.t[j] = __float2half_rn(y[j]);
      lo.t[j] = __float2half_rn(y[j] - __half2float(hi.t[j]));
    }
    __half* row = dst + int64_t(r) * 2 * E;
    *reinterpret_cast<uint2*>(row + c) = hi.u;
    *reinterpret_cast<uint2*>(row + E + c) = lo.u;
  }
}

}  // namespace

#if !defined(FA_E)
#error "define FA_E"
#endif

#if defined(FA_SPLIT4)
// fa_f32_split4_<E>: for the backward (backward_f32s_wg.cu), k and v read
// where they lie (each one's batch, head and row strides) into packed rows
// of two terms, and the shifts of q's, k's, v's and dO's tiles, as
// f32_split.cuh's Shifts (dO's after V's; the keys pass makes Q's and dO's
// terms itself). Grid: 2 q_slices tiles(L) + 2 kv_slices tiles(S) blocks.
extern "C" __global__ void __launch_bounds__(kThreads) FA_CAT3(fa_f32_split4_, FA_E, )(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ d_out, __half* __restrict__ k2, __half* __restrict__ v2, int* __restrict__ shifts,
    int q_slices, int kv_slices, int H_q, int H_kv, int L, int S,
    int q_sb, int q_sh, int q_sr, int k_sb, int k_sh, int k_sr, int v_sb, int v_sh, int v_sr, int d_sb, int d_sh,
    int d_sr) {
  const int tq = fa::f32_split::tiles(L), tk = fa::f32_split::tiles(S);
  int64_t b = blockIdx.x;
  const int64_t nq = int64_t(q_slices) * tq, nk = int64_t(kv_slices) * tk;
  // Block b's array: Q's tiles, K's, V's, then dO's, as the shifts lie.
  const float* src;
  __half* dst;
  int64_t sb, sh, sr, first = 0;
  int heads, rows, tiles;
  if (b < nq || b >= nq + 2 * nk) {
    const bool is_d = b >= nq;
    first = is_d ? nq + 2 * nk : 0;
    src = is_d ? d_out : q, dst = nullptr, heads = H_q, rows = L, tiles = tq;
    sb = is_d ? d_sb : q_sb, sh = is_d ? d_sh : q_sh, sr = is_d ? d_sr : q_sr;
  } else {
    const bool is_v = b >= nq + nk;
    first = is_v ? nq + nk : nq;
    src = is_v ? v : k, dst = is_v ? v2 : k2, heads = H_kv, rows = S, tiles = tk;
    sb = is_v ? v_sb : k_sb, sh = is_v ? v_sh : k_sh, sr = is_v ? v_sr : k_sr;
  }
  const int64_t slice = (b - first) / tiles;
  split_tile<FA_E, true>(src + slice / heads * sb + slice % heads * sh, dst ? dst + slice * rows * 2 * FA_E : dst,
                         shifts + b, rows, int((b - first) % tiles), sr);
}
#else
// q: q_slices x L x FA_E, k and v: kv_slices x S x FA_E (slices: batch x
// heads), row-contiguous; q2, k2, v2 the same with rows of 2 FA_E halves;
// shifts as f32_split.cuh's Shifts. Grid: q_slices tiles(L) + 2 kv_slices
// tiles(S) blocks.
extern "C" __global__ void __launch_bounds__(kThreads) FA_CAT3(fa_f32_split_, FA_E, )(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, __half* __restrict__ q2,
    __half* __restrict__ k2, __half* __restrict__ v2, int* __restrict__ shifts, int q_slices, int kv_slices, int L,
    int S) {
  const int tq = fa::f32_split::tiles(L), tk = fa::f32_split::tiles(S);
  int64_t b = blockIdx.x;
  const int64_t nq = int64_t(q_slices) * tq, nk = int64_t(kv_slices) * tk;
  if (b < nq) {
    const int64_t slice = b / tq;
    split_tile<FA_E>(q + slice * L * FA_E, q2 + slice * L * 2 * FA_E, shifts + b, L, int(b % tq));
    return;
  }
  b -= nq;
  const bool is_v = b >= nk;
  if (is_v) b -= nk;
  const int64_t slice = b / tk;
  split_tile<FA_E>((is_v ? v : k) + slice * S * FA_E, (is_v ? v2 : k2) + slice * S * 2 * FA_E,
                   shifts + nq + (is_v ? nk : 0) + b, S, int(b % tk));
}
#endif
