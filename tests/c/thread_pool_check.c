/*
 * thread_pool_check.c -- checks the thread pool and the default thread count of
 * src/ln_threads.c, without Python: built with that file alone and run by
 * tests/test_c_checks.py, which also builds it under ThreadSanitizer where it can.
 *
 *     cc -std=c11 -O2 -pthread -Isrc tests/c/thread_pool_check.c src/ln_threads.c -o check
 *     ./check           prints "thread_pool_check: ok", or what failed and exits 1
 *
 * What it checks:
 *   - every job covers [0, n) exactly once, on no more threads than the thread count set, as the
 *     count goes up and down, with several callers at once, and in a child after fork();
 *   - a job wakes only the workers it uses: after the pool grew to 7 workers, jobs of 2 parts
 *     leave the 6 others asleep (Linux: their voluntary context switches in /proc stay put);
 *   - a job does not wait for a sleeping worker: the caller runs the range the worker has not
 *     taken yet (at least once in 10 jobs of 2 one-element parts, each after 50 ms idle);
 *   - the default thread count is min(CPUs in the affinity mask, the cgroup CPU quota rounded
 *     up), from made-up cgroup v1 and v2 files: the root's, and a nested cgroup's and its
 *     parents' as a made-up /proc/self/cgroup names them;
 *   - scratch memory (ln_scratch_take) starts on an LN_SCRATCH_ALIGN boundary and is zeroed when
 *     asked, whether it is the kept buffer (grown through many sizes), a second caller's while
 *     the kept one is in use, or a large results' block.
 */
#define _GNU_SOURCE
#include "ln_internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ThreadSanitizer cannot follow a fork() after threads started */
#if defined(__SANITIZE_THREAD__)
#define UNDER_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_THREAD_SANITIZER 1
#endif
#endif
#ifndef UNDER_THREAD_SANITIZER
#define UNDER_THREAD_SANITIZER 0
#endif

static _Atomic int failures; /* fail() runs on the concurrent callers too */

static void fail(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fputs("thread_pool_check: FAIL: ", stderr);
    vfprintf(stderr, format, args);
    fputc('\n', stderr);
    va_end(args);
    failures++;
}

/* ------------------------------------------------------------------------ */
/* Coverage: each index of a job run exactly once                            */
/* ------------------------------------------------------------------------ */

#define MAX_N 4096
#define MAX_RUNNERS 64

typedef struct {
    _Atomic int hits[MAX_N];           /* times each index was run */
    _Atomic int parts;                 /* ranges run */
    _Atomic long runners[MAX_RUNNERS]; /* thread ids that ran a range, 0 past the last */
} job_record;

static long thread_id(void)
{
#ifdef SYS_gettid
    return (long)syscall(SYS_gettid);
#else
    return (long)(intptr_t)pthread_self();
#endif
}

/* Adds the calling thread to record->runners unless it is there already. */
static void note_runner(job_record *record)
{
    const long self = thread_id();
    for (int k = 0; k < MAX_RUNNERS; k++) {
        long seen = 0;
        if (atomic_compare_exchange_strong(&record->runners[k], &seen, self) || seen == self) {
            return;
        }
    }
}

static void record_range(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    job_record *record = ctx;
    atomic_fetch_add(&record->parts, 1);
    note_runner(record);
    for (ptrdiff_t i = begin; i < end; i++) {
        atomic_fetch_add(&record->hits[i], 1);
    }
}

static int runner_count(job_record *record)
{
    int count = 0;
    while (count < MAX_RUNNERS && atomic_load(&record->runners[count])) {
        count++;
    }
    return count;
}

/* Runs one job over [0, n) and checks it against the thread count `threads` in effect. */
static void check_job(const char *where, ptrdiff_t n, ptrdiff_t min_per_part, int threads)
{
    job_record *record = calloc(1, sizeof *record);
    ln_parallel_for(n, min_per_part, record_range, record);
    for (ptrdiff_t i = 0; i < n; i++) {
        if (atomic_load(&record->hits[i]) != 1) {
            fail("%s: n %td, index %td run %d times", where, n, i, atomic_load(&record->hits[i]));
            break;
        }
    }
    if (atomic_load(&record->parts) > 1 + (threads - 1) * LN_POOL_PIECES) {
        fail("%s: n %td in %d pieces at %d threads", where, n, atomic_load(&record->parts), threads);
    }
    if (runner_count(record) > threads) {
        fail("%s: n %td run by %d threads at %d threads", where, n, runner_count(record), threads);
    }
    free(record);
}

