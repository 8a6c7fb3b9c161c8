// The call between flashattn-core and the Metal emulator the tests build
// (tests/metal_emulator): plain C, so that the extension (any compiler) and
// the emulator (clang) agree without sharing anything else.

#pragma once

#include <stdint.h>

extern "C" {

struct FaEmuBuffer {
  void* data;
  int64_t elements;
  int64_t bytes;
  const char* dtype;  // MSL type name, as MLX writes it ("float", "float16_t", ...)
};

// Runs one instance ("flash_rows<float16_t, 4>") over `grid` threads in
// threadgroups of `threadgroup` threads: the inputs first, then the outputs.
// lane_order: 0 forward, 1 reverse, 2 shuffled (seeded). Returns 0, or
// non-zero with a message in error.
typedef int (*FaEmuRun)(
    const char* instance,
    FaEmuBuffer* buffers,
    int n_inputs,
    int n_outputs,
    const unsigned* grid,
    const unsigned* threadgroup,
    int lane_order,
    unsigned long long seed,
    char* error,
    int error_len);
}
