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
    double *chunk_sums;                  /* grad sums: rows x chunks x [sum g, sum g * xhat] */
    int streams;                         /* normalize, grad_input: output by non-temporal stores */
} ln_part_job;

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
            job->chunk_moments[t] = job->kernels->chunk_moments(x + start * elsize, len);
        }
        else {
            ln_gather(x, step, elsize, start, len, buffer);
            job->chunk_moments[t] = job->kernels->chunk_moments(buffer, len);
        }
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
        const double mean = a->mean.data ? *(const double *)ln_row_address(&a->mean, &a->extent, r) : 0.0;
        const double rstd = *(const double *)ln_row_address(&a->rstd, &a->extent, r);
        const void *weight = a->weight ? (const char *)a->weight + start * param_elsize : NULL;
        const void *bias = a->bias ? (const char *)a->bias + start * param_elsize : NULL;
        const char *x = ln_row_address(&a->input, &a->extent, r);
        char *y = ln_row_address(&a->output, &a->extent, r);
        if (adjacent) {
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

/* Row r's moments out (mean where wanted: it is absent for RMSNorm). */
static void ln_store_part_moments(const ln_part_moments_args *a, ptrdiff_t r, double mean, double m2)
{
    if (a->mean.data) {
        *(double *)ln_row_address(&a->mean, &a->extent, r) = mean;
    }
    *(double *)ln_row_address(&a->m2, &a->extent, r) = m2;
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
    assert(ln_element_array_valid(&a->input, a->dtype) && a->m2.data && (a->kind == LN_NORM_LAYER || !a->mean.data));
    const ptrdiff_t rows = ln_rows_of(&a->extent), n = a->extent.row_len;
    if (rows <= 0) {
        return 0;
    }
    if (n == 0) {
        for (ptrdiff_t r = 0; r < rows; r++) {
            ln_store_part_moments(a, r, 0.0, 0.0);
        }
        return 0;
    }
    ln_part_job job = {
        .dtype = a->dtype,
        .extent = &a->extent,
        .input = &a->input,
        .kernels = &ln_kernels_in_use()->by_dtype[a->dtype].by_kind[a->kind],
        .chunks = (n + LN_CHUNK - 1) / LN_CHUNK,
    };
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
        ln_store_part_moments(a, r, m.mean, m.m2);
    }
    free(job.chunk_moments);
    return 0;
}

int ln_part_normalize(const ln_part_normalize_args *a)
{
    assert(a && 0 <= a->kind && a->kind < LN_NORM_KINDS && 0 <= a->dtype && a->dtype < LN_DTYPES);
    assert(ln_element_array_valid(&a->input, a->dtype) && ln_element_array_valid(&a->output, a->dtype));
    assert(a->rstd.data && (a->kind == LN_NORM_LAYER || (!a->bias && !a->mean.data)));
    const ptrdiff_t rows = ln_rows_of(&a->extent), n = a->extent.row_len;
    if (rows <= 0 || n == 0) {
        return 0;
    }
    ln_part_job job = {
        .dtype = a->dtype,
        .extent = &a->extent,
        .kernels = &ln_kernels_in_use()->by_dtype[a->dtype].by_kind[a->kind],
        .chunks = (n + LN_CHUNK - 1) / LN_CHUNK,
        .normalize = a,
        .streams = ln_output_streams(a->dtype, &a->extent),
    };
    ln_part_run(&job, ln_part_normalize_tasks);
    return 0;
}

/* A per-row float64 statistic, or `absent` when its array is. */
static double ln_part_stat(const ln_array *stat, const ln_extent *extent, ptrdiff_t r, double absent)
{
    return stat->data ? *(const double *)ln_row_address(stat, extent, r) : absent;
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
                                job->chunk_sums + 2 * t, NULL);
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
        char *const dx = group.dx[0];
        if (!adjacent) {
            ln_gather(group.dy[0], a->grad_output.walk.elem_step, elsize, 0, len, dy_buffer);
            ln_gather(group.x[0], a->input.walk.elem_step, elsize, 0, len, x_buffer);
            group.dy[0] = (const char *)dy_buffer;
            group.x[0] = (const char *)x_buffer;
            group.dx[0] = (char *)dx_buffer;
        }
        job->kernels->grad_apply(&group, a->weight ? (const char *)a->weight + start * param_elsize : NULL, len, NULL,
                                 NULL);
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

/* Debug builds' check of what ln_kernels.h promises of a part backward's arguments. */
static inline int ln_part_backward_args_valid(const ln_part_backward_args *a)
{
    return 0 <= a->kind && a->kind < LN_NORM_KINDS && 0 <= a->dtype && a->dtype < LN_DTYPES &&
           ln_element_array_valid(&a->grad_output, a->dtype) && ln_element_array_valid(&a->input, a->dtype) &&
           ln_element_array_valid(&a->grad_input, a->dtype) && a->rstd.data && a->g_xhat.data &&
           (a->kind == LN_NORM_RMS ? !a->mean.data && !a->g.data : a->mean.data && a->g.data);
}

int ln_part_grad_sums(const ln_part_backward_args *a)
{
    assert(a && ln_part_backward_args_valid(a));
    const ptrdiff_t rows = ln_rows_of(&a->extent), n = a->extent.row_len;
    ln_part_job job = {
        .dtype = a->dtype,
        .extent = &a->extent,
        .kernels = &ln_kernels_in_use()->by_dtype[a->dtype].by_kind[a->kind],
        .chunks = (n + LN_CHUNK - 1) / LN_CHUNK,
        .backward = a,
    };
    if (rows <= 0) {
        return 0;
    }
    job.chunk_sums = malloc((size_t)(2 * rows * job.chunks + 1) * sizeof(double));
    if (!job.chunk_sums) {
        return -1;
    }
    ln_part_run(&job, ln_part_grad_sums_tasks);
    for (ptrdiff_t r = 0; r < rows; r++) {
        double g_sum = 0.0, g_xhat_sum = 0.0;
        for (ptrdiff_t c = 0; c < job.chunks; c++) {
            g_sum += job.chunk_sums[2 * (r * job.chunks + c)];
            g_xhat_sum += job.chunk_sums[2 * (r * job.chunks + c) + 1];
        }
        if (a->g.data) {
            *(double *)ln_row_address(&a->g, &a->extent, r) = g_sum;
        }
        *(double *)ln_row_address(&a->g_xhat, &a->extent, r) = g_xhat_sum;
    }
    free(job.chunk_sums);
    return 0;
}

int ln_part_grad_input(const ln_part_backward_args *a)
{
    assert(a && ln_part_backward_args_valid(a) && a->grad_input.data);
    const ptrdiff_t n = a->extent.row_len;
    ln_part_job job = {
        .dtype = a->dtype,
        .extent = &a->extent,
        .kernels = &ln_kernels_in_use()->by_dtype[a->dtype].by_kind[a->kind],
        .chunks = (n + LN_CHUNK - 1) / LN_CHUNK,
        .backward = a,
        .streams = ln_dx_streams(a->dtype, &a->extent, &a->grad_input),
    };
    if (ln_rows_of(&a->extent) > 0 && n > 0) {
        ln_part_run(&job, ln_part_grad_input_tasks);
    }
    return 0;
}
