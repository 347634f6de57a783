/* ln_level_avx512_bf16.c -- the avx512 level's bfloat16 kernels, storing with AVX512-BF16's
   vcvtneps2bf16 (ln_simd_avx512.h, gf_store_bf16), compiled with -mavx512f -mavx512bw
   -mavx512dq -mavx512bf16 -mavx2 -mfma -mf16c (src/kernel_flags.py); nothing off x86-64.  The
   other element types are the avx512 level's (ln_dtype_kernels_in_use).  Run only where
   ln_dispatch.c found those features. */
#if defined(__x86_64__)
#if !defined(__AVX512BF16__) || !defined(__AVX512DQ__)
#error "the avx512bf16 level is compiled with -mavx512dq -mavx512bf16 besides the avx512 level's flags"
#endif
#include "ln_simd_avx512.h"

#define LN_LEVEL_FOR_EACH_DTYPE(X) X(LN_BF16, bf16)
#define LN_LEVEL_KERNELS ln_kernels_avx512_bf16
#include "ln_rows.h"
#endif
