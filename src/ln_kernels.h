/*
 * ln_kernels.h -- the pure-C kernel layer of the norm family (no Python in here).
 *
 * What it computes, in NumPy terms, for rows of N = row_len elements (statistics in float64):
 *
 *   LayerNorm (LN_NORM_LAYER):
 *     mean = x.mean(-1, keepdims=True)
 *     var  = ((x - mean) ** 2).mean(-1, keepdims=True)      # biased
 *     rstd = 1 / np.sqrt(var + eps)
 *     y    = (x - mean) * rstd * weight + bias              # rounded once per element
 *
 *   RMSNorm (LN_NORM_RMS): LayerNorm with the mean fixed at 0 and no bias:
 *     rstd = 1 / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
 *     y    = x * rstd * weight
 *
 * and the backward pass of each.  A row is any set of elements the layout layer (ln_layout.h)
 * can walk with one element step: the trailing axes of a C-contiguous array, or the channels
 * of an NCHW one.  Results are bit-identical whatever the SIMD level and the thread count
 * (ln_rows.h and ln_internal.h say why).
 */
#ifndef LN_KERNELS_H
#define LN_KERNELS_H

#include <stddef.h>

#include "ln_layout.h"

/* Element type of the input, the output and the gradients.
 * Statistics are always float64 internally; weight/bias are float32 for
 * LN_F16/LN_F32/LN_BF16 input and float64 for LN_F64 input ("param type"); mean/rstd
 * handed in or out are of the same param type. */
typedef enum { LN_F16 = 0, LN_F32 = 1, LN_F64 = 2, LN_BF16 = 3 } ln_dtype;

/* What the statistics are: centred (mean and variance) or not (mean of squares). */
typedef enum { LN_NORM_LAYER = 0, LN_NORM_RMS = 1 } ln_norm_kind;

/* Kernel variants, slowest first.  LN_SIMD_VEC128 is SSE2 on x86-64 and NEON on aarch64;
 * a build has the levels its target can run (ln_simd_name says which). */
typedef enum {
    LN_SIMD_SCALAR = 0,
    LN_SIMD_VEC128 = 1,
    LN_SIMD_AVX2 = 2,
    LN_SIMD_AVX512 = 3,
    LN_SIMD_AVX512_BF16 = 4,
} ln_simd_level;
#define LN_SIMD_LEVELS 5

/* One array taking part in a call: its first element and how to walk it over the call's
 * extent (ln_layout.h).  Element arrays are aligned to their element size.  Statistics
 * (mean, rstd) have one param-type value per row: elem_step 0, and in backward any
 * steps, zero included (a broadcast value is never expanded). */
typedef struct {
    char *data;    /* NULL: absent (an optional input, or a result not wanted) */
    ln_walk walk;
} ln_array;

typedef struct {
    ln_norm_kind kind;
    ln_dtype dtype;          /* of input, residual, sum and output */
    ln_extent extent;        /* blocks x rows x row_len, common to every array below */
    ln_array input;
    ln_array residual;       /* present: the rows normalized are sum = input + residual */
    ln_array sum;            /* present iff residual is: input + residual rounded to dtype, as
                                NumPy's add rounds it; may be input's or residual's own memory */
    ln_array output;         /* may be input's (or sum's) own memory, element for element */
    const void *weight;      /* row_len params, contiguous, or NULL for ones */
    const void *bias;        /* row_len params, contiguous, or NULL for zeros; NULL for RMS */
    double eps;
    ln_array mean;           /* out, or absent; always absent for RMS */
    ln_array rstd;           /* out, or absent */
    ln_array copy;           /* present (never with a residual): the input's values are written
                                here too, each row while it is in cache for normalizing */
} ln_forward_args;

