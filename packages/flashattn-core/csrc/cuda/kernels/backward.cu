// FlashAttention-2's backward (Algorithm 2) on TF32 tensor cores
// (mma.sync m16n8k8), for every dtype, mask and head dim up to 256. With
// P = softmax(S), S = scale Q K^T + mask over the visible keys:
//   dV = P^T dO    dP = dO V^T    D = rowsum(dO * O)    dS = P * (dP - D)
//   dQ = scale dS K    dK = scale dS^T Q
// Two passes, so that dQ and dK / dV each have one writer a block:
//   fa_backward_rows: 4 warps x 16 query rows. A row's log-sum-exp (the
//     forward's where the launch has it, kLse; else a first walk over the
//     keys takes it again), D, and dQ; writes (lse, D) per row for
//   fa_backward_keys: 4 warps x 16 keys against one query head's rows. dK
//     and dV; under GQA each head of a group adds its share (float32
//     atomics, K and V never repeated).
// Both recompute P from the scores and the row's log-sum-exp; never an
// L x S buffer. Where the forward kept the log-sum-exp and E <= 128, the
// keys pass makes dQ too (fa_backward_keysq: FlashAttention-2's dQ += dS K
// by float32 atomics into zeros) after fa_backward_d has written (lse, D):
// the rows pass's second walk of S and dP, three products of seven, saved
// for one.
//
// float32 inputs take the 3xTF32 split (hi*hi + hi*lo + lo*hi: float32
// accuracy, mma.cuh); float16 and bfloat16 values are exact in TF32, so their
// products take one term, with P and dS rounded to TF32 (10 bits, more than
// either 16-bit type keeps). The kernels read Q, K, V, O and dO where they
// lie and store dQ, dK and dV laid out as them (BackwardLayout and dQ's
// rows, the launches' last arguments; cuda/backward_node.cpp).

#include <type_traits>

#include "backward_parts.cuh"
#include "backward_shapes.h"
#include "mma.cuh"
#include "unit.cuh"

namespace fa {

namespace bs = backward_shapes;

// An input element as TF32 operand parts (lo = 0 without the split).
// kFinite: of a tile whose values are all finite (the block's flags say so),
// split without split_tf32's guard for +-inf, two instructions fewer.
template <bool kSplit, bool kFinite = false>
__device__ __forceinline__ void input_operand(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kSplit && kFinite) {
    split_finite(x, hi, lo);
  } else if constexpr (kSplit) {
    split_tf32(x, hi, lo);
  } else {
    hi = __float_as_uint(x);
    lo = 0;
  }
}
// The same for the A side of a score product (split_tf32_query: an infinite
// input meets a zero part without making NaN of x * inf). kFinite: both
// operands' tiles hold finite values only, so split_finite does (two
// instructions where split_tf32_query takes six).
template <bool kSplit, bool kFinite = false>
__device__ __forceinline__ void query_operand(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kSplit && kFinite) {
    split_finite(x, hi, lo);
  } else if constexpr (kSplit) {
    split_tf32_query(x, hi, lo);
  } else {
    hi = __float_as_uint(x);
    lo = 0;
  }
}
// A computed value (P or dS): split, or rounded to nearest TF32.
template <bool kSplit>
__device__ __forceinline__ void computed_operand(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kSplit) {
    split_tf32(x, hi, lo);
  } else {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    lo = 0;
  }
}

template <bool kSplit>
__device__ __forceinline__ void mma_terms(float* c, const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0,
                                          uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  if constexpr (kSplit) {
    mma1688_tf32(c, al, bh0, bh1);
    mma1688_tf32(c, ah, bl0, bl1);
  }
  mma1688_tf32(c, ah, bh0, bh1);
}

// ROWS rows of E elements from src (rows ld apart) into dst as float32
// (row stride LD), zeros past `count` rows and past E columns. Returns
// whether this thread saw a value that is not finite.
template <typename T, int EB, int ROWS>
__device__ __forceinline__ bool load_rows(float* dst, const T* src, int64_t ld, int count, int E) {
  bool bad = false;
  for (int idx = threadIdx.x; idx < ROWS * EB; idx += bs::kThreads) {
    const int r = idx / EB, e = idx % EB;
    const float x = r < count && e < E ? to_f(src[r * ld + e]) : 0.0f;
    bad |= !isfinite(x);
    dst[r * bs::ld(EB) + e] = x;
  }
  return bad;
}

