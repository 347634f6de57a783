/*
 * ln_forward.c -- the forward driver: splits a call into row ranges (contiguous route) or
 * tiles (strided route) across the threads, or a few huge rows into chunks (across the threads
 * where there are several), and runs the level's kernels on them.
 *
 * With a residual, the rows normalized are `sum`'s, so the route is chosen by sum's and the
 * output's walks alone: a call with a residual gives what a call on its sum gives, bit for
 * bit.  On the contiguous route, input and residual with adjacent elements are summed and
 * normalized in one pass (forward_sum_rows); otherwise the residual is summed into `sum` a few
 * rows at a time, and those rows are then normalized from `sum` by the ordinary row kernels.
 * A copy of the input is written by the row kernels themselves where the pipelined loop runs
 * (ln_copies_in_rows: each row copied as its statistics are gathered); elsewhere it is made
 * the staged way too: rows copied a few at a time and normalized from the copy while they are
 * in cache; a large copy is written with non-temporal stores instead, and its rows normalized
 * from the input, which copying them brought into cache.
 */
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "ln_internal.h"

typedef struct {
    const ln_forward_args *args;
    const ln_dtype_kernels *dtype_kernels;  /* the level in use, for args->dtype */
    const ln_row_kernels *kernels;          /* ... and args->kind */
    ln_forward_args of_staged;              /* with a residual or a copy: args normalizing `sum`
                                               or `copy`, where the rows are staged */
    ptrdiff_t staged_rows;                  /* ... rows staged at a time */
    int stream_copy;                        /* the copy by non-temporal stores (see
                                               LN_STREAM_COPY_MIN_BYTES) */
    int fused;                              /* with a residual: by forward_sum_rows, unstaged */
    ptrdiff_t read_ahead;                   /* how the statistics read the input (huge rows:
                                               row_x) ahead (ln_read_ahead) */
    /* for a few huge rows, each split into chunks (ln_forward_huge_rows): */
    const char *row_x, *row_residual;       /* the row's input and residual (or NULL) */
    char *row_sum;                          /* ... and its sum (or NULL) */
    const char *row_in;                     /* the row normalized: row_sum, or row_x */
    char *row_out;
    ln_moments *chunk_moments;              /* one per LN_CHUNK-element chunk of the row */
    double mean, rstd;
    ln_rstd_bounds bounds;                  /* the call's, from its weight and bias (huge rows:
                                               once the first row's scan has learnt them) */
    ln_span_scan *scanned;                  /* huge rows, the bounds not known yet: each normalize
                                               task's scan, at its first chunk (else NULL) */
} ln_forward_job;

#ifndef NDEBUG
/* Debug builds' check of what ln_kernels.h promises the kernels. */
static inline int ln_forward_args_valid(const ln_forward_args *a)
{
    const ln_extent *e = &a->extent;
    const int has_work = e->blocks > 0 && e->rows > 0 && e->row_len > 0;
    return 0 <= a->kind && a->kind < LN_NORM_KINDS && 0 <= a->dtype && a->dtype < LN_DTYPES &&
           e->blocks >= 0 && e->rows >= 0 && e->row_len >= 0 &&
           (!has_work || (a->input.data && a->output.data)) &&
           (a->residual.data != NULL) == (a->sum.data != NULL) && !(a->residual.data && a->copy.data) &&
           (a->kind == LN_NORM_LAYER || (!a->bias && !a->mean.data)) &&
           ln_element_array_valid(&a->input, a->dtype) && ln_element_array_valid(&a->residual, a->dtype) &&
           ln_element_array_valid(&a->sum, a->dtype) && ln_element_array_valid(&a->output, a->dtype) &&
           ln_element_array_valid(&a->copy, a->dtype) &&
           ln_stat_array_valid(&a->mean, a->dtype, e) && ln_stat_array_valid(&a->rstd, a->dtype, e);
}
#endif

/* Whether the copy goes by ln_stream_copy_row: large, both rows' elements adjacent, and the
   copy's rows whole 16-byte units from 16-byte aligned starts. */
