/*
 * ln_kernel_impl.h -- the row kernels, written once and compiled once per SIMD level.
 *
 * ln_kernels.c includes this file three times, each time inside a different
 * `#pragma GCC target` region and with LN_ISA / LN_ISA_LEVEL defined:
 *
 *     LN_ISA_LEVEL 0  scalar   baseline x86-64 (or any GCC/Clang target)
 *     LN_ISA_LEVEL 1  avx2     AVX2 + FMA + F16C
 *     LN_ISA_LEVEL 2  avx512   AVX-512F
 *
 * The arithmetic uses GCC vector extensions (f32x16, f64x8), which the compiler
 * lowers to the widest registers of the target.  Only the few operations that
 * vector extensions cannot express (fused multiply-add, float16 conversion) have
 * per-level code below.  Every level performs the same IEEE operations in the same
 * order -- 16 accumulation lanes, lane k taking elements i with i % 16 == k, then a
 * fixed reduction tree -- so every level returns bit-identical results.
 *
 * Forward, per row of N elements (statistics in float64):
 *
 *     chunk c (<= LN_CHUNK elements):  mean_c = sum(x) / n_c
 *                                      s1 = sum(x - mean_c),  s2 = sum((x - mean_c)^2)
 *                                      moments_c = (n_c, mean_c + s1/n_c, s2 - s1^2/n_c)
 *     row:   moments = chan_merge(moments_0, moments_1, ...)      (left to right)
 *            rstd = 1 / sqrt(m2 / N + eps)
 *     float32/float16 output, computed in float32 with a two-part mean:
 *            mean_hi = float(mean),  mean_lo = float(mean - mean_hi)
 *            a_j = float(rstd * weight_j)           (one rounding)
 *            y_j = fma((x_j - mean_hi) - mean_lo, a_j, bias_j)
 *     float64 output:  y_j = fma(x_j - mean, rstd * weight_j, bias_j)
 *
 * Backward, per row (all in float64; g = dy * weight, xhat = (x - mean) * rstd):
 *
 *     dx_j = rstd * (g_j - mean(g) - xhat_j * mean(g * xhat))
 *     dweight_j = sum over rows of dy_j * xhat_j,   dbias_j = sum over rows of dy_j
 */

#define LN_CAT_(a, b) a##_##b
#define LN_CAT(a, b) LN_CAT_(a, b)
#define LN_FN(name) LN_CAT(name, LN_ISA)

/* ------------------------------------------------------------------------ */
/* Per-level primitives                                                      */
/* ------------------------------------------------------------------------ */

#if LN_ISA_LEVEL == 0

static inline f32x16 LN_FN(load16_f16)(const uint16_t *p)
{
    f32x16 v;
    for (int k = 0; k < 16; k++) {
        v[k] = ln_half_to_float(p[k]);
    }
    return v;
}

static inline void LN_FN(store16_f16)(uint16_t *p, f32x16 v)
{
    for (int k = 0; k < 16; k++) {
        p[k] = ln_float_to_half(v[k]);
    }
}

static inline f32x16 LN_FN(fma_f32)(f32x16 a, f32x16 b, f32x16 c)
{
    f32x16 r;
    for (int k = 0; k < 16; k++) {
        r[k] = fmaf(a[k], b[k], c[k]);
    }
    return r;
}

static inline f64x8 LN_FN(fma_f64)(f64x8 a, f64x8 b, f64x8 c)
{
    f64x8 r;
    for (int k = 0; k < 8; k++) {
        r[k] = fma(a[k], b[k], c[k]);
    }
    return r;
}

#elif LN_ISA_LEVEL == 1

typedef union { f32x16 v; __m256 h[2]; } LN_FN(f32x16_halves);
typedef union { f64x8 v; __m256d h[2]; } LN_FN(f64x8_halves);

