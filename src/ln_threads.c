/*
 * ln_threads.c -- the thread pool that runs a call's parts, how many threads it uses by
 * default, the scratch buffer that backward keeps between calls, and the faulting in of new
 * results' pages (ln_buffers.c maps them).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

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
 * ranges; the caller runs range 0 and hands range k to worker k through worker k's
 * own slot, so a job wakes only the parts - 1 workers it uses however many the pool
 * has.  Workers spin briefly for their next range (back-to-back calls are common)
 * before sleeping on their slot's condition variable.  Range k is cut into
 * LN_POOL_PIECES pieces, each run by whoever takes it first: worker k, or the caller
 * once its own range is done.  So a call never waits for a sleeping worker to wake (on a
 * 2-core virtual machine that took up to 0.6 ms), and a worker that wakes late still
 * takes the pieces left.  Which thread runs a piece does not change its result.  A
 * second concurrent caller, finding the pool busy, runs its job alone, so calls from
 * several Python threads never wait on each other.  After fork() the child starts with
 * no workers and makes new ones on first use.
 */

/* Worker k's slot, a cache line of its own so that handing one worker its range does
   not disturb another worker's spin. */
typedef struct {
    _Alignas(64) _Atomic unsigned jobs; /* ranges handed to this worker; only the caller bumps it */
    _Atomic uint64_t next_piece;        /* (job << 32) | the job's next piece of this range to take */
    pthread_mutex_t lock;               /* guards sleeping on and waking `wake` */
    pthread_cond_t wake;                /* the worker sleeps here while `jobs` stays put */
} ln_worker_slot;

static struct {
    pthread_mutex_t busy;      /* held by the caller running a parallel job */
    pthread_mutex_t done_lock; /* guards sleeping on and waking `done` */
    pthread_cond_t done;       /* the caller waits here for the last worker */
    int workers;               /* worker threads started: slots 1 .. workers */
    _Atomic int threads;       /* threads a job may use, caller included */
    _Atomic int pending;       /* pieces of the current job outside the caller's range not yet run */
    ln_range_fn fn;
    void *ctx;
    ptrdiff_t n;
    int parts;
    ln_worker_slot slot[LN_MAX_THREADS]; /* slot[k] for worker k; slot[0], the caller's, unused */
} ln_pool = {
    .busy = PTHREAD_MUTEX_INITIALIZER,
    .done_lock = PTHREAD_MUTEX_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
    .threads = 0,
};

void ln_range_of_part(ptrdiff_t n, int parts, int part, ptrdiff_t *begin, ptrdiff_t *end)
{
    assert(n >= 0 && 0 <= part && part < parts);
    *begin = (ptrdiff_t)((long double)n * part / parts);
    *end = (ptrdiff_t)((long double)n * (part + 1) / parts);
}

static void ln_finish_piece(void)
{
    if (atomic_fetch_sub(&ln_pool.pending, 1) == 1) {
        pthread_mutex_lock(&ln_pool.done_lock);
        pthread_cond_signal(&ln_pool.done);
        pthread_mutex_unlock(&ln_pool.done_lock);
    }
}

/* Runs the pieces of range k (slot `slot`) of job `job` that no other thread has taken;
   each one run counts down `pending`.  A thread still holding an earlier job's number takes
   nothing: each job starts its slots' counts again under its own number. */
static void ln_run_pieces(ln_worker_slot *slot, int k, unsigned job)
{
    uint64_t next = atomic_load(&slot->next_piece);
    while ((unsigned)(next >> 32) == job && (next & 0xffffffffu) < LN_POOL_PIECES) {
        if (!atomic_compare_exchange_weak(&slot->next_piece, &next, next + 1)) {
            continue;  /* `next` now holds the count another thread left */
        }
        /* the job's fields stay put until this piece counts down `pending` */
        const int parts = ln_pool.parts, piece = (int)(next & 0xffffffffu);
        ptrdiff_t begin, end;
        ln_range_of_part(ln_pool.n, parts * LN_POOL_PIECES, k * LN_POOL_PIECES + piece, &begin, &end);
        if (begin < end) {
            ln_pool.fn(ln_pool.ctx, begin, end);
        }
        ln_finish_piece();
        next = atomic_load(&slot->next_piece);
    }
}