static int ln_copy_streams(const ln_forward_args *a)
{
#if defined(__x86_64__)
    const ptrdiff_t row_bytes = a->extent.row_len * (ptrdiff_t)ln_dtype_size(a->dtype);
    return a->copy.data && ln_elements_adjacent(&a->input, a->dtype) && ln_elements_adjacent(&a->copy, a->dtype) &&
           row_bytes % 16 == 0 && ln_rows_aligned(&a->copy, &a->extent, 16) &&
           (double)row_bytes * (double)ln_rows_of(&a->extent) >= (double)LN_STREAM_COPY_MIN_BYTES;
#else
    (void)a;
    return 0;
#endif
}

/* Row r of the input copied to a->copy by non-temporal stores (ln_copy_streams holds, so
   only where there are such stores). */
static void ln_stream_copy_row(const ln_forward_args *a, ptrdiff_t r)
{
#if defined(__x86_64__)
    const char *x = ln_row_address(&a->input, &a->extent, r);
    char *copy = ln_row_address(&a->copy, &a->extent, r);
    const ptrdiff_t row_bytes = a->extent.row_len * (ptrdiff_t)ln_dtype_size(a->dtype);
    for (ptrdiff_t i = 0; i < row_bytes; i += 16) {
        _mm_stream_si128((__m128i *)(copy + i), _mm_loadu_si128((const __m128i *)(x + i)));
    }
#else
    (void)a;
    (void)r;
    assert(0);
#endif
}

/* Row r of the input copied to a->copy. */
static void ln_copy_row(const ln_forward_args *a, ptrdiff_t r)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype);
    const char *x = ln_row_address(&a->input, &a->extent, r);
    char *copy = ln_row_address(&a->copy, &a->extent, r);
    if (a->input.walk.elem_step == elsize && a->copy.walk.elem_step == elsize) {
        memcpy(copy, x, (size_t)(a->extent.row_len * elsize));
        return;
    }
    for (ptrdiff_t j = 0; j < a->extent.row_len; j++) {
        memcpy(copy + j * a->copy.walk.elem_step, x + j * a->input.walk.elem_step, (size_t)elsize);
    }
}

/* Rows [begin, end) of the input copied to a->copy: by one memcpy where they lie one after
   another in both (short rows, a training-mode call: 32768x8 float32 copied row by row took
   longer than normalizing it). */
static void ln_copy_rows(const ln_forward_args *a, ptrdiff_t begin, ptrdiff_t end)
{
    if (begin >= end) {
        return;
    }
    const ptrdiff_t row_bytes = a->extent.row_len * (ptrdiff_t)ln_dtype_size(a->dtype);
    if (ln_elements_adjacent(&a->input, a->dtype) && ln_elements_adjacent(&a->copy, a->dtype) &&
        ln_rows_consecutive(&a->input, &a->extent, begin, end, row_bytes) &&
        ln_rows_consecutive(&a->copy, &a->extent, begin, end, row_bytes)) {
        memcpy(ln_row_address(&a->copy, &a->extent, begin), ln_row_address(&a->input, &a->extent, begin),
               (size_t)((end - begin) * row_bytes));
        return;
    }
    for (ptrdiff_t r = begin; r < end; r++) {
        ln_copy_row(a, r);
    }
}

static void ln_forward_copy_rows(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    ln_copy_rows(job->args, begin, end);
}

/* Rows [begin, end) by the row kernels; with a residual or a copy that they do not make
   (ln_copies_in_rows), rows first staged in `sum` (summed) or `copy` (copied), staged_rows at
   a time, and normalized from there while they are in cache (a streamed copy: from the
   input, in cache from being copied). */
static void ln_forward_rows(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    const ln_forward_args *a = job->args;
    if (!a->residual.data && (!a->copy.data || ln_copies_in_rows(a))) {
        job->kernels->forward_rows(a, &job->bounds, begin, end, job->read_ahead);
        return;
    }
    if (job->fused) {
        job->kernels->forward_sum_rows(a, &job->bounds, begin, end);
        return;
    }
    for (ptrdiff_t first = begin; first < end; first += job->staged_rows) {
        const ptrdiff_t last = end - first < job->staged_rows ? end : first + job->staged_rows;
        if (job->stream_copy) {
            for (ptrdiff_t r = first; r < last; r++) {
                ln_stream_copy_row(a, r);
            }
        }
        else if (a->copy.data) {
            ln_copy_rows(a, first, last);
        }
        else {
            for (ptrdiff_t r = first; r < last; r++) {
                job->dtype_kernels->add_row(ln_row_address(&a->input, &a->extent, r), a->input.walk.elem_step,
                                            ln_row_address(&a->residual, &a->extent, r), a->residual.walk.elem_step,
                                            ln_row_address(&a->sum, &a->extent, r), a->extent.row_len);
            }
        }
        /* no reading ahead: the staged rows were just written (or read), a few at a time */
        job->kernels->forward_rows(&job->of_staged, &job->bounds, first, last, 0);
    }
#if defined(__x86_64__)
    if (job->stream_copy) {
        _mm_sfence();  /* the non-temporal stores are weakly ordered: finish them first */
    }
#endif
}

/* Tiles [begin, end) of the strided route (which sums a residual itself). */
static void ln_forward_tiles(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    job->kernels->forward_tiles(job->args, &job->bounds, begin, end);
}

/* Tasks [begin, end): those chunks of the huge row summed (with a residual), and their
   moments. */
static void ln_forward_huge_row_moments(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    ln_forward_job *job = ctx;
    const ln_forward_args *a = job->args;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype);
    for (ptrdiff_t c = begin; c < end; c++) {
        const ptrdiff_t start = c * LN_CHUNK;
        const ptrdiff_t len = a->extent.row_len - start < LN_CHUNK ? a->extent.row_len - start : LN_CHUNK;
        if (job->row_sum) {
            job->dtype_kernels->add_row(job->row_x + start * a->input.walk.elem_step, a->input.walk.elem_step,
                                        job->row_residual + start * a->residual.walk.elem_step,
                                        a->residual.walk.elem_step, job->row_sum + start * elsize, len);
        }
        job->chunk_moments[c] = job->kernels->chunk_moments(job->row_in + start * elsize, len, job->read_ahead);
    }
}

/* Tasks [begin, end): those chunks of the huge row normalized (and, while the bounds are
   not known, their weight and bias scanned as they go). */
static void ln_forward_huge_row_normalize(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    const ln_forward_args *a = job->args;
    const ptrdiff_t stop = end * LN_CHUNK < a->extent.row_len ? end * LN_CHUNK : a->extent.row_len;
    const void *bias = a->kind == LN_NORM_LAYER ? a->bias : NULL;  /* the scan's: RMSNorm has none */
    ln_normalize_spans_backwards(ln_forward_streams(a) ? job->kernels->normalize_row_streaming
                                                       : job->kernels->normalize_row,
                                 a->dtype, job->row_in, job->row_out, begin * LN_CHUNK, stop, job->mean,
                                 job->rstd, a->weight, bias, job->scanned ? job->scanned + begin : NULL);
}

/* Whether normalizing row r of `source` into the output leaves its elements as they were
   (the row's output is elsewhere: not an in-place call), so that a row found to need
   ln_forward_exact_row afterwards can still take it.  Rows of adjacent elements. */
static int ln_row_survives_output(const ln_forward_args *a, const ln_array *source, ptrdiff_t r)
{
    const ptrdiff_t bytes = a->extent.row_len * (ptrdiff_t)ln_dtype_size(a->dtype);
    const uintptr_t in = (uintptr_t)ln_row_address(source, &a->extent, r);
    const uintptr_t out = (uintptr_t)ln_row_address(&a->output, &a->extent, r);
    return out + (uintptr_t)bytes <= in || in + (uintptr_t)bytes <= out;
}

