// Python bindings: argument names, defaults and the docstring; the mask
// argument (None, a string or an array) is split into MLX's (mode, array).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cpu/kernels.h"
#include "cpu/thread_pool.h"
#include "cuda/kernel_images.h"
#include "cuda/module_cache.h"
#include "flash_attention.h"
#include "metal/emulated.h"
#include "metal/kernels.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

#define FLASHATTN_STR2(x) #x
#define FLASHATTN_STR(x) FLASHATTN_STR2(x)

using MaskArg = std::variant<std::monostate, std::string, mx::array>;
// Keys or values: an array, or (packed, scales, biases) as mx.quantize returns them.
using KeysArg = std::variant<mx::array, std::tuple<mx::array, mx::array, mx::array>>;

namespace {

// MLX's (mode, array) form of the Python mask argument.
std::pair<std::string, std::optional<mx::array>> split_mask(const MaskArg& mask) {
  if (auto* s = std::get_if<std::string>(&mask)) return {*s, std::nullopt};
  if (auto* a = std::get_if<mx::array>(&mask)) return {"array", *a};
  return {"", std::nullopt};
}

flashattn::KeysOrValues keys_or_values(const KeysArg& x) {
  if (auto* a = std::get_if<mx::array>(&x)) return *a;
  const auto& [packed, scales, biases] = std::get<1>(x);
  return flashattn::QuantizedArray{packed, scales, biases};
}

flashattn::metal::Variant variant_named(const std::string& name) {
  using flashattn::metal::Variant;
  if (name == "auto") return Variant::automatic;
  if (name == "rows") return Variant::rows;
  if (name == "decode") return Variant::decode;
  if (name == "matrix") return Variant::matrix;
  throw std::invalid_argument(
      "kernel must be \"auto\", \"rows\", \"decode\" or \"matrix\"; got \"" + name + "\"");
}

// flashattn::Unsupported -> UnsupportedError (a ValueError) whose .reason
// names why, as decided by the check that threw.
void translate_unsupported(const std::exception_ptr& p, void* type) {
  try {
    std::rethrow_exception(p);
  } catch (const flashattn::Unsupported& e) {
    nb::object error = nb::borrow((PyObject*)type)(e.what());
    error.attr("reason") = flashattn::reason_name(e.reason());
    PyErr_SetObject((PyObject*)type, error.ptr());
  }
}

} // namespace

