// The kernel instances a generated emulator holds (build.py writes the
// table; entry.cpp looks names up in it). No MSL here: included before msl.h.

#pragma once

#include "runtime.h"

namespace fa_emu {

struct Instance {
  const char* name;  // "flash_rows<float16_t, 4>"
  LaneFn lane;
  int n_inputs;
  int n_outputs;
  const char* const* types;  // MSL type of each argument, inputs then outputs
  const char* const* names;  // argument names, likewise
};

extern const Instance kInstances[];
extern const int kInstanceCount;

}  // namespace fa_emu
