/*
 * ln_parts.c -- the driver for rows split across arrays (ln_kernels.h): each part's moments,
 * each part normalized with statistics given, and backward's row sums and grad_input.
 *
 * A part's rows are cut into LN_CHUNK-element chunks from the row start, as ln_forward cuts a
 * whole row (and ln_backward a few huge ones); the tasks are (row, chunk) pairs, so a few long
 * rows keep every thread busy as well as many short ones.  A row's chunk moments are merged,
 * and its chunk sums added, left to right, whichever thread took each.  Rows whose elements
 * are not adjacent (the strided layouts) have each chunk gathered into a buffer first (and
 * the chunk written scattered back), so that the level's kernels see the same values in the
 * same order: the bits do not depend on the layout.
 *
 * Rows of extreme magnitude go as ln_exact.c takes whole rows: in plain float64 C, the same
 * bits at every level.  A part whose float64 moments could overflow or underflow in the
 * caller's merge (|mean| or m2 far from 1, or all zeros) has them taken again in units of
 * s = 2**(e - 1), e the binary exponent of max|x| (x / s is exact and below 2):
 *
 *     mean_s = mean(x / s), then mean_s += mean(x / s - mean_s)      (0 for RMSNorm)
 *     m2_s = sum((x / s - mean_s)**2)                                 (mean = mean_s * s)
 *
 * and normalize takes such a row's statistics in the same units, y = (x / s - mean_s) * rstd_s
 * * w + b with rstd_s = rstd * s, as it takes every row whose rstd the kernels cannot carry
 * (ln_rstd_bounds).  Backward's parts go so for rows ln_grad_row_needs_exact flags, in
 * float64 with rstd applied last: the sums by the part's own largest magnitudes, grad_input
 * by the row's, which the caller merges from the sums'.  Every NaN written is the one quiet NaN.
 */
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "ln_internal.h"

typedef struct {
    ln_dtype dtype;
    const ln_extent *extent;
    const ln_array *input;               /* moments: the part's input */
    const ln_row_kernels *kernels;       /* the level in use, for kind and dtype */
    ptrdiff_t chunks;                    /* LN_CHUNK-element chunks per row */
    ln_moments *chunk_moments;           /* moments: rows x chunks */
    const ln_part_normalize_args *normalize;
    const ln_part_backward_args *backward;
    double *chunk_sums;                  /* grad sums: rows x chunks x LN_GRAD_SUMS [sum g,
                                            sum g * xhat, largest] */
    int streams;                         /* normalize, grad_input: output by non-temporal stores */
    ln_rstd_bounds bounds;               /* normalize: the rstd the kernels carry */
} ln_part_job;

/* A job over a part of kind and dtype cut into LN_CHUNK-element chunks, its kernels the
   level's in use. */
static ln_part_job ln_part_job_of(ln_norm_kind kind, ln_dtype dtype, const ln_extent *extent)
{
    return (ln_part_job){
        .dtype = dtype,
        .extent = extent,
        .kernels = &ln_dtype_kernels_in_use(dtype)->by_kind[kind],
        .chunks = (extent->row_len + LN_CHUNK - 1) / LN_CHUNK,
    };
}

/* Element i of a row whose elements are `step` bytes apart, as float64. */
static double ln_part_element(ln_dtype dtype, const char *row, ptrdiff_t step, ptrdiff_t i)
{
    return ln_load1_as_f64(dtype, row + i * step, 0);
}

/* Elements [start, start + len) of a row whose elements are `step` bytes apart, to or from
   adjacent ones in `buffer`. */
static void ln_gather(const char *row, ptrdiff_t step, ptrdiff_t elsize, ptrdiff_t start, ptrdiff_t len,
                      void *buffer)
{
    for (ptrdiff_t j = 0; j < len; j++) {
        memcpy((char *)buffer + j * elsize, row + (start + j) * step, (size_t)elsize);
    }
}

