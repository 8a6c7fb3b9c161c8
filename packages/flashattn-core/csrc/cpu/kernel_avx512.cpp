// The kernels compiled for AVX-512 (F, BW, DQ, VL) with FMA and F16C.
#if defined(__x86_64__)
#include <immintrin.h>
#define FLASHATTN_ISA avx512
#define FLASHATTN_TILES avx512_tiles
#define FLASHATTN_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#define FLASHATTN_HAS_F16C 1
#define FLASHATTN_DECODE 1 // 32 vector registers: isa/decode.h fits
#include "isa/instantiate.h"
#endif
