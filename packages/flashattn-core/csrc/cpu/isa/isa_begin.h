// Opens an instruction-set region. The including file defines FLASHATTN_ISA
// (the namespace) and, on x86-64, FLASHATTN_TARGET (the target attribute);
// every function defined until isa_end.h is compiled for that target.
// Standard and MLX headers must be included before this one: code defined
// outside the region keeps the baseline instruction set.

#ifndef FLASHATTN_ISA
#error "define FLASHATTN_ISA before including isa_begin.h"
#endif

#define FLASHATTN_DO_PRAGMA(x) _Pragma(#x)
#define FLASHATTN_GCC_TARGET(t) FLASHATTN_DO_PRAGMA(GCC target(t))
#define FLASHATTN_CLANG_TARGET(t) \
  FLASHATTN_DO_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))

#ifdef FLASHATTN_TARGET
#if defined(__clang__)
FLASHATTN_CLANG_TARGET(FLASHATTN_TARGET)
#elif defined(__GNUC__)
#pragma GCC push_options
FLASHATTN_GCC_TARGET(FLASHATTN_TARGET)
#endif
#endif
