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
 *     ln_buffers.c                       memory for large results, kept for reuse
 *     ln_layout.c                        shapes and strides to blocks x rows x row_len walks
 *     ln_forward.c, ln_backward.c        drivers: split a call into rows or tiles, spans, threads
 *
 * Two routes through a call, chosen by the layout alone.  Rows whose elements are adjacent in
 * the arrays the norm reads and writes (the contiguous route) go through the row kernels one
 * row at a time, as vectors along the row.  Otherwise (the strided route: channels-first
 * data, transposed rows) rows go in tiles of 16 rows of one block, one row per vector lane,
 * each lane walking its row's elements with their step.  Each route's bits are its own: the
 * same at every level and thread count, not the same as the other route's.
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
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "ln_kernels.h"
#include "ln_tuning.h"
#include "ln_types.h"

#define LN_ALWAYS_INLINE inline __attribute__((always_inline))

/* The norm kinds, in ln_norm_kind order, as X(kind, suffix, DTYPE, dtype_suffix): a
   cross product with LN_FOR_EACH_DTYPE's list, for the kernel tables. */
#define LN_FOR_EACH_KIND(X, DTYPE, dtype_suffix) \
    X(LN_NORM_LAYER, layer, DTYPE, dtype_suffix)   \
    X(LN_NORM_RMS, rms, DTYPE, dtype_suffix)
#define LN_NORM_KINDS 2

/* Rows per tile of the strided route: one a vector lane. */
#define LN_TILE_ROWS 16

/* A load waits on an earlier store to an address with the same low 12 bits, whatever the
   page size, until it knows the two differ ("4 KiB aliasing"): the period of addresses that
   the kernels and the result memory keep their loads and stores apart in. */
#define LN_ALIAS_PERIOD ((uintptr_t)4096)

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

/* The rows the row kernels normalize, the others going by ln_forward_exact_row: those whose
   rstd lies in [low, high] and whose mean is 0 or at least tiny_mean in magnitude.
   float16/bfloat16/float32 rows take float(rstd) * w_j in float32, so rstd outside [low, high]
   leaves float32's normal range for some normal weight or the largest, float64 rows the same
   in float64; low > 0, so a row whose squares overflowed (rstd 0) or whose moments are not
   finite (rstd NaN) is outside.  One call's, from its weight and bias (ln_rstd_bounds_of);
   empty where those hold NaN or Inf. */
typedef struct {
    double low, high;
    double tiny_mean;
} ln_rstd_bounds;

/* What a call's rstd bounds depend on, over some columns of its weight and bias (the levels'
   param_magnitudes): the smallest normal |w_j| (Inf when none is normal; of no use where the
   largest is NaN) and the largest |w_j| and |b_j| (NaN when one is NaN); 1.0 and 1.0 without
   a weight, 0.0 without a bias. */
typedef struct {
    double weight_smallest_normal, weight_largest, bias_largest;
} ln_param_magnitudes;

typedef ln_param_magnitudes (*ln_param_magnitudes_fn)(const void *weight, const void *bias, ptrdiff_t n);

/* The rows that make backward pass 2 together, at one span's first column. */
typedef struct {
    int count;                          /* rows in use, 1..LN_GRAD_ROWS */
    int stream_dx;                      /* dx by non-temporal stores (grad_dx_store) */
    int set_sums;                       /* dweight and dbias get 0.0 + the group's sums, not
                                           what they held + those sums: a block's first group */
    const char *dy[LN_GRAD_ROWS];       /* each row's dy at the span's first column */
    const char *x[LN_GRAD_ROWS];        /* ... and x */
    char *dx[LN_GRAD_ROWS];             /* ... and dx, or all NULL to skip dx */
    double mean[LN_GRAD_ROWS], rstd[LN_GRAD_ROWS];
    double g_mean[LN_GRAD_ROWS];        /* mean(dy * weight) over the row (0 for RMSNorm) */
    double gx_mean[LN_GRAD_ROWS];       /* mean(dy * weight * xhat) over the row */
    const char *next_dy[LN_GRAD_ROWS];  /* the rows of the group after this one, whose lines pass 2
                                           asks for as it goes (ln_backward_prefetches); NULL
                                           past that group's last row, all NULL: none */
    const char *next_x[LN_GRAD_ROWS];
} ln_grad_rows;

/* Backward pass 2 over a span of a group of rows, adding into float64 dweight and dbias
   (each may be NULL). */
typedef void (*ln_grad_apply_fn)(const ln_grad_rows *group, const void *weight, ptrdiff_t n, double *dweight,
                                 double *dbias);

/* One SIMD level's kernels for one norm kind and element type.  "Rows [begin, end)" are
   linear row indices of the call (ln_row_address); "tiles [begin, end)" are the strided
   route's tiles, block by block (ln_tile_of). */
