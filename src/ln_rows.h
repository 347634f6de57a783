/*
 * ln_rows.h -- the row algorithms, written once against the group primitives.
 *
 * Each ln_level_<level>.c includes its level's ln_simd_<level>.h, defines LN_LEVEL_KERNELS
 * (the name of its table), then includes this file: the functions here are plain statics
 * of that translation unit, and the table is its only export.
 *
 * Every level performs the same IEEE operations in the same order -- groups of 16
 * elements, 16 accumulation lanes, lane k taking the elements i with i % 16 == k, then a
 * fixed reduction tree (ln_sum_lanes) -- so every level returns bit-identical results.
 *
 * Every algorithm takes the norm kind and the element type as its first parameters; the
 * table at the end instantiates it for each (kind, dtype), so both are constants and each
 * instance is compiled for its pair alone (RMSNorm's loops hold no mean and no bias).
 *
 * Forward, per row of N elements (statistics in float64):
 *
 *     chunk c (<= LN_CHUNK elements, K = its first element, one pass):
 *         s1 = sum(x - K),  s2 = sum((x - K)^2)
 *         moments_c = (n_c, K + s1 / n_c, s2 - s1^2 / n_c)
 *         (float16 and bfloat16 data: x - K and its square in float32, summed in float32
 *         over blocks of LN_F16_BLOCK groups, the block sums added in float64)
 *     row:
 *         moments = ln_merge(moments_0, moments_1, ...)            (left to right)
 *         rstd = 1 / sqrt(m2 / N + eps)
 *     output, float16/bfloat16/float32 data, in float32 with a two-part mean:
 *         mean_hi = float(mean),  mean_lo = float(mean - mean_hi),  a_j = float(rstd) * w_j
 *         y_j = fma((x_j - mean_hi) - mean_lo, a_j, b_j)
 *     output, float64 data, and float16/bfloat16 rows of fewer than 16 elements:
 *         y_j = fma(x_j - mean, rstd * w_j, b_j)
 *         (float16/bfloat16: rounded to odd into float32, then to nearest even)
 *
 *     RMSNorm: the same with the mean fixed at 0 and no bias: K = 0 and s1 unused, so
 *         moments_c = (n_c, 0, s2), the sum of squares, which ln_merge adds up (delta = 0);
 *         y_j = fma(x_j, a_j, -0.0), x - 0 - 0 being x exactly (ln_absent_bias).
 *
 *     With a residual: sum = x + residual as NumPy rounds it, and the rows normalized are
 *     sum's; the statistics are taken from the sum as it is formed (forward_sum_rows,
 *     forward_tile), so they are those of the written sum, bit for bit.
 *
 * Backward, per row (dy = dL/dy, g = dy * w, xhat = (x - mean) * rstd, N elements):
 *
 *     y = xhat * w + b, so dL/dxhat_j = g_j, and since xhat depends on every x through
 *     mean and rstd (dmean/dx_j = 1/N, drstd/dx_j = -rstd^3 (x_j - mean) / N):
 *         dx_j = rstd * (g_j - mean(g) - xhat_j * mean(g * xhat))
 *     dweight_j = sum over rows of dy_j * xhat_j,   dbias_j = sum over rows of dy_j
 *
 *     pass 1: the row sums of g and g * xhat (float64 lanes; float32 products summed in
 *             float32 over blocks of LN_GRAD_SUM_BLOCK groups for float16/float32 data)
 *     pass 2: dx (float32 arithmetic for float16/float32 data, float64 for float64),
 *             and dy * xhat, dy added into float64 column sums, LN_GRAD_ROWS rows at a time
 *
 *     RMSNorm: mean = 0, so xhat = x * rstd and nothing depends on x through a mean:
 *         dx_j = rstd * (g_j - xhat_j * mean(g * xhat)),   no dbias
 *
 * Those are the contiguous route's row kernels (rows whose elements are adjacent); the
 * strided route's tile kernels, further down, compute the same per lane.
 */
#if !defined(LN_LEVEL_KERNELS) || !defined(LN_AFFINE_LOOP_APART) || !defined(LN_ROWS8_F32_TRANSPOSE) || \
    !defined(LN_BF16_PAIR_STORE) || !defined(LN_GF_TRANSPOSE)
#error "include a level's ln_simd_<level>.h and define LN_LEVEL_KERNELS before ln_rows.h"
#endif

/* ------------------------------------------------------------------------ */
/* Group loads and stores by element type (dtype is a constant after inlining) */
/* ------------------------------------------------------------------------ */

/* The bytes of one group, 16 elements of the element type. */
static LN_ALWAYS_INLINE ptrdiff_t group_bytes_of(ln_dtype dtype)
{
    return 16 * (ptrdiff_t)ln_dtype_size(dtype);
}

/* 16 elements from p[i] as float32 (float16, bfloat16 and float32 only). */
static LN_ALWAYS_INLINE gf load_as_f32(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    if (dtype == LN_F16) {
        return gf_load_f16((const uint16_t *)p + i);
    }
    if (dtype == LN_BF16) {
        return gf_load_bf16((const uint16_t *)p + i);
    }
    return gf_load((const float *)p + i);
}

/* The first `count` (1 to 15) of the 16 elements from p[i] as float32, into lanes 0 ..
   count - 1, the other lanes 0.0, reading no element past them: by masked loads where the
   level has them (LN_LOAD_PART), else through a buffer of the element type. */
static LN_ALWAYS_INLINE gf load_part_as_f32(ln_dtype dtype, const void *p, ptrdiff_t i, int count)
{
    assert(1 <= count && count < 16);
#if defined(LN_LOAD_PART)
    if (dtype == LN_F16) {
        return gf_load_part_f16((const uint16_t *)p + i, count);
    }
    if (dtype == LN_BF16) {
        return gf_load_part_bf16((const uint16_t *)p + i, count);
    }
    return gf_load_part((const float *)p + i, count);
#else
    uint16_t halves[16] = {0};
    float floats[16] = {0};
    void *buffer = ln_dtype_is_16bit(dtype) ? (void *)halves : (void *)floats;
    const size_t size = ln_dtype_size(dtype);
    memcpy(buffer, (const char *)p + i * (ptrdiff_t)size, (size_t)count * size);
    return load_as_f32(dtype, buffer, 0);
#endif
}

/* The same as float64, for every element type. */
static LN_ALWAYS_INLINE gd load_part_as_f64(ln_dtype dtype, const void *p, ptrdiff_t i, int count)
{
    assert(1 <= count && count < 16);
    if (dtype != LN_F64) {
        return gf_widen(load_part_as_f32(dtype, p, i, count));
    }
#if defined(LN_LOAD_PART)
    return gd_load_part((const double *)p + i, count);
#else
    double doubles[16] = {0};
    memcpy(doubles, (const double *)p + i, (size_t)count * sizeof *doubles);
    return gd_load(doubles);
#endif
}

/* v is a result of float arithmetic, so its NaNs are quiet (the avx512 bfloat16 store keeps them).
   nan_lanes: whether a lane of v may be a NaN; without it the bfloat16 rounding skips its NaN
   test (bf16_rounded), for the normalized rows of the forward, which are never NaN: a row whose
   statistics or parameters could make one goes by ln_forward_exact_row (512x768 bfloat16 forward,
   one thread: 4-6% faster). */
static LN_ALWAYS_INLINE void store_from_f32(ln_dtype dtype, void *p, ptrdiff_t i, gf v, int nan_lanes)
{
#ifndef NDEBUG
    float lanes[16];
    gf_store(lanes, v);
    for (int k = 0; k < 16; k++) {
        assert(nan_lanes || lanes[k] == lanes[k]);
    }
#endif
    if (dtype == LN_F16) {
        gf_store_f16((uint16_t *)p + i, v);
    }
    else if (dtype == LN_BF16) {
        gf_store_bf16((uint16_t *)p + i, v, nan_lanes);
    }
    else {
        gf_store((float *)p + i, v);
    }
}

/* 16 elements from p[i] as float64. */
static LN_ALWAYS_INLINE gd load_as_f64(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    if (dtype == LN_F64) {
        return gd_load((const double *)p + i);
    }
    if (dtype == LN_F32) {
        return gd_load_f32((const float *)p + i);
    }
    return gf_widen(load_as_f32(dtype, p, i));
}

/* 16 float64 values into p[0 .. 16), rounded once to the element type as ln_store1_from_f64
   rounds them (float16/bfloat16: to odd in float32, then to nearest even), a group at a
   time: in vectors (gd_to_odd_float_bits) where the level has them, but for the scalar
   rounding to odd of a group with a lane below float32's normal range. */
static LN_ALWAYS_INLINE void store_from_f64(ln_dtype dtype, void *p, gd v)
{
    if (dtype == LN_F64) {
        gd_store(p, v);
        return;
    }
    double values[16];
    float narrowed[16];
    const int rounded_to_odd = ln_dtype_is_16bit(dtype) && gd_to_odd_float_bits(&v);
    gd_store(values, v);
    if (ln_dtype_is_16bit(dtype) && !rounded_to_odd) {
        for (int k = 0; k < 16; k++) {
            narrowed[k] = ln_double_to_float_odd(values[k]);
        }
    }
    else {
        for (int k = 0; k < 16; k++) {
            narrowed[k] = (float)values[k];
        }
    }
    store_from_f32(dtype, p, 0, gf_load(narrowed), 1);
}

/* ------------------------------------------------------------------------ */
/* Forward: statistics                                                       */
/* ------------------------------------------------------------------------ */

/* Mean and M2 of one chunk of 1 <= n <= LN_CHUNK elements in one pass, in float64,
   with the sums taken about the chunk's first element K.  Because K is one of the data,
   M2 >= (K - mean)^2, so S2 = M2 + n (mean - K)^2 is at most (n + 1) M2 and the
   subtraction below loses at most log2(n + 1) bits of float64's 53; x - K is exact for
   float16/float32 data.  Even and odd groups use separate accumulators, so no add waits
   on the one before it.  The accumulator is a type of its own so that the pipelined row
   loop (forward_rows_pipelined) performs exactly the same operations.  RMSNorm's chunk
   sums x^2 alone, K = 0.  read_ahead: ln_read_ahead's distance, 0 for none.  narrow:
   float16/bfloat16 data summed in float32 blocks (below), but where moments_sums redoes a
   chunk in float64. */
typedef struct {
    double shift;
    ptrdiff_t read_ahead;
    int narrow;
    gd shift_v, s1_even, s2_even, s1_odd, s2_odd;
    /* float16 and bfloat16 data: float32 sums over blocks of LN_F16_BLOCK groups, added into
       s1_even and s2_even (float64) at the end of each block */
    gf shift_f, block_s1_even, block_s2_even, block_s1_odd, block_s2_odd;
} moments_acc;

static LN_ALWAYS_INLINE void moments_start(moments_acc *acc, ln_norm_kind kind, ln_dtype dtype, const void *x,
                                           ptrdiff_t read_ahead)
{
    acc->read_ahead = read_ahead;
    acc->narrow = ln_dtype_is_16bit(dtype);
    acc->shift = kind == LN_NORM_RMS ? 0.0 : ln_load1_as_f64(dtype, x, 0);
    acc->shift_v = gd_splat(acc->shift);
    acc->s1_even = acc->s2_even = acc->s1_odd = acc->s2_odd = gd_splat(0.0);
    if (acc->narrow) {
        acc->shift_f = gf_splat((float)acc->shift);
        acc->block_s1_even = acc->block_s2_even = acc->block_s1_odd = acc->block_s2_odd = gf_splat(0.0f);
    }
}

/* float16 and bfloat16: the block's float32 sums into the float64 ones. */
static LN_ALWAYS_INLINE void moments_flush_16bit(moments_acc *acc, ln_norm_kind kind)
{
    if (kind == LN_NORM_LAYER) {
        acc->s1_even = gd_add(acc->s1_even, gf_widen(gf_add(acc->block_s1_even, acc->block_s1_odd)));
    }
    acc->s2_even = gd_add(acc->s2_even, gf_widen(gf_add(acc->block_s2_even, acc->block_s2_odd)));
    acc->block_s1_even = acc->block_s2_even = acc->block_s1_odd = acc->block_s2_odd = gf_splat(0.0f);
}

/* Asks for the lines read_ahead bytes past the group at `group` (element i of its chunk),
   one line for each 64 bytes the groups take: every other float16/bfloat16 group.  The
   address is formed as an integer: it may lie past the array, where a prefetch does nothing
   (and never faults). */
static LN_ALWAYS_INLINE void read_ahead_of_group(ln_dtype dtype, const void *group, ptrdiff_t i, ptrdiff_t read_ahead)
{
    if (!read_ahead || (ln_dtype_is_16bit(dtype) && (i / 16) % 2 != 0)) {
        return;
    }
    const uintptr_t ahead = (uintptr_t)group + (uintptr_t)read_ahead;
    __builtin_prefetch((const void *)ahead, 0, LN_READ_AHEAD_LOCALITY);
    if (dtype == LN_F64) {
        __builtin_prefetch((const void *)(ahead + 64), 0, LN_READ_AHEAD_LOCALITY);
    }
}

/* float32/float64 data: the group at `group` into one parity's sums, s1 of x - shift (none
   for RMSNorm) and s2 of the squares. */
static LN_ALWAYS_INLINE void moments_add_wide(ln_norm_kind kind, ln_dtype dtype, const void *group, gd shift,
                                              gd *s1, gd *s2)
{
    const gd value = load_as_f64(dtype, group, 0);
    const gd d = kind == LN_NORM_LAYER ? gd_sub(value, shift) : value;
    *s1 = kind == LN_NORM_LAYER ? gd_add(*s1, d) : *s1;
    *s2 = gd_fma(d, d, *s2);
}

/* Adds the group of 16 at `group`, elements i .. i + 16 of the chunk; `odd` picks the
   accumulators: (i / 16) % 2. */
static LN_ALWAYS_INLINE void moments_add_group(moments_acc *acc, ln_norm_kind kind, ln_dtype dtype,
                                               const void *group, ptrdiff_t i, int odd)
{
    const int has_mean = kind == LN_NORM_LAYER;
    read_ahead_of_group(dtype, group, i, acc->read_ahead);
    if (acc->narrow) {
        /* x - K is exact in float32 for float16 or bfloat16 values of similar size (11 or 8
           significant bits), and the squares of such differences are too; the float32 block
           sums of 8 terms round at 2^-24 relative, far below float16's 2^-11 and bfloat16's
           2^-8 (the float64 path made this case conversion-bound: 2048x1024 float16, AVX2,
           2 threads: 488 -> 351 us). */
        const gf value = load_as_f32(dtype, group, 0);
        const gf d = has_mean ? gf_sub(value, acc->shift_f) : value;
        if (odd) {
            acc->block_s1_odd = has_mean ? gf_add(acc->block_s1_odd, d) : acc->block_s1_odd;
            acc->block_s2_odd = gf_fma(d, d, acc->block_s2_odd);
        }
        else {
            acc->block_s1_even = has_mean ? gf_add(acc->block_s1_even, d) : acc->block_s1_even;
            acc->block_s2_even = gf_fma(d, d, acc->block_s2_even);
        }
        if ((i / 16) % LN_F16_BLOCK == LN_F16_BLOCK - 1) {
            moments_flush_16bit(acc, kind);
        }
        return;
    }
    if (odd) {
        moments_add_wide(kind, dtype, group, acc->shift_v, &acc->s1_odd, &acc->s2_odd);
    }
    else {
        moments_add_wide(kind, dtype, group, acc->shift_v, &acc->s1_even, &acc->s2_even);
    }
}

/* Adds the group of 16 at x[i]. */
static LN_ALWAYS_INLINE void moments_add(moments_acc *acc, ln_norm_kind kind, ln_dtype dtype, const void *x,
                                         ptrdiff_t i, int odd)
{
    moments_add_group(acc, kind, dtype, (const char *)x + i * (ptrdiff_t)ln_dtype_size(dtype), i, odd);
}

/* A chunk's sums about its shift K (sum1 of x - K, sum2 of (x - K)^2), whose every whole
   group before x[i] has been added: the elements from i to n, fewer than 16, go into lanes
   0 .. n - i - 1 as one part group (0.0 in the other lanes changes none: none holds -0.0), and
   the lanes are added in ln_sum_lanes' order.  RMSNorm has no sum1. */
typedef struct {
    double shift, sum1, sum2;
} chunk_sums;

static LN_ALWAYS_INLINE chunk_sums lane_sums(moments_acc *acc, ln_norm_kind kind, ln_dtype dtype, const void *x,
                                             ptrdiff_t i, ptrdiff_t n)
{
    assert(i % 16 == 0 && 0 <= n - i && n - i < 16);
    if (acc->narrow) {
        moments_flush_16bit(acc, kind);
    }
    gd s1 = gd_add(acc->s1_even, acc->s1_odd), s2 = gd_add(acc->s2_even, acc->s2_odd);
    if (i < n) {
        const int count = (int)(n - i);
        const gd d = gd_first_lanes(gd_sub(load_part_as_f64(dtype, x, i, count), acc->shift_v), count);
        s1 = gd_add(s1, d);
        s2 = gd_fma(d, d, s2);
    }
    const chunk_sums sums = {acc->shift, kind == LN_NORM_RMS ? 0.0 : gd_sum_lanes(s1), gd_sum_lanes(s2)};
    return sums;
}

/* The blocks, in elements, in which a chunk of n elements takes its groups by parity (see
   LN_PARITY_CHUNK_MAX_BYTES), or 0 where it takes them in order: float16/bfloat16 data (its
   float32 block sums take both parities at once), an input read ahead (ln_read_ahead; a parity
   at a time reads every other line: 2048x4096 float64 7.0 -> 8.1 ms), an output that
   streams (its lines leave whole), and a chunk `copying` into a training-mode copy on a level
   whose registers hold both parities' sums (AVX-512's 32; a group is LN_VD_PER_GROUP float64
   vectors): the copy written in order there, Zen 4, one thread, training-mode forward of
   float32 256x768 50.4-50.9 -> 47.2-48.2 us, 512x768 85.9-86.2 -> 81.6-81.8 us, float64
   64x1024 44.5-44.8 -> 41.2-42.2 us. */
static LN_ALWAYS_INLINE ptrdiff_t parity_block_of(ln_dtype dtype, ptrdiff_t n, ptrdiff_t read_ahead, ln_store store,
                                                 int copying)
{
    if (ln_dtype_is_16bit(dtype) || read_ahead || store != LN_STORE_CACHED || (copying && LN_VD_PER_GROUP <= 2)) {
        return 0;
    }
    _Static_assert(LN_PARITY_BLOCK_GROUPS % 2 == 0, "a block after the first must start at an even group");
    return n * (ptrdiff_t)ln_dtype_size(dtype) <= LN_PARITY_CHUNK_MAX_BYTES ? n : 16 * LN_PARITY_BLOCK_GROUPS;
}

/* below, with the normalize kernels, which it runs too */
typedef struct row_norm row_norm;
static LN_ALWAYS_INLINE void groups_by_parity(ln_norm_kind kind, ln_dtype dtype, int gather, moments_acc *acc,
                                              const char *chunk, char *chunk_copy, ptrdiff_t groups_end,
                                              ptrdiff_t block, int emit, const row_norm *norm, const char *x,
                                              char *y, ptrdiff_t column, const void *weight, const void *bias);

/* Adds the whole groups of chunk x[0 .. n) from the first; returns where they end. */
static LN_ALWAYS_INLINE ptrdiff_t moments_add_groups(moments_acc *acc, ln_norm_kind kind, ln_dtype dtype,
                                                     const void *x, ptrdiff_t n)
{
    const ptrdiff_t block = parity_block_of(dtype, n, acc->read_ahead, LN_STORE_CACHED, 0);
    if (block) {
        groups_by_parity(kind, dtype, 1, acc, x, NULL, n - n % 16, block, 0, NULL, NULL, NULL, 0, NULL, NULL);
        return n - n % 16;
    }
    ptrdiff_t i = 0;
    for (; i + 32 <= n; i += 32) {
        moments_add(acc, kind, dtype, x, i, 0);
        moments_add(acc, kind, dtype, x, i + 16, 1);
    }
    if (i + 16 <= n) {
        moments_add(acc, kind, dtype, x, i, 0);
        i += 16;
    }
    return i;
}

/* The LayerNorm sums of a float16/bfloat16 chunk x[0 .. n) in float64, as float32 data's: for
   a chunk whose first element K lies far from its mean (an outlier), where the float32 block
   sums of x - K, each of about |K - mean| * 8, would round at that scale and take the
   deviations' own digits (rows of 4096 float16 with x[0] = 1e4: outputs 3.7 units in the last
   place off, 0.8% of them misrounded; the mean 130 float32 units off).  Out of line: only such
   chunks pay for it. */
__attribute__((noinline, cold)) static chunk_sums chunk_sums_wide(ln_dtype dtype, const void *x, ptrdiff_t n)
{
    moments_acc acc;
    moments_start(&acc, LN_NORM_LAYER, dtype, x, 0);
    acc.narrow = 0;
    const ptrdiff_t i = moments_add_groups(&acc, LN_NORM_LAYER, dtype, x, n);
    return lane_sums(&acc, LN_NORM_LAYER, dtype, x, i, n);
}

/* Whether a float16/bfloat16 chunk of n elements, summed in float32 blocks, must be summed
   again by chunk_sums_wide: where its shift K lies more than about 4 standard deviations from
   its mean, sum2 = M2 + n (mean - K)^2 exceeds 16 M2, and the blocks' rounding, relative to
   sum2, would be that much larger relative to M2.  Random rows rarely have such a first
   element (a normal one, about once in 9000 rows). */
static LN_ALWAYS_INLINE int sums_need_wide(ln_norm_kind kind, ln_dtype dtype, chunk_sums sums, ptrdiff_t n)
{
    return ln_dtype_is_16bit(dtype) && kind == LN_NORM_LAYER &&
           __builtin_expect(sums.sum1 * sums.sum1 > (15.0 / 16.0) * (double)n * sums.sum2, 0);
}

/* A chunk's sums: lane_sums, or chunk_sums_wide's where sums_need_wide. */
static LN_ALWAYS_INLINE chunk_sums moments_sums(moments_acc *acc, ln_norm_kind kind, ln_dtype dtype,
                                                const void *x, ptrdiff_t i, ptrdiff_t n)
{
    const chunk_sums sums = lane_sums(acc, kind, dtype, x, i, n);
    return sums_need_wide(kind, dtype, sums, n) ? chunk_sums_wide(dtype, x, n) : sums;
}

/* The moments of a chunk of n elements from its sums: mean = K + sum1 / n and
   M2 = sum2 - sum1 (mean - K); RMSNorm's are about zero, M2 = sum2. */
static LN_ALWAYS_INLINE ln_moments moments_of_sums(ln_norm_kind kind, chunk_sums sums, ptrdiff_t n)
{
    if (kind == LN_NORM_RMS) {
        const ln_moments about_zero = {(double)n, 0.0, sums.sum2};
        return about_zero;
    }
    const double mean_offset = sums.sum1 / (double)n;
    const ln_moments m = {(double)n, sums.shift + mean_offset, sums.sum2 - sums.sum1 * mean_offset};
    return m;
}

/* The sums of a chunk of 1 <= n <= LN_CHUNK elements, as lane_sums gives them: the caller
   applies sums_need_wide. */
static LN_ALWAYS_INLINE chunk_sums chunk_lane_sums(ln_norm_kind kind, ln_dtype dtype, const void *x, ptrdiff_t n,
                                                   ptrdiff_t read_ahead)
{
    assert(x && 1 <= n && n <= LN_CHUNK);
    moments_acc acc;
    moments_start(&acc, kind, dtype, x, read_ahead);
    const ptrdiff_t i = moments_add_groups(&acc, kind, dtype, x, n);
    return lane_sums(&acc, kind, dtype, x, i, n);
}

/* The sums of a chunk of 1 <= n <= LN_CHUNK elements. */
static LN_ALWAYS_INLINE chunk_sums chunk_sums_of(ln_norm_kind kind, ln_dtype dtype, const void *x, ptrdiff_t n,
                                                 ptrdiff_t read_ahead)
{
    const chunk_sums sums = chunk_lane_sums(kind, dtype, x, n, read_ahead);
    return sums_need_wide(kind, dtype, sums, n) ? chunk_sums_wide(dtype, x, n) : sums;
}

static LN_ALWAYS_INLINE ln_moments chunk_moments(ln_norm_kind kind, ln_dtype dtype, const void *x, ptrdiff_t n,
                                                 ptrdiff_t read_ahead)
{
    return moments_of_sums(kind, chunk_sums_of(kind, dtype, x, n, read_ahead), n);
}

/* Moments of a whole row: its chunks, merged left to right. */
static LN_ALWAYS_INLINE ln_moments row_moments(ln_norm_kind kind, ln_dtype dtype, const char *x, ptrdiff_t n,
                                               ptrdiff_t read_ahead)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    ln_moments m = {0.0, 0.0, 0.0};
    for (ptrdiff_t start = 0; start < n; start += LN_CHUNK) {  /* one loop: one inlined copy */
        const ptrdiff_t len = n - start < LN_CHUNK ? n - start : LN_CHUNK;
        const ln_moments chunk = chunk_moments(kind, dtype, x + start * elsize, len, read_ahead);
        m = start == 0 ? chunk : ln_merge(m, chunk);
    }
    return m;
}

/* ------------------------------------------------------------------------ */
/* Forward: normalize                                                        */
/* ------------------------------------------------------------------------ */

/* One row's normalization, per element:
       float16/float32: y = fma((x - mean_hi) - mean_lo, float(rstd) * w, b), computed in
                        float32, mean_hi = float(mean), mean_lo = float(mean - mean_hi)
       float64:         y = fma(x - mean, rstd * w, b)
   weight and bias are of the param type (float32, or float64 for float64 data), or NULL.
   RMSNorm's mean is 0, and its x - 0 - 0 is x: it skips the subtractions, same bits. */
struct row_norm {
    float mean_hi, mean_lo, scale;
    gf mean_hi_v, mean_lo_v, scale_v;
    double mean, rstd;
    gd mean_v, rstd_v;
};

static LN_ALWAYS_INLINE row_norm row_norm_of(ln_dtype dtype, double mean, double rstd)
{
    row_norm k = {0};
    if (dtype == LN_F64) {
        k.mean = mean;
        k.rstd = rstd;
        k.mean_v = gd_splat(mean);
        k.rstd_v = gd_splat(rstd);
    }
    else {
        k.mean_hi = (float)mean;
        k.mean_lo = (float)(mean - (double)k.mean_hi);
        k.scale = (float)rstd;
        k.mean_hi_v = gf_splat(k.mean_hi);
        k.mean_lo_v = gf_splat(k.mean_lo);
        k.scale_v = gf_splat(k.scale);
    }
    return k;
}

/* row_norm_of's float32 constants of 16 rows, a row per lane (rows of the short-row and the
   strided routes). */
typedef struct {
    gf mean_hi, mean_lo, scale;
} lane_norm;

static LN_ALWAYS_INLINE lane_norm lane_norm_of(const double means[16], const double rstds[16])
{
    /* row_norm_of's arithmetic, in loops the compiler turns into a few vector conversions */
    float mean_hi[16], mean_lo[16], scales[16];
    for (int k = 0; k < 16; k++) {
        mean_hi[k] = (float)means[k];
    }
    for (int k = 0; k < 16; k++) {
        mean_lo[k] = (float)(means[k] - (double)mean_hi[k]);
    }
    for (int k = 0; k < 16; k++) {
        scales[k] = (float)rstds[k];
    }
    return (lane_norm){gf_load(mean_hi), gf_load(mean_lo), gf_load(scales)};
}

/* ln_rstd_of of 16 rows of n elements, a row per lane, from their means and M2s (IEEE
   division and square root are correctly rounded, so lane and scalar results agree bit for
   bit). */
static LN_ALWAYS_INLINE void lane_rstds(ptrdiff_t n, double eps, const double means[16], const double m2s[16],
                                        double rstds[16])
{
    double vars[16];
    gd_store(vars, gd_div(gd_load(m2s), gd_splat((double)n)));
    for (int k = 0; k < 16; k++) {
        vars[k] = m2s[k] > 0.0 ? vars[k] : 0.0;
    }
    gd_store(rstds, gd_div(gd_splat(1.0), gd_sqrt(gd_add(gd_load(vars), gd_splat(eps)))));
    for (int k = 0; k < 16; k++) {
        const ln_moments m = {(double)n, means[k], m2s[k]};
        rstds[k] = ln_moments_finite(m) ? rstds[k] : NAN;
    }
}

