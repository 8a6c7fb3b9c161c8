// The CUDA kernels compiled at build time (when nvcc was there) and embedded
// in the extension, two small modules per kernel (compressed fatbins): sm_90
// machine code, and PTX for compute_80 that the driver compiles for any other
// GPU from Ampere on. MLX hashes and copies a kernel's module on every
// launch, so a launch passes only the one its GPU runs.

#pragma once

#include <string>
#include <vector>

namespace flashattn::cuda {

struct KernelImage {
  std::string kernel;  // the extern "C" entry point it defines
  std::string sm90;    // what cuModuleLoadData takes (fatbin): Hopper
  std::string ptx;     // the same for other GPUs (compute_80 PTX); empty for
                       // a Hopper-only kernel (sm_90a machine code alone)
};

// Every embedded module (empty when the build had no nvcc).
const std::vector<KernelImage>& kernel_images();

// The image of `kernel`'s module for the GPU of `device_index`, or nullptr
// (no such kernel, or none for that GPU).
const std::string* find_image(const std::string& kernel, int device_index);

}  // namespace flashattn::cuda
