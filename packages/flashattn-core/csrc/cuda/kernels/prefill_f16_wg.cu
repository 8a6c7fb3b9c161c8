// FlashAttention-2 forward for float16 / bfloat16 on Hopper (sm_90a): the
// products of prefill_f16.cu on warpgroup tensor-core instructions (wgmma,
// wgmma.cuh), which read their shared-memory operands themselves instead of
// every warp loading fragments with ldmatrix. One unit per (dtype, E), E in
// {64, 80, 96, 128}; E = 80 and 96 in the E = 128 kernel's tiles, the
// columns past E zero (wg_shapes.h's f16_stored_e), P V E columns wide;
// other head dims and other GPUs take prefill_f16.cu.
//
// Block (wg_shapes.h): consumer warpgroups of 64 query rows each (three
// for E = 64, two for E = 128) and a producer warpgroup that copies Q and
// every key/value tile of 128 keys (cp.async) into three buffers, as they
// free up; it keeps few registers and the consumers take the rest
// (setmaxnreg). At E = 128 a block may take two row tiles (ITEMS, below).
// Q, K and V are stored in wgmma's
// 128-byte swizzled layout (wgmma.cuh's sw_at). The same layout serves all three:
// Q and K as K-major operands (the head dim is the product's K), V as the
// MN-major B operand of P V (the keys are its K, its rows stay as stored).
// Per tile and consumer warpgroup:
//   1. S = Q K^T: E / 16 wgmma of 64 x Bc x 16, both operands in shared memory;
//   2. online softmax on the accumulators (softmax.cuh), as prefill_f16.cu;
//   3. O += P V: Bc / 16 wgmma of 64 x E x 16, P from registers (its accumulator
//      layout is already wgmma's A layout), V from shared memory.
// The consumers run skewed (pingpong.cuh): they take turns to issue Q K^T,
// so one's softmax runs while the others' products do. With OVERLAP a
// warpgroup also issues step 3 of the previous tile with step 1 and runs
// step 2 while it is in flight (up to wg_shapes.h's
// kF16SoftmaxUnderPvMaxE). A tile's buffer has a full barrier (its copies
// have landed: the producer's TMA copies complete it by their bytes) and an
// empty one (every consumer thread is done with the tile) instead of a
// block-wide barrier per tile.

#include <algorithm>

#include "unit.cuh"
#include "f32_split.cuh"
#include "pingpong.cuh"
#include "key_split.cuh"
#include "store_output.cuh"
#include "tma.cuh"
#include "wg_shapes.h"
#include "wgmma.cuh"

// Points of a block's timeline that benchmarks/cuda-probes/prefill-timeline.cu
// records (it defines the macro); nothing in the shipped kernels.
#ifndef FA_TIMELINE_MARK
#define FA_TIMELINE_MARK(k) ((void)0)
#endif

namespace fa {

constexpr int kWhRows = wg_shapes::kRowsPerGroup;

// G warpgroups per block, key/value tiles of BC keys (wg_shapes.h).
// OVERLAP: a warpgroup issues tile j's Q K^T together with tile j - 1's P V
// and runs tile j's softmax while that P V is in flight.
// One more warpgroup, the producer, does every key/value copy (one thread,
// with the Tensor Memory Accelerator: tma.cuh), and the G consumer
// warpgroups take its registers (setmaxnreg).
// ITEMS: 2 lets a block take many row tiles, when the
// planner launches one block per SM (prefill_wg's `slices` > 0): the
// producer loads a tile's Q and first key/value tiles while the consumers
// finish the one before, instead of the SM idling between blocks. (The name
// is from when a block took two: p and row_tiles - 1 - p.)
template <int G, int BC, bool OVERLAP, int ITEMS = 1>
struct WhShape {
  static_assert(ITEMS == 1 || ITEMS == 2, "one row tile a block, or many (2)");
  static constexpr int kBr = kWhRows * G, kBc = BC, kThreads = 128 * (G + 1), kItems = ITEMS;
  static constexpr bool kOverlap = OVERLAP;
  // Registers per thread after setmaxnreg. The launch (one block per SM)
  // gives every thread kLaunchRegs; the producer keeps 24 (one thread
  // copies), and the consumers share what it frees (multiples of 8, at most
  // 240). Asking for more than the block holds would hang the consumers'
  // setmaxnreg.inc.
  static constexpr int kLaunchRegs = std::min(65536 / kThreads / 8 * 8, 248);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = std::min((kLaunchRegs * (G + 1) - kProducerRegs) / G / 8 * 8, 240);
  static_assert(128 * (kProducerRegs + G * kConsumerRegs) <= 128 * (G + 1) * kLaunchRegs,
                "setmaxnreg: the consumers ask for more registers than the producer frees");
};

constexpr int kWhBuffers = wg_shapes::kF16Buffers;

template <typename T, int E, typename Shape, int EQ = E>
struct WhSmem {
  T q[Shape::kBr * EQ];  // EQ: the queries' stored columns (kTT: half the keys')
  T k[kWhBuffers][Shape::kBc * E];  // tile j in buffer j % 3
  T v[kWhBuffers][Shape::kBc * E];
  uint64_t full[kWhBuffers];   // every thread's copies of the tile have landed
  uint64_t empty[kWhBuffers];  // every thread is done with it
  uint64_t q_full, q_empty;    // the same for Q (with a producer)
};

// Copies of ROWS x E tiles into the swizzled layout by THREADS threads,
// the source rows ED <= E long (columns ED.. zero-filled),
// asynchronously (cp.async). Neighbouring threads take neighbouring 16-byte
// chunks of a row: each 8 read 128 contiguous bytes (whole sectors; with rows across them instead,
// every sector came half used and twice) and, thanks to the swizzle, write
// one 128-byte row of shared memory without conflicts. A thread's chunks sit
// kRowStep rows apart in one column, so its addresses are fixed offsets from
// its first (a multiple of 8 rows keeps the swizzle's XOR): per chunk, an
// add and the copy. Rows past the count are zero-filled (no bytes read: the
// address is never dereferenced).
template <typename T, int E, int ROWS, int THREADS, int ED = E>
struct TileCopy {
  static constexpr int CH = E / 8, kRowStep = THREADS / CH;
  static constexpr int kChunks = (ROWS + kRowStep - 1) / kRowStep;
  static_assert(THREADS % CH == 0 && kRowStep % 8 == 0, "a thread's chunks keep their column and swizzle");
  int r0, c0, dst0;  // this thread's first chunk: row, column, place in the tile

