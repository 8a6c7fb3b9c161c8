// The emulator's entry point (emulator_abi.h): finds the instance, checks the
// buffers against the signature MLX would write for them, and runs the
// kernel on guarded copies, so that a kernel that writes outside its outputs
// or leaves an output element unwritten is reported, not silently passed.
//
//   each buffer: [4 KiB guard][data][4 KiB guard], guards all-ones bytes
//   outputs start all-ones too: NaN in every float type
//   reads past an input's end see NaN, never a neighbour's data

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "emulator_abi.h"
#include "instances.h"

namespace {

constexpr size_t kGuard = 4096;
constexpr unsigned char kPoison = 0xff;
constexpr int64_t kMinDeviceElements = 8;  // MLX passes smaller inputs as `constant`

const fa_emu::Instance* find(const char* name) {
  for (int i = 0; i < fa_emu::kInstanceCount; ++i) {
    if (std::strcmp(fa_emu::kInstances[i].name, name) == 0) return &fa_emu::kInstances[i];
  }
  return nullptr;
}

bool all_poison(const unsigned char* p, size_t n) {
  return std::all_of(p, p + n, [](unsigned char c) { return c == kPoison; });
}

std::string check_buffers(const fa_emu::Instance& inst, const FaEmuBuffer* b, int n_inputs, int n_outputs) {
  if (n_inputs != inst.n_inputs || n_outputs != inst.n_outputs) {
    return "expected " + std::to_string(inst.n_inputs) + " inputs and " + std::to_string(inst.n_outputs) +
        " outputs, got " + std::to_string(n_inputs) + " and " + std::to_string(n_outputs);
  }
  for (int i = 0; i < n_inputs + n_outputs; ++i) {
    if (std::strcmp(b[i].dtype, inst.types[i]) != 0) {
      return std::string("argument ") + inst.names[i] + " is " + b[i].dtype + ", the kernel takes " + inst.types[i];
    }
    if (i < n_inputs && b[i].elements < kMinDeviceElements) {
      return std::string("input ") + inst.names[i] + " has " + std::to_string(b[i].elements) +
          " elements: MLX would pass it in the constant address space, not as the device pointer the kernel takes";
    }
  }
  return "";
}

}  // namespace

extern "C" int fa_metal_emulate(const char* instance, FaEmuBuffer* buffers, int n_inputs, int n_outputs,
                                const unsigned* grid, const unsigned* threadgroup, int lane_order,
                                unsigned long long seed, char* error, int error_len) {
  auto report = [&](const std::string& msg) {
    std::snprintf(error, error_len, "%s", msg.c_str());
    return 1;
  };
  const fa_emu::Instance* inst = find(instance);
  if (!inst) return report(std::string("no instance ") + instance + " in this emulator build");
  if (std::string msg = check_buffers(*inst, buffers, n_inputs, n_outputs); !msg.empty()) return report(msg);

  const int n = n_inputs + n_outputs;
  std::vector<std::vector<unsigned char>> copies(n);
  std::vector<void*> pointers(n);
  for (int i = 0; i < n; ++i) {
    copies[i].assign(buffers[i].bytes + 2 * kGuard, kPoison);
    if (i < n_inputs) std::memcpy(copies[i].data() + kGuard, buffers[i].data, buffers[i].bytes);
    pointers[i] = copies[i].data() + kGuard;
  }
  const std::string failure = fa_emu::launch(inst->lane, pointers.data(), grid, threadgroup,
                                             static_cast<fa_emu::LaneOrder>(lane_order), seed);
  if (!failure.empty()) return report(failure);

  for (int i = 0; i < n; ++i) {
    const unsigned char* c = copies[i].data();
    const size_t bytes = buffers[i].bytes;
    if (!all_poison(c, kGuard) || !all_poison(c + kGuard + bytes, kGuard)) {
      return report(std::string("the kernel wrote outside ") + (i < n_inputs ? "input " : "output ") + inst->names[i]);
    }
    if (i < n_inputs && std::memcmp(c + kGuard, buffers[i].data, bytes) != 0) {
      return report(std::string("the kernel wrote into input ") + inst->names[i]);
    }
  }
  for (int i = n_inputs; i < n; ++i) std::memcpy(buffers[i].data, copies[i].data() + kGuard, buffers[i].bytes);
  return 0;
}
