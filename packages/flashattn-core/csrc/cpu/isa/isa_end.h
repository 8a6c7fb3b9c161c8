// Closes the region opened by isa_begin.h.
#ifdef FLASHATTN_TARGET
#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif
