// The registry of a build without nvcc: no CUDA kernels.
#include "cuda/kernel_images.h"

namespace flashattn::cuda {

const std::vector<KernelImage>& kernel_images() {
  static const std::vector<KernelImage> none;
  return none;
}

}  // namespace flashattn::cuda
