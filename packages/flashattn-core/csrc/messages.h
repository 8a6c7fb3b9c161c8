// What the checks of the operation share: how they name shapes and dtypes in
// a message, and how they refuse.
//
// Messages are built with std::to_string, not iostreams: a toolchain that
// links parts of libstdc++ statically (seen on the GPU machines) crashed
// formatting numbers through an ostream whose locale was never set up.

#pragma once

#include <string>

#include "flash_attention.h"

namespace flashattn {

inline std::string shape_str(const mx::Shape& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return out + (shape.size() == 1 ? ",)" : ")");
}

inline std::string dtype_str(mx::Dtype t) {
  if (t == mx::float32) return "float32";
  if (t == mx::float16) return "float16";
  if (t == mx::bfloat16) return "bfloat16";
  if (t == mx::float64) return "float64";
  if (t == mx::bool_) return "bool";
  if (t == mx::complex64) return "complex64";
  return std::string(mx::issubdtype(t, mx::signedinteger) ? "int" : "uint") + std::to_string(8 * mx::size_of(t));
}

[[noreturn]] inline void fail(Reason reason, const std::string& msg) {
  throw Unsupported(reason, "flash_attention: " + msg);
}

inline bool is_supported_float(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

} // namespace flashattn
