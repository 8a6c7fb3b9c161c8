#pragma once

#include "metal/dispatch.h"

namespace flashattn::metal {

// A Launcher for Metal streams, through MLX's fast::metal_kernel.
std::vector<mx::array> launch_on_metal(const KernelCall& call, mx::Stream s);

}  // namespace flashattn::metal