static void ln_scatter(const void *buffer, ptrdiff_t elsize, ptrdiff_t start, ptrdiff_t len, char *row,
                       ptrdiff_t step)
{
    for (ptrdiff_t j = 0; j < len; j++) {
        memcpy(row + (start + j) * step, (const char *)buffer + j * elsize, (size_t)elsize);
    }
}

/* Task t's row and its chunk's first element and length. */
static void ln_part_task(const ln_part_job *job, ptrdiff_t t, ptrdiff_t *row, ptrdiff_t *start, ptrdiff_t *len)
{
    const ptrdiff_t n = job->extent->row_len;
    *row = t / job->chunks;
    *start = (t - *row * job->chunks) * LN_CHUNK;
    *len = n - *start < LN_CHUNK ? n - *start : LN_CHUNK;
}

/* Tasks [begin, end): their chunks' moments. */
static void ln_part_moments_tasks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_part_job *job = ctx;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(job->dtype), step = job->input->walk.elem_step;
    double buffer[LN_CHUNK];  /* a strided chunk's elements, adjacent (float64 at most) */
    for (ptrdiff_t t = begin; t < end; t++) {
        ptrdiff_t r, start, len;
        ln_part_task(job, t, &r, &start, &len);
        const char *x = ln_row_address(job->input, job->extent, r);
        if (step == elsize) {
            job->chunk_moments[t] = job->kernels->chunk_moments(x + start * elsize, len, 0);
        }
        else {
            ln_gather(x, step, elsize, start, len, buffer);
            job->chunk_moments[t] = job->kernels->chunk_moments(buffer, len, 0);
        }
    }
}

/* A per-row float64 statistic, or `absent` when its array is. */
static double ln_part_stat(const ln_array *stat, const ln_extent *extent, ptrdiff_t r, double absent)
{
    return stat->data ? *(const double *)ln_row_address(stat, extent, r) : absent;
}

/* Elements [start, start + len) of row r normalized in float64 from its statistics in units
   of s (the header's y = (x / s - mean_s) * rstd_s * w + b); weight and bias at column start. */
static void ln_part_normalize_exact(const ln_part_normalize_args *a, ptrdiff_t r, ptrdiff_t start, ptrdiff_t len,
                                    double mean_s, double rstd_s, double s, const void *weight, const void *bias)
{
    const ptrdiff_t x_step = a->input.walk.elem_step, y_step = a->output.walk.elem_step;
    const char *x = ln_row_address(&a->input, &a->extent, r) + start * x_step;
    char *y = ln_row_address(&a->output, &a->extent, r) + start * y_step;
    for (ptrdiff_t i = 0; i < len; i++) {
        const double xhat = (ln_part_element(a->dtype, x, x_step, i) / s - mean_s) * rstd_s;
        const double w = weight ? ln_load1_param_as_f64(a->dtype, weight, i) : 1.0;
        const double out = xhat * w + (bias ? ln_load1_param_as_f64(a->dtype, bias, i) : ln_absent_bias(a->kind));
        ln_store1_from_f64(a->dtype, y + i * y_step, 0, isnan(out) ? NAN : out);
    }
}

/* Tasks [begin, end): their chunks normalized with their rows' statistics. */
static void ln_part_normalize_tasks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_part_job *job = ctx;
    const ln_part_normalize_args *a = job->normalize;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype), param_elsize = (ptrdiff_t)ln_param_size(a->dtype);
    const int adjacent = ln_elements_adjacent(&a->input, a->dtype) && ln_elements_adjacent(&a->output, a->dtype);
    double x_buffer[LN_CHUNK], y_buffer[LN_CHUNK];  /* a strided chunk's elements, adjacent */
    for (ptrdiff_t t = begin; t < end; t++) {
        ptrdiff_t r, start, len;
        ln_part_task(job, t, &r, &start, &len);
        const double mean = ln_part_stat(&a->mean, &a->extent, r, 0.0);
        const double rstd = ln_part_stat(&a->rstd, &a->extent, r, 0.0);
        const double scale = ln_part_stat(&a->scale, &a->extent, r, 1.0);
        const void *weight = a->weight ? (const char *)a->weight + start * param_elsize : NULL;
        const void *bias = a->bias ? (const char *)a->bias + start * param_elsize : NULL;
        const char *x = ln_row_address(&a->input, &a->extent, r);
        char *y = ln_row_address(&a->output, &a->extent, r);
        if (scale != 1.0 || ln_row_needs_exact(mean, rstd, &job->bounds)) {
            ln_part_normalize_exact(a, r, start, len, mean, rstd, scale, weight, bias);
        }
        else if (adjacent) {
            (job->streams ? job->kernels->normalize_row_streaming : job->kernels->normalize_row)(
                x + start * elsize, y + start * elsize, len, mean, rstd, weight, bias);
        }
        else {
            ln_gather(x, a->input.walk.elem_step, elsize, start, len, x_buffer);
            job->kernels->normalize_row(x_buffer, y_buffer, len, mean, rstd, weight, bias);
            ln_scatter(y_buffer, elsize, start, len, y, a->output.walk.elem_step);
        }
    }
}

