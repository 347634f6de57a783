/*
 * ln_threads.c -- the thread pool that runs a call's parts, and the scratch buffer that
 * backward keeps between calls.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "ln_internal.h"

/* One step of a spin wait: a hint that lets the core's other hardware thread run. */
static inline void ln_spin_pause(void)
{
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
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

void ln_range_of_part(ptrdiff_t n, int parts, int part, ptrdiff_t *begin, ptrdiff_t *end)
{
    assert(n >= 0 && 0 <= part && part < parts);
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
            ln_spin_pause();
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

void ln_parallel_for(ptrdiff_t n, ptrdiff_t min_per_part, ln_range_fn fn, void *ctx)
{
    assert(n >= 0 && fn);
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
        ln_spin_pause();
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
#else
    /* no affinity masks (macOS): the CPUs online */
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online > 0) {
        return online < LN_MAX_THREADS ? (int)online : LN_MAX_THREADS;
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
/* Scratch memory                                                            */
/* ------------------------------------------------------------------------ */

/*
 * One zeroed buffer of up to LN_SCRATCH_MAX bytes is kept between calls (see its reason in
 * ln_tuning.h); a call that finds it in use by another thread, or needs more, allocates
 * its own.
 */

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

double *ln_scratch_take(size_t count, int *kept)
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

void ln_scratch_give(double *data, int kept)
{
    if (kept) {
        pthread_mutex_unlock(&ln_scratch.lock);
    }
    else {
        free(data);
    }
}
