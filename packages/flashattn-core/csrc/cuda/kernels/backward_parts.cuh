// What the two backward kernels share (backward.cu on TF32 for every dtype,
// backward_f16.cu on 16-bit tensor cores): the blocks' order, the softmax
// steps on a warp's tile of scores (accumulator layout: rows g and g + 8,
// columns 2t and 2t + 1 of each 8-column block), the guarded product for
// tiles that hold values that are not finite, and the gradients' stores.
// FlashAttention-2's Algorithm 2 with P = softmax(S):
//   dV = P^T dO    dP = dO V^T    D = rowsum(dO * O)    dS = P * (dP - D)
// kFast: the steps' exponentials by fast_exp2 (the 16-bit kernels) or exp2f.

#pragma once

#include "common.cuh"
#include "softmax.cuh"

namespace fa {

// Where the backward reads Q, K, V, O and dO, and where its keys pass
// stores dK and dV (the gradients in the inputs' dtype): each array's rows
// as they lie, mlx-lm's transposed (B, L, H, E) views included, so that no
// launch copies them first nor after (cuda/backward_node.cpp). The 16-bit
// kernels' dQ and group sums are float32 rows of their own, row-contiguous;
// backward.cu's dQ takes a layout too (FA_BACKWARD_DQ_PARAMS).
struct BackwardLayout {
  Rows q, k, v, o, d_out, dk, dv;
  // Whether the inputs' rows all lie 16 bytes apart (16-bit elements).
  __device__ __forceinline__ bool rows16() const {
    const int bits = q.sb | q.sh | q.sr | k.sb | k.sh | k.sr | v.sb | v.sh | v.sr | o.sb | o.sh | o.sr | d_out.sb |
                     d_out.sh | d_out.sr;
    return (bits & 7) == 0;
  }
};

// The layout as the last launch arguments of the backward's kernels.
#define FA_BACKWARD_LAYOUT_PARAMS                                                                             \
  int q_sb, int q_sh, int q_sr, int k_sb, int k_sh, int k_sr, int v_sb, int v_sh, int v_sr, int o_sb, int o_sh, \
      int o_sr, int do_sb, int do_sh, int do_sr, int dk_sb, int dk_sh, int dk_sr, int dv_sb, int dv_sh, int dv_sr
#define FA_BACKWARD_LAYOUT                                                                              \
  fa::BackwardLayout{{q_sb, q_sh, q_sr},    {k_sb, k_sh, k_sr},    {v_sb, v_sh, v_sr}, {o_sb, o_sh, o_sr}, \
                     {do_sb, do_sh, do_sr}, {dk_sb, dk_sh, dk_sr}, {dv_sb, dv_sh, dv_sr}}

// Row-contiguous arrays (the probes' layout): (B, H_q, L, E) queries, (B,
// H_kv, S, E) keys.
__host__ __device__ __forceinline__ BackwardLayout contiguous_backward_layout(int H_q, int H_kv, int L, int S, int E) {
  const Rows rq{H_q * L * E, L * E, E}, rk{H_kv * S * E, S * E, E};
  return {rq, rk, rk, rq, rq, rk, rk};
}

// Head n (b H + h) of x, laid out as r says.
template <typename T>
__device__ __forceinline__ T* head_of(T* x, const Rows& r, int64_t n, int H) {
  return x + r.at(n / H, n % H, 0);
}

// Row r of a block's query head (n = b H_q + h), or of its KV head, in an
// array laid out as x says: the batch's offset in 64 bits, the head's and
// the row's in 32 (the host reads an array in place only where one batch
// element's offsets fit an int: cuda/node.cpp). Kept as the batch and head,
// ints, so that each array's offset is made where it is read.
struct RowAt {
  int batch, head, kv_head;
  __device__ __forceinline__ RowAt(int64_t n, int H_q, int H_kv)
      : batch(int(n) / H_q), head(int(n) % H_q), kv_head(int(n) % H_q / (H_q / H_kv)) {}
  __device__ __forceinline__ int64_t operator()(const Rows& x, int r) const {
    return int64_t{batch} * x.sb + (head * x.sh + r * x.sr);
  }
  __device__ __forceinline__ int64_t kv(const Rows& x, int r) const {
    return int64_t{batch} * x.sb + (kv_head * x.sh + r * x.sr);
  }
};

// The blocks of a pass: grid.x = tiles x slices (slice: batch x head, the
// query head's), slice-minor, so that blocks start tile by tile in every
// slice at once: the heaviest tiles under a causal mask (the last rows, the
// first keys) are given the lowest tile index and start first. grid.z: the
// gradient's column half (out_cols wide).
struct BackwardBlock {
  int64_t slice;
  int tile, col0;
  __device__ BackwardBlock(int64_t slices, int out_cols)
      : slice(blockIdx.x % slices), tile(int(blockIdx.x / slices)), col0(blockIdx.z * out_cols) {}
};

// The rows pass's scores (rows ra, ra + 8 against keys c0 ...) into the log2
// domain, -inf where hidden; rb: the rows' bases in an array mask.
template <int NB>
__device__ __forceinline__ void mask_row_scores(float (&s)[NB][4], const Mask& mask, const int64_t (&rb)[2], int ra,
                                                int c0, bool need_mask, float scale_log2, int t, int L, int S) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ra + 8 * (i >> 1), c = c0 + nb * 8 + 2 * t + (i & 1);
      float x = s[nb][i] * scale_log2;
      if (need_mask) {
        const float add = mask.hides(rb[i >> 1], r, c, L, S) ? FA_NEG_INF
                          : mask.is_array()                   ? mask.term(rb[i >> 1], c)
                                                              : 0.0f;
        x = add == FA_NEG_INF ? FA_NEG_INF : x + add;
      }
      s[nb][i] = x;
    }
}

