/*
 * ln_kernels.c -- LayerNorm forward and backward over rows, with SIMD dispatch and
 * a small thread pool.  No Python in here: see ln_kernels.h for the contract.
 *
 * Determinism: a row's statistics are computed chunk by chunk (LN_CHUNK elements,
 * boundaries fixed from the row start) and the chunks are merged left to right,
 * whether one thread does all of them or several threads share a huge row.  Rows
 * never depend on each other, and parameter gradients are summed over a partition
 * that depends only on the shape.  So results do not depend on the thread count.
 */
#define _GNU_SOURCE
#include "ln_kernels.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define LN_X86 1
#include <immintrin.h>
#else
#define LN_X86 0
#endif

#define LN_ALWAYS_INLINE inline __attribute__((always_inline))

/* Elements per statistics chunk: 16 KiB of float64, so a chunk stays in L1
   between its two passes. */
#define LN_CHUNK 2048
/* Rows of at least this many bytes do not stay in L2 between the statistics pass and
   the normalize pass: their float32/float64 output is written with non-temporal stores,
   which keep it from evicting the input about to be read again and need no read for ownership
   (8x1000000 float32, 2 threads: ours/torch 0.91-1.07 -> 0.75-0.83). */
#define LN_STREAM_MIN_BYTES ((ptrdiff_t)1 << 20)
/* Below this many elements a call runs on the calling thread alone. */
#define LN_PARALLEL_MIN_ELEMENTS 65536

/* ------------------------------------------------------------------------ */
/* Helpers shared by every SIMD level                       */
/* ------------------------------------------------------------------------ */

/* Backward writes dx with non-temporal stores when dx is this large: it does not stay in
   cache for its reader anyway, and the stores then cost no read for ownership (AMD EPYC,
   2 threads: 1024x1024 float64 1.17 -> 0.80 ms, 8x1000000 float32 8.3 -> 7.5 ms).  They
   are 16-byte stores, so float32/float64 rows of a multiple of 16 bytes from a 16-byte
   aligned start (every NumPy allocation) qualify; float16 is stored as usual. */
#define LN_BACKWARD_STREAM_MIN_BYTES ((ptrdiff_t)4 << 20)

static inline int ln_backward_streams_dx(const ln_backward_args *a)
{
    const ptrdiff_t row_bytes = a->row_len * (a->dtype == LN_F64 ? 8 : a->dtype == LN_F32 ? 4 : 0);
    return a->grad_input && row_bytes > 0 && row_bytes % 16 == 0 &&
           ((uintptr_t)a->grad_input & 15) == 0 && row_bytes * a->rows >= LN_BACKWARD_STREAM_MIN_BYTES;
}

typedef struct {
    double n;     /* elements */
    double mean;  /* their mean */
    double m2;    /* sum of squared deviations from the mean */
} ln_moments;

typedef void (*ln_normalize_fn)(const void *x, void *y, ptrdiff_t n, double mean, double rstd,
                                const void *weight, const void *bias);

/* Rows that make backward pass 2 together (see grad_apply in ln_kernel_impl.h). */
#define LN_GRAD_ROWS 4
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

/* One SIMD level's kernels, indexed by ln_dtype. */
typedef struct {
    void (*forward_rows[3])(const ln_forward_args *a, ptrdiff_t begin, ptrdiff_t end);
    ln_moments (*chunk_moments[3])(const void *x, ptrdiff_t n);
    ln_normalize_fn normalize_row[3];
    ln_normalize_fn normalize_row_streaming[3];  /* the same, output by non-temporal stores */
    /* backward over rows [begin, end), adding into float64 dweight/dbias (each may be NULL) */
    void (*backward_rows[3])(const ln_backward_args *a, ptrdiff_t begin, ptrdiff_t end,
                             double *dweight, double *dbias);
    /* backward pass 1 over a span of one row: sums of g and g * xhat */
    void (*grad_sums[3])(const void *dy, const void *x, const void *weight, ptrdiff_t n,
                         double mean, double rstd, double sums[2]);
    /* backward pass 2 over a span of a group of rows */
    void (*grad_apply[3])(const ln_grad_rows *group, const void *weight, ptrdiff_t n,
                          double *dweight, double *dbias);
} ln_kernel_table;

