// FlashAttention-2 forward for float32 inputs at float32 accuracy on Hopper
// (sm_90a): the 3xTF32 split of prefill_tf32.cu, with the products on
// warpgroup tensor-core instructions (wgmma.cuh) instead of mma.sync.
//
// Nsight Compute put prefill_tf32.cu at ~8 issued instructions per mma.sync:
// every warp split each K and V element it used into TF32 high and low parts
// itself, with scalar shared-memory loads around it. Here each element is
// split once per block, as it is stored to shared memory, into the layouts
// wgmma reads directly; a product is then one instruction per 64 x 64 x 8.
//
// Block: two warpgroups x 64 query rows; key/value tiles of 64 keys in
// three shared-memory buffers at E = 64, of 32 in two at E = 128
// (wg_shapes.h). Q is split once into registers (the A operand of S = Q K^T:
// with both operands in shared memory those products would ask more of its
// bandwidth than it has at full tensor rate); at E = 128 only its high part,
// the low part's product reading it from shared memory. Per tile:
//   1. S = Q K^T is issued: 3 wgmma per 8 head-dim columns (lo*hi, hi*lo,
//      hi*hi), K from shared memory;
//   2. while it runs, the next tile (loaded into registers during the last
//      one) is split and stored into its buffer: K as it is (K-major along
//      the head dim, rows in paired order), V transposed (K-major along the
//      keys, as wgmma's B operand of P V must be); the tile after it is
//      loaded from global memory;
//   3. online softmax on the accumulators (softmax.cuh), then O += P V: P split
//      in registers (A operand), V^T from shared memory (at E = 128 in two
//      halves of 64 columns).
// The two warpgroups run skewed (pingpong.cuh): they take turns to issue
// their products, so one's softmax runs while the other's products do; the
// buffers' full / empty barriers replace a block-wide barrier per tile, and
// the third buffer is the slack the skew needs (a warpgroup stores tile j + 1
// while the other may still read tile j - 1; at E = 128, with two, that store
// waits for it).
// Only Hopper runs it (the planner asks); other GPUs take prefill_tf32.cu
// (prefill_tf32_pairs.cu at E = 128).

#include "unit.cuh"
#include "wg_shapes.h"
#include "pingpong.cuh"
#include "kv_rows.cuh"
#include "wgmma.cuh"

namespace fa {

constexpr int kWgRows = wg_shapes::kRowsPerGroup;  // query rows per warpgroup (wgmma's M)
constexpr int kWgBr = wg_shapes::kTf32Rows;
constexpr int kWgThreads = wg_shapes::kTf32Threads;
constexpr int kWgGroups = wg_shapes::kTf32Groups;

// Operands in wgmma's K-major core-matrix layout (wgmma.cuh), TF32 high and
// low parts apart; the key/value tiles (tile j in buffer j % B), each with
// its barriers and its rare-path flag. (At E = 128 Q's low part comes first,
// before this: wg_shapes.h.)
template <int E>
struct WgSmem {
  static constexpr int Bc = wg_shapes::tf32_bc(E), B = wg_shapes::tf32_buffers(E);
  struct Tile {
    float k_hi[Bc * E], k_lo[Bc * E];  // rows: keys (paired order); K: head dim
    float v_hi[E * Bc], v_lo[E * Bc];  // V^T: rows: head dim; K: keys
  } kv[B];
  uint64_t full[B];   // every thread has stored its part of the tile
  uint64_t empty[B];  // every thread is done reading it
  int rare[B];        // j + 1 when tile j takes the rare path (VTile::store)
};

// Row r of a K tile in shared memory holds key paired_key(r) of the tile:
// within each 8 keys, rows 2t, 2t + 1 hold keys t, t + 4. S = Q K^T then
// leaves in each thread exactly the keys (t, t + 4) that the A operand of
// P V asks of it, so P needs no shuffles between the two products.
__device__ __forceinline__ int paired_key(int r) { return (r & ~7) | ((r & 1) << 2) | ((r & 7) >> 1); }

template <bool Finite>
__device__ __forceinline__ void split4(const float4& x, float4& hi, float4& lo) {
  uint32_t h[4], l[4];
  const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (Finite) {
      split_finite(xs[j], h[j], l[j]);
    } else {
      split_tf32(xs[j], h[j], l[j]);
    }
  }
  hi = make_float4(__uint_as_float(h[0]), __uint_as_float(h[1]), __uint_as_float(h[2]), __uint_as_float(h[3]));
  lo = make_float4(__uint_as_float(l[0]), __uint_as_float(l[1]), __uint_as_float(l[2]), __uint_as_float(l[3]));
}

