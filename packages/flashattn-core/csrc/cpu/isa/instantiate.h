// Builds one instruction set's Kernels. The including kernel_<isa>.cpp
// defines FLASHATTN_ISA, FLASHATTN_TILES and, on x86-64, FLASHATTN_TARGET.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

// Shared by every instruction set, so included (and compiled for the
// baseline) before the region opens: an inline function defined inside it
// would be built for each target, and the linker could keep any of them.
#include "../backward.h"
#include "../causal.h"
#include "../kernels.h"
#include "../softmax.h"

#define FLASHATTN_CAT2(a, b) a##b
#define FLASHATTN_CAT(a, b) FLASHATTN_CAT2(a, b)
#define FLASHATTN_STR2(a) #a
#define FLASHATTN_STR(a) FLASHATTN_STR2(a)

#include "isa_begin.h"
#include "attend.h"
#include "backward.h"
#ifdef FLASHATTN_DECODE
#include "decode.h"
#endif

namespace flashattn::cpu::FLASHATTN_ISA {
static void wide(const AttentionProblem& p, WorkPlan& plan, const WorkItem& it, void* s) {
  attend_item_t<FLASHATTN_TILES::wide>(p, plan, it, s);
}
static void narrow(const AttentionProblem& p, WorkPlan& plan, const WorkItem& it, void* s) {
  attend_item_t<FLASHATTN_TILES::narrow>(p, plan, it, s);
}
#ifdef FLASHATTN_DECODE
static void decode(const AttentionProblem& p, WorkPlan& plan, const WorkItem& it, void* s) {
  decode_item(p, plan, it, s);
}
#endif
static void backward(const BackwardProblem& p, const BackwardItem& it, void* s) {
  backward_item_t<FLASHATTN_TILES::wide>(p, it, s);
}
} // namespace flashattn::cpu::FLASHATTN_ISA

#include "isa_end.h"

namespace flashattn::cpu {
Kernels FLASHATTN_CAT(FLASHATTN_ISA, _kernels)() {
  return {
      FLASHATTN_STR(FLASHATTN_ISA),
      FLASHATTN_TILES::wide::RB,
      FLASHATTN_TILES::narrow::RB,
      FLASHATTN_ISA::wide,
      FLASHATTN_ISA::narrow,
#ifdef FLASHATTN_DECODE
      FLASHATTN_ISA::decode,
#else
      nullptr,
#endif
      FLASHATTN_ISA::backward,
      FLASHATTN_TILES::wide::W,
  };
}
} // namespace flashattn::cpu
