/*
 * ln_kernels.h -- the pure-C LayerNorm kernel layer (no Python in here).
 *
 * What it computes, in NumPy terms, for rows of N = row_len elements:
 *
 *     mean = x.mean(-1, keepdims=True)                      # in float64
 *     var  = ((x - mean) ** 2).mean(-1, keepdims=True)      # biased, in float64
 *     rstd = 1 / np.sqrt(var + eps)
 *     y    = (x - mean) * rstd * weight + bias              # rounded once per element
 *
 * and the backward pass of that function.  Results are bit-identical whatever the
 * SIMD level and the thread count (ln_rows.h and ln_internal.h say why).
 */
#ifndef LN_KERNELS_H
#define LN_KERNELS_H

#include <stddef.h>

/* Element type of the input, the output and the gradients.
 * Statistics are always float64 internally; weight/bias are float32 for
 * LN_F16/LN_F32 input and float64 for LN_F64 input ("param type"); mean/rstd
 * handed in or out are of the same param type. */
typedef enum { LN_F16 = 0, LN_F32 = 1, LN_F64 = 2 } ln_dtype;

/* Kernel variants, slowest first.  LN_SIMD_VEC128 is SSE2 on x86-64 and NEON on aarch64;
 * a build has the levels its target can run (ln_simd_name says which). */
typedef enum {
    LN_SIMD_SCALAR = 0,
    LN_SIMD_VEC128 = 1,
    LN_SIMD_AVX2 = 2,
    LN_SIMD_AVX512 = 3,
} ln_simd_level;
#define LN_SIMD_LEVELS 4

typedef struct {
    ln_dtype dtype;
    ptrdiff_t rows;            /* number of rows (product of the batch dims) */
    ptrdiff_t row_len;         /* N, elements per row, contiguous within a row */
    const void *input;         /* first row */
    ptrdiff_t input_row_step;  /* elements from one row start to the next (any sign) */
    void *output;              /* rows x row_len, C-contiguous; may equal input */
    const void *weight;        /* row_len params, or NULL for ones */
    const void *bias;          /* row_len params, or NULL for zeros */
    double eps;
    void *mean;                /* rows params out, or NULL */
    void *rstd;                /* rows params out, or NULL */
} ln_forward_args;

typedef struct {
    ln_dtype dtype;
    ptrdiff_t rows;
    ptrdiff_t row_len;
    const void *grad_output;   /* first row of dL/dy */
    ptrdiff_t grad_output_row_step;
    const void *input;         /* first row of x */
    ptrdiff_t input_row_step;
    const void *mean;          /* rows params, contiguous */
    const void *rstd;          /* rows params, contiguous */
    const void *weight;        /* row_len params, or NULL for ones */
    void *grad_input;          /* rows x row_len, C-contiguous, or NULL to skip */
    void *grad_weight;         /* row_len params, or NULL to skip */
    void *grad_bias;           /* row_len params, or NULL to skip */
} ln_backward_args;

/* Both return 0, or -1 when scratch memory could not be allocated. */
int ln_forward(const ln_forward_args *args);
int ln_backward(const ln_backward_args *args);

/* SIMD dispatch: the best level this CPU runs is chosen on first use. */
ln_simd_level ln_simd_best(void);            /* what the CPU and the build allow */
ln_simd_level ln_simd_get(void);             /* what is in use now */
int ln_simd_set(ln_simd_level level);        /* 0, or -1 if the CPU or the build can't run it */
/* "scalar", "sse2" or "neon", "avx2", "avx512"; NULL for a level this build lacks. */
const char *ln_simd_name(ln_simd_level level);

/* Threads: a small pthread pool shared by every call in the process. */
int ln_threads_get(void);
void ln_threads_set(int n);                  /* n >= 1 */
int ln_threads_default(void);                /* CPUs this process may run on */

#endif
