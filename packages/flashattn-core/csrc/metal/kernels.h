// The Metal kernels as MLX's run-time compilation takes them
// (fast::metal_kernel): one shared source (kernels/*.metal, embedded at
// build time) and, per kernel, its argument names and a short body that
// declares the threadgroup memory and calls the templated function.

#pragma once

#include <string>
#include <vector>

namespace flashattn::metal {

struct MetalKernel {
  std::string name;
  std::vector<std::string> inputs;
  std::vector<std::string> outputs;
  std::string body;
};

// kernels/params.h, common.metal, rows.metal, mma.metal and backward.metal,
// concatenated.
const std::string& metal_source();

const std::vector<MetalKernel>& metal_kernels();

// Throws std::logic_error for a name that is not in metal_kernels().
const MetalKernel& find_kernel(const std::string& name);

}  // namespace flashattn::metal
