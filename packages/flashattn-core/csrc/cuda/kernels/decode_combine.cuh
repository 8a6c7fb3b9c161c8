// The end of a decode block (decode.cu, decode_mma.cu): its warps' online-
// softmax states (m, l, o), left in shared memory per warp and row, combined
// into the block's result for its R rows: the output itself when the keys
// were not split, or (fused) this split's partials and then, in the blocks
// that take its group's last tickets, the merge. (Or partials alone, for a
// separate fa_merge_* launch.)

#pragma once

#include "combine.cuh"
#include "common.cuh"
#include "partials.h"
#include "ticket.cuh"

namespace fa {

// Where a warp left row r's dim e in shared memory: the column itself.
struct SameColumn {
  __device__ __forceinline__ int operator()(int, int e) const { return e; }
};

// The sinks of a decode block's rows: row r of the block is query row
// r0 + r of its group, of query head h0 + (r0 + r) / L. sinks: one per query
// head, or nullptr (a kernel without sinks passes a constant nullptr, and
// the compiler drops what reads them).
struct GroupSinks {
  const float* sinks;
  int h0, r0, L;
  __device__ __forceinline__ bool any() const { return sinks != nullptr; }
  // Row r's sink logit, log2 domain.
  __device__ __forceinline__ float operator()(int r) const { return sinks[h0 + (r0 + r) / L] * FA_LOG2E; }
};

// The warps' states merged (combine.cuh). row_of(r): row r's index among
// the batch x H_q x L output rows (rows_total of them); col_of(r, e): the
// column of o[w][r] that holds dim e; the rows' sinks join the output or
// split 0's partials.
template <int W, int ROWS, int E, typename T, typename RowOf, typename ColOf>
__device__ __forceinline__ void combine_decode_warps(const float (&o)[W][ROWS][E], const float (&m)[W][ROWS],
                                                     const float (&l)[W][ROWS], int R, RowOf row_of, ColOf col_of,
                                                     GroupSinks sinks, T* out, float* o_part, float* ml_part,
                                                     int split, int64_t rows_total) {
  for (int i = threadIdx.x; i < R * E; i += blockDim.x) {
    const int r = i / E, e = i % E;
    float m_max = FA_NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) m_max = fmaxf(m_max, m[w][r]);
    const float base = exp_base(m_max);
    float l_sum = 0.0f, acc = 0.0f;
    const int col = col_of(r, e);
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float wgt = merge_weight(m[w][r], base);
      l_sum += wgt * l[w][r];
      acc += wgt * o[w][r][col];
    }
    if (sinks.any() && split == 0) acc *= add_sink(m_max, l_sum, sinks(r));
    const int64_t row = row_of(r);
    if (o_part == nullptr) {
      out[row * E + e] = from_f<T>(acc * inverse_sum(l_sum));
    } else {
      const int64_t slot = (int64_t)split * rows_total + row;
      o_part[slot * E + e] = acc;
      if (e == 0) ml_part[slot * 2] = m_max, ml_part[slot * 2 + 1] = l_sum;
    }
  }
}

// The fused decode: one launch instead of split + merge (a decode call is
// bound by the fixed cost of each launch). Each block writes its split's
// partials and takes a ticket; the blocks that take the group's last few
// merge (below: in shares). One level: a merge in two levels costs a ticket
// and a round trip of loads more than the one merge's extra data saves, and
// clusters merging through distributed shared memory do not all fit at once.
//
// The ticket word (ticket.cuh: tagged with the call) follows the m / l
// partials in the same output. Each block arms it when it starts, off the
// critical path, so that at its end taking a ticket is one atomic add.
constexpr int kFusedMaxSplits = 128;  // the merge's weights sit in shared memory
constexpr int kFusedMaxRows = 16;     // rows of one decode block

