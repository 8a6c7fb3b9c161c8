// Each kernel source is compiled once per (dtype, variant) "unit", to PTX of
// its own: MLX hashes and copies a kernel's whole PTX module on every call,
// so modules stay small. The build passes -DFA_DTYPE=0|1|2 and the variant.

#pragma once

#include "common.cuh"

#if FA_DTYPE == 0
#define FA_T float
#define FA_TNAME float32
#elif FA_DTYPE == 1
#define FA_T __half
#define FA_TNAME float16
#elif FA_DTYPE == 2
#define FA_T __nv_bfloat16
#define FA_TNAME bfloat16
#else
#error "FA_DTYPE must be 0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

// -DFA_KIND=0 | 1 (backward.cu, backward_wg.cu): a unit compiled for no mask
// or a causal one, its kernels' names marked n or c.
#if defined(FA_KIND)
#if FA_KIND == 0
#define FA_KIND_LETTER n
#else
#define FA_KIND_LETTER c
#endif
#endif

#define FA_CAT3_(a, b, c) a##b##c
#define FA_CAT3(a, b, c) FA_CAT3_(a, b, c)
#define FA_CAT5_(a, b, c, d, e) a##b##c##d##e
#define FA_CAT5(a, b, c, d, e) FA_CAT5_(a, b, c, d, e)