/* y[i .. i + 16) of a float16, float32 or bfloat16 row, in float32 lanes. */
static LN_ALWAYS_INLINE gf normalized_f32(ln_norm_kind kind, ln_dtype dtype, const row_norm *k, const void *x,
                                          ptrdiff_t i, const void *weight, const void *bias)
{
    const gf value_x = load_as_f32(dtype, x, i);
    const gf centred = kind == LN_NORM_RMS ? value_x : gf_sub(gf_sub(value_x, k->mean_hi_v), k->mean_lo_v);
    const gf a = weight ? gf_mul(gf_load((const float *)weight + i), k->scale_v) : k->scale_v;
    const gf b = bias ? gf_load((const float *)bias + i) : gf_splat((float)ln_absent_bias(kind));
    return gf_fma(centred, a, b);
}

/* y[i .. i + 16) of a float64 row. */
static LN_ALWAYS_INLINE gd normalized_f64(ln_norm_kind kind, const row_norm *k, const void *x, ptrdiff_t i,
                                          const void *weight, const void *bias)
{
    const gd value_x = gd_load((const double *)x + i);
    const gd centred = kind == LN_NORM_RMS ? value_x : gd_sub(value_x, k->mean_v);
    const gd a = weight ? gd_mul(gd_load((const double *)weight + i), k->rstd_v) : k->rstd_v;
    const gd b = bias ? gd_load((const double *)bias + i) : gd_splat(ln_absent_bias(kind));
    return gd_fma(centred, a, b);
}

/* y[i .. i + 16) from x[i .. i + 16), stored as `store` says: LN_STREAM_LINES, by
   non-temporal stores, y + i 64-byte aligned (32-byte for 16-bit output, whose groups are half
   a cache line); LN_STREAM_PIECES, float32/float64 only, in 16-byte pieces, y + i 16-byte
   aligned. */
static LN_ALWAYS_INLINE void normalize_group(ln_norm_kind kind, ln_dtype dtype, const row_norm *k, const void *x,
                                             void *y, ptrdiff_t i, const void *weight, const void *bias,
                                             ln_store store)
{
    assert(store != LN_STREAM_PIECES || !ln_dtype_is_16bit(dtype));
    if (dtype == LN_F64) {
        const gd value = normalized_f64(kind, k, x, i, weight, bias);
        if (store == LN_STREAM_PIECES) {
            gd_stream16((double *)y + i, value);
        }
        else if (store == LN_STREAM_LINES) {
            gd_stream((double *)y + i, value);
        }
        else {
            gd_store((double *)y + i, value);
        }
    }
    else {
        const gf value = normalized_f32(kind, dtype, k, x, i, weight, bias);
        if (store == LN_STREAM_PIECES && dtype == LN_F32) {
            gf_stream16((float *)y + i, value);
        }
        else if (store == LN_STREAM_LINES && dtype == LN_F32) {
            gf_stream((float *)y + i, value);
        }
        else if (store == LN_STREAM_LINES && ln_dtype_is_16bit(dtype)) {
            uint16_t halves[16];
            store_from_f32(dtype, halves, 0, value, 0);
            halves_stream((uint16_t *)y + i, halves);
        }
        else {
            store_from_f32(dtype, y, i, value, 0);
        }
    }
}

/* y[i .. i + 32), two groups; bfloat16 where the level stores two groups in one conversion
   (LN_BF16_PAIR_STORE, gf_store2_bf16) goes that way, the same bits. */
static LN_ALWAYS_INLINE void normalize_pair(ln_norm_kind kind, ln_dtype dtype, const row_norm *k, const void *x,
                                            void *y, ptrdiff_t i, const void *weight, const void *bias,
                                            ln_store store)
{
#if LN_BF16_PAIR_STORE
    if (dtype == LN_BF16) {
        gf_store2_bf16((uint16_t *)y + i, normalized_f32(kind, dtype, k, x, i, weight, bias),
                       normalized_f32(kind, dtype, k, x, i + 16, weight, bias), 0, store == LN_STREAM_LINES);
        return;
    }
#endif
    normalize_group(kind, dtype, k, x, y, i, weight, bias, store);
    normalize_group(kind, dtype, k, x, y, i + 16, weight, bias, store);
}

/* Elements [i, i + count) of row x into row `copy`, as they are. */
static LN_ALWAYS_INLINE void copy_elements(ln_dtype dtype, const char *x, char *copy, ptrdiff_t i, ptrdiff_t count)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    memcpy(copy + i * elsize, x + i * elsize, (size_t)(count * elsize));
}

/* The whole groups of a float32/float64 chunk, elements [0, groups_end), in blocks of `block`
   elements (parity_block_of's: the whole chunk, or a multiple of 32, so that every block starts
   at an even group), each block's even groups first, then its odd ones: with `gather`, their
   moments into acc (the sums of each parity kept in registers while its groups go), and the
   groups copied into chunk_copy where it is not NULL; with `emit`, the same columns of row x,
   column + 0 .. column + groups_end, normalized by norm into row y (y may be x).  acc is
   moments_start's; the pipelined loop's last turn, which gathers nothing, passes one of zeros,
   whose sums no one reads. */
static LN_ALWAYS_INLINE void groups_by_parity(ln_norm_kind kind, ln_dtype dtype, int gather, moments_acc *acc,
                                              const char *chunk, char *chunk_copy, ptrdiff_t groups_end,
                                              ptrdiff_t block, int emit, const row_norm *norm, const char *x,
                                              char *y, ptrdiff_t column, const void *weight, const void *bias)
{
    assert(!ln_dtype_is_16bit(dtype) && (block >= groups_end || block % 32 == 0) && groups_end % 16 == 0);
    assert(!gather || !acc->read_ahead);
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    for (ptrdiff_t first = 0; first < groups_end; first += block) {
        const ptrdiff_t end = groups_end - first < block ? groups_end : first + block;
        for (int odd = 0; odd < 2; odd++) {
            gd s1 = odd ? acc->s1_odd : acc->s1_even, s2 = odd ? acc->s2_odd : acc->s2_even;
            for (ptrdiff_t i = first + 16 * odd; i < end; i += 32) {
                if (gather) {
                    moments_add_wide(kind, dtype, chunk + i * elsize, acc->shift_v, &s1, &s2);
                }
                if (chunk_copy) {
                    copy_elements(dtype, chunk, chunk_copy, i, 16);
                }
                if (emit) {
                    normalize_group(kind, dtype, norm, x, y, column + i, weight, bias, LN_STORE_CACHED);
                }
            }
            if (odd) {
                acc->s1_odd = s1;
                acc->s2_odd = s2;
            }
            else {
                acc->s1_even = s1;
                acc->s2_even = s2;
            }
        }
    }
}

/* y[i] from x[i]: the same arithmetic, one element. */
static LN_ALWAYS_INLINE void normalize_one(ln_norm_kind kind, ln_dtype dtype, const row_norm *k, const void *x,
                                           void *y, ptrdiff_t i, const void *weight, const void *bias)
{
    if (dtype == LN_F64) {
        const double value_x = ((const double *)x)[i];
        const double a = weight ? ((const double *)weight)[i] * k->rstd : k->rstd;
        ((double *)y)[i] = fma(kind == LN_NORM_RMS ? value_x : value_x - k->mean, a,
                               bias ? ((const double *)bias)[i] : ln_absent_bias(kind));
        return;
    }
    const float value_x = (float)ln_load1_as_f64(dtype, x, i);
    const float centred = kind == LN_NORM_RMS ? value_x : (value_x - k->mean_hi) - k->mean_lo;
    const float a = weight ? ((const float *)weight)[i] * k->scale : k->scale;
    ln_store1_from_f64(dtype, y, i, fmaf(centred, a, bias ? ((const float *)bias)[i] : (float)ln_absent_bias(kind)));
}

/* y[begin .. end) of a span of n elements, by ordinary stores: from a whole group of the
   span that holds them, normalized into a buffer (each lane's arithmetic is its own, so the
   elements are normalize_one's), or element by element in a span shorter than a group.  For
   the few elements before and after a span's groups: one by one, a float16/bfloat16 element's
   conversion in scalar code cost 2048x4096 float16 forward a tenth of its time.  The group
   may take in elements before `begin` that an in-place call has written already; their lanes
   are not stored. */
static LN_ALWAYS_INLINE void normalize_few(ln_norm_kind kind, ln_dtype dtype, const row_norm *k, const void *x,
                                           void *y, ptrdiff_t begin, ptrdiff_t end, ptrdiff_t n,
                                           const void *weight, const void *bias)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    for (ptrdiff_t i = begin; i < end && n < 16; i++) {
        normalize_one(kind, dtype, k, x, y, i, weight, bias);
    }
    for (ptrdiff_t i = begin; i < end && n >= 16;) {
        const ptrdiff_t group = i + 16 <= n ? i : n - 16, stop = end < group + 16 ? end : group + 16;
        double lanes[16];  /* a group of any element type */
        if (dtype == LN_F64) {
            gd_store(lanes, normalized_f64(kind, k, x, group, weight, bias));
        }
        else {
            store_from_f32(dtype, lanes, 0, normalized_f32(kind, dtype, k, x, group, weight, bias), 0);
        }
        memcpy((char *)y + i * elsize, (const char *)lanes + (i - group) * elsize, (size_t)((stop - i) * elsize));
        i = stop;
    }
}

/* y[0 .. n) from x[0 .. n).  `streaming`, for rows too long to stay in cache: the output
   bypasses the caches, so it does not evict the input that the loop is about to read
   again, and costs no read for ownership.  The head up to a 64-byte boundary then goes by
   ordinary stores; the values are the same.  A float16/bfloat16 group is half a cache line,
   and the next group writes the other half, so the line leaves whole. */
static LN_ALWAYS_INLINE void normalize(ln_norm_kind kind, ln_dtype dtype, int streaming, const void *x, void *y,
                                       ptrdiff_t n, double mean, double rstd, const void *weight,
                                       const void *bias)
{
    assert(x && y && 1 <= n && n <= LN_NORMALIZE_SPAN);
    const row_norm k = row_norm_of(dtype, mean, rstd);
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    const ln_store store = streaming ? LN_STREAM_LINES : LN_STORE_CACHED;
    ptrdiff_t i = 0;
    while (streaming && i < n && ((uintptr_t)((char *)y + i * elsize) & 63) != 0) {
        i++;
    }
    normalize_few(kind, dtype, &k, x, y, 0, i, n, weight, bias);
    for (; i + 32 <= n; i += 32) {
        normalize_pair(kind, dtype, &k, x, y, i, weight, bias, store);
    }
    for (; i + 16 <= n; i += 16) {
        normalize_group(kind, dtype, &k, x, y, i, weight, bias, store);
    }
    normalize_few(kind, dtype, &k, x, y, i, n, n, weight, bias);
    if (streaming) {
        stream_fence();
    }
}

/* normalize(), the loop for rows with both weight and bias compiled apart where the level
   wants it (LN_AFFINE_LOOP_APART): the modules' case, with no tests in its loop. */
static LN_ALWAYS_INLINE void normalize_row(ln_norm_kind kind, ln_dtype dtype, int streaming, const void *x,
                                           void *y, ptrdiff_t n, double mean, double rstd, const void *weight,
                                           const void *bias)
{
    bias = kind == LN_NORM_RMS ? NULL : bias;
    if (LN_AFFINE_LOOP_APART && weight && bias) {
        normalize(kind, dtype, streaming, x, y, n, mean, rstd, weight, bias);
    }
    else {
        normalize(kind, dtype, streaming, x, y, n, mean, rstd, weight, bias);
    }
}

/* ------------------------------------------------------------------------ */
/* Forward: the residual sum                                                 */
/* ------------------------------------------------------------------------ */

/* sum[i .. i + 16) = x + residual rounded to the element type as NumPy's add rounds it:
   float16 and bfloat16 through float32, whose 24 bits (at least 2 * 11 + 2) make rounding twice the
   same as rounding once; float32 and float64 in their own precision.  A NaN sum is the one
   quiet NaN: which operand's NaN an add returns is up to the compiler's operand order and
   the CPU.  sum may be x's or residual's own memory: each group is loaded before it is stored. */
static LN_ALWAYS_INLINE void add_group(ln_dtype dtype, const void *x, const void *residual, void *sum, ptrdiff_t i)
{
    if (dtype == LN_F64) {
        gd_store((double *)sum + i,
                 gd_quiet_nans(gd_add(gd_load((const double *)x + i), gd_load((const double *)residual + i))));
    }
    else {
        store_from_f32(dtype, sum, i, gf_quiet_nans(gf_add(load_as_f32(dtype, x, i), load_as_f32(dtype, residual, i))),
                       1);
    }
}

/* sum[i] = x[i] + residual[i]: the same arithmetic, one element. */
static LN_ALWAYS_INLINE void add_one(ln_dtype dtype, const void *x, const void *residual, void *sum, ptrdiff_t i)
{
    if (dtype == LN_F64) {
        const double value = ((const double *)x)[i] + ((const double *)residual)[i];
        ((double *)sum)[i] = isnan(value) ? NAN : value;
    }
    else {
        const float value = (float)ln_load1_as_f64(dtype, x, i) + (float)ln_load1_as_f64(dtype, residual, i);
        ln_store1_from_f64(dtype, sum, i, isnan(value) ? NAN : value);
    }
}

/* to[0 .. n) = from[0 .. n) as float32, a group at a time: exact, every float16 and bfloat16
   value being a float32 one (the float64 instance is never in a table: see
   LN_DTYPE_TABLE_ENTRY). */
static LN_ALWAYS_INLINE void widen_to_f32(ln_dtype dtype, const void *from, float *to, ptrdiff_t n)
{
    assert(dtype != LN_F64);
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        gf_store(to + i, load_as_f32(dtype, from, i));
    }
    for (; i < n; i++) {
        to[i] = (float)ln_load1_as_f64(dtype, from, i);
    }
}

/* params[0 .. n) = sums in dtype's parameter type, a NaN as the one quiet NaN: converted
   before the select, so that the loop vectorizes at the level's width (a 1x4096 backward's
   parameter gradients go out 16 at a time at AVX-512 where the scalar loop took most of the
   call after the kernel). */
static LN_ALWAYS_INLINE void store_params(ln_dtype dtype, void *params, const double *sums, ptrdiff_t n)
{
    if (dtype == LN_F64) {
        double *out = params;
        for (ptrdiff_t i = 0; i < n; i++) {
            out[i] = isnan(sums[i]) ? NAN : sums[i];
        }
        return;
    }
    float *out = params;
    for (ptrdiff_t i = 0; i < n; i++) {
        const float param = (float)sums[i];
        out[i] = isnan(param) ? NAN : param;
    }
}

/* sum[0 .. n) = x + residual, x's and residual's elements x_step and residual_step bytes
   apart: in groups where they are adjacent, else one at a time (the same values). */
static LN_ALWAYS_INLINE void add_row(ln_dtype dtype, const char *x, ptrdiff_t x_step, const char *residual,
                                    ptrdiff_t residual_step, void *sum, ptrdiff_t n)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    assert(x && residual && sum && n >= 0);
    ptrdiff_t i = 0;
    if (x_step != elsize || residual_step != elsize) {
        for (; i < n; i++) {
            add_one(dtype, x + i * x_step, residual + i * residual_step, (char *)sum + i * elsize, 0);
        }
        return;
    }
    for (; i + 16 <= n; i += 16) {
        add_group(dtype, x, residual, sum, i);
    }
    for (; i < n; i++) {
        add_one(dtype, x, residual, sum, i);
    }
}

/* sum's group at element i from the 16 elements at `from`: by 16-byte non-temporal stores
   when `streaming` (float32/float64, sum + i 16-byte aligned). */
static LN_ALWAYS_INLINE void sum_store_group(ln_dtype dtype, char *sum, ptrdiff_t i, const void *from, int streaming)
{
    const ptrdiff_t offset = i * (ptrdiff_t)ln_dtype_size(dtype);
    if (streaming && dtype == LN_F64) {
        gd_stream16((double *)(sum + offset), gd_load(from));
    }
    else if (streaming) {
        gf_stream16((float *)(sum + offset), gf_load(from));
    }
    else {
        memcpy(sum + offset, from, (size_t)group_bytes_of(dtype));
    }
}

/* Group i of a chunk's sum, x + residual (add_group), into lanes, and to sum and buffer as
   sum_chunk_moments says. */
static LN_ALWAYS_INLINE void sum_chunk_group(ln_dtype dtype, const char *x, const char *residual, char *sum,
                                             char *buffer, ptrdiff_t delay, ptrdiff_t i, double lanes[16],
                                             int streaming, ptrdiff_t read_ahead)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), offset = i * elsize, behind = 16 * delay;
    read_ahead_of_group(dtype, x + offset, i, read_ahead);
    read_ahead_of_group(dtype, residual + offset, i, read_ahead);
    add_group(dtype, x + offset, residual + offset, lanes, 0);
    if (buffer) {
        memcpy(buffer + offset, lanes, (size_t)group_bytes_of(dtype));
    }
    if (!delay) {
        sum_store_group(dtype, sum, i, lanes, streaming);
    }
    else if (i >= behind) {
        sum_store_group(dtype, sum, i - behind, buffer + (i - behind) * elsize, streaming);
    }
}

/* chunk_moments of sum[0 .. n) = x + residual, summed as it is formed (sum_chunk_group), so
   that the statistics come from the values in registers instead of from memory; the same
   operations in the same order, so the same bits.  sum may be x's or residual's own memory:
   each element is read before it is written.  buffer: NULL, or memory that gets the chunk's
   sum too (forward_sum_rows); with `delay`, sum's stores are made from it that many groups
   behind the loads of x and residual (sum_delay_of), the last `delay` groups' at the chunk's
   end.
   read_ahead: ln_read_ahead's, for x and residual both. */
static LN_ALWAYS_INLINE ln_moments sum_chunk_moments(ln_norm_kind kind, ln_dtype dtype, const char *x,
                                                     const char *residual, char *sum, char *buffer, ptrdiff_t delay,
                                                     ptrdiff_t n, int streaming, ptrdiff_t read_ahead)
{
    assert(x && residual && sum && 1 <= n && n <= LN_CHUNK && (buffer || !delay));
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), behind = 16 * delay;
    if (n < 16) {
        add_row(dtype, x, elsize, residual, elsize, sum, n);
        if (buffer) {
            memcpy(buffer, sum, (size_t)(n * elsize));
        }
        return chunk_moments(kind, dtype, sum, n, 0);
    }
    double lanes[16];
    moments_acc acc;
    sum_chunk_group(dtype, x, residual, sum, buffer, delay, 0, lanes, streaming, 0);
    moments_start(&acc, kind, dtype, lanes, 0);
    moments_add_group(&acc, kind, dtype, lanes, 0, 0);
    ptrdiff_t i = 16;
    for (; i + 16 <= n; i += 16) {
        sum_chunk_group(dtype, x, residual, sum, buffer, delay, i, lanes, streaming, read_ahead);
        moments_add_group(&acc, kind, dtype, lanes, i, (int)(i / 16) % 2);
    }
    for (ptrdiff_t j = i > behind ? i - behind : 0; delay && j < i; j += 16) {  /* the stores still behind */
        sum_store_group(dtype, sum, j, buffer + j * elsize, streaming);
    }
    for (ptrdiff_t j = i; j < n; j++) {
        if (buffer) {  /* first: sum may be x's or residual's memory */
            add_one(dtype, x, residual, buffer, j);
        }
        add_one(dtype, x, residual, sum, j);
    }
    return moments_of_sums(kind, moments_sums(&acc, kind, dtype, sum, i, n), n);
}

/* Elements [begin, end) of sum = x + residual, n elements in all, normalized into y by
   ordinary stores, where they lie within one group's reach (the head before y's first line,
   the tail after the last whole group, or a span shorter than a group): the sum formed in
   lanes, a whole group of it where the span holds one, then normalize_few's arithmetic.  The
   group may take in elements before `begin` that an in-place output has written already;
   their lanes are not stored. */
static LN_ALWAYS_INLINE void normalize_sum_few(ln_norm_kind kind, ln_dtype dtype, const row_norm *k, const char *x,
                                               const char *residual, char *y, ptrdiff_t begin, ptrdiff_t end,
                                               ptrdiff_t n, const void *weight, const void *bias)
{
    const ptrdiff_t first = n < 16 ? 0 : begin + 16 <= n ? begin : n - 16, count = n < 16 ? n : 16;
    assert(first <= begin && end <= first + count);
    if (begin == end) {
        return;
    }
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), param_size = (ptrdiff_t)ln_param_size(dtype);
    const char *x_first = x + first * elsize, *residual_first = residual + first * elsize;
    double lanes[16];
    if (count == 16) {
        add_group(dtype, x_first, residual_first, lanes, 0);
    }
    for (ptrdiff_t j = begin - first; j < end - first && count < 16; j++) {
        add_one(dtype, x_first, residual_first, lanes, j);
    }
    normalize_few(kind, dtype, k, lanes, y + first * elsize, begin - first, end - first, count,
                  weight ? (const char *)weight + first * param_size : NULL,
                  bias ? (const char *)bias + first * param_size : NULL);
}

/* normalize() of sum[0 .. n) = x + residual with the sum formed again from x and residual
   (add_group's bits), which are still in cache, where sum went to memory by non-temporal
   stores: reading it back would fetch it from memory.  The output streams too, as
   normalize()'s does: by ordinary stores up to y's first 64-byte boundary and whole lines
   after it (16-byte pieces from y's start took four stores and three extractions a group at
   AVX-512: 2048x4096 float32 add_layer_norm, one thread, arrays 16 bytes into a page, 4-6%
   of the call).  No prefetch of the next row here: the hardware's prefetchers do better
   alone (the same call with the next row's x and residual prefetched from this loop: 7.1 ms;
   without: 4.6 ms); the statistics loop reads ahead instead (sum_chunk_moments). */
static LN_ALWAYS_INLINE void normalize_sum(ln_norm_kind kind, ln_dtype dtype, const char *x, const char *residual,
                                           char *y, ptrdiff_t n, double mean, double rstd, const void *weight,
                                           const void *bias)
{
    assert(x && residual && y && 1 <= n && n <= LN_NORMALIZE_SPAN);
    const row_norm k = row_norm_of(dtype, mean, rstd);
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), param_size = (ptrdiff_t)ln_param_size(dtype);
    ptrdiff_t i = 0;
    while (i < n && ((uintptr_t)(y + i * elsize) & 63) != 0) {
        i++;
    }
    normalize_sum_few(kind, dtype, &k, x, residual, y, 0, i, n, weight, bias);
    double lanes[16];
    for (; i + 16 <= n; i += 16) {
        add_group(dtype, x + i * elsize, residual + i * elsize, lanes, 0);
        normalize_group(kind, dtype, &k, lanes, y + i * elsize, 0,
                        weight ? (const char *)weight + i * param_size : NULL,
                        bias ? (const char *)bias + i * param_size : NULL, LN_STREAM_LINES);
    }
    normalize_sum_few(kind, dtype, &k, x, residual, y, i, n, n, weight, bias);
}

/* ------------------------------------------------------------------------ */
/* Forward: rows                                                             */
/* ------------------------------------------------------------------------ */

/* ln_param_magnitudes of weight[0 .. n) and bias[0 .. n), either of them NULL where absent,
   both in one loop (two streams of reads in flight: one row of 3,000,000 float32 elements,
   one thread, scanned span by span as ln_forward_huge_rows does, 1.39 -> 1.15 ms for the call).
   Integer min/max over the bit patterns, ordered as the magnitudes are (NaN above Inf), with
   no branch, which the compiler vectorizes at the level's width: a scalar float scan of 768
   weights and biases cost 16x768 float32 forward a third.  The minimum is taken less the
   smallest normal's bits, so that zeros and subnormals wrap above every normal (a compare
   against the smallest normal became a scalar loop: 3.6 -> 5.2 us).  FLOAT and BITS: the
   parameters' type and an unsigned integer as wide; MAGNITUDE and NORMAL_MIN: the mask of all
   but the sign bit and the smallest normal's bits; has_weight and has_bias are constants where
   it is called. */
#define LN_PARAM_MAGNITUDES(name, BITS, FLOAT, MAGNITUDE, NORMAL_MIN)                              \
    static LN_ALWAYS_INLINE ln_param_magnitudes name(const void *weight, const void *bias, int has_weight, \
                                                     int has_bias, ptrdiff_t n)                      \
    {                                                                                                \
        typedef BITS bits_alias __attribute__((may_alias));                                          \
        const bits_alias *weight_bits = weight, *bias_bits = bias;                                   \
        BITS low = (BITS)-1, high = 0, bias_high = 0;                                                \
        for (ptrdiff_t j = 0; j < n; j++) {                                                          \
            if (has_weight) {                                                                        \
                const BITS magnitude = weight_bits[j] & (MAGNITUDE);                                 \
                low = magnitude - (NORMAL_MIN) < low ? magnitude - (NORMAL_MIN) : low;               \
                high = magnitude > high ? magnitude : high;                                          \
            }                                                                                        \
            if (has_bias) {                                                                          \
                const BITS magnitude = bias_bits[j] & (MAGNITUDE);                                   \
                bias_high = magnitude > bias_high ? magnitude : bias_high;                           \
            }                                                                                        \
        }                                                                                            \
        const BITS low_bits = low + (NORMAL_MIN);                                                    \
        FLOAT low_value, high_value, bias_value;                                                     \
        memcpy(&low_value, &low_bits, sizeof low_value);                                             \
        memcpy(&high_value, &high, sizeof high_value);                                               \
        memcpy(&bias_value, &bias_high, sizeof bias_value);                                          \
        return (ln_param_magnitudes){                                                                \
            !has_weight ? 1.0 : low > (MAGNITUDE) ? INFINITY : (double)low_value,                   \
            has_weight ? (double)high_value : 1.0,                                                   \
            has_bias ? (double)bias_value : 0.0,                                                     \
        };                                                                                           \
    }

LN_PARAM_MAGNITUDES(param_magnitudes_64bit, uint64_t, double, 0x7fffffffffffffffu, 0x0010000000000000u)
LN_PARAM_MAGNITUDES(param_magnitudes_32bit, uint32_t, float, 0x7fffffffu, 0x00800000u)
#undef LN_PARAM_MAGNITUDES

static LN_ALWAYS_INLINE ln_param_magnitudes param_magnitudes_of(ln_dtype dtype, const void *weight, const void *bias,
                                                              ptrdiff_t n)
{
    const int f64 = dtype == LN_F64;
    if (weight && bias) {
        return f64 ? param_magnitudes_64bit(weight, bias, 1, 1, n) : param_magnitudes_32bit(weight, bias, 1, 1, n);
    }
    if (weight) {
        return f64 ? param_magnitudes_64bit(weight, NULL, 1, 0, n) : param_magnitudes_32bit(weight, NULL, 1, 0, n);
    }
    if (bias) {
        return f64 ? param_magnitudes_64bit(NULL, bias, 0, 1, n) : param_magnitudes_32bit(NULL, bias, 0, 1, n);
    }
    return ln_magnitudes_without_params();
}

/* Whether rows of n elements get their output in float64 arithmetic: float64 data, and
   float16/bfloat16 rows shorter than one group (forward_short_rows, and tiles of such rows),
   whose float32 answer rounded to 11 or 8 bits would go to the wrong side of the near-ties
   that such rows make often (n = 2: x_hat = +-1 / sqrt(1 + eps / var), so y is w + b less
   a hair), at a cost that does not matter to rows this short. */
static LN_ALWAYS_INLINE int output_in_f64(ln_dtype dtype, ptrdiff_t n)
{
    return dtype == LN_F64 || (ln_dtype_is_16bit(dtype) && n < 16);
}

/* x / n per lane.  Where n is a power of two its reciprocal is exact, x * (1 / n) is the
   same real number as x / n and so rounds to the same bits, and a multiply costs a fraction
   of a division (1000000x8 float32 forward, one thread: 15.7 -> 13.9 ms). */
typedef struct {
    gd n, reciprocal;
    int by_reciprocal;
} lane_divisor;

static LN_ALWAYS_INLINE lane_divisor lane_divisor_of(ptrdiff_t n)
{
    assert(n >= 1);
    return (lane_divisor){gd_splat((double)n), gd_splat(1.0 / (double)n), (n & (n - 1)) == 0};
}

static LN_ALWAYS_INLINE gd gd_div_by(gd x, const lane_divisor *d)
{
    return d->by_reciprocal ? gd_mul(x, d->reciprocal) : gd_div(x, d->n);
}

/* Rows shorter than one group (n < 16) go 16 at a time, turned so that lane k of every
   group holds row block + k (a row of 8 float32 elements is half a group: a vector over
   the row would leave most lanes idle, and its sums would need a reduction per row).
   columns[i] holds element i of the block's rows, as elements of the data's type, so that
   they are converted a group at a time; the slots past the last row hold zeros.  Where the
   level has it (LN_ROWS8_F32_TRANSPOSE), 16 rows of 8 float32 elements one after another turn
   in registers. */
static LN_ALWAYS_INLINE int rows8_f32_adjacent(ln_dtype dtype, const ln_array *array, const ln_extent *extent,
                                               ptrdiff_t block, ptrdiff_t rows, ptrdiff_t n)
{
    return LN_ROWS8_F32_TRANSPOSE && dtype == LN_F32 && n == 8 && rows == 16 && array->walk.elem_step == 4 &&
           ln_rows_consecutive(array, extent, block, block + 16, 32);
}

static LN_ALWAYS_INLINE void short_rows_to_columns(ln_dtype dtype, const ln_array *array, const ln_extent *extent,
                                                   ptrdiff_t block, ptrdiff_t rows, ptrdiff_t n,
                                                   double columns[16][16])
{
    const size_t size = ln_dtype_size(dtype);
#if LN_ROWS8_F32_TRANSPOSE
    if (rows8_f32_adjacent(dtype, array, extent, block, rows, n)) {
        rows8_f32_to_columns((const float *)ln_row_address(array, extent, block), columns);
        return;
    }
#endif
    for (ptrdiff_t k = 0; k < 16; k++) {
        const char *row = k < rows ? ln_row_address(array, extent, block + k) : NULL;
        for (ptrdiff_t i = 0; i < n; i++) {
            char *lane = (char *)columns[i] + (size_t)k * size;
            if (row) {
                memcpy(lane, row + (size_t)i * size, size);
            }
            else {
                memset(lane, 0, size);
            }
        }
    }
}

static LN_ALWAYS_INLINE gd short_rows_column(ln_dtype dtype, const double columns[16][16], ptrdiff_t i)
{
    return load_as_f64(dtype, columns[i], 0);
}

/* Element i of row block + k from lane k of columns[i] (elements of the data's type), for
   the rows k < rows with written[k] (NULL: every one). */
static LN_ALWAYS_INLINE void short_rows_from_columns(ln_dtype dtype, const ln_array *array, const ln_extent *extent,
                                                     ptrdiff_t block, ptrdiff_t rows, const int *written,
                                                     ptrdiff_t n, double columns[16][16])
{
    const size_t size = ln_dtype_size(dtype);
#if LN_ROWS8_F32_TRANSPOSE
    int every_row = 1;
    for (ptrdiff_t k = 0; written && k < rows; k++) {
        every_row &= written[k];
    }
    if (every_row && rows8_f32_adjacent(dtype, array, extent, block, rows, n)) {
        rows8_f32_from_columns(columns, (float *)ln_row_address(array, extent, block));
        return;
    }
#endif
    for (ptrdiff_t k = 0; k < rows; k++) {
        if (written && !written[k]) {
            continue;
        }
        char *row = ln_row_address(array, extent, block + k);
        for (ptrdiff_t i = 0; i < n; i++) {
            memcpy(row + (size_t)i * size, (const char *)columns[i] + (size_t)k * size, size);
        }
    }
}

/* A statistic (mean or rstd, of dtype's parameter type) of rows block .. block + rows out:
   where the 16 rows' values lie one after another (as in the arrays layernorm and NumPy
   make), by a loop over them that vectorizes; else row by row. */
static LN_ALWAYS_INLINE void store_block_stat(ln_dtype dtype, const ln_array *stat, const ln_extent *extent,
                                              ptrdiff_t block, ptrdiff_t rows, const double values[16])
{
    char *first = ln_row_address(stat, extent, block);
    const int run = rows == 16 && ln_rows_consecutive(stat, extent, block, block + 16, dtype == LN_F64 ? 8 : 4);
    for (ptrdiff_t k = 0; run && k < 16; k++) {
        ln_store1_param(dtype, first, k, values[k]);
    }
    for (ptrdiff_t k = 0; !run && k < rows; k++) {
        ln_store1_param(dtype, ln_row_address(stat, extent, block + k), 0, values[k]);
    }
}

/* A block of 16 short rows between forward_short_rows' two stages. */
typedef struct {
    double columns[16][16];        /* short_rows_to_columns' */
    double means[16], rstds[16];
    int every_row;                 /* no row went to ln_forward_exact_row (else written[k]: row k did not) */
    int written[16];
} short_block;

typedef struct {
    ptrdiff_t n;
    lane_divisor by_n;
    double weights[16], biases[16];       /* ones and zeros where absent */
    gf weight_lanes[16], bias_lanes[16];  /* ... splat in float32, for float32 outputs */
} short_rows_params;

/* Stage 1 of forward_short_rows: rows [block, block + rows) turned into b->columns, their
   statistics, and the rows outside the bounds through ln_forward_exact_row. */
static LN_ALWAYS_INLINE void short_block_statistics(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                                    const ln_rstd_bounds *bounds, const short_rows_params *p,
                                                    ptrdiff_t block, ptrdiff_t rows, short_block *b)
{
    const ptrdiff_t n = p->n;
    const int has_mean = kind == LN_NORM_LAYER;
    const gd zero_v = gd_splat(0.0);
    gd xs[16];  /* the columns in float64, loaded once */
    short_rows_to_columns(dtype, &a->input, &a->extent, block, rows, n, b->columns);
    xs[0] = short_rows_column(dtype, b->columns, 0);
    for (ptrdiff_t i = 1; i < n; i++) {
        xs[i] = short_rows_column(dtype, b->columns, i);
    }
    const gd first = has_mean ? xs[0] : zero_v;
    gd sum = zero_v;  /* (x0 - first) is 0 where it is finite, and a row where not is exact anyway */
    for (ptrdiff_t i = 1; has_mean && i < n; i++) {
        sum = gd_add(sum, gd_sub(xs[i], first));
    }
    const gd mean_v = has_mean ? gd_add(first, gd_div_by(sum, &p->by_n)) : zero_v;
    gd m2 = zero_v;
    for (ptrdiff_t i = 0; i < n; i++) {
        const gd d = gd_sub(xs[i], mean_v);
        m2 = gd_add(m2, gd_mul(d, d));
    }
    const gd rstd_v = gd_div(gd_splat(1.0), gd_sqrt(gd_add(gd_div_by(m2, &p->by_n), gd_splat(a->eps))));
    gd_store(b->means, mean_v);
    gd_store(b->rstds, rstd_v);
    /* the common block: every lane's rstd and mean within bounds, so every row's moments are
       finite (a lane past the last row may fail, and sends the block the long way) */
    b->every_row = gd_all_within(rstd_v, bounds->low, bounds->high) &&
                   !(has_mean && gd_any_nonzero_below(mean_v, bounds->tiny_mean));
    if (b->every_row) {
        if (a->mean.data) {
            store_block_stat(dtype, &a->mean, &a->extent, block, rows, b->means);
        }
        if (a->rstd.data) {
            store_block_stat(dtype, &a->rstd, &a->extent, block, rows, b->rstds);
        }
        return;
    }
    double m2s[16];
    gd_store(m2s, m2);
    for (ptrdiff_t k = 0; k < rows; k++) {
        const ln_moments m = {(double)n, b->means[k], m2s[k]};
        b->rstds[k] = ln_moments_finite(m) ? b->rstds[k] : NAN;
        b->written[k] = !ln_row_needs_exact(b->means[k], b->rstds[k], bounds);
        if (b->written[k]) {
            ln_store_stats(a, block + k, b->means[k], b->rstds[k]);
        }
        else {
            ln_forward_exact_row(a, &a->input, block + k);
        }
    }
}

/* Stage 2: the block's normalized rows, from b, turned back into rows of the output. */
static LN_ALWAYS_INLINE void short_block_output(ln_dtype dtype, const ln_forward_args *a, const short_rows_params *p,
                                                ptrdiff_t block, ptrdiff_t rows, const short_block *b)
{
    const ptrdiff_t n = p->n;
    double outputs[16][16];
    if (output_in_f64(dtype, n)) {
        const gd mean_v = gd_load(b->means), rstd_v = gd_load(b->rstds);
        for (ptrdiff_t i = 0; i < n; i++) {
            const gd centred = gd_sub(short_rows_column(dtype, b->columns, i), mean_v);
            store_from_f64(dtype, outputs[i], gd_fma(centred, gd_mul(gd_splat(p->weights[i]), rstd_v),
                                                     gd_splat(p->biases[i])));
        }
    }
    else {  /* float32 data: float32 parameters, held exactly in weight_lanes and bias_lanes */
        const lane_norm lanes = lane_norm_of(b->means, b->rstds);
        for (ptrdiff_t i = 0; i < n; i++) {
            const gf centred = gf_sub(gf_sub(gf_load((const float *)b->columns[i]), lanes.mean_hi), lanes.mean_lo);
            const gf scale = gf_mul(p->weight_lanes[i], lanes.scale);
            store_from_f32(dtype, outputs[i], 0, gf_fma(centred, scale, p->bias_lanes[i]), 1);
        }
    }
    short_rows_from_columns(dtype, &a->output, &a->extent, block, rows, b->every_row ? NULL : b->written, n,
                            outputs);
}

/* Forward of rows shorter than one group, per lane: the textbook two passes in float64,
   the sums about the row's first element so that a constant row has mean == x exactly
   (RMSNorm: mean 0), then normalize_one's arithmetic (output_in_f64's in float64).
   Software-pipelined a block deep: one loop takes block b's statistics while it writes
   block b - 1's output, two chains of dependent operations (turn, sums, square root and
   division; scale, turn back) that the core then runs side by side. */
static LN_ALWAYS_INLINE void forward_short_rows(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                                const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end)
{
    const ptrdiff_t n = a->extent.row_len;
    assert(1 <= n && n < 16);
    /* the parameters, ones and zeros standing in for an absent weight and bias: rstd * 1 is
       rstd and fma(c, s, ln_absent_bias) is c * s rounded, the bits of the tests they replace, and the
       output loops test nothing per column */
    short_rows_params p = {.n = n, .by_n = lane_divisor_of(n)};
    for (ptrdiff_t i = 0; i < n; i++) {
        p.weights[i] = a->weight ? ln_load1_param_as_f64(dtype, a->weight, i) : 1.0;
        p.biases[i] =
            kind == LN_NORM_LAYER && a->bias ? ln_load1_param_as_f64(dtype, a->bias, i) : ln_absent_bias(kind);
        p.weight_lanes[i] = gf_splat((float)p.weights[i]);
        p.bias_lanes[i] = gf_splat((float)p.biases[i]);
    }
    short_block blocks[2];
    for (ptrdiff_t block = begin, turn = 0; block < end + 16; block += 16, turn ^= 1) {
        if (block < end) {
            short_block_statistics(kind, dtype, a, bounds, &p, block, end - block < 16 ? end - block : 16,
                                   &blocks[turn]);
        }
        if (block > begin) {  /* block - 16: 16 rows, fewer if it is the range's last */
            short_block_output(dtype, a, &p, block - 16, end - block < 0 ? end - block + 16 : 16, &blocks[turn ^ 1]);
        }
    }
}

/* Rows of more than LN_BATCH_MAX elements, software-pipelined: one loop normalizes row r - 1
   while it gathers the statistics of row r, chunk by chunk as row_moments goes, so the
   statistics' float64 arithmetic and the normalized row's loads and stores overlap instead
   of taking turns (16x768 float32: 3.2 -> 2.7 us; 256x4096 float32: 271 -> 238 us).  It runs the same
   operations as row_moments and normalize, so the results are the plain path's, bit for bit.
   With a copy (a training-mode call), row r is copied from L1 as its statistics are
   gathered, not in a pass of its own (4x128x768 float32, training-mode forward against
   eval-mode: 1.75x -> 1.22x at one thread, when the rows were copied first by non-temporal
   stores). */
static LN_ALWAYS_INLINE void forward_rows_pipelined(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                                    const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end,
                                                    const void *weight, const void *bias, ln_store store,
                                                    ptrdiff_t read_ahead)
{
    const ptrdiff_t n = a->extent.row_len, elsize = (ptrdiff_t)ln_dtype_size(dtype);
    assert(n >= 16);
    row_norm previous = row_norm_of(dtype, 0.0, 0.0);
    int previous_done = 0;  /* row r - 1 went through ln_forward_exact_row */
    for (ptrdiff_t r = begin; r <= end; r++) {
        const int gather = r < end, emit = r > begin && !previous_done;
        /* pointers only to rows that exist: row end and row begin - 1 may lie outside */
        const char *x = gather ? ln_row_address(&a->input, &a->extent, r) : NULL;
        char *copy = gather && a->copy.data ? ln_row_address(&a->copy, &a->extent, r) : NULL;
        const char *x_previous = emit ? ln_row_address(&a->input, &a->extent, r - 1) : NULL;
        char *y_previous = emit ? ln_row_address(&a->output, &a->extent, r - 1) : NULL;
        ln_moments m = {0.0, 0.0, 0.0};
        for (ptrdiff_t start = 0; start < n; start += LN_CHUNK) {  /* row_moments' chunks */
            const ptrdiff_t len = n - start < LN_CHUNK ? n - start : LN_CHUNK;
            const char *chunk = gather ? x + start * elsize : NULL;
            char *chunk_copy = copy ? copy + start * elsize : NULL;
            moments_acc acc = {.narrow = ln_dtype_is_16bit(dtype)};  /* moments_start's: a constant */
            if (gather) {
                moments_start(&acc, kind, dtype, chunk, read_ahead);
            }
            ptrdiff_t i = 0;
            const ptrdiff_t parity_block = parity_block_of(dtype, len, read_ahead, store, copy != NULL);
            if (parity_block) {
                i = len - len % 16;
                groups_by_parity(kind, dtype, gather, &acc, chunk, chunk_copy, i, parity_block, emit, &previous,
                                 x_previous, y_previous, start, weight, bias);
            }
            for (; i + 32 <= len; i += 32) {
                if (gather) {
                    moments_add(&acc, kind, dtype, chunk, i, 0);
                    moments_add(&acc, kind, dtype, chunk, i + 16, 1);
                    if (copy) {
                        copy_elements(dtype, chunk, chunk_copy, i, 32);
                    }
                }
                if (emit) {
                    normalize_pair(kind, dtype, &previous, x_previous, y_previous, start + i, weight, bias, store);
                }
            }
            const ptrdiff_t paired = i;  /* elements copied so far */
            if (i + 16 <= len) {
                if (gather) {
                    moments_add(&acc, kind, dtype, chunk, i, 0);
                }
                if (emit) {
                    normalize_group(kind, dtype, &previous, x_previous, y_previous, start + i, weight, bias, store);
                }
                i += 16;
            }
            if (copy && paired < len) {
                copy_elements(dtype, chunk, chunk_copy, paired, len - paired);
            }
            if (emit) {
                normalize_few(kind, dtype, &previous, x_previous, y_previous, start + i, start + len, n, weight, bias);
            }
            if (gather) {
                const ln_moments chunk_m = moments_of_sums(kind, moments_sums(&acc, kind, dtype, chunk, i, len), len);
                m = start == 0 ? chunk_m : ln_merge(m, chunk_m);
            }
        }
        if (gather) {
            const double rstd = ln_rstd_of(m, a->eps);
            previous_done = ln_row_needs_exact(m.mean, rstd, bounds);
            if (previous_done) {
                ln_forward_exact_row(a, &a->input, r);
            }
            else {
                ln_store_stats(a, r, m.mean, rstd);
                previous = row_norm_of(dtype, m.mean, rstd);
            }
        }
    }
    if (store != LN_STORE_CACHED) {
        stream_fence();
    }
}

/* Rows of 16 to LN_BATCH_MAX elements, 16 rows at a time: each row's sums as chunk_sums_of
   takes them, then the 16 rows' means and rstds in lanes (moments_of_sums' and lane_rstds'
   arithmetic, a row per lane: the same bits), then each row normalized as the pipelined
   loop does it.  Row by row, a short row's statistics end in a chain of dependent float64
   operations (the lanes' additions, two divisions and a square root) longer than the rest
   of its work, which the next row waits for; here the 16 rows' chains are independent and
   their divisions share vectors (2**21 float32 elements, one thread, Zen 5: rows of 16
   28.8 -> 14.7 ns a row, of 64 31.3 -> 18.8, of 256 45.1 -> 42.6; of 384, pipelined, 57). */
static LN_ALWAYS_INLINE void forward_rows_batched(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                                  const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end,
                                                  const void *weight, const void *bias, ln_store store,
                                                  ptrdiff_t read_ahead)
{
    const ptrdiff_t n = a->extent.row_len;
    assert(16 <= n && n <= LN_BATCH_MAX);
    for (ptrdiff_t block = begin; block < end; block += 16) {
        const int rows = end - block < 16 ? (int)(end - block) : 16;
        double shifts[16] = {0}, sum1s[16] = {0}, sum2s[16] = {0};  /* zeros past the last row */
        for (int k = 0; k < rows; k++) {
            const char *x = ln_row_address(&a->input, &a->extent, block + k);
            if (a->copy.data) {
                copy_elements(dtype, x, ln_row_address(&a->copy, &a->extent, block + k), 0, n);
            }
            const chunk_sums sums = chunk_lane_sums(kind, dtype, x, n, read_ahead);
            shifts[k] = sums.shift;
            sum1s[k] = sums.sum1;
            sum2s[k] = sums.sum2;
        }
        /* chunk_sums_of's test, 16 rows in one vector test first (rows of 64 float16: 2.6 ns a
           row when each row took it) */
        const gd sum1 = gd_load(sum1s);
        if (ln_dtype_is_16bit(dtype) && kind == LN_NORM_LAYER &&
            !gd_all_within(gd_sub(gd_mul(gd_splat((15.0 / 16.0) * (double)n), gd_load(sum2s)), gd_mul(sum1, sum1)),
                           0.0, INFINITY)) {
            for (int k = 0; k < rows; k++) {
                const chunk_sums sums = {shifts[k], sum1s[k], sum2s[k]};
                if (sums_need_wide(kind, dtype, sums, n)) {
                    const chunk_sums wide = chunk_sums_wide(dtype, ln_row_address(&a->input, &a->extent, block + k), n);
                    sum1s[k] = wide.sum1;
                    sum2s[k] = wide.sum2;
                }
            }
        }
        double means[16], m2s[16], rstds[16];
        if (kind == LN_NORM_RMS) {
            gd_store(means, gd_splat(0.0));
            gd_store(m2s, gd_load(sum2s));
        }
        else {
            const gd sum1_final = gd_load(sum1s), mean_offset = gd_div(sum1_final, gd_splat((double)n));
            gd_store(means, gd_add(gd_load(shifts), mean_offset));
            gd_store(m2s, gd_sub(gd_load(sum2s), gd_mul(sum1_final, mean_offset)));
        }
        lane_rstds(n, a->eps, means, m2s, rstds);
        for (int k = 0; k < rows; k++) {
            const ptrdiff_t r = block + k;
            if (ln_row_needs_exact(means[k], rstds[k], bounds)) {
                ln_forward_exact_row(a, &a->input, r);
                continue;
            }
            ln_store_stats(a, r, means[k], rstds[k]);
            const row_norm norm = row_norm_of(dtype, means[k], rstds[k]);
            const char *x = ln_row_address(&a->input, &a->extent, r);
            char *y = ln_row_address(&a->output, &a->extent, r);
            /* elements past the last whole group: a group ending at n, taken before the
               stores (y may be x) and stored after them, over elements stored already with
               the same values (cached stores: rows with such elements never stream, see
               ln_short_rows_may_stream, and streaming stores might land after it) */
            assert(store == LN_STORE_CACHED || n % 16 == 0);
            const int last_group = n % 16 != 0;
            gd last_f64 = gd_splat(0.0);
            gf last_f32 = gf_splat(0.0f);
            if (last_group && dtype == LN_F64) {
                last_f64 = normalized_f64(kind, &norm, x, n - 16, weight, bias);
            }
            else if (last_group) {
                last_f32 = normalized_f32(kind, dtype, &norm, x, n - 16, weight, bias);
            }
            ptrdiff_t i = 0;
            for (; i + 32 <= n; i += 32) {
                normalize_pair(kind, dtype, &norm, x, y, i, weight, bias, store);
            }
            if (i + 16 <= n) {
                normalize_group(kind, dtype, &norm, x, y, i, weight, bias, store);
                i += 16;
            }
            if (last_group && dtype == LN_F64) {
                gd_store((double *)y + n - 16, last_f64);
            }
            else if (last_group) {
                store_from_f32(dtype, y, n - 16, last_f32, 0);
            }
        }
    }
    if (store != LN_STORE_CACHED) {
        stream_fence();
    }
}

/* Rows [begin, end) of a call whose rows have adjacent elements and no residual (the
   driver sums a residual first): statistics, then the normalized row, while the row is in
   cache.  read_ahead: ln_read_ahead's for the input, or 0 (rows the driver staged). */
static LN_ALWAYS_INLINE void forward_rows(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *args,
                                          const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end,
                                          ptrdiff_t read_ahead)
{
    /* a copy that no store through the outputs' char pointers can change, so that its walks
       stay in registers (20000x8 float32 rows, one thread: 3% faster) */
    const ln_forward_args copy = *args, *a = &copy;
    const ptrdiff_t n = a->extent.row_len;
    assert(a && a->input.data && a->output.data && !a->residual.data && n >= 1);
    assert(0 <= begin && begin <= end && end <= ln_rows_of(&a->extent));
    assert(!a->copy.data || ln_copies_in_rows(a));
    const void *bias = kind == LN_NORM_RMS ? NULL : a->bias;
    if (n < 16) {
        forward_short_rows(kind, dtype, a, bounds, begin, end);
        return;
    }
    if (n <= LN_BATCH_MAX) {
        const ln_store store = ln_pipelined_rows_store(a);
        forward_rows_batched(kind, dtype, a, bounds, begin, end, a->weight, bias, store, read_ahead);
        return;
    }
    if (ln_rows_pipelined(a)) {
        const ln_store store = ln_pipelined_rows_store(a);
        /* as normalize_row (avx512, one thread, 256x1024 float32 with both: 64 -> 59 us) */
        if (LN_AFFINE_LOOP_APART && a->weight && bias) {
            forward_rows_pipelined(kind, dtype, a, bounds, begin, end, a->weight, bias, store, read_ahead);
        }
        else {
            forward_rows_pipelined(kind, dtype, a, bounds, begin, end, a->weight, bias, store, read_ahead);
        }
        return;
    }
    const ln_row_kernels *kernels = &LN_LEVEL_KERNELS.by_dtype[dtype].by_kind[kind];
    const ln_normalize_fn normalize_span = ln_forward_streams(a) ? kernels->normalize_row_streaming
                                                                 : kernels->normalize_row;
    for (ptrdiff_t r = begin; r < end; r++) {
        const char *x = ln_row_address(&a->input, &a->extent, r);
        char *y = ln_row_address(&a->output, &a->extent, r);
        const ln_moments m = row_moments(kind, dtype, x, n, read_ahead);
        const double rstd = ln_rstd_of(m, a->eps);
        if (ln_row_needs_exact(m.mean, rstd, bounds)) {
            ln_forward_exact_row(a, &a->input, r);
            continue;
        }
        ln_store_stats(a, r, m.mean, rstd);
        ln_normalize_spans_backwards(normalize_span, dtype, x, y, 0, n, m.mean, rstd, a->weight, bias, NULL);
    }
}

/* Whether stores to address `stored` followed by loads walking forward from `loaded` or
   `loaded_too` wait on each other: where the stores lie 1 to LN_ALIAS_WINDOW bytes above the
   loads in the aliasing period. */
static LN_ALWAYS_INLINE int stores_alias_loads(uintptr_t stored, const void *loaded, const void *loaded_too)
{
    const uintptr_t apart = (stored - (uintptr_t)loaded) % LN_ALIAS_PERIOD;
    const uintptr_t apart_too = (stored - (uintptr_t)loaded_too) % LN_ALIAS_PERIOD;
    return (apart != 0 && apart <= LN_ALIAS_WINDOW) || (apart_too != 0 && apart_too <= LN_ALIAS_WINDOW);
}

/* The groups by which a row's stores to sum trail its loads of x and residual where sum lies
   just above one of them (sum_chunk_moments' delay): the fewest past the window that leave
   the trailing stores clear of both. */
static LN_ALWAYS_INLINE ptrdiff_t sum_delay_of(ln_dtype dtype, const char *x, const char *residual, const char *sum)
{
    const ptrdiff_t group_bytes = group_bytes_of(dtype), step = (ptrdiff_t)LN_ALIAS_WINDOW / group_bytes;
    ptrdiff_t delay = step + 1;
    while (delay < 4 * step && stores_alias_loads((uintptr_t)sum - (uintptr_t)(delay * group_bytes), x, residual)) {
        delay += step;
    }
    return delay;
}

/* Where in `memory` (LN_SUM_BUFFER_BYTES + LN_ALIAS_PERIOD + 64 bytes) forward_sum_rows puts
   a row's sum: of 16 line-aligned starts 256 bytes apart, the one farthest above x and
   residual, whose loads follow its stores, and farthest below sum and y, whose stores follow
   its loads, in the aliasing period. */
static LN_ALWAYS_INLINE char *sum_buffer_in(char *memory, const char *x, const char *residual, const char *sum,
                                            const char *y)
{
    char *const first = memory + (-(uintptr_t)memory & 63);
    char *best = first;
    uintptr_t best_margin = 0;
    for (uintptr_t start = 0; start < LN_ALIAS_PERIOD; start += LN_ALIAS_PERIOD / 16) {
        const uintptr_t at = (uintptr_t)first + start;
        const uintptr_t above[4] = {at - (uintptr_t)x, at - (uintptr_t)residual, (uintptr_t)sum - at,
                                    (uintptr_t)y - at};
        uintptr_t margin = LN_ALIAS_PERIOD;
        for (int k = 0; k < 4; k++) {
            const uintptr_t apart = above[k] % LN_ALIAS_PERIOD;
            margin = apart != 0 && apart < margin ? apart : margin;
        }
        if (margin > best_margin) {
            best_margin = margin;
            best = (char *)at;
        }
    }
    return best;
}

/* Rows [begin, end) of a call with a residual whose rows of x, residual, sum and output all
   have adjacent elements, n >= 16: the fused pass.  Per row, sum = x + residual is formed in
   registers, its statistics taken from those values and it is written once
   (sum_chunk_moments); the output then comes from the row while it is in L1/L2: from sum,
   or, where sum went past the caches by non-temporal stores, from x + residual formed again.
   Two arrays are read and two written, the floor: the staged route wrote sum through the
   cache (a read for ownership) and read it back to normalize it.  Where the row's sum or
   output lies a little above its x or residual in the aliasing period (stores_alias_loads),
   and may_buffer (the row's bytes between LN_SUM_BUFFER_MIN_BYTES and LN_SUM_BUFFER_BYTES),
   the sum also goes to a buffer placed clear of all four (sum_buffer_in) and the output comes
   from the buffer; where sum is the one so placed, its stores are made from the buffer, past
   the window behind the loads (sum_delay_of).  The same values, so the same bits. */
static LN_ALWAYS_INLINE void sum_rows(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *args,
                                      const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end, int may_buffer)
{
    const ln_forward_args copy = *args, *a = &copy;  /* see forward_rows */
    assert(a->residual.data && a->sum.data && a->extent.row_len >= 16);
    assert(ln_elements_adjacent(&a->input, dtype) && ln_elements_adjacent(&a->residual, dtype) &&
           ln_elements_adjacent(&a->sum, dtype) && ln_elements_adjacent(&a->output, dtype));
    const void *weight = a->weight, *bias = kind == LN_NORM_RMS ? NULL : a->bias;
    const ptrdiff_t n = a->extent.row_len, elsize = (ptrdiff_t)ln_dtype_size(dtype);
    const int streaming = ln_sum_streams(a);
    /* 16-byte non-temporal stores (sum_store_group): float32/float64 rows 16-byte aligned */
    const int sum_streams = streaming && !ln_dtype_is_16bit(dtype) && ln_rows_aligned(&a->sum, &a->extent, 16);
    const ln_row_kernels *kernels = &LN_LEVEL_KERNELS.by_dtype[dtype].by_kind[kind];
    const ln_normalize_fn normalize_span = streaming ? kernels->normalize_row_streaming : kernels->normalize_row;
    /* no page ahead even at one thread: reading both arrays so made 2048x1024 float32 slower
       (1448 -> 1659 us) */
    const int reads_ahead = ln_read_ahead(a, &a->input, 0) && ln_read_ahead(a, &a->residual, 0);
    const ptrdiff_t read_ahead = reads_ahead ? LN_READ_AHEAD_BYTES : 0;
    char buffer_memory[LN_SUM_BUFFER_BYTES + LN_ALIAS_PERIOD + 64];
    for (ptrdiff_t r = begin; r < end; r++) {
        const char *x = ln_row_address(&a->input, &a->extent, r);
        const char *residual = ln_row_address(&a->residual, &a->extent, r);
        char *sum = ln_row_address(&a->sum, &a->extent, r), *y = ln_row_address(&a->output, &a->extent, r);
        /* a sum written over x or residual is in cache already, and is read back from there */
        const int stream_sum = sum_streams && sum != x && sum != residual;
        const int sum_aliases = may_buffer && stores_alias_loads((uintptr_t)sum, x, residual);
        char *const buffer = may_buffer && (sum_aliases || stores_alias_loads((uintptr_t)y, x, residual))
                                 ? sum_buffer_in(buffer_memory, x, residual, sum, y)
                                 : NULL;
        const ptrdiff_t delay = buffer && sum_aliases ? sum_delay_of(dtype, x, residual, sum) : 0;
        ln_moments m = {0.0, 0.0, 0.0};
        for (ptrdiff_t start = 0; start < n; start += LN_CHUNK) {  /* one loop: one inlined copy */
            const ptrdiff_t len = n - start < LN_CHUNK ? n - start : LN_CHUNK, offset = start * elsize;
            /* two instances: the loop without a buffer keeps none of its tests */
            const ln_moments chunk =
                buffer ? sum_chunk_moments(kind, dtype, x + offset, residual + offset, sum + offset, buffer + offset,
                                           delay, len, stream_sum, read_ahead)
                       : sum_chunk_moments(kind, dtype, x + offset, residual + offset, sum + offset, NULL, 0, len,
                                           stream_sum, read_ahead);
            m = start == 0 ? chunk : ln_merge(m, chunk);
        }
        const double rstd = ln_rstd_of(m, a->eps);
        if (ln_row_needs_exact(m.mean, rstd, bounds)) {
            ln_forward_exact_row(a, &a->sum, r);
            continue;
        }
        ln_store_stats(a, r, m.mean, rstd);
        if (buffer) {
            normalize_span(buffer, y, n, m.mean, rstd, weight, bias);
            continue;
        }
        /* spans from the end back, as ln_normalize_spans_backwards goes */
        for (ptrdiff_t stop = n; stop > 0;) {
            const ptrdiff_t start = stop > LN_NORMALIZE_SPAN ? stop - LN_NORMALIZE_SPAN : 0, offset = start * elsize;
            const void *w = weight ? (const char *)weight + start * (ptrdiff_t)ln_param_size(dtype) : NULL;
            const void *b = bias ? (const char *)bias + start * (ptrdiff_t)ln_param_size(dtype) : NULL;
            if (stream_sum) {
                normalize_sum(kind, dtype, x + offset, residual + offset, y + offset, stop - start, m.mean, rstd, w, b);
            }
            else {
                normalize_span(sum + offset, y + offset, stop - start, m.mean, rstd, w, b);
            }
            stop = start;
        }
    }
    if (streaming) {
        stream_fence();
    }
}

/* sum_rows, in an instance of its own for rows that may be buffered (LN_SUM_BUFFER_MIN_BYTES
   to LN_SUM_BUFFER_BYTES): the others' loop keeps none of the buffer's tests (rows of 64
   float32 elements took 5-9% longer with them). */
static LN_ALWAYS_INLINE void forward_sum_rows(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                              const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end)
{
    const ptrdiff_t row_bytes = a->extent.row_len * (ptrdiff_t)ln_dtype_size(dtype);
    if (LN_SUM_BUFFER_MIN_BYTES <= row_bytes && row_bytes <= LN_SUM_BUFFER_BYTES) {
        sum_rows(kind, dtype, a, bounds, begin, end, 1);
    }
    else {
        sum_rows(kind, dtype, a, bounds, begin, end, 0);
    }
}

/* ------------------------------------------------------------------------ */
/* Backward: pass 1, the row sums                                            */
/* ------------------------------------------------------------------------ */

/* The largest of 16 magnitudes, none NaN, spent in the process: a halving tree of compares
   (fmax() is a call or a NaN-handling sequence on x86). */
static LN_ALWAYS_INLINE double largest_of_lanes(double tops[16])
{
    for (int half = 8; half >= 1; half /= 2) {
        for (int k = 0; k < half; k++) {
            tops[k] = tops[k + half] > tops[k] ? tops[k + half] : tops[k];
        }
    }
    return tops[0];
}

/* Pass 1's running maxima of magnitudes (ln_grad_row_needs_exact's largest). */
typedef struct {
    gf g, dy, xc;
} grad_tops;

/* Which maxima pass 1 keeps: none, a row's (its lanes folded together by
   gf_max_magnitude_folded, a register each where a group takes several) or each lane's (a
   float32 tile's, whose lanes are rows). */
typedef enum { TOPS_NONE, TOPS_OF_ROW, TOPS_OF_LANES } grad_tops_kind;

static LN_ALWAYS_INLINE gf grad_top_of(grad_tops_kind tops_kind, gf top, gf a)
{
    return tops_kind == TOPS_OF_ROW ? gf_max_magnitude_folded(top, a) : gf_max_magnitude(top, a);
}

/* Pass 1's terms of 16 elements, given dy, g = dy * weight and x: g and g * xc (xc = x - mean,
   or x for RMSNorm) added into sum_g and sum_gc, and the magnitudes of g, dy and xc into
   their running maxima, as tops_kind says. */
static LN_ALWAYS_INLINE void grad_sums_terms(ln_norm_kind kind, gf dy_v, gf g, gf value_x, int has_weight,
                                             grad_tops_kind tops_kind, gf mean_v, gf *sum_g, gf *sum_gc,
                                             grad_tops *tops)
{
    const gf xc = kind == LN_NORM_LAYER ? gf_sub(value_x, mean_v) : value_x;
    if (tops_kind != TOPS_NONE) {
        tops->g = grad_top_of(tops_kind, tops->g, g);
        tops->dy = has_weight ? grad_top_of(tops_kind, tops->dy, dy_v) : tops->g;
        tops->xc = grad_top_of(tops_kind, tops->xc, xc);
    }
    if (kind == LN_NORM_LAYER) {
        *sum_g = gf_add(*sum_g, g);
    }
    *sum_gc = gf_fma(g, xc, *sum_gc);
}

/* grad_sums_block's terms of the group at element i. */
static LN_ALWAYS_INLINE void grad_sums_group(ln_norm_kind kind, ln_dtype dtype, const void *dy, const void *x,
                                             const float *weight, int has_weight, int has_largest, ptrdiff_t i,
                                             gf mean_v, gf *sum_g, gf *sum_gc, grad_tops *tops)
{
    const gf dy_v = gf_kept(load_as_f32(dtype, dy, i)), value_x = gf_kept(load_as_f32(dtype, x, i));
    const gf g = has_weight ? gf_mul(dy_v, gf_load(weight + i)) : dy_v;
    grad_sums_terms(kind, dy_v, g, value_x, has_weight, has_largest ? TOPS_OF_ROW : TOPS_NONE, mean_v, sum_g, sum_gc,
                    tops);
}

/* Pass 1 over a span of n elements of one row, for float16/float32 data:
       sums[0] = sum(g),  sums[1] = sum(g * xhat),   g = dy * weight, xhat = (x - mean) * rstd
   The products are formed in float32 (mean and rstd are float32 for this data, so x - mean
   is exact for x near the mean) and summed in float32 over blocks of LN_GRAD_SUM_BLOCK
   groups whose sums are added in float64.  `weight` points at the span's first column,
   or is NULL.  RMSNorm (mean 0) needs no sum(g): sums[0] is 0 then.  tops: the running
   maxima of the magnitudes ln_grad_row_needs_exact tests (grad_tops_largest takes them), or
   NULL: not wanted. */

/* A row's pass 1 between its blocks. */
typedef struct {
    gf mean_v;
    gd g_sum, gc_sum;    /* the blocks' sums so far */
    grad_tops tops;      /* the largest magnitudes so far */
} grad_sums_acc;

static LN_ALWAYS_INLINE grad_sums_acc grad_sums_start(double mean)
{
    const gf zero_f = gf_splat(0.0f);
    const grad_sums_acc acc = {gf_splat((float)mean), gd_splat(0.0), gd_splat(0.0), {zero_f, zero_f, zero_f}};
    return acc;
}

/* The end of the block that starts at element `block` of a row whose groups end at groups_end. */
static LN_ALWAYS_INLINE ptrdiff_t grad_sums_block_end(ptrdiff_t block, ptrdiff_t groups_end)
{
    return groups_end - block < 16 * LN_GRAD_SUM_BLOCK ? groups_end : block + 16 * LN_GRAD_SUM_BLOCK;
}

/* One block, elements [block, grad_sums_block_end(block, groups_end)), into acc.  Within the
   block the even and odd groups go to separate float32 accumulators, so no add waits on the
   one before: the even groups first, then the odd ones, so that one parity's sums and the
   running maxima stay in registers (taken together, AVX2's 16 could not hold them: 16x768
   float32 backward, one thread, 7.8 -> 7.4 us); the maxima do not depend on the order.
   has_weight and has_largest are constants where this is called. */
static LN_ALWAYS_INLINE void grad_sums_block(ln_norm_kind kind, ln_dtype dtype, grad_sums_acc *acc,
                                             const void *dy, const void *x, const float *weight, int has_weight,
                                             int has_largest, ptrdiff_t block, ptrdiff_t groups_end)
{
    const ptrdiff_t block_end = grad_sums_block_end(block, groups_end);
    const gf zero_v = gf_splat(0.0f);
    gf even_g = zero_v, even_gc = zero_v, odd_g = zero_v, odd_gc = zero_v;
    grad_tops tops = acc->tops;
    for (ptrdiff_t i = block; i < block_end; i += 32) {
        grad_sums_group(kind, dtype, dy, x, weight, has_weight, has_largest, i, acc->mean_v, &even_g, &even_gc,
                        &tops);
    }
    for (ptrdiff_t i = block + 16; i < block_end; i += 32) {
        grad_sums_group(kind, dtype, dy, x, weight, has_weight, has_largest, i, acc->mean_v, &odd_g, &odd_gc,
                        &tops);
    }
    acc->tops = tops;
    acc->g_sum = gd_add(acc->g_sum, gf_widen(gf_add(even_g, odd_g)));
    acc->gc_sum = gd_add(acc->gc_sum, gf_widen(gf_add(even_gc, odd_gc)));
}

/* The row's whole groups, elements [0, n - n % 16), into acc block by block. */
static LN_ALWAYS_INLINE void grad_sums_groups(ln_norm_kind kind, ln_dtype dtype, grad_sums_acc *acc,
                                              const void *dy, const void *x, const float *weight, int has_weight,
                                              int has_largest, ptrdiff_t n, ptrdiff_t read_ahead)
{
    const ptrdiff_t groups_end = n - n % 16, elsize = (ptrdiff_t)ln_dtype_size(dtype);
    for (ptrdiff_t block = 0; block < groups_end; block += 16 * LN_GRAD_SUM_BLOCK) {
        for (ptrdiff_t i = block; read_ahead && i < grad_sums_block_end(block, groups_end); i += 16) {
            read_ahead_of_group(dtype, (const char *)dy + i * elsize, i, read_ahead);
            read_ahead_of_group(dtype, (const char *)x + i * elsize, i, read_ahead);
        }
        grad_sums_block(kind, dtype, acc, dy, x, weight, has_weight, has_largest, block, groups_end);
    }
}

/* sums and tops from acc, once every whole group of the row is in it.  The elements from
   n - n % 16 on go as one part group (load_part_as_f32), element i to lane i % 16 as in a
   whole group, with 0.0 added in the other lanes: that changes no lane, since none holds
   -0.0 (each starts at +0.0, and an exact cancellation gives +0.0).  Then the lanes are
   added in ln_sum_lanes' order, in registers (grad_tops_largest takes the maxima's). */
static LN_ALWAYS_INLINE void grad_sums_finish(ln_norm_kind kind, ln_dtype dtype, const grad_sums_acc *acc,
                                              const void *dy, const void *x, const float *weight, ptrdiff_t n,
                                              double rstd, double sums[2], grad_tops *tops_out)
{
    gd g_sum = acc->g_sum, gc_sum = acc->gc_sum;
    grad_tops tops = acc->tops;
    const ptrdiff_t tail = n - n % 16;
    const int count = (int)(n % 16);
    if (count > 0) {
        const gf dy_v = load_part_as_f32(dtype, dy, tail, count);
        const gf g = weight ? gf_mul(dy_v, load_part_as_f32(LN_F32, weight, tail, count)) : dy_v;
        const gf value_x = load_part_as_f32(dtype, x, tail, count);
        const gf centred = kind == LN_NORM_LAYER ? gf_sub(value_x, acc->mean_v) : value_x;
        g_sum = gd_add(g_sum, gd_first_lanes(gf_widen(g), count));
        gc_sum = gd_add(gc_sum, gd_first_lanes(gf_widen(gf_mul(g, centred)), count));
        tops.g = gf_max_magnitude_folded(tops.g, g);  /* the other lanes' 0.0 changes no maximum */
        tops.dy = gf_max_magnitude_folded(tops.dy, dy_v);
        static const float ones[16] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f,
                                       1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
        const gf in_part = load_part_as_f32(LN_F32, ones, 0, count);  /* past the part, centred is -mean */
        tops.xc = gf_max_magnitude_folded(tops.xc, gf_mul(centred, in_part));
    }
    sums[0] = kind == LN_NORM_LAYER ? gd_sum_lanes(g_sum) : 0.0;
    sums[1] = gd_sum_lanes(gc_sum) * rstd;
    if (tops_out) {
        *tops_out = tops;
    }
}

/* The largest magnitudes of a row's pass 1 (TOPS_OF_ROW), in ln_grad_row_needs_exact's order. */
static LN_ALWAYS_INLINE void grad_tops_largest(const grad_tops *tops, double largest[LN_LARGEST_COUNT])
{
    largest[LN_LARGEST_G] = gf_largest_lane(tops->g);
    largest[LN_LARGEST_DY] = gf_largest_lane(tops->dy);
    largest[LN_LARGEST_XC] = gf_largest_lane(tops->xc);
}

/* Pass 1 over a span, as above. */
static LN_ALWAYS_INLINE void grad_sums_single(ln_norm_kind kind, ln_dtype dtype, const void *dy, const void *x,
                                              const float *weight, ptrdiff_t n, double mean, double rstd,
                                              double sums[2], grad_tops *tops, ptrdiff_t read_ahead)
{
    grad_sums_acc acc = grad_sums_start(mean);
    if (weight && tops) {
        grad_sums_groups(kind, dtype, &acc, dy, x, weight, 1, 1, n, read_ahead);
    }
    else if (tops) {
        grad_sums_groups(kind, dtype, &acc, dy, x, NULL, 0, 1, n, read_ahead);
    }
    else {
        grad_sums_groups(kind, dtype, &acc, dy, x, weight, weight != NULL, 0, n, read_ahead);
    }
    grad_sums_finish(kind, dtype, &acc, dy, x, weight, n, rstd, sums, tops);
}

/* Whether ln_grad_row_needs_exact would find a float16/bfloat16/float32 row common (and return
   0), from its means and pass 1's maxima as they are, in vectors, without their largest lanes:
   its factors in the normal range (or zero with a zero operand: g_mean or gx_mean 0), some
   lane of |g|'s and of |dy|'s at least twice max(precise_min, 2 precise_min rstd) and of
   |xc|'s times rstd at least 0.5, every lane
   of |dy|'s times max(rstd, 1) and of |xc|'s at most half the square root of the term limit
   (their product a quarter of it), and |xc| |xc_scale| at most a quarter of FLT_MAX and
   |offset| an eighth (the inner term under half, with room for the float32 roundings).  The
   margins cover the float32 rounding of the bounds, so a row this passes passes the scalar
   test; the others take that.  Every part is evaluated and the answers and-ed, with no
   branch between them, and the two upper bounds of one limit tested as one (the larger of
   the two magnitudes), which takes a tenth off a short row's backward (float32 rows of 32
   and 64 elements, one thread, alternating processes: 22.0 -> 19.9 and 28.5 -> 24.5 ns a
   row). */
static LN_ALWAYS_INLINE int grad_row_common(double rstd, double g_mean, double gx_mean, const grad_tops *tops)
{
    const double xc_scale = fabs(-rstd * rstd * gx_mean), offset = fabs(-rstd * g_mean);
    const double precise_min = (double)FLT_MIN / (double)FLT_EPSILON;
    const double least = 2.0 * (rstd > 0.5 ? 2.0 * precise_min * rstd : precise_min);
    const float root = (float)(0.5 * sqrt(ln_grad_term_limit(LN_F32)));
    int common = (rstd >= (double)FLT_MIN) & (rstd <= (double)FLT_MAX);
    common &= (gx_mean == 0.0) | ((xc_scale >= (double)FLT_MIN) & (xc_scale <= (double)FLT_MAX));
    common &= (g_mean == 0.0) | ((offset >= (double)FLT_MIN) & (offset <= (double)FLT_MAX / 8));
    const gf dy_scaled = gf_mul(tops->dy, gf_splat((float)(rstd > 1.0 ? rstd : 1.0)));
    return common & gf_any_at_least(tops->g, (float)least) & gf_any_at_least(tops->dy, (float)least) &
           gf_any_at_least(gf_mul(tops->xc, gf_splat((float)rstd)), 0.5f) &
           gf_all_at_most(gf_max_magnitude(tops->xc, dy_scaled), root) &
           gf_all_at_most(gf_mul(tops->xc, gf_splat((float)xc_scale)), FLT_MAX / 4);
}

/* a with its lanes from count on set to 1.0, a value every test of grad_lanes_common passes. */
static LN_ALWAYS_INLINE gd lanes_padded(gd a, int count)
{
    const gd one = gd_splat(1.0);
    return gd_add(gd_first_lanes(a, count), gd_sub(one, gd_first_lanes(one, count)));
}

/* Whether ln_grad_row_needs_exact returns 0 for each row in the first count lanes, lane k
   holding a row's rstd, its factors xc_scale = -rstd^2 * gx_mean and offset = -rstd * g_mean,
   and the largest magnitudes of its pass 1 (widened): its common rows' test, in vectors,
   largest >= max(precise_min, 2 * precise_min * rstd) as largest - that >= 0, the largest
   |xc| times rstd at least 0.5, |v| as
   max(|v|, 0), which a NaN fails.  RMSNorm's offset is -0.0 (g_mean = 0), which that test
   refuses and its zero-operand rule accepts: it is left out.  Rows with a zero factor
   otherwise (g_mean or gx_mean exactly 0, dy all zero) fail here though that rule passes
   them; the callers then go row by row. */
static LN_ALWAYS_INLINE int grad_lanes_common(ln_norm_kind kind, ln_dtype dtype, int count, gd rstd, gd xc_scale,
                                              gd offset, const gd widened[LN_LARGEST_COUNT])
{
    const double precise_min = (double)FLT_MIN / (double)FLT_EPSILON;
    const gd least = gd_max_magnitude(gd_splat(precise_min), gd_mul(gd_splat(2.0 * precise_min), rstd));
    const gd zero_d = gd_splat(0.0);
    const gd xc_scale_size = gd_max_magnitude(zero_d, xc_scale), offset_size = gd_max_magnitude(zero_d, offset);
    const gd inner_top = gd_add(gd_mul(xc_scale_size, widened[LN_LARGEST_XC]), offset_size);
    const gd term_top = gd_mul(gd_mul(widened[LN_LARGEST_DY], widened[LN_LARGEST_XC]),
                               gd_max_magnitude(gd_splat(1.0), rstd));
    int common = gd_all_within(lanes_padded(rstd, count), (double)FLT_MIN, (double)FLT_MAX);
    common &= gd_all_within(lanes_padded(xc_scale_size, count), (double)FLT_MIN, (double)FLT_MAX);
    if (kind == LN_NORM_LAYER) {
        common &= gd_all_within(lanes_padded(offset_size, count), (double)FLT_MIN, (double)FLT_MAX);
    }
    common &= gd_all_within(lanes_padded(gd_sub(widened[LN_LARGEST_G], least), count), 0.0, INFINITY);
    common &= gd_all_within(lanes_padded(gd_sub(widened[LN_LARGEST_DY], least), count), 0.0, INFINITY);
    common &= gd_all_within(lanes_padded(gd_mul(widened[LN_LARGEST_XC], rstd), count), 0.5, INFINITY);
    common &= gd_all_within(lanes_padded(inner_top, count), 0.0, (double)FLT_MAX / 2);
    common &= gd_all_within(lanes_padded(term_top, count), 0.0, ln_grad_term_limit(dtype));
    return common;
}

/* The same for float64 data, all in float64. */
static LN_ALWAYS_INLINE void grad_sums_double(ln_norm_kind kind, const double *dy, const double *x,
                                              const double *weight, ptrdiff_t n, double mean, double rstd,
                                              double sums[2], double largest[LN_LARGEST_COUNT])
{
    const int has_mean = kind == LN_NORM_LAYER;
    const gd mean_v = gd_splat(mean), rstd_v = gd_splat(rstd);
    gd g_sum = gd_splat(0.0), gx_sum = gd_splat(0.0), g_top = g_sum, dy_top = g_sum, xc_top = g_sum;
    double g_lanes[16], gx_lanes[16];
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const gd dy_v = gd_load(dy + i), value_x = gd_load(x + i);
        const gd g = weight ? gd_mul(dy_v, gd_load(weight + i)) : dy_v;
        const gd xc = has_mean ? gd_sub(value_x, mean_v) : value_x;
        if (largest) {
            g_top = gd_max_magnitude(g_top, g);
            dy_top = weight ? gd_max_magnitude(dy_top, dy_v) : g_top;
            xc_top = gd_max_magnitude(xc_top, xc);
        }
        const gd xhat = gd_mul(xc, rstd_v);
        g_sum = has_mean ? gd_add(g_sum, g) : g_sum;
        gx_sum = gd_add(gx_sum, gd_mul(g, xhat));
    }
    gd_store(g_lanes, g_sum);
    gd_store(gx_lanes, gx_sum);
    double g_tops[16], dy_tops[16], xc_tops[16];
    gd_store(g_tops, g_top);
    gd_store(dy_tops, dy_top);
    gd_store(xc_tops, xc_top);
    for (; i < n; i++) {
        const double g = weight ? dy[i] * weight[i] : dy[i], xc = has_mean ? x[i] - mean : x[i];
        g_lanes[i & 15] += g;
        gx_lanes[i & 15] += g * (xc * rstd);
        g_tops[i & 15] = fabs(g) > g_tops[i & 15] ? fabs(g) : g_tops[i & 15];
        dy_tops[i & 15] = fabs(dy[i]) > dy_tops[i & 15] ? fabs(dy[i]) : dy_tops[i & 15];
        xc_tops[i & 15] = fabs(xc) > xc_tops[i & 15] ? fabs(xc) : xc_tops[i & 15];
    }
    sums[0] = has_mean ? ln_sum_lanes(g_lanes) : 0.0;
    sums[1] = ln_sum_lanes(gx_lanes);
    if (largest) {
        largest[LN_LARGEST_G] = largest_of_lanes(g_tops);
        largest[LN_LARGEST_DY] = largest_of_lanes(dy_tops);
        largest[LN_LARGEST_XC] = largest_of_lanes(xc_tops);
    }
}

static LN_ALWAYS_INLINE void grad_sums(ln_norm_kind kind, ln_dtype dtype, const void *dy, const void *x,
                                       const void *weight, ptrdiff_t n, double mean, double rstd, double sums[2],
                                       double largest[LN_LARGEST_COUNT], ptrdiff_t read_ahead)
{
    assert(dy && x && n >= 1 && sums);
    if (dtype == LN_F64) {
        grad_sums_double(kind, dy, x, weight, n, mean, rstd, sums, largest);
        return;
    }
    grad_tops tops;
    grad_sums_single(kind, dtype, dy, x, weight, n, mean, rstd, sums, largest ? &tops : NULL, read_ahead);
    if (largest) {
        grad_tops_largest(&tops, largest);
    }
}

/* ------------------------------------------------------------------------ */
/* Backward: pass 2, dx and the parameter gradients                          */
/* ------------------------------------------------------------------------ */

/* How pass 2 writes the group's dx: through the caches, or by non-temporal stores
   (group->stream_dx) of whole 64-byte lines where every row of the group starts on one, as
   the results layernorm allocates do, else of 16-byte pieces (Zen 4, best of 4 alternating
   processes, pieces -> lines: 6304x768 float32 one thread 3.32 -> 3.22 ms, two threads 2.04
   -> 1.71 ms; 2048x4096 float32 5.45 -> 5.31 and 3.26 -> 2.98 ms; 1024x1024 float64 1.18 ->
   1.07 and 0.52 -> 0.50 ms). */
static LN_ALWAYS_INLINE ln_store grad_dx_store(const ln_grad_rows *group)
{
    if (!group->stream_dx) {
        return LN_STORE_CACHED;
    }
    for (int k = 0; k < group->count; k++) {
        if ((uintptr_t)group->dx[k] % 64 != 0) {
            return LN_STREAM_PIECES;
        }
    }
    return LN_STREAM_LINES;
}

/* Pass 2 over one span of the rows of `group` (all pointers at the span's first column),
   given each row's g_mean = mean(g) and gx_mean = mean(g * xhat).  With xc = x - mean,
       dx_j       = rstd * ((g_j - g_mean) - xhat_j * gx_mean)
                  = fma(rstd, g_j, fma(-rstd^2 * gx_mean, xc_j, -rstd * g_mean))
       dweight_j += dy_j * xhat_j = fma(dy_j * xc_j, rstd, ...),   dbias_j += dy_j
   in float32 for float16/float32 data (the per-row constants rounded once from float64).
   dx, dweight and dbias may each be NULL.  A group's rows pass over a column together:
   their (at most LN_GRAD_ROWS) terms are summed in registers, and dweight and dbias, in
   float64, go to memory once per group instead of once per row (a block's first group
   writes them: set_sums, so nobody zeroes them first).  RMSNorm: xc = x and
   g_mean = 0, so the inner fma's addend is -0 and it is the product alone (same bits). */

/* dx of 16 elements from g and xc = x - mean (x for RMSNorm), given their rows' per-row
   factors rstd, -rstd^2 * gx_mean (xc_scale) and -rstd * g_mean (offset). */
static LN_ALWAYS_INLINE gf grad_dx(ln_norm_kind kind, gf g, gf xc, gf rstd_v, gf xc_scale_v, gf offset_v)
{
    const gf inner = kind == LN_NORM_LAYER ? gf_fma(xc_scale_v, xc, offset_v) : gf_mul(xc_scale_v, xc);
    return gf_fma(rstd_v, g, inner);
}

/* The group of dx at element j of a row, stored as `how` says (a NaN the one quiet NaN). */
static LN_ALWAYS_INLINE void grad_store_dx(ln_dtype dtype, ln_store how, char *dx, ptrdiff_t j, gf v)
{
    if (dtype == LN_F32 && how == LN_STREAM_LINES) {
        gf_stream((float *)dx + j, v);
    }
    else if (dtype == LN_F32 && how == LN_STREAM_PIECES) {
        gf_stream16((float *)dx + j, v);
    }
    else {
        store_from_f32(dtype, dx, j, v, 1);
    }
}

/* Asks for the lines of dy and x that hold a group of 16 elements (`bytes` from `offset`) of
   the next group's row, into L2: pass 2 works from cache, and without these requests memory
   would idle while it does (ln_backward_prefetches). */
static LN_ALWAYS_INLINE void grad_prefetch_next(const char *dy, const char *x, ptrdiff_t offset, ptrdiff_t bytes)
{
    for (ptrdiff_t line = 0; line < bytes; line += 64) {
        __builtin_prefetch(dy + offset + line, 0, 2);
        __builtin_prefetch(x + offset + line, 0, 2);
    }
}

/* Pass 2's copy of a group: its row pointers and per-row factors, in a local that the dx
   stores, which may alias anything else (the group included), cannot change. */
typedef struct {
    const char *dy[LN_GRAD_ROWS], *x[LN_GRAD_ROWS];
    char *dx[LN_GRAD_ROWS];
    gf mean_v[LN_GRAD_ROWS], rstd_v[LN_GRAD_ROWS], xc_scale_v[LN_GRAD_ROWS], offset_v[LN_GRAD_ROWS];
    const char *next_dy[LN_GRAD_ROWS], *next_x[LN_GRAD_ROWS];  /* a row's own where it has none */
    ln_store dx_store;
    int set_sums, prefetch;
    int want_dx, paired;  /* dx asked for; columns two groups at a time (grad_dx_rows_collide) */
} grad_apply_rows;

/* Whether a group's dx, written as dx_store says, goes by non-temporal stores to rows whose
   lines share their offsets in a 4 KiB page (rows 2048 bytes apart, or a multiple of it: rows
   of 512, 1024, 2048 ... float32 elements), stores that pass 2 would alternate between the
   rows a line at a time.  Streamed so, those rows' dx took 1.2x-1.6x the time of cached stores
   (2-core AVX2 EPYC, one thread, 2**22 float32 elements in rows of 512 to 4096), and two groups
   of a row at a time, 128 bytes before the next row's, took 0.7x-0.9x of it.  Any two of a
   group's rows are 1 to 3 rows apart, so they collide only where one row's length does,
   modulo 2048. */
static LN_ALWAYS_INLINE int grad_dx_rows_collide(const ln_grad_rows *group, ln_store dx_store)
{
    if (group->count < 2 || dx_store == LN_STORE_CACHED || !group->dx[0]) {
        return 0;
    }
    const uintptr_t apart = ((uintptr_t)group->dx[1] - (uintptr_t)group->dx[0]) % 2048;
    return apart < 64 || apart > 2048 - 64;
}

static LN_ALWAYS_INLINE void grad_apply_start(grad_apply_rows *rows, const ln_grad_rows *group, int count)
{
    assert(count == group->count);
    rows->dx_store = grad_dx_store(group);
    rows->set_sums = group->set_sums;
    rows->prefetch = group->next_x[0] != NULL;
    rows->want_dx = group->dx[0] != NULL;
    rows->paired = grad_dx_rows_collide(group, rows->dx_store);
    for (int k = 0; k < count; k++) {
        rows->next_dy[k] = group->next_dy[k] ? group->next_dy[k] : group->dy[k];
        rows->next_x[k] = group->next_x[k] ? group->next_x[k] : group->x[k];
        rows->dy[k] = group->dy[k];
        rows->x[k] = group->x[k];
        rows->dx[k] = group->dx[k];
        rows->mean_v[k] = gf_splat((float)group->mean[k]);
        rows->rstd_v[k] = gf_splat((float)group->rstd[k]);
        rows->xc_scale_v[k] = gf_splat((float)(-group->rstd[k] * group->rstd[k] * group->gx_mean[k]));
        rows->offset_v[k] = gf_splat((float)(-group->rstd[k] * group->g_mean[k]));
    }
}

/* Row k's terms of the group of 16 columns at j: its dx stored, dy * xhat and dy added into
   the group's sums of the columns (want_sums: bit 0 dweight's, bit 1 dbias'). */
static LN_ALWAYS_INLINE void grad_apply_term(ln_norm_kind kind, ln_dtype dtype, const grad_apply_rows *rows, int k,
                                             ptrdiff_t j, const gf *w, gf *group_dweight, gf *group_dbias,
                                             int want_sums)
{
    const gf dy_v = load_as_f32(dtype, rows->dy[k], j);
    const gf value_x = load_as_f32(dtype, rows->x[k], j);
    const gf xc = kind == LN_NORM_LAYER ? gf_sub(value_x, rows->mean_v[k]) : value_x;
    if (rows->want_dx) {
        grad_store_dx(dtype, rows->dx_store, rows->dx[k], j,
                      grad_dx(kind, w ? gf_mul(dy_v, *w) : dy_v, xc, rows->rstd_v[k], rows->xc_scale_v[k],
                              rows->offset_v[k]));
    }
    if (want_sums & 1) {
        *group_dweight = gf_fma(gf_mul(dy_v, xc), rows->rstd_v[k], *group_dweight);
    }
    if (want_sums & 2) {
        *group_dbias = gf_add(*group_dbias, dy_v);
    }
}

/* A group's sums of columns j .. j + 16 into dweight and dbias (either may be NULL). */
static LN_ALWAYS_INLINE void grad_apply_sums(const grad_apply_rows *rows, ptrdiff_t j, gf group_dweight,
                                             gf group_dbias, double *dweight, double *dbias)
{
    if (dweight) {
        const gd before = rows->set_sums ? gd_splat(0.0) : gd_load(dweight + j);
        gd_store(dweight + j, gd_add(before, gf_widen(group_dweight)));
    }
    if (dbias) {
        const gd before = rows->set_sums ? gd_splat(0.0) : gd_load(dbias + j);
        gd_store(dbias + j, gd_add(before, gf_widen(group_dbias)));
    }
}

/* The whole groups of 16 columns in [begin, end) (begin a multiple of 16): a group of columns
   at a time, its rows one after another, or where rows->paired, two groups of a row before
   the next row's, each column's terms added in the same order either way. */
static LN_ALWAYS_INLINE void grad_apply_columns(ln_norm_kind kind, ln_dtype dtype, const grad_apply_rows *rows,
                                                int count, const float *weight, ptrdiff_t begin, ptrdiff_t end,
                                                double *dweight, double *dbias)
{
    const int want_sums = (dweight ? 1 : 0) | (dbias ? 2 : 0);
    const ptrdiff_t size = (ptrdiff_t)ln_dtype_size(dtype);
    ptrdiff_t j = begin;
    for (; rows->paired && j + 32 <= end; j += 32) {
        const gf w0 = weight ? gf_load(weight + j) : gf_splat(1.0f);
        const gf w1 = weight ? gf_load(weight + j + 16) : gf_splat(1.0f);
        gf dweight0 = gf_splat(0.0f), dbias0 = dweight0, dweight1 = dweight0, dbias1 = dweight0;
        for (int k = 0; k < count; k++) {
            if (rows->prefetch) {
                grad_prefetch_next(rows->next_dy[k], rows->next_x[k], j * size, 2 * group_bytes_of(dtype));
            }
            grad_apply_term(kind, dtype, rows, k, j, weight ? &w0 : NULL, &dweight0, &dbias0, want_sums);
            grad_apply_term(kind, dtype, rows, k, j + 16, weight ? &w1 : NULL, &dweight1, &dbias1, want_sums);
        }
        grad_apply_sums(rows, j, dweight0, dbias0, dweight, dbias);
        grad_apply_sums(rows, j + 16, dweight1, dbias1, dweight, dbias);
    }
    for (; j + 16 <= end; j += 16) {
        const gf w = weight ? gf_load(weight + j) : gf_splat(1.0f);
        gf group_dweight = gf_splat(0.0f), group_dbias = group_dweight;
        for (int k = 0; k < count; k++) {
            if (rows->prefetch) {
                grad_prefetch_next(rows->next_dy[k], rows->next_x[k], j * size, group_bytes_of(dtype));
            }
            grad_apply_term(kind, dtype, rows, k, j, weight ? &w : NULL, &group_dweight, &group_dbias, want_sums);
        }
        grad_apply_sums(rows, j, group_dweight, group_dbias, dweight, dbias);
    }
}

/* The first `bytes` of `from` to p, a row's dx past its last whole group, the way
   grad_dx_store says: by 16-byte non-temporal stores (bytes a multiple of 16, p 16-byte
   aligned, as ln_dx_streams has it) where the row's groups went so, since a line written
   both through the cache and around it waits for the one to drain before the other. */
static LN_ALWAYS_INLINE void part_store(ln_store how, char *p, const void *from, ptrdiff_t bytes)
{
    if (how == LN_STORE_CACHED) {
        memcpy(p, from, (size_t)bytes);
        return;
    }
    assert(bytes % 16 == 0 && (uintptr_t)p % 16 == 0);
    for (ptrdiff_t piece = 0; piece < bytes; piece += 16) {
        piece_stream(p + piece, (const char *)from + piece);
    }
}

/* Columns [begin, n), fewer than 16 from a multiple of 16, as one part group
   (load_part_as_f32): grad_apply_columns' arithmetic lane by lane, and so its bits; dx,
   dweight and dbias go out from buffers, the columns' lanes alone. */
static LN_ALWAYS_INLINE void grad_apply_part(ln_norm_kind kind, ln_dtype dtype, const grad_apply_rows *rows,
                                             int count, const float *weight, ptrdiff_t begin, ptrdiff_t n,
                                             double *dweight, double *dbias)
{
    const int has_mean = kind == LN_NORM_LAYER, want_dx = rows->want_dx, columns = (int)(n - begin);
    const ptrdiff_t size = (ptrdiff_t)ln_dtype_size(dtype);
    if (columns == 0) {
        return;
    }
    const gf w = weight ? load_part_as_f32(LN_F32, weight, begin, columns) : gf_splat(1.0f);
    gf group_dweight = gf_splat(0.0f), group_dbias = group_dweight;
    for (int k = 0; k < count; k++) {
        const gf dy_v = load_part_as_f32(dtype, rows->dy[k], begin, columns);
        const gf value_x = load_part_as_f32(dtype, rows->x[k], begin, columns);
        const gf xc = has_mean ? gf_sub(value_x, rows->mean_v[k]) : value_x;
        if (want_dx) {
            const gf dx_v = grad_dx(kind, weight ? gf_mul(dy_v, w) : dy_v, xc, rows->rstd_v[k],
                                    rows->xc_scale_v[k], rows->offset_v[k]);
            uint16_t halves[16];
            float floats[16];
            void *dx = ln_dtype_is_16bit(dtype) ? (void *)halves : (void *)floats;
            store_from_f32(dtype, dx, 0, dx_v, 1);
            part_store(rows->dx_store, rows->dx[k] + begin * size, dx, columns * size);
        }
        group_dweight = gf_fma(gf_mul(dy_v, xc), rows->rstd_v[k], group_dweight);
        group_dbias = gf_add(group_dbias, dy_v);
    }
    double lanes[16];
    if (dweight) {
        gd_store(lanes, gf_widen(group_dweight));
        for (int j = 0; j < columns; j++) {
            dweight[begin + j] = (rows->set_sums ? 0.0 : dweight[begin + j]) + lanes[j];
        }
    }
    if (dbias) {
        gd_store(lanes, gf_widen(group_dbias));
        for (int j = 0; j < columns; j++) {
            dbias[begin + j] = (rows->set_sums ? 0.0 : dbias[begin + j]) + lanes[j];
        }
    }
}

/* Pass 2 over a span, as above. */
static LN_ALWAYS_INLINE void grad_apply_single(ln_norm_kind kind, ln_dtype dtype, const ln_grad_rows *group,
                                               int count, const float *weight, ptrdiff_t n,
                                               double *dweight, double *dbias)
{
    grad_apply_rows rows;
    grad_apply_start(&rows, group, count);
    grad_apply_columns(kind, dtype, &rows, count, weight, 0, n, dweight, dbias);
    grad_apply_part(kind, dtype, &rows, count, weight, n - n % 16, n, dweight, dbias);
}

/* The same for float64 data, all in float64. */
static LN_ALWAYS_INLINE void grad_apply_double(ln_norm_kind kind, const ln_grad_rows *group, const double *weight,
                                               ptrdiff_t n, double *dweight, double *dbias)
{
    const int has_mean = kind == LN_NORM_LAYER;
    gd mean_v[LN_GRAD_ROWS], rstd_v[LN_GRAD_ROWS], xc_scale_v[LN_GRAD_ROWS], offset_v[LN_GRAD_ROWS];
    double xc_scale[LN_GRAD_ROWS], offset[LN_GRAD_ROWS];
    const int count = group->count;
    for (int k = 0; k < count; k++) {
        xc_scale[k] = -group->rstd[k] * group->rstd[k] * group->gx_mean[k];
        offset[k] = -group->rstd[k] * group->g_mean[k];
        mean_v[k] = gd_splat(group->mean[k]);
        rstd_v[k] = gd_splat(group->rstd[k]);
        xc_scale_v[k] = gd_splat(xc_scale[k]);
        offset_v[k] = gd_splat(offset[k]);
    }
    const int want_dx = group->dx[0] != NULL;
    const ln_store dx_store = grad_dx_store(group);
    ptrdiff_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const gd w = weight ? gd_load(weight + j) : gd_splat(1.0);
        gd dweight_v = dweight && !group->set_sums ? gd_load(dweight + j) : gd_splat(0.0);
        gd dbias_v = dbias && !group->set_sums ? gd_load(dbias + j) : gd_splat(0.0);
        for (int k = 0; k < count; k++) {
            if (group->next_x[k]) {
                grad_prefetch_next(group->next_dy[k], group->next_x[k], j * 8, 128);
            }
            const gd dy_v = gd_load((const double *)group->dy[k] + j);
            const gd value_x = gd_load((const double *)group->x[k] + j);
            const gd xc = has_mean ? gd_sub(value_x, mean_v[k]) : value_x;
            if (want_dx) {
                const gd g = weight ? gd_mul(dy_v, w) : dy_v;
                const gd inner = has_mean ? gd_fma(xc_scale_v[k], xc, offset_v[k]) : gd_mul(xc_scale_v[k], xc);
                const gd dx = gd_fma(rstd_v[k], g, inner);
                if (dx_store == LN_STREAM_LINES) {
                    gd_stream((double *)group->dx[k] + j, dx);
                }
                else if (dx_store == LN_STREAM_PIECES) {
                    gd_stream16((double *)group->dx[k] + j, dx);
                }
                else {
                    gd_store((double *)group->dx[k] + j, dx);
                }
            }
            if (dweight) {
                dweight_v = gd_fma(gd_mul(dy_v, xc), rstd_v[k], dweight_v);
            }
            if (dbias) {
                dbias_v = gd_add(dbias_v, dy_v);
            }
        }
        if (dweight) {
            gd_store(dweight + j, dweight_v);
        }
        if (dbias) {
            gd_store(dbias + j, dbias_v);
        }
    }
    const ptrdiff_t tail = j;
    double tail_dx[LN_GRAD_ROWS][16];  /* the rows' dx from column `tail` on, for part_store */
    for (; j < n; j++) {
        if (dweight && group->set_sums) {
            dweight[j] = 0.0;
        }
        if (dbias && group->set_sums) {
            dbias[j] = 0.0;
        }
        for (int k = 0; k < count; k++) {
            const double dy_1 = ((const double *)group->dy[k])[j];
            const double value_x = ((const double *)group->x[k])[j];
            const double xc = has_mean ? value_x - group->mean[k] : value_x;
            if (want_dx) {
                const double g = weight ? dy_1 * weight[j] : dy_1;
                const double inner = has_mean ? fma(xc_scale[k], xc, offset[k]) : xc_scale[k] * xc;
                tail_dx[k][j - tail] = fma(group->rstd[k], g, inner);
            }
            if (dweight) {
                dweight[j] = fma(dy_1 * xc, group->rstd[k], dweight[j]);
            }
            if (dbias) {
                dbias[j] += dy_1;
            }
        }
    }
    for (int k = 0; want_dx && tail < n && k < count; k++) {
        part_store(dx_store, group->dx[k] + tail * 8, tail_dx[k], (n - tail) * 8);
    }
}

static LN_ALWAYS_INLINE void grad_apply(ln_norm_kind kind, ln_dtype dtype, const ln_grad_rows *group,
                                        const void *weight, ptrdiff_t n, double *dweight, double *dbias)
{
    assert(group && 1 <= group->count && group->count <= LN_GRAD_ROWS && n >= 1);
    assert(kind == LN_NORM_LAYER || !dbias);
    for (int k = 0; k < group->count; k++) {
        assert(group->dy[k] && group->x[k] && (group->dx[k] != NULL) == (group->dx[0] != NULL));
    }
    dbias = kind == LN_NORM_RMS ? NULL : dbias;
    if (dtype == LN_F64) {
        grad_apply_double(kind, group, weight, n, dweight, dbias);
    }
    else if (LN_AFFINE_LOOP_APART && group->dx[0] && weight && dweight && (dbias || kind == LN_NORM_RMS)) {
        /* a training step's case, everything asked for, compiled apart: no tests in its
           loops (2048x1024 float16 backward, 2 threads: 5% faster); a full group apart again,
           its loop over the rows unrolled (512x768 float32, one thread: 12% faster) */
        if (group->count == LN_GRAD_ROWS) {
            grad_apply_single(kind, dtype, group, LN_GRAD_ROWS, weight, n, dweight, dbias);
        }
        else {
            grad_apply_single(kind, dtype, group, group->count, weight, n, dweight, dbias);
        }
    }
    else {
        grad_apply_single(kind, dtype, group, group->count, weight, n, dweight, dbias);
    }
}

/* ------------------------------------------------------------------------ */
/* Backward: rows                                                            */
/* ------------------------------------------------------------------------ */

/* ln_xhat_of, lane by lane: out of line, for the lanes whose x - mean left float64's range
   (or holds NaN). */
__attribute__((noinline, cold)) static gd xhat_lanes_wide(gd x, gd mean, gd rstd)
{
    double xs[16], means[16], rstds[16];
    gd_store(xs, x);
    gd_store(means, mean);
    gd_store(rstds, rstd);
    for (int k = 0; k < 16; k++) {
        xs[k] = ln_xhat_of(xs[k], means[k], rstds[k]);
    }
    return gd_load(xs);
}

/* Whether x - mean stays in float64's range for every x of rows with these means: float32,
   float16 and bfloat16 data widened, RMSNorm's mean of 0, and means below 2**970 in
   magnitude, for which |x - mean| < DBL_MAX + 2**970 rounds to DBL_MAX at most (ties at
   2**1024 - 2**970 go to Inf).  Tested once for the rows of a block or a tile, so that the
   loops over rows in range test nothing more. */
static LN_ALWAYS_INLINE int centred_in_range(ln_norm_kind kind, ln_dtype dtype, gd means)
{
    const double below = 0x1.fffffffffffffp969;  /* the largest double below 2**970 */
    return dtype != LN_F64 || kind == LN_NORM_RMS || gd_all_within(means, -below, below);
}

/* xhat = (x - mean) * rstd in float64 lanes (x * rstd for RMSNorm), as ln_xhat_of; in_range:
   centred_in_range's answer for these lanes' rows. */
static LN_ALWAYS_INLINE gd xhat_lanes(ln_norm_kind kind, gd x, gd mean, gd rstd, int in_range)
{
    if (kind == LN_NORM_RMS) {
        return gd_mul(x, rstd);
    }
    const gd xc = gd_sub(x, mean);
    return in_range || gd_all_within(xc, -DBL_MAX, DBL_MAX) ? gd_mul(xc, rstd) : xhat_lanes_wide(x, mean, rstd);
}

/* xhat_columns[i][k] = ln_xhat_of of float64 column i, lane k: for backward_short_rows' blocks
   whose rows' x - mean may overflow. */
__attribute__((noinline, cold)) static void short_rows_xhat_wide(const double x_columns[16][16],
                                                                  const double means[16], const double rstds[16],
                                                                  ptrdiff_t n, double xhat_columns[16][16])
{
    for (ptrdiff_t i = 0; i < n; i++) {
        for (int k = 0; k < 16; k++) {
            xhat_columns[i][k] = ln_xhat_of(x_columns[i][k], means[k], rstds[k]);
        }
    }
}

/* Rows shorter than one group (n < 16), where per-row overhead would dominate: 16 rows
   at a time, one row per lane, all in float64.  Lane k of the parameter accumulators
   takes rows block + k; the lanes are added by the fixed tree when the range is done. */
static LN_ALWAYS_INLINE void backward_short_rows(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                                 ptrdiff_t begin, ptrdiff_t end, double *dweight, double *dbias)
{
    const ptrdiff_t n = a->extent.row_len;
    const int has_mean = kind == LN_NORM_LAYER;
    assert(1 <= n && n < 16);
    const lane_divisor by_n = lane_divisor_of(n);
    const gd zero_v = gd_splat(0.0);
    gd dweight_lanes[16], dbias_lanes[16];   /* [column], a lane per row slot */
    for (ptrdiff_t i = 0; i < n; i++) {
        dweight_lanes[i] = zero_v;
        dbias_lanes[i] = zero_v;
    }
    for (ptrdiff_t block = begin; block < end; block += 16) {
        const ptrdiff_t rows = end - block < 16 ? end - block : 16;
        double dy_columns[16][16], x_columns[16][16], g_columns[16][16], xhat_columns[16][16], dx_columns[16][16];
        double means[16] = {0}, rstds[16] = {0};  /* padding slots past the last row: zeros */
        short_rows_to_columns(dtype, &a->grad_output, &a->extent, block, rows, n, dy_columns);
        short_rows_to_columns(dtype, &a->input, &a->extent, block, rows, n, x_columns);
        for (ptrdiff_t k = 0; k < rows; k++) {
            means[k] = has_mean ? ln_load_stat(dtype, &a->mean, &a->extent, block + k) : 0.0;
            rstds[k] = ln_load_stat(dtype, &a->rstd, &a->extent, block + k);
        }
        const gd mean_v = gd_load(means), rstd_v = gd_load(rstds);
        /* rows whose x - mean may overflow: xhat from ln_xhat_of, before the loop (a test and
           a call in it took float64 1000000x8 backward 7-15% longer) */
        const int in_range = centred_in_range(kind, dtype, mean_v);
        if (!in_range) {
            short_rows_xhat_wide(x_columns, means, rstds, n, xhat_columns);
        }
        gd g_sum = zero_v, gx_sum = zero_v;
        for (ptrdiff_t i = 0; i < n; i++) {
            const gd dy_v = short_rows_column(dtype, dy_columns, i), value_x = short_rows_column(dtype, x_columns, i);
            const gd xhat = in_range ? gd_mul(has_mean ? gd_sub(value_x, mean_v) : value_x, rstd_v)
                                     : gd_load(xhat_columns[i]);
            const gd g = a->weight ? gd_mul(dy_v, gd_splat(ln_load1_param_as_f64(dtype, a->weight, i))) : dy_v;
            g_sum = has_mean ? gd_add(g_sum, g) : g_sum;
            gx_sum = gd_add(gx_sum, gd_mul(g, xhat));
            if (dweight) {
                dweight_lanes[i] = gd_add(dweight_lanes[i], gd_mul(dy_v, xhat));
            }
            if (dbias) {
                dbias_lanes[i] = gd_add(dbias_lanes[i], dy_v);
            }
            gd_store(xhat_columns[i], xhat);
            gd_store(g_columns[i], g);
        }
        if (!a->grad_input.data) {
            continue;
        }
        const gd g_mean = gd_div_by(g_sum, &by_n), gx_mean = gd_div_by(gx_sum, &by_n);
        for (ptrdiff_t i = 0; i < n; i++) {
            const gd g = gd_load(g_columns[i]);
            const gd inner = gd_sub(has_mean ? gd_sub(g, g_mean) : g, gd_mul(gd_load(xhat_columns[i]), gx_mean));
            store_from_f64(dtype, dx_columns[i], gd_quiet_nans(gd_mul(inner, rstd_v)));  /* a NaN the one quiet NaN */
        }
        short_rows_from_columns(dtype, &a->grad_input, &a->extent, block, rows, NULL, n, dx_columns);
    }
    for (ptrdiff_t i = 0; i < n; i++) {
        double lanes[16];
        if (dweight) {
            gd_store(lanes, dweight_lanes[i]);
            dweight[i] += ln_sum_lanes(lanes);
        }
        if (dbias) {
            gd_store(lanes, dbias_lanes[i]);
            dbias[i] += ln_sum_lanes(lanes);
        }
    }
}

#if LN_GF_TRANSPOSE
/*
 * Rows of 16 float16, bfloat16 or float32 elements, with dx: 16 rows at a time, a row tile,
 * turned by gf_transpose so that lane k of a vector holds row k, with the bits of
 * backward_rows' groups of LN_GRAD_ROWS rows.  Pass 1 of a row of one group adds its 16
 * lanes (widened) by ln_sum_lanes' tree; turned, a lane is a vector over the tile's rows and
 * the tree is vector adds, and what a group does once per row in scalars (the means, the
 * test of the common row, pass 2's factors) is one vector operation per tile.  A tile with
 * a row that is not common (grad_lanes_common) writes nothing and returns 0: its rows then
 * go group by group.  Float32, one thread, A/B in alternating processes: rows of 16 30-33
 * -> 19-22 ns a row (torch 13).  Longer rows took as long or longer this way (rows of 32:
 * 33-38 -> 38-40 ns, 24: 37 -> 52, 64: 43 -> 57), each of their groups turned twice on the
 * way in and once on the way out.
 */
static LN_ALWAYS_INLINE int row_tiles_fit(ln_dtype dtype, const ln_backward_args *a)
{
    return dtype != LN_F64 && a->grad_input.data && a->extent.row_len == 16;
}

/* The addresses of rows first .. first + 15 of an array. */
static LN_ALWAYS_INLINE void row_tile_addresses(const ln_array *array, const ln_extent *extent, ptrdiff_t first,
                                                char *rows[16])
{
    const ptrdiff_t block = extent->blocks > 1 ? first / extent->rows : 0;
    if ((block + 1) * extent->rows < first + 16) {  /* a block ends among them */
        for (int k = 0; k < 16; k++) {
            rows[k] = ln_row_address(array, extent, first + k);
        }
        return;
    }
    rows[0] = ln_block_row_address(array, block, first - block * extent->rows);
    for (int k = 1; k < 16; k++) {
        rows[k] = rows[k - 1] + array->walk.row_step;
    }
}

/* Pass 1's sums of element l of the tile's rows, turned (a vector over the rows), as
   grad_sums_block and grad_sums_finish form lane l's for a row of one group: its group in
   the even accumulators, the odd ones' 0.0 added to them, widened and added to 0.0 (which
   change no bits of a common row's sums, and are kept to be the group route's operations),
   and their maxima into tops. */
static LN_ALWAYS_INLINE void row_tile_lane_sums(ln_norm_kind kind, const gf dy[16], const gf x[16],
                                                const float *weight, int l, gf mean_v, gd sums[2], grad_tops *tops)
{
    const gf zero_f = gf_splat(0.0f), g = weight ? gf_mul(dy[l], gf_splat(weight[l])) : dy[l];
    gf even_g = zero_f, even_gc = zero_f;
    grad_sums_terms(kind, dy[l], g, x[l], weight != NULL, TOPS_OF_LANES, mean_v, &even_g, &even_gc, tops);
    sums[0] = gd_add(gd_splat(0.0), gf_widen(gf_add(even_g, zero_f)));
    sums[1] = gd_add(gd_splat(0.0), gf_widen(gf_add(even_gc, zero_f)));
}

/* Rows first .. first + 15 backward as a row tile; returns 0, having written nothing, where
   one of them is not common. */