static inline size_t ln_dtype_size(ln_dtype dtype)
{
    return dtype == LN_F16 ? 2 : dtype == LN_F32 ? 4 : 8;
}

/* An output of this many bytes in all does not stay in cache for its reader either (L2 is
   1 MiB a core, L3 is shared with the other cores): rows longer than LN_CHUNK are then
   written with non-temporal stores too, whatever their length (AMD EPYC Zen 4, 2 threads,
   2048x4096 float32 into out=: ours/copy 1.20-1.26 -> 0.73-0.91; into a new array, whose
   pages the OS has just zeroed through the cache, about 4% slower: 4.2 -> 4.4 ms). */
#define LN_STREAM_MIN_OUTPUT_BYTES ((ptrdiff_t)16 << 20)

/* Whether forward writes its float32/float64 output with non-temporal stores. */
static inline int ln_forward_streams(const ln_forward_args *a)
{
    const ptrdiff_t row_bytes = a->row_len * (ptrdiff_t)ln_dtype_size(a->dtype);
    return row_bytes >= LN_STREAM_MIN_BYTES ||
           (a->row_len > LN_CHUNK && row_bytes * a->rows >= LN_STREAM_MIN_OUTPUT_BYTES);
}

/* IEEE binary16 <-> binary32, round to nearest even (the hardware's rounding). */
static inline float ln_half_to_float(uint16_t h)
{
    _Float16 value;
    memcpy(&value, &h, sizeof value);
    return (float)value;
}

static inline uint16_t ln_float_to_half(float f)
{
    _Float16 value = (_Float16)f;
    uint16_t h;
    memcpy(&h, &value, sizeof h);
    return h;
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

static inline double ln_load1_as_f64(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    switch (dtype) {
    case LN_F16:
        return ln_half_to_float(((const uint16_t *)p)[i]);
    case LN_F32:
        return ((const float *)p)[i];
    default:
        return ((const double *)p)[i];
    }
}

static inline double ln_load1_param_as_f64(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    return dtype == LN_F64 ? ((const double *)p)[i] : ((const float *)p)[i];
}

static inline void ln_store1_from_f64(ln_dtype dtype, void *p, ptrdiff_t i, double value)
{
    switch (dtype) {
    case LN_F16:
        ((uint16_t *)p)[i] = ln_float_to_half((float)value);
        break;
    case LN_F32:
        ((float *)p)[i] = (float)value;
        break;
    default:
        ((double *)p)[i] = value;
    }
}

static inline void ln_store1_param(ln_dtype dtype, void *p, ptrdiff_t i, double value)
{
    if (dtype == LN_F64) {
        ((double *)p)[i] = value;
    }
    else {
        ((float *)p)[i] = (float)value;
    }
}

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

/* Chan et al.'s pairwise update: the moments of two parts' union. */
static ln_moments ln_merge(ln_moments a, ln_moments b)
{
    const double n = a.n + b.n;
    const double delta = b.mean - a.mean;
    ln_moments m = {n, a.mean + delta * (b.n / n), a.m2 + b.m2 + delta * delta * (a.n * (b.n / n))};
    return m;
}

static double ln_rstd_of(ln_moments m, double eps)
{
    if (!isfinite(m.mean)) {
        return NAN;  /* NaN or Inf in the row: the whole row becomes NaN, as in torch */
    }
    const double var = m.m2 > 0.0 ? m.m2 / m.n : 0.0;
    return 1.0 / sqrt(var + eps);
}

/* The normalize pass goes through a long row from the end back, so that the part the
   statistics pass read last, still in cache, is used first, one span at a time, and through
   each span forward.  A span of 16384 elements (64 KiB of float32) is long enough for the
   hardware prefetchers to get going on x, weight and bias at each span; at 2048 elements
   they restarted every 8 KiB (AMD EPYC Zen 4, 2 threads, float32 into out=: 8x1000000
   2.19 -> 1.94 ms, 2048x4096 2.16 -> 1.82 ms). */
#define LN_NORMALIZE_SPAN 16384

/* normalize() over elements [begin, end) of a row, LN_NORMALIZE_SPAN at a time from the end
   back. */
static inline void ln_normalize_spans_backwards(ln_normalize_fn normalize, ln_dtype dtype, const void *x,
                                                void *y, ptrdiff_t begin, ptrdiff_t end, double mean,
                                                double rstd, const void *weight, const void *bias)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), param_elsize = dtype == LN_F64 ? 8 : 4;
    for (ptrdiff_t stop = end; stop > begin;) {
        const ptrdiff_t start = stop - begin > LN_NORMALIZE_SPAN ? stop - LN_NORMALIZE_SPAN : begin;
        normalize((const char *)x + start * elsize, (char *)y + start * elsize, stop - start, mean, rstd,
                  weight ? (const char *)weight + start * param_elsize : NULL,
                  bias ? (const char *)bias + start * param_elsize : NULL);
        stop = start;
    }
}

