// Quantized keys and values at the operation: their checks, and what the
// rest of the operation sees of them.

#pragma once

#include <optional>
#include <vector>

#include "flash_attention.h"

namespace flashattn {

// Keys and values as the operation sees them.
struct KeysValues {
  // The arrays themselves or, for a quantized one, a placeholder of its
  // logical (B..., H_kv, S, E) shape in the queries' dtype, for the shape
  // checks: never evaluated.
  mx::array k;
  mx::array v;
  // What the primitive reads: the keys' array(s), then the values'.
  std::vector<mx::array> inputs;
  KVQuantization quantization;
};

// Checks each quantized argument (dtypes, shapes, bits, group size against
// the queries' head dim and the group_size / bits given) and unpacks both.
KeysValues unpack_keys_values(
    const KeysOrValues& keys,
    const KeysOrValues& values,
    const mx::array& queries,
    std::optional<int> group_size,
    std::optional<int> bits,
    mx::Stream stream);

} // namespace flashattn
