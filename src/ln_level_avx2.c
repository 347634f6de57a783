/* ln_level_avx2.c -- the row kernels on AVX2 + FMA + F16C, compiled with -mavx2 -mfma -mf16c
   (src/kernel_flags.py); nothing off x86-64.  Run only where ln_dispatch.c found those features. */
#if defined(__x86_64__)
#include "ln_simd_avx2.h"

#define LN_LEVEL_KERNELS ln_kernels_avx2
#include "ln_rows.h"
#endif