static void ln_store_stats(const ln_forward_args *a, ptrdiff_t row, double mean, double rstd)
{
    if (a->mean) {
        ln_store1_param(a->dtype, a->mean, row, mean);
    }
    if (a->rstd) {
        ln_store1_param(a->dtype, a->rstd, row, rstd);
    }
}

/* ------------------------------------------------------------------------ */
/* The kernels, once per SIMD level                                          */
/* ------------------------------------------------------------------------ */

#define LN_ISA scalar
#define LN_ISA_LEVEL 0
#include "ln_kernel_impl.h"
#undef LN_ISA
#undef LN_ISA_LEVEL

#if LN_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define LN_ISA avx2
#define LN_ISA_LEVEL 1
#include "ln_kernel_impl.h"
#undef LN_ISA
#undef LN_ISA_LEVEL
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#define LN_ISA avx512
#define LN_ISA_LEVEL 2
#include "ln_kernel_impl.h"
#undef LN_ISA
#undef LN_ISA_LEVEL
#pragma GCC pop_options
#endif

/* ------------------------------------------------------------------------ */
/* SIMD dispatch                                                             */
/* ------------------------------------------------------------------------ */

static _Atomic int ln_simd_current = -1;

ln_simd_level ln_simd_best(void)
{
#if LN_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        return LN_SIMD_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        return LN_SIMD_AVX2;
    }
#endif
    return LN_SIMD_SCALAR;
}

ln_simd_level ln_simd_get(void)
{
    int level = atomic_load(&ln_simd_current);
    if (level < 0) {
        level = ln_simd_best();
        atomic_store(&ln_simd_current, level);
    }
    return (ln_simd_level)level;
}

int ln_simd_set(ln_simd_level level)
{
    if (level < LN_SIMD_SCALAR || level > ln_simd_best()) {
        return -1;
    }
    atomic_store(&ln_simd_current, (int)level);
    return 0;
}

const char *ln_simd_name(ln_simd_level level)
{
    static const char *const names[] = {"scalar", "avx2", "avx512"};
    return (level >= LN_SIMD_SCALAR && level <= LN_SIMD_AVX512) ? names[level] : "unknown";
}

static const ln_kernel_table *ln_kernels_in_use(void)
{
    switch (ln_simd_get()) {
#if LN_X86
    case LN_SIMD_AVX512:
        return &kernels_avx512;
    case LN_SIMD_AVX2:
        return &kernels_avx2;
#endif
    default:
        return &kernels_scalar;
    }
}

/* ------------------------------------------------------------------------ */
/* Thread pool                                                               */
/* ------------------------------------------------------------------------ */

/*
 * One pool per process.  A parallel job splits [0, n) into `parts` contiguous
 * ranges; the caller runs range 0 and worker k runs range k.  Workers spin briefly
 * for the next job (back-to-back calls are common) before sleeping on a condition
 * variable.  A second concurrent caller, finding the pool busy, runs its job alone,
 * so calls from several Python threads never wait on each other.  After fork() the
 * child starts with no workers and makes new ones on first use.
 */