// The same for float32 rows of exactly EB elements, each at a 16-byte
// boundary (every float32 call at E = 64, 128 or 256 whose rows lie so): the
// tiles' 16-byte chunks copied by cp.async, all in flight at once, where
// load_rows's element loads went a few at a time. RowCopy::issue starts a tile's copies; after
// cp_async_wait_all, RowCopy::bad says whether the chunks this thread copied
// hold a value that is not finite (its own copies are visible to it without
// a barrier).
template <int EB, int ROWS>
struct RowCopy {
  static constexpr int CH = EB / 4, PER = ROWS * CH / bs::kThreads;
  static_assert(ROWS * CH % bs::kThreads == 0, "whole chunks a thread");
  template <typename T>
  static __device__ __forceinline__ bool takes(const T* src, int64_t ld, int E) {
    return std::is_same<T, float>::value && E == EB && (reinterpret_cast<uintptr_t>(src) & 15) == 0 && ld % 4 == 0;
  }
  // One source pointer stepped from chunk to chunk (a thread's chunks lie
  // kThreads / CH rows apart) rather than a 64-bit product a chunk.
  static __device__ __forceinline__ void issue(float* dst, const float* src, int64_t ld, int count) {
    static_assert(bs::kThreads % CH == 0, "a thread's chunks in one column");
    constexpr int kStep = bs::kThreads / CH;
    const int r0 = threadIdx.x / CH, c = threadIdx.x % CH * 4;
    const float* from = src + r0 * ld + c;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const bool valid = r0 + i * kStep < count;
      cp_async16(dst + (r0 + i * kStep) * bs::ld(EB) + c, valid ? from : src, valid);
      from += kStep * ld;
    }
  }
  static __device__ __forceinline__ bool bad(const float* dst) {
    bool b = false;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int idx = threadIdx.x + i * bs::kThreads, r = idx / CH, c = idx % CH * 4;
      const float4 x = *reinterpret_cast<const float4*>(dst + r * bs::ld(EB) + c);
      b |= !(isfinite(x.x) && isfinite(x.y) && isfinite(x.z) && isfinite(x.w));
    }
    return b;
  }
};

// Two tiles of ROWS rows from a and b (rows lda and ldb apart, count of
// them) into da and db as load_rows does; the flags of each.
template <typename T, int EB, int ROWS>
__device__ __forceinline__ void load_two(float* da, const T* a, int64_t lda, float* db, const T* b, int64_t ldb,
                                         int count, int E, bool& bad_a, bool& bad_b) {
  using Copy = RowCopy<EB, ROWS>;
  if (Copy::takes(a, lda, E) && Copy::takes(b, ldb, E)) {
    Copy::issue(da, reinterpret_cast<const float*>(a), lda, count);
    Copy::issue(db, reinterpret_cast<const float*>(b), ldb, count);
    cp_async_commit();
    cp_async_wait_all();
    bad_a = Copy::bad(da);
    bad_b = Copy::bad(db);
  } else {
    bad_a = load_rows<T, EB, ROWS>(da, a, lda, count, E);
    bad_b = load_rows<T, EB, ROWS>(db, b, ldb, count, E);
  }
}

// s = A B^T for the warp's 16 rows of A (a_rows) against NB x 8 rows of B
// (b_rows), both in shared memory, inner dim EB; kFinite: A's and B's values
// all finite (query_operand, input_operand).
template <bool kSplit, int NB, int EB, bool kFinite = false>
__device__ __forceinline__ void scores(float (&s)[NB][4], const float* a_rows, const float* b_rows, int lane) {
  constexpr int LD = bs::ld(EB);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nb][i] = 0.0f;
  // The fragments by ldmatrix on 32-bit words: each 8 x 8 16-bit matrix is
  // 8 rows x 4 floats, and lane 4 g + t receives row g's float t, the
  // m16n8k8 TF32 layout (one instruction for four matrices where scalar
  // loads took four). Lane l addresses row l % 8 of matrix l / 8.
  static_assert(NB % 2 == 0, "n-blocks in pairs");
  const float* a_lane = a_rows + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 4;
  const float* b_lane = b_rows + ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 4;
  // Whole at E = 64 in the units compiled for one mask kind (FA_KIND, below),
  // where the registers allow it (249): later steps' loads and splits then
  // issue under earlier products (the keys pass with dQ 0.97x the time at
  // qwen05b causal 8K). The other units' mask code would spill.
#if defined(FA_KIND)
  constexpr int kUnroll = EB == 64 ? EB / 8 : 2;
#else
  constexpr int kUnroll = 2;
