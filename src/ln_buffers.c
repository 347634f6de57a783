/*
 * ln_buffers.c -- memory for large results, kept after it is freed for the next result of
 * about the same size.
 *
 * A new mapping costs the OS a zeroed page on every first write: making a 32 MiB result
 * took longer than normalizing into it.  glibc's malloc maps every request that large anew
 * (its largest mmap threshold is 32 MiB), so the same loop over the same shapes paid it on
 * every call.  Here a freed block goes into a small cache, most recent last, up to a limit
 * on the bytes held (ln_buffers_set_limit); a request takes the smallest cached block that
 * holds it without wasting more than an eighth, else maps a new one.
 *
 * A block is one anonymous mapping, started at a huge-page boundary when it spans one:
 *
 *   [page of slack ... header][data: the bytes asked for ...][to the end of the page]
 *
 * with its data 64-byte aligned (whole cache lines for the kernels' non-temporal stores) and
 * a header of LN_BUFFER_HEADER bytes before it that says how large the block is.  Where in
 * its first page the data starts is chosen each time the block is taken (ln_buffers_place):
 * as far as it can be from where the inputs it is computed from start in theirs.  A load that follows a store to an
 * address with the same low 12 bits waits for the store ("4 KiB aliasing"); a result just
 * above its input made every load of the input ahead of the normalize loop's stores wait
 * (Zen 4, 2048x4096 bfloat16 forward, one thread, input 16 bytes into a page: output 64
 * bytes in, 3.5 ms; 0, 256 or 2048 bytes in, 2.0-2.1 ms).
 */
#define _GNU_SOURCE
#include <assert.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ln_internal.h"

#if !defined(MAP_ANONYMOUS) && defined(MAP_ANON)
#define MAP_ANONYMOUS MAP_ANON
#endif

#define LN_BUFFER_HEADER 64
#define LN_HUGE_PAGE ((size_t)2 << 20)
#define LN_PAGE ((size_t)LN_ALIAS_PERIOD)

/* The offset into its first page at which the data of the next block this thread takes
   starts (ln_buffers_place). */
static _Thread_local size_t ln_data_page_offset = LN_PAGE / 2;

typedef struct {
    char *mapping;     /* start of the mapping */
    size_t length;     /* of the mapping */
    size_t requested;  /* bytes asked for by the block's current owner */
} ln_buffer_header;

_Static_assert(sizeof(ln_buffer_header) <= LN_BUFFER_HEADER, "the header fits before the data");

static struct {
    pthread_mutex_t lock;
    char *data[LN_BUFFER_CACHE_BLOCKS];  /* cached blocks' data, oldest first */
    int count;
    size_t held;                         /* their mappings' bytes */
    size_t limit;
} ln_buffers = {.lock = PTHREAD_MUTEX_INITIALIZER, .limit = LN_BUFFER_CACHE_DEFAULT};

static inline ln_buffer_header *ln_header_of(void *data)
{
    return (ln_buffer_header *)((char *)data - LN_BUFFER_HEADER);
}

/* Where data starts in a block's mapping: at page_offset into the first page that leaves room
   for the header; never later than LN_PAGE + LN_BUFFER_HEADER. */
static inline size_t ln_data_start(size_t page_offset)
{
    return page_offset >= LN_BUFFER_HEADER ? page_offset : page_offset + LN_PAGE;
}

/* The bytes a block's data may fill, wherever it starts. */
static inline size_t ln_capacity_of(const ln_buffer_header *header)
{
    return header->length - (LN_PAGE + LN_BUFFER_HEADER);
}

/* The data of the block `mapping` (its header written), at this thread's page offset. */
static char *ln_block_data(char *mapping, size_t length, size_t bytes)
{
    char *data = mapping + ln_data_start(ln_data_page_offset);
    ln_buffer_header *header = (ln_buffer_header *)(data - LN_BUFFER_HEADER);
    header->mapping = mapping;
    header->length = length;
    header->requested = bytes;
    return data;
}

