/* ln_level_scalar.c -- the row kernels on the scalar primitives: the portable baseline,
   present in every build. */
#include "ln_simd_scalar.h"

#define LN_LEVEL_KERNELS ln_kernels_scalar
#include "ln_rows.h"