/* Worker k runs the pieces of range k of each job handed to it that the caller has not
   taken.  The caller hands out the next job only when every piece of this one has been
   run, so the job's fields are stable while a worker that took a piece reads them. */
static void *ln_worker_main(void *arg)
{
    const int index = (int)(intptr_t)arg;
    ln_worker_slot *const slot = &ln_pool.slot[index];
    unsigned seen = 0; /* ln_pool_grow started the slot at 0 */
    for (;;) {
        unsigned now = atomic_load(&slot->jobs);
        for (int spin = 0; now == seen && spin < LN_SPIN_ITERATIONS; spin++) {
            ln_spin_pause();
            now = atomic_load(&slot->jobs);
        }
        if (now == seen) {
            pthread_mutex_lock(&slot->lock);
            while ((now = atomic_load(&slot->jobs)) == seen) {
                pthread_cond_wait(&slot->wake, &slot->lock);
            }
            pthread_mutex_unlock(&slot->lock);
        }
        seen = now;
        ln_run_pieces(slot, index, now);
    }
    return NULL;
}

static void ln_pool_after_fork_child(void)
{
    pthread_mutex_init(&ln_pool.busy, NULL);
    pthread_mutex_init(&ln_pool.done_lock, NULL);
    pthread_cond_init(&ln_pool.done, NULL);
    ln_pool.workers = 0; /* ln_pool_grow sets up each slot again as it starts its worker */
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
    assert(wanted < LN_MAX_THREADS);
    pthread_once(&ln_fork_handlers_once, ln_register_fork_handlers);
    while (ln_pool.workers < wanted) {
        const int index = ln_pool.workers + 1;
        ln_worker_slot *const slot = &ln_pool.slot[index];
        atomic_store(&slot->jobs, 0);
        atomic_store(&slot->next_piece, LN_POOL_PIECES);  /* job 0's pieces, all taken */
        pthread_mutex_init(&slot->lock, NULL);
        pthread_cond_init(&slot->wake, NULL);
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, ln_worker_main, (void *)(intptr_t)index);
        pthread_attr_destroy(&attr);
        if (failed) {
            pthread_cond_destroy(&slot->wake);
            pthread_mutex_destroy(&slot->lock);
            break;
        }
        ln_pool.workers = index;
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
    const int workers = ln_pool_grow(parts - 1);
    if (workers < parts - 1) {
        parts = workers + 1;
    }
    ln_pool.fn = fn;
    ln_pool.ctx = ctx;
    ln_pool.n = n;
    ln_pool.parts = parts;
    atomic_store(&ln_pool.pending, (parts - 1) * LN_POOL_PIECES);
    for (int k = 1; k < parts; k++) {
        ln_worker_slot *const slot = &ln_pool.slot[k];
        const unsigned job = atomic_load(&slot->jobs) + 1;
        atomic_store(&slot->next_piece, (uint64_t)job << 32);
        atomic_store(&slot->jobs, job);
        /* under the slot's lock: a worker between its last look at `jobs` and its wait
           would miss a signal sent without it */
        pthread_mutex_lock(&slot->lock);
        pthread_cond_signal(&slot->wake);
        pthread_mutex_unlock(&slot->lock);
    }

    /* the caller's range: pieces 0 .. LN_POOL_PIECES - 1, whole */
    ptrdiff_t begin, end, unused;
    ln_range_of_part(n, parts * LN_POOL_PIECES, 0, &begin, &unused);
    ln_range_of_part(n, parts * LN_POOL_PIECES, LN_POOL_PIECES - 1, &unused, &end);
    fn(ctx, begin, end);
    /* the pieces no worker has taken yet (it may be asleep), the last range first */
    for (int k = parts - 1; k >= 1; k--) {
        ln_run_pieces(&ln_pool.slot[k], k, atomic_load(&ln_pool.slot[k].jobs));
    }

    for (int spin = 0; atomic_load(&ln_pool.pending) > 0 && spin < LN_SPIN_ITERATIONS; spin++) {
        ln_spin_pause();
    }
    if (atomic_load(&ln_pool.pending) > 0) {
        pthread_mutex_lock(&ln_pool.done_lock);
        while (atomic_load(&ln_pool.pending) > 0) {
            pthread_cond_wait(&ln_pool.done, &ln_pool.done_lock);
        }
        pthread_mutex_unlock(&ln_pool.done_lock);
    }
    pthread_mutex_unlock(&ln_pool.busy);
}