/* Row r's moments out (mean where wanted: it is absent for RMSNorm) and their unit. */
static void ln_store_part_moments(const ln_part_moments_args *a, ptrdiff_t r, ln_moments m, double scale)
{
    if (a->mean.data) {
        *(double *)ln_row_address(&a->mean, &a->extent, r) = m.mean;
    }
    *(double *)ln_row_address(&a->m2, &a->extent, r) = m.m2;
    *(double *)ln_row_address(&a->scale, &a->extent, r) = scale;
}

/* Whether a part's moments go to the caller's merge as they are: |mean| and m2 so far from
   the range ends of the arithmetic that took them (float32 for float16/bfloat16 data, whose
   squares of subnormals would round away, else float64) that neither lost bits, and that
   n * (mean_p - mean)**2 and the sums of m2 in float64 can neither overflow nor round to
   subnormals; a part of zeros (0, 0), a constant one of tiny squares perhaps, does not. */
static int ln_moments_mergeable(ln_dtype dtype, ln_moments m)
{
    const int in_f32 = ln_dtype_is_16bit(dtype);
    const double mean = fabs(m.mean), mean_min = in_f32 ? 0x1p-100 : 0x1p-400, mean_max = in_f32 ? 0x1p100 : 0x1p400;
    const double m2_min = in_f32 ? 0x1p-60 : 0x1p-800, m2_max = in_f32 ? 0x1p120 : 0x1p800;
    const int mean_mergeable = mean == 0.0 || (mean_min <= mean && mean <= mean_max);
    return mean_mergeable && (m.m2 == 0.0 ? mean != 0.0 : m2_min <= m.m2 && m.m2 <= m2_max);
}

/* Row r's part's moments in units of s (the header's), with s in *scale; for a part holding
   NaN or Inf, `plain`'s mean and a NaN m2 in units of 1, so that its row's rstd is NaN (a sum
   of squares would be Inf). */
static ln_moments ln_scaled_part_moments(const ln_part_moments_args *a, ptrdiff_t r, ln_moments plain,
                                         double *scale)
{
    const ptrdiff_t n = a->extent.row_len, step = a->input.walk.elem_step;
    const char *x = ln_row_address(&a->input, &a->extent, r);
    double largest = 0.0;
    for (ptrdiff_t i = 0; i < n; i++) {
        const double v = fabs(ln_part_element(a->dtype, x, step, i));
        largest = v > largest || isnan(v) ? v : largest;
    }
    *scale = 1.0;
    if (!isfinite(largest)) {
        return (ln_moments){.mean = plain.mean, .m2 = NAN};
    }
    int exponent;
    frexp(largest > 0.0 ? largest : 1.0, &exponent);
    const double s = ldexp(1.0, exponent - 1);
    double mean_s = 0.0, m2_s = 0.0;
    if (a->kind == LN_NORM_LAYER) {
        double sum = 0.0, correction = 0.0;
        for (ptrdiff_t i = 0; i < n; i++) {
            sum += ln_part_element(a->dtype, x, step, i) / s;
        }
        mean_s = sum / (double)n;
        for (ptrdiff_t i = 0; i < n; i++) {
            correction += ln_part_element(a->dtype, x, step, i) / s - mean_s;
        }
        mean_s += correction / (double)n;
    }
    for (ptrdiff_t i = 0; i < n; i++) {
        const double d = ln_part_element(a->dtype, x, step, i) / s - mean_s;
        m2_s += d * d;
    }
    *scale = s;
    return (ln_moments){.mean = mean_s, .m2 = m2_s};
}