// One thread's part of a ROWS x E tile of Q or K, held in registers between
// its load from global memory and its split into shared memory. Thread
// element idx is core-matrix row idx % 8 of core matrix idx / 8 (row-major
// over (row / 8, column / 4)): 8 neighbouring threads fill one core matrix's
// 128 bytes (no bank conflicts) and read 16 bytes from each of 8 rows.
template <int E, int ROWS, bool PAIRED>
struct RowTile {
  static constexpr int N = ROWS * E / 4 / kWgThreads;
  static_assert(ROWS * E / 4 % kWgThreads == 0, "tile must divide over the block");
  float4 x[N];

  __device__ __forceinline__ static int row_of(int idx) {
    const int r = ((idx >> 3) / (E / 4)) * 8 + (idx & 7);
    return PAIRED ? paired_key(r) : r;
  }
  __device__ __forceinline__ static const float4* at(const float* src, int64_t stride, int row, int idx) {
    return reinterpret_cast<const float4*>(src + row * stride + ((idx >> 3) % (E / 4)) * 4);
  }
  // Rows first .. first + count - 1 of src (zeros past count).
  __device__ __forceinline__ void load(const F32Rows& rows, int first, int count, int tid) {
    load(rows.p, rows.sr, first, count, tid);
  }
  __device__ __forceinline__ void load(const float* src, int64_t stride, int first, int count, int tid) {
    src += first * stride;
    if (count >= ROWS) {
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] = *at(src, stride, row_of(tid + i * kWgThreads), tid + i * kWgThreads);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int idx = tid + i * kWgThreads, r = row_of(idx);
        x[i] = r < count ? *at(src, stride, r, idx) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
  }
  __device__ __forceinline__ void store(float* hi, float* lo, int tid) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int idx = tid + i * kWgThreads;
      float4 h, l;
      split4<false>(x[i], h, l);
      *reinterpret_cast<float4*>(hi + idx * 4) = h;
      *reinterpret_cast<float4*>(lo + idx * 4) = l;
    }
  }
};

// One thread's part of a V tile, stored transposed: element idx holds 4
// consecutive keys of head-dim column idx % E (a warp's loads read 32
// consecutive floats of a key row), one core-matrix row of V^T.
template <int E, int BC>
struct VTile {
  static constexpr int N = E * BC / 4 / kWgThreads;
  static_assert(E * BC / 4 % kWgThreads == 0, "tile must divide over the block");
  float x[N][4];

  __device__ __forceinline__ void load(const F32Rows& rows, int first, int count, int tid) {
    load(rows.p, rows.sr, first, count, tid);
  }
  __device__ __forceinline__ void load(const float* src, int64_t stride, int first, int count, int tid) {
    src += first * stride;
    const bool full = count >= BC;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int idx = tid + i * kWgThreads, e = idx % E, key = (idx / E) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) x[i][j] = full || key + j < count ? src[(key + j) * stride + e] : 0.0f;
    }
  }
  // bad: set when a value is +-inf, or NaN in a tile with hidden keys
  // (masked): the rare path. A product's low-part term would make 0 x inf =
  // NaN of an infinite value wherever P's low part is 0 (P = 1 at a row's
  // maximum); a NaN is NaN in every term, so unmasked tiles carry it as is.
  __device__ __forceinline__ void store(float* hi, float* lo, int tid, bool masked, bool& bad) const {
    float big = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int idx = tid + i * kWgThreads, e = idx % E, kc = idx / E;
      const int at = ((e >> 3) * (BC / 4) + kc) * 32 + (e & 7) * 4;
      const float4 v = make_float4(x[i][0], x[i][1], x[i][2], x[i][3]);
      if (masked) bad |= !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
      big = fmaxf(big, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
      float4 h, l;
      split4<true>(v, h, l);
      *reinterpret_cast<float4*>(hi + at) = h;
      *reinterpret_cast<float4*>(lo + at) = l;
    }
    bad |= big == INFINITY;
  }
};

