// Python bindings: argument names, defaults and the docstring; the mask
// argument (None, a string or an array) is split into MLX's (mode, array).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "cpu/kernels.h"
#include "cpu/thread_pool.h"
#include "cuda/kernel_images.h"
#include "flash_attention.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

#define FLASHATTN_STR2(x) #x
#define FLASHATTN_STR(x) FLASHATTN_STR2(x)

using MaskArg = std::variant<std::monostate, std::string, mx::array>;

NB_MODULE(_ext, m) {
  m.doc() = "FlashAttention-2 as an MLX primitive (C++ extension)";
  m.attr("mlx_version") = FLASHATTN_STR(MLX_VERSION_MAJOR) "." FLASHATTN_STR(
      MLX_VERSION_MINOR) "." FLASHATTN_STR(MLX_VERSION_PATCH);

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
          out[m.kernel.c_str()] = m.image.size();
        }
        return out;
      },
      "The embedded CUDA kernels and their module sizes in bytes (empty when "
      "the build had no nvcc).");

  m.def(
      "flash_attention",
      [](const mx::array& queries,
         const mx::array& keys,
         const mx::array& values,
         std::optional<float> scale,
         const MaskArg& mask,
         mx::StreamOrDevice stream) {
        std::string mode;
        std::optional<mx::array> mask_arr;
        if (auto* s = std::get_if<std::string>(&mask)) {
          mode = *s;
        } else if (auto* a = std::get_if<mx::array>(&mask)) {
          mode = "array";
          mask_arr = *a;
        }
        return flashattn::flash_attention(
            queries, keys, values, scale, mode, mask_arr, stream);
      },
      "queries"_a,
      "keys"_a,
      "values"_a,
      nb::kw_only(),
      "scale"_a = nb::none(),
      "mask"_a = nb::none(),
      "stream"_a = nb::none(),
      nb::sig(
          "def flash_attention(queries: mlx.core.array, keys: mlx.core.array, "
          "values: mlx.core.array, *, scale: float | None = None, "
          "mask: str | mlx.core.array | None = None, "
          "stream: mlx.core.Stream | mlx.core.Device | None = None) "
          "-> mlx.core.array"),
      R"(FlashAttention-2: softmax(scale * Q K^T + mask) V without the L x S matrix.

Args:
    queries (array): ``(B..., H_q, L, E)``.
    keys (array): ``(B..., H_kv, S, E)``; ``H_q`` a multiple of ``H_kv``.
    values (array): ``(B..., H_kv, S, E)``.
    scale (float, optional): defaults to ``1 / sqrt(E)``.
    mask (str or array, optional): ``None``, ``"causal"`` (bottom-right
        aligned: row ``i`` sees key ``j`` iff ``j <= i + S - L``), a boolean
        array (``True`` attends) or an additive float array, broadcastable to
        ``(B..., H_q, L, S)``.
    stream (Stream or Device, optional): where to run.

Returns:
    array: ``(B..., H_q, L, E)`` in the dtype of ``queries``. Rows that see
    no key are zeros.)");
}