static LN_ALWAYS_INLINE int backward_row_tile(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                              ptrdiff_t first, int stream_dx, int *params_written,
                                              double *dweight, double *dbias)
{
    const int has_mean = kind == LN_NORM_LAYER;
    const float *weight = a->weight;
    _Static_assert(16 % LN_GRAD_ROWS == 0, "a row tile is whole groups of pass 2");
    assert(row_tiles_fit(dtype, a));
    char *dy_rows[16], *x_rows[16], *dx_rows[16], *mean_at[16], *rstd_at[16];
    double rstds[16];
    float mean_f[16], rstd_f[16];
    int dx_lines = stream_dx;
    row_tile_addresses(&a->grad_output, &a->extent, first, dy_rows);
    row_tile_addresses(&a->input, &a->extent, first, x_rows);
    row_tile_addresses(&a->grad_input, &a->extent, first, dx_rows);
    row_tile_addresses(&a->rstd, &a->extent, first, rstd_at);
    if (has_mean) {
        row_tile_addresses(&a->mean, &a->extent, first, mean_at);
    }
    for (int k = 0; k < 16; k++) {
        dx_lines &= (uintptr_t)dx_rows[k] % 64 == 0;
        mean_f[k] = has_mean ? (float)ln_load1_param_as_f64(dtype, mean_at[k], 0) : 0.0f;
        rstds[k] = ln_load1_param_as_f64(dtype, rstd_at[k], 0);
        rstd_f[k] = (float)rstds[k];
    }
    /* the rows in, turned, and pass 2's terms of dweight and dbias (which need no sums),
       summed over each LN_GRAD_ROWS rows, while they are rows */
    gf dy[16], x[16], dweight_sums[16 / LN_GRAD_ROWS], dbias_sums[16 / LN_GRAD_ROWS];
    for (int s = 0; s < 16 / LN_GRAD_ROWS; s++) {
        gf group_dweight = gf_splat(0.0f), group_dbias = group_dweight;
        for (int k = s * LN_GRAD_ROWS; k < (s + 1) * LN_GRAD_ROWS; k++) {
            dy[k] = load_as_f32(dtype, dy_rows[k], 0);
            x[k] = load_as_f32(dtype, x_rows[k], 0);
            const gf xc = has_mean ? gf_sub(x[k], gf_splat(mean_f[k])) : x[k];
            group_dweight = gf_fma(gf_mul(dy[k], xc), gf_splat(rstd_f[k]), group_dweight);
            group_dbias = gf_add(group_dbias, dy[k]);
        }
        dweight_sums[s] = group_dweight;
        dbias_sums[s] = group_dbias;
    }
    gf_transpose(dy);
    gf_transpose(x);
    /* pass 1, lanes l and l + 8 together: ln_sum_lanes' first step, then its others */
    const gf mean_v = gf_load(mean_f), zero_f = gf_splat(0.0f);
    grad_tops tops = {zero_f, zero_f, zero_f};
    gd pairs[2][8], totals[2];
    for (int l = 0; l < 8; l++) {
        gd low[2], high[2];
        row_tile_lane_sums(kind, dy, x, weight, l, mean_v, low, &tops);
        row_tile_lane_sums(kind, dy, x, weight, l + 8, mean_v, high, &tops);
        pairs[0][l] = gd_add(low[0], high[0]);
        pairs[1][l] = gd_add(low[1], high[1]);
    }
    for (int i = 0; i < 2; i++) {
        for (int l = 0; l < 4; l++) {
            pairs[i][l] = gd_add(pairs[i][l], pairs[i][l + 4]);
        }
        totals[i] = gd_add(gd_add(pairs[i][0], pairs[i][2]), gd_add(pairs[i][1], pairs[i][3]));
    }
    /* grad_group_pass1's means and grad_apply_start's factors, a lane per row */
    const gd rstd = gd_load(rstds), n_v = gd_splat(16.0), zero_d = gd_splat(0.0);
    const gd neg_rstd = gd_sub(zero_d, rstd);  /* -rstd, for the rstd > 0 of a common row */
    const gd g_mean = has_mean ? gd_div(totals[0], n_v) : zero_d, gx_mean = gd_div(gd_mul(totals[1], rstd), n_v);
    const gd xc_scale = gd_mul(gd_mul(neg_rstd, rstd), gx_mean), offset = gd_mul(neg_rstd, g_mean);
    const gd widened[LN_LARGEST_COUNT] = {
        [LN_LARGEST_G] = gf_widen(tops.g), [LN_LARGEST_DY] = gf_widen(tops.dy), [LN_LARGEST_XC] = gf_widen(tops.xc)};
    if (!grad_lanes_common(kind, dtype, 16, rstd, xc_scale, offset, widened)) {
        return 0;
    }
    double factors[2][16];
    float xc_scale_f[16], offset_f[16];
    gd_store(factors[0], xc_scale);
    gd_store(factors[1], offset);
    for (int k = 0; k < 16; k++) {
        xc_scale_f[k] = (float)factors[0][k];
        offset_f[k] = (float)factors[1][k];
    }
    /* pass 2: dx, turned back to rows; the parameters' terms into their sums */
    const gf rstd_v = gf_load(rstd_f), xc_scale_v = gf_load(xc_scale_f), offset_v = gf_load(offset_f);
    for (int l = 0; l < 16; l++) {
        const gf g = weight ? gf_mul(dy[l], gf_splat(weight[l])) : dy[l];
        dy[l] = grad_dx(kind, g, has_mean ? gf_sub(x[l], mean_v) : x[l], rstd_v, xc_scale_v, offset_v);
    }
    gf_transpose(dy);
    const ln_store how = !stream_dx ? LN_STORE_CACHED : dx_lines ? LN_STREAM_LINES : LN_STREAM_PIECES;
    for (int k = 0; k < 16; k++) {
        grad_store_dx(dtype, how, dx_rows[k], 0, dy[k]);
    }
    for (int s = 0; s < 16 / LN_GRAD_ROWS; s++) {
        const int from_zero = !*params_written && s == 0;  /* set_sums */
        if (dweight) {
            gd_store(dweight, gd_add(from_zero ? gd_splat(0.0) : gd_load(dweight), gf_widen(dweight_sums[s])));
        }
        if (dbias) {
            gd_store(dbias, gd_add(from_zero ? gd_splat(0.0) : gd_load(dbias), gf_widen(dbias_sums[s])));
        }
    }
    *params_written = 1;
    return 1;
}
#endif

/* Row r's pointers and statistics into slot k of group. */
static LN_ALWAYS_INLINE void grad_group_row(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                            ln_grad_rows *group, int k, ptrdiff_t r)
{
    group->dy[k] = ln_row_address(&a->grad_output, &a->extent, r);
    group->x[k] = ln_row_address(&a->input, &a->extent, r);
    group->dx[k] = a->grad_input.data ? ln_row_address(&a->grad_input, &a->extent, r) : NULL;
    group->mean[k] = kind == LN_NORM_LAYER ? ln_load_stat(dtype, &a->mean, &a->extent, r) : 0.0;
    group->rstd[k] = ln_load_stat(dtype, &a->rstd, &a->extent, r);
    group->g_mean[k] = group->gx_mean[k] = 0.0;
}

/* Pass 1 of slot k, its sums into the group's means; whether the row goes by
   ln_backward_exact_row: one the group's float32 (or rstd**2) arithmetic cannot carry. */
static LN_ALWAYS_INLINE int grad_group_pass1(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                             ln_grad_rows *group, int k, ptrdiff_t read_ahead)
{
    const ptrdiff_t n = a->extent.row_len;
    double sums[2], largest[LN_LARGEST_COUNT];
    grad_tops tops;
    if (dtype == LN_F64) {
        grad_sums_double(kind, (const double *)group->dy[k], (const double *)group->x[k], a->weight, n,
                         group->mean[k], group->rstd[k], sums, largest);
    }
    else {
        grad_sums_single(kind, dtype, group->dy[k], group->x[k], a->weight, n, group->mean[k], group->rstd[k],
                         sums, &tops, read_ahead);
    }
    group->g_mean[k] = sums[0] / (double)n;
    group->gx_mean[k] = sums[1] / (double)n;
    if (dtype != LN_F64) {
        if (grad_row_common(group->rstd[k], group->g_mean[k], group->gx_mean[k], &tops)) {
            return 0;
        }
        grad_tops_largest(&tops, largest);
    }
    return ln_grad_row_needs_exact(dtype, group->rstd[k], group->g_mean[k], group->gx_mean[k], largest);
}

/* dweight and dbias (n each, or NULL) zeroed, for sums to be added into. */
static LN_ALWAYS_INLINE void grad_params_zero(double *dweight, double *dbias, ptrdiff_t n)
{
    if (dweight) {
        memset(dweight, 0, (size_t)n * sizeof *dweight);
    }
    if (dbias) {
        memset(dbias, 0, (size_t)n * sizeof *dbias);
    }
}

/* Readies the block's dweight and dbias (n each, or NULL) for the pass 2 of `group`, which
   has rows for ln_backward_exact_row if any_exact; *written: whether a group before it in the
   block has been through pass 2.  The first group writes the sums (set_sums): 0.0 + its own,
   the bits of adding them into zeros; ln_backward_exact_row adds, into zeros then. */
static LN_ALWAYS_INLINE void grad_params_begin(ln_grad_rows *group, int any_exact, int *written, double *dweight,
                                               double *dbias, ptrdiff_t n)
{
    group->set_sums = !*written && !any_exact;
    if (!*written && any_exact) {
        grad_params_zero(dweight, dbias, n);
    }
    *written = 1;
}

/* Pass 2 of a group (rows first ..) of which some rows go by ln_backward_exact_row. */
static LN_ALWAYS_INLINE void grad_group_with_exact(const ln_row_kernels *kernels, const ln_backward_args *a,
                                                   const ln_grad_rows *group, const int exact[], ptrdiff_t first,
                                                   double *dweight, double *dbias)
{
    ln_grad_apply_without(kernels->grad_apply, group, exact, a->weight, a->extent.row_len, dweight, dbias);
    for (int k = 0; k < group->count; k++) {
        if (exact[k]) {
            ln_backward_exact_row(a, first + k, dweight);
        }
    }
}

/* Rows [begin, end): pass 1 row by row, pass 2 over groups of LN_GRAD_ROWS rows, each
   group still in cache from pass 1 (rows of 16 elements 16 rows at a time where the level
   has row tiles, with the same bits).  With totals, rows that ln_rows_add_to_totals allows
   and that have no row for ln_backward_exact_row have their group's sums added to the
   totals (returns 1; see ln_row_kernels). */
static LN_ALWAYS_INLINE int backward_rows(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *args,
                                          ptrdiff_t begin, ptrdiff_t end, double *dweight, double *dbias,
                                          double *total_dweight, double *total_dbias)
{
    const ln_backward_args copy = *args, *a = &copy;  /* see forward_rows */
    const ptrdiff_t n = a->extent.row_len;
    assert(a && a->grad_output.data && a->input.data && a->rstd.data && n >= 1);
    assert(0 <= begin && begin <= end && end <= ln_rows_of(&a->extent));
    assert(!(total_dweight || total_dbias) || (!total_dweight == !dweight && !total_dbias == !dbias));
    dbias = kind == LN_NORM_LAYER ? dbias : NULL;
    total_dbias = kind == LN_NORM_LAYER ? total_dbias : NULL;
    const int may_add = (total_dweight || total_dbias) && ln_rows_add_to_totals(dtype, end - begin, n);
    int added = 0;
    if (n < 16) {
        grad_params_zero(dweight, dbias, n);
        backward_short_rows(kind, dtype, a, begin, end, dweight, dbias);
        return 0;
    }
    int params_written = 0;  /* see grad_params_begin */
    const int stream_dx = ln_backward_streams_dx(a);
    const ln_row_kernels *kernels = &LN_LEVEL_KERNELS.by_dtype[dtype].by_kind[kind];
    const ptrdiff_t read_ahead = ln_backward_read_ahead(a);
#if LN_GF_TRANSPOSE
    const int row_tiles = row_tiles_fit(dtype, a);
    ptrdiff_t groups_until = begin;  /* rows [a failed row tile's first, groups_until) go group by group */
#endif
    for (ptrdiff_t first = begin; first < end; first += LN_GRAD_ROWS) {
#if LN_GF_TRANSPOSE
        if (row_tiles && first >= groups_until && end - first >= 16) {
            if (backward_row_tile(kind, dtype, a, first, stream_dx, &params_written, dweight, dbias)) {
                first += 16 - LN_GRAD_ROWS;
                continue;
            }
            groups_until = first + 16;
        }
#endif
        ln_grad_rows group = {.count = (int)(end - first < LN_GRAD_ROWS ? end - first : LN_GRAD_ROWS),
                              .stream_dx = stream_dx};
        int exact[LN_GRAD_ROWS], any_exact = 0;
        for (int k = 0; k < group.count; k++) {
            grad_group_row(kind, dtype, a, &group, k, first + k);
            exact[k] = 0;
            /* pass 1 also without dx, so that which rows go by ln_backward_exact_row, and so
               dweight's bits, do not depend on what else the call asks for; dbias alone needs
               none of it (ln_grad_apply_without sums dbias over every row) */
            if (a->grad_input.data || dweight) {
                exact[k] = grad_group_pass1(kind, dtype, a, &group, k, read_ahead);
            }
            any_exact |= exact[k];
        }
        grad_params_begin(&group, any_exact, &params_written, dweight, dbias, n);
        double *into_dweight = dweight, *into_dbias = dbias;
        if (may_add && !any_exact) {
            /* the group's float32 sums, widened, go to the totals as set_sums puts them to 0.0
               (the block's only group: may_add) */
            assert(first == begin && end - begin <= LN_GRAD_ROWS);
            group.set_sums = 0;
            into_dweight = total_dweight;
            into_dbias = total_dbias;
            added = 1;
        }
        for (int k = 0; ln_backward_prefetches(a) && k < group.count && first + LN_GRAD_ROWS + k < end; k++) {
            group.next_dy[k] = ln_row_address(&a->grad_output, &a->extent, first + LN_GRAD_ROWS + k);
            group.next_x[k] = ln_row_address(&a->input, &a->extent, first + LN_GRAD_ROWS + k);
        }
        if (any_exact) {
            grad_group_with_exact(kernels, a, &group, exact, first, dweight, dbias);
        }
        else {
            kernels->grad_apply(&group, a->weight, n, into_dweight, into_dbias);
        }
    }
    if (!params_written) {  /* no rows */
        grad_params_zero(dweight, dbias, n);
    }
    if (stream_dx) {
        stream_fence();
    }
    return added;
}

/* ------------------------------------------------------------------------ */
/* Strided route: tiles of rows, a row per lane                              */
/* ------------------------------------------------------------------------ */

/*
 * Rows whose elements are not adjacent in memory (channels-first data normalized over C:
 * elements H*W apart, rows adjacent) go LN_TILE_ROWS rows of one block at a time, lane k of
 * every group holding the tile's row k, in a loop over the rows' elements: element j of the
 * tile's rows is one group, loaded (and stored) as a vector where those rows are adjacent in
 * memory, else gathered (and scattered) through a lane buffer with scalar loads.  A lane's
 * arithmetic is its own and sequential over its row, so its bits are the same at every
 * level and thread count; the tiles depend on the shape alone.  Per lane:
 *
 *     statistics in float64, one pass per LN_CHUNK elements about the chunk's first
 *     element K (0 for RMSNorm), the chunks merged by ln_merge, as chunk_moments does:
 *     a two-pass mean would read the tile a third time for no accuracy that matters here
 *     output: normalize_one's formulas, with each lane's own mean and rstd
 *     backward: float16/bfloat16/float32 data the contiguous route's float32 arithmetic
 *     (backward_tile_f32), but for the rows that fail that route's test for
 *     ln_backward_exact_row, which go as float64 data goes: backward_short_rows' formulas,
 *     in float64 (so a row's bits do not depend on the rows beside it in its tile); dweight
 *     and dbias added into per-lane column sums over the tiles, whose lanes ln_backward.c
 *     adds by ln_sum_lanes (a block of one tile adds them itself: tile_add_term)
 *
 * A tile is read twice, for the statistics and then for the output (or for the backward's
 * two passes): 16 rows of up to a few thousand elements are still in cache the second time,
 * longer rows are read twice from memory.  Where the forward output's stores would hold up
 * those second reads (tiles_output_staged), the statistics' pass copies the tile into L1 and
 * the output is read from the copy.
 */

/* One array's part in a tile: where its lanes' rows are and how to walk them. */
typedef struct {
    char *first;          /* lane 0's row; NULL: the array is absent */
    ptrdiff_t row_step;   /* bytes from one lane's row to the next's */
    ptrdiff_t elem_step;  /* bytes from one element of a row to the next */
    ptrdiff_t row_len;    /* elements a row */
    int adjacent;         /* all 16 lanes, rows adjacent: element j is one group in memory */
    int prefetch;         /* adjacent, and LN_TILE_PREFETCH more tiles of the block follow */
} tile_view;

/* Elements [begin, end) of a tile's rows that are not adjacent in memory, gathered a group
   of 16 lanes each (of any element type; lanes from the tile's count on 0.0) by tile_load.
   Gathered LN_TILE_GATHER elements at a time, not one: a vector load of a group just
   stored element by element waits for those stores to reach the cache (store-to-load
   forwarding fails), on every element.  The copy fills one group after another, its stores
   to a group adjacent; a row at a time, each store would go to the next group, 128 bytes on
   (float32 over axis=0, one thread, AVX2, best of 11 in three alternating processes, a row
   at a time -> a group at a time: (200000, 8) forward 3.8-4.1 -> 2.8-2.9 ms, backward
   7.3-7.6 -> 5.4-5.9 ms; (100000, 15) 3.0-3.2 -> 1.9-2.0 and 6.2-6.6 -> 4.0-4.3 ms; with two
   rows, (1000000, 2), forward 9.1-9.9 -> 9.3-9.7 ms and backward 16.6-16.9 -> 18.6-19.1 ms). */
typedef struct {
    ptrdiff_t begin, end;
    double groups[LN_TILE_GATHER][16];
} tile_gathered;

/* g empty, ready for a tile of `count` rows of row_len `dtype` elements (the groups it can
   use have their lanes from count on zeroed). */
static LN_ALWAYS_INLINE void tile_gathered_init(tile_gathered *g, ln_dtype dtype, int count, ptrdiff_t row_len)
{
    const size_t size = ln_dtype_size(dtype);
    g->begin = g->end = 0;
    for (ptrdiff_t i = 0; count < 16 && i < LN_TILE_GATHER && i < row_len; i++) {
        memset((char *)g->groups[i] + (size_t)count * size, 0, (size_t)(16 - count) * size);
    }
}

/* The view of rows row .. row + count of block `block` in an array walked over extent. */
static LN_ALWAYS_INLINE tile_view tile_view_of(ln_dtype dtype, const ln_array *array, const ln_extent *extent,
                                               ptrdiff_t block, ptrdiff_t row, int count)
{
    tile_view t = {NULL, 0, 0, 0, 0, 0};
    if (array->data) {
        t.first = ln_block_row_address(array, block, row);
        t.row_step = array->walk.row_step;
        t.elem_step = array->walk.elem_step;
        t.row_len = extent->row_len;
        t.adjacent = count == LN_TILE_ROWS && t.row_step == (ptrdiff_t)ln_dtype_size(dtype);
        t.prefetch = t.adjacent && row + LN_TILE_PREFETCH * LN_TILE_ROWS < extent->rows;
    }
    return t;
}

/* Element j of the tile's `count` rows as 16 consecutive elements: in memory where they are
   adjacent, else in `gathered` (elements j on gathered there first, unless they are: a copy,
   which a caller writing those rows' memory through another view must empty).
   Each element of a tile is a cache line of its own (channels-first rows: H*W elements
   apart), more lines at once than the hardware prefetchers follow, so the line of a tile
   LN_TILE_PREFETCH further on is asked for now.  `adjacent`: the caller knows t's rows are
   adjacent, a constant 1 in the instance that serves that case (its loops then test nothing). */
static LN_ALWAYS_INLINE const void *tile_load(ln_dtype dtype, const tile_view *t, int count, ptrdiff_t j,
                                              tile_gathered *gathered, int adjacent)
{
    const char *from = t->first + j * t->elem_step;
    const size_t size = ln_dtype_size(dtype);
    if (adjacent || t->adjacent) {
        if (t->prefetch) {
            __builtin_prefetch(from + LN_TILE_PREFETCH * LN_TILE_ROWS * size, 0, LN_TILE_PREFETCH_LOCALITY);
        }
        return from;
    }
    if (j < gathered->begin || j >= gathered->end) {
        gathered->begin = j;
        gathered->end = t->row_len - j < LN_TILE_GATHER ? t->row_len : j + LN_TILE_GATHER;
        const ptrdiff_t elements = gathered->end - j;
        for (ptrdiff_t i = 0; i < elements; i++) {
            const char *element = from + i * t->elem_step;
            char *group = (char *)gathered->groups[i];
            for (int k = 0; k < count; k++) {
                memcpy(group + (size_t)k * size, element + k * t->row_step, size);
            }
        }
    }
    return gathered->groups[j - gathered->begin];
}

/* Where element j of the tile's rows is to be written as 16 consecutive elements: in memory
   where they are adjacent (and the line LN_TILE_PREFETCH tiles on asked for, to be written:
   see tile_load), else lanes, for tile_scatter. */
static LN_ALWAYS_INLINE void *tile_target(ln_dtype dtype, const tile_view *t, ptrdiff_t j, void *lanes, int adjacent)
{
    char *to = t->first + j * t->elem_step;
    if (t->prefetch) {
        __builtin_prefetch(to + LN_TILE_PREFETCH * LN_TILE_ROWS * ln_dtype_size(dtype), 1, LN_TILE_PREFETCH_LOCALITY);
    }
    return adjacent || t->adjacent ? to : lanes;
}

/* Element j of the tile's `count` rows out of lanes, unless tile_target put it in place. */
static LN_ALWAYS_INLINE void tile_scatter(ln_dtype dtype, const tile_view *t, int count, ptrdiff_t j,
                                          const void *lanes, int adjacent)
{
    char *to = t->first + j * t->elem_step;
    const size_t size = ln_dtype_size(dtype);
    if (adjacent || t->adjacent) {
        return;
    }
    for (int k = 0; k < count; k++) {
        memcpy(to + k * t->row_step, (const char *)lanes + (size_t)k * size, size);
    }
}

/* A forward tile's arrays, and apart from them (so that the views, never stored through,
   stay in registers), the elements gathered from x and the residual (tile_load) and lane
   buffers of 16 elements of any type for those scattered to sum and y (tile_target). */
typedef struct {
    int count;
    tile_view x, residual, sum, y;
} forward_tile_arrays;

typedef struct {
    tile_gathered x, residual;
    double sum[16], y[16];
} forward_tile_lanes;

/* Element j of a forward tile's rows as float64 lanes: the input's (copied to staged[j], a
   group each, where staged is not NULL), or with a residual their sum, written to `sum` on the
   way. */
static LN_ALWAYS_INLINE gd forward_tile_values(ln_dtype dtype, const forward_tile_arrays *t,
                                               forward_tile_lanes *lanes, ptrdiff_t j, int adjacent, char *staged)
{
    if (!t->residual.first) {
        const void *group = tile_load(dtype, &t->x, t->count, j, &lanes->x, adjacent);
        if (staged) {
            memcpy(staged + j * group_bytes_of(dtype), group, (size_t)group_bytes_of(dtype));
        }
        return load_as_f64(dtype, group, 0);
    }
    void *target = tile_target(dtype, &t->sum, j, lanes->sum, adjacent);
    add_group(dtype, tile_load(dtype, &t->x, t->count, j, &lanes->x, adjacent),
              tile_load(dtype, &t->residual, t->count, j, &lanes->residual, adjacent), target, 0);
    tile_scatter(dtype, &t->sum, t->count, j, target, adjacent);
    return load_as_f64(dtype, target, 0);
}

/* A forward tile's running sums over a chunk of its rows' elements, per lane: about the
   chunk's first element (shift; 0 for RMSNorm), the deviations and their squares. */
typedef struct {
    gd shift, s1, s2;
} tile_sums;

static LN_ALWAYS_INLINE tile_sums tile_sums_start(void)
{
    const gd zero_v = gd_splat(0.0);
    return (tile_sums){zero_v, zero_v, zero_v};
}

/* s with the chunk's next element added (first: it is the chunk's first). */
static LN_ALWAYS_INLINE tile_sums tile_sums_add(ln_norm_kind kind, tile_sums s, gd value, int first)
{
    const int has_mean = kind == LN_NORM_LAYER;
    const gd shift = has_mean && first ? value : s.shift;
    const gd d = has_mean ? gd_sub(value, shift) : value;
    return (tile_sums){shift, has_mean ? gd_add(s.s1, d) : s.s1, gd_fma(d, d, s.s2)};
}

/* The moments of a chunk of len elements from its sums, as chunk_moments computes them. */
static LN_ALWAYS_INLINE void tile_sums_moments(ln_norm_kind kind, const tile_sums *s, ptrdiff_t len,
                                               double means[16], double m2s[16])
{
    const int has_mean = kind == LN_NORM_LAYER;
    const gd mean_offset = gd_div(s->s1, gd_splat((double)len));
    gd_store(means, has_mean ? gd_add(s->shift, mean_offset) : gd_splat(0.0));
    gd_store(m2s, has_mean ? gd_sub(s->s2, gd_mul(s->s1, mean_offset)) : s->s2);
}

/* The moments of elements [start, start + len) of a forward tile's rows, per lane. */
static LN_ALWAYS_INLINE void forward_tile_chunk(ln_norm_kind kind, ln_dtype dtype, const forward_tile_arrays *t,
                                                forward_tile_lanes *lanes, int adjacent, char *staged,
                                                ptrdiff_t start, ptrdiff_t len, double means[16], double m2s[16])
{
    tile_sums sums = tile_sums_start();
    for (ptrdiff_t j = start; j < start + len; j++) {  /* the first element in the loop: one copy of it */
        sums = tile_sums_add(kind, sums, forward_tile_values(dtype, t, lanes, j, adjacent, staged), j == start);
    }
    tile_sums_moments(kind, &sums, len, means, m2s);
}

/* A forward tile's statistics per lane into means and rstds: chunk by chunk, the chunks
   merged by ln_merge, rstd by lane_rstds. */
static LN_ALWAYS_INLINE void forward_tile_statistics(ln_norm_kind kind, ln_dtype dtype, const forward_tile_arrays *t,
                                                     forward_tile_lanes *lanes, int adjacent, char *staged,
                                                     ptrdiff_t n, double eps, double means[16], double rstds[16])
{
    double m2s[16];
    for (ptrdiff_t start = 0; start < n; start += LN_CHUNK) {  /* one loop: one inlined copy */
        const ptrdiff_t len = n - start < LN_CHUNK ? n - start : LN_CHUNK;
        double chunk_means[16], chunk_m2s[16];
        forward_tile_chunk(kind, dtype, t, lanes, adjacent, staged, start, len, chunk_means, chunk_m2s);
        for (int k = 0; k < 16; k++) {
            const ln_moments chunk = {(double)len, chunk_means[k], chunk_m2s[k]};
            const ln_moments m = start == 0 ? chunk : ln_merge((ln_moments){(double)start, means[k], m2s[k]}, chunk);
            means[k] = m.mean;
            m2s[k] = m.m2;
        }
    }
    lane_rstds(n, eps, means, m2s, rstds);
}

/* A statistic of each of the tile's `count` rows out, where wanted (view absent: not). */
static LN_ALWAYS_INLINE void tile_store_stats(ln_dtype dtype, const tile_view *t, int count, const double values[16])
{
    for (int k = 0; t->first && k < count; k++) {
        ln_store1_param(dtype, t->first + k * t->row_step, 0, values[k]);
    }
}

/* The output of a tile's `count` rows from row `first` of the call on, one row at a time: a
   row that needs it by ln_forward_exact_row, the others by normalize_one's arithmetic, each
   lane's own, which gives the tile's vector loop's bits; statistics included.  For the rare
   tiles holding such a row: the vector loop would write every lane, and the output may be
   the input. */
static void forward_tile_rows(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a, const ln_array *source,
                              ptrdiff_t first, int count, const double means[16], const double rstds[16],
                              const ln_rstd_bounds *bounds)
{
    const ptrdiff_t n = a->extent.row_len, param_size = (ptrdiff_t)ln_param_size(dtype);
    const ptrdiff_t x_step = source->walk.elem_step, y_step = a->output.walk.elem_step;
    const char *weight = a->weight, *bias = kind == LN_NORM_LAYER ? a->bias : NULL;
    for (int k = 0; k < count; k++) {
        if (ln_row_needs_exact(means[k], rstds[k], bounds)) {
            ln_forward_exact_row(a, source, first + k);
            continue;
        }
        ln_store_stats(a, first + k, means[k], rstds[k]);
        const row_norm row = row_norm_of(dtype, means[k], rstds[k]);
        const char *x = ln_row_address(source, &a->extent, first + k);
        char *y = ln_row_address(&a->output, &a->extent, first + k);
        for (ptrdiff_t j = 0; j < n; j++) {
            const char *w_j = weight ? weight + j * param_size : NULL, *b_j = bias ? bias + j * param_size : NULL;
            if (output_in_f64(dtype, n)) {  /* the vector loop's float64 arithmetic, rounded once */
                const double value_x = ln_load1_as_f64(dtype, x + j * x_step, 0);
                const double centred = kind == LN_NORM_RMS ? value_x : value_x - means[k];
                const double scale = w_j ? ln_load1_param_as_f64(dtype, w_j, 0) * rstds[k] : rstds[k];
                const double bias_j = b_j ? ln_load1_param_as_f64(dtype, b_j, 0) : ln_absent_bias(kind);
                ln_store1_from_f64(dtype, y + j * y_step, 0, fma(centred, scale, bias_j));
            }
            else {
                normalize_one(kind, dtype, &row, x + j * x_step, y + j * y_step, 0, w_j, b_j);
            }
        }
    }
}

/* Whether a call's forward tiles have their output loop read x from the copy the statistics'
   pass staged in L1 (forward_tile_values) rather than from x: where the loop's loads of x
   would wait on its stores to y, the load of group j + k falling, for half or more of
   k = 1 .. 8, on the 4 KiB page offsets of group j stored just before it, which the CPU takes
   for a possible overlap until the store has gone (4K aliasing).  Channel strides of a power
   of two bytes, x and y at the same page offset, do that, in place above all: (24, 64, 32, 32)
   in place, one thread, Zen 4: float32 1.28-1.35 -> 0.83-0.85 ms, float64 1.30-1.42 -> 0.92-0.95,
   float16 0.68 -> 0.59; the staging costs 3-8% where nothing aliases.  x and y walked alike
   keep the same distance in every tile. */
static LN_ALWAYS_INLINE int tiles_output_staged(ln_dtype dtype, const ln_forward_args *a)
{
    const ln_walk *x = &a->input.walk, *y = &a->output.walk;
    const ptrdiff_t group_bytes = group_bytes_of(dtype);
    if (a->residual.data || x->block_step != y->block_step || x->row_step != y->row_step ||
        x->elem_step != y->elem_step || a->extent.row_len > LN_TILE_STAGE_BYTES / group_bytes) {
        return 0;
    }
    int aliased = 0;
    for (ptrdiff_t k = 1; k <= 8; k++) {
        const uintptr_t offset = ((uintptr_t)a->input.data + (uintptr_t)k * (uintptr_t)x->elem_step -
                                  (uintptr_t)a->output.data) % LN_ALIAS_PERIOD;
        aliased += offset < (uintptr_t)group_bytes || offset > LN_ALIAS_PERIOD - (uintptr_t)group_bytes;
    }
    return aliased >= 4;
}

