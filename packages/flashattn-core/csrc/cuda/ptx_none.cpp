// The registry of a build without nvcc: no CUDA kernels.
#include "cuda/ptx_registry.h"

namespace flashattn::cuda {

const std::vector<PtxModule>& ptx_modules() {
  static const std::vector<PtxModule> none;
  return none;
}

}  // namespace flashattn::cuda