typedef void (*ln_range_fn)(void *ctx, ptrdiff_t begin, ptrdiff_t end);

#define LN_MAX_THREADS 256
#define LN_SPIN_ITERATIONS 20000

static struct {
    pthread_mutex_t busy;        /* held by the caller running a parallel job */
    pthread_mutex_t lock;        /* guards the fields below for sleeping/waking */
    pthread_cond_t wake;         /* workers wait here for a new job */
    pthread_cond_t done;         /* the caller waits here for the last worker */
    int workers;                 /* worker threads started */
    _Atomic int threads;         /* threads a job may use, caller included */
    _Atomic unsigned generation; /* bumped for every job */
    _Atomic int pending;         /* workers that have not yet finished the current job */
    unsigned grow_generation;    /* the generation when the newest workers were started */
    ln_range_fn fn;
    void *ctx;
    ptrdiff_t n;
    int parts;
} ln_pool = {
    .busy = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
    .threads = 0,
};

static void ln_range_of_part(ptrdiff_t n, int parts, int part, ptrdiff_t *begin, ptrdiff_t *end)
{
    *begin = (ptrdiff_t)((long double)n * part / parts);
    *end = (ptrdiff_t)((long double)n * (part + 1) / parts);
}

static void ln_finish_part(void)
{
    if (atomic_fetch_sub(&ln_pool.pending, 1) == 1) {
        pthread_mutex_lock(&ln_pool.lock);
        pthread_cond_signal(&ln_pool.done);
        pthread_mutex_unlock(&ln_pool.lock);
    }
}

/* Every worker takes part in every job (doing nothing if its index is past the
   job's parts) and reports back, so no worker can mistake one job's fields for the
   next one's. */
static void *ln_worker_main(void *arg)
{
    const int index = (int)(intptr_t)arg;
    unsigned seen = ln_pool.grow_generation;
    for (;;) {
        unsigned now = atomic_load(&ln_pool.generation);
        for (int spin = 0; now == seen && spin < LN_SPIN_ITERATIONS; spin++) {
#if LN_X86
            _mm_pause();
#endif
            now = atomic_load(&ln_pool.generation);
        }
        if (now == seen) {
            pthread_mutex_lock(&ln_pool.lock);
            while ((now = atomic_load(&ln_pool.generation)) == seen) {
                pthread_cond_wait(&ln_pool.wake, &ln_pool.lock);
            }
            pthread_mutex_unlock(&ln_pool.lock);
        }
        seen = now;
        if (index < ln_pool.parts) {
            ptrdiff_t begin, end;
            ln_range_of_part(ln_pool.n, ln_pool.parts, index, &begin, &end);
            ln_pool.fn(ln_pool.ctx, begin, end);
        }
        ln_finish_part();
    }
    return NULL;
}

static void ln_pool_after_fork_child(void)
{
    pthread_mutex_init(&ln_pool.busy, NULL);
    pthread_mutex_init(&ln_pool.lock, NULL);
    pthread_cond_init(&ln_pool.wake, NULL);
    pthread_cond_init(&ln_pool.done, NULL);
    ln_pool.workers = 0;
}

static void ln_scratch_after_fork_child(void);

/* Both the pool and the scratch buffer (below) register before their first use. */
static pthread_once_t ln_fork_handlers_once = PTHREAD_ONCE_INIT;

static void ln_register_fork_handlers(void)
{
    pthread_atfork(NULL, NULL, ln_pool_after_fork_child);
    pthread_atfork(NULL, NULL, ln_scratch_after_fork_child);
}

/* Starts workers until `wanted` exist (the busy lock is held); returns how many exist. */
static int ln_pool_grow(int wanted)
{
    pthread_once(&ln_fork_handlers_once, ln_register_fork_handlers);
    ln_pool.grow_generation = atomic_load(&ln_pool.generation);
    while (ln_pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, ln_worker_main,
                                    (void *)(intptr_t)(ln_pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) {
            break;
        }
        ln_pool.workers++;
    }
    return ln_pool.workers;
}

