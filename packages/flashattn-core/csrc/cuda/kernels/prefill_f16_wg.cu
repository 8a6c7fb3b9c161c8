// FlashAttention-2 forward for float16 / bfloat16 on Hopper (sm_90a): the
// products of prefill_f16.cu on warpgroup tensor-core instructions (wgmma,
// wgmma.cuh), which read their shared-memory operands themselves instead of
// every warp loading fragments with ldmatrix. One unit per (dtype, E), E in
// {64, 128}; other head dims and other GPUs take prefill_f16.cu.
//
// Block: three warpgroups x 64 query rows and key/value tiles of 128 keys
// for E = 64, four and 64 for E = 128 (wg_shapes.h); three tile buffers
// (cp.async: tile j + 1 lands while tile j is computed; the third is the
// slack for the warpgroups' skew, below). Q, K and V are stored in wgmma's
// unswizzled core-matrix layout: 8 rows x 16 bytes as 128 contiguous bytes,
// core matrices of a row band side by side along the head dim. The same layout serves all three: Q and K as K-major operands
// (the head dim is the product's K), V as the MN-major B operand of P V
// (the keys are its K, its rows stay as stored). Per tile and warpgroup:
//   1. S = Q K^T: E / 16 wgmma of 64 x Bc x 16, both operands in shared memory;
//   2. online softmax on the accumulators (mma.cuh), as prefill_f16.cu;
//   3. O += P V: Bc / 16 wgmma of 64 x E x 16, P from registers (its accumulator
//      layout is already wgmma's A layout), V from shared memory.
// The warpgroups of a block run skewed (pingpong.cuh): they take turns to
// issue Q K^T, so one's softmax runs while the others' products do. A tile's
// buffer has a full barrier (every thread's copies have landed: cp.async
// arrives on it by itself) and an empty one (every thread is done with the
// tile) instead of a block-wide barrier per tile.

#include "unit.cuh"
#include "pingpong.cuh"
#include "wg_shapes.h"
#include "wgmma.cuh"

namespace fa {

constexpr int kWhRows = wg_shapes::kRowsPerGroup;

// G warpgroups per block, key/value tiles of BC keys (wg_shapes.h).
template <int G, int BC>
struct WhShape {
  static constexpr int kBr = kWhRows * G, kBc = BC, kThreads = 128 * G;
};

constexpr int kWhBuffers = wg_shapes::kF16Buffers;

template <typename T, int E, typename Shape>
struct WhSmem {
  T q[Shape::kBr * E];
  T k[kWhBuffers][Shape::kBc * E];  // tile j in buffer j % 3
  T v[kWhBuffers][Shape::kBc * E];
  uint64_t full[kWhBuffers];   // every thread's copies of the tile have landed
  uint64_t empty[kWhBuffers];  // every thread is done with it
};

// Element (r, c) of a tile in the core-matrix layout: core matrix (r / 8, c / 8)
// at ((r / 8) (E / 8) + c / 8) x 64 elements, its row r % 8 at 8 (r % 8).
template <int E>
__device__ __forceinline__ int cm_at(int r, int c) {
  return ((r >> 3) * (E / 8) + (c >> 3)) * 64 + (r & 7) * 8 + (c & 7);
}

// rows x E elements from src rows first.., rows past count zero-filled, into
// the core-matrix layout. Chunk idx (16 bytes) is row idx % 8 of core matrix
// idx / 8: 8 neighbouring threads fill one core matrix's 128 bytes.
template <typename T, int E, int ROWS, int THREADS>
__device__ __forceinline__ void load_cm(T* dst, const T* src, int64_t stride, int first, int count, int tid) {
  constexpr int CH = E / 8;
#pragma unroll
  for (int idx = tid; idx < ROWS * CH; idx += THREADS) {
    const int r = ((idx >> 3) / CH) * 8 + (idx & 7), c8 = (idx >> 3) % CH;
    const bool valid = r < count;
    cp_async16(dst + idx * 8, valid ? src + (first + r) * stride + c8 * 8 : src, valid);
  }
}

// This thread's arrival on bar once its cp.async copies so far have landed
// (counted in the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

template <typename T, int E, typename Shape>
__device__ __forceinline__ void prefill_wg(const T* __restrict__ q, const T* __restrict__ k,
                                           const T* __restrict__ v, const void* mask_data,
                                           const int64_t* __restrict__ mask_base, T* __restrict__ out,
                                           int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs,
                                           int mask_cs, float scale_log2, Layout lay) {
  constexpr int kWhBr = Shape::kBr, kWhBc = Shape::kBc, kWhThreads = Shape::kThreads, G = kWhThreads / 128;
  constexpr int NB = kWhBc / 8, NO = E / 8;
  static_assert(E == 64 || E == 128, "wgmma's N is the head dim in P V");
  using Smem = WhSmem<T, E, Shape>;
  // Descriptor offsets (bytes): core matrices adjacent along the head dim are
  // 128 apart, row bands 16 E apart. K-major (Q, K): LBO along K = the head
  // dim, SBO along the rows. MN-major (V): SBO along N = the head dim, LBO
  // along K = the keys. A step of 16 along the head dim adds 256 bytes, of 16
  // keys 32 E; the next buffer is sizeof(k[0]) away.
  constexpr uint32_t kBand = 16 * E;
  constexpr uint64_t kStepE = 256 >> 4, kStepKeys = (32 * E) >> 4;
  constexpr uint64_t kStepBuf = (kWhBc * E * sizeof(T)) >> 4;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const PrefillBlock blk(kWhBr, H_q, H_kv, L, S, mask_kind);
  const int64_t n = blk.n;
  const int l0 = blk.l0, kv_end = blk.kv_end;
  const T* k_head = k + lay.k.at(blk.b, blk.g, 0);
  const T* v_head = v + lay.v.at(blk.b, blk.g, 0);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, S - L};
  const int n_tiles = (kv_end + kWhBc - 1) / kWhBc;
  const int row0 = l0 + wg * kWhRows;  // this warpgroup's first row
  const int ra = row0 + w * 16 + g;    // this thread's rows: ra and ra + 8

