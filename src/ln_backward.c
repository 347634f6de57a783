/*
 * ln_backward.c -- the backward driver: splits a call into row blocks, or a few huge rows
 * into column spans, across the threads, runs the level's row kernels on them and adds
 * up the parameter gradients.
 */
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "ln_internal.h"

/* n float64 sums out as parameters (float32, or float64 for float64 data); p may be NULL. */
static void ln_store_params(ln_dtype dtype, void *p, const double *sums, ptrdiff_t n)
{
    if (!p) {
        return;
    }
    if (dtype == LN_F64) {
        memcpy(p, sums, (size_t)n * sizeof(double));
        return;
    }
    for (ptrdiff_t i = 0; i < n; i++) {
        ((float *)p)[i] = (float)sums[i];
    }
}

/*
 * Two ways through, chosen by the shape alone, so the thread count never changes a bit:
 *
 * Row blocks (the usual case).  The rows are cut into a number of contiguous blocks
 * fixed by the shape, one task each.  A task makes both passes over each row of its
 * block while the row is in cache, adding the row's dy * xhat and dy into its block's
 * own float64 partial sums; the partials are then added in block order.  So dx and
 * the parameter gradients cost one read of dy and x.
 *
 * Column spans (a few huge rows).  Pass 1 runs over LN_CHUNK-element spans of every
 * row in parallel and each row's span sums are added in order; pass 2 runs over column
 * spans in parallel, each walking all rows top to bottom, so each column of dweight
 * and dbias is summed by one task, in row order.
 */

typedef struct {
    const ln_backward_args *args;
    const ln_dtype_kernels *kernels;  /* the level in use, for args->dtype */
    ptrdiff_t elsize;        /* bytes per element of dy, x, dx */
    ptrdiff_t param_elsize;  /* bytes per weight, mean and rstd */
    ptrdiff_t blocks;        /* row blocks */
    ptrdiff_t spans;         /* LN_CHUNK-column spans per row */
    double *dparams;         /* blocks x [dweight (row_len), dbias (row_len)], float64 */
    double *sums;            /* column spans: rows x spans x [sum g, sum g * xhat] */
    double *row_means;       /* column spans: rows x [mean g, mean g * xhat] */
} ln_backward_job;

static void ln_backward_blocks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    for (ptrdiff_t block = begin; block < end; block++) {
        ptrdiff_t row_begin, row_end;
        ln_range_of_part(a->rows, (int)job->blocks, (int)block, &row_begin, &row_end);
        job->kernels->backward_rows(
            a, row_begin, row_end, a->grad_weight ? job->dparams + 2 * block * a->row_len : NULL,
            a->grad_bias ? job->dparams + (2 * block + 1) * a->row_len : NULL);
    }
}

/* Task t: pass 1 over span t % spans of row t / spans. */
static void ln_backward_span_sums(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    for (ptrdiff_t t = begin; t < end; t++) {
        const ptrdiff_t r = t / job->spans, start = (t % job->spans) * LN_CHUNK;
        const ptrdiff_t len = a->row_len - start < LN_CHUNK ? a->row_len - start : LN_CHUNK;
        job->kernels->grad_sums(
            (const char *)a->grad_output + (r * a->grad_output_row_step + start) * job->elsize,
            (const char *)a->input + (r * a->input_row_step + start) * job->elsize,
            a->weight ? (const char *)a->weight + start * job->param_elsize : NULL, len,
            ln_load1_param_as_f64(a->dtype, a->mean, r), ln_load1_param_as_f64(a->dtype, a->rstd, r),
            job->sums + 2 * t);
    }
}

/* Task s: pass 2 over column span s of every row, rows in order. */
static void ln_backward_span_apply(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    const int stream_dx = ln_backward_streams_dx(a);
    for (ptrdiff_t s = begin; s < end; s++) {
        const ptrdiff_t start = s * LN_CHUNK;
        const ptrdiff_t len = a->row_len - start < LN_CHUNK ? a->row_len - start : LN_CHUNK;
        for (ptrdiff_t first = 0; first < a->rows; first += LN_GRAD_ROWS) {
            ln_grad_rows group = {.count = (int)(a->rows - first < LN_GRAD_ROWS ? a->rows - first : LN_GRAD_ROWS),
                                  .stream_dx = stream_dx};
            for (int k = 0; k < group.count; k++) {
                const ptrdiff_t r = first + k;
                group.dy[k] = (const char *)a->grad_output + (r * a->grad_output_row_step + start) * job->elsize;
                group.x[k] = (const char *)a->input + (r * a->input_row_step + start) * job->elsize;
                group.dx[k] = a->grad_input ? (char *)a->grad_input + (r * a->row_len + start) * job->elsize : NULL;
                group.mean[k] = ln_load1_param_as_f64(a->dtype, a->mean, r);
                group.rstd[k] = ln_load1_param_as_f64(a->dtype, a->rstd, r);
                group.g_mean[k] = job->row_means[2 * r];
                group.gx_mean[k] = job->row_means[2 * r + 1];
            }
            job->kernels->grad_apply(
                &group, a->weight ? (const char *)a->weight + start * job->param_elsize : NULL, len,
                a->grad_weight ? job->dparams + start : NULL,
                a->grad_bias ? job->dparams + a->row_len + start : NULL);
        }
    }
#if defined(__x86_64__)
    if (stream_dx) {
        _mm_sfence();  /* the non-temporal stores are weakly ordered: finish them first */
    }
#endif
}