/* A few huge rows, each split into its chunks (across the threads where the call is
   parallel): the chunks' moments, merged in order, then the chunks normalized.  Where the
   call's first row survives its output, the rstd bounds are not taken before it: its
   normalize scans the weight and bias span by span as it reads them (so a call of one row
   reads them once, not twice), and the row goes again by ln_forward_exact_row if its rstd
   turns out to be outside the bounds, which the rows after it know beforehand. */
static int ln_forward_huge_rows(ln_forward_job *job, int parallel)
{
    const ln_forward_args *a = job->args;
    const ptrdiff_t rows = ln_rows_of(&a->extent), n = a->extent.row_len;
    const ptrdiff_t chunks = (n + LN_CHUNK - 1) / LN_CHUNK;
    const ln_array *source = a->sum.data ? &a->sum : &a->input;
    assert(rows >= 1);
    job->chunk_moments = malloc((size_t)chunks * sizeof(ln_moments));
    if (!job->chunk_moments) {
        return -1;
    }
    /* without memory for the scan, the bounds first */
    ln_span_scan *scanned = ln_row_survives_output(a, source, 0) ? malloc((size_t)chunks * sizeof *scanned) : NULL;
    if (!scanned) {
        job->bounds = ln_rstd_bounds_of_call(a);
    }
    /* the bounds of no weight and bias, which every call's lie within */
    const ln_rstd_bounds widest = ln_rstd_bounds_of(a->dtype, n, ln_magnitudes_without_params());
    for (ptrdiff_t r = 0; r < rows; r++) {
        job->row_x = ln_row_address(&a->input, &a->extent, r);
        job->row_residual = a->residual.data ? ln_row_address(&a->residual, &a->extent, r) : NULL;
        job->row_sum = a->sum.data ? ln_row_address(&a->sum, &a->extent, r) : NULL;
        job->row_in = job->row_sum ? job->row_sum : job->row_x;
        job->row_out = ln_row_address(&a->output, &a->extent, r);
        ln_run(parallel, chunks, 4, ln_forward_huge_row_moments, job);
        ln_moments m = job->chunk_moments[0];
        for (ptrdiff_t c = 1; c < chunks; c++) {
            m = ln_merge(m, job->chunk_moments[c]);
        }
        job->mean = m.mean;
        job->rstd = ln_rstd_of(m, a->eps);
        if (scanned && ln_row_needs_exact(job->mean, job->rstd, &widest)) {
            /* outside every call's bounds: the row goes by the exact path whatever the weight
               and bias, and the normalize's float32 constants could not even hold its rstd */
            job->bounds = ln_rstd_bounds_of_call(a);
            free(scanned);
            scanned = NULL;
        }
        if (!scanned && ln_row_needs_exact(job->mean, job->rstd, &job->bounds)) {
            ln_forward_exact_row(a, source, r);
            continue;
        }
        ln_store_stats(a, r, job->mean, job->rstd);
        if (scanned) {
            for (ptrdiff_t c = 0; c < chunks; c++) {
                scanned[c] = (ln_span_scan){job->dtype_kernels->param_magnitudes, a->dtype, n,
                                            ln_no_param_magnitudes(), 1};
            }
            job->scanned = scanned;
        }
        ln_run(parallel, chunks, 4, ln_forward_huge_row_normalize, job);
        if (scanned) {
            ln_param_magnitudes params = scanned[0].seen;
            int complete = scanned[0].complete;
            for (ptrdiff_t c = 1; c < chunks; c++) {
                params = ln_merge_param_magnitudes(params, scanned[c].seen);
                complete &= scanned[c].complete;
            }
            job->bounds = ln_rstd_bounds_of(a->dtype, n, params);
            job->scanned = NULL;
            free(scanned);
            scanned = NULL;
            if (ln_row_needs_exact(job->mean, job->rstd, &job->bounds)) {
                ln_forward_exact_row(a, source, r);
            }
            else if (!complete) {
                /* a span whose own weights did not allow the rstd that the whole row's do (one
                   whose weights are all below the normal range): the row by the bounds */
                ln_run(parallel, chunks, 4, ln_forward_huge_row_normalize, job);
            }
        }
    }
    free(scanned);
    free(job->chunk_moments);
    return 0;
}

