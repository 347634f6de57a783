/*
 * ln_forward.c -- the forward driver: splits a call into row ranges, or a few huge rows
 * into chunks, across the threads, and runs the level's row kernels on them.
 */
#include <stdlib.h>

#include "ln_internal.h"

typedef struct {
    const ln_forward_args *args;
    const ln_dtype_kernels *kernels;  /* the level in use, for args->dtype */
    /* for one huge row split across threads: */
    const char *row_in;
    char *row_out;
    ln_moments *chunk_moments;        /* one per LN_CHUNK-element chunk of the row */
    double mean, rstd;
} ln_forward_job;

static void ln_forward_rows(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    job->kernels->forward_rows(job->args, begin, end);
}

/* Tasks [begin, end): the moments of those chunks of the huge row. */
static void ln_forward_huge_row_moments(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    ln_forward_job *job = ctx;
    const ln_forward_args *a = job->args;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype);
    for (ptrdiff_t c = begin; c < end; c++) {
        const ptrdiff_t start = c * LN_CHUNK;
        const ptrdiff_t len = a->row_len - start < LN_CHUNK ? a->row_len - start : LN_CHUNK;
        job->chunk_moments[c] = job->kernels->chunk_moments(job->row_in + start * elsize, len);
    }
}

/* Tasks [begin, end): those chunks of the huge row normalized. */
static void ln_forward_huge_row_normalize(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    const ln_forward_args *a = job->args;
    const ptrdiff_t stop = end * LN_CHUNK < a->row_len ? end * LN_CHUNK : a->row_len;
    ln_normalize_spans_backwards(ln_forward_streams(a) ? job->kernels->normalize_row_streaming
                                                       : job->kernels->normalize_row,
                                 a->dtype, job->row_in, job->row_out, begin * LN_CHUNK, stop, job->mean,
                                 job->rstd, a->weight, a->bias);
}

int ln_forward(const ln_forward_args *a)
{
    assert(a && 0 <= a->dtype && a->dtype < LN_DTYPES && a->row_len >= 0);
    assert(a->rows <= 0 || a->row_len == 0 || (a->input && a->output));
    ln_forward_job job = {.args = a, .kernels = &ln_kernels_in_use()->by_dtype[a->dtype]};
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype);
    if (a->rows <= 0) {
        return 0;
    }
    if (a->row_len == 0) {
        for (ptrdiff_t r = 0; r < a->rows; r++) {
            ln_store_stats(a, r, 0.0, NAN);  /* torch: mean 0, rstd NaN */
        }
        return 0;
    }
    const int threads = ln_threads_get();
    const double elements = (double)a->rows * (double)a->row_len;
    if (threads <= 1 || elements < LN_PARALLEL_MIN_ELEMENTS) {
        ln_forward_rows(&job, 0, a->rows);
        return 0;
    }
    if (a->row_len < LN_SPLIT_ROW_MIN || a->rows >= 4 * (ptrdiff_t)threads) {
        const ptrdiff_t min_rows = LN_PARALLEL_MIN_ELEMENTS / 4 / a->row_len;
        ln_parallel_for(a->rows, min_rows > 1 ? min_rows : 1, ln_forward_rows, &job);
        return 0;
    }
    /* A few huge rows: split each row into its chunks across the threads. */
    const ptrdiff_t chunks = (a->row_len + LN_CHUNK - 1) / LN_CHUNK;
    job.chunk_moments = malloc((size_t)chunks * sizeof(ln_moments));
    if (!job.chunk_moments) {
        return -1;
    }
    for (ptrdiff_t r = 0; r < a->rows; r++) {
        job.row_in = (const char *)a->input + r * a->input_row_step * elsize;
        job.row_out = (char *)a->output + r * a->row_len * elsize;
        ln_parallel_for(chunks, 4, ln_forward_huge_row_moments, &job);
        ln_moments m = job.chunk_moments[0];
        for (ptrdiff_t c = 1; c < chunks; c++) {
            m = ln_merge(m, job.chunk_moments[c]);
        }
        job.mean = m.mean;
        job.rstd = ln_rstd_of(m, a->eps);
        ln_store_stats(a, r, job.mean, job.rstd);
        ln_parallel_for(chunks, 4, ln_forward_huge_row_normalize, &job);
    }
    free(job.chunk_moments);
    return 0;
}