/* Runs fn over the job's tasks, across the threads when there is enough to share. */
static void ln_part_run(ln_part_job *job, ln_range_fn fn)
{
    const ptrdiff_t rows = ln_rows_of(job->extent), tasks = rows * job->chunks;
    const double elements = (double)rows * (double)job->extent->row_len;
    if (ln_threads_get() > 1 && elements >= LN_PARALLEL_MIN_ELEMENTS) {
        ln_parallel_for(tasks, LN_PARALLEL_MIN_ELEMENTS / 4 / LN_CHUNK, fn, job);
    }
    else {
        fn(job, 0, tasks);
    }
}

int ln_part_moments(const ln_part_moments_args *a)
{
    assert(a && 0 <= a->kind && a->kind < LN_NORM_KINDS && 0 <= a->dtype && a->dtype < LN_DTYPES);
    assert(ln_element_array_valid(&a->input, a->dtype) && a->m2.data && a->scale.data &&
           (a->kind == LN_NORM_LAYER || !a->mean.data));
    const ptrdiff_t rows = ln_rows_of(&a->extent);
    if (rows <= 0) {
        return 0;
    }
    if (a->extent.row_len == 0) {
        for (ptrdiff_t r = 0; r < rows; r++) {
            ln_store_part_moments(a, r, (ln_moments){0.0, 0.0}, 1.0);
        }
        return 0;
    }
    ln_part_job job = ln_part_job_of(a->kind, a->dtype, &a->extent);
    job.input = &a->input;
    job.chunk_moments = malloc((size_t)(rows * job.chunks) * sizeof(ln_moments));
    if (!job.chunk_moments) {
        return -1;
    }
    ln_part_run(&job, ln_part_moments_tasks);
    for (ptrdiff_t r = 0; r < rows; r++) {
        const ln_moments *chunks = job.chunk_moments + r * job.chunks;
        ln_moments m = chunks[0];
        for (ptrdiff_t c = 1; c < job.chunks; c++) {
            m = ln_merge(m, chunks[c]);
        }
        double scale = 1.0;
        if (!ln_moments_mergeable(a->dtype, m)) {
            m = ln_scaled_part_moments(a, r, m, &scale);
        }
        ln_store_part_moments(a, r, m, scale);
    }
    free(job.chunk_moments);
    return 0;
}

int ln_part_normalize(const ln_part_normalize_args *a)
{
    assert(a && 0 <= a->kind && a->kind < LN_NORM_KINDS && 0 <= a->dtype && a->dtype < LN_DTYPES);
    assert(ln_element_array_valid(&a->input, a->dtype) && ln_element_array_valid(&a->output, a->dtype));
    assert(a->rstd.data && a->row_len >= a->extent.row_len);
    assert(a->kind == LN_NORM_LAYER || (!a->bias && !a->mean.data));
    const ptrdiff_t rows = ln_rows_of(&a->extent), n = a->extent.row_len;
    if (rows <= 0 || n == 0) {
        return 0;
    }
    ln_part_job job = ln_part_job_of(a->kind, a->dtype, &a->extent);
    job.normalize = a;
    job.streams = ln_output_streams(a->dtype, &a->extent);
    /* the bounds of the part's parameters, and of the whole row's length (float32's x - mean) */
    const ln_forward_args part = {.kind = a->kind, .dtype = a->dtype, .extent = a->extent, .weight = a->weight,
                                  .bias = a->bias};
    const ln_forward_args row = {.kind = a->kind, .dtype = a->dtype,
                                 .extent = {.blocks = 1, .rows = 1, .row_len = a->row_len}};
    const ln_rstd_bounds of_part = ln_rstd_bounds_of_call(&part), of_row = ln_rstd_bounds_of_call(&row);
    job.bounds = (ln_rstd_bounds){fmax(of_part.low, of_row.low), fmin(of_part.high, of_row.high),
                                  fmax(of_part.tiny_mean, of_row.tiny_mean)};
    ln_part_run(&job, ln_part_normalize_tasks);
    return 0;
}