/* A thread that held the lock at fork() does not exist in the child; the cached blocks are
   the child's copies, and stay its to reuse. */
static void ln_buffers_after_fork_child(void)
{
    pthread_mutex_init(&ln_buffers.lock, NULL);
}

static pthread_once_t ln_buffers_fork_once = PTHREAD_ONCE_INIT;

static void ln_buffers_register_fork_handler(void)
{
    pthread_atfork(NULL, NULL, ln_buffers_after_fork_child);
}

/* A new block holding `bytes`, its pages faulted in (ln_fault_in), or NULL. */
static char *ln_block_map(size_t bytes)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (bytes > SIZE_MAX / 2 - LN_PAGE - LN_BUFFER_HEADER - LN_HUGE_PAGE) {
        return NULL;
    }
    const size_t length = (bytes + LN_PAGE + LN_BUFFER_HEADER + page - 1) / page * page;
    /* a huge-page boundary to start at: map one huge page more, unmap what is before and after */
    const size_t slack = length >= LN_HUGE_PAGE ? LN_HUGE_PAGE : 0;
    char *mapped = mmap(NULL, length + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) {
        return NULL;
    }
    char *mapping = mapped;
    if (slack) {
        mapping = (char *)(((uintptr_t)mapped + LN_HUGE_PAGE - 1) & ~(uintptr_t)(LN_HUGE_PAGE - 1));
        if (mapping > mapped) {
            munmap(mapped, (size_t)(mapping - mapped));
        }
        if (mapped + slack > mapping) {
            munmap(mapping + length, (size_t)(mapped + slack - mapping));
        }
#if defined(MADV_HUGEPAGE)
        (void)madvise(mapping, length, MADV_HUGEPAGE);  /* as NumPy does for its large arrays */
#endif
    }
    char *data = ln_block_data(mapping, length, bytes);
    ln_fault_in(data, bytes);
    return data;
}

static void ln_block_unmap(char *data)
{
    const ln_buffer_header *header = ln_header_of(data);
    munmap(header->mapping, header->length);
}

/* Whether a block of `capacity` bytes is the one for `bytes`: it holds them without wasting
   more than an eighth of itself. */
static inline int ln_block_fits(size_t capacity, size_t bytes)
{
    return capacity >= bytes && capacity - bytes <= capacity / 8;
}

/* The index of the smallest cached block that fits `bytes` (ln_block_fits), or -1 (the lock
   is held). */
static int ln_best_cached(size_t bytes)
{
    int best = -1;
    for (int i = 0; i < ln_buffers.count; i++) {
        const size_t capacity = ln_capacity_of(ln_header_of(ln_buffers.data[i]));
        if (ln_block_fits(capacity, bytes) &&
            (best < 0 || capacity < ln_capacity_of(ln_header_of(ln_buffers.data[best])))) {
            best = i;
        }
    }
    return best;
}

/* Removes cached block i, keeping the others' order (the lock is held). */
static char *ln_uncache(int i)
{
    char *data = ln_buffers.data[i];
    ln_buffers.held -= ln_header_of(data)->length;
    memmove(&ln_buffers.data[i], &ln_buffers.data[i + 1], (size_t)(ln_buffers.count - i - 1) * sizeof(char *));
    ln_buffers.count--;
    return data;
}

/* Unmaps the oldest blocks until at most `blocks` are cached in at most `bytes`. */
static void ln_trim_cache(int blocks, size_t bytes)
{
    for (;;) {
        char *evicted = NULL;
        pthread_mutex_lock(&ln_buffers.lock);
        if (ln_buffers.count > blocks || ln_buffers.held > bytes) {
            evicted = ln_uncache(0);
        }
        pthread_mutex_unlock(&ln_buffers.lock);
        if (!evicted) {
            return;
        }
        ln_block_unmap(evicted);
    }
}