  __device__ explicit TileCopy(int tid) : r0(tid / CH), c0((tid % CH) * 8), dst0(sw_at<ROWS>(tid / CH, c0)) {}

  // Rows first.. of src (row stride `stride`) into dst; rows past count
  // zero-filled.
  __device__ __forceinline__ void operator()(T* dst, const T* src, int64_t stride, int first, int count) const {
    const T* g = src + ((first + r0) * stride + c0);
    const int64_t step = kRowStep * stride;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int r = r0 + i * kRowStep;
      if (ROWS % kRowStep == 0 || i + 1 < kChunks || r < ROWS)  // the last round: warp-uniform
        cp_async16(dst + dst0 + i * kRowStep * 64, g + i * step, r < count && (ED == E || c0 < ED));
    }
  }
};

// kF32: float32 attention over the 16-bit inputs (fa_prefill_wg32_*), the
// output float32: the scores are float32-exact already (16-bit products are
// exact in float32 and accumulate in float32), and P goes into P V as
// PSplit's terms (mma.cuh): two, P to 16 bits (bfloat16) or 22 (float16), so
// two P V products a tile instead of one. A third bfloat16 term (24 bits)
// took the output from ~2e-6 to ~5e-7 off float64, at 1.2-1.3x the time,
// and left no registers for the overlap at E = 64 (docs/cuda.md).
// kTT (with kF32; fa_prefill_wg32t_*): keys and values are a quantized
// cache's rows as two bfloat16 terms, [hi | lo] (E = twice the head dim:
// quant_split.cu), the queries E / 2 wide. Q K^T reads each query row twice,
// once against each half, so the scores are q . (hi + lo); P V adds P hi x
// hi, P hi x lo and P lo x hi into one accumulator E / 2 wide, the
// output's. P lo x lo is left out: each lo is within 2^-9 of its hi, so the
// product is within 2^-18 of P x V, under the terms' own 2^-17.
// kQS (with kTT, float16; prefill_f32s_wg.cu): float32 queries, keys and
// values as two float16 terms each (f32_split.cu), every 128-row tile
// scaled by a power of two of its own (`shifts`: Q's per row tile, then K's
// and V's per key tile). Q K^T adds Q hi x K hi, Q hi x K lo and Q lo x K hi
// (22 bits a side, as 3xTF32, at float16's rate: twice TF32's); each key
// tile's scale enters its softmax step and its P V's addition to o. A tile
// marked bad (a value not finite among its keys, its values or the block's
// queries) takes its scores and its P V in plain float32 from the float32
// inputs (`f32`) instead, as the rare tiles of the other units do.
template <typename T, int E, typename Shape, bool kF32 = false, bool kTT = false,
          typename TO = std::conditional_t<kF32, float, T>, bool kQS = false>