// The same tiles from MLX's affine-quantized rows (kv_rows.cuh's
// QuantHead: T the scales' dtype). A thread holds its part's codes, scales
// and biases as loaded, and expands them only when it stores the tile (a
// tile later), so the loads stay in flight meanwhile, as the plain tiles'.
// RowTile's layout (4 columns of one row a thread element).
template <int E, int ROWS, bool PAIRED, typename T>
struct QuantRowTile {
  using Plain = RowTile<E, ROWS, PAIRED>;
  static constexpr int N = Plain::N;
  QuantRaw<T> x[N];
  int bits;
  __device__ __forceinline__ static int col_of(int idx) { return ((idx >> 3) % (E / 4)) * 4; }
  __device__ __forceinline__ void load(const QuantHead<T>& h, int first, int count, int tid) {
    bits = h.bits;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int idx = tid + i * kWgThreads, r = Plain::row_of(idx);
      x[i] = r < count ? load_quant4(h, first + r, col_of(idx)) : QuantRaw<T>{0u, T(0.0f), T(0.0f)};
    }
  }
  __device__ __forceinline__ void store(float* hi, float* lo, int tid) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int idx = tid + i * kWgThreads;
      float4 h, l;
      split4<false>(expand_quant4(x[i], col_of(idx), bits), h, l);
      *reinterpret_cast<float4*>(hi + idx * 4) = h;
      *reinterpret_cast<float4*>(lo + idx * 4) = l;
    }
  }
};

// VTile's layout from quantized rows: a thread element is 4 consecutive
// keys x 4 consecutive columns (4 words, scales and biases for 16 values),
// stored as 4 of VTile's (4 keys of one column each).
template <int E, int BC, typename T>
struct QuantVTile {
  static constexpr int N = E * BC / 16 / kWgThreads;
  static_assert(E * BC / 16 % kWgThreads == 0, "tile must divide over the block");
  QuantRaw<T> x[N][4];
  int bits;
  __device__ __forceinline__ void load(const QuantHead<T>& h, int first, int count, int tid) {
    bits = h.bits;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int idx = tid + i * kWgThreads, col = (idx % (E / 4)) * 4, key = (idx / (E / 4)) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[i][j] = key + j < count ? load_quant4(h, first + key + j, col) : QuantRaw<T>{0u, T(0.0f), T(0.0f)};
      }
    }
  }
  __device__ __forceinline__ void store(float* hi, float* lo, int tid, bool masked, bool& bad) const {
    float big = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int idx = tid + i * kWgThreads, col = (idx % (E / 4)) * 4, kc = idx / (E / 4);
      float4 keys[4];  // keys[j]: key j's 4 columns
#pragma unroll
      for (int j = 0; j < 4; ++j) keys[j] = expand_quant4(x[i][j], col, bits);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int e = col + c, at = ((e >> 3) * (BC / 4) + kc) * 32 + (e & 7) * 4;
        auto pick = [&](const float4& k) { return c == 0 ? k.x : c == 1 ? k.y : c == 2 ? k.z : k.w; };
        const float4 v = make_float4(pick(keys[0]), pick(keys[1]), pick(keys[2]), pick(keys[3]));
        if (masked) bad |= !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
        big = fmaxf(big, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        float4 h, l;
        split4<true>(v, h, l);
        *reinterpret_cast<float4*>(hi + at) = h;
        *reinterpret_cast<float4*>(lo + at) = l;
      }
    }
    bad |= big == INFINITY;
  }
};

// The tiles for a head's rows (kv_rows.cuh): float32 or quantized.
template <int E, class Rows>
struct WgTiles;
template <int E>
struct WgTiles<E, F32Rows> {
  using K = RowTile<E, wg_shapes::tf32_bc(E), true>;
  using V = VTile<E, wg_shapes::tf32_bc(E)>;
};
template <int E, typename T>
struct WgTiles<E, QuantHead<T>> {
  using K = QuantRowTile<E, wg_shapes::tf32_bc(E), true, T>;
  using V = QuantVTile<E, wg_shapes::tf32_bc(E), T>;
};

