// The kernels compiled for AVX2 with FMA and F16C.
#if defined(__x86_64__)
#include <immintrin.h>
#define FLASHATTN_ISA avx2
#define FLASHATTN_TILES avx2_tiles
#define FLASHATTN_TARGET "avx2,fma,f16c"
#define FLASHATTN_HAS_F16C 1
#include "isa/instantiate.h"
#endif