typedef struct {
    ln_norm_kind kind;
    ln_dtype dtype;
    ln_extent extent;
    ln_array grad_output;
    ln_array input;
    ln_array mean;           /* in; always absent for RMS (the mean is 0) */
    ln_array rstd;           /* in */
    const void *weight;      /* row_len params, or NULL for ones */
    ln_array grad_input;     /* out, or absent: not computed */
    void *grad_weight;       /* row_len params out, contiguous, or NULL to skip */
    void *grad_bias;         /* likewise; always NULL for RMS */
} ln_backward_args;

/* Both return 0, or -1 when scratch memory could not be allocated. */
int ln_forward(const ln_forward_args *args);
int ln_backward(const ln_backward_args *args);

/* to[0 .. n) = from[0 .. n) as float32, exactly, by the SIMD level in use: float16, bfloat16
   or float32 elements, not float64 (the parameters of 16-bit data are float32). */
void ln_widen_to_f32(ln_dtype dtype, const void *from, float *to, ptrdiff_t n);

/*
 * Rows split across arrays (a chunked array whose normalized axes are cut into parts): the
 * caller takes each part's moments, merges them across the parts (ln_merge's formulas) into
 * each row's mean and rstd, then normalizes each part with them.  In NumPy terms, for a part
 * x_p of each row:
 *
 *   moments:    n_p = x_p.size,  mean_p = x_p.mean(),  m2_p = ((x_p - mean_p) ** 2).sum()
 *               (RMSNorm: mean_p = 0, m2_p the sum of squares)
 *   normalize:  y_p = (x_p - mean) * rstd * weight_p + bias_p
 *
 * computed as ln_forward computes a whole row's (its chunks' one-pass moments merged left to
 * right; its normalize arithmetic), so the bits are the same at every level and thread count
 * and whatever the layout.  Statistics are float64 whatever the dtype; their arrays are walked
 * as ln_forward's (elem_step 0).  A part of extreme magnitude has its moments in units of a
 * power of two, scale (mean_p * scale and m2_p * scale**2 are the moments); normalize takes
 * a row's mean and rstd in the units of its scale (mean / scale, rstd * scale), and then
 * computes it, as every row whose rstd the kernels cannot carry, in plain float64 (ln_parts.c).
 */
typedef struct {
    ln_norm_kind kind;
    ln_dtype dtype;
    ln_extent extent;        /* the part: blocks x rows x its row_len */
    ln_array input;
    ln_array mean;           /* out: float64, one per row; always absent for RMS */
    ln_array m2;             /* out: float64, one per row */
    ln_array scale;          /* out: float64, one per row: the power of two mean and m2 are in
                                units of, 1 but for parts of extreme magnitude */
} ln_part_moments_args;

typedef struct {
    ln_norm_kind kind;
    ln_dtype dtype;
    ln_extent extent;
    ln_array input;
    ln_array output;         /* may be input's own memory, element for element */
    const void *weight;      /* the part's row_len params, contiguous, or NULL for ones */
    const void *bias;        /* likewise, or NULL for zeros; NULL for RMS */
    ln_array mean;           /* in: float64, one per row; always absent for RMS (the mean is 0) */
    ln_array rstd;           /* in: float64, one per row */
    ln_array scale;          /* in: float64, one per row: the units of mean and rstd (moments'
                                scale), or absent for ones */
    ptrdiff_t row_len;       /* the whole row's length, the sum of its parts' */
} ln_part_normalize_args;

/* Each returns 0, or -1 when scratch memory could not be allocated. */
int ln_part_moments(const ln_part_moments_args *args);
int ln_part_normalize(const ln_part_normalize_args *args);

/* Backward pass 1's largest magnitudes over a row (or a part of one, merged by maximum): of
   g = grad_output * weight, of grad_output, and of xc = x - mean (x for RMSNorm). */
enum { LN_LARGEST_G, LN_LARGEST_DY, LN_LARGEST_XC, LN_LARGEST_COUNT };

