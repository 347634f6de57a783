/*
 * ln_tuning.h -- every tuning threshold of the kernel layer, each with its reason.
 *
 * Timings quoted are from the machine they were measured on (AMD EPYC, 2 threads unless
 * said otherwise).  The constants under "Summation order" fix the order of the statistics'
 * sums; LN_GRAD_ROWS, and those that decide backward's row blocks and column spans
 * (LN_PARALLEL_MIN_ELEMENTS, LN_SPLIT_ROW_MIN, LN_COLUMN_SPANS_MIN, LN_GRAD_BLOCKS,
 * LN_GRAD_PARTIALS_MAX), fix the order of dweight's and dbias'.  The others change no bit.
 */
#ifndef LN_TUNING_H
#define LN_TUNING_H

#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------------ */
/* Summation order (changing these changes results)                          */
/* ------------------------------------------------------------------------ */

/* Elements per statistics chunk: 16 KiB of float64, so a chunk stays in L1 between its
   two passes.  Chunk boundaries are fixed from the row start, whoever computes them. */
#define LN_CHUNK 2048

/* Forward, float16 data: groups whose float32 sums are added into the float64 ones
   (8 terms a lane round at 2^-24 relative, far below float16's 2^-11). */
#define LN_F16_BLOCK 8

/* Backward pass 1, float16/float32 data: groups whose float32 sums of g and g * xhat
   are added into the float64 ones. */
#define LN_GRAD_SUM_BLOCK 8

/* ------------------------------------------------------------------------ */
/* Threads                                                                   */
/* ------------------------------------------------------------------------ */

/* Below this many elements a call runs on the calling thread alone. */
#define LN_PARALLEL_MIN_ELEMENTS 65536

/* Rows at least this long, when there are few of them, are split across the threads
   (forward: fewer than 4 rows a thread; backward: fewer rows than LN_GRAD_BLOCKS), so
   that no thread waits while one works through a huge row. */
#define LN_SPLIT_ROW_MIN (8 * LN_CHUNK)

/* Backward splits rows this long into column spans however many rows there are: row
   blocks would each need partial sums as long as the row. */
#define LN_COLUMN_SPANS_MIN (64 * LN_CHUNK)

/* The pool's most threads; ln_threads_set clamps to it. */
#define LN_MAX_THREADS 256

/* Pieces each worker's range of a parallel job is cut into: a piece is run by the worker or,
   if it has not taken it by the time the caller is done with its own range, by the caller. */
#define LN_POOL_PIECES 4

/* Pause iterations a worker spins for the next job (back-to-back calls are common), and
   the caller for the last worker, before sleeping on a condition variable. */
#define LN_SPIN_ITERATIONS 20000

/* ------------------------------------------------------------------------ */
/* Backward                                                                  */
/* ------------------------------------------------------------------------ */

/* Rows that make backward pass 2 together: their terms of a column are summed in
   registers, and dweight and dbias go to memory once per group instead of once per row.
   Those float32 sums of a group fix the order of dweight's and dbias' sums: changing this
   changes their bits. */
#define LN_GRAD_ROWS 4

/* Row blocks for the parameter gradients: enough to share evenly among threads, one for
   inputs too small to be worth a thread, and at most LN_GRAD_PARTIALS_MAX over a block's
   partial sums (ln_backward.c: sums_len). */
#define LN_GRAD_BLOCKS 16

/* Backward pass 2 of a group of rows asks for the next group's rows of x and dy, a line of
   each row per step (grad_prefetch_next), when x and dy take this many bytes: they come from
   memory then, and pass 2, working from cache, would otherwise leave memory idle until pass 1
   of the next group waits on it (Zen 5, A/B in alternating processes, 6304x768 float32: one
   thread 2.34-2.38 -> 1.54-1.59 ms, two threads 1.08-1.09 -> 0.86-0.92 ms; into L1 or L2
   alike).  Where they stay in the last-level cache it was slower (512x768 float32 108 -> 118 us,
   2048x1024 float16 385 -> 420 us). */
#define LN_GRAD_PREFETCH_MIN_BYTES ((ptrdiff_t)16 << 20)

