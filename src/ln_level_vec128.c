/* ln_level_vec128.c -- the row kernels on 128-bit vectors: SSE2 on x86-64, NEON on aarch64
   (each target's baseline: no extra flags); nothing on other targets. */
#if defined(__x86_64__) || defined(__aarch64__)
#include "ln_simd_vec128.h"

#define LN_LEVEL_KERNELS ln_kernels_vec128
#include "ln_rows.h"
#endif