// The merge in shares, each merged by one of the blocks that take the
// group's last tickets. In one block the merge is a chain of batches of
// loads, each a round trip to L2; in shares of one batch each, the chain
// is one batch long. The block with the last ticket merges
// share 0; the block with the ticket `behind` places before it, for
// behind < shares, waits for the last ticket and merges share `behind`. A
// helper waits at most kHelperWaitCycles; then it marks its share given up
// (a bit in the ticket word, set only while tickets are still to be taken),
// and the last block, which finds the marks in the word its own ticket
// returns, merges those shares too: no block ever waits on a block that may
// not run, and no share is lost. At most kMergeShares shares (2, 4 and 8
// measured alike; more helpers, more blocks polling).
#ifndef FA_MERGE_SHARES
#define FA_MERGE_SHARES 4
#endif
constexpr int kMergeShares = FA_MERGE_SHARES;
static_assert(kMergeShares >= 1 && kMergeShares <= 8, "a given-up bit a share: bits 8-15 of the ticket word");
static_assert(kFusedMaxSplits < 256, "tickets counted in bits 0-7 of the ticket word");
constexpr unsigned long long kTicketCount = 0xff;
// How long a helper waits for the group's last tickets (cycles, ~10 us):
// longer only when not every block of the launch fits the GPU at once.
// (-DFA_HELPER_WAIT_CYCLES=0: every helper gives up, the last block merges
// all; a probe's check of that path.)
#ifndef FA_HELPER_WAIT_CYCLES
#define FA_HELPER_WAIT_CYCLES 20000
#endif
constexpr long long kHelperWaitCycles = FA_HELPER_WAIT_CYCLES;

// The fused decode's scratch: its one output holds the attention output
// (rows_total x E of TO), then the partials (partials.h), their tickets last.
struct FusedScratch {
  float* o_part;
  float* ml_part;
};
template <int E, typename TO>
__device__ __forceinline__ FusedScratch fused_scratch(TO* out, int64_t rows_total) {
  float* o_part = reinterpret_cast<float*>(out) + partials::fused_offset_floats(rows_total * E * (int64_t)sizeof(TO));
  return {o_part, o_part + partials::ml_offset(gridDim.x, rows_total, E)};
}

// This block's group's ticket word: groups are (batch, grid.y) pairs in the
// decode kernels, one word each past the m / l partials (plan.cpp sizes
// the scratch).
__device__ __forceinline__ unsigned long long* group_ticket(float* ml_part, int64_t rows_total) {
  const int64_t group = (int64_t)blockIdx.z * gridDim.y + blockIdx.y;
  return reinterpret_cast<unsigned long long*>(ml_part + 2 * (int64_t)gridDim.x * rows_total) + group;
}

// At the start of a fused decode block (thread 0), while its first loads
// are in flight: its group's ticket armed (ticket.cuh).
__device__ __forceinline__ void arm_group_ticket(float* ml_part, int64_t rows_total, unsigned long long tag) {
  arm_ticket(group_ticket(ml_part, rows_total), tag);
}

// The group's ticket word as this block's ticket found it (the tickets
// given out before, the shares given up): it takes one after its partials
// are written (thread 0 after the barrier: the add's release is cumulative,
// so it covers the block's writes) and the add acquires the writes of every
// block that took one before. The other threads read those after the
// barrier below, which orders them after thread 0's acquire (the pattern of
// CUTLASS's semaphores; a fence in every thread cost more). The same
// thread armed the word first.
__device__ __forceinline__ unsigned long long take_group_ticket(float* ml_part, int64_t rows_total) {
  __shared__ unsigned long long before;
  __syncthreads();  // the block's partials are written
  if (threadIdx.x == 0) {
    unsigned long long was;
    asm volatile("atom.add.acq_rel.gpu.u64 %0, [%1], 1;"
                 : "=l"(was)
                 : "l"(group_ticket(ml_part, rows_total))
                 : "memory");
    before = was;
  }
  __syncthreads();
  return before;
}

// A helper's wait (thread 0) for its group's last ticket: true once every
// split has taken one (the load that sees it acquires their partials, as
// the last block's add did); false when it gave share `share` up to the last
// block instead. The mark goes in by an exchange that expects tickets still
// to be taken, so it is in place before the last ticket is taken or not at
// all.
__device__ __forceinline__ bool waits_for_last_ticket(unsigned long long* ticket, unsigned splits, int share) {
  const long long start = clock64();
  unsigned long long seen;
  for (;;) {
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(seen) : "l"(ticket) : "memory");
    if ((seen & kTicketCount) == splits) return true;
    if (clock64() - start > kHelperWaitCycles) break;
  }
  for (;;) {
    const unsigned long long was = atomicCAS(ticket, seen, seen | (1ull << (8 + share)));
    if (was == seen) return false;
    seen = was;
    if ((seen & kTicketCount) == splits) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");  // the exchange read the last add's word
      return true;
    }
  }
}