/* Row r's part's float64 g_sum and g_xhat_sum in sums[0 .. 2), as ln_backward_exact_row
   takes them. */
static void ln_part_grad_sums_exact(const ln_part_backward_args *a, ptrdiff_t r, double mean, double rstd,
                                    double sums[2])
{
    const ptrdiff_t dy_step = a->grad_output.walk.elem_step, x_step = a->input.walk.elem_step;
    const char *dy = ln_row_address(&a->grad_output, &a->extent, r);
    const char *x = ln_row_address(&a->input, &a->extent, r);
    sums[0] = sums[1] = 0.0;
    for (ptrdiff_t i = 0; i < a->extent.row_len; i++) {
        const double xhat = (ln_part_element(a->dtype, x, x_step, i) - mean) * rstd;
        const double w = a->weight ? ln_load1_param_as_f64(a->dtype, a->weight, i) : 1.0;
        const double g = ln_part_element(a->dtype, dy, dy_step, i) * w;
        sums[0] += g;
        sums[1] += g * xhat;
    }
}

/* Elements [start, start + len) of row r's dx in float64, rstd applied last (ln_exact.c),
   from the row's means of g and g * xhat; weight at column start. */
static void ln_part_grad_input_exact(const ln_part_backward_args *a, ptrdiff_t r, ptrdiff_t start, ptrdiff_t len,
                                     const ln_grad_rows *group, const void *weight)
{
    const ptrdiff_t dy_step = a->grad_output.walk.elem_step, x_step = a->input.walk.elem_step;
    const ptrdiff_t dx_step = a->grad_input.walk.elem_step;
    const char *dy = ln_row_address(&a->grad_output, &a->extent, r) + start * dy_step;
    const char *x = ln_row_address(&a->input, &a->extent, r) + start * x_step;
    char *dx = ln_row_address(&a->grad_input, &a->extent, r) + start * dx_step;
    const double mean = group->mean[0], rstd = group->rstd[0], g_mean = group->g_mean[0], gx_mean = group->gx_mean[0];
    for (ptrdiff_t i = 0; i < len; i++) {
        const double xhat = (ln_part_element(a->dtype, x, x_step, i) - mean) * rstd;
        const double w = weight ? ln_load1_param_as_f64(a->dtype, weight, i) : 1.0;
        const double g = ln_part_element(a->dtype, dy, dy_step, i) * w;
        const double value = ((g - g_mean) - xhat * gx_mean) * rstd;
        ln_store1_from_f64(a->dtype, dx + i * dx_step, 0, isnan(value) ? NAN : value);
    }
}

/* Tasks [begin, end): backward pass 1 over their chunks. */
static void ln_part_grad_sums_tasks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_part_job *job = ctx;
    const ln_part_backward_args *a = job->backward;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype), param_elsize = (ptrdiff_t)ln_param_size(a->dtype);
    const int adjacent = ln_elements_adjacent(&a->grad_output, a->dtype) && ln_elements_adjacent(&a->input, a->dtype);
    double dy_buffer[LN_CHUNK], x_buffer[LN_CHUNK];  /* a strided chunk's elements, adjacent */
    for (ptrdiff_t t = begin; t < end; t++) {
        ptrdiff_t r, start, len;
        ln_part_task(job, t, &r, &start, &len);
        const char *dy = ln_row_address(&a->grad_output, &a->extent, r) + start * a->grad_output.walk.elem_step;
        const char *x = ln_row_address(&a->input, &a->extent, r) + start * a->input.walk.elem_step;
        if (!adjacent) {
            ln_gather(dy, a->grad_output.walk.elem_step, elsize, 0, len, dy_buffer);
            ln_gather(x, a->input.walk.elem_step, elsize, 0, len, x_buffer);
            dy = (const char *)dy_buffer;
            x = (const char *)x_buffer;
        }
        job->kernels->grad_sums(dy, x, a->weight ? (const char *)a->weight + start * param_elsize : NULL, len,
                                ln_part_stat(&a->mean, &a->extent, r, 0.0), ln_part_stat(&a->rstd, &a->extent, r, 0.0),
                                job->chunk_sums + LN_GRAD_SUMS * t, job->chunk_sums + LN_GRAD_SUMS * t + 2, 0);
    }
}

