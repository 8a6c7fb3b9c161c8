// The mask_kind launch argument, in plain C++ so that the host
// (cuda/mask_args.cpp) and the kernels (common.cuh) share it: the mask's
// kind in the low bits; with attention sinks also kSinks, and the sinks (one
// float32 logit per query head) then lie in the base-offset array, after its
// offsets (one 8-byte word each, none without an array mask), whose count
// the bits from kSinkWordsShift hold. So every kernel that reads a mask
// reads the sinks without a launch argument more. A causal mask has no
// array: its column-stride argument carries the sliding window instead (the
// number of keys a row sees at most; causal.h's kNoWindow: no window).
// kLse: the prefill kernels also write each row's log-sum-exp into their
// lse output (a gradient will be taken); the backward's statistics passes
// then read it from their lse input instead of taking it again.
// kFold: the mma.sync float32 prefills over 16-bit inputs (prefill_f16.cu)
// add each row's two halves, columns c and c + E / 2, into an output E / 2
// wide (a quantized cache's keys and values as two bfloat16 terms a row:
// cuda/quantized.cpp).

#pragma once

namespace fa {

constexpr int kKindBits = 3, kSinks = 4, kLse = 8, kFold = 16, kSinkWordsShift = 8;

}  // namespace fa