#endif
#pragma unroll kUnroll
  for (int kk = 0; kk < EB / 8; ++kk) {
    uint32_t a[4], ah[4], al[4];
    ldmatrix_x4(a, a_lane + kk * 8);  // rows g, g + 8 x columns t, t + 4
#pragma unroll
    for (int i = 0; i < 4; ++i) query_operand<kSplit, kFinite>(__uint_as_float(a[i]), ah[i], al[i]);
#pragma unroll
    for (int nb = 0; nb < NB; nb += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, b_lane + nb * 8 * LD + kk * 8);  // n-blocks nb, nb + 1 x columns t, t + 4
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t bh0, bl0, bh1, bl1;
        input_operand<kSplit, kFinite>(__uint_as_float(b[2 * h]), bh0, bl0);
        input_operand<kSplit, kFinite>(__uint_as_float(b[2 * h + 1]), bh1, bl1);
        mma_terms<kSplit>(s[nb + h], ah, al, bh0, bh1, bl0, bl1);
      }
    }
  }
}

// scores for tiles whose values are all finite (`finite`: both flags said
// so) or not: the split takes no care for infinities where none can meet.
// (One variant for every tile that holds another value: rare, and a third
// variant cost the keys pass registers.)
template <bool kSplit, int NB, int EB>
__device__ __forceinline__ void scores_of(float (&s)[NB][4], const float* a_rows, const float* b_rows, bool finite,
                                          int lane) {
  if (finite) {
    scores<kSplit, NB, EB, true>(s, a_rows, b_rows, lane);
  } else {
    scores<kSplit, NB, EB>(s, a_rows, b_rows, lane);
  }
}

// acc (16 x NO*8) += W X[:, col0 ..], W (16 x NB*8) in the accumulator
// layout (P or dS), X's NB*8 rows in shared memory. Each call's
// products start from zero and join acc by a float32 add: a gradient sums
// thousands of tiles (dK and dV every row of a GQA group), and chaining them
// all through the tensor cores' accumulation cost float32 accuracy (dV of
// 7 x 1000 rows: 5e-5 relative, against 2e-5 wanted). X's values are all
// finite: a tile that holds another value takes accumulate_guarded.
//
// Where the NO partial sums fit (E = 64: 32 registers), the inner step is the
// outer loop: each step's A fragment made once and NO independent products
// issued on it, where output-block order chains NB x 3 products into one
// accumulator and holds every step's fragment (the keys pass with dQ 0.99x
// the time at qwen05b causal 8K with 64-row tiles; at E = 128 the partials
// spill).
template <bool kSplit, int NB, int NO, int EB>
__device__ __forceinline__ void accumulate(float (&acc)[NO][4], const float (&w)[NB][4], const float* x_rows,
                                           int col0, int lane) {
  constexpr int LD = bs::ld(EB);
  const int g = lane >> 2, t = lane & 3;
  const float* xr = x_rows + col0 + g;
  // X's B fragment of inner step kb and output block eb, times A into c.
  auto product = [&](float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], int kb, int eb) {
    uint32_t bh0, bl0, bh1, bl1;
    input_operand<kSplit, true>(xr[(kb * 8 + t) * LD + eb * 8], bh0, bl0);
    input_operand<kSplit, true>(xr[(kb * 8 + t + 4) * LD + eb * 8], bh1, bl1);
    mma_terms<kSplit>(c, ah, al, bh0, bh1, bl0, bl1);
  };
  if constexpr (NO <= 8) {
    float part[NO][4];
    zero(part);
#pragma unroll
    for (int kb = 0; kb < NB; ++kb) {
      float x[4];
      uint32_t ah[4], al[4];
      accumulator_to_a<NB>(w, kb, lane, x);
#pragma unroll
      for (int i = 0; i < 4; ++i) computed_operand<kSplit>(x[i], ah[i], al[i]);
#pragma unroll
      for (int eb = 0; eb < NO; ++eb) product(part[eb], ah, al, kb, eb);
    }
#pragma unroll
    for (int eb = 0; eb < NO; ++eb) add_fresh(acc[eb], part[eb]);
  } else {
    uint32_t ah[NB][4], al[NB][4];
#pragma unroll
    for (int kb = 0; kb < NB; ++kb) {
      float x[4];
      accumulator_to_a<NB>(w, kb, lane, x);
#pragma unroll
      for (int i = 0; i < 4; ++i) computed_operand<kSplit>(x[i], ah[kb][i], al[kb][i]);
    }
#pragma unroll
    for (int eb = 0; eb < NO; ++eb) {
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kb = 0; kb < NB; ++kb) product(part, ah[kb], al[kb], kb, eb);
      add_fresh(acc[eb], part);
    }
  }
}