/* Tasks [begin, end): their chunks' dx, one row a group. */
static void ln_part_grad_input_tasks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_part_job *job = ctx;
    const ln_part_backward_args *a = job->backward;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype), param_elsize = (ptrdiff_t)ln_param_size(a->dtype);
    const int adjacent = ln_elements_adjacent(&a->grad_output, a->dtype) && ln_elements_adjacent(&a->input, a->dtype) &&
                         ln_elements_adjacent(&a->grad_input, a->dtype);
    double dy_buffer[LN_CHUNK], x_buffer[LN_CHUNK], dx_buffer[LN_CHUNK];  /* a strided chunk's, adjacent */
    for (ptrdiff_t t = begin; t < end; t++) {
        ptrdiff_t r, start, len;
        ln_part_task(job, t, &r, &start, &len);
        ln_grad_rows group = {
            .count = 1,
            .stream_dx = adjacent && job->streams,
            .dy = {ln_row_address(&a->grad_output, &a->extent, r) + start * a->grad_output.walk.elem_step},
            .x = {ln_row_address(&a->input, &a->extent, r) + start * a->input.walk.elem_step},
            .dx = {ln_row_address(&a->grad_input, &a->extent, r) + start * a->grad_input.walk.elem_step},
            .mean = {ln_part_stat(&a->mean, &a->extent, r, 0.0)},
            .rstd = {ln_part_stat(&a->rstd, &a->extent, r, 0.0)},
            .g_mean = {ln_part_stat(&a->g, &a->extent, r, 0.0)},
            .gx_mean = {ln_part_stat(&a->g_xhat, &a->extent, r, 0.0)},
        };
        const void *weight = a->weight ? (const char *)a->weight + start * param_elsize : NULL;
        double largest[LN_LARGEST_COUNT];
        for (int i = 0; i < LN_LARGEST_COUNT; i++) {
            largest[i] = ln_part_stat(&a->largest[i], &a->extent, r, 0.0);
        }
        if (ln_grad_row_needs_exact(a->dtype, group.rstd[0], group.g_mean[0], group.gx_mean[0], largest)) {
            ln_part_grad_input_exact(a, r, start, len, &group, weight);
            continue;
        }
        char *const dx = group.dx[0];
        if (!adjacent) {
            ln_gather(group.dy[0], a->grad_output.walk.elem_step, elsize, 0, len, dy_buffer);
            ln_gather(group.x[0], a->input.walk.elem_step, elsize, 0, len, x_buffer);
            group.dy[0] = (const char *)dy_buffer;
            group.x[0] = (const char *)x_buffer;
            group.dx[0] = (char *)dx_buffer;
        }
        job->kernels->grad_apply(&group, weight, len, NULL, NULL);
        if (!adjacent) {
            ln_scatter(dx_buffer, elsize, 0, len, dx, a->grad_input.walk.elem_step);
        }
    }
#if defined(__x86_64__)
    if (adjacent && job->streams) {
        _mm_sfence();  /* the non-temporal stores are weakly ordered: finish them first */
    }
#endif
}

