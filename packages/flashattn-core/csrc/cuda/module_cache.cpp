// Our modules in MLX's PTX cache (module_cache.h says why). What MLX does,
// as of 0.32 (mlx/backend/cuda/custom_kernel.cpp and jit_module.cpp): a
// custom kernel's module is named "<name>_<hash of its bytes, hex>"; before
// it loads the bytes, MLX reads "<dir>/<module name>.ptx" if that exists, and
// "<dir>/<module name>.txt", one line a kernel, "<name> TAB <entry point>".

#include "cuda/module_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <random>
#include <unordered_map>

#include "mlx/version.h"

namespace fs = std::filesystem;
namespace mx = mlx::core;

namespace flashattn::cuda {

namespace {

// What a launch hands MLX in place of a module on disk. Never a valid
// module: should MLX load it, it did not find ours, and says so.
const std::string kStandIn = "flashattn-core: this kernel's module is in MLX's PTX cache";

std::atomic<bool> refused{false};

bool wanted() {
  static const bool on = [] {
    const char* v = std::getenv("FLASHATTN_CUDA_MODULE_CACHE");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

std::string hex(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(x));
  return buf;
}

// 64-bit FNV-1a: the name of a module's bytes (not MLX's hash, which is of
// the stand-in).
uint64_t fnv1a(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// MLX's PTX cache directory, found as MLX finds it; empty when there is
// none. FLASHATTN_CUDA_MODULE_DIR puts the modules elsewhere (tests: a
// directory MLX does not read, so that it refuses the stand-in).
fs::path cache_dir() {
  std::error_code ec;
  fs::path dir;
  if (const char* ours = std::getenv("FLASHATTN_CUDA_MODULE_DIR")) {
    dir = ours;
  } else if (const char* c = std::getenv("MLX_PTX_CACHE_DIR")) {
    dir = c;
  } else {
    dir = fs::temp_directory_path(ec);
    if (ec) return {};
    dir = dir / "mlx" / mx::version() / "ptx";
  }
  if (dir.empty()) return {};
  fs::create_directories(dir, ec);  // false also when another process made it first
  return fs::is_directory(dir, ec) ? dir : fs::path();
}

bool read_file(const fs::path& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return !f.bad();
}

// `bytes` into `path` whole or not at all: a file of its own first, then
// renamed over `path` (a process reading it meanwhile sees the old file or
// the new one, never part of one).
bool write_file(const fs::path& path, const std::string& bytes) {
  static std::atomic<uint64_t> serial{std::random_device{}()};
  fs::path tmp = path;
  tmp += "." + std::to_string(::getpid()) + "." + hex(serial.fetch_add(1)) + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.close();
    std::error_code ec;
    if (!f) {
      fs::remove(tmp, ec);
      return false;
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fs::remove(tmp, ec);
  return !ec;
}

// `path` holds exactly `bytes`, written now if it did not.
bool put(const fs::path& path, const std::string& bytes) {
  std::string found;
  if (read_file(path, found) && found == bytes) return true;
  return write_file(path, bytes) && read_file(path, found) && found == bytes;
}

struct OnDisk {
  std::string name;  // what a launch asks MLX for: "<kernel>_<hash of the module>"
  bool ok = false;   // the module and its kernel list read back as written
};

// `kernel`'s module put in place under its name. The list is written before
// the module: MLX takes a module it finds with whatever list is there.
OnDisk place(const fs::path& dir, const std::string& kernel, const std::string& image) {
  OnDisk d;
  d.name = kernel + "_" + hex(fnv1a(image));
  if (dir.empty()) return d;
  const std::string module = d.name + "_" + hex(std::hash<std::string>{}(kStandIn));
  d.ok = put(dir / (module + ".txt"), d.name + "\t" + kernel + "\n") && put(dir / (module + ".ptx"), image);
  return d;
}

struct Cache {
  std::mutex mutex;
  bool dir_found = false;
  fs::path dir;
  std::unordered_map<const std::string*, OnDisk> modules;  // by the embedded image
};

Cache& cache() {
  static Cache* c = new Cache;  // left alive: launches may outlive static destruction
  return *c;
}

}  // namespace

ModuleSource module_source(const std::string& kernel, const std::string& image) {
  const ModuleSource bytes{&kernel, &image, false};
  if (!wanted() || refused.load(std::memory_order_relaxed)) return bytes;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.modules.find(&image);
  if (it == c.modules.end()) {
    if (!c.dir_found) {
      c.dir = cache_dir();
      c.dir_found = true;
    }
    it = c.modules.emplace(&image, place(c.dir, kernel, image)).first;
  }
  return it->second.ok ? ModuleSource{&it->second.name, &kStandIn, true} : bytes;
}

void module_cache_refused() {
  refused.store(true, std::memory_order_relaxed);
}

ModuleCacheState module_cache_state() {
  ModuleCacheState s;
  s.wanted = wanted();
  s.refused = refused.load(std::memory_order_relaxed);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  s.dir = c.dir.string();
  for (const auto& [image, d] : c.modules) {
    if (d.ok) s.on_disk.push_back(d.name);
  }
  return s;
}

}  // namespace flashattn::cuda