template <typename T, int EB>
__device__ __forceinline__ void backward_rows(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v, const T* __restrict__ o,
                                              const T* __restrict__ d_out, const void* mask_data,
                                              const int64_t* __restrict__ mask_base,
                                              const float* __restrict__ lse_fwd, T* __restrict__ dq,
                                              float* __restrict__ stats, int64_t slices, int H_q, int H_kv, int L,
                                              int S, int E,
                                              int mask_kind, int mask_rs, int mask_cs, float scale_log2,
                                              float scale, const BackwardLayout& lay, const Rows& dq_rows) {
  constexpr bool kSplit = std::is_same<T, float>::value;
  constexpr int LD = bs::ld(EB), BR = bs::kRows, BC = bs::key_tile(EB), NB = BC / 8, NO = bs::out_cols(EB) / 8;
  extern __shared__ __align__(16) float smem[];
  float* q_s = smem;
  float* do_s = q_s + BR * LD;
  float* k_s = do_s + BR * LD;
  float* v_s = k_s + BC * LD;
  __shared__ float d_s[BR];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  const int tiles = (L + BR - 1) / BR;
  const BackwardBlock blk(slices, bs::out_cols(EB));
  const int64_t n = blk.slice;  // b H_q + h
  const int l0 = (tiles - 1 - blk.tile) * BR;  // the last rows first
  const RowAt row_at(n, H_q, H_kv);
  const T* q_rows = q + row_at(lay.q, l0);
  const T* do_rows = d_out + row_at(lay.d_out, l0);
  const T* o_rows = o + row_at(lay.o, l0);
  const int count = min(BR, L - l0);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  const int kv_begin = mask.kv_begin(l0, L, S) / BC * BC, kv_end = mask.kv_end(l0, BR, L, S);

  bool q_finite, do_finite;  // the block's rows (scores_of)
  {
    bool bad_q, bad_do;
    load_two<T, EB, BR>(q_s, q_rows, lay.q.sr, do_s, do_rows, lay.d_out.sr, count, E, bad_q, bad_do);
    q_finite = !__syncthreads_or(bad_q);
    do_finite = !__syncthreads_or(bad_do);
  }
  for (int r = w; r < BR; r += bs::kWarps) {
    float d = 0.0f;
    if (r < count) {
      for (int e = lane; e < E; e += 32) d += do_s[r * LD + e] * to_f(o_rows[r * lay.o.sr + e]);
    }
    d = warp_sum(d);
    if (lane == 0) d_s[r] = d;
  }
  __syncthreads();

  const int ra = l0 + w * 16 + g;
  const float D[2] = {d_s[w * 16 + g], d_s[w * 16 + g + 8]};
  const float* q_w = q_s + w * 16 * LD;
  const float* do_w = do_s + w * 16 * LD;
  int64_t rb[2] = {0, 0};
  if (mask.is_array()) {
    rb[0] = ra < L ? mask.row_base(n, ra) : 0;
    rb[1] = ra + 8 < L ? mask.row_base(n, ra + 8) : 0;
  }
  // The tile's scores in the log2 domain, -inf where hidden; k_finite: K's
  // values all finite.
  auto masked_scores = [&](float (&s)[NB][4], int c0, bool k_finite) {
    scores_of<kSplit, NB, EB>(s, q_w, k_s, q_finite && k_finite, lane);
    mask_row_scores<NB>(s, mask, rb, ra, c0, mask.tile_hides(c0, BC, l0, BR, S), scale_log2, t, L, S);
  };

  // The rows' log-sum-exp: the forward's, or its online softmax again without V.
  float lse[2];
  if (const float* kept = lse_in(mask_kind, lse_fwd)) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) lse[rr] = ra + 8 * rr < L ? kept[n * L + ra + 8 * rr] : INFINITY;
  } else {
    float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f};
    for (int c0 = kv_begin; c0 < kv_end; c0 += BC) {
      const bool k_finite =
          !__syncthreads_or(load_rows<T, EB, BC>(k_s, k + row_at.kv(lay.k, c0), lay.k.sr, min(BC, S - c0), E));
      float s[NB][4];
      masked_scores(s, c0, k_finite);
      lse_step<NB>(s, m, l);
      __syncthreads();
    }
    lse_final(m, l, lse, sink_log2(mask_kind, mask_base, int(n % H_q)));
  }

  float acc[NO][4];
  zero(acc);
  for (int c0 = kv_begin; c0 < kv_end; c0 += BC) {
    const int kc = min(BC, S - c0);
    bool bad, bad_v;
    load_two<T, EB, BC>(k_s, k + row_at.kv(lay.k, c0), lay.k.sr, v_s, v + row_at.kv(lay.v, c0), lay.v.sr, kc, E, bad,
                        bad_v);
    const bool guard = __syncthreads_or(bad);
    const bool v_finite = !__syncthreads_or(bad_v);
    float s[NB][4], dp[NB][4];
    masked_scores(s, c0, !guard);
    scores_of<kSplit, NB, EB>(dp, do_w, v_s, do_finite && v_finite, lane);
    row_ds<NB>(s, dp, lse, D);
    if (guard) {
      accumulate_guarded<float, LD, NB, NO>(acc, s, k_s, blk.col0, lane);
    } else {
      accumulate<kSplit, NB, NO, EB>(acc, s, k_s, blk.col0, lane);
    }
    __syncthreads();
  }

  store_acc<T, NO>(acc, dq + row_at(dq_rows, 0), ra, L, E, blk.col0, scale, lane, dq_rows.sr);
  if (blockIdx.z == 0 && t == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = ra + 8 * rr;
      if (r < L) {
        stats[(n * L + r) * 2] = lse[rr];
        stats[(n * L + r) * 2 + 1] = D[rr];
      }
    }
  }
}