/* ------------------------------------------------------------------------ */
/* Thread count                                                              */
/* ------------------------------------------------------------------------ */

/* The CPUs the affinity mask allows or, where there are no masks (macOS), the CPUs online. */
static long ln_cpus_allowed(void)
{
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        return CPU_COUNT(&set);
    }
#endif
    return sysconf(_SC_NPROCESSORS_ONLN);
}

/* The first line of dir/name, at most size - 1 bytes, into line.  Returns 0, or -1 when
   the file cannot be read. */
static int ln_read_first_line(const char *dir, const char *name, char *line, size_t size)
{
    char path[4096];
    const int length = snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *file = length > 0 && (size_t)length < sizeof path ? fopen(path, "r") : NULL;
    if (!file) {
        return -1;
    }
    const int got_line = fgets(line, (int)size, file) != NULL;
    fclose(file);
    return got_line ? 0 : -1;
}

/* The CPUs that `quota` microseconds of CPU time every `period` microseconds keep busy,
   rounded up; 0 when that is no limit (v1 writes -1, and v2's "max" parses as 0). */
static long ln_cpus_of_quota(long long quota, long long period)
{
    if (quota <= 0 || period <= 0) {
        return 0;
    }
    const long long cpus = quota / period + (quota % period != 0);
    return cpus < LN_MAX_THREADS ? (long)cpus : LN_MAX_THREADS;
}

/* The CPUs one cgroup's quota allows, or 0 when it sets none: v2's cpu.max ("<quota>
   <period>" or "max <period>") in `dir`, or v1's cpu.cfs_quota_us and cpu.cfs_period_us.
   *found: whether the file was there to read. */
static long ln_cgroup_v2_limit(const char *dir, int *found)
{
    char line[64];
    *found = ln_read_first_line(dir, "cpu.max", line, sizeof line) == 0;
    if (!*found) {
        return 0;
    }
    char *after_quota;
    const long long quota = strtoll(line, &after_quota, 10);
    return ln_cpus_of_quota(quota, strtoll(after_quota, NULL, 10));
}

static long ln_cgroup_v1_limit(const char *dir, int *found)
{
    char quota_line[64], period_line[64];
    *found = ln_read_first_line(dir, "cpu.cfs_quota_us", quota_line, sizeof quota_line) == 0 &&
             ln_read_first_line(dir, "cpu.cfs_period_us", period_line, sizeof period_line) == 0;
    return *found ? ln_cpus_of_quota(strtoll(quota_line, NULL, 10), strtoll(period_line, NULL, 10)) : 0;
}

/* The process's cgroup in the hierarchy `want` of a /proc/self/cgroup file (lines
   "<id>:<controllers>:<path>"): v2's, the line "0::<path>", where `want` is NULL, else the
   v1 line whose controllers include `want`.  Into path; "" where there is none, or where the
   cgroup lies outside the visible tree (a path with ".."). */
static void ln_self_cgroup(const char *self_cgroup, const char *want, char *path, size_t size)
{
    char line[4096];
    path[0] = '\0';
    FILE *file = fopen(self_cgroup, "r");
    while (file && fgets(line, sizeof line, file)) {
        char *controllers = strchr(line, ':');
        char *cgroup = controllers ? strchr(controllers + 1, ':') : NULL;
        if (!cgroup) {
            continue;
        }
        *controllers++ = '\0';
        *cgroup++ = '\0';
        cgroup[strcspn(cgroup, "\n")] = '\0';
        int match = !want && strcmp(line, "0") == 0 && controllers[0] == '\0';
        for (const char *name = controllers; want && !match && *name;) {  /* "cpu,cpuacct" */
            const size_t length = strcspn(name, ",");
            match = length == strlen(want) && strncmp(name, want, length) == 0;
            name += length + (name[length] == ',');
        }
        if (match && strlen(cgroup) < size && !strstr(cgroup, "..")) {
            strcpy(path, cgroup);
            break;
        }
    }
    if (file) {
        fclose(file);
    }
}

/* The smallest limit of the cgroups from mount + cgroup up to mount (limit_of's, 0 for none;
   *found: whether any of them had the files). */
static long ln_cgroup_tree_limit(const char *mount, const char *cgroup, long (*limit_of)(const char *, int *),
                                 int *found)
{
    char dir[4096];
    long limit = 0;
    *found = 0;
    if (snprintf(dir, sizeof dir, "%s%s", mount, cgroup) >= (int)sizeof dir) {
        snprintf(dir, sizeof dir, "%s", mount);
    }
    const size_t mount_length = strlen(mount);
    for (;;) {
        int here;
        const long cpus = limit_of(dir, &here);
        *found |= here;
        limit = cpus > 0 && (limit == 0 || cpus < limit) ? cpus : limit;
        char *last = strrchr(dir + mount_length, '/');
        if (!last) {
            return limit;
        }
        *last = '\0';  /* the parent cgroup; the mount itself last */
    }
}

/* The CPUs the cgroup CPU quota allows, or 0 when none is set: the smallest quota of the
   process's cgroup and of every cgroup above it (a quota set on a parent limits its
   children), v2's where cpu.max files exist, else v1's cpu controller's.  Containers see their
   own cgroup as the root, a service on a host (systemd's CPUQuota=) sits below it. */
static long ln_cgroup_cpu_limit(const char *cgroup_root, const char *self_cgroup)
{
    char cgroup[2048], mount[4096];
    int found;
    ln_self_cgroup(self_cgroup, NULL, cgroup, sizeof cgroup);
    const long v2 = ln_cgroup_tree_limit(cgroup_root, cgroup, ln_cgroup_v2_limit, &found);
    if (found) {
        return v2;
    }
    ln_self_cgroup(self_cgroup, "cpu", cgroup, sizeof cgroup);
    snprintf(mount, sizeof mount, "%s/cpu", cgroup_root);
    return ln_cgroup_tree_limit(mount, cgroup, ln_cgroup_v1_limit, &found);
}

int ln_threads_default_in(const char *cgroup_root, const char *self_cgroup)
{
    long cpus = ln_cpus_allowed();
    const long limit = ln_cgroup_cpu_limit(cgroup_root, self_cgroup);
    if (limit > 0 && limit < cpus) {
        cpus = limit;
    }
    return cpus < 1 ? 1 : cpus > LN_MAX_THREADS ? LN_MAX_THREADS : (int)cpus;
}

int ln_threads_default(void)
{
    return ln_threads_default_in("/sys/fs/cgroup", "/proc/self/cgroup");
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
 * ln_tuning.h); a call that finds it in use by another thread allocates its own.  More than
 * that comes from the large results' blocks (ln_buffer_alloc): mapped on huge pages, and
 * cached after the call as a freed result is.  calloc mapped it anew in 4 KiB pages every
 * call: a backward of 2x4000000 float32 (64 MiB of float64 column sums) took 52-55 ms at one
 * thread, 8x1000000 (16 MB, the kept buffer) 6-7 ms.
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

