// Key splits of a launch's last row tiles (prefill_f16_wg.cu): a launch of a
// little more than a whole number of waves leaves most SMs idle while its
// last blocks run (mlx-lm's 2048-row prefill chunk at qwen05b: 154 blocks on
// 132 SMs). The planner (wg_launch.cpp's launch model) then cuts each of the
// last row tiles' keys into `splits` pieces, one block each, launched after
// the whole tiles. A piece leaves its online-softmax state (o, m, l) in
// scratch; the piece that finds the others done merges them all, in piece
// order whichever it is (a call's result does not depend on which piece
// ends last), and stores the rows. Nothing waits on another block, so
// blocks that are not all resident cannot hang.
//
// Scratch, past the tensor maps' slots (wg_shapes.h): a ticket word per split
// row tile (8 bytes, tagged with the call as the maps' slots are: scratch
// is not zeroed), then the pieces' states. A piece's state lies in the
// consumer threads' own fragment layout, value k of thread i at k x threads
// + i: each thread reads back exactly what the same thread of another piece
// wrote (same rows, same columns), every warp's loads and stores whole
// 128-byte lines.

#pragma once

#include "combine.cuh"
#include "mma.cuh"
#include "pingpong.cuh"
#include "ticket.cuh"
#include "wg_shapes.h"

namespace fa {

template <int NO, int kThreads>
struct KeySplit {
  static constexpr int kValues = NO * 4 + 4;  // o, then m and l of rows ra and ra + 8
  static constexpr int64_t kPieceFloats = int64_t(kValues) * kThreads;

  unsigned long long* ticket;  // this row tile's
  float* states;               // the row tile's pieces' states, piece after piece
  int piece, splits;

  // Scratch of a launch whose `tail` last row tiles are split; row tile
  // `index` among them.
  __device__ KeySplit(void* scratch, int64_t tail, int64_t index, int piece_, int splits_)
      : piece(piece_), splits(splits_) {
    auto* base = static_cast<unsigned char*>(scratch) + wg_shapes::kMapSlots * wg_shapes::kMapSlotBytes;
    ticket = reinterpret_cast<unsigned long long*>(base) + index;
    float* all = reinterpret_cast<float*>(base + wg_shapes::split_ticket_bytes(tail));
    states = all + index * splits * kPieceFloats;
  }

  // Stores this piece's state; true in the piece that finds every other one
  // stored, whose o, m_i and l_i then hold the whole row tile's state (every
  // piece's, merged in piece order from what they stored). Called by every
  // consumer thread (tid < kThreads), which meet at named barrier `bar`.
  __device__ bool finish(float (&o)[NO][4], float* m_i, float* l_i, unsigned long long tag, int tid,
                         int bar) const {
    float* mine = states + piece * kPieceFloats + tid;
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int c = 0; c < 4; ++c) __stcg(mine + (eb * 4 + c) * kThreads, o[eb][c]);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      __stcg(mine + (NO * 4 + rr) * kThreads, m_i[rr]);
      __stcg(mine + (NO * 4 + 2 + rr) * kThreads, l_i[rr]);
    }
    __threadfence();  // this thread's state is visible before the ticket is taken
    named_sync(bar, kThreads);
    bool last = false;
    if (tid == 0) last = take_unarmed_ticket(ticket, tag) == splits;
    if (!named_or(bar, kThreads, last)) return false;
    __threadfence();  // the other pieces' states, as their tickets published them
    const float* first = states + tid;  // piece 0's (this thread's own writes, or another piece's)
#pragma unroll
    for (int eb = 0; eb < NO; ++eb)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[eb][c] = __ldcg(first + (eb * 4 + c) * kThreads);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      m_i[rr] = __ldcg(first + (NO * 4 + rr) * kThreads);
      l_i[rr] = __ldcg(first + (NO * 4 + 2 + rr) * kThreads);
    }
    for (int p = 1; p < splits; ++p) {
      const float* other = states + p * kPieceFloats + tid;
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const float m_p = __ldcg(other + (NO * 4 + rr) * kThreads), l_p = __ldcg(other + (NO * 4 + 2 + rr) * kThreads);
        float a, b;
        merge_pair<true>(m_i[rr], l_i[rr], m_p, l_p, a, b);
#pragma unroll
        for (int eb = 0; eb < NO; ++eb)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& x = o[eb][2 * rr + c];
            x = x * a + __ldcg(other + (eb * 4 + 2 * rr + c) * kThreads) * b;
          }
      }
    }
    return true;
  }
};

}  // namespace fa
