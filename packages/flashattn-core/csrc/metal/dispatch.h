// flash_attention on Apple GPUs: which Metal kernel runs and how it is
// launched, decided once for both ways a launch can happen: MLX's run-time
// compiled kernels on a Metal stream (launch_metal.cpp), or the CPU
// emulation of the same source that the Linux tests use (emulated.cpp).

#pragma once

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../flash_attention.h"
#include "mlx/fast.h"

namespace flashattn::metal {

using TemplateArgs = std::vector<std::pair<std::string, mx::fast::TemplateArg>>;

// One launch of one kernel of metal_kernels(), as fast::metal_kernel takes it.
struct KernelCall {
  std::string kernel;
  TemplateArgs template_args;
  std::vector<mx::array> inputs;
  std::vector<mx::Shape> output_shapes;
  std::vector<mx::Dtype> output_dtypes;
  std::tuple<int, int, int> grid;         // threads
  std::tuple<int, int, int> threadgroup;  // threads
};

using Launcher = std::function<std::vector<mx::array>(const KernelCall&)>;

// Which kernel: the automatic choice, or one forced (tests run every kernel
// on every case; splits > 0 forces that many decode key splits).
enum class Variant { automatic, rows, decode, matrix };
struct Choice {
  Variant variant = Variant::automatic;
  int splits = 0;
};

// widen: float32 attention over the 16-bit inputs, read in place (the
// kernels compute in float32), and a float32 output; not over quantized keys
// and values, nor with lse.
mx::array flash_attention(const AttentionCall& call, const Launcher& launch, Choice choice = {}, bool widen = false);

// The same, and where lse (a gradient may be taken) and the kernel keeps it
// (flash_mma, flash_rows: not a split decode, not quantized keys), each
// row's log-sum-exp as a second array (q's shape but E; log2 domain, the
// sink in it, +inf for a row that sees no key).
std::vector<mx::array> flash_attention_outputs(const AttentionCall& call, const Launcher& launch, Choice choice,
                                               bool lse, bool widen = false);

// dQ, dK and dV of that call (FlashAttention-2's backward in two launches,
// flash_backward_rows then flash_backward_keys; backward.metal), and with
// sinks their gradient: o is the call's output, d_out its cotangent, lse the
// forward's log-sum-exp where it kept it. Never builds an L x S array.
std::vector<mx::array> flash_attention_backward(const AttentionCall& call, const mx::array& o,
                                                const mx::array& d_out, const Launcher& launch,
                                                const std::optional<mx::array>& lse = std::nullopt);

// "flash_rows<float16_t, 4>": a kernel with its template arguments, as the
// emulator names its instances.
std::string instance_name(const std::string& kernel, const TemplateArgs& args);

// MSL's name of a dtype, as MLX writes it in a generated signature.
std::string msl_type(mx::Dtype t);

// Every instance the dispatch can launch, with its argument dtypes (inputs,
// then outputs).
struct Instance {
  std::string kernel;
  TemplateArgs template_args;
  std::vector<std::string> input_types;
  std::vector<std::string> output_types;
};
std::vector<Instance> instances();

}  // namespace flashattn::metal