static inline f32x16 LN_FN(load16_f16)(const uint16_t *p)
{
    LN_FN(f32x16_halves) u;
    u.h[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    u.h[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return u.v;
}

static inline void LN_FN(store16_f16)(uint16_t *p, f32x16 v)
{
    LN_FN(f32x16_halves) u = {.v = v};
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(u.h[0], _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(u.h[1], _MM_FROUND_TO_NEAREST_INT));
}

static inline f32x16 LN_FN(fma_f32)(f32x16 a, f32x16 b, f32x16 c)
{
    LN_FN(f32x16_halves) ua = {.v = a}, ub = {.v = b}, uc = {.v = c}, r;
    r.h[0] = _mm256_fmadd_ps(ua.h[0], ub.h[0], uc.h[0]);
    r.h[1] = _mm256_fmadd_ps(ua.h[1], ub.h[1], uc.h[1]);
    return r.v;
}

static inline f64x8 LN_FN(fma_f64)(f64x8 a, f64x8 b, f64x8 c)
{
    LN_FN(f64x8_halves) ua = {.v = a}, ub = {.v = b}, uc = {.v = c}, r;
    r.h[0] = _mm256_fmadd_pd(ua.h[0], ub.h[0], uc.h[0]);
    r.h[1] = _mm256_fmadd_pd(ua.h[1], ub.h[1], uc.h[1]);
    return r.v;
}

#else

static inline f32x16 LN_FN(load16_f16)(const uint16_t *p)
{
    return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline void LN_FN(store16_f16)(uint16_t *p, f32x16 v)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
}

static inline f32x16 LN_FN(fma_f32)(f32x16 a, f32x16 b, f32x16 c)
{
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

static inline f64x8 LN_FN(fma_f64)(f64x8 a, f64x8 b, f64x8 c)
{
    return (f64x8)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
}

#endif

/* ------------------------------------------------------------------------ */
/* Loads and stores by element type (dtype is a constant after inlining)     */
/* ------------------------------------------------------------------------ */

/* 16 elements from p[i] as float32 (float16 and float32 only). */
static LN_ALWAYS_INLINE f32x16 LN_FN(load16_as_f32)(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    if (dtype == LN_F16) {
        return LN_FN(load16_f16)((const uint16_t *)p + i);
    }
    return ln_load_f32x16((const float *)p + i);
}

static LN_ALWAYS_INLINE void LN_FN(store16_from_f32)(ln_dtype dtype, void *p, ptrdiff_t i, f32x16 v)
{
    if (dtype == LN_F16) {
        LN_FN(store16_f16)((uint16_t *)p + i, v);
    }
    else {
        ln_store_f32x16((float *)p + i, v);
    }
}

/* 16 elements from p[i] as two float64 vectors (low 8, high 8). */
static LN_ALWAYS_INLINE void LN_FN(load16_as_f64)(ln_dtype dtype, const void *p, ptrdiff_t i,
                                                  f64x8 *lo, f64x8 *hi)
{
    if (dtype == LN_F64) {
        *lo = ln_load_f64x8((const double *)p + i);
        *hi = ln_load_f64x8((const double *)p + i + 8);
    }
    else {
        ln_widen(LN_FN(load16_as_f32)(dtype, p, i), lo, hi);
    }
}

static LN_ALWAYS_INLINE void LN_FN(store16_from_f64)(ln_dtype dtype, void *p, ptrdiff_t i,
                                                     f64x8 lo, f64x8 hi)
{
    if (dtype == LN_F64) {
        ln_store_f64x8((double *)p + i, lo);
        ln_store_f64x8((double *)p + i + 8, hi);
    }
    else {
        LN_FN(store16_from_f32)(dtype, p, i, ln_narrow(lo, hi));
    }
}

/* Params (weight, bias, mean, rstd) are float32 unless the input is float64. */
static LN_ALWAYS_INLINE void LN_FN(load16_param_as_f64)(ln_dtype dtype, const void *p, ptrdiff_t i,
                                                        f64x8 *lo, f64x8 *hi)
{
    LN_FN(load16_as_f64)(dtype == LN_F64 ? LN_F64 : LN_F32, p, i, lo, hi);
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */
/* ------------------------------------------------------------------------ */

/* Mean and M2 of one chunk of n <= LN_CHUNK elements, by two passes over it
   while it sits in L1. */
static LN_ALWAYS_INLINE ln_moments LN_FN(chunk_moments)(ln_dtype dtype, const void *x, ptrdiff_t n)
{
    double lanes[16];
    f64x8 sum_lo = {0}, sum_hi = {0};
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        f64x8 lo, hi;
        LN_FN(load16_as_f64)(dtype, x, i, &lo, &hi);
        sum_lo += lo;
        sum_hi += hi;
    }
    ln_store_lanes(lanes, sum_lo, sum_hi);
    for (; i < n; i++) {
        lanes[i & 15] += ln_load1_as_f64(dtype, x, i);
    }
    const double chunk_mean = ln_sum_lanes(lanes) / (double)n;

    f64x8 dev_lo = {0}, dev_hi = {0}, sq_lo = {0}, sq_hi = {0};
    const f64x8 mean_v = ln_splat_f64(chunk_mean);
    double sq_lanes[16];
    for (i = 0; i + 16 <= n; i += 16) {
        f64x8 lo, hi;
        LN_FN(load16_as_f64)(dtype, x, i, &lo, &hi);
        lo -= mean_v;
        hi -= mean_v;
        dev_lo += lo;
        dev_hi += hi;
        sq_lo += lo * lo;
        sq_hi += hi * hi;
    }
    ln_store_lanes(lanes, dev_lo, dev_hi);
    ln_store_lanes(sq_lanes, sq_lo, sq_hi);
    for (; i < n; i++) {
        const double d = ln_load1_as_f64(dtype, x, i) - chunk_mean;
        lanes[i & 15] += d;
        sq_lanes[i & 15] += d * d;
    }
    const double s1 = ln_sum_lanes(lanes), s2 = ln_sum_lanes(sq_lanes);
    ln_moments m = {(double)n, chunk_mean + s1 / (double)n, s2 - s1 * (s1 / (double)n)};
    return m;
}

/* y = fma((x - mean_hi) - mean_lo, float(rstd * w), b) for float16/float32 rows. */
static LN_ALWAYS_INLINE void LN_FN(normalize_f32)(ln_dtype dtype, const void *x, void *y, ptrdiff_t n,
                                                  double mean, double rstd,
                                                  const float *weight, const float *bias)
{
    const float mean_hi = (float)mean;
    const float mean_lo = (float)(mean - (double)mean_hi);
    const float scale = (float)rstd;
    const f32x16 mean_hi_v = ln_splat_f32(mean_hi), mean_lo_v = ln_splat_f32(mean_lo);
    const f32x16 scale_v = ln_splat_f32(scale), zero_v = ln_splat_f32(0.0f);
    const f64x8 rstd_v = ln_splat_f64(rstd);
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const f32x16 centred = (LN_FN(load16_as_f32)(dtype, x, i) - mean_hi_v) - mean_lo_v;
        f32x16 a = scale_v;
        if (weight) {
            f64x8 w_lo, w_hi;
            ln_widen(ln_load_f32x16(weight + i), &w_lo, &w_hi);
            a = ln_narrow(w_lo * rstd_v, w_hi * rstd_v);
        }
        const f32x16 b = bias ? ln_load_f32x16(bias + i) : zero_v;
        LN_FN(store16_from_f32)(dtype, y, i, LN_FN(fma_f32)(centred, a, b));
    }
    for (; i < n; i++) {
        const float centred = ((float)ln_load1_as_f64(dtype, x, i) - mean_hi) - mean_lo;
        const float a = weight ? (float)((double)weight[i] * rstd) : scale;
        const float out = fmaf(centred, a, bias ? bias[i] : 0.0f);
        if (dtype == LN_F16) {
            ((uint16_t *)y)[i] = ln_float_to_half(out);
        }
        else {
            ((float *)y)[i] = out;
        }
    }
}

/* y = fma(x - mean, rstd * w, b) for float64 rows. */
static inline void LN_FN(normalize_f64)(const double *x, double *y, ptrdiff_t n, double mean,
                                        double rstd, const double *weight, const double *bias)
{
    const f64x8 mean_v = ln_splat_f64(mean), rstd_v = ln_splat_f64(rstd);
    const f64x8 zero_v = ln_splat_f64(0.0);
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const f64x8 centred = ln_load_f64x8(x + i) - mean_v;
        const f64x8 a = weight ? ln_load_f64x8(weight + i) * rstd_v : rstd_v;
        const f64x8 b = bias ? ln_load_f64x8(bias + i) : zero_v;
        ln_store_f64x8(y + i, LN_FN(fma_f64)(centred, a, b));
    }
    for (; i < n; i++) {
        const double a = weight ? weight[i] * rstd : rstd;
        y[i] = fma(x[i] - mean, a, bias ? bias[i] : 0.0);
    }
}

static ln_moments LN_FN(chunk_moments_f16)(const void *x, ptrdiff_t n)
{
    return LN_FN(chunk_moments)(LN_F16, x, n);
}

static ln_moments LN_FN(chunk_moments_f32)(const void *x, ptrdiff_t n)
{
    return LN_FN(chunk_moments)(LN_F32, x, n);
}

static ln_moments LN_FN(chunk_moments_f64)(const void *x, ptrdiff_t n)
{
    return LN_FN(chunk_moments)(LN_F64, x, n);
}

static void LN_FN(normalize_row_f16)(const void *x, void *y, ptrdiff_t n, double mean, double rstd,
                                     const void *weight, const void *bias)
{
    LN_FN(normalize_f32)(LN_F16, x, y, n, mean, rstd, weight, bias);
}

static void LN_FN(normalize_row_f32)(const void *x, void *y, ptrdiff_t n, double mean, double rstd,
                                     const void *weight, const void *bias)
{
    LN_FN(normalize_f32)(LN_F32, x, y, n, mean, rstd, weight, bias);
}

static void LN_FN(normalize_row_f64)(const void *x, void *y, ptrdiff_t n, double mean, double rstd,
                                     const void *weight, const void *bias)
{
    LN_FN(normalize_f64)(x, y, n, mean, rstd, weight, bias);
}

/* ------------------------------------------------------------------------ */
/* Backward                                                                  */
/* ------------------------------------------------------------------------ */

/* dx for one row: two passes, the row staying in cache between them. */
static LN_ALWAYS_INLINE void LN_FN(backward_row)(ln_dtype dtype, const void *dy, const void *x, void *dx,
                                                 ptrdiff_t n, double mean, double rstd,
                                                 const void *weight)
{
    const f64x8 mean_v = ln_splat_f64(mean), rstd_v = ln_splat_f64(rstd);
    f64x8 g_lo_sum = {0}, g_hi_sum = {0}, gx_lo_sum = {0}, gx_hi_sum = {0};
    double g_lanes[16], gx_lanes[16];
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        f64x8 g_lo, g_hi, x_lo, x_hi;
        LN_FN(load16_as_f64)(dtype, dy, i, &g_lo, &g_hi);
        LN_FN(load16_as_f64)(dtype, x, i, &x_lo, &x_hi);
        if (weight) {
            f64x8 w_lo, w_hi;
            LN_FN(load16_param_as_f64)(dtype, weight, i, &w_lo, &w_hi);
            g_lo *= w_lo;
            g_hi *= w_hi;
        }
        const f64x8 xhat_lo = (x_lo - mean_v) * rstd_v, xhat_hi = (x_hi - mean_v) * rstd_v;
        g_lo_sum += g_lo;
        g_hi_sum += g_hi;
        gx_lo_sum += g_lo * xhat_lo;
        gx_hi_sum += g_hi * xhat_hi;
    }
    ln_store_lanes(g_lanes, g_lo_sum, g_hi_sum);
    ln_store_lanes(gx_lanes, gx_lo_sum, gx_hi_sum);
    for (; i < n; i++) {
        double g = ln_load1_as_f64(dtype, dy, i);
        if (weight) {
            g *= ln_load1_param_as_f64(dtype, weight, i);
        }
        const double xhat = (ln_load1_as_f64(dtype, x, i) - mean) * rstd;
        g_lanes[i & 15] += g;
        gx_lanes[i & 15] += g * xhat;
    }
    const double g_mean = ln_sum_lanes(g_lanes) / (double)n;
    const double gx_mean = ln_sum_lanes(gx_lanes) / (double)n;
    const f64x8 g_mean_v = ln_splat_f64(g_mean), gx_mean_v = ln_splat_f64(gx_mean);

    for (i = 0; i + 16 <= n; i += 16) {
        f64x8 g_lo, g_hi, x_lo, x_hi;
        LN_FN(load16_as_f64)(dtype, dy, i, &g_lo, &g_hi);
        LN_FN(load16_as_f64)(dtype, x, i, &x_lo, &x_hi);
        if (weight) {
            f64x8 w_lo, w_hi;
            LN_FN(load16_param_as_f64)(dtype, weight, i, &w_lo, &w_hi);
            g_lo *= w_lo;
            g_hi *= w_hi;
        }
        const f64x8 xhat_lo = (x_lo - mean_v) * rstd_v, xhat_hi = (x_hi - mean_v) * rstd_v;
        const f64x8 dx_lo = rstd_v * ((g_lo - g_mean_v) - xhat_lo * gx_mean_v);
        const f64x8 dx_hi = rstd_v * ((g_hi - g_mean_v) - xhat_hi * gx_mean_v);
        LN_FN(store16_from_f64)(dtype, dx, i, dx_lo, dx_hi);
    }
    for (; i < n; i++) {
        double g = ln_load1_as_f64(dtype, dy, i);
        if (weight) {
            g *= ln_load1_param_as_f64(dtype, weight, i);
        }
        const double xhat = (ln_load1_as_f64(dtype, x, i) - mean) * rstd;
        ln_store1_from_f64(dtype, dx, i, rstd * ((g - g_mean) - xhat * gx_mean));
    }
}

