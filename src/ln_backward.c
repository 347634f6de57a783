/*
 * ln_backward.c -- the backward driver: splits a call into row blocks (of rows, or of the
 * strided route's tiles), or a few huge rows into column spans, across the threads, runs
 * the level's kernels on them and adds up the parameter gradients.
 */
#include <stdlib.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "ln_internal.h"

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
 *
 * The strided route goes by row blocks too, blocks of whole tiles: a block's partial sums
 * are per lane (16 per column), added by ln_sum_lanes when the block is done (by the kernel
 * in a block of one tile, whose sums then take one double per column).
 */

typedef struct {
    const ln_backward_args *args;
    const ln_row_kernels *kernels;  /* the level in use, for args->kind and args->dtype */
    ptrdiff_t elsize;        /* bytes per element of dy, x, dx */
    ptrdiff_t param_elsize;  /* bytes per weight, mean and rstd */
    ptrdiff_t grad_blocks;   /* row blocks (of rows, or of tiles) */
    ptrdiff_t spans;         /* LN_CHUNK-column spans per row */
    ptrdiff_t read_ahead;    /* column spans: how pass 1 reads dy and x ahead (ln_backward_read_ahead) */
    ptrdiff_t sums_len;      /* doubles of a block's dweight or dbias sums: row_len, or 16 a column on the
                                strided route unless each block is one tile; to a whole line */
    double *dparams;         /* grad_blocks x [dweight sums, dbias sums], sums_len doubles each */
    int adds_as_it_goes;     /* the task of block 0 adds its blocks to block 0's sums (ln_backward_blocks) */
    ptrdiff_t blocks_added;  /* blocks 0 .. blocks_added - 1 are in block 0's sums */
    double *sums;            /* column spans: rows x spans x LN_GRAD_SUMS [sum g, sum g * xhat, largest] */
    double *row_means;       /* column spans: rows x LN_GRAD_SUMS [mean g, mean g * xhat, largest] */
} ln_backward_job;

#ifndef NDEBUG
/* Debug builds' check of what ln_kernels.h promises the kernels. */
static inline int ln_backward_args_valid(const ln_backward_args *a)
{
    const ln_extent *e = &a->extent;
    const int has_work = e->blocks > 0 && e->rows > 0 && e->row_len > 0 &&
                         (a->grad_input.data || a->grad_weight || a->grad_bias);
    return 0 <= a->kind && a->kind < LN_NORM_KINDS && 0 <= a->dtype && a->dtype < LN_DTYPES &&
           e->blocks >= 0 && e->rows >= 0 && e->row_len >= 0 &&
           (!has_work || (a->grad_output.data && a->input.data && a->rstd.data &&
                          (a->kind == LN_NORM_RMS || a->mean.data))) &&
           (a->kind == LN_NORM_LAYER || (!a->mean.data && !a->grad_bias)) &&
           ln_element_array_valid(&a->grad_output, a->dtype) && ln_element_array_valid(&a->input, a->dtype) &&
           ln_element_array_valid(&a->grad_input, a->dtype) && ln_stat_array_valid(&a->mean, a->dtype, e) &&
           ln_stat_array_valid(&a->rstd, a->dtype, e);
}
#endif

/* Row r's mean: RMSNorm's is 0. */
static double ln_backward_mean(const ln_backward_args *a, ptrdiff_t r)
{
    return a->kind == LN_NORM_RMS ? 0.0 : ln_load_stat(a->dtype, &a->mean, &a->extent, r);
}

/* Block `block`'s dweight partial sums (sums_len doubles), or NULL when not wanted. */
static double *ln_block_dweight(const ln_backward_job *job, ptrdiff_t block)
{
    return job->args->grad_weight ? job->dparams + 2 * block * job->sums_len : NULL;
}

/* ... and its dbias partial sums. */
static double *ln_block_dbias(const ln_backward_job *job, ptrdiff_t block)
{
    return job->args->grad_bias ? job->dparams + (2 * block + 1) * job->sums_len : NULL;
}

/* totals[0 .. n) += sums[0 .. n): one block's sums added to the blocks' before it. */
static void ln_add_sums(double *totals, const double *sums, ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        totals[j] += sums[j];
    }
}

/* Tasks [begin, end): row blocks.  Where the call adds as it goes, the task that starts at
   block 0 adds each of its blocks to block 0's sums as soon as it is done, in block order,
   the order the final sums take: backward_rows adds a block of one group of rows itself,
   reading the totals where it would write the block's own sums, which it then never
   writes, and nothing reads them again (48 rows of 65536, 16 blocks: 16 MiB of partial
   sums otherwise written and added after). */
