#include "cuda/mask_args.h"

#include "mask_layout.h"

namespace flashattn::cuda {

MaskArgs mask_args(const mx::array& q, MaskKind kind, const std::optional<mx::array>& mask, mx::Stream s) {
  MaskArgs args{q, q};
  if (kind != MaskKind::boolean && kind != MaskKind::additive) {
    return args;
  }
  MaskLayout layout = mask_layout(q, kind == MaskKind::boolean ? *mask : mx::astype(*mask, mx::float32, s), s);
  args.data = layout.data;
  args.base = mx::array(layout.base.data(), {static_cast<int>(layout.base.size())}, mx::int64);
  args.row_stride = layout.row_stride;
  args.col_stride = layout.col_stride;
  return args;
}

const char* dtype_name(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  return "bfloat16";
}

}  // namespace flashattn::cuda
