// The mask as the CUDA kernels read it: (data, per-(batch, query head) base
// offsets, row stride, column stride), and the attention sinks in front of
// the offsets (kernels/mask_bits.h); a causal mask's sliding window in the
// column stride. Without an array mask the kernels never
// read the data, and without sinks either pointer: the queries stand in (no
// extra arrays, no extra work).

#pragma once

#include <optional>

#include "../flash_attention.h"

namespace flashattn::cuda {

struct MaskArgs {
  mx::array data, base;
  int row_stride = 0, col_stride = 0;
  int kind = 0;         // the kernels' mask_kind argument
  bool inputs = false;  // whether the kernels read data and base (an array mask, or sinks)
};

MaskArgs mask_args(const mx::array& q, MaskKind kind, const std::optional<mx::array>& mask,
                   const std::optional<mx::array>& sinks, int window, mx::Stream s);

// The dtype's name in the kernels' entry points.
const char* dtype_name(mx::Dtype t);

}  // namespace flashattn::cuda