/* Adds dy * xhat and dy over rows [row_begin, row_end) into dweight/dbias
   (float64, one per column of [col_begin, col_end)), row by row in order. */
static LN_ALWAYS_INLINE void LN_FN(param_grads)(ln_dtype dtype, const ln_backward_args *a,
                                                ptrdiff_t row_begin, ptrdiff_t row_end,
                                                ptrdiff_t col_begin, ptrdiff_t col_end,
                                                double *dweight, double *dbias)
{
    const size_t elsize = ln_dtype_size(dtype);
    const ptrdiff_t cols = col_end - col_begin;
    for (ptrdiff_t r = row_begin; r < row_end; r++) {
        const char *dy = (const char *)a->grad_output + (r * a->grad_output_row_step + col_begin) * (ptrdiff_t)elsize;
        const char *x = (const char *)a->input + (r * a->input_row_step + col_begin) * (ptrdiff_t)elsize;
        const double mean = ln_load1_param_as_f64(dtype, a->mean, r);
        const double rstd = ln_load1_param_as_f64(dtype, a->rstd, r);
        const f64x8 mean_v = ln_splat_f64(mean), rstd_v = ln_splat_f64(rstd);
        ptrdiff_t j = 0;
        for (; j + 16 <= cols; j += 16) {
            f64x8 g_lo, g_hi, x_lo, x_hi;
            LN_FN(load16_as_f64)(dtype, dy, j, &g_lo, &g_hi);
            LN_FN(load16_as_f64)(dtype, x, j, &x_lo, &x_hi);
            if (dweight) {
                f64x8 acc_lo = ln_load_f64x8(dweight + j), acc_hi = ln_load_f64x8(dweight + j + 8);
                acc_lo += g_lo * ((x_lo - mean_v) * rstd_v);
                acc_hi += g_hi * ((x_hi - mean_v) * rstd_v);
                ln_store_f64x8(dweight + j, acc_lo);
                ln_store_f64x8(dweight + j + 8, acc_hi);
            }
            if (dbias) {
                ln_store_f64x8(dbias + j, ln_load_f64x8(dbias + j) + g_lo);
                ln_store_f64x8(dbias + j + 8, ln_load_f64x8(dbias + j + 8) + g_hi);
            }
        }
        for (; j < cols; j++) {
            const double g = ln_load1_as_f64(dtype, dy, j);
            if (dweight) {
                dweight[j] += g * ((ln_load1_as_f64(dtype, x, j) - mean) * rstd);
            }
            if (dbias) {
                dbias[j] += g;
            }
        }
    }
}