NB_MODULE(_ext, m) {
  m.doc() = "FlashAttention-2 as an MLX primitive (C++ extension)";
  m.attr("mlx_version") = FLASHATTN_STR(MLX_VERSION_MAJOR) "." FLASHATTN_STR(
      MLX_VERSION_MINOR) "." FLASHATTN_STR(MLX_VERSION_PATCH);

  PyObject* unsupported = PyErr_NewExceptionWithDoc(
      "flashattn_core.UnsupportedError",
      "flash_attention refused its arguments (a ValueError). .reason names why: "
      "'unsupported_input', 'unsupported_head_dim', 'unsupported_dtype', "
      "'unsupported_mask', 'no_gpu_kernel' or 'quantized_kv_cache'.",
      PyExc_ValueError,
      nullptr);
  m.attr("UnsupportedError") = nb::steal(unsupported);
  nb::register_exception_translator(translate_unsupported, unsupported);

  m.def(
      "gradient_stats",
      [] {
        const auto counts = flashattn::gradient_counts();
        nb::dict recomputed;
        for (const auto& [reason, n] : counts.recomputed) recomputed[reason.c_str()] = n;
        nb::dict out;
        out["fused"] = counts.fused;
        out["recomputed"] = recomputed;
        return out;
      },
      "Gradients taken through flash_attention since the last reset: 'fused' "
      "(the FlashAttention-2 backward kernels) and 'recomputed' per reason "
      "(attention recomputed with MLX operations, holding L x S: "
      "'mask_gradient', 'cuda', 'metal').");
  m.def("reset_gradient_stats", &flashattn::reset_gradient_counts, "Zero gradient_stats().");

  m.def(
      "cpu_info",
      [] {
        nb::dict info;
        info["isa"] = flashattn::cpu::select_kernels().isa;
        info["threads"] = flashattn::cpu::pool_size();
        return info;
      },
      "The CPU kernels in use: instruction set (FLASHATTN_ISA narrows it) and "
      "worker threads (FLASHATTN_NUM_THREADS sets them).");

  m.def(
      "cuda_kernels",
      [] {
        nb::dict out;
        for (const auto& m : flashattn::cuda::kernel_images()) {
          nb::dict sizes;
          sizes["sm90"] = m.sm90.size();
          sizes["ptx"] = m.ptx.size();
          out[m.kernel.c_str()] = sizes;
        }
        return out;
      },
      "The embedded CUDA kernels and the sizes in bytes of their two modules "
      "(sm90: Hopper machine code, ptx: for other GPUs); empty when the build "
      "had no nvcc.");

  m.def(
      "_cuda_module_cache",
      [] {
        const auto state = flashattn::cuda::module_cache_state();
        nb::dict out;
        out["wanted"] = state.wanted;
        out["refused"] = state.refused;
        out["dir"] = state.dir;
        out["on_disk"] = state.on_disk;
        return out;
      },
      "How the CUDA launches hand MLX their modules (cuda/module_cache.h): "
      "wanted (not FLASHATTN_CUDA_MODULE_CACHE=0), refused (MLX did not find "
      "one on disk: every launch passes the bytes), dir (MLX's PTX cache, "
      "where they went) and on_disk (the modules in place there).");

  m.def(
      "flash_attention",
      [](const mx::array& queries,
         const KeysArg& keys,
         const KeysArg& values,
         std::optional<float> scale,
         const MaskArg& mask,
         std::optional<int> window,
         std::optional<mx::Dtype> dtype,
         std::optional<mx::array> sinks,
         std::optional<int> group_size,
         std::optional<int> bits,
         std::optional<mx::Dtype> out_dtype,
         mx::StreamOrDevice stream) {
        auto [mode, mask_arr] = split_mask(mask);
        return flashattn::flash_attention(queries, keys_or_values(keys), keys_or_values(values), scale, mode,
                                          mask_arr, stream, dtype, sinks, window, group_size, bits, out_dtype);
      },
      "queries"_a,
      "keys"_a,
      "values"_a,
      nb::kw_only(),
      "scale"_a = nb::none(),
      "mask"_a = nb::none(),
      "window"_a = nb::none(),
      "dtype"_a = nb::none(),
      "sinks"_a = nb::none(),
      "group_size"_a = nb::none(),
      "bits"_a = nb::none(),
      "out_dtype"_a = nb::none(),
      "stream"_a = nb::none(),
      nb::sig(
          "def flash_attention(queries: mlx.core.array, "
          "keys: mlx.core.array | tuple[mlx.core.array, mlx.core.array, mlx.core.array], "
          "values: mlx.core.array | tuple[mlx.core.array, mlx.core.array, mlx.core.array], "
          "*, scale: float | None = None, "
          "mask: str | mlx.core.array | None = None, "
          "window: int | None = None, "
          "dtype: mlx.core.Dtype | None = None, "
          "sinks: mlx.core.array | None = None, "
          "group_size: int | None = None, bits: int | None = None, "
          "out_dtype: mlx.core.Dtype | None = None, "
          "stream: mlx.core.Stream | mlx.core.Device | None = None) "
          "-> mlx.core.array"),
      R"(FlashAttention-2: softmax(scale * Q K^T + mask) V without the L x S matrix.

Args:
    queries (array): ``(B..., H_q, L, E)``.
    keys (array or tuple): ``(B..., H_kv, S, E)``; ``H_q`` a multiple of
        ``H_kv``. Or quantized, ``(packed, scales, biases)`` as
        ``mx.quantize`` returns them (2, 4 or 8 bits, groups of 32, 64 or
        128; mlx-lm's ``QuantizedKVCache``): read in place and dequantized
        tile by tile, on the CPU.
    values (array or tuple): ``(B..., H_kv, S, E)``, or quantized likewise.
    scale (float, optional): defaults to ``1 / sqrt(E)``.
    mask (str or array, optional): ``None``, ``"causal"`` (bottom-right
        aligned: row ``i`` sees key ``j`` iff ``j <= i + S - L``), a boolean
        array (``True`` attends) or an additive float array, broadcastable to
        ``(B..., H_q, L, S)``.
    window (int, optional): with ``mask="causal"``, a sliding window of
        this many keys: row ``i`` sees key ``j`` iff
        ``i + S - L - window < j <= i + S - L`` (mlx-lm's
        ``create_causal_mask(..., window_size=window)``); keys outside it are
        skipped, tile by tile, on the CPU and Metal.
    dtype (Dtype, optional): ``None`` (the inputs' dtype) or ``float32``
        with ``float16`` / ``bfloat16`` inputs: attention in float32 and a
        float32 result, as if the inputs had been cast to float32 first (the
        kernels read the 16-bit inputs as they are, but on CPU and Metal
        under a gradient).
    sinks (array, optional): ``(H_q,)``, one logit per query head that joins
        every row's softmax denominator and adds no value, as MLX's
        ``scaled_dot_product_attention(..., sinks=)``, on every backend;
        differentiable (their gradient too) by the fused backward.
    group_size (int, optional), bits (int, optional): of quantized keys
        and values; when given, checked against their shapes (which define
        them).
    out_dtype (Dtype, optional): the result's dtype: ``None`` (``dtype``'s)
        or, with ``dtype=float32``, the inputs' dtype: float32 attention
        rounded once to 16 bits, equal to casting the float32 result (on
        Hopper GPUs the prefill kernels store it so, without the float32
        copy).
    stream (Stream or Device, optional): where to run.

Returns:
    array: ``(B..., H_q, L, E)`` in ``out_dtype`` (by default ``dtype``,
    else the dtype of ``queries``). Rows that see no key are zeros.)");

  // For tests: the Metal kernels' sources and the emulated path
  // (tests/metal_emulator builds the emulator and passes its entry point).
  m.def(
      "_metal_kernels",
      [] {
        nb::dict out;
        out["source"] = flashattn::metal::metal_source();
        nb::list kernels;
        for (const auto& k : flashattn::metal::metal_kernels()) {
          nb::dict d;
          d["name"] = k.name;
          d["inputs"] = k.inputs;
          d["outputs"] = k.outputs;
          d["body"] = k.body;
          kernels.append(d);
        }
        out["kernels"] = kernels;
        nb::list instances;
        for (const auto& inst : flashattn::metal::instances()) {
          nb::dict d;
          d["kernel"] = inst.kernel;
          d["name"] = flashattn::metal::instance_name(inst.kernel, inst.template_args);
          nb::list targs;
          for (const auto& [name, value] : inst.template_args) {
            std::string kind = std::holds_alternative<mx::Dtype>(value)
                ? "typename"
                : (std::holds_alternative<int>(value) ? "int" : "bool");
            targs.append(nb::make_tuple(name, kind));
          }
          d["template_params"] = targs;
          d["input_types"] = inst.input_types;
          d["output_types"] = inst.output_types;
          instances.append(d);
        }
        out["instances"] = instances;
        return out;
      },
      "The Metal source, kernels (names, arguments, bodies) and every instance "
      "the dispatch launches.");

  m.def(
      "_metal_emulated",
      [](const mx::array& queries,
         const KeysArg& keys,
         const KeysArg& values,
         std::optional<float> scale,
         const MaskArg& mask,
         uintptr_t emulator,
         const std::string& kernel,
         int splits,
         int lane_order,
         unsigned long long seed,
         std::optional<int> window,
         std::optional<int> group_size,
         std::optional<int> bits,
         std::optional<mx::array> sinks,
         std::optional<mx::Dtype> dtype,
         std::optional<mx::Dtype> out_dtype) {
        auto [mode, mask_arr] = split_mask(mask);
        flashattn::metal::Emulation emulation{
            reinterpret_cast<FaEmuRun>(emulator), lane_order, seed};
        return flashattn::flash_attention_metal_emulated(
            queries, keys_or_values(keys), keys_or_values(values), scale, mode, mask_arr, emulation,
            {variant_named(kernel), splits}, window, group_size, bits, sinks, dtype, out_dtype);
      },
      "queries"_a,
      "keys"_a,
      "values"_a,
      nb::kw_only(),
      "scale"_a = nb::none(),
      "mask"_a = nb::none(),
      "emulator"_a,
      "kernel"_a = "auto",
      "splits"_a = 0,
      "lane_order"_a = 2,
      "seed"_a = 0,
      "window"_a = nb::none(),
      "group_size"_a = nb::none(),
      "bits"_a = nb::none(),
      "sinks"_a = nb::none(),
      "dtype"_a = nb::none(),
      "out_dtype"_a = nb::none(),
      "flash_attention through the Metal dispatch and kernels, run by the "
      "emulator whose entry point address is `emulator` (tests only).");
}