// One tile of the rows' log-sum-exp: the forward's online softmax without V.
template <int NB, bool kFast = false>
__device__ __forceinline__ void lse_step(const float (&s)[NB][4], float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = FA_NEG_INF;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * rr], s[nb][2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float base;
    l[rr] *= online_rescale<kFast>(m[rr], mx, base);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      l[rr] += exp2_of<kFast>(s[nb][2 * rr] - base) + exp2_of<kFast>(s[nb][2 * rr + 1] - base);
    }
  }
}

// The rows' log-sum-exp (log2 domain) once every tile has passed, with the
// head's attention sink (sink2: log2 domain, -inf for none) in it, so that
// P = 2^(s - lse) is the forward's.
__device__ __forceinline__ void lse_final(float (&m)[2], float (&l)[2], float (&lse)[2], float sink2) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    // A row that sees no key: +inf, so that every P = 2^(s - lse) of it is 0
    // (its O and D are 0 too, so a sink's gradient gets nothing from it).
    if (l[rr] == 0.0f) {
      lse[rr] = INFINITY;
    } else {
      add_sink(m[rr], l[rr], sink2);
      lse[rr] = row_lse(true, m[rr], l[rr]);
    }
  }
}

// s (masked scores) becomes dS = P (dP - D) in the rows pass.
template <int NB, bool kFast = false>
__device__ __forceinline__ void row_ds(float (&s)[NB][4], const float (&dp)[NB][4], const float (&lse)[2],
                                       const float (&D)[2]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float p = s[nb][i] == FA_NEG_INF ? 0.0f : exp2_of<kFast>(s[nb][i] - lse[i >> 1]);  // (hidden: 0)
      // p = 0 (a hidden key): dS = 0 whatever dP holds (NaN of a hidden value).
      s[nb][i] = p == 0.0f ? 0.0f : p * (dp[nb][i] - D[i >> 1]);
    }
}

// The keys pass's transposed tile (keys ka, ka + 8 against rows r0 ...): p
// holds S^T and ds dP^T on entry, P^T and dS^T on return; lse_s and d_s:
// the rows' statistics (lse = +inf past L).
template <int NB, bool kFast = false>
__device__ __forceinline__ void key_tile_ds(float (&p)[NB][4], float (&ds)[NB][4], const Mask& mask, int64_t n,
                                            int ka, int r0, bool need_mask, const float* lse_s, const float* d_s,
                                            float scale_log2, int t, int L, int S) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = ka + 8 * (i >> 1), j = nb * 8 + 2 * t + (i & 1), r = r0 + j;
      float x = p[nb][i] * scale_log2;
      bool hidden = false;
      if (need_mask) {
        const int64_t rb = mask.is_array() && r < L ? mask.row_base(n, r) : 0;
        const float add = mask.hides(rb, r, c, L, S) ? FA_NEG_INF
                          : mask.is_array()          ? mask.term(rb, c)
                                                     : 0.0f;
        hidden = add == FA_NEG_INF;
        x = hidden ? FA_NEG_INF : x + add;
      }
      // A hidden key's P is 0 even where the row's log-sum-exp is NaN (a
      // value the row sees that is not finite): its gradients stay the
      // keys' own.
      const float pv = hidden ? 0.0f : exp2_of<kFast>(x - lse_s[j]);
      p[nb][i] = pv;
      ds[nb][i] = pv == 0.0f ? 0.0f : pv * (ds[nb][i] - d_s[j]);
    }
}