/* count doubles from malloc's heap, LN_SCRATCH_ALIGN-aligned (count is at most LN_SCRATCH_MAX
   bytes); free() gives them back. */
static double *ln_scratch_alloc(size_t count)
{
    void *data = NULL;
    return posix_memalign(&data, LN_SCRATCH_ALIGN, count * sizeof(double)) == 0 ? data : NULL;
}

double *ln_scratch_take(size_t count, int zeroed, ln_scratch_source *source)
{
    pthread_once(&ln_fork_handlers_once, ln_register_fork_handlers);
    if (count > LN_SCRATCH_MAX / sizeof(double)) {
        *source = LN_SCRATCH_BLOCK;
        return count > SIZE_MAX / sizeof(double) ? NULL : ln_buffer_alloc(count * sizeof(double), zeroed);
    }
    *source = LN_SCRATCH_MALLOC;
    if (pthread_mutex_trylock(&ln_scratch.lock) != 0) {
        double *data = ln_scratch_alloc(count);
        if (data && zeroed) {
            memset(data, 0, count * sizeof(double));
        }
        return data;
    }
    if (ln_scratch.count < count) {
        free(ln_scratch.data);
        ln_scratch.data = ln_scratch_alloc(count);
        ln_scratch.count = ln_scratch.data ? count : 0;
        if (!ln_scratch.data) {
            pthread_mutex_unlock(&ln_scratch.lock);
            return NULL;
        }
    }
    if (zeroed) {
        memset(ln_scratch.data, 0, count * sizeof(double));
    }
    *source = LN_SCRATCH_KEPT;
    return ln_scratch.data;
}

void ln_scratch_give(double *data, ln_scratch_source source)
{
    switch (source) {
    case LN_SCRATCH_KEPT:
        pthread_mutex_unlock(&ln_scratch.lock);
        break;
    case LN_SCRATCH_BLOCK:
        ln_buffer_free(data);
        break;
    case LN_SCRATCH_MALLOC:
        free(data);
        break;
    }
}

/* ------------------------------------------------------------------------ */
/* Faulting in new results                                                   */
/* ------------------------------------------------------------------------ */

typedef struct {
    uintptr_t start, end;  /* the whole pages of the memory */
} ln_fault_in_job;

/* Pieces [begin, end) of the memory, counted in LN_FAULT_IN_PIECE from the one holding
   start, faulted in. */
static void ln_fault_in_pieces(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
#if defined(MADV_POPULATE_WRITE)
    const ln_fault_in_job *job = ctx;
    const uintptr_t base = job->start & ~(LN_FAULT_IN_PIECE - 1);
    const uintptr_t first = base + (uintptr_t)begin * LN_FAULT_IN_PIECE;
    const uintptr_t last = base + (uintptr_t)end * LN_FAULT_IN_PIECE;
    const uintptr_t from = first > job->start ? first : job->start, to = last < job->end ? last : job->end;
    /* before Linux 5.14 this fails, and the pages fault in as the kernel writes them */
    (void)madvise((void *)from, to - from, MADV_POPULATE_WRITE);
#else
    (void)ctx;
    (void)begin;
    (void)end;
#endif
}

void ln_fault_in(void *data, size_t bytes)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    ln_fault_in_job job = {.start = ((uintptr_t)data + page - 1) & ~(page - 1),
                           .end = ((uintptr_t)data + bytes) & ~(page - 1)};
    if (job.end <= job.start) {
        return;
    }
    const uintptr_t base = job.start & ~(LN_FAULT_IN_PIECE - 1);
    const ptrdiff_t pieces = (ptrdiff_t)((job.end - base + LN_FAULT_IN_PIECE - 1) / LN_FAULT_IN_PIECE);
    ln_parallel_for(pieces, 1, ln_fault_in_pieces, &job);
}
