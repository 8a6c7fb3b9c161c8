#include "cuda/mask_args.h"

#include "cuda/kernels/causal.h"
#include "cuda/kernels/mask_bits.h"
#include "mask_layout.h"

namespace flashattn::cuda {

MaskArgs mask_args(const mx::array& q, MaskKind kind, const std::optional<mx::array>& mask,
                   const std::optional<mx::array>& sinks, int window, mx::Stream s) {
  MaskArgs args{q, q};
  args.kind = static_cast<int>(kind);
  if (kind == MaskKind::causal) args.col_stride = window > 0 ? window : fa::kNoWindow;
  if (kind == MaskKind::boolean || kind == MaskKind::additive) {
    MaskLayout layout = mask_layout(q, kind == MaskKind::boolean ? *mask : mx::astype(*mask, mx::float32, s), s);
    args.data = layout.data;
    args.base = mx::array(layout.base.data(), {static_cast<int>(layout.base.size())}, mx::int64);
    args.row_stride = layout.row_stride;
    args.col_stride = layout.col_stride;
    args.inputs = true;
  }
  if (sinks) {
    // float32 logits, padded to whole 8-byte words, after the offsets.
    const int H_q = sinks->shape(0);
    const int64_t words = args.inputs ? args.base.size() : 0;
    if (words >= (int64_t{1} << (31 - fa::kSinkWordsShift))) {
      throw Unsupported(Reason::input, "flash_attention: too many (batch, head) slices of a mask for sinks on CUDA");
    }
    mx::array logits = mx::astype(*sinks, mx::float32, s);
    if (H_q % 2 != 0) logits = mx::concatenate({logits, mx::zeros({1}, mx::float32, s)}, 0, s);
    const mx::array tail = mx::view(logits, mx::int64, s);
    args.base = args.inputs ? mx::concatenate({args.base, tail}, 0, s) : tail;
    if (!args.inputs) args.data = args.base;  // never read; row-contiguous, so MLX copies nothing for it
    args.inputs = true;
    args.kind |= fa::kSinks | static_cast<int>(words) << fa::kSinkWordsShift;
  }
  return args;
}

const char* dtype_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  return "bfloat16";
}

}  // namespace flashattn::cuda