// acc += W X for a tile of X that holds a value that is not finite: in
// float32 FMA, skipping zero weights, so that a value a row (or key) cannot
// see never meets its zero weight (0 x inf is NaN). W: 16 rows x K, the
// thread's two rows' weights of column k from w_at(k, p); x_at(k, c): X's
// element (k, c) as a float, whatever the tile's layout. Rare: not unrolled
// over k.
template <int K, int NO, typename WAt, typename At>
__device__ __forceinline__ void accumulate_guarded_by(float (&acc)[NO][4], WAt w_at, At x_at, int lane) {
  const int t = lane & 3;
#pragma unroll 1
  for (int k = 0; k < K; ++k) {
    float p[2];
    w_at(k, p);
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (p[i >> 1] != 0.0f) acc[eb][i] = fmaf(p[i >> 1], x_at(k, eb * 8 + 2 * t + (i & 1)), acc[eb][i]);
  }
}

// The same for W (16 x NB*8) in registers, in the accumulator layout
// (accumulator_column, common.cuh).
template <int NB, int NO, typename At>
__device__ __forceinline__ void accumulate_guarded_at(float (&acc)[NO][4], const float (&w)[NB][4], At x_at,
                                                      int lane) {
  accumulate_guarded_by<NB * 8, NO>(acc, [&](int k, float (&p)[2]) { accumulator_column(w, k, lane, p); }, x_at,
                                    lane);
}

// The same for X's rows LD apart in shared memory (float32 or 16-bit), its
// columns from col0.
template <typename X, int LD, int NB, int NO>
__device__ __forceinline__ void accumulate_guarded(float (&acc)[NO][4], const float (&w)[NB][4], const X* x_rows,
                                                   int col0, int lane) {
  accumulate_guarded_at<NB, NO>(acc, w, [&](int k, int c) { return to_f(x_rows[k * LD + col0 + c]); }, lane);
}

template <int NO>
__device__ __forceinline__ void zero(float (&acc)[NO][4]) {
#pragma unroll
  for (int eb = 0; eb < NO; ++eb)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[eb][i] = 0.0f;
}

// acc's rows (accumulator layout: rows r0, r0 + 8 of this thread, columns
// col0 + ...) times `mul` into dst (E columns, rows ld apart), rows < N.
template <typename T, int NO>
__device__ __forceinline__ void store_acc(const float (&acc)[NO][4], T* dst, int r0, int N, int E, int col0,
                                          float mul, int lane, int64_t ld) {
  const int t = lane & 3;
#pragma unroll
  for (int eb = 0; eb < NO; ++eb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + 8 * (i >> 1), e = col0 + eb * 8 + 2 * t + (i & 1);
      if (r < N && e < E) dst[r * ld + e] = from_f<T>(acc[eb][i] * mul);
    }
}

// acc times `mul` added into dst (float32, E columns, rows ld apart) at
// rows r0, r0 + 8 (< N): the query heads of a GQA group add their share of
// dK and dV.
template <int NO>
__device__ __forceinline__ void add_acc(const float (&acc)[NO][4], float* dst, int r0, int N, int E, int col0,
                                        float mul, int lane, int64_t ld) {
  const int t = lane & 3;
#pragma unroll
  for (int eb = 0; eb < NO; ++eb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + 8 * (i >> 1), e = col0 + eb * 8 + 2 * t + (i & 1);
      if (r < N && e < E) atomicAdd(dst + r * ld + e, acc[eb][i] * mul);
    }
}

// A keys block's dK and dV (rows ka, ka + 8 of this thread; columns from
// col0) into the KV head's gradients dk and dv (rows dk_ld and dv_ld
// apart): stored in T without GQA, else added into the float32 sums of the
// group's query heads (zeros before the launch), and then only by a block
// that saw some row (`any_rows`).
template <typename T, int NO>
__device__ __forceinline__ void store_dk_dv(const float (&dk_acc)[NO][4], const float (&dv_acc)[NO][4], void* dk,
                                            void* dv, int64_t dk_ld, int64_t dv_ld, bool group_sums, bool any_rows,
                                            int ka, int S, int E, int col0, float scale, int lane) {
  if (!group_sums) {
    store_acc<T, NO>(dk_acc, static_cast<T*>(dk), ka, S, E, col0, scale, lane, dk_ld);
    store_acc<T, NO>(dv_acc, static_cast<T*>(dv), ka, S, E, col0, 1.0f, lane, dv_ld);
  } else if (any_rows) {
    add_acc<NO>(dk_acc, static_cast<float*>(dk), ka, S, E, col0, scale, lane, dk_ld);
    add_acc<NO>(dv_acc, static_cast<float*>(dv), ka, S, E, col0, 1.0f, lane, dv_ld);
  }
}

}  // namespace fa