// The rare path's P V at E = 64 for one warp's 16 rows (P's accumulator
// layout, -1 where the key is hidden: no exponential gives it) into delta
// (16 x E floats): each column's sum over the thread's 16 keys, then over
// its quad's (all 64), stored by the quad's first lane. Not inlined, so that
// its registers stay out of the main loop's. (Shared-memory float atomics
// into delta, four lanes an address, took 3.17-3.19 ms for 4 heads x 77
// causal rows with a NaN value row, 0.041-0.043 ms this way; the main loop
// did not slow: H200, benchmarks/cuda-probes/prefill-probe.cu.)
struct RareP {
  float x[8][4];
};
template <int E>
__device__ __noinline__ void rare_pv(const RareP p, const float* v_hi, const float* v_lo, float* delta, int g, int t) {
  constexpr int Bc = wg_shapes::tf32_bc(E);
  static_assert(Bc == 64, "P's accumulator layout of a 64-key tile");
#pragma unroll 1
  for (int e = 0; e < E; ++e) {
    float acc[2] = {0.0f, 0.0f};  // rows g, g + 8
#pragma unroll
    for (int kb = 0; kb < 8; ++kb)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {  // keys t, t + 4 of the 8
        const int c = kb * 8 + t + 4 * kh;
        const int at = ((e >> 3) * (Bc / 4) + (c >> 2)) * 32 + (e & 7) * 4 + (c & 3);
        const float hi = v_hi[at];  // lo is NaN where hi is +-inf (split_finite)
        const float v = isinf(hi) ? hi : hi + v_lo[at];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const float pr = p.x[kb][2 * rr + kh];
          if (pr != -1.0f) acc[rr] += pr * v;  // a value reaches only the rows that see it
        }
      }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      acc[rr] += __shfl_xor_sync(0xffffffffu, acc[rr], 1);
      acc[rr] += __shfl_xor_sync(0xffffffffu, acc[rr], 2);
    }
    if (t == 0) {
      delta[g * E + e] = acc[0];
      delta[(g + 8) * E + e] = acc[1];
    }
  }
}