// The merge's partial sums of an item (its splits in parts, below) meet in
// shared memory: this many float4.
constexpr int kPartSums = 256;

// How merge_group spreads `items` over the block's threads: as many parts of
// each item's splits as the threads allow.
__device__ __forceinline__ int merge_parts(int items) {
  const int threads = blockDim.x;
  return items > threads ? 1 : min(threads / items, kPartSums / items + 1);
}

// The batches of kBatch loads one block would need to merge the whole
// group: the round trips to L2 that sharing the merge can save.
template <int E, int kBatch>
__device__ __forceinline__ int merge_batches(int R) {
  const int items = R * (E / 4), splits = gridDim.x, parts = merge_parts(items);
  const int rounds = (items + blockDim.x - 1) / blockDim.x;
  return rounds * ((splits + parts * kBatch - 1) / (parts * kBatch));
}

// The fused decode's merge, in a block that took one of the last tickets: the
// group's R rows of output from the gridDim.x splits' partials (read through
// L2, where the other blocks left them), as fa_merge_* would: out = sum_s
// 2^(m_s - m) o_s / sum_s 2^(m_s - m) l_s, m = max_s m_s.
//
// Each thread takes an item (4 dims of a row) and a part of its splits
// (`part` of `parts`, every parts-th split), loaded kBatch at a time (issued
// together: a loop with a bound known only at run time kept them one after
// another). The first batch is asked for before the weights are worked out,
// so that the o partials and the m / l partials come back together.
//
// Share `share` of `shares`: the group's items [share, share + 1) x items /
// shares (every row's weights are worked out all the same: 3.6 KB of m / l
// at qwen05b).
template <int E, int kBatch, typename T, typename RowOf>
__device__ __forceinline__ void merge_group(const float* o_part, const float* ml_part, int R, RowOf row_of,
                                            T* out, int64_t rows_total, int share, int shares) {
  static_assert(E % 4 == 0, "float4 reads of the partials");
  __shared__ float weight[kFusedMaxRows][kFusedMaxSplits];
  __shared__ float inv_l[kFusedMaxRows];
  __shared__ float4 part_sum[kPartSums];
  const int splits = gridDim.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
  // Items in rounds of `span` (one round unless a block has fewer threads
  // than items); each item's splits in `parts` interleaved parts, as many
  // threads, the parts added through shared memory.
  __syncthreads();  // a share merged before in this block is done with the shared arrays
  const int all_items = R * (E / 4), item0 = share * all_items / shares;
  const int threads = blockDim.x, items = (share + 1) * all_items / shares - item0, span = min(items, threads);
  if (items == 0) return;
  const int parts = merge_parts(items);
  // i: an item of the share; item0 + i of the group.
  auto load_batch = [&](float4 (&o)[kBatch], int i, int s0) {
    const int r = (item0 + i) / (E / 4), e = 4 * ((item0 + i) % (E / 4));
    const float* o_row = o_part + row_of(r) * E + e;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = s0 + j * parts;
      o[j] = s < splits ? __ldcg(reinterpret_cast<const float4*>(o_row + s * rows_total * E))
                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  auto add_batch = [&](float4& acc, const float4 (&o)[kBatch], int i, int s0) {
    const int r = (item0 + i) / (E / 4);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int s = s0 + j * parts;
      const float wgt = s < splits ? weight[r][s] : 0.0f;
      acc.x += wgt * o[j].x, acc.y += wgt * o[j].y, acc.z += wgt * o[j].z, acc.w += wgt * o[j].w;
    }
  };
  const int first_i = static_cast<int>(threadIdx.x) % span, first_part = threadIdx.x / span;
  float4 head[kBatch];
  if (first_part < parts) load_batch(head, first_i, first_part);

  // Per row (a warp each): every split's (m, l) read at once, 4 per lane.
  for (int r = w; r < R; r += warps) {
    const int64_t row = row_of(r);
    constexpr int kPerLane = kFusedMaxSplits / 32;
    float2 ml[kPerLane];
    float m = FA_NEG_INF;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = lane + 32 * j;
      ml[j] = s < splits ? __ldcg(reinterpret_cast<const float2*>(ml_part + (s * rows_total + row) * 2))
                        : make_float2(FA_NEG_INF, 0.0f);
      m = fmaxf(m, ml[j].x);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float base = exp_base(m);
    float l_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int s = lane + 32 * j;
      const float wgt = merge_weight(ml[j].x, base);
      if (s < splits) weight[r][s] = wgt;
      l_sum += wgt * ml[j].y;
    }
    l_sum = warp_sum(l_sum);
    if (lane == 0) inv_l[r] = inverse_sum(l_sum);
  }
  __syncthreads();
  for (int base = 0; base < items; base += span) {
    const int i = base + first_i, part = first_part;
    const bool active = i < items && part < parts;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (active) {
      int s0 = part;
      if (base == 0) add_batch(acc, head, i, s0), s0 += kBatch * parts;
      for (; s0 < splits; s0 += kBatch * parts) {
        float4 o[kBatch];
        load_batch(o, i, s0);
        add_batch(acc, o, i, s0);
      }
    }
    if (parts > 1) {
      if (active && part > 0) part_sum[(part - 1) * items + i] = acc;
      __syncthreads();
      if (active && part == 0) {
        for (int p = 1; p < parts; ++p) {
          const float4 x = part_sum[(p - 1) * items + i];
          acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
      }
    }
    if (active && part == 0) {
      const int r = (item0 + i) / (E / 4), e = 4 * ((item0 + i) % (E / 4));
      const float inv = inv_l[r];
      T* dst = out + row_of(r) * E + e;
      dst[0] = from_f<T>(acc.x * inv), dst[1] = from_f<T>(acc.y * inv);
      dst[2] = from_f<T>(acc.z * inv), dst[3] = from_f<T>(acc.w * inv);
    }
  }
}