static void ln_backward_blocks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    for (ptrdiff_t block = begin; block < end; block++) {
        ptrdiff_t row_begin, row_end;
        ln_range_of_part(ln_rows_of(&a->extent), (int)job->grad_blocks, (int)block, &row_begin, &row_end);
        double *const dweight = ln_block_dweight(job, block), *const dbias = ln_block_dbias(job, block);
        if (!job->adds_as_it_goes || begin > 0 || block == 0) {
            job->kernels->backward_rows(a, row_begin, row_end, dweight, dbias, NULL, NULL);
            continue;
        }
        if (!job->kernels->backward_rows(a, row_begin, row_end, dweight, dbias, ln_block_dweight(job, 0),
                                         ln_block_dbias(job, 0))) {
            /* a row for the exact path: the block's own sums, added now */
            if (dweight) {
                ln_add_sums(ln_block_dweight(job, 0), dweight, a->extent.row_len);
            }
            if (dbias) {
                ln_add_sums(ln_block_dbias(job, 0), dbias, a->extent.row_len);
            }
        }
        job->blocks_added = block + 1;
    }
}

/* Columns [first, first + len) of one parameter gradient: block 0's sums (`of_block`'s)
   take the other blocks' in block order (those not added already), then go out in the
   parameters' dtype. */
static void ln_backward_param_columns(const ln_backward_job *job,
                                      double *(*of_block)(const ln_backward_job *, ptrdiff_t), void *param,
                                      ptrdiff_t first, ptrdiff_t len)
{
    double *const sums = of_block(job, 0) + first;
    for (ptrdiff_t block = job->blocks_added; block < job->grad_blocks; block++) {
        ln_add_sums(sums, of_block(job, block) + first, len);
    }
    ln_dtype_kernels_in_use(job->args->dtype)->store_params((char *)param + first * job->param_elsize, sums, len);
}

/* Tasks [begin, end): LN_CHUNK-column chunks of dweight and dbias, taken as one run of
   columns, each column's block sums added in block order (that order alone sets the bits,
   so the columns may go to any thread).  A block's run is read whole before the next
   block's: runs of a chunk each, the blocks' sums row_len apart, left the prefetchers no
   stream to follow (rows of 65536, 16 blocks, one thread: 2.2 -> 2.6 ms for the call). */
static void ln_backward_param_chunks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    const ptrdiff_t n = a->extent.row_len, first = begin * LN_CHUNK;
    const ptrdiff_t len = (end * LN_CHUNK < n ? end * LN_CHUNK : n) - first;
    if (a->grad_weight) {
        ln_backward_param_columns(job, ln_block_dweight, a->grad_weight, first, len);
    }
    if (a->grad_bias) {
        ln_backward_param_columns(job, ln_block_dbias, a->grad_bias, first, len);
    }
}

/* Column j's 16 lanes at sums[16 j ..] added by the fixed tree into sums[j], in place: the
   lanes of the columns before j are spent by then. */
static void ln_sum_column_lanes(double *sums, ptrdiff_t row_len)
{
    for (ptrdiff_t j = 0; sums && j < row_len; j++) {
        sums[j] = ln_sum_lanes(sums + 16 * j);
    }
}

/* The strided route's row blocks: whole tiles each, their lanes added when done (a block
   of one tile has added them itself). */
static void ln_backward_tile_blocks(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    for (ptrdiff_t block = begin; block < end; block++) {
        ptrdiff_t tile_begin, tile_end;
        ln_range_of_part(ln_tiles_of(&a->extent), (int)job->grad_blocks, (int)block, &tile_begin, &tile_end);
        job->kernels->backward_tiles(a, tile_begin, tile_end, ln_block_dweight(job, block), ln_block_dbias(job, block));
        if (tile_end - tile_begin > 1) {
            ln_sum_column_lanes(ln_block_dweight(job, block), a->extent.row_len);
            ln_sum_column_lanes(ln_block_dbias(job, block), a->extent.row_len);
        }
    }
}

/* Task t: pass 1 over span t % spans of row t / spans. */
static void ln_backward_span_sums(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    for (ptrdiff_t t = begin; t < end; t++) {
        const ptrdiff_t r = t / job->spans, start = (t % job->spans) * LN_CHUNK;
        const ptrdiff_t len = a->extent.row_len - start < LN_CHUNK ? a->extent.row_len - start : LN_CHUNK;
        job->kernels->grad_sums(ln_row_address(&a->grad_output, &a->extent, r) + start * job->elsize,
                                ln_row_address(&a->input, &a->extent, r) + start * job->elsize,
                                a->weight ? (const char *)a->weight + start * job->param_elsize : NULL, len,
                                ln_backward_mean(a, r), ln_load_stat(a->dtype, &a->rstd, &a->extent, r),
                                job->sums + LN_GRAD_SUMS * t, job->sums + LN_GRAD_SUMS * t + 2, job->read_ahead);
    }
}