__device__ __forceinline__ void prefill_wg(const T* __restrict__ q, const T* __restrict__ k,
                                           const T* __restrict__ v, const void* mask_data,
                                           const int64_t* __restrict__ mask_base, TO* __restrict__ out,
                                           float* __restrict__ lse,
                                           int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs,
                                           int mask_cs, float scale_log2, int slices, int split_from,
                                           int splits, Layout lay,
                                           const MapTemplate* map_template = nullptr,
                                           void* map_slots = nullptr, unsigned long long tag = 0,
                                           const int* __restrict__ shifts = nullptr,
                                           const f32_split::Source f32 = {}) {
  constexpr int kWhBr = Shape::kBr, kWhBc = Shape::kBc, kWhThreads = Shape::kThreads;
  constexpr int kConsumers = kWhThreads - 128, G = kConsumers / 128;
  // Arrivals on a full barrier: the producer thread's expect_tx (the bytes
  // complete it).
  constexpr int kCopiers = 1;
  // EP: the head dim as stored (wg_shapes.h's f16_stored_e); the columns E..
  // of Q, K and V are zero there. Q K^T takes E / 16 steps, P V has N = E
  // (kTT: N = E / 2, twice).
  // kTT: EQ the queries' stored columns (each read twice), EO the output's.
  constexpr int EP = wg_shapes::f16_stored_e(E, kTT), EQ = kTT && !kQS ? EP / 2 : EP, EO = kTT ? E / 2 : E;
  static_assert(!kQS || (kTT && std::is_same_v<T, __half> && !Shape::kOverlap),
                "split queries: the two-term float16 units, no overlap");
  constexpr int NB = kWhBc / 8, NO = EO / 8;
  static_assert(kTT ? kF32 && (E == 128 || E == 256) : E == 64 || E == 80 || E == 96 || E == 128,
                "the units CMakeLists.txt builds");
  using Smem = WhSmem<T, EP, Shape, EQ>;
  // Descriptors (wgmma.cuh; offsets in 16-byte units). K-major (Q, K): 8-row
  // groups 1024 bytes apart (SBO); a step of 16 along the head dim moves 32
  // bytes within a column block, or to the next block (rows x 128 bytes on).
  // MN-major (V): 8-key groups 1024 bytes apart (SBO), column blocks
  // kWhBc x 128 bytes apart (LBO); a step of 16 keys moves 2048 bytes.
  auto step_e = [](int rows, int kk) { return uint32_t((kk >> 2) * rows * 8 + (kk & 3) * 2); };
  constexpr uint32_t kStepKeys = 2048 >> 4;
  constexpr uint32_t kStepBuf = (kWhBc * EP * sizeof(T)) >> 4;
  extern __shared__ __align__(1024) unsigned char smem_wg[];  // its own name: other units declare 16-byte alignment
  auto& sm = *reinterpret_cast<Smem*>(smem_wg);
  if (smem_u32(smem_wg) & 1023) __trap();  // the swizzle needs 1024-byte alignment (never seen otherwise)
  // wg from lane 0: ptxas then knows it is warp-uniform and keeps what
  // derives from it (the Q descriptor) in uniform registers.
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), w = (tid >> 5) & 3, lane = tid & 31,
            g = lane >> 2, t = lane & 3;
  // This block's row tiles ("items": a row tile of one (batch, query head)
  // slice). With slices = 0, the grid's own tile (PrefillBlock: heaviest
  // first across the slices). With slices > 0 (Shape::kItems = 2) the
  // launch is one block per SM and every item is placed in a list ordered
  // heaviest first (position u: tile row_tiles - 1 - u / slices of slice
  // u % slices); of P blocks, block b takes positions b, 2P - 1 - b, 2P + b,
  // 4P - 1 - b, ... (a snake), which evens out the blocks' work, and the
  // producer loads an item's Q and first tiles while the consumers finish the
  // one before.
  // With splits > 1 (key_split.cuh) the launch is a row of blocks: the first
  // split_from take the row tiles in the same order, a tile each, and the
  // rest cut each of the remaining (lightest) row tiles' keys into `splits`
  // pieces, a piece a block.
  const int row_tiles = (L + kWhBr - 1) / kWhBr;
  const bool split = splits > 1;
  const int64_t units = Shape::kItems == 2 && !split ? int64_t(row_tiles) * slices : 0;
  const int P = gridDim.x, bx = blockIdx.x;
  auto position = [&](int i) { return int64_t(i) * P + (i % 2 == 0 ? bx : P - 1 - bx); };
  const int n_items = units == 0 ? 1 : int(units / P) + (position(int(units / P)) < units ? 1 : 0);
  const Mask mask{mask_kind, mask_data, mask_base, mask_rs, mask_cs, L, S};
  // This block's piece of its row tile (split launches), -1 for a whole tile.
  const int64_t split_at = split ? int64_t(blockIdx.x) - split_from : -1;
  const int piece = split_at < 0 ? -1 : int(split_at % splits);
  auto item_block = [&](int i) {
    if (split) {
      const int64_t u = split_at < 0 ? int64_t(blockIdx.x) : split_from + split_at / splits;
      return PrefillBlock(kWhBr, H_q, H_kv, L, S, mask_kind, mask_cs, row_tiles - 1 - int(u / slices), u % slices);
    }
    if (units == 0) return PrefillBlock(kWhBr, H_q, H_kv, L, S, mask_kind, mask_cs);
    const int64_t u = position(i);
    return PrefillBlock(kWhBr, H_q, H_kv, L, S, mask_kind, mask_cs, row_tiles - 1 - int(u / slices), u % slices);
  };
  // An item's key tiles: [kv_begin, kv_end) in tiles, or a piece's share of them.
  auto begin_of = [&](const PrefillBlock& ib) { return ib.kv_begin / kWhBc; };
  auto tiles_of = [&](const PrefillBlock& ib) { return (ib.kv_end + kWhBc - 1) / kWhBc - begin_of(ib); };
  auto first_tile = [&](const PrefillBlock& ib) {
    return begin_of(ib) + (piece < 0 ? 0 : wg_shapes::piece_first_tile(tiles_of(ib), piece, splits));
  };
  auto end_tile = [&](const PrefillBlock& ib) {
    return begin_of(ib) + (piece < 0 ? tiles_of(ib) : wg_shapes::piece_first_tile(tiles_of(ib), piece + 1, splits));
  };
  // The current item's rows and keys: its tiles kv0 .. kv0 + n_tiles - 1,
  // counted from 0 (tile j is keys key0(j) ..).
  PrefillBlock blk = item_block(0);
  // kQS: the tiles' shifts (a grid of row tiles: gridDim.z is the batch).
  static_assert(!kQS || (kWhBr == f32_split::kRows && kWhBc == f32_split::kRows), "a tile a shift");
  const f32_split::Shifts split_shifts{shifts, int64_t(gridDim.z) * H_q, int64_t(gridDim.z) * H_kv,
                                       f32_split::tiles(L), f32_split::tiles(S)};
  const int* k_shift = nullptr;
  const int* v_shift = nullptr;
  int q_shift = 0;
  bool q_bad = false;
  int64_t n;
  int l0, kv_end, kv0, n_tiles, row0, ra;
  const T *k_head, *v_head;
  auto key0 = [&](int j) { return (kv0 + j) * kWhBc; };
  auto begin_item = [&](int i) {
    blk = item_block(i);
    n = blk.n, l0 = blk.l0, kv_end = blk.kv_end;
    kv0 = first_tile(blk);
    n_tiles = end_tile(blk) - kv0;
    k_head = k + lay.k.at(blk.b, blk.g, 0);
    v_head = v + lay.v.at(blk.b, blk.g, 0);
    row0 = l0 + wg * kWhRows;  // this warpgroup's first row
    ra = row0 + w * 16 + g;    // this thread's rows: ra and ra + 8
    if constexpr (kQS) {
      const int64_t kv_slice = blk.b * H_kv + blk.g;
      k_shift = split_shifts.k(kv_slice);
      v_shift = split_shifts.v(kv_slice);
      q_shift = split_shifts.q(blk.n)[l0 / kWhBr];
      q_bad = q_shift == f32_split::kBad;
    }
  };
  begin_item(0);
  // Tile j of the current item is the block's (it0 + j)-th: buffer and
  // barrier phase follow the block's count.
  int it0 = 0;
  auto buf = [&](int j) { return (it0 + j) % kWhBuffers; };

  if (tid < kWhBuffers) {
    mbar_init(&sm.full[tid], kCopiers);
    mbar_init(&sm.empty[tid], kConsumers);
  }
  if (tid == kWhBuffers) {
    mbar_init(&sm.q_full, kCopiers);
    mbar_init(&sm.q_empty, kConsumers);
  }
  fence_mbar_init();
  __syncthreads();  // the barriers are initialised
  if (wg == G) {  // the producer: each item's Q once the consumers are done with the last, then its tiles
    setmaxnreg_dec<Shape::kProducerRegs>();
    // Tensor maps of Q, K and V (4-d: head dim, rows, heads, batch); a
    // box is 64 columns (128 bytes: the swizzle's row) of a tile's rows
    // (at E = 80 / 96 the second box's columns past E come zero-filled,
    // and count in its bytes).
    // Made by the producer's first warp once per SM and call
    // (tma_call_maps), staged in a value buffer not yet loaded. Item 0's
    // Q and first key/value tile are copied by the consumers meanwhile
    // (below): the producer only arrives for them, so that calls of one wave
    // of blocks do not wait out the making of the maps.
    if (tid % 128 >= 32) return;
    if (tid % 128 == 0) {
      mbar_arrive(&sm.q_full);
      if (n_tiles > 0) mbar_arrive(&sm.full[0]);
    }
    const int batch = units == 0 && !split ? int(gridDim.z) : slices / H_q;
    auto fields = [&](const void* base, const Rows& r, uint32_t cols, uint32_t rows, uint32_t heads) {
      // A stride of 0 (an axis of size 1) as if the axis were packed.
      const uint64_t sr = r.sr != 0 ? uint64_t(r.sr) * sizeof(T) : cols * sizeof(T);
      const uint64_t sh = r.sh != 0 ? uint64_t(r.sh) * sizeof(T) : sr * rows;
      const uint64_t sb = r.sb != 0 ? uint64_t(r.sb) * sizeof(T) : sh * heads;
      return MapFields{base, {cols, rows, heads, uint32_t(batch)}, {sr, sh, sb}, 0};
    };
    unsigned char* staging = reinterpret_cast<unsigned char*>(sm.v[kWhBuffers - 1]);
    MapFields f[3] = {fields(q, lay.q, kTT ? EQ : E, L, H_q), fields(k, lay.k, E, S, H_kv),
                      fields(v, lay.v, E, S, H_kv)};
    f[0].box_rows = kWhBr;
    f[1].box_rows = f[2].box_rows = kWhBc;
    const unsigned char* maps =
        tma_call_maps<3, wg_shapes::kMapSlots, wg_shapes::kMapSlotBytes>(map_slots, tag, *map_template, staging, f,
                                                                         units > 0);
    const void *map_q = maps, *map_k = maps + 128, *map_v = maps + 256;
    if (tid % 128 != 0) return;
    FA_TIMELINE_MARK(6);
    tma_prefetch_map(map_q);
    tma_prefetch_map(map_k);
    tma_prefetch_map(map_v);
    constexpr uint32_t kQBytes = kWhBr * EQ * sizeof(T), kKvBytes = 2 * kWhBc * EP * sizeof(T);
    for (int i = 0; i < n_items; ++i) {
      if (i > 0) {
        begin_item(i);
        mbar_wait(&sm.q_empty, (i - 1) & 1);
      }
      if (i > 0) {
        mbar_arrive_expect_tx(&sm.q_full, kQBytes);
#pragma unroll
        for (int cb = 0; cb < EQ / 64; ++cb)
          tma_load_4d(sm.q + cb * kWhBr * 64, map_q, &sm.q_full, cb * 64, l0, blk.h, int(blk.b));
      }
      for (int j = i == 0 ? 1 : 0; j < n_tiles; ++j) {
        const int gj = it0 + j, b = gj % kWhBuffers;
        if (gj >= kWhBuffers) mbar_wait(&sm.empty[b], (gj / kWhBuffers - 1) & 1);
        mbar_arrive_expect_tx(&sm.full[b], kKvBytes);
#pragma unroll
        for (int cb = 0; cb < EP / 64; ++cb) {
          tma_load_4d(sm.k[b] + cb * kWhBc * 64, map_k, &sm.full[b], cb * 64, key0(j), blk.g, int(blk.b));
          tma_load_4d(sm.v[b] + cb * kWhBc * 64, map_v, &sm.full[b], cb * 64, key0(j), blk.g, int(blk.b));
        }
      }
      it0 += n_tiles;
    }
    return;
  }
  setmaxnreg_inc<Shape::kConsumerRegs>();
  // The consumers copy item 0's Q and first tile while the producer makes the maps.
  const TileCopy<T, EQ, kWhBr, kConsumers, kTT ? EQ : E> copy_q(tid);
  copy_q(sm.q, q + lay.q.at(blk.b, blk.h, 0), lay.q.sr, l0, L - l0);
  if (n_tiles > 0) {
    const TileCopy<T, EP, kWhBc, kConsumers, E> copy_tile(tid);
    copy_tile(sm.k[0], k_head, lay.k.sr, key0(0), S - key0(0));
    copy_tile(sm.v[0], v_head, lay.v.sr, key0(0), S - key0(0));
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  named_sync(2 + G, kConsumers);
  FA_TIMELINE_MARK(1);

  const WgDesc d_q(wgmma_desc_sw128(sm.q + wg * kWhRows * 64, 16, 1024));
  const WgDesc d_k(wgmma_desc_sw128(sm.k[0], 16, 1024));
  const WgDesc d_v(wgmma_desc_sw128(sm.v[0], kWhBc * 128, 1024));

  float o[NO][4];
  // kF32: each tile's P V into a fresh accumulator, added to o in float32
  // (rounded to nearest). The tensor cores' own accumulation of the 2-3
  // products a key over every tile drifted: 9.4e-5 against float64 at
  // 32768 keys (bfloat16, H200), where float32's tolerance is 2e-5.
  float o_tile[NO][4];
  float (&o_pv)[NO][4] = kF32 ? o_tile : o;
  // kQS: times the tile's V scale and its rows' 2^-p_shift (P's scale),
  // one rounding (fma).
  int p_shift[2] = {0, 0};
  auto add_tile = [&](float v_scale) {
    if constexpr (kQS) {
      fence_fragments(o_tile);
      const float f[2] = {v_scale * f32_split::pow2(-p_shift[0]), v_scale * f32_split::pow2(-p_shift[1])};
#pragma unroll
      for (int eb = 0; eb < NO; ++eb)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[eb][c] = fmaf(o_tile[eb][c], f[c >> 1], o[eb][c]);
    } else if constexpr (kF32) {
      fence_fragments(o_tile);
#pragma unroll
      for (int eb = 0; eb < NO; ++eb) add_fresh(o[eb], o_tile[eb]);
    }
  };
  // kQS: tile j's V scale times 1 / P's (its terms carry kPScale), and its
  // softmax's scale (the queries' and keys' shifts undone).
  auto v_scale_of = [&](int j) {
    if constexpr (kQS) return ldexpf(1.0f, -15 - v_shift[kv0 + j]);
    else return 1.0f;
  };
  auto scale_of = [&](int j) {
    if constexpr (kQS) return ldexpf(scale_log2, -(q_shift + k_shift[kv0 + j]));
    else return scale_log2;
  };
  // kQS: whether tile j takes the plain float32 path (warp-uniform), read
  // once a tile into `bad_tile` (its loads anywhere later would wait in the
  // chain).
  auto tile_bad = [&](int j) {
    if constexpr (kQS) return q_bad || k_shift[kv0 + j] == f32_split::kBad || v_shift[kv0 + j] == f32_split::kBad;
    else return false;
  };
  bool bad_tile = false;
  float m_i[2] = {FA_NEG_INF, FA_NEG_INF}, l_i[2] = {0.0f, 0.0f};  // set again for each item

  constexpr int NK = kWhBc / 16;  // P V's K steps
  using Split = PSplit<T, wg_shapes::kF32Bf16Terms>;
  constexpr int kTerms = kF32 ? Split::kTerms : 1;
  constexpr float kPScale = kF32 ? Split::kScale : 1.0f;
  float s[NB][4];                   // scores, then P (float)
  uint32_t p[kTerms][NK][4];        // P as P V's A operand (kF32: its terms)
  auto wait_tile = [&](int j) {
    mbar_wait(&sm.full[buf(j)], ((it0 + j) / kWhBuffers) & 1);  // tile j has landed (visible to wgmma: TMA)
  };
  // The tile's buffer offset from lane 0, as wg above: ptxas then builds the
  // K and V descriptors in uniform registers (UIADD3) instead of moving each
  // one over from ordinary registers (R2UR) right before its wgmma, which
  // the wgmma would wait on.
  auto buf_offset = [&](int j) { return uint32_t(__shfl_sync(0xffffffffu, buf(j) * kStepBuf, 0)); };
  auto issue_qk = [&](int j) {  // s = Q K_j^T (over the E columns: the rest are zero; kTT: Q twice)
    const uint32_t b_off = buf_offset(j);
    wgmma_fence();
    // kQS: Q hi against K's both halves, then Q lo against K hi.
    constexpr int kQSteps = kQS ? E / 32 : EQ / 16;
#pragma unroll
    for (int kk = 0; kk < E / 16; ++kk)
      wgmma16_ss<T, kWhBc>(s, d_q.at(step_e(kWhBr, kk % kQSteps)), d_k.at(b_off + step_e(kWhBc, kk)), kk > 0);
    if constexpr (kQS) {
#pragma unroll
      for (int kk = 0; kk < E / 32; ++kk)
        wgmma16_ss<T, kWhBc>(s, d_q.at(step_e(kWhBr, E / 32 + kk)), d_k.at(b_off + step_e(kWhBc, kk)), true);
    }
  };
  auto issue_pv = [&](int j) {  // o += P V_j (kF32: o_tile = P V_j)
    const uint32_t b_off = buf_offset(j);
    if constexpr (kF32) {
#pragma unroll
      for (int eb = 0; eb < NO; ++eb)
#pragma unroll
        for (int c = 0; c < 4; ++c) o_tile[eb][c] = 0.0f;
    }
    wgmma_fence();
    // kTT: V's lo half starts EO / 64 column blocks on (kWhBc x 128 bytes each).
    constexpr uint32_t kLoOffset = uint32_t(EO / 64 * kWhBc * 128) >> 4;
#pragma unroll
    for (int term = 0; term < kTerms; ++term)
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        wgmma16_rs_t<T, EO>(o_pv, p[term][kk], d_v.at(b_off + kk * kStepKeys));
        if constexpr (kTT) {
          if (term == 0) wgmma16_rs_t<T, EO>(o_pv, p[term][kk], d_v.at(b_off + kk * kStepKeys + kLoOffset));
        }
      }
  };
  // P's pairs (keys 2t, 2t + 1 of rows g, g + 8 in each 8-key block) as P V's
  // A operand; kF32: each term the rounding of what the ones before left.
  auto pack_p = [&] {
    if constexpr (kQS) {
      const float f[2] = {kPScale * f32_split::pow2(p_shift[0]), kPScale * f32_split::pow2(p_shift[1])};
      pack_p_terms<T>(p, s, f);
    } else {
      pack_p_terms<T>(p, s, kPScale);
    }
  };
  auto need_mask = [&](int j) { return mask.tile_hides(key0(j), kWhBc, row0, kWhRows, S); };
  // Tile j's softmax: against the rows' running base, with no maximum
  // taken, where it may (softmax.cuh's softmax_scores_stale: unmasked tiles
  // once every row of the warp has a finite base), else against the tile's
  // maximum. The maximum's instructions were what the step saved, not the
  // exponents' wait for them: a bfloat16 chunk of 2,048 rows over 16,384 keys
  // 0.944x the time, causal 8K 0.967x (qwen05b) and 0.947x (hd128), causal
  // 2K at hd128 1.008x (H200, benchmarks/cuda-probes/prefill-timeline.cu).
  // Not for float32 attention, whose step took 1.01-1.02x the time with it:
  // its P's split keeps the chain long either way (docs/cuda.md).
  constexpr bool kStale = !kF32;
  auto softmax_tile = [&](int j, float (&alpha)[2], float tile_scale_log2) {
    bool exact = !kStale || need_mask(j) || !(scale_log2 > 0.0f) ||
                 !__all_sync(0xffffffffu, isfinite(m_i[0]) && isfinite(m_i[1]));
    if (!exact && softmax_scores_stale<NB>(s, alpha, m_i, l_i, scale_log2)) {
      // A P reached 2^64 or was not finite: the tile's scores again,
      // then the exact step. In float32 from shared memory, a score at a
      // time in rolled loops (16-bit products are exact; the sums run in
      // another order than the tensor cores'): issuing Q K^T again here made
      // ptxas spill ~1.7 KB in the main loop.
      const T* sq = sm.q;
      const T* sk = sm.k[buf(j)];
      float redo[2 * NB * 2];
#pragma unroll 1
      for (int x = 0; x < 2 * NB * 2; ++x) {
        const int nb = x >> 2, i = x & 3;
        const int r = wg * kWhRows + w * 16 + g + (i >> 1) * 8, c = nb * 8 + 2 * t + (i & 1);
        float acc = 0.0f;
#pragma unroll 1
        for (int e = 0; e < E; ++e) acc += to_f(sq[sw_at<kWhBr>(r, e % EQ)]) * to_f(sk[sw_at<kWhBc>(c, e)]);
        redo[x] = acc;
      }
#pragma unroll
      for (int x = 0; x < 2 * NB * 2; ++x) s[x >> 2][x & 3] = redo[x];
      exact = true;
    }
    // kQS: each row's P shifted near 1 (p_shift), but on a tile that takes
    // plain float32 (rare_pv adds P as it is).
    if (exact) {
      softmax_scores<NB, false, kQS>(s, alpha, m_i, l_i, mask, n, ra, L, S, key0(j), tile_scale_log2,
                                     need_mask(j), lane, p_shift, !bad_tile);
    }
  };
  // Rare: a tile where some key is hidden from some row of the block and
  // some value is not finite (block-wide: every thread must ask).
  auto rare = [&](int j) {
    if constexpr (kQS) return bad_tile;
    if (!mask.tile_hides(key0(j), kWhBc, l0, kWhBr, S)) return false;
    // 16 bytes a load, the exponent bits tested as integers: this runs on
    // every causal diagonal tile, where a scalar load and conversion per
    // element cost more than the tile's softmax.
    bool bad = false;
    const uint4* sv = reinterpret_cast<const uint4*>(sm.v[buf(j)]);
    for (int idx = tid; idx < kWhBc * EP / 8; idx += kConsumers) {
      const uint4 x = sv[idx];
      bad |= pair_nonfinite<T>(x.x) | pair_nonfinite<T>(x.y) | pair_nonfinite<T>(x.z) | pair_nonfinite<T>(x.w);
    }
    return named_or(1 + G, kConsumers, bad);
  };
  // Its P V in plain float32 over visible keys only (mma.cuh).
  auto rare_pv = [&](int j) {
    const T* sv = sm.v[buf(j)];
    fa::rare_pv<T>(
        o, p,
        [&](int c, int col) {
          if constexpr (kQS) {  // P's terms carry kPScale
            const int key = key0(j) + c;
            return key < S ? f32.v[f32.lay.v.at(blk.b, blk.g, key) + col] * (1.0f / kPScale) : 0.0f;
          } else if constexpr (kTT) {
            return to_f(sv[sw_at<kWhBc>(c, col)]) + to_f(sv[sw_at<kWhBc>(c, col + EO)]);
          } else {
            return sv[sw_at<kWhBc>(c, col)];
          }
        },
        mask, n, ra, L, S, key0(j), kWhBc, lane);
  };

  // kQS, a tile marked bad: its scores in plain float32 from the float32
  // inputs, a score at a time in rolled loops (rare).
  auto plain_scores = [&](int j) {
    if constexpr (kQS) {
      const float* qh = f32.q + f32.lay.q.at(blk.b, blk.h, 0);
      const float* kh = f32.k + f32.lay.k.at(blk.b, blk.g, 0);
      float redo[2 * NB * 2];
#pragma unroll 1
      for (int x = 0; x < 2 * NB * 2; ++x) {
        const int r = ra + (x & 2) * 4, c = key0(j) + (x >> 2) * 8 + 2 * t + (x & 1);
        float acc = 0.0f;
        if (r < L && c < S) {
#pragma unroll 1
          for (int e = 0; e < EO; ++e) acc += qh[r * f32.lay.q.sr + e] * kh[c * f32.lay.k.sr + e];
        }
        redo[x] = acc;
      }
#pragma unroll
      for (int x = 0; x < 2 * NB * 2; ++x) s[x >> 2][x & 3] = redo[x];
    }
  };

  // O += P_j V_j, finished before it returns (rare or not).
  auto pv_now = [&](int j, float v_scale) {
    if (rare(j)) {
      rare_pv(j);
    } else {
      issue_pv(j);
      wgmma_commit();
      wgmma_wait_all();
      fence_fragments(o);
      fence_terms(p);
      add_tile(v_scale);
    }
  };

  // Turns run over the block's tiles, every item's in a row.
  int total = 0;
  for (int i = 0; i < n_items; ++i) {
    const PrefillBlock ib = item_block(i);
    total += end_tile(ib) - first_tile(ib);
  }
  const Turns turns(wg, G, total);
  int done = 0;  // tiles of the items before
  for (int i = 0; i < n_items; ++i) {
    if (i > 0) begin_item(i);
    // From lane 0, as wg above (with a window, each item starts at its own
    // key tile: this kept the kernel within 1-2% of its time without).
    kv0 = __shfl_sync(0xffffffffu, kv0, 0);
    n_tiles = __shfl_sync(0xffffffffu, n_tiles, 0);
    mbar_wait(&sm.q_full, i & 1);  // the item's Q has landed
    FA_TIMELINE_MARK(2);
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[eb][c] = 0.0f;
    m_i[0] = m_i[1] = FA_NEG_INF;
    l_i[0] = l_i[1] = 0.0f;
    if constexpr (Shape::kOverlap) {
      // Tile j's turn issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1}; the
      // softmax of S_j runs while that P V is in flight, and o takes its
      // rescale once the P V is done. A tile's buffer is free once its P V is.
      // PREV: 0 no tile before, 1 its P V on wgmma, 2 its P V on the rare path.
      // Each step waits for all it issued: a wgmma issued inside a branch and
      // waited for outside it makes ptxas serialise every wgmma of the kernel
      // (C7520).
      // (Not kQS: its tiles' scales.)
      auto step = [&](int j, auto prev) {
        constexpr int PREV = decltype(prev)::value;
        turns.wait();
        issue_qk(j);
        wgmma_commit();
        if constexpr (PREV == 1) {
          issue_pv(j - 1);
          wgmma_commit();
        }
        turns.pass(done + j, total);
        if constexpr (PREV == 1) {
          wgmma_wait<1>();  // S_j is done, P_{j-1} V_{j-1} may not be
        } else {
          wgmma_wait<0>();
        }
        fence_fragments(s);
        if constexpr (PREV == 2) rare_pv(j - 1);
        float alpha[2];
        softmax_tile(j, alpha, scale_log2);
        if constexpr (PREV == 1) {
          // ptxas schedules this wait at the top of the softmax's basic
          // block, before the exponentials, unless a branch ends the block
          // here: this one is never taken (l is a sum of exponentials).
          // wg_shapes.h says where that pays.
          if constexpr (EO <= wg_shapes::kF16SoftmaxUnderPvMaxE) {
            if (l_i[0] < 0.0f) __trap();
          }
          wgmma_wait<0>();
          fence_fragments(o);
          fence_terms(p);
          add_tile(1.0f);
        }
        if constexpr (PREV != 0) mbar_arrive(&sm.empty[buf(j - 1)]);
        rescale_rows(o, alpha);
        pack_p();
      };
      for (int j = 0; j < n_tiles; ++j) {
        wait_tile(j);
        if (j == 0) {
          step(j, std::integral_constant<int, 0>());
        } else if (rare(j - 1)) {
          step(j, std::integral_constant<int, 2>());
        } else {
          step(j, std::integral_constant<int, 1>());
        }
      }
      FA_TIMELINE_MARK(3);
      mbar_arrive(&sm.q_empty);  // every Q K^T of the item is done
      if (n_tiles > 0) {  // the last tile's P V
        pv_now(n_tiles - 1, 1.0f);
        mbar_arrive(&sm.empty[buf(n_tiles - 1)]);
      }
      FA_TIMELINE_MARK(4);
    } else {
      for (int j = 0; j < n_tiles; ++j) {
        bad_tile = tile_bad(j);
        const float tile_scale = bad_tile ? scale_log2 : scale_of(j), v_scale = v_scale_of(j);
        wait_tile(j);
        turns.wait();
        issue_qk(j);
        wgmma_commit();
        turns.pass(done + j, total);
        wgmma_wait_all();
        fence_fragments(s);
        if (bad_tile) plain_scores(j);
        float alpha[2];
        softmax_tile(j, alpha, tile_scale);
        rescale_rows(o, alpha);
        pack_p();
        pv_now(j, v_scale);
        mbar_arrive(&sm.empty[buf(j)]);  // this thread's products have read the tile
      }
      mbar_arrive(&sm.q_empty);
    }

    if constexpr (kPScale != 1.0f && !kQS) {  // kQS: in each tile's V scale
#pragma unroll
      for (int eb = 0; eb < NO; ++eb)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[eb][c] *= 1.0f / kPScale;
    }
    // A piece: the last of its row tile's pieces to finish stores the rows.
    bool store = true;
    if (piece >= 0) {
      const int64_t tail = int64_t(row_tiles) * slices - split_from;
      const KeySplit<NO, kConsumers> ks(map_slots, tail, split_at / splits, piece, splits);
      store = ks.finish(o, m_i, l_i, tag, tid, 2 + G);
    }
    if (store) {
      store_output<TO, NO, false>(o, m_i, l_i, sink_log2(mask_kind, mask_base, int(n % H_q)),
                                  out_rows(out, lay.o, n, H_q, L, lse_of(mask_kind, lse)), L, EO, ra, t, mask_kind);
    }
    FA_TIMELINE_MARK(5);
    it0 += n_tiles;
    done += n_tiles;
  }
  cp_async_wait_all();  // nothing may be in flight at exit
}

}  // namespace fa