/* ... for rows of at most this many bytes: a group of them and the next, x and dy, fill at
   most Zen 5's 48 KiB of L1.  Longer float16/bfloat16/float32 rows are read ahead by pass 1
   instead (ln_backward_read_ahead), which was faster for most (one thread, A/B in alternating
   processes: 8192x1024 float32 3.9-4.1 -> 3.3-3.5 ms, 4096x2048 float16 3.2-3.6 -> 2.1 ms,
   counting the float16 pipelined loop this replaced; 3000x1024 float32 alike, 0.84-0.95 ms
   asked for and 0.87-0.98 ms read ahead) but slower for rows of 3 KiB and less (6304x768
   float32 1.41-1.48 ms asked for, 1.51-1.53 ms read ahead; 6304x768 bfloat16 1.01-1.03
   against 1.27-1.36 ms). */
#define LN_GRAD_PREFETCH_MAX_ROW_BYTES 3072

/* ... and for float64 rows, whose pass 1 does not read ahead, of at most this many: longer
   ones are long runs for the hardware prefetchers already, and a group of them no longer
   fits L1 beside the next (rows of 8 KiB, 1024x1024 float64, one thread: no faster asked
   for, 0.53-0.54 -> 0.51 ms). */
#define LN_GRAD_PREFETCH_MAX_ROW_BYTES_F64 4096

/* At most this many float64 partial sums per parameter gradient (64 MiB for both). */
#define LN_GRAD_PARTIALS_MAX ((ptrdiff_t)1 << 22)

/* The backward partial sums take a few hundred KiB on mid-sized inputs.  A fresh calloc
   of that size is an mmap, and its page faults cost more than the kernel itself
   (512x768 float32 backward: 185 -> 155 us without them).  So one zeroed buffer of up to
   this many bytes is kept between calls; larger scratch comes from the large results'
   blocks (ln_scratch_take). */
#define LN_SCRATCH_MAX ((size_t)16 << 20)

/* ------------------------------------------------------------------------ */
/* Memory traffic                                                            */
/* ------------------------------------------------------------------------ */

/* Rows of at least this many bytes do not stay in L2 between the statistics pass and
   the normalize pass: their float32/float64 output is written with non-temporal stores,
   which keep it from evicting the input about to be read again and need no read for
   ownership (8x1000000 float32: ours/torch 0.91-1.07 -> 0.75-0.83). */
#define LN_STREAM_MIN_BYTES ((ptrdiff_t)1 << 20)

/* Forward's statistics of float32/float64 data that comes from cache take a chunk's groups in
   blocks, each block's even groups first, then its odd ones: one parity's float64 sums, 8 of
   AVX2's 16 vector registers, then stay in registers, where both parities' sums together
   were kept on the stack and each addition waited on a store and a load.  Each sum still
   takes the same terms in the same order, so results do not depend on these.  A chunk of up
   to LN_PARITY_CHUNK_MAX_BYTES is one block; longer ones go LN_PARITY_BLOCK_GROUPS groups (an
   even number) at a time: whole chunks of 2048 float32 elements by parity were slower than the
   interleaved loop (one thread, 512x2048 1.0-1.4x and 64x4096 1.1-1.3x its time), blocks of 4,
   8, 16 and 32 groups measured, 8 the fastest (0.86-0.94x).  Zen 3, one thread,
   float32, interleaved -> by parity: 16x768 4.65 -> 3.61 us, 512x768 124 -> 95 us, 1024x1024
   328 -> 281 us; 512x2048 323 -> 279 us in blocks of 8. */
#define LN_PARITY_CHUNK_MAX_BYTES 4096
#define LN_PARITY_BLOCK_GROUPS 8

/* Forward's statistics loops ask for the input this many bytes ahead of the group they add
   (a prefetch into L1 per 64 bytes read) where the input comes from memory (see
   LN_READ_AHEAD_MIN_BYTES).  A loop as busy as the statistics' (a conversion, a subtraction,
   an addition and a fused multiply-add per 8 elements) has too few loads in flight for the
   hardware prefetchers to keep memory busy: on Zen 5 a loop of those sums alone read 34-40
   GB/s, a loop of plain loads 57-73, and the sums with this read-ahead 63-70.  16 KiB ahead
   was the best of 8, 16 and 32 KiB.  One thread, A/B in alternating processes, into out=:
   2048x4096 float32 2.39-2.43 -> 1.13-1.16 ms (a copy of the array: 1.18-1.26 ms), 8x1000000
   2.72-2.77 -> 2.13-2.14 ms, 2048x2048 float64 2.66-2.72 -> 2.26-2.28 ms; add_layer_norm of
   2048x4096 float32, reading x and residual ahead, 3.51-3.64 -> 2.54-2.78 ms. */
