// Tickets in scratch that MLX allocates uninitialised (the fused decode's
// merge, decode_combine.cuh; the prefill's key splits, key_split.cuh): a
// ticket word holds (tag << 16) | tickets taken, with the call's tag (48
// bits the host never repeats: common.cuh's call_tag), and a word with
// another tag is whatever lay there before: no ticket of this call yet. (The
// fused decode counts in bits 0-7 and marks shares of its merge given up in
// bits 8-15.)

#pragma once

namespace fa {

// Sets the word to (tag << 16) | 0 unless it already carries the tag (a
// block of the call armed it first, and maybe took a ticket since): the
// exchange only ever replaces a word of another tag, so no ticket taken is
// lost. After it, taking a ticket is one atomic add.
__device__ __forceinline__ void arm_ticket(unsigned long long* ticket, unsigned long long tag) {
  unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(ticket);
  while ((seen >> 16) != tag) {
    const unsigned long long was = atomicCAS(ticket, seen, tag << 16);
    if (was == seen) break;
    seen = was;
  }
}

// Takes a ticket from a word nobody armed (an exchange loop, for a few
// takers): the tickets taken so far, this one included.
__device__ __forceinline__ int take_unarmed_ticket(unsigned long long* ticket, unsigned long long tag) {
  unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(ticket);
  for (;;) {
    const unsigned long long want = (seen >> 16) == tag ? seen + 1 : (tag << 16) | 1ull;
    const unsigned long long was = atomicCAS(ticket, seen, want);
    if (was == seen) return int(want & 0xffff);
    seen = was;
  }
}

}  // namespace fa
