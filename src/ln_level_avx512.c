/* ln_level_avx512.c -- the row kernels on AVX-512F and BW, compiled with -mavx512f -mavx512bw
   -mavx2 -mfma -mf16c (src/kernel_flags.py); nothing off x86-64.  Run only where ln_dispatch.c
   found those features. */
#if defined(__x86_64__)
#include "ln_simd_avx512.h"

#define LN_LEVEL_KERNELS ln_kernels_avx512
#include "ln_rows.h"
#endif