#ifndef NDEBUG
/* Debug builds' check of what ln_kernels.h promises of a part backward's arguments. */
static inline int ln_part_backward_args_valid(const ln_part_backward_args *a)
{
    return 0 <= a->kind && a->kind < LN_NORM_KINDS && 0 <= a->dtype && a->dtype < LN_DTYPES &&
           ln_element_array_valid(&a->grad_output, a->dtype) && ln_element_array_valid(&a->input, a->dtype) &&
           ln_element_array_valid(&a->grad_input, a->dtype) && a->rstd.data && a->g_xhat.data &&
           a->largest[LN_LARGEST_G].data && a->largest[LN_LARGEST_DY].data && a->largest[LN_LARGEST_XC].data &&
           (a->kind == LN_NORM_RMS ? !a->mean.data && !a->g.data : a->mean.data && a->g.data);
}
#endif

int ln_part_grad_sums(const ln_part_backward_args *a)
{
    assert(a && ln_part_backward_args_valid(a));
    const ptrdiff_t rows = ln_rows_of(&a->extent);
    if (rows <= 0) {
        return 0;
    }
    ln_part_job job = ln_part_job_of(a->kind, a->dtype, &a->extent);
    job.backward = a;
    job.chunk_sums = malloc((size_t)(LN_GRAD_SUMS * rows * job.chunks + 1) * sizeof(double));
    if (!job.chunk_sums) {
        return -1;
    }
    ln_part_run(&job, ln_part_grad_sums_tasks);
    for (ptrdiff_t r = 0; r < rows; r++) {
        double sums[2] = {0.0, 0.0}, largest[LN_LARGEST_COUNT] = {0.0};  /* g_sum, g_xhat_sum */
        for (ptrdiff_t c = 0; c < job.chunks; c++) {
            const double *chunk = job.chunk_sums + LN_GRAD_SUMS * (r * job.chunks + c);
            sums[0] += chunk[0];
            sums[1] += chunk[1];
            for (int i = 0; i < LN_LARGEST_COUNT; i++) {
                largest[i] = chunk[2 + i] > largest[i] ? chunk[2 + i] : largest[i];
            }
        }
        /* where the kernels' products overflowed or came near the subnormals or the largest
           finite value, or rstd leaves their range; the row's means are not known yet, so
           bounds of this part's terms stand in for them (|g| <= max |g|, |g * xhat| <= max |g|
           max |xc| rstd): a part whose own terms could send grad_input to float64 has float64
           sums (where rstd * g cancels most of grad_input, float32 sums would not carry the
           rest).  A part whose sums are not finite (NaN or Inf in it) reports Inf as its
           largest magnitudes, whatever its level's maxima made of the NaN. */
        const double rstd = ln_part_stat(&a->rstd, &a->extent, r, 0.0);
        const double g_bound = largest[LN_LARGEST_G], gx_bound = g_bound * largest[LN_LARGEST_XC] * rstd;
        const int finite = isfinite(sums[0]) && isfinite(sums[1]);
        for (int i = 0; !finite && i < LN_LARGEST_COUNT; i++) {
            largest[i] = INFINITY;
        }
        if (!finite ||
            ln_grad_row_needs_exact(a->dtype, rstd, a->kind == LN_NORM_LAYER ? g_bound : 0.0, gx_bound, largest)) {
            ln_part_grad_sums_exact(a, r, ln_part_stat(&a->mean, &a->extent, r, 0.0), rstd, sums);
        }
        if (a->g.data) {
            *(double *)ln_row_address(&a->g, &a->extent, r) = sums[0];
        }
        *(double *)ln_row_address(&a->g_xhat, &a->extent, r) = sums[1];
        for (int i = 0; i < LN_LARGEST_COUNT; i++) {
            *(double *)ln_row_address(&a->largest[i], &a->extent, r) = largest[i];
        }
    }
    free(job.chunk_sums);
    return 0;
}

int ln_part_grad_input(const ln_part_backward_args *a)
{
    assert(a && ln_part_backward_args_valid(a) && a->grad_input.data);
    if (ln_rows_of(&a->extent) <= 0 || a->extent.row_len == 0) {
        return 0;
    }
    ln_part_job job = ln_part_job_of(a->kind, a->dtype, &a->extent);
    job.backward = a;
    job.streams = ln_dx_streams(a->dtype, &a->extent, &a->grad_input);
    ln_part_run(&job, ln_part_grad_input_tasks);
    return 0;
}