/* Whether huge row r's backward goes by ln_backward_exact_row, from pass 1's means (none
   when dbias alone is wanted: pass 1 is skipped then). */
static int ln_backward_span_row_exact(const ln_backward_job *job, ptrdiff_t r)
{
    const ln_backward_args *a = job->args;
    if (!a->grad_input.data && !a->grad_weight) {
        return 0;
    }
    const double *row = job->row_means + LN_GRAD_SUMS * r;
    return ln_grad_row_needs_exact(a->dtype, ln_load_stat(a->dtype, &a->rstd, &a->extent, r), row[0], row[1],
                                   row + 2);
}

/* Task s: pass 2 over column span s of every row, rows in order (the rows
   ln_backward_exact_row takes: their dbias only). */
static void ln_backward_span_apply(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_backward_job *job = ctx;
    const ln_backward_args *a = job->args;
    const int stream_dx = ln_backward_streams_dx(a);
    const ptrdiff_t rows = ln_rows_of(&a->extent);
    for (ptrdiff_t s = begin; s < end; s++) {
        const ptrdiff_t start = s * LN_CHUNK;
        const ptrdiff_t len = a->extent.row_len - start < LN_CHUNK ? a->extent.row_len - start : LN_CHUNK;
        for (ptrdiff_t first = 0; first < rows; first += LN_GRAD_ROWS) {
            ln_grad_rows group = {.count = (int)(rows - first < LN_GRAD_ROWS ? rows - first : LN_GRAD_ROWS),
                                  .stream_dx = stream_dx};
            int exact[LN_GRAD_ROWS], any_exact = 0;
            for (int k = 0; k < group.count; k++) {
                const ptrdiff_t r = first + k;
                group.dy[k] = ln_row_address(&a->grad_output, &a->extent, r) + start * job->elsize;
                group.x[k] = ln_row_address(&a->input, &a->extent, r) + start * job->elsize;
                group.dx[k] = a->grad_input.data ? ln_row_address(&a->grad_input, &a->extent, r) + start * job->elsize
                                                 : NULL;
                group.mean[k] = ln_backward_mean(a, r);
                group.rstd[k] = ln_load_stat(a->dtype, &a->rstd, &a->extent, r);
                group.g_mean[k] = job->row_means[LN_GRAD_SUMS * r];
                group.gx_mean[k] = job->row_means[LN_GRAD_SUMS * r + 1];
                exact[k] = ln_backward_span_row_exact(job, r);
                any_exact |= exact[k];
            }
            const void *weight = a->weight ? (const char *)a->weight + start * job->param_elsize : NULL;
            double *dweight = a->grad_weight ? ln_block_dweight(job, 0) + start : NULL;
            double *dbias = a->grad_bias ? ln_block_dbias(job, 0) + start : NULL;
            if (any_exact) {
                ln_grad_apply_without(job->kernels->grad_apply, &group, exact, weight, len, dweight, dbias);
            }
            else {
                job->kernels->grad_apply(&group, weight, len, dweight, dbias);
            }
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
    const ptrdiff_t rows = ln_rows_of(&a->extent);
    int status = -1;
    job->spans = (a->extent.row_len + LN_CHUNK - 1) / LN_CHUNK;
    job->read_ahead = ln_backward_read_ahead(a);
    job->sums = calloc((size_t)(LN_GRAD_SUMS * rows * (job->spans + 1)), sizeof(double));
    if (!job->sums) {
        goto done;
    }
    job->row_means = job->sums + LN_GRAD_SUMS * rows * job->spans;
    /* pass 1 also without dx: which rows ln_backward_exact_row takes must not depend on it;
       dbias alone needs none of it */
    if (a->grad_input.data || a->grad_weight) {
        ln_parallel_for(rows * job->spans, 4, ln_backward_span_sums, job);
    }
    for (ptrdiff_t r = 0; r < rows; r++) {
        double *row = job->row_means + LN_GRAD_SUMS * r;
        for (ptrdiff_t s = 0; s < job->spans; s++) {
            const double *span = job->sums + LN_GRAD_SUMS * (r * job->spans + s);
            row[0] += span[0];
            row[1] += span[1];
            for (int i = 2; i < LN_GRAD_SUMS; i++) {
                row[i] = fmax(row[i], span[i]);
            }
        }
        row[0] /= (double)a->extent.row_len;
        row[1] /= (double)a->extent.row_len;
    }
    ln_parallel_for(job->spans, 4, ln_backward_span_apply, job);
    for (ptrdiff_t r = 0; r < rows; r++) {
        if (ln_backward_span_row_exact(job, r)) {
            ln_backward_exact_row(a, r, ln_block_dweight(job, 0));
        }
    }
    status = 0;
done:
    free(job->sums);
    return status;
}

int ln_backward(const ln_backward_args *a)
{
    assert(a && ln_backward_args_valid(a));
    ln_backward_job job = {
        .args = a,
        .kernels = &ln_dtype_kernels_in_use(a->dtype)->by_kind[a->kind],
        .elsize = (ptrdiff_t)ln_dtype_size(a->dtype),
        .param_elsize = (ptrdiff_t)ln_param_size(a->dtype),
        .grad_blocks = 1,
        .blocks_added = 1,
    };
    const ptrdiff_t rows = ln_rows_of(&a->extent), n = a->extent.row_len;
    const int want_params = a->grad_weight || a->grad_bias;
    ln_scratch_source dparams_source = LN_SCRATCH_MALLOC;
    const double elements = (double)rows * (double)n;
    int status = -1;
    if (!a->grad_input.data && !want_params) {
        return 0;
    }
    if (elements == 0) {
        /* no rows: the parameter gradients are zeros, with no scratch (an empty strided call's
           lanes of partial sums for rows of 2**26 elements took 16 GiB) */
        for (int p = 0; p < 2; p++) {
            void *grad = p == 0 ? a->grad_weight : a->grad_bias;
            if (grad) {
                memset(grad, 0, (size_t)n * (size_t)job.param_elsize);
            }
        }
        return 0;
    }
    const int contiguous = ln_elements_adjacent(&a->grad_output, a->dtype) &&
                           ln_elements_adjacent(&a->input, a->dtype) && ln_elements_adjacent(&a->grad_input, a->dtype);
    const ptrdiff_t lanes = contiguous ? 1 : 16;  /* partial sums per column a block */
    const ptrdiff_t line = LN_SCRATCH_ALIGN / (ptrdiff_t)sizeof(double);
    job.sums_len = (lanes * n + line - 1) / line * line;
    const ptrdiff_t units = contiguous ? rows : ln_tiles_of(&a->extent);  /* what row blocks hold */
    if (elements >= LN_PARALLEL_MIN_ELEMENTS) {
        const ptrdiff_t max_blocks = LN_GRAD_PARTIALS_MAX / job.sums_len;
        job.grad_blocks = units < LN_GRAD_BLOCKS ? units : LN_GRAD_BLOCKS;
        job.grad_blocks = job.grad_blocks < max_blocks ? job.grad_blocks : max_blocks > 1 ? max_blocks : 1;
    }
    /* blocks of one tile store their column sums (backward_tiles): 2 rows of 4000000
       elements took 1 GiB of lanes for 61 MiB of results */
    const int tiles_store_sums = !contiguous && job.grad_blocks == units;
    if (tiles_store_sums) {
        job.sums_len = (n + line - 1) / line * line;
    }
    const int by_column_spans = contiguous && n >= LN_SPLIT_ROW_MIN &&
                                (rows < LN_GRAD_BLOCKS || n >= LN_COLUMN_SPANS_MIN);
    if (by_column_spans) {
        job.grad_blocks = 1;
    }
    job.adds_as_it_goes = contiguous && !by_column_spans && want_params && job.grad_blocks > 1 &&
                          ln_rows_add_to_totals(a->dtype, (rows + job.grad_blocks - 1) / job.grad_blocks, n);
    if (want_params) {
        /* backward_rows writes its block's sums before it adds to them (or adds them to block
           0's, leaving its own unwritten and unread), the other routes add into zeros */
        const int sums_written = (contiguous && !by_column_spans) || tiles_store_sums;
        job.dparams = ln_scratch_take((size_t)(2 * job.grad_blocks * job.sums_len), !sums_written,
                                      &dparams_source);
        if (!job.dparams) {
            goto done;
        }
    }
    if (by_column_spans) {
        if (ln_backward_by_column_spans(&job) < 0) {
            goto done;
        }
    }
    else {
        ln_parallel_for(job.grad_blocks, 1, contiguous ? ln_backward_blocks : ln_backward_tile_blocks, &job);
    }
    if (want_params) {
        /* the blocks left to add, and block 0's sums to store */
        const double sums_left = (double)(job.grad_blocks - job.blocks_added + 1) * (double)n;
        ln_run(sums_left >= LN_PARALLEL_MIN_ELEMENTS, (n + LN_CHUNK - 1) / LN_CHUNK, 1, ln_backward_param_chunks,
               &job);
    }
    status = 0;
done:
    ln_scratch_give(job.dparams, dparams_source);
    return status;
}