static void check_caller_takes_sleeping_workers_ranges(void)
{
    const struct timespec idle = {0, 50000000}; /* far longer than a worker spins */
    job_record *record = calloc(1, sizeof *record);
    ln_threads_set(2);
    check_job("taking: first job", 2, 1, 2);
    int caller_ran_both = 0;
    for (int job = 0; job < 10 && !caller_ran_both; job++) {
        nanosleep(&idle, NULL);
        memset(record, 0, sizeof *record);
        ln_parallel_for(2, 1, record_range, record);
        if (atomic_load(&record->hits[0]) != 1 || atomic_load(&record->hits[1]) != 1) {
            fail("taking: a job of 2 parts ran its elements %d and %d times", atomic_load(&record->hits[0]),
                 atomic_load(&record->hits[1]));
        }
        caller_ran_both = runner_count(record) == 1 && atomic_load(&record->runners[0]) == thread_id();
    }
    if (!caller_ran_both) {
        fail("taking: in 10 jobs after idle the sleeping worker's range never ran on the caller");
    }
    free(record);
}

static void check_coverage(void)
{
    static const int thread_counts[] = {1, 2, 3, 8, 5, 2, 1, 8, 4};
    static const ptrdiff_t sizes[] = {0, 1, 2, 7, 8, 100, MAX_N};
    for (size_t t = 0; t < sizeof thread_counts / sizeof *thread_counts; t++) {
        ln_threads_set(thread_counts[t]);
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
            check_job("coverage", sizes[s], 1, thread_counts[t]);
            check_job("coverage, 3 a part at least", sizes[s], 3, thread_counts[t]);
        }
    }
}

/* Several callers at once: whoever finds the pool busy runs alone; all finish. */
static void *caller_main(void *arg)
{
    for (int round = 0; round < 200; round++) {
        check_job("concurrent callers", 1 + round * 17 % MAX_N, 1, 4);
    }
    return arg;
}

static void check_concurrent_callers(void)
{
    pthread_t callers[4];
    ln_threads_set(4);
    for (int k = 0; k < 4; k++) {
        pthread_create(&callers[k], NULL, caller_main, NULL);
    }
    for (int k = 0; k < 4; k++) {
        pthread_join(callers[k], NULL);
    }
}

/* The child of a fork() has none of the parent's workers and starts its own. */
static void check_fork(void)
{
    ln_threads_set(4);
    check_job("before fork", MAX_N, 1, 4);
    fflush(stderr);
    const pid_t child = fork();
    if (child == 0) {
        failures = 0;  /* the child's own */
        check_job("after fork, in the child", MAX_N, 1, 4);
        _exit(failures ? 1 : 0);
    }
    int status = 0;
    if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
        fail("fork: the child's job failed (status %d)", status);
    }
}

/* ------------------------------------------------------------------------ */
/* Waking: a job wakes only the workers it uses (Linux)                      */
/* ------------------------------------------------------------------------ */

#ifdef __linux__

/* The task's scheduler state letter from /proc/self/task/<tid>/stat ('S': asleep), or '?'. */
static char task_state(long tid)
{
    char path[64], text[512];
    snprintf(path, sizeof path, "/proc/self/task/%ld/stat", tid);
    FILE *file = fopen(path, "r");
    const size_t length = file ? fread(text, 1, sizeof text - 1, file) : 0;
    if (file) {
        fclose(file);
    }
    text[length] = '\0';
    const char *after_name = strrchr(text, ')');  /* the name in parentheses may hold spaces */
    return after_name && after_name[1] == ' ' ? after_name[2] : '?';
}

/* The task's voluntary context switches: one each time it went to sleep. */
static long task_sleeps(long tid)
{
    char path[64], line[256];
    long sleeps = -1;
    snprintf(path, sizeof path, "/proc/self/task/%ld/status", tid);
    FILE *file = fopen(path, "r");
    while (file && fgets(line, sizeof line, file)) {
        if (sscanf(line, "voluntary_ctxt_switches: %ld", &sleeps) == 1) {
            break;
        }
    }
    if (file) {
        fclose(file);
    }
    return sleeps;
}