/*
 * Backward of rows split across arrays: each part's row sums, which the caller adds up across
 * the parts and divides by the row's length, then each part's grad_input from those means.
 * With g = grad_output * weight and xhat = (x - mean) * rstd over a part of each row:
 *
 *   sums:        g_sum = g.sum(),  g_xhat_sum = (g * xhat).sum()      (RMSNorm: no g_sum)
 *   grad_input:  dx = rstd * (g - g_mean - xhat * g_xhat_mean)         (RMSNorm: no g_mean)
 *
 * The sums come with the part's largest |g|, |dy| and |xc| (xc = x - mean, x for RMSNorm),
 * which the caller takes the maximum of across the parts: grad_input needs the row's to tell
 * rows whose products come near the subnormals or the largest finite value, which go in
 * float64 as the whole row would.
 *
 * computed as ln_backward computes a few huge rows' (LN_CHUNK-element span sums added in
 * order; its dx arithmetic): the same bits at every level, thread count and layout.
 */
typedef struct {
    ln_norm_kind kind;
    ln_dtype dtype;
    ln_extent extent;        /* the part: blocks x rows x its row_len */
    ln_array grad_output;
    ln_array input;
    const void *weight;      /* the part's row_len params, contiguous, or NULL for ones */
    ln_array mean;           /* in: float64, one per row; always absent for RMS */
    ln_array rstd;           /* in: float64, one per row */
    ln_array g;              /* float64, one per row, absent for RMS: ln_part_grad_sums writes
                                the part's g_sum, ln_part_grad_input reads the row's g_mean */
    ln_array g_xhat;         /* likewise: g_xhat_sum out, g_xhat_mean in */
    ln_array largest[LN_LARGEST_COUNT];  /* float64, one per row each: the part's max |g|, |dy|
                                            and |xc| out, the row's in */
    ln_array grad_input;     /* ln_part_grad_input: out */
} ln_part_backward_args;

int ln_part_grad_sums(const ln_part_backward_args *args);
int ln_part_grad_input(const ln_part_backward_args *args);

/* SIMD dispatch: the best level this CPU runs is chosen on first use. */
ln_simd_level ln_simd_best(void);            /* what the CPU and the build allow */
ln_simd_level ln_simd_get(void);             /* what is in use now */
int ln_simd_set(ln_simd_level level);        /* 0, or -1 if the CPU or the build can't run it */
/* "scalar", "sse2" or "neon", "avx2", "avx512", "avx512bf16"; NULL for a level this build lacks. */
const char *ln_simd_name(ln_simd_level level);

/* Threads: a small pthread pool shared by every call in the process. */
int ln_threads_get(void);
void ln_threads_set(int n);                  /* n >= 1 */
int ln_threads_default(void);                /* CPUs this process may run on */

/* Memory for large results (ln_buffers.c): 64-byte aligned blocks, each kept after it is
   freed, for the next result of about its size, while the blocks kept fit in a limit of bytes
   (LN_BUFFER_CACHE_DEFAULT until set).  ln_buffer_alloc returns NULL when out of memory;
   zeroed asks for zeros.  ln_buffer_realloc and ln_buffer_free take only these blocks (or
   NULL); realloc keeps the first bytes of the block as realloc() does. */
void *ln_buffer_alloc(size_t bytes, int zeroed);
/* The blocks this thread takes from now on (until it is called again) start in their page as
   far as can be from where the `count` arrays inputs[] start in theirs (half a page from a
   lone input): results that do not alias the inputs they are computed from.  count is 1 to
   LN_BUFFER_PLACE_MAX. */
#define LN_BUFFER_PLACE_MAX 4
void ln_buffers_place(const void *const inputs[], int count);
void *ln_buffer_realloc(void *data, size_t bytes);
void ln_buffer_free(void *data);

typedef struct {
    size_t limit;  /* bytes the kept blocks may take */
    size_t held;   /* bytes they take */
    int blocks;    /* how many are kept */
} ln_buffers_state;

ln_buffers_state ln_buffers_get(void);
void ln_buffers_set_limit(size_t bytes);     /* unmaps kept blocks beyond it; 0 keeps none */

#endif
