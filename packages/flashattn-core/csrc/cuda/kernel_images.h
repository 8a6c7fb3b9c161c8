// The CUDA kernels compiled at build time (when nvcc was there) and embedded
// in the extension, one small module per kernel (a compressed fatbin: PTX for
// compute_80 and sm_90 machine code): MLX hashes and copies a kernel's module
// on every launch.

#pragma once

#include <string>
#include <vector>

namespace flashattn::cuda {

struct KernelImage {
  std::string kernel;  // the extern "C" entry point it defines
  std::string image;   // what cuModuleLoadData takes (fatbin)
};

// Every embedded module (empty when the build had no nvcc).
const std::vector<KernelImage>& kernel_images();

// The image of `kernel`'s module, or nullptr.
const std::string* find_image(const std::string& kernel);

}  // namespace flashattn::cuda