/* A forward tile's buffers made ready for its views (only tiles whose rows are not adjacent
   use them). */
static LN_ALWAYS_INLINE void forward_tile_lanes_init(forward_tile_lanes *buffers, ln_dtype dtype, int count,
                                                     ptrdiff_t row_len, int adjacent)
{
    if (!adjacent) {
        tile_gathered_init(&buffers->x, dtype, count, row_len);
        tile_gathered_init(&buffers->residual, dtype, count, row_len);
        memset(buffers->sum, 0, sizeof buffers->sum);
        memset(buffers->y, 0, sizeof buffers->y);
    }
}

/* What a tile's output loop sums of the tile after it (forward_tile_output's `next`): that
   tile's rows, adjacent, of at most LN_CHUNK elements, and its statistics. */
typedef struct {
    const tile_view *x;
    double means[16], rstds[16];
} forward_next_tile;

/* Element j of a tile's rows out, from its group of x to the target of y: normalize_one's
   float32 arithmetic, each lane with its row's constants. */
static LN_ALWAYS_INLINE void tile_output_group(ln_norm_kind kind, ln_dtype dtype, const lane_norm *lanes,
                                               const void *weight, const void *bias, ptrdiff_t j,
                                               const void *group, void *target)
{
    const gf value_x = load_as_f32(dtype, group, 0);
    const gf centred = kind == LN_NORM_LAYER ? gf_sub(gf_sub(value_x, lanes->mean_hi), lanes->mean_lo) : value_x;
    const gf scale = weight ? gf_mul(gf_splat(((const float *)weight)[j]), lanes->scale) : lanes->scale;
    const gf offset = gf_splat(bias ? ((const float *)bias)[j] : (float)ln_absent_bias(kind));
    store_from_f32(dtype, target, 0, gf_fma(centred, scale, offset), 1);
}

/* forward_tile_output's loop with `next`: the output of a tile whose views are all adjacent
   (source: its rows normalized, y: its output) and the statistics of the next tile, in one
   loop over the elements, through pointers kept in registers (the views' fields, read
   through pointers, would be read again after every store). */
static LN_ALWAYS_INLINE void forward_tile_output_with_next(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                                           const tile_view *source, const tile_view *y_view,
                                                           const lane_norm *lanes, forward_next_tile *next)
{
    const ptrdiff_t n = a->extent.row_len;
    const ptrdiff_t ahead = LN_TILE_PREFETCH * LN_TILE_ROWS * (ptrdiff_t)ln_dtype_size(dtype);
    const void *weight = a->weight, *bias = kind == LN_NORM_LAYER ? a->bias : NULL;
    const char *x = source->first, *x_next = next->x->first;
    char *y = y_view->first;
    const ptrdiff_t x_step = source->elem_step, next_step = next->x->elem_step, y_step = y_view->elem_step;
    const int prefetch_next = next->x->prefetch, prefetch_y = y_view->prefetch;
    tile_sums sums = tile_sums_start();
    for (ptrdiff_t j = 0; j < n; j++, x += x_step, x_next += next_step, y += y_step) {
        if (prefetch_next) {
            __builtin_prefetch(x_next + ahead, 0, LN_TILE_PREFETCH_LOCALITY);
        }
        sums = tile_sums_add(kind, sums, load_as_f64(dtype, x_next, 0), j == 0);
        if (prefetch_y) {
            __builtin_prefetch(y + ahead, 1, LN_TILE_PREFETCH_LOCALITY);
        }
        tile_output_group(kind, dtype, lanes, weight, bias, j, x, y);
    }
    double m2s[16];
    tile_sums_moments(kind, &sums, n, next->means, m2s);
    lane_rstds(n, a->eps, next->means, m2s, next->rstds);
}

/* A forward tile's statistics out, then its output (see forward_tile_from_views for `adjacent`
   and `staged`), from its statistics per lane.  With `next` (see forward_tiles_pipelined), the
   output's loop also sums the next tile's elements, into next's statistics, and returns 1; it
   returns 0 where it did not (rows that need ln_forward_exact_row, float64 arithmetic). */
static LN_ALWAYS_INLINE int forward_tile_output(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                                const ln_rstd_bounds *bounds, const forward_tile_arrays *t,
                                                ptrdiff_t block, ptrdiff_t row, int adjacent, char *staged,
                                                forward_tile_lanes *buffers, const double means[16],
                                                const double rstds[16], forward_next_tile *next)
{
    const ptrdiff_t n = a->extent.row_len;
    const int has_mean = kind == LN_NORM_LAYER, count = t->count;
    const ptrdiff_t group_bytes = group_bytes_of(dtype);
    int exact_rows = 0;
    for (int k = 0; k < count; k++) {
        exact_rows |= ln_row_needs_exact(means[k], rstds[k], bounds);
    }
    const ln_array *source_rows = a->residual.data ? &a->sum : &a->input;  /* the rows normalized */
    if (exact_rows) {
        forward_tile_rows(kind, dtype, a, source_rows, block * a->extent.rows + row, count, means, rstds, bounds);
        return 0;
    }
    const tile_view mean_out = tile_view_of(dtype, &a->mean, &a->extent, block, row, count);
    const tile_view rstd_out = tile_view_of(dtype, &a->rstd, &a->extent, block, row, count);
    tile_store_stats(dtype, &mean_out, count, means);
    tile_store_stats(dtype, &rstd_out, count, rstds);

    const tile_view *source = a->residual.data ? &t->sum : &t->x;
    const void *weight = a->weight, *bias = has_mean ? a->bias : NULL;
    buffers->x.begin = buffers->x.end = 0;  /* source's elements, which may be sum's, gathered afresh */
    if (output_in_f64(dtype, n)) {
        const gd mean_v = gd_load(means), rstd_v = gd_load(rstds);
        for (ptrdiff_t j = 0; j < n; j++) {
            const void *group = staged ? staged + j * group_bytes
                                       : tile_load(dtype, source, count, j, &buffers->x, adjacent);
            const gd value_x = load_as_f64(dtype, group, 0);
            const gd centred = has_mean ? gd_sub(value_x, mean_v) : value_x;
            const gd scale = weight ? gd_mul(gd_splat(ln_load1_param_as_f64(dtype, weight, j)), rstd_v) : rstd_v;
            const gd offset = gd_splat(bias ? ln_load1_param_as_f64(dtype, bias, j) : ln_absent_bias(kind));
            void *target = tile_target(dtype, &t->y, j, buffers->y, adjacent);
            store_from_f64(dtype, target, gd_fma(centred, scale, offset));
            tile_scatter(dtype, &t->y, count, j, target, adjacent);
        }
        return 0;
    }
    const lane_norm lanes = lane_norm_of(means, rstds);
    if (next) {
        forward_tile_output_with_next(kind, dtype, a, source, &t->y, &lanes, next);
        return 1;
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        const void *group = staged ? staged + j * group_bytes
                                   : tile_load(dtype, source, count, j, &buffers->x, adjacent);
        void *target = tile_target(dtype, &t->y, j, buffers->y, adjacent);
        tile_output_group(kind, dtype, &lanes, weight, bias, j, group, target);
        tile_scatter(dtype, &t->y, count, j, target, adjacent);
    }
    return 0;
}

/* forward_tile's work once its views are made (see tile_load for `adjacent`; `staged`, NULL
   or LN_TILE_STAGE_BYTES for the output loop to read x from, see tiles_output_staged). */
static LN_ALWAYS_INLINE void forward_tile_from_views(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                                     const ln_rstd_bounds *bounds, const forward_tile_arrays *t,
                                                     ptrdiff_t block, ptrdiff_t row, int adjacent, char *staged)
{
    forward_tile_lanes buffers;
    forward_tile_lanes_init(&buffers, dtype, t->count, a->extent.row_len, adjacent);
    double means[16], rstds[16];
    forward_tile_statistics(kind, dtype, t, &buffers, adjacent, staged, a->extent.row_len, a->eps, means, rstds);
    forward_tile_output(kind, dtype, a, bounds, t, block, row, adjacent, staged, &buffers, means, rstds, NULL);
}

/* The views of tile `tile`'s arrays, and its block and first row there. */
static LN_ALWAYS_INLINE forward_tile_arrays forward_tile_views(ln_dtype dtype, const ln_forward_args *a,
                                                               ptrdiff_t tile, ptrdiff_t *block, ptrdiff_t *row)
{
    int count;
    ln_tile_of(&a->extent, tile, block, row, &count);
    return (forward_tile_arrays){
        .count = count,
        .x = tile_view_of(dtype, &a->input, &a->extent, *block, *row, count),
        .residual = tile_view_of(dtype, &a->residual, &a->extent, *block, *row, count),
        .sum = tile_view_of(dtype, &a->sum, &a->extent, *block, *row, count),
        .y = tile_view_of(dtype, &a->output, &a->extent, *block, *row, count),
    };
}

/* Whether every view of a tile has its rows adjacent (channels-first arrays). */
static LN_ALWAYS_INLINE int forward_tile_adjacent(const forward_tile_arrays *t)
{
    return t->x.adjacent && t->y.adjacent && (!t->residual.first || (t->residual.adjacent && t->sum.adjacent));
}

/* Tile `tile` forward: statistics per lane (summing the residual into `sum` on the way),
   the statistics out, then the output.  The common case, channels-first arrays (every view
   adjacent), runs in an instance of its own (0.8x the time on (8, 64, 56, 56) float32, one
   thread, AMD Zen 4). */
static LN_ALWAYS_INLINE void forward_tile(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *a,
                                          const ln_rstd_bounds *bounds, ptrdiff_t tile, char *staged)
{
    ptrdiff_t block, row;
    const forward_tile_arrays t = forward_tile_views(dtype, a, tile, &block, &row);
    if (t.count > LN_TILE_ROWS) {
        /* what ln_tile_of says: without it GCC 12 left the loops over a gathered tile's lanes
           rolled ((200000, 8) over axis 0, one thread: 1.1x the time) */
        __builtin_unreachable();
    }
    if (forward_tile_adjacent(&t)) {
        forward_tile_from_views(kind, dtype, a, bounds, &t, block, row, 1, staged);
    }
    else {
        forward_tile_from_views(kind, dtype, a, bounds, &t, block, row, 0, NULL);
    }
}

/* Tiles [begin, end) of a call forward, `staged` as forward_tile_from_views takes it: NULL, or
   (in a function of its own, forward_tiles_staged_*, whose code would slow this loop's by 3-5%
   if they shared a function) LN_TILE_STAGE_BYTES of its caller's stack. */
static LN_ALWAYS_INLINE void forward_tiles(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *args,
                                           const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end,
                                           char *staged)
{
    const ln_forward_args copy = *args, *a = &copy;  /* see forward_rows */
    assert(a && a->input.data && a->output.data && a->extent.row_len >= 1);
    assert(0 <= begin && begin <= end && end <= ln_tiles_of(&a->extent));
    for (ptrdiff_t tile = begin; tile < end; tile++) {
        forward_tile(kind, dtype, a, bounds, tile, staged);
    }
}

/* Whether a call's tiles go pipelined (forward_tiles_pipelined): rows of at most LN_CHUNK
   elements, x's and y's rows adjacent (a block's full tiles have every view adjacent), no
   residual, and no staging (tiles_output_staged). */
static LN_ALWAYS_INLINE int tiles_pipelined(ln_dtype dtype, const ln_forward_args *a)
{
    const ptrdiff_t size = (ptrdiff_t)ln_dtype_size(dtype);
    return !a->residual.data && a->extent.row_len <= LN_CHUNK && a->extent.rows >= LN_TILE_ROWS &&
           a->input.walk.row_step == size && a->output.walk.row_step == size && !tiles_output_staged(dtype, a);
}

/* forward_tiles, pipelined: the output loop of a tile also sums the next tile's elements
   (forward_tile_output_with_next).  A tile's statistics alone are a chain of dependent
   additions a group, ending in divisions and a square root that its output waits for; beside
   another tile's output they cost little ((8, 64, 56, 56) float32 over C, one thread, Zen 4:
   0.68-0.77x the time).  Each lane's arithmetic is the same either way: the same bits.  In a
   function of its own: forward_tiles' gathering loops, sharing one with it, took 1.1x the time
   ((200000, 8) over axis 0). */
static LN_ALWAYS_INLINE void forward_tiles_pipelined(ln_norm_kind kind, ln_dtype dtype, const ln_forward_args *args,
                                                     const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end)
{
    const ln_forward_args copy = *args, *a = &copy;  /* see forward_rows */
    assert(a && a->input.data && a->output.data && a->extent.row_len >= 1 && tiles_pipelined(dtype, a));
    assert(0 <= begin && begin <= end && end <= ln_tiles_of(&a->extent));
    forward_next_tile next;
    int have_next = 0;  /* next holds this tile's statistics */
    for (ptrdiff_t tile = begin; tile < end; tile++) {
        ptrdiff_t block, row;
        const forward_tile_arrays t = forward_tile_views(dtype, a, tile, &block, &row);
        if (!forward_tile_adjacent(&t)) {  /* a block's last tile, of fewer rows */
            forward_tile_from_views(kind, dtype, a, bounds, &t, block, row, 0, NULL);
            have_next = 0;
            continue;
        }
        forward_tile_lanes buffers;  /* unused: every view adjacent */
        double means[16], rstds[16];
        if (have_next) {
            memcpy(means, next.means, sizeof means);
            memcpy(rstds, next.rstds, sizeof rstds);
        }
        else {
            forward_tile_statistics(kind, dtype, &t, &buffers, 1, NULL, a->extent.row_len, a->eps, means, rstds);
        }
        ptrdiff_t next_block, next_row;
        const forward_tile_arrays after = tile + 1 < end ? forward_tile_views(dtype, a, tile + 1, &next_block, &next_row)
                                                         : (forward_tile_arrays){0};
        if (tile + 1 < end && forward_tile_adjacent(&after)) {
            next.x = &after.x;
            have_next = forward_tile_output(kind, dtype, a, bounds, &t, block, row, 1, NULL, &buffers, means, rstds,
                                            &next);
        }
        else {
            have_next = forward_tile_output(kind, dtype, a, bounds, &t, block, row, 1, NULL, &buffers, means, rstds,
                                            NULL);
        }
    }
}

/* A set of a tile's lanes: bit k for lane k. */
#define LN_ALL_LANES 0xffffu

/* chosen's lanes in `lanes`, other's elsewhere.  Through memory: only tiles whose lanes go
   two ways take it. */
static LN_ALWAYS_INLINE gd gd_lanes_from(gd chosen, gd other, unsigned lanes)
{
    double values[16], others[16];
    gd_store(values, chosen);
    gd_store(others, other);
    for (int k = 0; k < 16; k++) {
        values[k] = lanes >> k & 1u ? values[k] : others[k];
    }
    return gd_load(values);
}

/* v with the lanes outside `lanes` +0.0: a term those lanes must not add to their sums
   (adding +0.0 leaves a sum's bits as they are, and no sum is -0.0: each starts as +0.0). */
static LN_ALWAYS_INLINE gd gd_lanes_only(gd v, unsigned lanes)
{
    return gd_lanes_from(v, gd_splat(0.0), lanes);
}

/* A column's sums from one tile: its term's lanes, each started at +0.0 as a block's lanes
   are, added by ln_sum_lanes' tree, so the bits a block of this one tile would give. */
static LN_ALWAYS_INLINE double gd_one_tile_sum(gd term)
{
    double lanes[16];
    gd_store(lanes, gd_add(gd_splat(0.0), term));
    return ln_sum_lanes(lanes);
}

/* A term of column j into a tile's parameter sums: added into its lanes at sums[16 j ..],
   or with one_tile (a block of one tile, which sums its lanes itself) its lanes' sum stored
   at sums[j]. */
static LN_ALWAYS_INLINE void tile_add_term(double *sums, ptrdiff_t j, gd term, int one_tile)
{
    if (one_tile) {
        sums[j] = gd_one_tile_sum(term);
    }
    else {
        gd_store(sums + 16 * j, gd_add(gd_load(sums + 16 * j), term));
    }
}

/* What a backward pass over a tile's elements keeps where its rows are not adjacent: dy's and
   x's elements gathered (tile_load), and dx's group of 16 until tile_scatter writes it. */
typedef struct {
    tile_gathered dy, x;
    double dx[16];  /* 16 elements of any type, for tile_target */
} tile_backward_lanes;

static LN_ALWAYS_INLINE void tile_backward_lanes_init(tile_backward_lanes *b, ln_dtype dtype, int count,
                                                      ptrdiff_t row_len, int adjacent)
{
    if (!adjacent) {
        tile_gathered_init(&b->dy, dtype, count, row_len);
        tile_gathered_init(&b->x, dtype, count, row_len);
        memset(b->dx, 0, sizeof b->dx);
    }
}

/* backward_tile's work in float64, once its views are made (see tile_load for `adjacent`), for
   the lanes in `lanes` (LN_ALL_LANES: every lane): the others' dx is left as it is and their
   terms are not added. */
static LN_ALWAYS_INLINE void backward_tile_from_views(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                                      const tile_view *dy, const tile_view *x, const tile_view *dx,
                                                      int count, const double means[16], const double rstds[16],
                                                      int adjacent, double *dweight_lanes, double *dbias_lanes,
                                                      int one_tile, unsigned lanes)
{
    const ptrdiff_t n = a->extent.row_len;
    const int has_mean = kind == LN_NORM_LAYER;
    const void *weight = a->weight;
    tile_backward_lanes buffers;
    tile_gathered dx_kept;
    tile_backward_lanes_init(&buffers, dtype, count, n, adjacent);
    if (!adjacent) {
        tile_gathered_init(&dx_kept, dtype, count, n);
    }
    const gd mean_v = gd_load(means), rstd_v = gd_load(rstds), zero_v = gd_splat(0.0);
    const int in_range = centred_in_range(kind, dtype, mean_v);
    gd g_mean = zero_v, gx_mean = zero_v;
    if (dx->first) {
        gd g_sum = zero_v, gx_sum = zero_v;
        for (ptrdiff_t j = 0; j < n; j++) {
            const gd dy_v = load_as_f64(dtype, tile_load(dtype, dy, count, j, &buffers.dy, adjacent), 0);
            const gd value_x = load_as_f64(dtype, tile_load(dtype, x, count, j, &buffers.x, adjacent), 0);
            const gd xhat = xhat_lanes(kind, value_x, mean_v, rstd_v, in_range);
            const gd g = weight ? gd_mul(dy_v, gd_splat(ln_load1_param_as_f64(dtype, weight, j))) : dy_v;
            g_sum = has_mean ? gd_add(g_sum, g) : g_sum;
            gx_sum = gd_add(gx_sum, gd_mul(g, xhat));
        }
        const gd n_v = gd_splat((double)n);
        g_mean = gd_div(g_sum, n_v);
        gx_mean = gd_div(gx_sum, n_v);
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        const gd dy_v = load_as_f64(dtype, tile_load(dtype, dy, count, j, &buffers.dy, adjacent), 0);
        const gd value_x = load_as_f64(dtype, tile_load(dtype, x, count, j, &buffers.x, adjacent), 0);
        const gd xhat = xhat_lanes(kind, value_x, mean_v, rstd_v, in_range);
        if (dx->first) {
            const gd g = weight ? gd_mul(dy_v, gd_splat(ln_load1_param_as_f64(dtype, weight, j))) : dy_v;
            const gd inner = gd_sub(has_mean ? gd_sub(g, g_mean) : g, gd_mul(xhat, gx_mean));
            gd value = gd_quiet_nans(gd_mul(inner, rstd_v));  /* a NaN the one quiet NaN */
            if (lanes != LN_ALL_LANES) {  /* the other lanes' dx as it is (exact both ways) */
                const gd kept = load_as_f64(dtype, tile_load(dtype, dx, count, j, &dx_kept, adjacent), 0);
                value = gd_lanes_from(value, kept, lanes);
            }
            void *target = tile_target(dtype, dx, j, buffers.dx, adjacent);
            store_from_f64(dtype, target, value);
            tile_scatter(dtype, dx, count, j, target, adjacent);
        }
        if (dweight_lanes) {
            const gd term = gd_mul(dy_v, xhat);
            tile_add_term(dweight_lanes, j, lanes == LN_ALL_LANES ? term : gd_lanes_only(term, lanes), one_tile);
        }
        if (dbias_lanes) {
            tile_add_term(dbias_lanes, j, lanes == LN_ALL_LANES ? dy_v : gd_lanes_only(dy_v, lanes), one_tile);
        }
    }
}

/* A float32 tile's pass 1 term at element j into the even or odd accumulators (see
   backward_tile_f32). */
static LN_ALWAYS_INLINE void tile_grad_sums_term(ln_norm_kind kind, ln_dtype dtype, const tile_view *dy,
                                                 const tile_view *x, int count, ptrdiff_t j, const float *weight,
                                                 tile_backward_lanes *buffers, int adjacent, gf mean_v,
                                                 gf *sum_g, gf *sum_gc, grad_tops *tops)
{
    const gf dy_v = load_as_f32(dtype, tile_load(dtype, dy, count, j, &buffers->dy, adjacent), 0);
    const gf g = weight ? gf_mul(dy_v, gf_splat(weight[j])) : dy_v;
    const gf value_x = load_as_f32(dtype, tile_load(dtype, x, count, j, &buffers->x, adjacent), 0);
    grad_sums_terms(kind, dy_v, g, value_x, weight != NULL, TOPS_OF_LANES, mean_v, sum_g, sum_gc, tops);
}

/* The lanes (of the first count) of a float32 tile that fail ln_backward_exact_row's test,
   applied to the tile's own sums (whose order differs from a contiguous row's): the scalar
   test, for the tiles whose lanes the vector test of the common rows did not all pass (a
   row whose dy is all 0.0, or a factor with a zero operand, passes this one). */
static LN_ALWAYS_INLINE unsigned tile_lanes_need_exact(ln_dtype dtype, int count, gd rstd, gd g_mean, gd gx_mean,
                                                       const gd tops[LN_LARGEST_COUNT])
{
    double lanes[3 + LN_LARGEST_COUNT][16];
    gd_store(lanes[0], rstd);
    gd_store(lanes[1], g_mean);
    gd_store(lanes[2], gx_mean);
    for (int i = 0; i < LN_LARGEST_COUNT; i++) {
        gd_store(lanes[3 + i], tops[i]);
    }
    unsigned exact = 0;
    for (int k = 0; k < count; k++) {
        double largest[LN_LARGEST_COUNT];
        for (int i = 0; i < LN_LARGEST_COUNT; i++) {
            largest[i] = lanes[3 + i][k];
        }
        exact |= (unsigned)ln_grad_row_needs_exact(dtype, lanes[0][k], lanes[1][k], lanes[2][k], largest) << k;
    }
    return exact;
}

/* A float32 tile's lane constants for pass 2 (see backward_tile_f32). */
typedef struct {
    gf mean, rstd, xc_scale, offset;
} tile_f32_factors;

/* backward_tile_f32's pass 2: dx of every lane, the terms of dweight and dbias of the lanes
   in `terms` (LN_ALL_LANES, a constant in the instance of the tiles whose lanes all go in
   float32: every lane, with nothing to mask). */
static LN_ALWAYS_INLINE void backward_tile_f32_pass2(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                                     const tile_view *dy, const tile_view *x, const tile_view *dx,
                                                     int count, tile_f32_factors f, int adjacent,
                                                     double *dweight_lanes, double *dbias_lanes, int one_tile,
                                                     tile_backward_lanes *buffers, unsigned terms)
{
    const ptrdiff_t n = a->extent.row_len;
    const int want_dx = dx->first != NULL;
    const float *weight = a->weight;
    for (ptrdiff_t j = 0; j < n; j++) {
        const gf dy_v = load_as_f32(dtype, tile_load(dtype, dy, count, j, &buffers->dy, adjacent), 0);
        const gf value_x = load_as_f32(dtype, tile_load(dtype, x, count, j, &buffers->x, adjacent), 0);
        const gf xc = kind == LN_NORM_LAYER ? gf_sub(value_x, f.mean) : value_x;
        if (want_dx) {
            const gf g = weight ? gf_mul(dy_v, gf_splat(weight[j])) : dy_v;
            void *target = tile_target(dtype, dx, j, buffers->dx, adjacent);
            store_from_f32(dtype, target, 0, grad_dx(kind, g, xc, f.rstd, f.xc_scale, f.offset), 1);
            tile_scatter(dtype, dx, count, j, target, adjacent);
        }
        if (dweight_lanes) {
            const gd term = gf_widen(gf_mul(gf_mul(dy_v, xc), f.rstd));
            tile_add_term(dweight_lanes, j, terms == LN_ALL_LANES ? term : gd_lanes_only(term, terms), one_tile);
        }
        if (dbias_lanes) {
            const gd term = gf_widen(dy_v);
            tile_add_term(dbias_lanes, j, terms == LN_ALL_LANES ? term : gd_lanes_only(term, terms), one_tile);
        }
    }
}

/* What pass 1 of a float32 tile sums (see backward_tile_f32): in float64, the blocks' sums of
   g and g * (x - mean), and the running maxima. */
typedef struct {
    gd g_sum, gc_sum;
    grad_tops tops;
} tile_grad_sums;

/* Sixteen float64 lanes as float32 lanes (a tile's means, rstds and pass 2 factors). */
static LN_ALWAYS_INLINE gf tile_f32_lanes(const double values[16])
{
    float lanes[16];
    for (int k = 0; k < 16; k++) {
        lanes[k] = (float)values[k];
    }
    return gf_load(lanes);
}

/* The end of a float32 tile's pass 1: the lanes that need float64 (returned) and, unless all
   of them do, every lane's pass 2 factors in *factors. */
static LN_ALWAYS_INLINE unsigned tile_f32_factors_of(ln_norm_kind kind, ln_dtype dtype, int count, ptrdiff_t n,
                                                     const double means[16], const double rstds[16],
                                                     const tile_grad_sums *sums, tile_f32_factors *factors)
{
    const gd n_v = gd_splat((double)n), rstd = gd_load(rstds), neg_rstd = gd_sub(gd_splat(0.0), rstd);
    const gd g_mean = gd_div(sums->g_sum, n_v), gx_mean = gd_div(gd_mul(sums->gc_sum, rstd), n_v);
    const gd xc_scale = gd_mul(gd_mul(neg_rstd, rstd), gx_mean), offset = gd_mul(neg_rstd, g_mean);
    const gd widened[LN_LARGEST_COUNT] = {[LN_LARGEST_G] = gf_widen(sums->tops.g),
                                           [LN_LARGEST_DY] = gf_widen(sums->tops.dy),
                                           [LN_LARGEST_XC] = gf_widen(sums->tops.xc)};
    unsigned exact = 0;
    if (!grad_lanes_common(kind, dtype, count, rstd, xc_scale, offset, widened)) {
        exact = tile_lanes_need_exact(dtype, count, rstd, g_mean, gx_mean, widened);
        if (exact == (1u << count) - 1) {
            return exact;
        }
    }
    double factors_d[2][16];
    gd_store(factors_d[0], xc_scale);
    gd_store(factors_d[1], offset);
    *factors = (tile_f32_factors){tile_f32_lanes(means), tile_f32_lanes(rstds), tile_f32_lanes(factors_d[0]),
                                  tile_f32_lanes(factors_d[1])};
    return exact;
}

/* Pass 1 of a float32 tile (see backward_tile_f32), where `wanted` (dx or dweight is: else
   there is nothing to test, and the factors are the means and rstds with zeros), and its
   end (tile_f32_factors_of). */
static LN_ALWAYS_INLINE unsigned tile_f32_statistics(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                                     const tile_view *dy, const tile_view *x, int count,
                                                     const double means[16], const double rstds[16], int adjacent,
                                                     int wanted, tile_backward_lanes *buffers,
                                                     tile_f32_factors *factors)
{
    const ptrdiff_t n = a->extent.row_len;
    const float *weight = a->weight;
    const gf mean_v = tile_f32_lanes(means), zero_f = gf_splat(0.0f);
    if (!wanted) {
        *factors = (tile_f32_factors){mean_v, tile_f32_lanes(rstds), zero_f, zero_f};
        return 0;
    }
    tile_grad_sums sums = {gd_splat(0.0), gd_splat(0.0), {zero_f, zero_f, zero_f}};
    for (ptrdiff_t block = 0; block < n; block += 16) {
        const ptrdiff_t block_end = n - block < 16 ? n : block + 16;
        gf even_g = zero_f, even_gc = zero_f, odd_g = zero_f, odd_gc = zero_f;
        ptrdiff_t j = block;
        for (; j + 2 <= block_end; j += 2) {
            tile_grad_sums_term(kind, dtype, dy, x, count, j, weight, buffers, adjacent, mean_v, &even_g, &even_gc,
                                &sums.tops);
            tile_grad_sums_term(kind, dtype, dy, x, count, j + 1, weight, buffers, adjacent, mean_v, &odd_g, &odd_gc,
                                &sums.tops);
        }
        if (j < block_end) {
            tile_grad_sums_term(kind, dtype, dy, x, count, j, weight, buffers, adjacent, mean_v, &even_g, &even_gc,
                                &sums.tops);
        }
        sums.g_sum = gd_add(sums.g_sum, gf_widen(gf_add(even_g, odd_g)));
        sums.gc_sum = gd_add(sums.gc_sum, gf_widen(gf_add(even_gc, odd_gc)));
    }
    return tile_f32_factors_of(kind, dtype, count, n, means, rstds, &sums, factors);
}

