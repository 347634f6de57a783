/*
 * ln_internal.h -- what the drivers (ln_forward.c, ln_backward.c) and the SIMD levels
 * (ln_level_*.c) share: the kernel table, the moments of a run of elements, the thread
 * pool and scratch memory, and the small helpers both sides call.
 *
 * Layers, bottom up:
 *     ln_types.h, ln_tuning.h            element types; thresholds
 *     ln_simd_<level>.h                  16-element group primitives of one SIMD level
 *     ln_rows.h                          the row algorithms, written once against them
 *     ln_level_<level>.c                 one translation unit per level: primitives + rows,
 *                                        exporting its kernel table only
 *     ln_dispatch.c, ln_threads.c        level choice; thread pool and scratch buffer
 *     ln_forward.c, ln_backward.c        drivers: split a call into rows, spans, threads
 *
 * Determinism: a row's statistics are computed chunk by chunk (LN_CHUNK elements,
 * boundaries fixed from the row start) and the chunks are merged left to right,
 * whether one thread does all of them or several threads share a huge row.  Rows
 * never depend on each other, and parameter gradients are summed over a partition
 * that depends only on the shape.  So results do not depend on the thread count.
 */
#ifndef LN_INTERNAL_H
#define LN_INTERNAL_H

#include <assert.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "ln_kernels.h"
#include "ln_tuning.h"
#include "ln_types.h"

#define LN_ALWAYS_INLINE inline __attribute__((always_inline))

/* ------------------------------------------------------------------------ */
/* The kernel table                                                          */
/* ------------------------------------------------------------------------ */

typedef struct {
    double n;     /* elements */
    double mean;  /* their mean */
    double m2;    /* sum of squared deviations from the mean */
} ln_moments;

/* y[0 .. n) normalized from x[0 .. n); weight and bias point at the same columns, or are
   NULL for ones and zeros. */
typedef void (*ln_normalize_fn)(const void *x, void *y, ptrdiff_t n, double mean, double rstd,
                                const void *weight, const void *bias);

/* The rows that make backward pass 2 together, at one span's first column. */
typedef struct {
    int count;                          /* rows in use, 1..LN_GRAD_ROWS */
    int stream_dx;                      /* dx by non-temporal stores (16-byte aligned rows) */
    const char *dy[LN_GRAD_ROWS];       /* each row's dy at the span's first column */
    const char *x[LN_GRAD_ROWS];        /* ... and x */
    char *dx[LN_GRAD_ROWS];             /* ... and dx, or all NULL to skip dx */
    double mean[LN_GRAD_ROWS], rstd[LN_GRAD_ROWS];
    double g_mean[LN_GRAD_ROWS];        /* mean(dy * weight) over the row */
    double gx_mean[LN_GRAD_ROWS];       /* mean(dy * weight * xhat) over the row */
} ln_grad_rows;

/* One SIMD level's kernels for one element type. */
typedef struct {
    /* forward over rows [begin, end) of a call */
    void (*forward_rows)(const ln_forward_args *a, ptrdiff_t begin, ptrdiff_t end);
    /* moments of 1 <= n <= LN_CHUNK elements */
    ln_moments (*chunk_moments)(const void *x, ptrdiff_t n);
    /* 1 <= n <= LN_NORMALIZE_SPAN elements, output by ordinary or by non-temporal stores */
    ln_normalize_fn normalize_row;
    ln_normalize_fn normalize_row_streaming;
    /* backward over rows [begin, end), adding into float64 dweight/dbias (each may be NULL) */
    void (*backward_rows)(const ln_backward_args *a, ptrdiff_t begin, ptrdiff_t end,
                          double *dweight, double *dbias);
    /* backward pass 1 over a span of one row: sums of g and g * xhat */
    void (*grad_sums)(const void *dy, const void *x, const void *weight, ptrdiff_t n,
                      double mean, double rstd, double sums[2]);
    /* backward pass 2 over a span of a group of rows */
    void (*grad_apply)(const ln_grad_rows *group, const void *weight, ptrdiff_t n,
                       double *dweight, double *dbias);
} ln_dtype_kernels;

/* One SIMD level's kernels, the only export of its translation unit. */
typedef struct {
    ln_dtype_kernels by_dtype[LN_DTYPES];
} ln_kernel_table;

/* The levels' tables (ln_level_*.c), each present where its target is. */
extern const ln_kernel_table ln_kernels_scalar;
#if defined(__x86_64__) || defined(__aarch64__)
extern const ln_kernel_table ln_kernels_vec128;
#endif
#if defined(__x86_64__)
extern const ln_kernel_table ln_kernels_avx2;
extern const ln_kernel_table ln_kernels_avx512;
#endif

/* The kernels of the level in use (ln_dispatch.c). */
const ln_kernel_table *ln_kernels_in_use(void);