template <int E, class Src>
__device__ __forceinline__ void prefill_tf32_wg(const Src& src, const void* mask_data,
                                                const int64_t* __restrict__ mask_base, float* __restrict__ out,
                                                float* __restrict__ lse,
                                                int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs,
                                                int mask_cs, float scale_log2) {
  static_assert(wg_shapes::tf32_has(E), "the wgmma products are written for E = 64 and 128");
  constexpr int Bc = wg_shapes::tf32_bc(E), B = wg_shapes::tf32_buffers(E);
  constexpr int NB = Bc / 8, NO = E / 8;
  constexpr bool kQLoShared = wg_shapes::tf32_q_lo_shared(E);
  using Smem = WgSmem<E>;
  static_assert(wg_shapes::tf32_q_lo_bytes(E) + sizeof(Smem) == wg_shapes::tf32_smem_bytes(E),
                "the planner's shared memory");
  // Descriptor strides (bytes): core matrices along K are adjacent (128 B);
  // along rows, one 8-row band of the whole K extent apart. Stepping 8
  // columns along K adds 256 B (16 in the descriptor's units); stepping to
  // the other key/value buffer adds sizeof(Tile); P V's second 64 output
  // columns (E = 128) are 8 bands of V^T on.
  constexpr uint32_t kLbo = 128, kSboRows = 8 * E * 4, kSboV = 8 * Bc * 4;
  constexpr uint64_t kStepK = 256 >> 4, kStepBuf = sizeof(typename Smem::Tile) >> 4;
  constexpr uint64_t kStepHalf = (8 * kSboV) >> 4;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* q_lo = reinterpret_cast<float*>(smem_raw);  // E = 128: Q's low parts, RowTile's layout
  auto& sm = *reinterpret_cast<Smem*>(smem_raw + wg_shapes::tf32_q_lo_bytes(E));
  // wg from lane 0: ptxas then knows it is warp-uniform (uniform registers for
  // what derives from it, as in prefill_f16_wg.cu).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), w = (tid >> 5) & 3, lane = tid & 31,
            g = lane >> 2, t = lane & 3;
  const PrefillBlock blk(kWgBr, H_q, H_kv, L, S, mask_kind, mask_cs);
  const int64_t n = blk.n;
  // Under a sliding window the keys from the row tile's first one on (at a
  // key tile's start) stand for all of them, renumbered from 0: the causal
  // offset S - L follows. (Offsetting each tile's start instead was 2%
  // slower, 16% with that start read from lane 0.)
  const int c_first = blk.kv_begin / Bc * Bc;
  S -= c_first;
  const int l0 = blk.l0, kv_end = blk.kv_end - c_first;
  const typename Src::Head rows = src.head(blk, c_first);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  auto masked = [&](int c0, int first, int rows) { return mask.tile_hides(c0, Bc, first, rows, S); };

  const int tiles = (kv_end + Bc - 1) / Bc;
  if (tid < B) {
    mbar_init(&sm.full[tid], kWgThreads);
    mbar_init(&sm.empty[tid], kWgThreads);
    sm.rare[tid] = 0;
  }
  if constexpr (kQLoShared) {
    // The block's Q rows, split once: the low parts into shared memory.
    RowTile<E, kWgBr, false> qt;
    qt.load(rows.q, rows.q_sr, l0, L - l0, tid);
#pragma unroll
    for (int i = 0; i < qt.N; ++i) {
      const float xs[4] = {qt.x[i].x, qt.x[i].y, qt.x[i].z, qt.x[i].w};
      uint32_t h, l[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) split_tf32_query(xs[k], h, l[k]);
      *reinterpret_cast<uint4*>(q_lo + (tid + i * kWgThreads) * 4) = make_uint4(l[0], l[1], l[2], l[3]);
    }
    fence_proxy_async();
  }
  __syncthreads();

  // Tile j, held in registers, into buffer j % B once every thread has read
  // tile j - B there; then tile j + 1 from global memory into the registers
  // (at E = 128 once this tile's P V is done: registers).
  using Tiles = WgTiles<E, decltype(rows.k)>;
  typename Tiles::K kt;
  typename Tiles::V vt;
  constexpr bool kLoadLate = E > 64;
  auto load_tile = [&](int j) {
    const int c = j * Bc;
    kt.load(rows.k, c, min(Bc, S - c), tid);
    vt.load(rows.v, c, min(Bc, S - c), tid);
  };
  auto store_tile = [&](int j) {
    const int b = j % B, c = j * Bc;
    if (j >= B) mbar_wait(&sm.empty[b], (j / B - 1) & 1);
    auto& dst = sm.kv[b];
    bool bad = false;
    kt.store(dst.k_hi, dst.k_lo, tid);
    vt.store(dst.v_hi, dst.v_lo, tid, masked(c, l0, kWgBr), bad);
    if (bad) sm.rare[b] = j + 1;
    fence_proxy_async();
    mbar_arrive(&sm.full[b]);
    if (!kLoadLate && c + Bc < kv_end) {
      kt.load(rows.k, c + Bc, min(Bc, S - c - Bc), tid);
      vt.load(rows.v, c + Bc, min(Bc, S - c - Bc), tid);
    }
  };
  if (tiles > 0) {
    load_tile(0);
    store_tile(0);
    if (kLoadLate && tiles > 1) load_tile(1);
  }

  const int row0 = l0 + wg * kWgRows;               // this warpgroup's first row
  const int ra = row0 + w * 16 + g;
  // Q's high parts stay in registers as the A operand of S = Q K^T (shared
  // memory would carry both operands of those products, more than its
  // bandwidth at full tensor rate): rows ra, ra + 8, columns 8 kk + t, + 4,
  // split once; at E = 64 the low parts too.
  uint32_t qh[E / 8][4], ql[kQLoShared ? 1 : E / 8][4];
  {
#pragma unroll
    for (int kk = 0; kk < E / 8; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ra + (i & 1) * 8, e = kk * 8 + t + (i >> 1) * 4;
        uint32_t lo;
        split_tf32_query(r < L ? to_f(rows.q[int64_t(r) * rows.q_sr + e]) : 0.0f, qh[kk][i],
                         kQLoShared ? lo : ql[kQLoShared ? 0 : kk][i]);
      }
    }
  }
  const uint64_t d_ql = wgmma_desc(q_lo + wg * kWgRows * E, kLbo, kSboRows);
  const uint64_t d_kh = wgmma_desc(sm.kv[0].k_hi, kLbo, kSboRows);
  const uint64_t d_kl = wgmma_desc(sm.kv[0].k_lo, kLbo, kSboRows);
  const uint64_t d_vh = wgmma_desc(sm.kv[0].v_hi, kLbo, kSboV);
  const uint64_t d_vl = wgmma_desc(sm.kv[0].v_lo, kLbo, kSboV);

  float o[NO][4] = {};
  float m_i[2] = {FA_NEG_INF, FA_NEG_INF}, l_i[2] = {0.0f, 0.0f};

  const Turns turns(wg, kWgGroups, tiles);

  for (int j = 0; j < tiles; ++j) {
    const int c0 = j * Bc, buf = j % B;
    const bool need_mask = masked(c0, row0, kWgRows);
    mbar_wait(&sm.full[buf], (j / B) & 1);  // stored, and visible to wgmma
    const bool guard = sm.rare[buf] == j + 1;
    const uint64_t b_off = buf * kStepBuf;

    // S = Q K^T, issued in this warpgroup's turn. (Also where the causal mask
    // hides the whole tile from this warpgroup, once per block: wgmma's issue
    // and wait must not sit in branches, or the compiler serializes every
    // product.)
    float s[NB][4];  // the first product ignores it
    turns.wait();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < E / 8; ++kk) {
      const uint64_t kb = kk * kStepK + b_off;
      if constexpr (kQLoShared) {
        wgmma_tf32_ss(s, d_ql + kk * kStepK, d_kh + kb, kk > 0);
      } else {
        wgmma_tf32_rs(s, ql[kk], d_kh + kb, kk > 0);
      }
      wgmma_tf32_rs(s, qh[kk], d_kl + kb);
      wgmma_tf32_rs(s, qh[kk], d_kh + kb);
    }
    wgmma_commit();
    turns.pass(j, tiles);
    // While the products run: the next tile into its buffer, and the one
    // after it on its way from global memory.
    if (j + 1 < tiles) store_tile(j + 1);

    wgmma_wait_all();
    fence_fragments(s);
    softmax_step<NB, NO, true>(s, o, m_i, l_i, mask, n, ra, L, S, c0, scale_log2, need_mask, lane);
    // O += P V, P (already in the A layout) split in registers; the tile's
    // P V in a fresh accumulator, added to o in float32 (mma.cuh's
    // add_fresh), 64 output columns at a time.
    uint32_t ph[NB][4], pl[NB][4];
    auto split_p = [&] {
#pragma unroll
      for (int kb = 0; kb < NB; ++kb) {
        split_finite(s[kb][0], ph[kb][0], pl[kb][0]);  // row g, key t
        split_finite(s[kb][2], ph[kb][1], pl[kb][1]);  // row g + 8, key t
        split_finite(s[kb][1], ph[kb][2], pl[kb][2]);  // row g, key t + 4
        split_finite(s[kb][3], ph[kb][3], pl[kb][3]);  // row g + 8, key t + 4
      }
    };
    auto products = [&](int h, float (&pv)[8][4]) {
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < NB; ++kb) {
        const uint64_t vk = kb * kStepK + h * kStepHalf + b_off;
        wgmma_64x64x8_rs(pv, pl[kb], d_vh + vk, kb > 0);
        wgmma_64x64x8_rs(pv, ph[kb], d_vl + vk);
        wgmma_64x64x8_rs(pv, ph[kb], d_vh + vk);
      }
      wgmma_commit();
      wgmma_wait_all();
      fence_fragments(pv);
    };
    // The rare path (an infinite value, or a NaN one where some key is
    // hidden) sums P V over the keys each row sees in plain float32, where
    // this tile's K was (both warpgroups take this path for the tile, and
    // each has waited for its Q K^T before the barrier): a value reaches
    // only the rows that see it (0 x NaN would not stay 0), and p x inf is
    // inf.
    // The rare path's P at fragment (kb, i): -1 where the key is hidden
    // (no exponential gives it), so that its sums skip the key.
    auto p_or_hidden = [&](int kb, int i) {
      const int r = ra + (i >> 1) * 8, key = c0 + kb * 8 + t + 4 * (i & 1);
      return mask.hides(mask.is_array() && r < L ? mask.row_base(n, r) : 0, r, key, L, S) ? -1.0f : s[kb][i];
    };
    if constexpr (NB == 8) {  // E = 64
      if (!guard) {
        split_p();
        products(0, s);  // into s's registers: P is in its split parts now
#pragma unroll
        for (int eb = 0; eb < NO; ++eb) add_fresh(o[eb], s[eb]);
      } else {
        // Into a 16 x E buffer a warp (rare_pv), then added to o.
        __syncthreads();
        auto& cur = sm.kv[buf];
        float* delta = cur.k_hi + (tid >> 5) * 16 * E;
        RareP p;
#pragma unroll
        for (int kb = 0; kb < NB; ++kb)
#pragma unroll
          for (int i = 0; i < 4; ++i) p.x[kb][i] = p_or_hidden(kb, i);
        rare_pv<E>(p, cur.v_hi, cur.v_lo, delta, g, t);
        __syncwarp();
#pragma unroll
        for (int eb = 0; eb < NO; ++eb)
#pragma unroll
          for (int i = 0; i < 4; ++i) o[eb][i] += delta[(g + (i >> 1) * 8) * E + eb * 8 + 2 * t + (i & 1)];
      }
    } else {
      // E = 128: the rare path takes P V's place, each thread summing its
      // own accumulator elements from P (-1 where the key is hidden) in
      // loops that are not unrolled. (The path above, its sums added to o
      // after loops of their own, made ptxas spill o in the main loop, which
      // then took 1.5x the time: H200, hd128 causal 8K. At E = 64 this one
      // spilled more than that one.)
      auto& cur = sm.kv[buf];
      float* pw = cur.k_hi + (tid >> 5) * 16 * Bc;
      if (!guard) {
        split_p();
      } else {
        __syncthreads();
#pragma unroll
        for (int kb = 0; kb < NB; ++kb)
#pragma unroll
          for (int i = 0; i < 4; ++i) pw[(g + 8 * (i >> 1)) * Bc + kb * 8 + t + 4 * (i & 1)] = p_or_hidden(kb, i);
        __syncwarp();
      }
#pragma unroll
      for (int h = 0; h < NO / 8; ++h) {
        float pv[8][4];
        if (!guard) {
          products(h, pv);
        } else {
#pragma unroll
          for (int eb = 0; eb < 8; ++eb)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int r = g + (i >> 1) * 8, e = h * 64 + eb * 8 + 2 * t + (i & 1);
              float acc = 0.0f;
#pragma unroll 1
              for (int c = 0; c < Bc; ++c) {
                const float p = pw[r * Bc + c];
                if (p < 0.0f) continue;
                const int at = ((e >> 3) * (Bc / 4) + (c >> 2)) * 32 + (e & 7) * 4 + (c & 3);
                const float hi = cur.v_hi[at];  // lo is NaN where hi is +-inf (split_finite)
                acc += p * (isinf(hi) ? hi : hi + cur.v_lo[at]);
              }
              pv[eb][i] = acc;
            }
        }
#pragma unroll
        for (int eb = 0; eb < 8; ++eb) add_fresh(o[h * 8 + eb], pv[eb]);
      }
    }
    mbar_arrive(&sm.empty[buf]);  // this thread's products have read the tile
    if (kLoadLate && j + 2 < tiles) load_tile(j + 2);
  }

  store_rows<float, NO>(o, m_i, l_i, sink_log2(mask_kind, mask_base, int(n % H_q)),
                        out_rows(out, src.lay.o, n, H_q, L, lse_of(mask_kind, lse)), L, E, ra, t);
}

}  // namespace fa

