// Which module of an embedded kernel (kernel_images.h) a launch takes: the
// sm_90 machine code on a GPU that runs it, the PTX anywhere else.

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <variant>

#include "cuda/dispatch.h"
#include "cuda/kernel_images.h"
#include "mlx/backend/gpu/device_info.h"

namespace flashattn::cuda {

namespace {

// Whether the GPU runs the sm_90 machine code (compute capability 9.0 exactly:
// sm_90 cubins load nowhere else), asked of MLX once per device.
// FLASHATTN_CUDA_IMAGE=ptx takes the PTX modules everywhere (tests of that
// path on a Hopper GPU).
bool runs_sm90(int device_index) {
  static const bool forced_ptx = [] {
    const char* image = std::getenv("FLASHATTN_CUDA_IMAGE");
    return image != nullptr && std::string(image) == "ptx";
  }();
  if (forced_ptx) return false;
  static std::mutex mutex;
  static std::unordered_map<int, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device_index);
  if (it != known.end()) return it->second;
  const auto& info = mx::gpu::device_info(device_index);
  auto cc = [&](const char* key) -> size_t {
    auto f = info.find(key);
    return f != info.end() && std::holds_alternative<size_t>(f->second) ? std::get<size_t>(f->second) : 0;
  };
  const bool sm90 = cc("compute_capability_major") == 9 && cc("compute_capability_minor") == 0;
  known[device_index] = sm90;
  return sm90;
}

}  // namespace

const std::string* find_image(const std::string& kernel, int device_index) {
  static std::once_flag once;
  static std::unordered_map<std::string, const KernelImage*> index;
  std::call_once(once, [] {
    for (const auto& m : kernel_images()) index[m.kernel] = &m;
  });
  auto it = index.find(kernel);
  if (it == index.end()) return nullptr;
  const std::string* image = runs_sm90(device_index) ? &it->second->sm90 : &it->second->ptx;
  return image->empty() ? nullptr : image;  // e.g. a Hopper-only kernel elsewhere
}

bool kernels_available() {
  return !kernel_images().empty();
}

}  // namespace flashattn::cuda