  if (tid < kWhBuffers) {
    mbar_init(&sm.full[tid], kWhThreads);
    mbar_init(&sm.empty[tid], kWhThreads);
  }
  // Tile j into buffer j % 3 once every thread is done with tile j - 3 there.
  auto load_tile = [&](int j) {
    const int b = j % kWhBuffers, c = j * kWhBc;
    if (j >= kWhBuffers) mbar_wait(&sm.empty[b], (j / kWhBuffers - 1) & 1);
    load_cm<T, E, kWhBc, kWhThreads>(sm.k[b], k_head, lay.k.sr, c, min(kWhBc, S - c), tid);
    load_cm<T, E, kWhBc, kWhThreads>(sm.v[b], v_head, lay.v.sr, c, min(kWhBc, S - c), tid);
    cp_async_arrive(&sm.full[b]);
  };
  load_cm<T, E, kWhBr, kWhThreads>(sm.q, q + lay.q.at(blk.b, blk.h, 0), lay.q.sr, l0, min(kWhBr, L - l0), tid);
  cp_async_commit();
  __syncthreads();  // the barriers are initialised
  if (n_tiles > 0) load_tile(0);
  cp_async_wait<0>();  // Q has landed (tile 0 arrives on its barrier)
  fence_proxy_async();
  __syncthreads();

  const uint64_t d_q = wgmma_desc(sm.q + wg * kWhRows * E, 128, kBand);
  const uint64_t d_k = wgmma_desc(sm.k[0], 128, kBand);
  const uint64_t d_v = wgmma_desc(sm.v[0], kBand, 128);

  float o[NO][4] = {};
  float m_i[2] = {FA_NEG_INF, FA_NEG_INF}, l_i[2] = {0.0f, 0.0f};