/* Tile backward in float32, for float16/bfloat16/float32 data: per lane, the contiguous
   route's arithmetic (pass 1 and grad_apply_columns' dx), with the lane's row in place of
   a vector over it:
       pass 1: g = dy * w and g * (x - mean) (x - mean in float32, as grad_sums_group), summed
               in float32 over 16 elements (even and odd ones apart, so no add waits on the
               one before), those sums added in float64
       pass 2: dx = fma(rstd, g, fma(-rstd^2 * gx_mean, x - mean, -rstd * g_mean)),
               dweight's term (dy * (x - mean)) * rstd, both in float32; the terms of dweight
               and dbias added, widened, into the per-lane column sums (tile_add_term)
   Returns the lanes that fail the test that sends a contiguous row to ln_backward_exact_row
   (ln_grad_row_needs_exact on the tile's own sums, its common rows tested in vectors),
   which then go in float64; where there are any, pass 2 is left to backward_tile_exact_lanes,
   with the lanes' float32 factors in *factors (unset where every lane fails).  Which way a
   row goes depends on its dy and x, the weight and its statistics, not on the rows beside it
   nor on which gradients are asked for, so neither do dweight's bits (dbias' are the same
   both ways).
   One vector op over a group of 16 float32 lanes where float64 takes two: 8x64x56x56 float32
   over axis=1, A/B in alternating processes, 627-647 -> 498-519 us at one thread, 321-323 ->
   252-258 us at two. */
static LN_ALWAYS_INLINE unsigned backward_tile_f32(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                                   const tile_view *dy, const tile_view *x, const tile_view *dx,
                                                   int count, const double means[16], const double rstds[16],
                                                   int adjacent, double *dweight_lanes, double *dbias_lanes,
                                                   int one_tile, tile_f32_factors *factors)
{
    tile_backward_lanes buffers;
    tile_backward_lanes_init(&buffers, dtype, count, a->extent.row_len, adjacent);
    const unsigned exact = tile_f32_statistics(kind, dtype, a, dy, x, count, means, rstds, adjacent,
                                               dx->first || dweight_lanes, &buffers, factors);
    if (!exact) {
        backward_tile_f32_pass2(kind, dtype, a, dy, x, dx, count, *factors, adjacent, dweight_lanes, dbias_lanes,
                                one_tile, &buffers, LN_ALL_LANES);
    }
    return exact;
}

/* The column sums of one tile whose lanes went both ways: each lane's terms of dweight and
   dbias as its way makes them (backward_tile_f32_pass2's for the lanes outside `exact`,
   backward_tile_from_views' for those in it), the lanes summed by gd_one_tile_sum. */
static LN_ALWAYS_INLINE void tile_mixed_column_sums(ln_norm_kind kind, ln_dtype dtype, const tile_view *dy,
                                                    const tile_view *x, ptrdiff_t n, int count,
                                                    const double means[16], const double rstds[16], int adjacent,
                                                    unsigned exact, double *dweight, double *dbias)
{
    tile_backward_lanes buffers;
    tile_backward_lanes_init(&buffers, dtype, count, n, adjacent);
    float mean_f[16], rstd_f[16];
    for (int k = 0; k < 16; k++) {
        mean_f[k] = (float)means[k];
        rstd_f[k] = (float)rstds[k];
    }
    const gf mean_f_v = gf_load(mean_f), rstd_f_v = gf_load(rstd_f);
    const gd mean_v = gd_load(means), rstd_v = gd_load(rstds);
    for (ptrdiff_t j = 0; j < n; j++) {
        const gf dy_f = load_as_f32(dtype, tile_load(dtype, dy, count, j, &buffers.dy, adjacent), 0);
        const gf x_f = load_as_f32(dtype, tile_load(dtype, x, count, j, &buffers.x, adjacent), 0);
        if (dweight) {
            const gd dy_d = gf_widen(dy_f), x_d = gf_widen(x_f);
            const gf xc_f = kind == LN_NORM_LAYER ? gf_sub(x_f, mean_f_v) : x_f;
            const gd xhat = gd_mul(kind == LN_NORM_LAYER ? gd_sub(x_d, mean_v) : x_d, rstd_v);
            dweight[j] = gd_one_tile_sum(gd_lanes_from(gd_mul(dy_d, xhat),
                                                       gf_widen(gf_mul(gf_mul(dy_f, xc_f), rstd_f_v)), exact));
        }
        if (dbias) {
            dbias[j] = gd_one_tile_sum(gf_widen(dy_f));
        }
    }
}

/* Pass 2 of a float32 route tile of which backward_tile_f32 left the lanes `exact` to float64:
   when all of them, those lanes' work in float64; else the other lanes' dx in float32 (from
   the lanes' *factors; their dx written, then written over), then the lanes' own; with
   one_tile, whose column sums add every lane's terms at once, dx first, then every lane's
   terms.  Out of line, one instance for every kind, type and layout: such lanes are rare
   (magnitudes near float32's limits), and an inlined copy in each of the tile instances made
   about a third of an x86-64 level's machine code (GCC 12, avx2 level: 1.68 MB inlined, 1.16
   MB out of line; 186 s of CPU to compile inlined, 58 s out of line). */
__attribute__((noinline, cold)) static void backward_tile_exact_lanes(
    ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a, const tile_view *dy, const tile_view *x,
    const tile_view *dx, int count, const double means[16], const double rstds[16], int adjacent,
    double *dweight_lanes, double *dbias_lanes, int one_tile, unsigned exact, const tile_f32_factors *factors)
{
    if (exact == (1u << count) - 1) {
        backward_tile_from_views(kind, dtype, a, dy, x, dx, count, means, rstds, adjacent, dweight_lanes,
                                 dbias_lanes, one_tile, LN_ALL_LANES);
        return;
    }
    tile_backward_lanes buffers;
    tile_backward_lanes_init(&buffers, dtype, count, a->extent.row_len, adjacent);
    const unsigned others = ~exact & LN_ALL_LANES;
    if (!one_tile) {
        backward_tile_f32_pass2(kind, dtype, a, dy, x, dx, count, *factors, adjacent, dweight_lanes, dbias_lanes, 0,
                                &buffers, others);
        backward_tile_from_views(kind, dtype, a, dy, x, dx, count, means, rstds, adjacent, dweight_lanes,
                                 dbias_lanes, 0, exact);
        return;
    }
    if (dx->first) {
        backward_tile_f32_pass2(kind, dtype, a, dy, x, dx, count, *factors, adjacent, NULL, NULL, 0, &buffers,
                                others);
        backward_tile_from_views(kind, dtype, a, dy, x, dx, count, means, rstds, adjacent, NULL, NULL, 0, exact);
    }
    if (dweight_lanes || dbias_lanes) {
        tile_mixed_column_sums(kind, dtype, dy, x, a->extent.row_len, count, means, rstds, adjacent, exact,
                               dweight_lanes, dbias_lanes);
    }
}

/* backward_tile's work once its views are made: float64 data in float64
   (backward_tile_from_views), the others in float32 (backward_tile_f32) but for the lanes
   float32 cannot take. */
static LN_ALWAYS_INLINE void backward_tile_of_views(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                                    const tile_view *dy, const tile_view *x, const tile_view *dx,
                                                    int count, const double means[16], const double rstds[16],
                                                    int adjacent, double *dweight_lanes, double *dbias_lanes,
                                                    int one_tile)
{
    if (dtype == LN_F64) {
        backward_tile_from_views(kind, dtype, a, dy, x, dx, count, means, rstds, adjacent, dweight_lanes,
                                 dbias_lanes, one_tile, LN_ALL_LANES);
        return;
    }
    tile_f32_factors factors;
    const unsigned exact = backward_tile_f32(kind, dtype, a, dy, x, dx, count, means, rstds, adjacent,
                                             dweight_lanes, dbias_lanes, one_tile, &factors);
    if (exact) {
        backward_tile_exact_lanes(kind, dtype, a, dy, x, dx, count, means, rstds, adjacent, dweight_lanes,
                                  dbias_lanes, one_tile, exact, &factors);
    }
}

/* The means (0.0 for RMSNorm) and rstds of rows row .. row + count of block `block`, lanes
   from count on 0.0. */
static LN_ALWAYS_INLINE void tile_means_rstds(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                              ptrdiff_t block, ptrdiff_t row, int count, double means[16],
                                              double rstds[16])
{
    const tile_view mean_in = tile_view_of(dtype, &a->mean, &a->extent, block, row, count);
    const tile_view rstd_in = tile_view_of(dtype, &a->rstd, &a->extent, block, row, count);
    for (int k = 0; k < 16; k++) {
        means[k] = k < count && kind == LN_NORM_LAYER
                       ? ln_load1_param_as_f64(dtype, mean_in.first + k * mean_in.row_step, 0) : 0.0;
        rstds[k] = k < count ? ln_load1_param_as_f64(dtype, rstd_in.first + k * rstd_in.row_step, 0) : 0.0;
    }
}

/* Tile `tile` backward, in float32 (backward_tile_f32), and for float64 data or the lanes
   that float32 cannot take, in float64: pass 1 the lanes'
   sums of g and g * xhat (float32: when dx or dweight is wanted; float64: when dx is), pass
   2 dx and the parameter gradients' terms, added into the per-lane column sums
   dweight_lanes and dbias_lanes (each may be NULL), or with one_tile summed over the lanes
   into them (tile_add_term).  Lanes past count hold zeros, whose terms are zeros.  As
   forward_tile, the common case (dy, x and dx adjacent) runs in instances of its own, one
   with one_tile and one without; the others, whose gathers cost more than a test of
   one_tile at each element, share one. */
static LN_ALWAYS_INLINE void backward_tile(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                           ptrdiff_t tile, double *dweight_lanes, double *dbias_lanes, int one_tile)
{
    ptrdiff_t block, row;
    int count;
    ln_tile_of(&a->extent, tile, &block, &row, &count);
    const tile_view dy = tile_view_of(dtype, &a->grad_output, &a->extent, block, row, count);
    const tile_view x = tile_view_of(dtype, &a->input, &a->extent, block, row, count);
    const tile_view dx = tile_view_of(dtype, &a->grad_input, &a->extent, block, row, count);
    double means[16], rstds[16];
    tile_means_rstds(kind, dtype, a, block, row, count, means, rstds);
    if (dy.adjacent && x.adjacent && (!dx.first || dx.adjacent)) {
        if (one_tile) {
            backward_tile_of_views(kind, dtype, a, &dy, &x, &dx, count, means, rstds, 1, dweight_lanes,
                                   dbias_lanes, 1);
        }
        else {
            backward_tile_of_views(kind, dtype, a, &dy, &x, &dx, count, means, rstds, 1, dweight_lanes,
                                   dbias_lanes, 0);
        }
    }
    else {
        backward_tile_of_views(kind, dtype, a, &dy, &x, &dx, count, means, rstds, 0, dweight_lanes, dbias_lanes,
                               one_tile);
    }
}

static LN_ALWAYS_INLINE void backward_tiles(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *args,
                                            ptrdiff_t begin, ptrdiff_t end, double *dweight_lanes,
                                            double *dbias_lanes)
{
    const ln_backward_args copy = *args, *a = &copy;  /* see forward_rows */
    assert(a && a->grad_output.data && a->input.data && a->rstd.data && a->extent.row_len >= 1);
    assert(0 <= begin && begin <= end && end <= ln_tiles_of(&a->extent));
    dbias_lanes = kind == LN_NORM_LAYER ? dbias_lanes : NULL;
    const int one_tile = end - begin == 1;
    for (ptrdiff_t tile = begin; tile < end; tile++) {
        backward_tile(kind, dtype, a, tile, dweight_lanes, dbias_lanes, one_tile);
    }
}

/* A run of a block's tiles whose lanes all go in float32, for pass 2 column by column
   (backward_tiles_columns): each tile's dy, x and dx at element 0 (dx NULL: not wanted) and
   its pass 2 factors. */
typedef struct {
    int tiles;
    const char *dy[LN_TILE_RUN], *x[LN_TILE_RUN];
    char *dx[LN_TILE_RUN];
    int ahead[LN_TILE_RUN];  /* the tile LN_TILE_RUN on is in the same block: its dx is asked for */
    ptrdiff_t dy_step, x_step, dx_step;  /* bytes from one element of a row to the next */
    tile_f32_factors factors[LN_TILE_RUN];
} tile_run;

/* Pass 2 of a run of tiles, one column at a time: element j of every tile's rows, the tiles
   in order, their terms of dweight and dbias added in registers to the column's lane sums,
   which are loaded and stored once a run.  Lane k of a column adds the tiles' terms in the
   order tile by tile pass 2 adds them, so the bits are the same; what is saved is the load
   and store of those sums (16 float64 lanes each of dweight and dbias: four 64-byte loads
   and four stores) at every tile and element.  8x64x56x56 float32 over axis=1, dx, dweight
   and dbias, one thread, Zen 4, A/B in alternating processes: 0.94-1.07 -> 0.87-0.96 ms. */
static LN_ALWAYS_INLINE void tile_run_pass2(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *a,
                                            const tile_run *run_in, double *dweight_lanes, double *dbias_lanes)
{
    const tile_run run = *run_in;  /* a copy the stores through dx cannot change (see forward_rows) */
    const ptrdiff_t n = a->extent.row_len, ahead = LN_TILE_RUN * group_bytes_of(dtype);
    const float *weight = a->weight;
    const int want_dx = run.dx[0] != NULL;
    const gd zero_d = gd_splat(0.0);
    for (ptrdiff_t j = 0; j < n; j++) {
        gd dweight_sum = dweight_lanes ? gd_load(dweight_lanes + 16 * j) : zero_d;
        gd dbias_sum = dbias_lanes ? gd_load(dbias_lanes + 16 * j) : zero_d;
        const gf w = gf_splat(weight ? weight[j] : 1.0f);
        for (int i = 0; i < run.tiles; i++) {
            const tile_f32_factors *f = &run.factors[i];
            const gf dy_v = load_as_f32(dtype, run.dy[i] + j * run.dy_step, 0);
            const gf value_x = load_as_f32(dtype, run.x[i] + j * run.x_step, 0);
            const gf xc = kind == LN_NORM_LAYER ? gf_sub(value_x, f->mean) : value_x;
            if (want_dx) {
                char *target = run.dx[i] + j * run.dx_step;
                if (run.ahead[i]) {
                    __builtin_prefetch(target + ahead, 1, LN_TILE_PREFETCH_LOCALITY);
                }
                const gf g = weight ? gf_mul(dy_v, w) : dy_v;
                store_from_f32(dtype, target, 0, grad_dx(kind, g, xc, f->rstd, f->xc_scale, f->offset), 1);
            }
            if (dweight_lanes) {
                dweight_sum = gd_add(dweight_sum, gf_widen(gf_mul(gf_mul(dy_v, xc), f->rstd)));
            }
            if (dbias_lanes) {
                dbias_sum = gd_add(dbias_sum, gf_widen(dy_v));
            }
        }
        if (dweight_lanes) {
            gd_store(dweight_lanes + 16 * j, dweight_sum);
        }
        if (dbias_lanes) {
            gd_store(dbias_lanes + 16 * j, dbias_sum);
        }
    }
}

/* Whether a call's tiles go by runs (backward_tiles_columns): float16/bfloat16/float32 data,
   dweight wanted, a block of more than one tile, dy's, x's and dx's rows adjacent.  Without
   dweight, tile by tile was faster: its stores of dx, a tile's 64 lines at a time, each
   asked for two tiles ahead, went faster than a run's columns of them (8x64x56x56 float32
   over axis=1, dx alone, one thread, Zen 4: 0.68-0.73 ms tile by tile, 0.78-0.83 ms by runs). */
static LN_ALWAYS_INLINE int backward_tiles_columns_fit(ln_dtype dtype, const ln_backward_args *a, ptrdiff_t begin,
                                                       ptrdiff_t end, const double *dweight_lanes)
{
    const ptrdiff_t size = (ptrdiff_t)ln_dtype_size(dtype);
    return dtype != LN_F64 && dweight_lanes && end - begin > 1 && a->grad_output.walk.row_step == size &&
           a->input.walk.row_step == size && (!a->grad_input.data || a->grad_input.walk.row_step == size);
}

/* backward_tiles, LN_TILE_RUN tiles at a time: pass 1 of each tile of the run, then pass 2 of
   the run column by column (tile_run_pass2).  A run with a tile of fewer rows (a block's
   last) or with lanes that need float64 goes tile by tile, in order, as backward_tiles takes
   it (its pass 1 again: such runs are rare). */
static LN_ALWAYS_INLINE void backward_tiles_columns(ln_norm_kind kind, ln_dtype dtype, const ln_backward_args *args,
                                                    ptrdiff_t begin, ptrdiff_t end, double *dweight_lanes,
                                                    double *dbias_lanes)
{
    const ln_backward_args copy = *args, *a = &copy;  /* see forward_rows */
    assert(backward_tiles_columns_fit(dtype, a, begin, end, dweight_lanes));
    assert(0 <= begin && begin <= end && end <= ln_tiles_of(&a->extent));
    dbias_lanes = kind == LN_NORM_LAYER ? dbias_lanes : NULL;
    tile_run run = {.dy_step = a->grad_output.walk.elem_step, .x_step = a->input.walk.elem_step,
                    .dx_step = a->grad_input.walk.elem_step};
    for (ptrdiff_t first = begin; first < end; first += LN_TILE_RUN) {
        run.tiles = end - first < LN_TILE_RUN ? (int)(end - first) : LN_TILE_RUN;
        int by_columns = 1;
        for (int i = 0; i < run.tiles && by_columns; i++) {
            ptrdiff_t block, row;
            int count;
            ln_tile_of(&a->extent, first + i, &block, &row, &count);
            if (count < LN_TILE_ROWS) {
                by_columns = 0;
                break;
            }
            const tile_view dy = tile_view_of(dtype, &a->grad_output, &a->extent, block, row, count);
            const tile_view x = tile_view_of(dtype, &a->input, &a->extent, block, row, count);
            run.dy[i] = dy.first;
            run.x[i] = x.first;
            run.dx[i] = a->grad_input.data ? ln_block_row_address(&a->grad_input, block, row) : NULL;
            run.ahead[i] = row + (LN_TILE_RUN + 1) * LN_TILE_ROWS <= a->extent.rows;
            double means[16], rstds[16];
            tile_means_rstds(kind, dtype, a, block, row, count, means, rstds);
            tile_backward_lanes buffers;  /* unused: every view adjacent */
            by_columns = !tile_f32_statistics(kind, dtype, a, &dy, &x, count, means, rstds, 1, 1, &buffers,
                                              &run.factors[i]);
        }
        if (by_columns) {
            tile_run_pass2(kind, dtype, a, &run, dweight_lanes, dbias_lanes);
            continue;
        }
        for (int i = 0; i < run.tiles; i++) {
            backward_tile(kind, dtype, a, first + i, dweight_lanes, dbias_lanes, 0);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* The level's kernel table                                                  */
/* ------------------------------------------------------------------------ */

/* The table's functions for one norm kind and element type: each fixes both, constants, so
   the code above is compiled for that pair alone. */
#define LN_KIND_FUNCTIONS(KIND, kind_suffix, DTYPE, suffix)                                        \
    static void forward_rows_##kind_suffix##_##suffix(const ln_forward_args *a,                    \
                                                      const ln_rstd_bounds *bounds,                \
                                                      ptrdiff_t begin, ptrdiff_t end,              \
                                                      ptrdiff_t read_ahead)                        \
    {                                                                                              \
        forward_rows(KIND, DTYPE, a, bounds, begin, end, read_ahead);                              \
    }                                                                                              \
    static void forward_sum_rows_##kind_suffix##_##suffix(const ln_forward_args *a,                \
                                                          const ln_rstd_bounds *bounds,            \
                                                          ptrdiff_t begin, ptrdiff_t end)          \
    {                                                                                              \
        forward_sum_rows(KIND, DTYPE, a, bounds, begin, end);                                      \
    }                                                                                              \
    __attribute__((noinline)) static void forward_tiles_pipelined_##kind_suffix##_##suffix(        \
        const ln_forward_args *a, const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end)    \
    {                                                                                              \
        forward_tiles_pipelined(KIND, DTYPE, a, bounds, begin, end);                               \
    }                                                                                              \
    __attribute__((noinline)) static void forward_tiles_staged_##kind_suffix##_##suffix(           \
        const ln_forward_args *a, const ln_rstd_bounds *bounds, ptrdiff_t begin, ptrdiff_t end)    \
    {                                                                                              \
        _Alignas(64) char stage[LN_TILE_STAGE_BYTES];                                              \
        forward_tiles(KIND, DTYPE, a, bounds, begin, end, stage);                                  \
    }                                                                                              \
    static void forward_tiles_##kind_suffix##_##suffix(const ln_forward_args *a,                   \
                                                       const ln_rstd_bounds *bounds,               \
                                                       ptrdiff_t begin, ptrdiff_t end)             \
    {                                                                                              \
        if (tiles_output_staged(DTYPE, a)) {                                                       \
            forward_tiles_staged_##kind_suffix##_##suffix(a, bounds, begin, end);                  \
            return;                                                                                \
        }                                                                                          \
        if (tiles_pipelined(DTYPE, a)) {                                                           \
            forward_tiles_pipelined_##kind_suffix##_##suffix(a, bounds, begin, end);               \
            return;                                                                                \
        }                                                                                          \
        forward_tiles(KIND, DTYPE, a, bounds, begin, end, NULL);                                   \
    }                                                                                              \
    static ln_moments chunk_moments_##kind_suffix##_##suffix(const void *x, ptrdiff_t n,           \
                                                             ptrdiff_t read_ahead)                 \
    {                                                                                              \
        return chunk_moments(KIND, DTYPE, x, n, read_ahead);                                       \
    }                                                                                              \
    static void normalize_row_##kind_suffix##_##suffix(const void *x, void *y, ptrdiff_t n,        \
                                                       double mean, double rstd,                   \
                                                       const void *weight, const void *bias)       \
    {                                                                                              \
        normalize_row(KIND, DTYPE, 0, x, y, n, mean, rstd, weight, bias);                          \
    }                                                                                              \
    static void normalize_row_streaming_##kind_suffix##_##suffix(const void *x, void *y,           \
                                                                 ptrdiff_t n, double mean,         \
                                                                 double rstd, const void *weight,  \
                                                                 const void *bias)                 \
    {                                                                                              \
        normalize_row(KIND, DTYPE, 1, x, y, n, mean, rstd, weight, bias);                          \
    }                                                                                              \
    static int backward_rows_##kind_suffix##_##suffix(const ln_backward_args *a, ptrdiff_t begin,  \
                                                      ptrdiff_t end, double *dweight, double *dbias, \
                                                      double *total_dweight, double *total_dbias)  \
    {                                                                                              \
        return backward_rows(KIND, DTYPE, a, begin, end, dweight, dbias, total_dweight, total_dbias); \
    }                                                                                              \
    __attribute__((noinline)) static void backward_tiles_columns_##kind_suffix##_##suffix(         \
        const ln_backward_args *a, ptrdiff_t begin, ptrdiff_t end, double *dweight_lanes,          \
        double *dbias_lanes)                                                                       \
    {                                                                                              \
        backward_tiles_columns(KIND, DTYPE, a, begin, end, dweight_lanes, dbias_lanes);            \
    }                                                                                              \
    static void backward_tiles_##kind_suffix##_##suffix(const ln_backward_args *a,                 \
                                                        ptrdiff_t begin, ptrdiff_t end,            \
                                                        double *dweight_lanes,                     \
                                                        double *dbias_lanes)                       \
    {                                                                                              \
        if (backward_tiles_columns_fit(DTYPE, a, begin, end, dweight_lanes)) {                     \
            backward_tiles_columns_##kind_suffix##_##suffix(a, begin, end, dweight_lanes,          \
                                                            dbias_lanes);                          \
            return;                                                                                \
        }                                                                                          \
        backward_tiles(KIND, DTYPE, a, begin, end, dweight_lanes, dbias_lanes);                    \
    }                                                                                              \
    static void grad_sums_##kind_suffix##_##suffix(const void *dy, const void *x,                  \
                                                   const void *weight, ptrdiff_t n, double mean,   \
                                                   double rstd, double sums[2],                    \
                                                   double largest[LN_LARGEST_COUNT],               \
                                                   ptrdiff_t read_ahead)                           \
    {                                                                                              \
        grad_sums(KIND, DTYPE, dy, x, weight, n, mean, rstd, sums, largest, read_ahead);           \
    }                                                                                              \
    static void grad_apply_##kind_suffix##_##suffix(const ln_grad_rows *group, const void *weight, \
                                                    ptrdiff_t n, double *dweight, double *dbias)   \
    {                                                                                              \
        grad_apply(KIND, DTYPE, group, weight, n, dweight, dbias);                                 \
    }

/* ... and for one element type: the residual sum, and its kinds' functions. */
#define LN_DTYPE_FUNCTIONS(DTYPE, suffix)                                                          \
    static ln_param_magnitudes param_magnitudes_##suffix(const void *weight, const void *bias,     \
                                                         ptrdiff_t n)                              \
    {                                                                                              \
        return param_magnitudes_of(DTYPE, weight, bias, n);                                          \
    }                                                                                              \
    static void add_row_##suffix(const void *x, ptrdiff_t x_step, const void *residual,            \
                                 ptrdiff_t residual_step, void *sum, ptrdiff_t n)                  \
    {                                                                                              \
        add_row(DTYPE, x, x_step, residual, residual_step, sum, n);                                \
    }                                                                                              \
    static void store_params_##suffix(void *params, const double *sums, ptrdiff_t n)               \
    {                                                                                              \
        store_params(DTYPE, params, sums, n);                                                      \
    }                                                                                              \
    static void widen_to_f32_##suffix(const void *from, float *to, ptrdiff_t n)                    \
    {                                                                                              \
        widen_to_f32(DTYPE, from, to, n);                                                          \
    }                                                                                              \
    LN_FOR_EACH_KIND(LN_KIND_FUNCTIONS, DTYPE, suffix)

/* The element types the level compiles: all of them, unless its file names fewer (a level
   that differs from the one below it only for those; ln_dtype_kernels_in_use takes the
   others from below). */
#ifndef LN_LEVEL_FOR_EACH_DTYPE
#define LN_LEVEL_FOR_EACH_DTYPE LN_FOR_EACH_DTYPE
#endif

LN_LEVEL_FOR_EACH_DTYPE(LN_DTYPE_FUNCTIONS)

#define LN_KIND_TABLE_ENTRY(KIND, kind_suffix, DTYPE, suffix)                              \
    [KIND] = {                                                                             \
        .forward_rows = forward_rows_##kind_suffix##_##suffix,                             \
        .forward_sum_rows = forward_sum_rows_##kind_suffix##_##suffix,                     \
        .forward_tiles = forward_tiles_##kind_suffix##_##suffix,                           \
        .chunk_moments = chunk_moments_##kind_suffix##_##suffix,                           \
        .normalize_row = normalize_row_##kind_suffix##_##suffix,                           \
        .normalize_row_streaming = normalize_row_streaming_##kind_suffix##_##suffix,       \
        .backward_rows = backward_rows_##kind_suffix##_##suffix,                           \
        .backward_tiles = backward_tiles_##kind_suffix##_##suffix,                         \
        .grad_sums = grad_sums_##kind_suffix##_##suffix,                                   \
        .grad_apply = grad_apply_##kind_suffix##_##suffix,                                 \
    },

#define LN_DTYPE_TABLE_ENTRY(DTYPE, suffix)                                         \
    [DTYPE] = {                                                                     \
        .by_kind = {LN_FOR_EACH_KIND(LN_KIND_TABLE_ENTRY, DTYPE, suffix)},          \
        .add_row = add_row_##suffix,                                                \
        .param_magnitudes = param_magnitudes_##suffix,                              \
        .store_params = store_params_##suffix,                                      \
        .widen_to_f32 = DTYPE == LN_F64 ? NULL : widen_to_f32_##suffix,             \
    },

const ln_kernel_table LN_LEVEL_KERNELS = {.by_dtype = {LN_LEVEL_FOR_EACH_DTYPE(LN_DTYPE_TABLE_ENTRY)}};
