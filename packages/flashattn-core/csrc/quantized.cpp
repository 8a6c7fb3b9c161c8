#include "quantized.h"

#include <string>

#include "messages.h"

namespace flashattn {

namespace {

// What MLX's affine quantization packs evenly into uint32 words, and the
// group sizes it makes.
bool supported_bits(int bits) {
  return bits == 2 || bits == 4 || bits == 8;
}
bool supported_group_size(int group_size) {
  return group_size == 32 || group_size == 64 || group_size == 128;
}

struct Unpacked {
  mx::array logical; // a placeholder of the (B..., H_kv, S, E) shape
  int bits = 0;
  int group_size = 0;
};

Unpacked check_quantized(
    const char* name,
    const QuantizedArray& x,
    const mx::array& queries,
    std::optional<int> group_size,
    std::optional<int> bits,
    mx::Stream s) {
  const std::string arg = name;
  const mx::array &packed = x.packed, &scales = x.scales, &biases = x.biases;
  if (packed.dtype() != mx::uint32) {
    fail(Reason::input, "quantized " + arg + ": the packed array must be uint32 (as mx.quantize returns it); got " +
         dtype_str(packed.dtype()));
  }
  if (!is_supported_float(scales.dtype()) || biases.dtype() != scales.dtype()) {
    fail(Reason::input, "quantized " + arg + ": scales and biases must share one dtype, float32, float16 or "
         "bfloat16; got " + dtype_str(scales.dtype()) + " and " + dtype_str(biases.dtype()));
  }
  if (packed.ndim() != queries.ndim() || scales.ndim() != queries.ndim() || biases.ndim() != queries.ndim()) {
    fail(Reason::input, "quantized " + arg + " must have the rank of queries (" + std::to_string(queries.ndim()) +
         "): packed " + shape_str(packed.shape()) + ", scales " + shape_str(scales.shape()) + ", biases " +
         shape_str(biases.shape()));
  }
  const int nd = packed.ndim();
  bool rows_agree = scales.shape() == biases.shape();
  for (int d = 0; rows_agree && d < nd - 1; ++d) rows_agree = packed.shape(d) == scales.shape(d);
  if (!rows_agree) {
    fail(Reason::input, "quantized " + arg + ": packed (B..., H_kv, S, E * bits / 32), scales and biases (B..., "
         "H_kv, S, E / group_size) must agree; got packed " + shape_str(packed.shape()) + ", scales " +
         shape_str(scales.shape()) + ", biases " + shape_str(biases.shape()));
  }
  const int E = queries.shape(-1), words = packed.shape(-1), groups = scales.shape(-1);
  const std::string dims = " (packed " + shape_str(packed.shape()) + ", scales " + shape_str(scales.shape()) +
      ", queries' head dim E = " + std::to_string(E) + ")";
  if (words == 0 || (32 * words) % E != 0) {
    fail(Reason::input, "quantized " + arg + ": E * bits / 32 words a row must hold E = " + std::to_string(E) +
         " elements of 2, 4 or 8 bits" + dims);
  }
  const int found_bits = 32 * words / E;
  if (groups == 0 || E % groups != 0) {
    fail(Reason::input, "quantized " + arg + ": scales must hold E / group_size values a row" + dims);
  }
  const int found_group_size = E / groups;
  if (bits && *bits != found_bits) {
    fail(Reason::input, "bits=" + std::to_string(*bits) + " does not match the quantized " + arg + ", whose rows hold " +
         std::to_string(found_bits) + "-bit elements" + dims);
  }
  if (group_size && *group_size != found_group_size) {
    fail(Reason::input, "group_size=" + std::to_string(*group_size) + " does not match the quantized " + arg +
         ", whose scales give groups of " + std::to_string(found_group_size) + dims);
  }
  if (!supported_bits(found_bits)) {
    fail(Reason::quantized, "quantized " + arg + " of " + std::to_string(found_bits) +
         " bits: the kernels read 2, 4 and 8 bits");
  }
  if (!supported_group_size(found_group_size)) {
    fail(Reason::quantized, "quantized " + arg + " in groups of " + std::to_string(found_group_size) +
         ": the kernels read group sizes 32, 64 and 128");
  }
  mx::Shape shape = packed.shape();
  shape.back() = E;
  return {mx::broadcast_to(mx::array(0, queries.dtype()), shape, s), found_bits, found_group_size};
}

} // namespace

KeysValues unpack_keys_values(
    const KeysOrValues& keys,
    const KeysOrValues& values,
    const mx::array& queries,
    std::optional<int> group_size,
    std::optional<int> bits,
    mx::Stream s) {
  KVQuantization quantization;
  std::vector<mx::array> inputs;
  auto unpack = [&](const char* name, const KeysOrValues& x, int& x_bits, int& x_group_size) {
    if (const auto* plain = std::get_if<mx::array>(&x)) {
      inputs.push_back(*plain);
      return *plain;
    }
    const auto& quantized = std::get<QuantizedArray>(x);
    Unpacked u = check_quantized(name, quantized, queries, group_size, bits, s);
    x_bits = u.bits;
    x_group_size = u.group_size;
    inputs.insert(inputs.end(), {quantized.packed, quantized.scales, quantized.biases});
    return u.logical;
  };
  mx::array k = unpack("keys", keys, quantization.k_bits, quantization.k_group_size);
  mx::array v = unpack("values", values, quantization.v_bits, quantization.v_group_size);
  if (!quantization.any() && (group_size || bits)) {
    fail(Reason::input, "group_size and bits describe quantized keys or values: pass keys or values as "
         "(packed, scales, biases), as mx.quantize returns them");
  }
  return {k, v, std::move(inputs), quantization};
}

} // namespace flashattn