/* Waits until every task sleeps: the workers spin a while after a job before they do.
   Returns 0, or -1 if some task still runs after a minute. */
static int wait_until_asleep(const long *tasks, int count)
{
    const struct timespec pause = {0, 2000000};
    for (int tries = 0; tries < 30000; tries++) {
        int asleep = 0;
        while (asleep < count && task_state(tasks[asleep]) == 'S') {
            asleep++;
        }
        if (asleep == count) {
            return 0;
        }
        nanosleep(&pause, NULL);
    }
    return -1;
}

static _Atomic int ranges_started;

/* record_range, then a wait until 8 ranges have started (at most 10 s): a job of 8 parts
   run by this is run by 8 threads, since the caller takes no worker's range while it waits
   in its own. */
static void record_range_of_8_together(void *ctx, ptrdiff_t begin, ptrdiff_t end)
{
    record_range(ctx, begin, end);
    atomic_fetch_add(&ranges_started, 1);
    const struct timespec pause = {0, 100000};
    for (int tries = 0; tries < 100000 && atomic_load(&ranges_started) < 8; tries++) {
        nanosleep(&pause, NULL);
    }
}

static void check_wakes_only_used_workers(void)
{
    long workers[MAX_RUNNERS], before[MAX_RUNNERS];
    job_record *record = calloc(1, sizeof *record);

    /* the pool's workers are the threads other than this one that run parts of 8 */
    ln_threads_set(8);
    ln_parallel_for(8, 1, record_range_of_8_together, record);
    int count = 0;
    for (int k = 0; k < runner_count(record); k++) {
        if (atomic_load(&record->runners[k]) != thread_id()) {
            workers[count++] = atomic_load(&record->runners[k]);
        }
    }
    if (count != 7) {
        fail("waking: a job of 8 parts ran on %d workers, not 7", count);
        goto done;
    }
    memset(record, 0, sizeof *record);
    if (wait_until_asleep(workers, count) != 0) {
        fail("waking: the workers never went to sleep");
        goto done;
    }
    for (int k = 0; k < count; k++) {
        before[k] = task_sleeps(workers[k]);
    }

    ln_threads_set(2);
    for (int round = 0; round < 100; round++) {
        ln_parallel_for(MAX_N, 1, record_range, record);
    }
    if (runner_count(record) > 2) {
        fail("waking: jobs of 2 parts ran on %d threads", runner_count(record));
    }
    if (wait_until_asleep(workers, count) != 0) {
        fail("waking: the workers never went back to sleep");
        goto done;
    }
    int woken = 0;
    for (int k = 0; k < count; k++) {
        const long tid = workers[k];
        const int ran = tid == atomic_load(&record->runners[0]) || tid == atomic_load(&record->runners[1]);
        const int slept_again = task_sleeps(tid) != before[k];
        woken += slept_again;
        /* woken and running nothing is allowed: the caller may have taken its ranges first */
        if (ran && !slept_again) {
            fail("waking: worker %ld ran parts without being woken", tid);
        }
    }
    if (woken != 1) {
        fail("waking: %d of 7 workers woken for jobs of 2 parts, not 1", woken);
    }
done:
    free(record);
}

#endif

/* ------------------------------------------------------------------------ */
/* Default thread count: affinity mask and cgroup CPU quota                  */
/* ------------------------------------------------------------------------ */

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *file = fopen(path, "w");
    if (!file) {
        fail("cannot write %s", path);
        return;
    }
    fputs(text, file);
    fclose(file);
}

static void remove_file(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    remove(path);
}

static long affinity_cpus(void)
{
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        return CPU_COUNT(&set);
    }
#endif
    return sysconf(_SC_NPROCESSORS_ONLN);
}

/* The default under cgroup root `dir`, the process in the cgroups the file self_cgroup lists. */
static void expect_default_of(const char *dir, const char *self_cgroup, const char *what, long quota_cpus)
{
    long cpus = affinity_cpus();
    if (quota_cpus > 0 && quota_cpus < cpus) {
        cpus = quota_cpus;
    }
    cpus = cpus > LN_MAX_THREADS ? LN_MAX_THREADS : cpus;
    const int got = ln_threads_default_in(dir, self_cgroup);
    if (got != cpus) {
        fail("default threads with %s: %d, not %ld", what, got, cpus);
    }
}