// fa_backward_d: each row's (lse, D) where the forward kept lse, for the
// keys pass that makes dQ (a block's 64 rows, 16 a warp, every load of a
// warp's rows in flight before the first sum).
template <typename T, int EB>
__device__ __forceinline__ void backward_d(const T* __restrict__ o, const T* __restrict__ d_out,
                                           const float* __restrict__ lse_fwd, float* __restrict__ stats,
                                           int64_t slices, int H_q, int L, int E, const BackwardLayout& lay) {
  constexpr int RW = bs::kRows / bs::kWarps, PER = EB / 32;
  const BackwardBlock blk(slices, bs::out_cols(EB));
  const int64_t n = blk.slice;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blk.tile * bs::kRows + w * RW;
  const RowAt row_at(n, H_q, H_q);
  const T* o_head = o + row_at(lay.o, 0);
  const T* do_head = d_out + row_at(lay.d_out, 0);
  float d[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    d[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int r = r0 + i, e = lane + 32 * j;
      if (r < L && e < E) d[i] += to_f(do_head[r * lay.d_out.sr + e]) * to_f(o_head[r * lay.o.sr + e]);
    }
  }
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    d[i] = warp_sum(d[i]);
    const int r = r0 + i;
    if (lane == 0 && r < L) {
      stats[(n * L + r) * 2] = lse_fwd[n * L + r];
      stats[(n * L + r) * 2 + 1] = d[i];
    }
  }
}