#if !defined(FA_NO_ENTRY)  // prefill_f32s_wg.cu takes the kernel alone
// fa_prefill_wg_<dtype>_<E>: grid (row tiles x threads, H_q, batch) with
// slices = 0, or (blocks x threads, 1, 1) with slices = batch x H_q (one
// block per SM, at E = 128: prefill_wg), or with splits > 1 (blocks x
// threads, 1, 1), blocks = split_from + (row tiles x slices - split_from) x
// splits (the last row tiles' keys split: key_split.cuh), which also
// needs the split scratch past the maps' (wg_shapes.h's
// split_scratch_bytes); threads and dynamic shared memory as wg_shapes.h
// says. Its outputs: the attention output, each row's log-sum-exp (written where
// mask_kind has kLse: mask_bits.h), and scratch for the TMA copies' tensor
// maps (kMapSlots x kMapSlotBytes); as the last
// arguments, the call's tag (two 24-bit halves) and the tensor-map
// template (32 words, made by the planner); strides must not be negative.
#if !defined(FA_E)
#error "define FA_E"
#endif
#if FA_DTYPE == 0
#error "prefill_f16_wg.cu takes float16 or bfloat16; float32 has prefill_tf32_wg.cu"
#endif
// -DFA_F32=1: fa_prefill_wg32_<dtype>_<E>, float32 attention over the 16-bit
// inputs (kF32 above), a float32 output; the same arguments otherwise.
// -DFA_OUT16=1 too: fa_prefill_wg32h_<dtype>_<E>, the same storing its
// output in the inputs' dtype (each value the float32 result rounded once,
// as a cast of fa_prefill_wg32_'s output would round it).
// -DFA_TWO_TERMS=1 too: fa_prefill_wg32t_<dtype>_<E>, kTT above (E twice
// the head dim; the grid of row tiles, slices and splits 0); with
// -DFA_OUT16=1 as well, fa_prefill_wg32th_<dtype>_<E>, its output stored in
// the inputs' dtype.
// -DFA_NARROW=1: fa_prefill_wg2_<dtype>_64, two consumers at E = 64 (row
// tiles of 128; wg_shapes.h's narrow).
#if defined(FA_NARROW) && FA_NARROW
#define FA_WG_NARROW true
#else
#define FA_WG_NARROW false
#endif
#if defined(FA_TWO_TERMS) && FA_TWO_TERMS
#define FA_WG_TT true
#else
#define FA_WG_TT false
#endif
#if defined(FA_F32) && FA_F32 && FA_WG_TT && defined(FA_OUT16) && FA_OUT16
#define FA_WG_F32 true
#define FA_WG_OUT FA_T
#define FA_WG_FAMILY fa_prefill_wg32th_
#elif defined(FA_F32) && FA_F32 && FA_WG_TT
#define FA_WG_F32 true
#define FA_WG_OUT float
#define FA_WG_FAMILY fa_prefill_wg32t_
#elif defined(FA_F32) && FA_F32 && defined(FA_OUT16) && FA_OUT16
#define FA_WG_F32 true
#define FA_WG_OUT FA_T
#define FA_WG_FAMILY fa_prefill_wg32h_
#elif defined(FA_F32) && FA_F32
#define FA_WG_F32 true
#define FA_WG_OUT float
#define FA_WG_FAMILY fa_prefill_wg32_
#elif FA_WG_NARROW
#define FA_WG_F32 false
#define FA_WG_OUT FA_T
#define FA_WG_FAMILY fa_prefill_wg2_
#else
#define FA_WG_F32 false
#define FA_WG_OUT FA_T
#define FA_WG_FAMILY fa_prefill_wg_
#endif
using WhUnitShape =
    fa::WhShape<fa::wg_shapes::f16_groups(FA_E, FA_WG_NARROW), fa::wg_shapes::f16_bc(FA_E, FA_WG_TT),
                fa::wg_shapes::f16_overlap(FA_E, FA_WG_F32, FA_DTYPE == 2, FA_WG_TT), fa::wg_shapes::f16_items(FA_E)>;