/* Runs fn over [0, n) in up to ln_threads_get() contiguous parts of at least
   min_per_part each. */
static void ln_parallel_for(ptrdiff_t n, ptrdiff_t min_per_part, ln_range_fn fn, void *ctx)
{
    ptrdiff_t max_parts = min_per_part > 0 ? n / min_per_part : n;
    int parts = ln_threads_get();
    if (max_parts < parts) {
        parts = max_parts < 1 ? 1 : (int)max_parts;
    }
    if (parts <= 1 || pthread_mutex_trylock(&ln_pool.busy) != 0) {
        fn(ctx, 0, n);
        return;
    }
    int workers = ln_pool_grow(parts - 1);
    if (workers < parts - 1) {
        parts = workers + 1;
    }
    ln_pool.fn = fn;
    ln_pool.ctx = ctx;
    ln_pool.n = n;
    ln_pool.parts = parts;
    atomic_store(&ln_pool.pending, workers);
    pthread_mutex_lock(&ln_pool.lock);
    atomic_fetch_add(&ln_pool.generation, 1);
    pthread_cond_broadcast(&ln_pool.wake);
    pthread_mutex_unlock(&ln_pool.lock);

    ptrdiff_t begin, end;
    ln_range_of_part(n, parts, 0, &begin, &end);
    fn(ctx, begin, end);

    for (int spin = 0; atomic_load(&ln_pool.pending) > 0 && spin < LN_SPIN_ITERATIONS; spin++) {
#if LN_X86
        _mm_pause();
#endif
    }
    if (atomic_load(&ln_pool.pending) > 0) {
        pthread_mutex_lock(&ln_pool.lock);
        while (atomic_load(&ln_pool.pending) > 0) {
            pthread_cond_wait(&ln_pool.done, &ln_pool.lock);
        }
        pthread_mutex_unlock(&ln_pool.lock);
    }
    pthread_mutex_unlock(&ln_pool.busy);
}

int ln_threads_default(void)
{
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int count = CPU_COUNT(&set);
        if (count > 0) {
            return count;
        }
    }
#endif
    return 1;
}

int ln_threads_get(void)
{
    int n = atomic_load(&ln_pool.threads);
    if (n <= 0) {
        n = ln_threads_default();
        atomic_store(&ln_pool.threads, n);
    }
    return n;
}

void ln_threads_set(int n)
{
    atomic_store(&ln_pool.threads, n < 1 ? 1 : n > LN_MAX_THREADS ? LN_MAX_THREADS : n);
}

/* ------------------------------------------------------------------------ */
/* Forward driver                                                            */
/* ------------------------------------------------------------------------ */

typedef struct {
    const ln_forward_args *args;
    const ln_kernel_table *kernels;
    /* for one huge row split across threads: */
    const char *row_in;
    char *row_out;
    ln_moments *chunk_moments;
    double mean, rstd;
} ln_forward_job;

static void ln_forward_rows(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    job->kernels->forward_rows[job->args->dtype](job->args, begin, end);
}

static void ln_forward_huge_row_moments(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    ln_forward_job *job = ctx;
    const ln_forward_args *a = job->args;
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(a->dtype);
    for (ptrdiff_t c = begin; c < end; c++) {
        const ptrdiff_t start = c * LN_CHUNK;
        const ptrdiff_t len = a->row_len - start < LN_CHUNK ? a->row_len - start : LN_CHUNK;
        job->chunk_moments[c] = job->kernels->chunk_moments[a->dtype](job->row_in + start * elsize, len);
    }
}

static void ln_forward_huge_row_normalize(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_job *job = ctx;
    const ln_forward_args *a = job->args;
    const ptrdiff_t stop = end * LN_CHUNK < a->row_len ? end * LN_CHUNK : a->row_len;
    ln_normalize_spans_backwards(ln_forward_streams(a) ? job->kernels->normalize_row_streaming[a->dtype]
                                                       : job->kernels->normalize_row[a->dtype],
                                 a->dtype, job->row_in, job->row_out,
                                 begin * LN_CHUNK, stop, job->mean, job->rstd, a->weight, a->bias);
}