int ln_forward(const ln_forward_args *a)
{
    assert(a && ln_forward_args_valid(a));
    const ln_dtype_kernels *dtype_kernels = ln_dtype_kernels_in_use(a->dtype);
    ln_forward_job job = {.args = a, .dtype_kernels = dtype_kernels, .kernels = &dtype_kernels->by_kind[a->kind]};
    const ptrdiff_t rows = ln_rows_of(&a->extent), n = a->extent.row_len;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype);
    if (rows <= 0) {
        return 0;
    }
    if (n == 0) {
        for (ptrdiff_t r = 0; r < rows; r++) {
            ln_store_stats(a, r, 0.0, NAN);  /* torch: mean 0, rstd NaN */
        }
        return 0;
    }
    const int threads = ln_threads_get();
    const int parallel = threads > 1 && (double)rows * (double)n >= LN_PARALLEL_MIN_ELEMENTS;
    const ptrdiff_t min_rows = LN_PARALLEL_MIN_ELEMENTS / 4 / n;
    const ln_array *normalized = a->residual.data ? &a->sum : a->copy.data ? &a->copy : &a->input;
    const int contiguous = ln_elements_adjacent(normalized, a->dtype) && ln_elements_adjacent(&a->output, a->dtype);
    /* one thread takes a residual or a copy with its rows (forward_sum_rows, ln_copies_in_rows),
       and pipelines rows that stay in cache where there are several (3x20000 float32: 7.7 us
       pipelined, 8.6 us here) */
    const int huge_rows = n >= LN_SPLIT_ROW_MIN && rows < 4 * (ptrdiff_t)threads &&
                          (parallel || (!a->residual.data && !a->copy.data && (rows == 1 || !ln_rows_pipelined(a))));
    if (a->copy.data && (!contiguous || huge_rows)) {
        /* routes that do not stage rows: the copy made first, then normalized */
        ln_run(parallel, rows, min_rows > 1 ? min_rows : 1, ln_forward_copy_rows, &job);
        ln_forward_args of_copy = *a;
        of_copy.input = a->copy;
        of_copy.copy = (ln_array){0};
        return ln_forward(&of_copy);
    }
    /* a page ahead where one thread takes the call; a sum (huge rows) is read just after it
       is written, from cache */
    job.read_ahead = a->sum.data ? 0 : ln_read_ahead(a, &a->input, !parallel);
    if (contiguous && huge_rows) {
        return ln_forward_huge_rows(&job, parallel);
    }
    job.bounds = ln_rstd_bounds_of_call(a);
    if (!contiguous) {
        const ptrdiff_t tiles = ln_tiles_of(&a->extent), min_tiles = min_rows / LN_TILE_ROWS;
        ln_run(parallel, tiles, min_tiles > 1 ? min_tiles : 1, ln_forward_tiles, &job);
        return 0;
    }
    if (a->residual.data || a->copy.data) {
        job.of_staged = *a;
        job.stream_copy = ln_copy_streams(a);
        job.of_staged.input = job.stream_copy ? a->input : *normalized;
        job.of_staged.residual = job.of_staged.sum = job.of_staged.copy = (ln_array){0};
        job.staged_rows = LN_SUM_BATCH_BYTES / (n * elsize);
        job.staged_rows = job.staged_rows > 1 ? job.staged_rows : 1;
        job.fused = a->residual.data && n >= 16 && ln_elements_adjacent(&a->input, a->dtype) &&
                    ln_elements_adjacent(&a->residual, a->dtype);
    }
    ln_run(parallel, rows, min_rows > 1 ? min_rows : 1, ln_forward_rows, &job);
    return 0;
}