/* ... the process in the root cgroup (as in a container: no /proc/self/cgroup to read). */
static void expect_default(const char *dir, const char *what, long quota_cpus)
{
    expect_default_of(dir, "/nonexistent", what, quota_cpus);
}

static void check_default_threads(void)
{
    char root[] = "/tmp/ln-cgroup-XXXXXX";
    if (!mkdtemp(root)) {
        fail("mkdtemp failed");
        return;
    }
    char v1[sizeof root + 8];
    snprintf(v1, sizeof v1, "%s/cpu", root);
    mkdir(v1, 0700);

    expect_default(root, "no cgroup files", 0);
    expect_default("/nonexistent", "no cgroup directory", 0);

    /* cgroup v2 */
    write_file(root, "cpu.max", "max 100000\n");
    expect_default(root, "v2 max 100000", 0);
    write_file(root, "cpu.max", "100000 100000\n");
    expect_default(root, "v2 quota of 1 CPU", 1);
    write_file(root, "cpu.max", "50000 100000\n");
    expect_default(root, "v2 quota of half a CPU", 1);
    write_file(root, "cpu.max", "150000 100000\n");
    expect_default(root, "v2 quota of 1.5 CPUs", 2);
    write_file(root, "cpu.max", "200000 100000\n");
    expect_default(root, "v2 quota of 2 CPUs", 2);
    write_file(root, "cpu.max", "100000000 1000\n");
    expect_default(root, "v2 quota of 100000 CPUs", 0);
    write_file(root, "cpu.max", "99999999999999999999999 1\n");
    expect_default(root, "v2 quota past 64 bits", 0);
    write_file(root, "cpu.max", "garbage\n");
    expect_default(root, "v2 garbage", 0);
    write_file(root, "cpu.max", "");
    expect_default(root, "v2 empty file", 0);

    /* cgroup v1, read only where there is no cpu.max */
    write_file(v1, "cpu.cfs_quota_us", "100000\n");
    write_file(v1, "cpu.cfs_period_us", "100000\n");
    write_file(root, "cpu.max", "max 100000\n");
    expect_default(root, "v2 max besides a v1 quota", 0);
    remove_file(root, "cpu.max");
    expect_default(root, "v1 quota of 1 CPU", 1);
    write_file(v1, "cpu.cfs_quota_us", "-1\n");
    expect_default(root, "v1 quota -1", 0);
    write_file(v1, "cpu.cfs_quota_us", "250000\n");
    expect_default(root, "v1 quota of 2.5 CPUs", 3);
    write_file(v1, "cpu.cfs_period_us", "0\n");
    expect_default(root, "v1 period 0", 0);
    remove_file(v1, "cpu.cfs_period_us");
    expect_default(root, "v1 quota without a period", 0);

    remove_file(v1, "cpu.cfs_quota_us");

    /* a process below the root (a service with systemd's CPUQuota=): its cgroup and every one
       above it count, the smallest quota wins */
    char self[sizeof root + 16], v2_a[sizeof root + 8], v2_ab[sizeof root + 8], v1_svc[sizeof root + 8];
    snprintf(self, sizeof self, "%s/self-cgroup", root);
    snprintf(v2_a, sizeof v2_a, "%s/a", root);
    snprintf(v2_ab, sizeof v2_ab, "%s/a/b", root);
    snprintf(v1_svc, sizeof v1_svc, "%s/cpu/svc", root);
    mkdir(v2_a, 0700);
    mkdir(v2_ab, 0700);
    mkdir(v1_svc, 0700);
    write_file(root, "self-cgroup", "0::/a/b\n");
    write_file(root, "cpu.max", "max 100000\n");
    write_file(v2_ab, "cpu.max", "100000 100000\n");
    expect_default_of(root, self, "v2 quota of 1 CPU on the process's own cgroup", 1);
    write_file(v2_ab, "cpu.max", "max 100000\n");
    write_file(v2_a, "cpu.max", "150000 100000\n");
    expect_default_of(root, self, "v2 quota of 1.5 CPUs on its parent", 2);
    write_file(v2_ab, "cpu.max", "300000 100000\n");
    write_file(v2_a, "cpu.max", "100000 100000\n");
    expect_default_of(root, self, "v2 parent's 1 CPU below the child's 3", 1);
    write_file(root, "self-cgroup", "0::/../a/b\n");
    expect_default_of(root, self, "v2 cgroup outside the visible tree", 0);
    remove_file(v2_ab, "cpu.max");
    remove_file(v2_a, "cpu.max");
    remove_file(root, "cpu.max");
    write_file(root, "self-cgroup", "5:cpuset:/a\n3:cpu,cpuacct:/svc\n1:name=systemd:/a/b\n");
    write_file(v1_svc, "cpu.cfs_quota_us", "100000\n");
    write_file(v1_svc, "cpu.cfs_period_us", "100000\n");
    expect_default_of(root, self, "v1 quota of 1 CPU on the process's cpu cgroup", 1);
    write_file(root, "self-cgroup", "3:cpuacct:/svc\n");
    expect_default_of(root, self, "v1 cpu cgroup not listed", 0);
    remove_file(v1_svc, "cpu.cfs_quota_us");
    remove_file(v1_svc, "cpu.cfs_period_us");
    remove_file(root, "self-cgroup");
    rmdir(v1_svc);
    rmdir(v2_ab);
    rmdir(v2_a);
    rmdir(v1);
    rmdir(root);

    const int threads = ln_threads_default();
    if (threads < 1 || threads > LN_MAX_THREADS || threads > affinity_cpus()) {
        fail("ln_threads_default() is %d with %ld CPUs in the affinity mask", threads, affinity_cpus());
    }
}