#define LN_BACKWARD_FOR(suffix, DTYPE)                                                           \
    static void LN_FN(backward_row_##suffix)(const void *dy, const void *x, void *dx, ptrdiff_t n, \
                                             double mean, double rstd, const void *weight)       \
    {                                                                                            \
        LN_FN(backward_row)(DTYPE, dy, x, dx, n, mean, rstd, weight);                            \
    }                                                                                            \
    static void LN_FN(param_grads_##suffix)(const ln_backward_args *a, ptrdiff_t row_begin,      \
                                            ptrdiff_t row_end, ptrdiff_t col_begin,              \
                                            ptrdiff_t col_end, double *dweight, double *dbias)   \
    {                                                                                            \
        LN_FN(param_grads)(DTYPE, a, row_begin, row_end, col_begin, col_end, dweight, dbias);    \
    }

LN_BACKWARD_FOR(f16, LN_F16)
LN_BACKWARD_FOR(f32, LN_F32)
LN_BACKWARD_FOR(f64, LN_F64)
#undef LN_BACKWARD_FOR

static const ln_kernel_table LN_FN(kernels) = {
    .chunk_moments = {LN_FN(chunk_moments_f16), LN_FN(chunk_moments_f32), LN_FN(chunk_moments_f64)},
    .normalize_row = {LN_FN(normalize_row_f16), LN_FN(normalize_row_f32), LN_FN(normalize_row_f64)},
    .backward_row = {LN_FN(backward_row_f16), LN_FN(backward_row_f32), LN_FN(backward_row_f64)},
    .param_grads = {LN_FN(param_grads_f16), LN_FN(param_grads_f32), LN_FN(param_grads_f64)},
};

#undef LN_FN
#undef LN_CAT
#undef LN_CAT_