typedef struct {
    /* contiguous route, forward over rows [begin, end) of a call without a residual, the
       statistics reading the input read_ahead bytes ahead (ln_read_ahead's, or 0) */
    void (*forward_rows)(const ln_forward_args *a, const ln_rstd_bounds *bounds, ptrdiff_t begin,
                         ptrdiff_t end, ptrdiff_t read_ahead);
    /* contiguous route, forward over rows [begin, end) of a call with a residual, whose
       input and residual have adjacent elements too and rows of 16 elements or more */
    void (*forward_sum_rows)(const ln_forward_args *a, const ln_rstd_bounds *bounds, ptrdiff_t begin,
                             ptrdiff_t end);
    /* strided route, forward over tiles [begin, end), residual included */
    void (*forward_tiles)(const ln_forward_args *a, const ln_rstd_bounds *bounds, ptrdiff_t begin,
                          ptrdiff_t end);
    /* moments of 1 <= n <= LN_CHUNK elements (read_ahead: ln_read_ahead's) */
    ln_moments (*chunk_moments)(const void *x, ptrdiff_t n, ptrdiff_t read_ahead);
    /* 1 <= n <= LN_NORMALIZE_SPAN elements, output by ordinary or by non-temporal stores */
    ln_normalize_fn normalize_row;
    ln_normalize_fn normalize_row_streaming;
    /* contiguous route, backward over rows [begin, end), its float64 sums into dweight/dbias
       (each may be NULL), whatever they held.  With `totals` (the sums of the blocks before
       this one: NULL where dweight or dbias is), where the rows are one group of float32
       sums (ln_rows_add_to_totals) and none goes by ln_backward_exact_row, their sums are
       added to the totals, which gives the bits that adding dweight/dbias to them would,
       dweight and dbias are left alone, and it returns 1; else 0. */
    int (*backward_rows)(const ln_backward_args *a, ptrdiff_t begin, ptrdiff_t end, double *dweight,
                         double *dbias, double *total_dweight, double *total_dbias);
    /* strided route, backward over tiles [begin, end), adding into float64 per-lane sums:
       column j's lanes at dweight_lanes[16 j .. 16 j + 16) (each may be NULL); a range of
       one tile stores its column sums instead, column j's at dweight_lanes[j], the bits
       ln_sum_lanes would give of that tile's lanes added into zeros (so a few huge rows
       need no scratch of 16 doubles a column) */
    void (*backward_tiles)(const ln_backward_args *a, ptrdiff_t begin, ptrdiff_t end,
                           double *dweight_lanes, double *dbias_lanes);
    /* backward pass 1 over a span of one row: sums of g and g * xhat, and the largest
       magnitudes (LN_LARGEST_G ..) unless NULL; read_ahead: ln_backward_read_ahead's, for dy
       and x both (float64 does not read ahead) */
    void (*grad_sums)(const void *dy, const void *x, const void *weight, ptrdiff_t n, double mean, double rstd,
                      double sums[2], double largest[LN_LARGEST_COUNT], ptrdiff_t read_ahead);
    /* backward pass 2 over a span of a group of rows */
    ln_grad_apply_fn grad_apply;
} ln_row_kernels;