// The end of a decode block, after its warps have left (m, l, o) in shared
// memory: combined into the output or this split's partials, and in the
// fused decode (fused: o_part and ml_part are the call's scratch, the
// block's thread 0 having armed its group's ticket) merged too, in shares,
// by the blocks that take the group's last tickets (kMergeShares).
template <int E, int kBatch = 16, int W, int ROWS, typename T, typename RowOf, typename ColOf = SameColumn>
__device__ __forceinline__ void finish_decode_block(const float (&o)[W][ROWS][E], const float (&m)[W][ROWS],
                                                    const float (&l)[W][ROWS], int R, RowOf row_of, T* out,
                                                    float* o_part, float* ml_part, int64_t rows_total,
                                                    bool fused, GroupSinks sinks, ColOf col_of = {}) {
  combine_decode_warps(o, m, l, R, row_of, col_of, sinks, out, o_part, ml_part, blockIdx.x, rows_total);
  if (!fused) return;
  // Shares only where one block would need more than one batch of loads:
  // a helper starts a round trip after the last ticket (its wait's), so at
  // one batch a share costs more than it saves.
  const int splits = gridDim.x, shares = min(kMergeShares, merge_batches<E, kBatch>(R));
  const unsigned long long word = take_group_ticket(ml_part, rows_total);
  const int behind = splits - 1 - static_cast<int>(word & kTicketCount);  // 0: the last ticket
  if (behind >= shares) return;
  // The last block: share 0 and the shares given up; a helper: its own.
  unsigned todo = 1u | (static_cast<unsigned>(word >> 8) & ((1u << shares) - 2u));
  if (behind > 0) {
    __shared__ bool merges;
    if (threadIdx.x == 0) merges = waits_for_last_ticket(group_ticket(ml_part, rows_total), splits, behind);
    __syncthreads();
    todo = merges ? 1u << behind : 0u;
  }
  while (todo != 0u) {
    const int share = __ffs(todo) - 1;
    todo &= todo - 1u;
    merge_group<E, kBatch>(o_part, ml_part, R, row_of, out, rows_total, share, shares);
  }
}

}  // namespace fa