// The keys pass's share of dQ for one row tile (rows r0 .. r0 + count):
// dQ += scale dS K over the block's BK keys, dS^T staged in shared memory
// (ds_s: a key's row tile LDS floats apart) by every warp. Each warp takes
// 16 rows and its share of the columns, and adds them into dq (float32,
// rows ld apart, zeros before the launch) by atomics. k_finite: the block's
// K all finite; else float32 FMA skipping zero weights
// (accumulate_guarded_by, backward_parts.cuh).
template <bool kSplit, int EB, int BK, int BR, int LDS>
__device__ __forceinline__ void add_dq(float* __restrict__ dq, const float* ds_s, const float* k_s, bool k_finite,
                                       int ld, int r0, int count, int E, float scale, int w, int lane) {
  // The warps over the tile's BR / 16 row groups, the columns shared among
  // a group's warps.
  constexpr int RG = BR / 16, CP = bs::kWarps / RG, NQ = EB / CP / 8;  // NQ: n-tiles of 8 a warp
  static_assert(bs::kWarps % RG == 0 && EB % (CP * 8) == 0, "whole row groups and n-tiles a warp");
  constexpr int LD = bs::ld(EB);
  const int g = lane >> 2, t = lane & 3;
  const int rq = (w % RG) * 16, cq = (w / RG) * (EB / CP);
  float acc[NQ][4];
  zero(acc);
  if (k_finite) {
#pragma unroll 4
    for (int kk = 0; kk < BK / 8; ++kk) {
      uint32_t ah[4], al[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)  // dS (rows x keys): row rq + g (+8), key kk*8 + t (+4)
        computed_operand<kSplit>(ds_s[(kk * 8 + t + (i >> 1) * 4) * LDS + rq + g + (i & 1) * 8], ah[i], al[i]);
#pragma unroll
      for (int nb = 0; nb < NQ; ++nb) {
        uint32_t bh0, bl0, bh1, bl1;
        input_operand<kSplit, true>(k_s[(kk * 8 + t) * LD + cq + nb * 8 + g], bh0, bl0);
        input_operand<kSplit, true>(k_s[(kk * 8 + t + 4) * LD + cq + nb * 8 + g], bh1, bl1);
        mma_terms<kSplit>(acc[nb], ah, al, bh0, bh1, bl0, bl1);
      }
    }
  } else {  // the weights from dS^T in shared memory
    accumulate_guarded_by<BK, NQ>(
        acc, [&](int k, float (&p)[2]) { p[0] = ds_s[k * LDS + rq + g], p[1] = ds_s[k * LDS + rq + g + 8]; },
        [&](int k, int c) { return k_s[k * LD + cq + c]; }, lane);
  }
#if __CUDA_ARCH__ >= 900
  // Each pair of neighbouring columns by one 8-byte reduction (Hopper's
  // float2 atomicAdd): half the requests, each a whole pair of a sector.
  if (E % 2 == 0 && ld % 2 == 0 && (reinterpret_cast<uintptr_t>(dq) & 7) == 0) {
#pragma unroll
    for (int nb = 0; nb < NQ; ++nb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = rq + g + 8 * h, e = cq + nb * 8 + 2 * t;
        if (r < count && e < E)
          atomicAdd(reinterpret_cast<float2*>(dq + int64_t{r0 + r} * ld + e),
                    make_float2(acc[nb][2 * h] * scale, acc[nb][2 * h + 1] * scale));
      }
    return;
  }
#endif
#pragma unroll
  for (int nb = 0; nb < NQ; ++nb)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = rq + g + 8 * (i >> 1), e = cq + nb * 8 + 2 * t + (i & 1);
      if (r < count && e < E) atomicAdd(dq + int64_t{r0 + r} * ld + e, acc[nb][i] * scale);
    }
}

