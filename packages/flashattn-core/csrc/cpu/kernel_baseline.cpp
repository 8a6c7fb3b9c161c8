// The kernels for the compiler's baseline: SSE2 on x86-64, NEON on arm64.
#define FLASHATTN_ISA baseline
#define FLASHATTN_TILES baseline_tiles
#include "isa/instantiate.h"
