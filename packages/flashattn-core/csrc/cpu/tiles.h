// Tile shapes of the CPU kernel, chosen in this one place.
//
// A query tile holds Br rows, a key/value tile Bc rows; the course design
// (tiny-llm, FlashAttention-2) uses Br = Bc = 32.

#pragma once

namespace flashattn::cpu {

constexpr int Br = 32;
constexpr int Bc = 32;

constexpr int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

} // namespace flashattn::cpu