#define LN_READ_AHEAD_BYTES 16384

/* ... into L2, not L1 (__builtin_prefetch's locality 2: PREFETCHT1 on x86, as
   LN_TILE_PREFETCH_LOCALITY): two streams read 16 KiB ahead into L1 (the fused residual pass's
   x and residual, backward pass 1's dy and x) ask for a 32 KiB L1's whole size, evicting the
   row about to be read, and the L1's own prefetcher fetches from L2 in time.  Zen 4 (32 KiB
   L1), A/B in alternating processes, best of 15 calls, 4 to 6 alternations, one thread:
   add_layer_norm 2048x4096 float32 into out= 5.31 -> 4.21 ms, backward 6.83 -> 5.49 ms,
   forward into out= 2.38 -> 2.19 ms, bfloat16 backward 3.60 -> 3.25 ms; two threads
   3.03 -> 2.74, 3.35 -> 2.74 and 1.12 -> 1.10 ms; the other standard cases within 5%
   either way. */
#define LN_READ_AHEAD_LOCALITY 2

/* ... once the array the statistics read, with the weight and bias, holds this many bytes
   and is read in one run (its rows one after another, or each row at least 4 x
   LN_READ_AHEAD_BYTES long): on Zen 5, that far ahead, an input that stays in the last-level
   cache gained nothing and lost up to 3% (4096x768 float32, 12 MiB, one thread: 0.95-0.96 ms
   either way; 256x4096, 4 MiB: 285 -> 289-294 us), but see LN_L3_READ_AHEAD_MIN_BYTES.
   Backward's pass 1 goes by LN_GRAD_PREFETCH_MIN_BYTES of x and dy together instead
   (ln_backward_read_ahead). */
#define LN_READ_AHEAD_MIN_BYTES ((ptrdiff_t)16 << 20)

/* ... and a page ahead for float16/bfloat16/float32 arrays of this many bytes up to that
   size, which a 32 MiB L3 holds: the statistics loop, busy with its float64 sums, waits on
   the L3 as it waits on memory, if less.  Zen 4, one thread, into out=, in one process turn
   by turn with the reading ahead off (best of 31 turns, three runs): 2048x1024 float32
   577-910 -> 525-711 us, 4096x768 float32 1349-1611 -> 1210-1394 us, 2048x2048 float16
   1156-1245 -> 959-1042 us; 8192x256 float32 607-1116 -> 593-889 us, later 0.92x-1.09x the
   time (no clear gain); 16 KiB ahead gained less; smaller arrays (1024x1024 float32, 4 MiB:
   196-248 -> 209-262 us) and float64 ones (1536x1024, 12 MiB: 1314-1334 -> 1413-1461 us)
   lost, and so did two threads each reading half (2048x1024 float32, alternating processes:
   248-314 -> 273-337 us), so only a call that one thread takes whole reads a page ahead
   (ln_read_ahead's page_ahead). */
#define LN_L3_READ_AHEAD_MIN_BYTES ((ptrdiff_t)8 << 20)
#define LN_L3_READ_AHEAD_BYTES 4096

/* An output of this many bytes in all does not stay in cache for its reader either (L2 is
   1 MiB a core, L3 is shared with the other cores): rows longer than LN_CHUNK are then
   written with non-temporal stores too, whatever their length, and shorter rows where each
   starts 16-byte aligned (ln_pipelined_rows_store) (Zen 4, 2048x4096 float32
   into out=: ours/copy 1.20-1.26 -> 0.73-0.91; into a new array, whose pages the OS has
   just zeroed through the cache, about 4% slower: 4.2 -> 4.4 ms). */
#define LN_STREAM_MIN_OUTPUT_BYTES ((ptrdiff_t)16 << 20)