  constexpr int NK = kWhBc / 16;  // P V's K steps
  float s[NB][4];                   // scores, then P (float)
  uint32_t p[NK][4];                // P as P V's A operand
  auto wait_tile = [&](int j) {
    mbar_wait(&sm.full[j % kWhBuffers], (j / kWhBuffers) & 1);  // tile j has landed
    fence_proxy_async();                                        // and is visible to wgmma
  };
  auto issue_qk = [&](int j) {  // s = Q K_j^T
    const uint64_t b_off = (j % kWhBuffers) * kStepBuf;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < E / 16; ++kk) wgmma16_ss<T, kWhBc>(s, d_q + kk * kStepE, d_k + b_off + kk * kStepE, kk > 0);
  };
  auto issue_pv = [&](int j) {  // o += P V_j
    const uint64_t b_off = (j % kWhBuffers) * kStepBuf;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) wgmma16_rs_t<T, E>(o, p[kk], d_v + b_off + kk * kStepKeys);
  };
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
      p[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      p[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      p[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      p[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };
  auto need_mask = [&](int j) { return mask.tile_hides(j * kWhBc, kWhBc, row0, S); };
  // Rare: a tile where some key is hidden from some row of the block and
  // some value is not finite (block-wide: every thread must ask).
  auto rare = [&](int j) {
    if (!mask.tile_hides(j * kWhBc, kWhBc, l0, S)) return false;
    bool bad = false;
    const T* sv = sm.v[j % kWhBuffers];
    for (int idx = tid; idx < kWhBc * E; idx += kWhThreads) bad |= !isfinite(to_f(sv[idx]));
    return __syncthreads_or(bad) != 0;
  };
  // Its P V in plain float32 over visible keys only (0 x NaN would leak a
  // hidden value), P as P V would take it; P of key c sits with quad thread
  // (c % 8) / 2, so the quad passes it round.
  auto rare_pv = [&](int j) {
    const int c0 = j * kWhBc;
    const T* sv = sm.v[j % kWhBuffers];
    const int64_t rb[2] = {mask.is_array() && ra < L ? mask.row_base(n, ra) : 0,
                           mask.is_array() && ra + 8 < L ? mask.row_base(n, ra + 8) : 0};
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint32_t pair[2] = {p[nb >> 1][(nb & 1) * 2], p[nb >> 1][(nb & 1) * 2 + 1]};  // rows g, g + 8
#pragma unroll 1
      for (int i = 0; i < 8; ++i) {
        const int c = nb * 8 + i, src = (lane & ~3) | (i >> 1), key = c0 + c;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const float pr = unpack_half<T>(__shfl_sync(0xffffffffu, pair[rr], src), i & 1);
          if (mask.hides(rb[rr], ra + rr * 8, key, L, S)) continue;
#pragma unroll
          for (int eb = 0; eb < NO; ++eb) {
            o[eb][2 * rr] += pr * to_f(sv[cm_at<E>(c, eb * 8 + 2 * t)]);
            o[eb][2 * rr + 1] += pr * to_f(sv[cm_at<E>(c, eb * 8 + 2 * t + 1)]);
          }
        }
      }
    }
  };

  const Turns turns(wg, G, n_tiles);
  for (int j = 0; j < n_tiles; ++j) {
    wait_tile(j);
    if (j + 1 < n_tiles) load_tile(j + 1);
    turns.wait();
    issue_qk(j);
    wgmma_commit();
    turns.pass(j, n_tiles);
    wgmma_wait_all();
    fence_fragments(s);
    softmax_step<NB, NO>(s, o, m_i, l_i, mask, n, ra, L, S, j * kWhBc, scale_log2, need_mask(j), lane);
    pack_p();
    if (rare(j)) {
      rare_pv(j);
    } else {
      issue_pv(j);
      wgmma_commit();
      wgmma_wait_all();
      fence_fragments(o);
      fence_fragments(p);
    }
    mbar_arrive(&sm.empty[j % kWhBuffers]);  // this thread's products have read the tile
  }

  cp_async_wait_all();  // nothing may be in flight at exit
  store_rows<T, NO>(o, l_i, out, n, L, E, ra, t);
}

}  // namespace fa

// fa_prefill_wg_<dtype>_<E>: grid (row tiles x threads, H_q, batch), threads
// and dynamic shared memory as wg_shapes.h says.
#if !defined(FA_E)
#error "define FA_E"
#endif
#if FA_DTYPE == 0
#error "prefill_f16_wg.cu takes float16 or bfloat16; float32 has prefill_tf32_wg.cu"
#endif
using WhUnitShape = fa::WhShape<fa::wg_shapes::f16_groups(FA_E), fa::wg_shapes::f16_bc(FA_E)>;
static_assert(sizeof(fa::WhSmem<FA_T, FA_E, WhUnitShape>) == fa::wg_shapes::f16_smem_bytes(FA_E),
              "the planner's shared memory");
extern "C" __global__ void __launch_bounds__(WhUnitShape::kThreads, 1) FA_CAT5(fa_prefill_wg_, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base,
    FA_T* out, int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs,
    float scale_log2, FA_LAYOUT_PARAMS) {
  fa::prefill_wg<FA_T, FA_E, WhUnitShape>(q, k, v, mask, mask_base, out, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs,
                             scale_log2, FA_LAYOUT);
}