/* ------------------------------------------------------------------------ */
/* Threads and scratch memory (ln_threads.c)                                 */
/* ------------------------------------------------------------------------ */

typedef void (*ln_range_fn)(void *ctx, ptrdiff_t begin, ptrdiff_t end);

/* Runs fn over [0, n) in up to ln_threads_get() contiguous parts of at least
   min_per_part each. */
void ln_parallel_for(ptrdiff_t n, ptrdiff_t min_per_part, ln_range_fn fn, void *ctx);

/* Part `part` of [0, n) cut into `parts` contiguous parts. */
void ln_range_of_part(ptrdiff_t n, int parts, int part, ptrdiff_t *begin, ptrdiff_t *end);

/* ln_threads_default() with the cgroup CPU quota read under cgroup_dir instead of
   /sys/fs/cgroup (tests give it made-up cgroup files). */
int ln_threads_default_in(const char *cgroup_dir);

/* count zeroed doubles, or NULL when out of memory; *kept says whether they are the kept
   buffer.  Give them back with ln_scratch_give. */
double *ln_scratch_take(size_t count, int *kept);
void ln_scratch_give(double *data, int kept);

/* ------------------------------------------------------------------------ */
/* Helpers of drivers and levels alike                                       */
/* ------------------------------------------------------------------------ */

/* Chan et al.'s pairwise update: the moments of two parts' union. */
static inline ln_moments ln_merge(ln_moments a, ln_moments b)
{
    const double n = a.n + b.n;
    const double delta = b.mean - a.mean;
    ln_moments m = {n, a.mean + delta * (b.n / n), a.m2 + b.m2 + delta * delta * (a.n * (b.n / n))};
    return m;
}

static inline double ln_rstd_of(ln_moments m, double eps)
{
    if (!isfinite(m.mean)) {
        return NAN;  /* NaN or Inf in the row: the whole row becomes NaN, as in torch */
    }
    const double var = m.m2 > 0.0 ? m.m2 / m.n : 0.0;
    return 1.0 / sqrt(var + eps);
}

/* The fixed reduction tree over the 16 accumulation lanes. */
static inline double ln_sum_lanes(const double lanes[16])
{
    double pairs[8];
    for (int k = 0; k < 8; k++) {
        pairs[k] = lanes[k] + lanes[k + 8];
    }
    for (int k = 0; k < 4; k++) {
        pairs[k] += pairs[k + 4];
    }
    return ((pairs[0] + pairs[2]) + (pairs[1] + pairs[3]));
}

/* Whether forward writes its float32/float64 output with non-temporal stores. */
static inline int ln_forward_streams(const ln_forward_args *a)
{
    const ptrdiff_t row_bytes = a->row_len * (ptrdiff_t)ln_dtype_size(a->dtype);
    return row_bytes >= LN_STREAM_MIN_BYTES ||
           (a->row_len > LN_CHUNK && row_bytes * a->rows >= LN_STREAM_MIN_OUTPUT_BYTES);
}

/* Whether backward writes dx with non-temporal stores (see LN_BACKWARD_STREAM_MIN_BYTES). */
static inline int ln_backward_streams_dx(const ln_backward_args *a)
{
    const ptrdiff_t row_bytes = a->row_len * (a->dtype == LN_F64 ? 8 : a->dtype == LN_F32 ? 4 : 0);
    return a->grad_input && row_bytes > 0 && row_bytes % 16 == 0 &&
           ((uintptr_t)a->grad_input & 15) == 0 && row_bytes * a->rows >= LN_BACKWARD_STREAM_MIN_BYTES;
}

static inline void ln_store_stats(const ln_forward_args *a, ptrdiff_t row, double mean, double rstd)
{
    if (a->mean) {
        ln_store1_param(a->dtype, a->mean, row, mean);
    }
    if (a->rstd) {
        ln_store1_param(a->dtype, a->rstd, row, rstd);
    }
}

/* normalize() over elements [begin, end) of a row, LN_NORMALIZE_SPAN at a time from the end
   back (see LN_NORMALIZE_SPAN). */
static inline void ln_normalize_spans_backwards(ln_normalize_fn normalize, ln_dtype dtype, const void *x,
                                                void *y, ptrdiff_t begin, ptrdiff_t end, double mean,
                                                double rstd, const void *weight, const void *bias)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), param_elsize = (ptrdiff_t)ln_param_size(dtype);
    assert(normalize && x && y && 0 <= begin && begin <= end);
    for (ptrdiff_t stop = end; stop > begin;) {
        const ptrdiff_t start = stop - begin > LN_NORMALIZE_SPAN ? stop - LN_NORMALIZE_SPAN : begin;
        normalize((const char *)x + start * elsize, (char *)y + start * elsize, stop - start, mean, rstd,
                  weight ? (const char *)weight + start * param_elsize : NULL,
                  bias ? (const char *)bias + start * param_elsize : NULL);
        stop = start;
    }
}

#endif