/* One SIMD level's kernels for one element type. */
typedef struct {
    ln_row_kernels by_kind[LN_NORM_KINDS];
    /* sum[0 .. n) = x + residual, rounded as NumPy's add rounds it; x's and residual's
       elements x_step and residual_step bytes apart */
    void (*add_row)(const void *x, ptrdiff_t x_step, const void *residual, ptrdiff_t residual_step, void *sum,
                    ptrdiff_t n);
    /* the magnitudes of weight[0 .. n) and bias[0 .. n) (either may be NULL) */
    ln_param_magnitudes_fn param_magnitudes;
    /* params[0 .. n) = sums in the parameters' dtype (float32; float64 for float64 data), a NaN
       as the one quiet NaN */
    void (*store_params)(void *params, const double *sums, ptrdiff_t n);
    /* to[0 .. n) = from[0 .. n) as float32, exactly (float16, bfloat16 and float32 elements;
       NULL for float64) */
    void (*widen_to_f32)(const void *from, float *to, ptrdiff_t n);
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
extern const ln_kernel_table ln_kernels_avx512_bf16;  /* bfloat16 alone */
#endif

/* The kernels for one element type at the level in use, or, where that level has none of
   its own for the type, at the nearest level below that has (ln_dispatch.c). */
const ln_dtype_kernels *ln_dtype_kernels_in_use(ln_dtype dtype);

/* ------------------------------------------------------------------------ */
/* Threads and scratch memory (ln_threads.c)                                 */
/* ------------------------------------------------------------------------ */

typedef void (*ln_range_fn)(void *ctx, ptrdiff_t begin, ptrdiff_t end);

/* Runs fn over [0, n) on up to ln_threads_get() threads: in as many parts, of at least
   min_per_part each, except that each part but the caller's is handed to fn in
   LN_POOL_PIECES contiguous pieces (any of which may be smaller, or empty and skipped). */
void ln_parallel_for(ptrdiff_t n, ptrdiff_t min_per_part, ln_range_fn fn, void *ctx);

/* fn over [0, n): across the threads where `parallel`, else on the calling thread. */
static inline void ln_run(int parallel, ptrdiff_t n, ptrdiff_t min_per_part, ln_range_fn fn, void *ctx)
{
    if (parallel) {
        ln_parallel_for(n, min_per_part, fn, ctx);
    }
    else {
        fn(ctx, 0, n);
    }
}

/* Part `part` of [0, n) cut into `parts` contiguous parts. */
void ln_range_of_part(ptrdiff_t n, int parts, int part, ptrdiff_t *begin, ptrdiff_t *end);

/* ln_threads_default() with the cgroup CPU quotas read under cgroup_root instead of
   /sys/fs/cgroup, for the process's cgroups as the file self_cgroup lists them instead of
   /proc/self/cgroup (tests give it made-up cgroup files). */
int ln_threads_default_in(const char *cgroup_root, const char *self_cgroup);

/* Where ln_scratch_take's doubles came from. */
typedef enum {
    LN_SCRATCH_MALLOC,  /* malloc's heap: the kept buffer was in use by another call */
    LN_SCRATCH_KEPT,    /* the buffer kept between calls */
    LN_SCRATCH_BLOCK,   /* a block of the large results' (ln_buffer_alloc) */
} ln_scratch_source;

/* The alignment of ln_scratch_take's doubles: a whole cache line.  The kernels store the
   partial sums 64 bytes at a time, and a store that crosses a line costs two: malloc's
   16-byte alignment made 6304x768 float32 backward at one thread 20% slower whenever the
   buffer started 16 or 48 bytes into a line (2.83-3.05 ms against 2.32-2.57 ms). */
#define LN_SCRATCH_ALIGN 64

/* count doubles, zeroed if `zeroed`, LN_SCRATCH_ALIGN-aligned, or NULL when out of memory;
   *source says where from.  Give them back with ln_scratch_give. */
double *ln_scratch_take(size_t count, int zeroed, ln_scratch_source *source);
void ln_scratch_give(double *data, ln_scratch_source source);

/* Memory just mapped for a result that a kernel is about to write whole: its pages faulted
   in first, by the pool's threads (Linux; elsewhere nothing). */
void ln_fault_in(void *data, size_t bytes);

/* ------------------------------------------------------------------------ */
/* Rows the row kernels cannot carry (ln_exact.c)                            */
/* ------------------------------------------------------------------------ */

/* Row r forward (statistics and output) by float64 arithmetic on the row scaled by a power
   of two, reading the row from `source` (the input, or the residual sum). */
void ln_forward_exact_row(const ln_forward_args *a, const ln_array *source, ptrdiff_t r);

/* Row r backward (dx, and dy * xhat added into the float64 column sums dweight, which may be
   NULL) in float64 with rstd applied last; its dbias terms are ln_grad_apply_without's. */
void ln_backward_exact_row(const ln_backward_args *a, ptrdiff_t r, double *dweight);

/* ------------------------------------------------------------------------ */
/* Helpers of drivers and levels alike                                       */
/* ------------------------------------------------------------------------ */

/* The addend of an output element without a bias: +0.0 for LayerNorm, as torch's; -0.0 for
   RMSNorm, whose output is torch's product x * rstd * w: fma(c, s, -0.0) is c * s rounded,
   a zero of either sign included (with +0.0, an input's -0.0 came out +0.0). */
static inline double ln_absent_bias(ln_norm_kind kind)
{
    return kind == LN_NORM_RMS ? -0.0 : 0.0;
}

/* Chan et al.'s pairwise update: the moments of two parts' union. */
static inline ln_moments ln_merge(ln_moments a, ln_moments b)
{
    const double n = a.n + b.n;
    const double delta = b.mean - a.mean;
    ln_moments m = {n, a.mean + delta * (b.n / n), a.m2 + b.m2 + delta * delta * (a.n * (b.n / n))};
    return m;
}

/* Whether a row's moments are finite: a NaN or an Inf in the row makes the whole row NaN,
   as in torch, and squares that overflowed make an m2 of Inf or NaN (Inf - Inf); either
   way the row's rstd is NaN and the row goes to ln_forward_exact_row. */
static inline int ln_moments_finite(ln_moments m)
{
    return isfinite(m.mean) && isfinite(m.m2);
}

/* xhat = (x - mean) * rstd of a float64 element, the difference rounded as if float64 had
   no largest value: where x - mean overflows (rows holding values near DBL_MAX of both signs,
   whose rstd is below 1e-308 and whose forward ln_forward_exact_row scales), it is formed from
   the halves, exact there, as (x / 2 - mean / 2) * rstd * 2, the same rounding of the same real
   number (xhat is at least about 1/2 for such an element, far from float64's subnormals). */
static inline double ln_xhat_of(double x, double mean, double rstd)
{
    const double xc = x - mean;
    return isinf(xc) && isfinite(x) && isfinite(mean) ? (x * 0.5 - mean * 0.5) * rstd * 2.0 : xc * rstd;
}

static inline double ln_rstd_of(ln_moments m, double eps)
{
    if (!ln_moments_finite(m)) {
        return NAN;
    }
    const double var = m.m2 > 0.0 ? m.m2 / m.n : 0.0;
    return 1.0 / sqrt(var + eps);
}

/* The magnitudes of columns a and b together: the order they are taken in does not matter. */
static inline ln_param_magnitudes ln_merge_param_magnitudes(ln_param_magnitudes a, ln_param_magnitudes b)
{
    return (ln_param_magnitudes){
        a.weight_smallest_normal < b.weight_smallest_normal ? a.weight_smallest_normal : b.weight_smallest_normal,
        isnan(a.weight_largest) || a.weight_largest > b.weight_largest ? a.weight_largest : b.weight_largest,
        isnan(a.bias_largest) || a.bias_largest > b.bias_largest ? a.bias_largest : b.bias_largest,
    };
}

/* ... and of no columns, which every merge leaves as the other. */
static inline ln_param_magnitudes ln_no_param_magnitudes(void)
{
    return (ln_param_magnitudes){INFINITY, 0.0, 0.0};
}

/* ... and of a call without weight and bias: their bounds hold every call's. */
static inline ln_param_magnitudes ln_magnitudes_without_params(void)
{
    return (ln_param_magnitudes){1.0, 1.0, 0.0};
}

/* The rstd bounds of a call with rows of n elements whose weight and bias have these
   magnitudes: float16/bfloat16/float32 rows need float(rstd) and float(rstd) * w_j normal and
   finite for every normal w_j, float64 rows rstd * w_j; a weight below the normal range needs
   only rstd * max|w| normal: its a_j = rstd * w_j, off by at most half the smallest subnormal,
   puts an error of |x - mean| times that into y_j, below the precision of the row's largest
   term |xhat| max|w| (so one subnormal weight sends no row to the exact path, where it sent
   every row of std below ~1e-38 / w_j).  A NaN or Inf weight or bias sends every row to
   ln_forward_exact_row, so that its NaNs are the one quiet NaN. */
static inline ln_rstd_bounds ln_rstd_bounds_of(ln_dtype dtype, ptrdiff_t n, ln_param_magnitudes params)
{
    if (!isfinite(params.weight_largest) || !isfinite(params.bias_largest)) {
        return (ln_rstd_bounds){INFINITY, 0.0, 0.0};
    }
    /* the nonzero magnitudes that rstd * w must keep normal, and 1 */
    const double kept = params.weight_smallest_normal <= params.weight_largest ? params.weight_smallest_normal
                      : params.weight_largest > 0.0                         ? params.weight_largest
                                                                            : 1.0;
    const double smallest = kept < 1.0 ? kept : 1.0;
    const double largest = params.weight_largest > 1.0 ? params.weight_largest : 1.0;
    /* The squares of x - mean are summed in float64 (float32 in blocks for float16 and
       bfloat16 data), where those below the normal range round to the subnormals' spacing,
       2**-1074 (2**-149): up to half of it per square, in var as in m2.  A row's var + eps,
       1 / rstd**2, must be at least 2**60 (2**40) times that for its rstd to be right:
       rstd <= 2**507 (2**55).  Rows of smaller var + eps (float64 values near 1e-160, or
       bfloat16 near 1e-20, with eps 0) go by the exact path, which scales them first. */
    if (dtype == LN_F64) {
        const double high = DBL_MAX / largest;
        return (ln_rstd_bounds){DBL_MIN / smallest, high < 0x1p507 ? high : 0x1p507, 0.0};
    }
    /* float32 arithmetic also needs x - mean finite: |x - mean| <= sqrt(m2) <= sqrt(n) / rstd,
       at most FLT_MAX / 2 once rstd >= 2 sqrt(n) / FLT_MAX (rows of std above ~1e37). */
    const double low = fmax((double)FLT_MIN / smallest, 2.0 * sqrt((double)n) / (double)FLT_MAX);
    const double high = (double)FLT_MAX / largest;
    /* and float32 arithmetic subtracts the mean as two floats, mean_hi + mean_lo (row_norm_of),
       whose second falls below float32's normal range where |mean| < 2**-102: the subnormals'
       spacing, 2**-149, then stands between it and the mean's own value, a large part of
       x - mean in rows as narrow (float32 or bfloat16 data near 1e-38 and below).  Such rows
       go by the exact path (float32 rows 1e-39 + 1e-42 * N(0, 1) of 512 elements: outputs
       1.6e-4 of their scale off with eps 1e-30, and by 66 of the subnormals' steps with eps
       1e-5, where the output is subnormal too). */
    return (ln_rstd_bounds){low, ln_dtype_is_16bit(dtype) && high > 0x1p55 ? 0x1p55 : high, 0x1p-102};
}

/* The rstd bounds of a call (its kind says whether its bias counts). */
static inline ln_rstd_bounds ln_rstd_bounds_of_call(const ln_forward_args *a)
{
    const ptrdiff_t n = a->extent.row_len;
    const void *bias = a->kind == LN_NORM_LAYER ? a->bias : NULL;
    return ln_rstd_bounds_of(a->dtype, n, ln_dtype_kernels_in_use(a->dtype)->param_magnitudes(a->weight, bias, n));
}

/* Whether a row needs ln_forward_exact_row: its rstd or its mean is outside the call's
   bounds, which includes rows whose moments overflowed or hold NaN or Inf. */
static inline int ln_row_needs_exact(double mean, double rstd, const ln_rstd_bounds *bounds)
{
    return !(bounds->low <= rstd && rstd <= bounds->high) || (mean != 0.0 && fabs(mean) < bounds->tiny_mean);
}

/* Pass 1's results for a span of a row: sum(g), sum(g * xhat), then the largest magnitudes. */
#define LN_GRAD_SUMS (2 + LN_LARGEST_COUNT)

/* The largest magnitude a row's dweight terms (dy * xc) * rstd, and the products dy * xc
   before rstd, may reach: pass 2 sums the terms of a group's LN_GRAD_ROWS rows in the compute
   type, and this leaves those sums a factor of 2 for rounding. */
static inline double ln_grad_term_limit(ln_dtype dtype)
{
    return (dtype == LN_F64 ? DBL_MAX : (double)FLT_MAX) / (2 * LN_GRAD_ROWS);
}

/* Whether a row's backward needs ln_backward_exact_row, given its rstd, pass 1's means of g
   and g * xhat and its largest magnitudes.  It does where one of these fails:
   - pass 2's per-row factors rstd, -rstd**2 * gx_mean and -rstd * g_mean are finite and in
     the normal range of the compute type (float32 for float16/bfloat16/float32 data), but
     for a factor with a zero operand: so not where pass 1's products overflowed, rstd**2
     overflows or underflows (to 0 in float64 too, as for float64 rows of 1e300), or the row,
     its dy or its statistics hold NaN or Inf;
   - g, and the products g * xc and dy * xc that pass 1 and 2 form before scaling by rstd,
     keep clear of the compute type's subnormals, where they would lose bits or vanish (x ~
     1e-30, dy ~ 1e-20 in float32): tested with |xc| as 1 / rstd, which it reaches unless eps
     outweighs the variance, and as its largest, which is far smaller where eps does (x ~
     1e-36, eps 1e-30, dy ~ 1e-11: every dy * xc 0.0 in float32);
   - -rstd**2 * gx_mean is formed left to right, in float64: rstd**2 is normal there (float64
     rows of std 1e154 to 1e162 have it subnormal, and their dx lost up to a third of its value);
   - what pass 2 forms keeps clear of the compute type's largest: dx's inner term
     xc_scale * xc + offset (where rstd * g cancels it, dx is finite though it is not), and
     dweight's terms (dy * xc) * rstd, summed in the compute type over a group's rows (a
     weight of 1e-20 lets dy reach 1e30 while g and g * xc stay in range).
   The contiguous route's float16/bfloat16/float32 rows take a conservative form of the common
   row's test in vectors first (grad_row_common), and the rows that do not pass come here;
   the strided route's float32 tiles and the contiguous route's tiles of 16 rows of 16
   elements test a lane per row (grad_lanes_common), and a tile that does not pass goes lane
   by lane here (strided) or group by group (contiguous). */
static inline int ln_grad_row_needs_exact(ln_dtype dtype, double rstd, double g_mean, double gx_mean,
                                          const double largest[LN_LARGEST_COUNT])
{
    const double factors[3] = {rstd, -rstd * rstd * gx_mean, -rstd * g_mean};
    const double normal_min = dtype == LN_F64 ? DBL_MIN : (double)FLT_MIN;
    const double normal_max = dtype == LN_F64 ? DBL_MAX : (double)FLT_MAX;
    const double precise_min = dtype == LN_F64 ? DBL_MIN / DBL_EPSILON : (double)FLT_MIN / (double)FLT_EPSILON;
    const double xc_top = largest[LN_LARGEST_XC];
    const int fits = fabs(factors[1]) * xc_top + fabs(factors[2]) <= normal_max / 2 &&
                     largest[LN_LARGEST_DY] * xc_top * (rstd > 1.0 ? rstd : 1.0) <= ln_grad_term_limit(dtype);
    /* The common row, without the conversions and divisions below: a factor in [normal_min,
       normal_max] rounds into it; with rstd positive, largest >= 2 * precise_min * rstd
       (rounded) makes largest / rstd > precise_min, and with xc_top * rstd >= 0.5 too,
       largest * xc_top >= precise_min.  So the test below would say normal too. */
    int common = fits & (rstd >= normal_min) & (rstd <= normal_max) & (rstd * rstd >= DBL_MIN) &
                 (xc_top * rstd >= 0.5);
    for (int i = 1; i < 3; i++) {
        common &= (fabs(factors[i]) >= normal_min) & (fabs(factors[i]) <= normal_max);
    }
    for (int i = LN_LARGEST_G; i <= LN_LARGEST_DY; i++) {
        common &= (largest[i] >= precise_min) & (largest[i] >= 2.0 * precise_min * rstd);
    }
    if (common) {
        return 0;
    }
    const int zero_operand[3] = {rstd == 0.0, rstd == 0.0 || gx_mean == 0.0, rstd == 0.0 || g_mean == 0.0};
    int normal = fits & (zero_operand[1] || rstd * rstd >= DBL_MIN);
    for (int i = 0; i < 3; i++) {
        const double factor = dtype == LN_F64 ? factors[i] : (double)(float)factors[i];
        normal &= (factors[i] == 0.0 && zero_operand[i]) || (isfinite(factor) && fabs(factor) >= normal_min);
    }
    for (int i = LN_LARGEST_G; i <= LN_LARGEST_DY; i++) {
        normal &= largest[i] == 0.0 || (largest[i] >= precise_min && largest[i] / rstd >= precise_min &&
                                        (xc_top == 0.0 || largest[i] * xc_top >= precise_min));
    }
    return !normal;
}

/* Pass 2 over a group of which the rows flagged in `exact` go by ln_backward_exact_row (the
   caller's): the other rows' dx and dweight by `apply`, and dbias by `apply` over every row,
   dx left alone, since dbias needs dy alone: its bits stay those of the whole group. */
static inline void ln_grad_apply_without(ln_grad_apply_fn apply, const ln_grad_rows *group, const int exact[],
                                         const void *weight, ptrdiff_t n, double *dweight, double *dbias)
{
    ln_grad_rows kept = {.count = 0, .stream_dx = group->stream_dx}, every = *group;
    for (int k = 0; k < group->count; k++) {
        every.dx[k] = NULL;
        if (!exact[k]) {
            const int i = kept.count++;
            kept.dy[i] = group->dy[k];
            kept.x[i] = group->x[k];
            kept.dx[i] = group->dx[k];
            kept.mean[i] = group->mean[k];
            kept.rstd[i] = group->rstd[k];
            kept.g_mean[i] = group->g_mean[k];
            kept.gx_mean[i] = group->gx_mean[k];
        }
    }
    if (kept.count > 0 && (kept.dx[0] || dweight)) {
        apply(&kept, weight, n, dweight, NULL);
    }
    if (dbias) {
        apply(&every, weight, n, NULL, dbias);
    }
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

/* Rows in a call: every block's. */
static inline ptrdiff_t ln_rows_of(const ln_extent *extent)
{
    return extent->blocks * extent->rows;
}

/* Row `row` of block `block` in an array. */
static inline char *ln_block_row_address(const ln_array *array, ptrdiff_t block, ptrdiff_t row)
{
    assert(array->data && block >= 0 && row >= 0);
    return array->data + block * array->walk.block_step + row * array->walk.row_step;
}

/* Row r of a call, block r / rows, row r % rows of it, in an array walked over extent. */
static inline char *ln_row_address(const ln_array *array, const ln_extent *extent, ptrdiff_t r)
{
    assert(0 <= r && r < ln_rows_of(extent));
    const ptrdiff_t block = extent->blocks > 1 ? r / extent->rows : 0;
    return ln_block_row_address(array, block, r - block * extent->rows);
}

/* Whether rows [begin, end) of an array (end > begin) lie one after another, each row_bytes
   long: a row step of row_bytes, and row end - 1 where that step puts it, so that no block
   boundary between them moved a row (crossing one moves every later row by the same amount). */
static inline int ln_rows_consecutive(const ln_array *array, const ln_extent *extent, ptrdiff_t begin, ptrdiff_t end,
                                      ptrdiff_t row_bytes)
{
    assert(begin < end);
    return array->walk.row_step == row_bytes &&
           ln_row_address(array, extent, end - 1) ==
               ln_row_address(array, extent, begin) + (end - 1 - begin) * row_bytes;
}

/* Whether an array is absent or has its rows' elements adjacent. */
static inline int ln_elements_adjacent(const ln_array *array, ln_dtype dtype)
{
    return !array->data || array->walk.elem_step == (ptrdiff_t)ln_dtype_size(dtype);
}

/* Whether every row of an array starts at a multiple of `alignment` bytes. */
static inline int ln_rows_aligned(const ln_array *array, const ln_extent *extent, ptrdiff_t alignment)
{
    return (uintptr_t)array->data % (uintptr_t)alignment == 0 &&
           (extent->rows <= 1 || array->walk.row_step % alignment == 0) &&
           (extent->blocks <= 1 || array->walk.block_step % alignment == 0);
}

/* Debug builds' checks of an array argument: an element array (if present) aligned to its
   element size and stepping in whole elements; a statistics array one param-type value per
   row, aligned, its elements not stepped over (elem_step 0, or rows of at most one element,
   which the layout plan steps by the element size). */
static inline int ln_element_array_valid(const ln_array *array, ln_dtype dtype)
{
    const ptrdiff_t size = (ptrdiff_t)ln_dtype_size(dtype);
    return !array->data || ((uintptr_t)array->data % (uintptr_t)size == 0 && array->walk.elem_step % size == 0 &&
                            array->walk.row_step % size == 0 && array->walk.block_step % size == 0);
}

static inline int ln_stat_array_valid(const ln_array *array, ln_dtype dtype, const ln_extent *extent)
{
    return !array->data ||
           ((uintptr_t)array->data % ln_param_size(dtype) == 0 && (array->walk.elem_step == 0 || extent->row_len <= 1));
}

/* Tiles in a call: each block's rows in tiles of LN_TILE_ROWS, the last one maybe partial. */
static inline ptrdiff_t ln_tiles_of(const ln_extent *extent)
{
    return extent->blocks * ((extent->rows + LN_TILE_ROWS - 1) / LN_TILE_ROWS);
}

/* Tile t's block, its first row in the block and its number of rows. */
static inline void ln_tile_of(const ln_extent *extent, ptrdiff_t t, ptrdiff_t *block, ptrdiff_t *row, int *count)
{
    const ptrdiff_t per_block = (extent->rows + LN_TILE_ROWS - 1) / LN_TILE_ROWS;
    *block = t / per_block;
    *row = (t - *block * per_block) * LN_TILE_ROWS;
    *count = (int)(extent->rows - *row < LN_TILE_ROWS ? extent->rows - *row : LN_TILE_ROWS);
}

/* Whether a loop over `array`'s rows reads it in one run: its elements adjacent, and its rows
   one after another or each long enough to be a run of its own. */
static inline int ln_read_in_one_run(const ln_array *array, const ln_extent *extent, ln_dtype dtype)
{
    const ptrdiff_t rows = ln_rows_of(extent), row_bytes = extent->row_len * (ptrdiff_t)ln_dtype_size(dtype);
    return array->data && rows > 0 && ln_elements_adjacent(array, dtype) &&
           (row_bytes >= 4 * LN_READ_AHEAD_BYTES || ln_rows_consecutive(array, extent, 0, rows, row_bytes));
}

/* How far ahead of its reads a forward statistics loop over `array`'s rows (the input of
   call a, or its residual) asks for them (LN_READ_AHEAD_BYTES; with page_ahead, which a call
   that one thread takes whole sets, LN_L3_READ_AHEAD_BYTES for float16/bfloat16/float32
   arrays that the last-level cache may hold), or 0: not at all.  The weight and bias count
   with the array: a row of millions of elements reads its parameters from memory too, and
   they push the array out of the cache before the next call (1x3000000 float32 with both,
   12 MiB of input and 24 MiB of parameters, one thread, into out=: 1.61-1.95 -> 1.43-1.47 ms;
   3x1000000, 20 MiB in all, 0.71-0.80 -> 0.69-0.73 ms). */
static inline ptrdiff_t ln_read_ahead(const ln_forward_args *a, const ln_array *array, int page_ahead)
{
    const double param_bytes = (double)a->extent.row_len * (double)ln_param_size(a->dtype) *
                               ((a->weight != NULL) + (a->bias != NULL));
    const double bytes = (double)ln_rows_of(&a->extent) * (double)a->extent.row_len * (double)ln_dtype_size(a->dtype);
    if (!ln_read_in_one_run(array, &a->extent, a->dtype)) {
        return 0;
    }
    if (bytes + param_bytes >= LN_READ_AHEAD_MIN_BYTES) {
        return LN_READ_AHEAD_BYTES;
    }
    return page_ahead && bytes + param_bytes >= LN_L3_READ_AHEAD_MIN_BYTES && a->dtype != LN_F64
               ? LN_L3_READ_AHEAD_BYTES
               : 0;
}

/* Whether a forward over extent writes its float32/float64 output with non-temporal stores. */
static inline int ln_output_streams(ln_dtype dtype, const ln_extent *extent)
{
    const ptrdiff_t row_bytes = extent->row_len * (ptrdiff_t)ln_dtype_size(dtype);
    return row_bytes >= LN_STREAM_MIN_BYTES ||
           (extent->row_len > LN_CHUNK && row_bytes * ln_rows_of(extent) >= LN_STREAM_MIN_OUTPUT_BYTES);
}

static inline int ln_forward_streams(const ln_forward_args *a)
{
    return ln_output_streams(a->dtype, &a->extent);
}

/* How a loop writes its output: through the caches, or past them by non-temporal stores of
   whole 64-byte lines (the groups' stores line-aligned) or of 16-byte pieces (the stores
   16-byte aligned, the groups straddling lines: the write-combining buffers join the pieces). */
typedef enum { LN_STORE_CACHED, LN_STREAM_LINES, LN_STREAM_PIECES } ln_store;

/* Whether forward's row kernels take a call's rows software-pipelined (forward_rows_pipelined),
   or for rows of up to LN_BATCH_MAX elements 16 rows at a time (forward_rows_batched), either
   way copying a training-mode call's rows and choosing their stores as below:
   rows of 16 to LN_CHUNK elements, and longer rows while their output stays in cache
   (!ln_forward_streams).  A streamed output of long rows goes row by row, statistics then
   normalize (Zen 4, one thread, 2048x4096 float32: pipelined with non-temporal stores 3.9-4.2
   ms, with cached stores 4.4-4.5 ms, row by row 2.6-2.9 ms).  float64 rows are pipelined up to
   LN_F64_PIPELINED_MAX elements, and up to LN_CHUNK where the call copies its input (a
   training-mode call), which the pipelined loop does from L1 instead of in a pass of its own
   (256x1024, one thread: 152-155 us pipelined, 182-212 us row by row). */
static inline int ln_rows_pipelined(const ln_forward_args *a)
{
    const ptrdiff_t n = a->extent.row_len;
    if (a->dtype == LN_F64) {
        return n >= 16 && (n <= LN_F64_PIPELINED_MAX || (a->copy.data && n <= LN_CHUNK));
    }
    return n >= 16 && (n <= LN_CHUNK || !ln_forward_streams(a));
}

/* Whether rows of n elements, of up to LN_CHUNK, may go to a large output by non-temporal
   stores: rows of whole groups of 16 filling whole lines (float16/bfloat16: an even number of
   groups).  Elements past a row's last whole group go by plain stores, and beside them, in the
   same lines and rows, the non-temporal stores cost 2x to 40x their time (AMD Zen 3, one
   thread, 40 MiB of float32 rows with weight and bias: rows of 24 235.7 -> 10.1 ms, 40 144.1
   -> 9.1, 100 47.0 -> 6.7, 1000 9.4 -> 5.7; add_layer_norm, rows of 40: 271 -> 20 ms; float16
   add_layer_norm, rows of 48: 8.2-8.5 ns an element streamed, 1.6 below the size that
   streams). */
static inline int ln_short_rows_may_stream(ln_dtype dtype, ptrdiff_t n)
{
    return n % 16 == 0 && (n * (ptrdiff_t)ln_dtype_size(dtype)) % 64 == 0;
}

/* How the pipelined rows write a float32/float64 output: with non-temporal stores once it is
   LN_STREAM_MIN_OUTPUT_BYTES in all (rows of up to LN_CHUNK elements: longer ones pipeline
   only while their output stays in cache, and ln_short_rows_may_stream), in whole lines where
   every row starts one, else in 16-byte pieces where every row starts 16-byte aligned (NumPy's
   arrays: 16 bytes past a line), the loop having no head of its own to reach a line (Zen 4,
   float32 with weight and bias, one thread: 10923x768 into a line-aligned output 3.13 -> 2.52
   ms; into one 16 bytes past a line, by plain stores against 16-byte pieces, 2.97-3.16 ->
   2.49-2.50 ms, at two threads 1.86-1.89 -> 1.48-1.53 ms). */
static inline ln_store ln_pipelined_rows_store(const ln_forward_args *a)
{
    const ptrdiff_t n = a->extent.row_len, row_bytes = n * (ptrdiff_t)ln_dtype_size(a->dtype);
    if (!((a->dtype == LN_F32 || a->dtype == LN_F64) && n <= LN_CHUNK && ln_short_rows_may_stream(a->dtype, n) &&
          row_bytes * ln_rows_of(&a->extent) >= LN_STREAM_MIN_OUTPUT_BYTES)) {
        return LN_STORE_CACHED;
    }
    return ln_rows_aligned(&a->output, &a->extent, 64)   ? LN_STREAM_LINES
           : ln_rows_aligned(&a->output, &a->extent, 16) ? LN_STREAM_PIECES
                                                         : LN_STORE_CACHED;
}

/* Whether forward's row kernels write a call's copy themselves, each row as its statistics
   are gathered: pipelined rows, the input's and the copy's elements adjacent. */
static inline int ln_copies_in_rows(const ln_forward_args *a)
{
    return a->copy.data && ln_rows_pipelined(a) && ln_elements_adjacent(&a->input, a->dtype) &&
           ln_elements_adjacent(&a->copy, a->dtype);
}

/* Whether the fused residual pass (forward_sum_rows) writes sum and the output with
   non-temporal stores: as ln_output_streams says for outputs, and for the rows
   ln_short_rows_may_stream lets, of any length, once the results are large
   (LN_SUM_STREAM_MIN_BYTES): the pass reads neither back from memory (8192x1024 float32 out=,
   one thread: 10.8 -> 4.6 ms), but on pages the OS has just zeroed, non-temporal stores cost
   more than they save (32x197x768 float32 into new arrays: 7.0 -> 10.1 ms). */
static inline int ln_sum_streams(const ln_forward_args *a)
{
    const ptrdiff_t n = a->extent.row_len;
    const ptrdiff_t result_bytes = ln_rows_of(&a->extent) * n * (ptrdiff_t)ln_dtype_size(a->dtype);
    return ln_forward_streams(a) || (ln_short_rows_may_stream(a->dtype, n) && result_bytes >= LN_SUM_STREAM_MIN_BYTES);
}

/* Whether a backward over extent writes dx, of dtype, with non-temporal stores (see
   LN_BACKWARD_STREAM_MIN_BYTES). */
static inline int ln_dx_streams(ln_dtype dtype, const ln_extent *extent, const ln_array *grad_input)
{
    const ptrdiff_t row_bytes = extent->row_len * (dtype == LN_F64 ? 8 : dtype == LN_F32 ? 4 : 0);
    return grad_input->data && row_bytes > 0 && row_bytes % 16 == 0 && ln_rows_aligned(grad_input, extent, 16) &&
           row_bytes * ln_rows_of(extent) >= LN_BACKWARD_STREAM_MIN_BYTES;
}

static inline int ln_backward_streams_dx(const ln_backward_args *a)
{
    return ln_dx_streams(a->dtype, &a->extent, &a->grad_input);
}

/* Whether backward_rows can add `rows` rows of n elements to the sums of the blocks before
   them as it goes (ln_row_kernels): they make one pass-2 group, whose float32 sums s it
   adds, widened, to the totals, where on its own it would write 0.0 + s.  totals + s and
   totals + (0.0 + s) differ only for s = -0.0 and totals = -0.0, and the totals are never
   -0.0: the first block's start as 0.0 + its first group's sums, or as zeros that its rows
   are added to, and a sum is -0.0 only where both terms are.
   float64 rows add each row's terms to the sums one at a time, which would change bits. */
static inline int ln_rows_add_to_totals(ln_dtype dtype, ptrdiff_t rows, ptrdiff_t n)
{
    return dtype != LN_F64 && 1 <= rows && rows <= LN_GRAD_ROWS && n >= 16;
}

/* The bytes of x and dy a backward reads, which say whether they come from memory (see
   LN_GRAD_PREFETCH_MIN_BYTES). */
static inline double ln_backward_data_bytes(const ln_backward_args *a)
{
    return 2.0 * (double)ln_rows_of(&a->extent) * (double)a->extent.row_len * (double)ln_dtype_size(a->dtype);
}

/* Whether backward pass 2 asks for the next group's rows as it goes (see
   LN_GRAD_PREFETCH_MIN_BYTES). */
static inline int ln_backward_prefetches(const ln_backward_args *a)
{
    const ptrdiff_t row_bytes = a->extent.row_len * (ptrdiff_t)ln_dtype_size(a->dtype);
    const ptrdiff_t max_row_bytes = a->dtype == LN_F64 ? LN_GRAD_PREFETCH_MAX_ROW_BYTES_F64
                                                       : LN_GRAD_PREFETCH_MAX_ROW_BYTES;
    return row_bytes <= max_row_bytes && ln_backward_data_bytes(a) >= (double)LN_GRAD_PREFETCH_MIN_BYTES;
}

/* How far ahead backward's pass 1 reads dy and x: LN_READ_AHEAD_BYTES where the two take
   LN_GRAD_PREFETCH_MIN_BYTES together, as for ln_backward_prefetches, whose rows pass 2 asks
   for instead, and both are read in one run; else 0 (float64's pass 1 ignores it).  One
   thread, A/B in alternating processes: 2048x4096 float32 3.68-3.80 -> 3.27-3.43 ms (8, 16 and
   32 KiB ahead alike); with arrays of 8 to 16 MiB, which LN_READ_AHEAD_MIN_BYTES leaves out,
   1024x2048 float32 0.67-0.68 -> 0.57 ms, 2048x2048 float16 1.15-1.26 -> 0.86-0.92 ms,
   1500x2048 float32 1.01-1.04 -> 0.86-0.95 ms. */
static inline ptrdiff_t ln_backward_read_ahead(const ln_backward_args *a)
{
    const int reads_ahead = !ln_backward_prefetches(a) &&
                            ln_backward_data_bytes(a) >= (double)LN_GRAD_PREFETCH_MIN_BYTES &&
                            ln_read_in_one_run(&a->input, &a->extent, a->dtype) &&
                            ln_read_in_one_run(&a->grad_output, &a->extent, a->dtype);
    return reads_ahead ? LN_READ_AHEAD_BYTES : 0;
}

/* One statistic of row r as a float64, from an array of dtype's param type. */
static inline double ln_load_stat(ln_dtype dtype, const ln_array *stat, const ln_extent *extent, ptrdiff_t r)
{
    return ln_load1_param_as_f64(dtype, ln_row_address(stat, extent, r), 0);
}

/* Row r's statistics out, where wanted (mean is absent for RMSNorm). */
static inline void ln_store_stats(const ln_forward_args *a, ptrdiff_t r, double mean, double rstd)
{
    if (a->mean.data) {
        ln_store1_param(a->dtype, ln_row_address(&a->mean, &a->extent, r), 0, mean);
    }
    if (a->rstd.data) {
        ln_store1_param(a->dtype, ln_row_address(&a->rstd, &a->extent, r), 0, rstd);
    }
}

/* A normalize that learns the call's rstd bounds as it goes (ln_normalize_spans_backwards):
   each span's weight and bias magnitudes are merged into `seen` before the span is
   normalized, and the span is normalized only if they allow the row's rstd, the normalize's
   premise; from the first span that does not, none is (complete = 0). */
typedef struct {
    ln_param_magnitudes_fn param_magnitudes;  /* the level's */
    ln_dtype dtype;
    ptrdiff_t row_len;                        /* the whole row's, for the bounds */
    ln_param_magnitudes seen;
    int complete;
} ln_span_scan;

/* normalize() over elements [begin, end) of a row, LN_NORMALIZE_SPAN at a time from the end
   back (see LN_NORMALIZE_SPAN).  With `scan`, each span's weight and bias are scanned first
   (ln_span_scan), and the normalize then reads them from cache: a call that learns its rstd
   bounds this way reads its parameters once. */
static inline void ln_normalize_spans_backwards(ln_normalize_fn normalize, ln_dtype dtype, const void *x,
                                                void *y, ptrdiff_t begin, ptrdiff_t end, double mean,
                                                double rstd, const void *weight, const void *bias,
                                                ln_span_scan *scan)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), param_elsize = (ptrdiff_t)ln_param_size(dtype);
    assert(normalize && x && y && 0 <= begin && begin <= end);
    for (ptrdiff_t stop = end; stop > begin;) {
        const ptrdiff_t start = stop - begin > LN_NORMALIZE_SPAN ? stop - LN_NORMALIZE_SPAN : begin;
        const void *span_weight = weight ? (const char *)weight + start * param_elsize : NULL;
        const void *span_bias = bias ? (const char *)bias + start * param_elsize : NULL;
        if (scan) {
            const ln_param_magnitudes span = scan->param_magnitudes(span_weight, span_bias, stop - start);
            const ln_rstd_bounds allowed = ln_rstd_bounds_of(scan->dtype, scan->row_len, span);
            scan->seen = ln_merge_param_magnitudes(scan->seen, span);
            scan->complete &= !ln_row_needs_exact(mean, rstd, &allowed);
        }
        if (!scan || scan->complete) {
            normalize((const char *)x + start * elsize, (char *)y + start * elsize, stop - start, mean, rstd,
                      span_weight, span_bias);
        }
        stop = start;
    }
}

#endif