static int ln_backward_by_column_spans(ln_backward_job *job)
{
    const ln_backward_args *a = job->args;
    int status = -1;
    job->spans = (a->row_len + LN_CHUNK - 1) / LN_CHUNK;
    job->sums = calloc((size_t)(2 * a->rows * (job->spans + 1)), sizeof(double));
    if (!job->sums) {
        goto done;
    }
    job->row_means = job->sums + 2 * a->rows * job->spans;
    if (a->grad_input) {
        ln_parallel_for(a->rows * job->spans, 4, ln_backward_span_sums, job);
        for (ptrdiff_t r = 0; r < a->rows; r++) {
            double g_sum = 0.0, gx_sum = 0.0;
            for (ptrdiff_t s = 0; s < job->spans; s++) {
                g_sum += job->sums[2 * (r * job->spans + s)];
                gx_sum += job->sums[2 * (r * job->spans + s) + 1];
            }
            job->row_means[2 * r] = g_sum / (double)a->row_len;
            job->row_means[2 * r + 1] = gx_sum / (double)a->row_len;
        }
    }
    ln_parallel_for(job->spans, 4, ln_backward_span_apply, job);
    status = 0;
done:
    free(job->sums);
    return status;
}

int ln_backward(const ln_backward_args *a)
{
    assert(a && 0 <= a->dtype && a->dtype < LN_DTYPES && a->rows >= 0 && a->row_len >= 0);
    assert(a->rows == 0 || a->row_len == 0 || (a->grad_output && a->input && a->mean && a->rstd));
    ln_backward_job job = {
        .args = a,
        .kernels = &ln_kernels_in_use()->by_dtype[a->dtype],
        .elsize = (ptrdiff_t)ln_dtype_size(a->dtype),
        .param_elsize = (ptrdiff_t)ln_param_size(a->dtype),
        .blocks = 1,
    };
    const int want_params = a->grad_weight || a->grad_bias;
    int dparams_kept = 0;
    const double elements = (double)a->rows * (double)a->row_len;
    int status = -1;
    if (!a->grad_input && !want_params) {
        return 0;
    }
    if (elements >= LN_PARALLEL_MIN_ELEMENTS) {
        const ptrdiff_t max_blocks = LN_GRAD_PARTIALS_MAX / a->row_len;
        job.blocks = a->rows < LN_GRAD_BLOCKS ? a->rows : LN_GRAD_BLOCKS;
        job.blocks = job.blocks < max_blocks ? job.blocks : max_blocks > 1 ? max_blocks : 1;
    }
    const int by_column_spans = a->row_len >= LN_SPLIT_ROW_MIN &&
                                (a->rows < LN_GRAD_BLOCKS || a->row_len >= LN_COLUMN_SPANS_MIN);
    if (by_column_spans) {
        job.blocks = 1;
    }
    if (want_params) {
        /* +1 so that row_len == 0 still allocates */
        job.dparams = ln_scratch_take((size_t)(2 * job.blocks * a->row_len + 1), &dparams_kept);
        if (!job.dparams) {
            goto done;
        }
    }
    if (elements > 0) {
        if (by_column_spans) {
            if (ln_backward_by_column_spans(&job) < 0) {
                goto done;
            }
        }
        else {
            ln_parallel_for(job.blocks, 1, ln_backward_blocks, &job);
        }
    }
    if (want_params) {
        /* Block 0's sums take the other blocks' in block order, column by column (contiguous,
           so the compiler vectorizes it), then go out in the parameters' dtype. */
        double *const dweight = job.dparams, *const dbias = job.dparams + a->row_len;
        for (ptrdiff_t block = 1; block < job.blocks; block++) {
            const double *const block_dweight = job.dparams + 2 * block * a->row_len;
            const double *const block_dbias = block_dweight + a->row_len;
            for (ptrdiff_t j = 0; j < a->row_len; j++) {
                dweight[j] += block_dweight[j];
                dbias[j] += block_dbias[j];
            }
        }
        ln_store_params(a->dtype, a->grad_weight, dweight, a->row_len);
        ln_store_params(a->dtype, a->grad_bias, dbias, a->row_len);
    }
    status = 0;
done:
    ln_scratch_give(job.dparams, dparams_kept);
    return status;
}