/* Backward writes dx with non-temporal stores when dx is this large: it does not stay in
   cache for its reader anyway, and the stores then cost no read for ownership (1024x1024
   float64 1.17 -> 0.80 ms, 8x1000000 float32 8.3 -> 7.5 ms).  They are 16-byte stores, or
   whole lines where the rows start on one, so float32/float64 rows of a multiple of 16 bytes
   from a 16-byte aligned start (every NumPy allocation) qualify; float16 and bfloat16 are
   stored as usual. */
#define LN_BACKWARD_STREAM_MIN_BYTES ((ptrdiff_t)4 << 20)

/* Results of at least this many bytes get their memory from ln_buffers.c, which keeps
   freed blocks for the next result of their size: glibc's malloc maps fresh pages for every
   request of 32 MiB or more (its largest mmap threshold), which the OS zeroes on their first
   write (Zen 4, 2048x4096 float32 forward, one thread: 6.3 ms into a new array against
   2.95 ms into a reused one).  Smaller requests mostly come back from its heap, faulted in
   already.  At most the size above which backward streams dx (its 16-byte stores then fill
   whole lines of the blocks' 64-byte aligned data). */
#define LN_BUFFER_MIN_BYTES ((size_t)4 << 20)

/* Freed blocks kept at most, and the bytes they may take until ln_buffers_set_limit says
   otherwise: a few results of a large model's activations. */
#define LN_BUFFER_CACHE_BLOCKS 16
#define LN_BUFFER_CACHE_DEFAULT ((size_t)256 << 20)

/* A new block's pages are faulted in by the pool's threads before a kernel writes them
   (ln_fault_in): the OS zeroes a page on its first write, and the non-temporal stores that
   follow then cost several times that zeroing (Xeon, 2048x4096 float32 forward into a new
   array, one thread, load ~5: 9.3 -> 7.7 ms, a copy into a new array 6.5 ms; backward
   2048x4096 16.5-17.0 -> 14.2-14.4 ms).  The pages go in pieces of this many bytes, at
   multiples of it: a transparent huge page each, so no huge page is split between two
   threads. */
#define LN_FAULT_IN_PIECE ((uintptr_t)2 << 20)

/* The fused residual pass writes sum and output with non-temporal stores, whatever its rows'
   length, from this many bytes of either (ln_sum_streams). */
#define LN_SUM_STREAM_MIN_BYTES ((ptrdiff_t)32 << 20)

/* The fused residual pass's stores hold up the loads after them where they land 1 to this many
   bytes above the loads in the aliasing period (LN_ALIAS_PERIOD; stores_alias_loads):
   2048x4096 float32 add_layer_norm into out= and residual_out=, one thread, Zen 4, input and
   residual 16 bytes into a page, sum at 32, 64, 128, 192, 256 bytes above them: 5.2-6.8,
   6.8-7.6, 5.1-5.6, 4.4-5.2, 4.2-4.7 ms, and 4.1-4.6 ms with it as far as the page allows;
   the output at 32, 64, 128, 192, 384 above: 7.3-9.8, 6.4-9.5, 5.6-8.8, 5.0-8.0, 4.2-5.0 ms. */
#define LN_ALIAS_WINDOW ((uintptr_t)256)

/* ... so a row whose sum or output lies that close above its input or residual is summed into
   a buffer of this many bytes at most as well (in L1 or L2; longer rows go as before), and the
   output made from it; a sum so placed is stored from it, past the window behind the loads
   (forward_sum_rows):
   the same case, sum or output 32 to 256 bytes above, 4.1-5.3 ms; sum 48 bytes above, output
   32 above, both 48 above: 7.2-7.5, 6.9-7.6, 8.7 -> 4.5-4.6, 4.6-4.8, 4.5-4.8 ms (two
   threads: 4.9-5.6 -> 3.2-3.3 ms), where nothing aliases 4.1-4.7 ms, as before.  Rows shorter than
   LN_SUM_BUFFER_MIN_BYTES go as before: placing the buffer costs a row of 64 float32 elements
   more than it saves (131072x64, sum 48 bytes above: 10.0 -> 23.7 ms; 32768x256: 8.6 -> 9.7 or
   better). */
#define LN_SUM_BUFFER_BYTES ((ptrdiff_t)16 << 10)
#define LN_SUM_BUFFER_MIN_BYTES ((ptrdiff_t)1 << 10)

