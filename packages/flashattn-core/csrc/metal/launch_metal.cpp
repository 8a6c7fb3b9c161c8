// Launches on a Metal stream: MLX compiles each kernel from source at first
// use (fast::metal_kernel) and caches the library; outputs come from MLX's
// allocator and the launch is ordered in MLX's graph. Compiled on every
// platform (the symbol is in every libmlx), run only on Apple GPUs.

#include "metal/launch_metal.h"

#include <mutex>
#include <unordered_map>

#include "metal/kernels.h"

namespace flashattn::metal {

std::vector<mx::array> launch_on_metal(const KernelCall& call, mx::Stream s) {
  static std::mutex mu;
  static std::unordered_map<std::string, mx::fast::CustomKernelFunction> compiled;
  mx::fast::CustomKernelFunction fn;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = compiled.find(call.kernel);
    if (it == compiled.end()) {
      const MetalKernel& k = find_kernel(call.kernel);
      it = compiled
               .emplace(call.kernel,
                        mx::fast::metal_kernel(k.name, k.inputs, k.outputs, k.body, metal_source(),
                                               /* ensure_row_contiguous */ true))
               .first;
    }
    fn = it->second;
  }
  return fn(call.inputs, call.output_shapes, call.output_dtypes, call.grid, call.threadgroup, call.template_args,
            std::nullopt, /* verbose */ false, s);
}

}  // namespace flashattn::metal