// fa_prefill_wg_float32_<E>: outputs the attention output and each row's log-sum-exp
// (written where mask_kind has kLse: mask_bits.h). -DFA_QUANT=1:
// fa_prefill_wgq_<dtype>_<E>, queries of the unit's dtype and keys and
// values in MLX's affine format read in place (quant_args.h's arguments).
#if !defined(FA_E)
#error "define FA_E"
#endif
#if defined(FA_QUANT) && FA_QUANT
#include "quant_args.h"
extern "C" __global__ void __launch_bounds__(fa::kWgThreads, 1)
    FA_CAT5(fa_prefill_wgq_, FA_TNAME, _, FA_E, )(FA_QUANT_PREFILL_PARAMS) {
  fa::prefill_tf32_wg<FA_E>(FA_QUANT_PREFILL_ROWS, mask, mask_base, out, lse, H_q, H_kv, L, S, mask_kind, mask_rs,
                            mask_cs, scale_log2);
}
#else
#if FA_DTYPE != 0
#error "prefill_tf32_wg.cu takes float32"
#endif
extern "C" __global__ void __launch_bounds__(fa::kWgThreads, 1) FA_CAT3(fa_prefill_wg_float32_, FA_E, )(
    const float* q, const float* k, const float* v, const void* mask, const int64_t* mask_base,
    float* out, float* lse, int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs,
    float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_tf32_wg<FA_E>(fa::Tf32Rows{q, k, v, FA_LAYOUT}, mask, mask_base, out, lse, H_q, H_kv, L, S,
                            mask_kind, mask_rs, mask_cs, scale_log2);
}
#endif
