// The CUDA kernels compiled to PTX at build time (when nvcc was there) and
// embedded in the extension, one small module per kernel unit: MLX hashes and
// copies a kernel's module on every launch.

#pragma once

#include <string>
#include <vector>

namespace flashattn::cuda {

struct PtxModule {
  std::vector<std::string> kernels;  // the extern "C" entry points it defines
  std::string ptx;
};

// Every embedded module (empty when the build had no nvcc).
const std::vector<PtxModule>& ptx_modules();

// The module defining `kernel`, or nullptr.
const std::string* find_ptx(const std::string& kernel);

}  // namespace flashattn::cuda
