// Quantized keys and values on MLX's CUDA backend (kernels/quantized.cu):
// the split kernel over the packed words, scales and biases, then the
// generic kernel's merge, both through MLX's custom-kernel API. Inputs are
// read row-contiguous (MLX copies a strided view of the cache first: the
// packed bytes, a quarter or an eighth of a 16-bit copy); scales and biases
// go in as float32. Keys quantized beside plain values (or the reverse) are
// dequantized and take the ordinary kernels.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "cuda/dispatch.h"
#include "cuda/driver.h"
#include "cuda/kernel_images.h"
#include "cuda/kernels/merge_shapes.h"
#include "cuda/mask_args.h"
#include "cuda/primitive.h"
#include "mlx/fast.h"

namespace flashattn::cuda {

namespace {

constexpr int kWarpsPerBlock = 4;  // quantized.cu's 128 threads
// Split the keys until about this many warps are in flight per SM, never
// below this many keys a split.
constexpr int kWarpsPerSm = 16;
constexpr int kMinKeysPerSplit = 64;

int elements_per_lane(int E) {
  return E <= 64 ? 2 : (E <= 128 ? 4 : 8);
}

const std::string& image(const std::string& kernel, const mx::Stream& s) {
  const std::string* found = find_image(kernel, s.device.index);
  if (!found) throw std::runtime_error("flash_attention: no CUDA kernel " + kernel + " in this build");
  return *found;
}

}  // namespace

mx::array quantized_attention(const AttentionCall& call, bool widen) {
  const mx::Stream s = call.stream;
  const KVQuantization& qz = call.quantization;
  if (!call.k_quantized || !call.v_quantized) {
    // One of them quantized: dequantized, in the queries' dtype.
    auto plain = [&](const QuantizedArray* x, int bits, int group_size, const mx::array& array) {
      if (!x) return array;
      return mx::dequantize(x->packed, x->scales, x->biases, group_size, bits, "affine", std::nullopt,
                            call.q.dtype(), s);
    };
    const mx::array k = plain(call.k_quantized, qz.k_bits, qz.k_group_size, call.k);
    const mx::array v = plain(call.v_quantized, qz.v_bits, qz.v_group_size, call.v);
    return flash_attention({call.q, k, v, call.scale, call.mask_kind, call.mask, s, call.window}, widen);
  }
  const mx::array q = widen ? mx::astype(call.q, mx::float32, s) : call.q;
  const int H_q = q.shape(-3), H_kv = call.k.shape(-3), L = q.shape(-2), S = call.k.shape(-2), E = q.shape(-1);
  int64_t batch = 1;
  for (int d = 0; d < q.ndim() - 3; ++d) batch *= q.shape(d);
  const int64_t rows = batch * H_q * L;
  const int64_t warps_wanted = static_cast<int64_t>(std::max(multiprocessors(s.device.index), 1)) * kWarpsPerSm;
  const int splits = static_cast<int>(std::clamp<int64_t>((warps_wanted + rows - 1) / rows, 1,
      std::min<int64_t>(fa::merge_shapes::kMaxSplits, std::max(1, S / kMinKeysPerSplit))));
  const int keys_per_split = (S + splits - 1) / splits;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks * 32 * kWarpsPerBlock > std::numeric_limits<int>::max() ||
      static_cast<int64_t>(splits) * rows * E > std::numeric_limits<int>::max()) {
    throw Unsupported(Reason::input, "flash_attention: too many query rows for one CUDA quantized call");
  }

  const MaskArgs m = mask_args(q, call.mask_kind, call.mask, s);
  auto f32 = [&](const mx::array& x) { return mx::astype(x, mx::float32, s); };
  const QuantizedArray &kq = *call.k_quantized, &vq = *call.v_quantized;
  const std::vector<mx::array> inputs = {q,          kq.packed,  f32(kq.scales), f32(kq.biases), vq.packed,
                                         f32(vq.scales), f32(vq.biases), m.data, m.base};
  const std::vector<mx::fast::ScalarArg> scalars = {static_cast<int>(batch), H_q, H_kv, L, S, E,
                                                     static_cast<int>(call.mask_kind), m.row_stride, m.col_stride,
                                                     keys_per_split, call.scale * kLog2e,
                                                     qz.k_bits, qz.k_group_size, qz.v_bits, qz.v_group_size};
  const std::string kernel =
      "fa_quantized_" + std::string(dtype_name(q.dtype())) + "_" + std::to_string(elements_per_lane(E));
  auto parts = mx::fast::precompiled_cuda_kernel(
      kernel, image(kernel, s), inputs,
      {{static_cast<int>(static_cast<int64_t>(splits) * rows * E)}, {static_cast<int>(splits * rows * 2)}},
      {mx::float32, mx::float32}, scalars,
      {static_cast<int>(blocks) * 32 * kWarpsPerBlock, splits, 1}, {32 * kWarpsPerBlock, 1, 1}, 0, poison_value(),
      /* ensure_row_contiguous */ true, s);
  const std::string merge = "fa_merge_" + std::string(dtype_name(q.dtype()));
  namespace ms = fa::merge_shapes;
  return mx::fast::precompiled_cuda_kernel(
      merge, image(merge, s), parts, {q.shape()}, {q.dtype()},
      {static_cast<int>(rows), E, splits}, {static_cast<int>(rows) * ms::kThreads, 1, 1}, {ms::kThreads, 1, 1}, 0,
      poison_value(), true, s)[0];
}

}  // namespace flashattn::cuda
