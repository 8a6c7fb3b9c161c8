// The Metal kernels run by the CPU emulator the tests build
// (tests/metal_emulator), through the same dispatch as on Apple GPUs: each
// launch becomes a node in MLX's graph on the CPU stream whose evaluation
// hands the buffers to the emulator.

#pragma once

#include "metal/dispatch.h"
#include "metal/emulator_abi.h"

namespace flashattn::metal {

struct Emulation {
  FaEmuRun run;    // the emulator's entry point
  int lane_order;  // 0 forward, 1 reverse, 2 shuffled
  unsigned long long seed;
};

// A Launcher that runs each kernel in the emulator on stream s (a CPU stream).
Launcher emulated_launcher(Emulation emulation, mx::Stream s);

}  // namespace flashattn::metal

namespace flashattn {

// flash_attention through the branches it takes on a Metal stream (ops.cpp's
// attention()), its kernels run by the emulator on the CPU stream: dtype
// float32 over 16-bit inputs runs the *_f32 kernels where no gradient can be
// asked for (with out_dtype the inputs' dtype the 16-bit ones), else the
// float32 kernels on cast inputs.
mx::array flash_attention_metal_emulated(
    const mx::array& queries,
    const KeysOrValues& keys,
    const KeysOrValues& values,
    std::optional<float> scale,
    const std::string& mask_mode,
    std::optional<mx::array> mask_arr,
    const metal::Emulation& emulation,
    metal::Choice choice,
    std::optional<int> window = std::nullopt,
    std::optional<int> group_size = std::nullopt,
    std::optional<int> bits = std::nullopt,
    std::optional<mx::array> sinks = std::nullopt,
    std::optional<mx::Dtype> dtype = std::nullopt,
    std::optional<mx::Dtype> out_dtype = std::nullopt);

}  // namespace flashattn