/* count doubles from ln_scratch_take: aligned, zeroed if asked (then written, so the next take
   of the same buffer must zero it again), and from the source expected. */
static double *take_checked(size_t count, int zeroed, ln_scratch_source expected, ln_scratch_source *source)
{
    double *data = ln_scratch_take(count, zeroed, source);
    if (!data) {
        fail("scratch of %zu doubles: out of memory", count);
        return NULL;
    }
    if ((uintptr_t)data % LN_SCRATCH_ALIGN != 0) {
        fail("scratch of %zu doubles starts %u bytes into a %d-byte line", count,
             (unsigned)((uintptr_t)data % LN_SCRATCH_ALIGN), LN_SCRATCH_ALIGN);
    }
    if (*source != expected) {
        fail("scratch of %zu doubles came from source %d, not %d", count, (int)*source, (int)expected);
    }
    for (size_t i = 0; zeroed && i < count; i++) {
        if (data[i] != 0.0) {
            fail("scratch of %zu doubles asked zeroed has %g at %zu", count, data[i], i);
            break;
        }
    }
    for (size_t i = 0; i < count; i++) {
        data[i] = 1.5;
    }
    return data;
}

static void check_scratch(void)
{
    /* sizes that grow, so the kept buffer is allocated anew for each (malloc's 16-byte
       alignment would start most of them off a line) */
    static const size_t counts[] = {1, 3, 17, 100, 1001, 4099, 20000, 70001, 300007};
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        for (int zeroed = 0; zeroed < 2; zeroed++) {
            ln_scratch_source kept, second;
            double *data = take_checked(counts[c], zeroed, LN_SCRATCH_KEPT, &kept);
            /* another call while this one holds the kept buffer */
            double *other = take_checked(counts[c], 1, LN_SCRATCH_MALLOC, &second);
            ln_scratch_give(other, second);
            ln_scratch_give(data, kept);
        }
    }
    ln_scratch_source block;
    double *large = take_checked(LN_SCRATCH_MAX / sizeof(double) + 1, 1, LN_SCRATCH_BLOCK, &block);
    ln_scratch_give(large, block);
}

int main(void)
{
    check_coverage();
    check_caller_takes_sleeping_workers_ranges();
    check_concurrent_callers();
#ifdef __linux__
    check_wakes_only_used_workers();
#endif
    if (!UNDER_THREAD_SANITIZER) {
        check_fork();
    }
    check_default_threads();
    check_scratch();
    if (failures) {
        fprintf(stderr, "thread_pool_check: %d failures\n", failures);
        return 1;
    }
    printf("thread_pool_check: ok\n");
    return 0;
}