// One block: 64 keys against the rows of one query head. Without GQA it
// writes dK and dV (T); with it, it adds them into float32 dK and dV of the
// KV head (zeros before the launch), so that a group's heads run side by
// side rather than one block walking them all (qwen05b: 7 heads a group).
// kDq (fa_backward_keysq): dQ too, added into dq (add_dq).
template <typename T, int EB, bool kDq = false>
__device__ __forceinline__ void backward_keys(const T* __restrict__ q, const T* __restrict__ k,
                                              const T* __restrict__ v, const T* __restrict__ d_out,
                                              const float* __restrict__ stats, const void* mask_data,
                                              const int64_t* __restrict__ mask_base, void* dk, void* dv,
                                              float* __restrict__ dq, int64_t slices, int H_q, int H_kv, int L, int S, int E,
                                              int mask_kind, int mask_rs, int mask_cs, float scale_log2,
                                              float scale, const BackwardLayout& lay, const Rows& dq_rows) {
  constexpr bool kSplit = std::is_same<T, float>::value;
  constexpr int LD = bs::ld(EB), BK = bs::kKeys, BR = bs::row_tile(EB), NB = BR / 8, NO = bs::out_cols(EB) / 8;
  extern __shared__ __align__(16) float smem[];
  float* k_s = smem;
  float* v_s = k_s + BK * LD;
  float* q_s = v_s + BK * LD;
  float* do_s = q_s + BR * LD;
  float* lse_s = do_s + BR * LD;
  float* d_s = lse_s + BR;
  constexpr int LDS = bs::ld_ds(BR);
  float* ds_s = d_s + BR;  // kDq: the tile's dS^T, a key's rows LDS apart
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  const BackwardBlock blk(slices, bs::out_cols(EB));
  const int64_t n = blk.slice;  // b H_q + h
  const int c0 = blk.tile * BK;  // the first keys first: under a causal mask they have the most rows
  const int ratio = H_q / H_kv;
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  // Each array's offset made where it is read, not held: three held
  // pointers spilled the keys pass with dQ at E = 128.
  const RowAt row_at(n, H_q, H_kv);

  bool k_finite, v_finite;  // the block's keys (scores_of)
  {
    bool bad_k, bad_v;
    load_two<T, EB, BK>(k_s, k + row_at.kv(lay.k, c0), lay.k.sr, v_s, v + row_at.kv(lay.v, c0), lay.v.sr,
                        min(BK, S - c0), E, bad_k, bad_v);
    k_finite = !__syncthreads_or(bad_k);
    v_finite = !__syncthreads_or(bad_v);
  }
  const int ka = c0 + w * 16 + g;  // this thread's keys: ka, ka + 8
  const float* k_w = k_s + w * 16 * LD;
  const float* v_w = v_s + w * 16 * LD;
  // Rows outside [row_begin, row_end) see none of the block's keys.
  const int row_begin = mask.row_begin(c0, L, S), row_end = mask.row_end(c0, BK, L, S);

  float dk_acc[NO][4], dv_acc[NO][4];
  zero(dk_acc);
  zero(dv_acc);
  for (int r0 = row_begin; r0 < row_end; r0 += BR) {
    const int count = min(BR, L - r0);
    __syncthreads();  // the last tile's readers are done
    bool bad_q, bad_do;
    load_two<T, EB, BR>(q_s, q + row_at(lay.q, r0), lay.q.sr, do_s, d_out + row_at(lay.d_out, r0), lay.d_out.sr,
                        count, E, bad_q, bad_do);
    if (threadIdx.x < BR) {
      // Rows past L: lse = +inf makes their P 0.
      const bool in = int(threadIdx.x) < count;
      lse_s[threadIdx.x] = in ? stats[(n * L + r0 + threadIdx.x) * 2] : INFINITY;
      d_s[threadIdx.x] = in ? stats[(n * L + r0 + threadIdx.x) * 2 + 1] : 0.0f;
    }
    const bool guard_q = __syncthreads_or(bad_q);
    const bool guard_do = __syncthreads_or(bad_do);

    float p[NB][4], ds[NB][4];
    // S^T (keys x rows) and dP^T
    scores_of<kSplit, NB, EB>(p, k_w, q_s, k_finite && !guard_q, lane);
    scores_of<kSplit, NB, EB>(ds, v_w, do_s, v_finite && !guard_do, lane);
    key_tile_ds<NB>(p, ds, mask, n, ka, r0, mask.tile_hides(c0, BK, r0, BR, S), lse_s, d_s, scale_log2, t, L, S);
    if constexpr (kDq) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2*>(ds_s + (w * 16 + g + 8 * h) * LDS + nb * 8 + 2 * t) =
              make_float2(ds[nb][2 * h], ds[nb][2 * h + 1]);
    }
    if (guard_do) {
      accumulate_guarded<float, LD, NB, NO>(dv_acc, p, do_s, blk.col0, lane);
    } else {
      accumulate<kSplit, NB, NO, EB>(dv_acc, p, do_s, blk.col0, lane);
    }
    if (guard_q) {
      accumulate_guarded<float, LD, NB, NO>(dk_acc, ds, q_s, blk.col0, lane);
    } else {
      accumulate<kSplit, NB, NO, EB>(dk_acc, ds, q_s, blk.col0, lane);
    }
    if constexpr (kDq) {
      __syncthreads();  // every warp's dS^T staged
      add_dq<kSplit, EB, BK, BR, LDS>(dq + row_at(dq_rows, r0), ds_s, k_s, k_finite, dq_rows.sr, 0, count, E, scale,
                                      w, lane);
    }
  }
  // Without GQA dK and dV in T; with it their float32 sums, which are the
  // gradients where the inputs are float32.
  void* dk_head = ratio != 1 ? static_cast<void*>(static_cast<float*>(dk) + row_at.kv(lay.dk, 0))
                             : static_cast<void*>(static_cast<T*>(dk) + row_at.kv(lay.dk, 0));
  void* dv_head = ratio != 1 ? static_cast<void*>(static_cast<float*>(dv) + row_at.kv(lay.dv, 0))
                             : static_cast<void*>(static_cast<T*>(dv) + row_at.kv(lay.dv, 0));
  store_dk_dv<T, NO>(dk_acc, dv_acc, dk_head, dv_head, lay.dk.sr, lay.dv.sr, ratio != 1, row_begin < row_end, ka, S,
                     E, blk.col0, scale, lane);
}

}  // namespace fa