void *ln_buffer_alloc(size_t bytes, int zeroed)
{
    pthread_once(&ln_buffers_fork_once, ln_buffers_register_fork_handler);
    char *data = NULL;
    pthread_mutex_lock(&ln_buffers.lock);
    const int best = ln_best_cached(bytes);
    if (best >= 0) {
        data = ln_uncache(best);
    }
    pthread_mutex_unlock(&ln_buffers.lock);
    if (!data) {
        return ln_block_map(bytes);  /* a new mapping reads as zeros */
    }
    const ln_buffer_header *header = ln_header_of(data);
    data = ln_block_data(header->mapping, header->length, bytes);
    if (zeroed) {
        memset(data, 0, bytes);
    }
    return data;
}

void ln_buffers_place(const void *const inputs[], int count)
{
    assert(count >= 1 && count <= LN_BUFFER_PLACE_MAX);
    size_t offsets[LN_BUFFER_PLACE_MAX] = {0};
    for (int i = 0; i < count; i++) {  /* sorted as they come */
        const size_t offset = (uintptr_t)inputs[i] % LN_PAGE;
        int j = i;
        for (; j > 0 && offsets[j - 1] > offset; j--) {
            offsets[j] = offsets[j - 1];
        }
        offsets[j] = offset;
    }
    /* the middle of the widest stretch of the page between two inputs' starts (going round
       from the last to the first) */
    size_t start = offsets[count - 1], widest = offsets[0] + LN_PAGE - offsets[count - 1];
    for (int i = 1; i < count; i++) {
        if (offsets[i] - offsets[i - 1] > widest) {
            start = offsets[i - 1];
            widest = offsets[i] - offsets[i - 1];
        }
    }
    const size_t line = 64;
    ln_data_page_offset = (start + widest / 2 + line - 1) / line * line % LN_PAGE;
}

void *ln_buffer_realloc(void *data, size_t bytes)
{
    if (!data) {
        return ln_buffer_alloc(bytes, 0);
    }
    /* a result shrunk (ndarray.resize) to much less than its block moves to one of its new
       size, as a block that grows does: it would keep the whole block mapped otherwise */
    ln_buffer_header *header = ln_header_of(data);
    if (ln_block_fits(ln_capacity_of(header), bytes)) {
        header->requested = bytes;
        return data;
    }
    void *moved = ln_buffer_alloc(bytes, 0);
    if (moved) {
        memcpy(moved, data, header->requested < bytes ? header->requested : bytes);
        ln_buffer_free(data);
    }
    return moved;
}

void ln_buffer_free(void *data)
{
    if (!data) {
        return;
    }
    const ln_buffer_header *header = ln_header_of(data);
    const size_t length = header->length;
    char *evicted = NULL;
    pthread_mutex_lock(&ln_buffers.lock);
    const size_t limit = ln_buffers.limit;
    /* a block smaller than any result the cache serves (a result shrunk by ndarray.resize
       has one) would take the place of one it can serve */
    const int kept = length <= limit && ln_capacity_of(header) >= LN_BUFFER_MIN_BYTES;
    if (kept) {
        if (ln_buffers.count == LN_BUFFER_CACHE_BLOCKS) {
            evicted = ln_uncache(0);
        }
        ln_buffers.data[ln_buffers.count++] = data;
        ln_buffers.held += length;
    }
    pthread_mutex_unlock(&ln_buffers.lock);
    if (evicted) {
        ln_block_unmap(evicted);
    }
    if (!kept) {
        ln_block_unmap(data);
        return;
    }
    ln_trim_cache(LN_BUFFER_CACHE_BLOCKS, limit);
}

void ln_buffers_set_limit(size_t bytes)
{
    pthread_mutex_lock(&ln_buffers.lock);
    ln_buffers.limit = bytes;
    pthread_mutex_unlock(&ln_buffers.lock);
    ln_trim_cache(LN_BUFFER_CACHE_BLOCKS, bytes);
}

ln_buffers_state ln_buffers_get(void)
{
    pthread_mutex_lock(&ln_buffers.lock);
    const ln_buffers_state state = {.limit = ln_buffers.limit, .held = ln_buffers.held, .blocks = ln_buffers.count};
    pthread_mutex_unlock(&ln_buffers.lock);
    return state;
}