int ln_forward(const ln_forward_args *a)
{
    ln_forward_job job = {.args = a, .kernels = ln_kernels_in_use()};
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
    if (a->row_len < 8 * LN_CHUNK || a->rows >= 4 * (ptrdiff_t)threads) {
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

/* ------------------------------------------------------------------------ */
/* Scratch memory                                                            */
/* ------------------------------------------------------------------------ */

/*
 * The backward partial sums take a few hundred KiB on mid-sized inputs.  A fresh calloc
 * of that size is an mmap, and its page faults cost more than the kernel itself
 * (512x768 float32 backward, 2 threads: 185 -> 155 us without them).  So one zeroed
 * buffer of up to LN_SCRATCH_MAX bytes is kept between calls; a call that finds it in
 * use by another thread, or needs more, allocates its own.
 */
#define LN_SCRATCH_MAX ((size_t)16 << 20)

static struct {
    pthread_mutex_t lock;  /* held by the call using the buffer */
    double *data;
    size_t count;          /* doubles allocated */
} ln_scratch = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* A thread that held the buffer at fork() does not exist in the child. */
static void ln_scratch_after_fork_child(void)
{
    pthread_mutex_init(&ln_scratch.lock, NULL);
}

/* count zeroed doubles, or NULL when out of memory; *kept says whether they are the kept
   buffer.  Give them back with ln_scratch_give. */
static double *ln_scratch_take(size_t count, int *kept)
{
    *kept = 0;
    pthread_once(&ln_fork_handlers_once, ln_register_fork_handlers);
    if (count > LN_SCRATCH_MAX / sizeof(double) || pthread_mutex_trylock(&ln_scratch.lock) != 0) {
        return calloc(count, sizeof(double));
    }
    if (ln_scratch.count < count) {
        free(ln_scratch.data);
        ln_scratch.data = malloc(count * sizeof(double));
        ln_scratch.count = ln_scratch.data ? count : 0;
        if (!ln_scratch.data) {
            pthread_mutex_unlock(&ln_scratch.lock);
            return NULL;
        }
    }
    memset(ln_scratch.data, 0, count * sizeof(double));
    *kept = 1;
    return ln_scratch.data;
}

static void ln_scratch_give(double *data, int kept)
{
    if (kept) {
        pthread_mutex_unlock(&ln_scratch.lock);
    }
    else {
        free(data);
    }
}

/* ------------------------------------------------------------------------ */
/* Backward driver                                                           */
/* ------------------------------------------------------------------------ */

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

/* Row blocks for the parameter gradients: enough to share evenly among threads, one for
   inputs too small to be worth a thread, and at most 2^22 / row_len (64 MiB of partials). */
#define LN_GRAD_BLOCKS 16

typedef struct {
    const ln_backward_args *args;
    const ln_kernel_table *kernels;
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
        job->kernels->backward_rows[a->dtype](
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
        job->kernels->grad_sums[a->dtype](
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
            job->kernels->grad_apply[a->dtype](
                &group, a->weight ? (const char *)a->weight + start * job->param_elsize : NULL, len,
                a->grad_weight ? job->dparams + start : NULL,
                a->grad_bias ? job->dparams + a->row_len + start : NULL);
        }
    }
#if LN_X86
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
    ln_backward_job job = {
        .args = a,
        .kernels = ln_kernels_in_use(),
        .elsize = (ptrdiff_t)ln_dtype_size(a->dtype),
        .param_elsize = a->dtype == LN_F64 ? 8 : 4,
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
        const ptrdiff_t max_blocks = ((ptrdiff_t)1 << 22) / a->row_len;
        job.blocks = a->rows < LN_GRAD_BLOCKS ? a->rows : LN_GRAD_BLOCKS;
        job.blocks = job.blocks < max_blocks ? job.blocks : max_blocks > 1 ? max_blocks : 1;
    }
    const int by_column_spans = a->row_len >= 8 * LN_CHUNK &&
                                (a->rows < LN_GRAD_BLOCKS || a->row_len >= 64 * LN_CHUNK);
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