static_assert(sizeof(fa::WhSmem<FA_T, fa::wg_shapes::f16_stored_e(FA_E, FA_WG_TT), WhUnitShape,
                                fa::wg_shapes::f16_stored_q(FA_E, FA_WG_TT)>) ==
                  fa::wg_shapes::f16_smem_bytes(FA_E, FA_WG_NARROW, FA_WG_TT),
              "the planner's shared memory");
extern "C" __global__ void __launch_bounds__(WhUnitShape::kThreads, 1) FA_CAT5(FA_WG_FAMILY, FA_TNAME, _, FA_E, )(
    const FA_T* q, const FA_T* k, const FA_T* v, const void* mask, const int64_t* mask_base,
    FA_WG_OUT* out, float* lse, void* map_slots, int H_q, int H_kv, int L, int S, int mask_kind, int mask_rs, int mask_cs,
    float scale_log2, int slices, int split_from, int splits, FA_LAYOUT_PARAMS, int tag_lo, int tag_hi,
    FA_MAP_TEMPLATE_PARAMS) {
  const fa::MapTemplate templ = FA_MAP_TEMPLATE;
  fa::prefill_wg<FA_T, FA_E, WhUnitShape, FA_WG_F32, FA_WG_TT, FA_WG_OUT>(
      q, k, v, mask, mask_base, out, lse, H_q, H_kv, L, S, mask_kind, mask_rs, mask_cs, scale_log2, slices, split_from,
      splits, FA_LAYOUT, &templ, map_slots, fa::call_tag(tag_lo, tag_hi));
}
#endif  // FA_NO_ENTRY
