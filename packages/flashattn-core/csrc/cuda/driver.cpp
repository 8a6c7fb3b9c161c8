#include "cuda/driver.h"

#include <atomic>
#include <mutex>
#include <map>
#include <utility>

#if defined(__linux__)
#include <dlfcn.h>
#endif

namespace flashattn::cuda {

namespace {

// dlsym in the driver MLX loaded (RTLD_NOLOAD: never loads one of our own).
void* driver_symbol(const char* name) {
#if defined(__linux__)
  static std::atomic<void*> handle{nullptr};  // kept open; not cached until MLX has loaded it
  void* driver = handle.load();
  if (driver == nullptr && (driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) != nullptr) handle = driver;
  return driver != nullptr ? dlsym(driver, name) : nullptr;
#else
  (void)name;
  return nullptr;
#endif
}

// A device attribute (cuDeviceGetAttribute), or 0 if unknown; cached.
int device_attribute(int device_index, int attribute) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> known;
  std::lock_guard<std::mutex> lock(mutex);
  const std::pair<int, int> key{device_index, attribute};
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  using DeviceGet = int (*)(int*, int);            // cuDeviceGet(CUdevice*, ordinal)
  using DeviceAttribute = int (*)(int*, int, int);  // cuDeviceGetAttribute(value, attribute, CUdevice)
  auto get = reinterpret_cast<DeviceGet>(driver_symbol("cuDeviceGet"));
  auto read = reinterpret_cast<DeviceAttribute>(driver_symbol("cuDeviceGetAttribute"));
  int result = 0, device = 0, value = 0;
  if (get != nullptr && read != nullptr && get(&device, device_index) == 0 &&
      read(&value, attribute, device) == 0 && value > 0) {
    result = value;
  }
  known[key] = result;
  return result;
}

}  // namespace

int multiprocessors(int device_index) {
  constexpr int kMultiprocessorCount = 16;  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  return device_attribute(device_index, kMultiprocessorCount);
}

int max_shared_memory_per_block(int device_index) {
  constexpr int kMaxSharedMemoryPerBlockOptIn = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
  return device_attribute(device_index, kMaxSharedMemoryPerBlockOptIn);
}

std::optional<TensorMap> tensor_map_template(bool float16) {
  // cuTensorMapEncodeTiled(map, dtype, rank, address, dims, strides (dims
  // 1..), box, element strides, interleave, swizzle, L2 promotion, OOB fill);
  // the enums' values from cuda.h.
  using Encode = int (*)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                         const uint32_t*, int, int, int, int);
  constexpr int kFloat16 = 6, kBfloat16 = 9, kInterleaveNone = 0, kSwizzle128B = 3, kL2Promotion256B = 3,
                kOobFillZeros = 0;
  const auto encode = reinterpret_cast<Encode>(driver_symbol("cuTensorMapEncodeTiled"));
  if (encode == nullptr) return std::nullopt;
  constexpr uint64_t kE = 64, kRows = 1 << 16;  // placeholders (the kernel puts in the real ones)
  const uint64_t dims[4] = {kE, kRows, 1, 1};
  const uint64_t strides[3] = {kE * 2, kE * 2 * kRows, kE * 2 * kRows};
  const uint32_t box[4] = {64, 128, 1, 1}, element_strides[4] = {1, 1, 1, 1};
  alignas(64) TensorMap map{};
  if (encode(map.data(), float16 ? kFloat16 : kBfloat16, 4, reinterpret_cast<void*>(uintptr_t{1} << 12), dims,
             strides, box, element_strides, kInterleaveNone, kSwizzle128B, kL2Promotion256B, kOobFillZeros) != 0) {
    return std::nullopt;
  }
  return map;
}

}  // namespace flashattn::cuda