/* With a residual (or a copy), the contiguous route sums (copies) rows into `sum` (`copy`)
   this many bytes at a time (one row at least) and normalizes them from there next, so that
   they are read back from L1 or L2 rather than memory. */
#define LN_SUM_BATCH_BYTES ((ptrdiff_t)32 << 10)

/* A copy of the input (what a training-mode call saves for backward) that the row kernels do
   not write themselves (ln_copies_in_rows) is, from this many bytes, written with non-temporal
   stores, and its rows normalized from the input, in cache
   from being copied: the copy is not read before backward, by when it has left the cache
   anyway, and the stores cost no read for ownership. */
#define LN_STREAM_COPY_MIN_BYTES ((ptrdiff_t)1 << 20)

/* The strided route asks for each element's cache line this many tiles ahead: a tile of
   channels-first rows touches one line in each of row_len streams, more than the hardware
   prefetchers follow (8x64x56x56 float32 over C, forward, one thread, load ~6: no prefetch
   1.45-1.62 ms, one tile ahead 1.26-1.63, two tiles ahead 1.16-1.23; backward 3.2-6.8,
   3.1-3.6, 2.8-3.0). */
#define LN_TILE_PREFETCH 2

/* ... and into L2, not L1 (__builtin_prefetch's locality 2: PREFETCHT1 on x86): a tile asks
   for 64 lines at once, more than L1 can have in flight, and a prefetch into L1 waited for a
   fill buffer (Intel Xeon, AVX-512, 8x64x56x56 float32 over C, 1 and 2 threads, A/B in one
   process: forward and backward 0.89-0.90x the time, bfloat16 forward 0.92-0.96x). */
#define LN_TILE_PREFETCH_LOCALITY 2

/* Tiles whose backward pass 2 goes column by column together (backward_tiles_columns): 64
   KiB of float32 dy and x at 64 channels, read again from L2 (8x64x56x56 over axis=1, one
   thread, Zen 4: 4 tiles 0.90-0.95 ms, 8 0.89-0.94, 16 0.89-0.94). */
#define LN_TILE_RUN 8

/* Elements of a tile's rows gathered at a time where they are not adjacent in memory (see
   tile_gathered).  (1000000, 2) float32 over axis=0, one thread, Zen 4: forward 13.7-13.8 ->
   4.1-4.2 ms and backward 30.3-32.1 -> 12.7-13.7 ms against one element at a time; 64 at a
   time was no faster. */
#define LN_TILE_GATHER 32

/* At most this many bytes of a tile's input (16 rows by row_len elements) are staged in L1 for
   its output loop where that loop's loads of x would wait on its stores to y (see
   tiles_output_staged): 256 channels of float32, half of Zen 4's 32 KiB L1. */
#define LN_TILE_STAGE_BYTES 16384

/* The normalize pass goes through a long row from the end back, so that the part the
   statistics pass read last, still in cache, is used first, one span at a time, and through
   each span forward.  A span of 16384 elements (64 KiB of float32) is long enough for the
   hardware prefetchers to get going on x, weight and bias at each span; at 2048 elements
   they restarted every 8 KiB (Zen 4, float32 into out=: 8x1000000 2.19 -> 1.94 ms,
   2048x4096 2.16 -> 1.82 ms). */
#define LN_NORMALIZE_SPAN 16384

/* float64 rows are software-pipelined (ln_rows_pipelined) up to this many elements.  The
   pipelined loop keeps two rows of x, one of the output, the weight and the bias in L1 at
   once, 40 bytes an element; past 32 KiB it evicts what it is about to read, and statistics
   then normalize, row by row, was faster (Zen 4, one thread, weight and bias, best of 7,
   three alternations: 256x1024 114-115 -> 95-99 us, 128x1536 88-90 -> 81-83 us, 128x2048
   116-119 -> 110 us; rows of up to 768 elements were faster pipelined: 512x256 41-45 us
   against 51-59, 256x768 64-66 against 65-79). */
#define LN_F64_PIPELINED_MAX 768

/* Rows of 16 to this many elements go forward 16 rows at a time (forward_rows_batched), longer
   ones pipelined, which measured as fast or faster from there on (float32, one thread, Zen 5,
   batched against pipelined: 0.96x the time at 384 elements, 1.19x at 512, 1.10x at 768,
   1.28x at 1024). */
#define LN_BATCH_MAX 256

#endif