// The extern "C" entry points of one unit (-DFA_DTYPE, -DFA_E: the head-dim
// bucket, -DFA_PASS=0 rows | 1 keys | 2 D | 3 keys with dQ):
// fa_backward_rows_<dtype>_<E>, fa_backward_keys_<dtype>_<E>,
// fa_backward_d_<dtype>_<E>, fa_backward_keysq_<dtype>_<E> (dq: float32
// zeros, the stats fa_backward_d's). Inputs, then outputs, then scalars, as MLX
// passes them; the scalars end in the arrays' rows (BackwardLayout, then
// dQ's). The rows pass's lse input is the forward's log-sum-exp where
// mask_kind has kLse (mask_bits.h), else any array, never read. The keys
// pass's dK and dV are T without GQA, float32 sums with it.
#if !defined(FA_E) || !defined(FA_PASS)
#error "define FA_E and FA_PASS"
#endif
#define FA_BACKWARD_SCALARS                                                                                  \
  int slices, int H_q, int H_kv, int L, int S, int E, int mask_kind, int mask_rs, int mask_cs, float scale_log2, \
      float scale, FA_BACKWARD_LAYOUT_PARAMS, int dq_sb, int dq_sh, int dq_sr
#define FA_DQ_ROWS \
  fa::Rows { dq_sb, dq_sh, dq_sr }

// -DFA_KIND=0 | 1: fa_backward_rows<n|c>_ and fa_backward_keys<n|c>_, the
// same arguments for calls with no mask or a causal one at E = FA_E exactly:
// the mask's kind and the head dim fixed at compile time (as
// backward_wg.cu's fa_backward_keyswg<n|c>_; the kind's other bits, sinks
// and kLse, stay arguments).
#if defined(FA_KIND)
#define FA_ROWS_FAMILY FA_CAT3(fa_backward_rows, FA_KIND_LETTER, _)
#define FA_KEYS_FAMILY FA_CAT3(fa_backward_keys, FA_KIND_LETTER, _)
#define FA_KEYSQ_FAMILY FA_CAT3(fa_backward_keysq, FA_KIND_LETTER, _)
#define FA_PASS_E FA_E
#define FA_PASS_KIND (FA_KIND | (mask_kind & ~fa::kKindBits))
#else
#define FA_ROWS_FAMILY fa_backward_rows_
#define FA_KEYS_FAMILY fa_backward_keys_
#define FA_KEYSQ_FAMILY fa_backward_keysq_
#define FA_PASS_E E
#define FA_PASS_KIND mask_kind
#endif
#if FA_PASS == 2
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(fa_backward_d_, FA_TNAME, _, FA_E, )(
    const FA_T* o, const FA_T* d_out, const float* lse, float* stats, FA_BACKWARD_SCALARS) {
  fa::backward_d<FA_T, FA_E>(o, d_out, lse, stats, slices, H_q, L, E, FA_BACKWARD_LAYOUT);
}
#elif FA_PASS == 0
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads, fa::backward_shapes::min_blocks(FA_E)) FA_CAT5(FA_ROWS_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* o, const FA_T* d_out, const void* mask,
    const int64_t* mask_base, const float* lse, FA_T* dq, float* stats, FA_BACKWARD_SCALARS) {
  fa::backward_rows<FA_T, FA_E>(q, k, v, o, d_out, mask, mask_base, lse, dq, stats, slices, H_q, H_kv, L, S, FA_PASS_E,
                                FA_PASS_KIND, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT, FA_DQ_ROWS);
}
#elif FA_PASS == 3
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(FA_KEYSQ_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* d_out, const float* stats, const void* mask,
    const int64_t* mask_base, void* dk, void* dv, float* dq, FA_BACKWARD_SCALARS) {
  fa::backward_keys<FA_T, FA_E, true>(q, k, v, d_out, stats, mask, mask_base, dk, dv, dq, slices, H_q, H_kv, L, S,
                                      FA_PASS_E, FA_PASS_KIND, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT,
                                      FA_DQ_ROWS);
}
#else
extern "C" __global__ void __launch_bounds__(fa::backward_shapes::kThreads) FA_CAT5(FA_KEYS_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const FA_T* d_out, const float* stats, const void* mask,
    const int64_t* mask_base, void* dk, void* dv, FA_BACKWARD_SCALARS) {
  fa::backward_keys<FA_T, FA_E>(q, k, v, d_out, stats, mask, mask_base, dk, dv, nullptr, slices, H_q, H_kv, L, S, FA_PASS_E,
                                FA_PASS_KIND, mask_rs, mask_cs, scale_log2, scale, FA_BACKWARD_LAYOUT, FA_DQ_ROWS);
}
#endif
