// Our kernels' modules in MLX's PTX cache, so that a launch need not hand
// MLX the module's bytes.
//
// MLX's custom-kernel primitive copies the module it is given on every call
// and hashes it on every launch (the loaded module's name is the kernel's
// name and that hash): host time on every call, in proportion to the
// module's size (docs/cuda.md).
// Before it loads a module from those bytes, though, MLX looks for one of
// that name in its PTX cache directory (MLX_PTX_CACHE_DIR, or
// <temp>/mlx/<version>/ptx). So each module is written there once, under a
// name of ours that carries a hash of its bytes, and launched with a stand-in
// of a few bytes in place of the module: MLX finds the module on disk at the
// first launch and keeps it loaded.
//
// Nothing of this is MLX's documented API, so nothing depends on it: a
// module is used from disk only once its files there read back exactly as
// written, and if MLX ever refuses the stand-in (it looked elsewhere), the
// launch is made again with the bytes and every later launch passes them.
// FLASHATTN_CUDA_MODULE_CACHE=0 turns it off.

#pragma once

#include <string>
#include <vector>

namespace flashattn::cuda {

// What a launch hands MLX for a kernel: the name it asks for and the module.
struct ModuleSource {
  const std::string* name;
  const std::string* module;
  bool from_disk;  // the stand-in for a module in MLX's PTX cache
};

// `kernel` (its entry point) with `image` (its module), or its stand-in when
// the module is in place in MLX's PTX cache. `image` must outlive the process
// (the embedded modules do).
ModuleSource module_source(const std::string& kernel, const std::string& image);

// MLX refused a stand-in: from now on every launch passes the module's bytes.
void module_cache_refused();

// What the cache did so far (tests and probes).
struct ModuleCacheState {
  bool wanted = true;    // not turned off by FLASHATTN_CUDA_MODULE_CACHE=0
  bool refused = false;  // MLX refused a stand-in
  std::string dir;       // where the modules went; empty before the first launch or when none was found
  std::vector<std::string> on_disk;  // the names of the modules in place there
};
ModuleCacheState module_cache_state();

}  // namespace flashattn::cuda
