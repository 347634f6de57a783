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
 * The kernels work on groups of 16 elements (GD: 16 float64, GF: 16 float32) held
 * in the level's native registers (16 scalars, 4 or 2 __m256d, 2 __m512d); the
 * group primitives below are the only per-level code.  Every level performs the same IEEE operations in the same
 * order -- 16 accumulation lanes, lane k taking elements i with i % 16 == k, then a
 * fixed reduction tree -- so every level returns bit-identical results.
 *
 * Forward, per row of N elements (statistics in float64):
 *
 *     chunk c (<= LN_CHUNK elements, K = its first element, one pass):
 *            s1 = sum(x - K),  s2 = sum((x - K)^2)
 *            moments_c = (n_c, K + s1/n_c, s2 - s1^2/n_c)
 *            (float16 data: x - K and its square in float32, summed in float32 over blocks
 *            of 8 groups, the block sums added in float64)
 *     row:   moments = chan_merge(moments_0, moments_1, ...)      (left to right)
 *            rstd = 1 / sqrt(m2 / N + eps)
 *     float32/float16 output, computed in float32 with a two-part mean:
 *            mean_hi = float(mean),  mean_lo = float(mean - mean_hi)
 *            a_j = float(rstd) * weight_j
 *            y_j = fma((x_j - mean_hi) - mean_lo, a_j, bias_j)
 *     float64 output:  y_j = fma(x_j - mean, rstd * weight_j, bias_j)
 *
 * Backward, per row (g = dy * weight, xhat = (x - mean) * rstd, N elements):
 *
 *     y = xhat * w + b,  xhat = (x - mean) * rstd,  so with dL/dy = dy:
 *     dx_j = rstd * (g_j - mean(g) - xhat_j * mean(g * xhat))
 *     dweight_j = sum over rows of dy_j * xhat_j,   dbias_j = sum over rows of dy_j
 *
 *     pass 1: the row sums of g and g * xhat (float64 lanes; float32 products summed
 *             in float32 over short blocks for float16/float32 data)
 *     pass 2: dx (float32 arithmetic for float16/float32 data, float64 for float64),
 *             and dy * xhat, dy added into float64 column sums, LN_GRAD_ROWS rows at a time
 */

#define LN_CAT_(a, b) a##_##b
#define LN_CAT(a, b) LN_CAT_(a, b)
#define LN_FN(name) LN_CAT(name, LN_ISA)

/* ------------------------------------------------------------------------ */
/* Per-level primitives on groups of 16 elements                             */
/* ------------------------------------------------------------------------ */

/* A group holds 16 consecutive elements in native registers: gd as float64,
   gf as float32.  Storing a group writes its elements in order, which is what
   makes "lane k takes elements i % 16 == k" hold at every level. */
#if LN_ISA_LEVEL == 0
typedef double LN_FN(vd);                 /* one float64 */
typedef float LN_FN(vf);                  /* one float32 */
#define LN_VD_PER_GROUP 16
#define LN_VF_PER_GROUP 16
#elif LN_ISA_LEVEL == 1
typedef double LN_FN(vd) __attribute__((vector_size(32)));   /* __m256d */
typedef float LN_FN(vf) __attribute__((vector_size(32)));    /* __m256 */
#define LN_VD_PER_GROUP 4
#define LN_VF_PER_GROUP 2
#else
typedef double LN_FN(vd) __attribute__((vector_size(64)));   /* __m512d */
typedef float LN_FN(vf) __attribute__((vector_size(64)));    /* __m512 */
#define LN_VD_PER_GROUP 2
#define LN_VF_PER_GROUP 1
#endif

#if LN_ISA_LEVEL == 1
#define LN_STREAM_PS(p, v) _mm256_stream_ps((p), (__m256)(v))
#define LN_STREAM_PD(p, v) _mm256_stream_pd((p), (__m256d)(v))
#elif LN_ISA_LEVEL == 2
#define LN_STREAM_PS(p, v) _mm512_stream_ps((p), (__m512)(v))
#define LN_STREAM_PD(p, v) _mm512_stream_pd((p), (__m512d)(v))
#endif

typedef struct { LN_FN(vd) v[LN_VD_PER_GROUP]; } LN_FN(gd);
typedef struct { LN_FN(vf) v[LN_VF_PER_GROUP]; } LN_FN(gf);
#define GD LN_FN(gd)
#define GF LN_FN(gf)
#define FOR_VD(k) for (int k = 0; k < LN_VD_PER_GROUP; k++)
#define FOR_VF(k) for (int k = 0; k < LN_VF_PER_GROUP; k++)

static LN_ALWAYS_INLINE GD LN_FN(gd_splat)(double value)
{
    GD r;
    FOR_VD(k) { r.v[k] = (LN_FN(vd)){0} + value; }
    return r;
}

static LN_ALWAYS_INLINE GD LN_FN(gd_add)(GD a, GD b) { FOR_VD(k) { a.v[k] += b.v[k]; } return a; }
static LN_ALWAYS_INLINE GD LN_FN(gd_sub)(GD a, GD b) { FOR_VD(k) { a.v[k] -= b.v[k]; } return a; }
static LN_ALWAYS_INLINE GD LN_FN(gd_mul)(GD a, GD b) { FOR_VD(k) { a.v[k] *= b.v[k]; } return a; }
static LN_ALWAYS_INLINE GD LN_FN(gd_div)(GD a, GD b) { FOR_VD(k) { a.v[k] /= b.v[k]; } return a; }

/* Unaligned, aliasing-safe views of memory as native vectors. */
typedef LN_FN(vd) LN_FN(vd_mem) __attribute__((aligned(1), may_alias));
typedef LN_FN(vf) LN_FN(vf_mem) __attribute__((aligned(1), may_alias));
#define LN_VD_LANES (16 / LN_VD_PER_GROUP)
#define LN_VF_LANES (16 / LN_VF_PER_GROUP)

static LN_ALWAYS_INLINE GD LN_FN(gd_load)(const double *p)
{
    GD r;
    FOR_VD(k) { r.v[k] = *(const LN_FN(vd_mem) *)(p + LN_VD_LANES * k); }
    return r;
}

static LN_ALWAYS_INLINE void LN_FN(gd_store)(double *p, GD a)
{
    FOR_VD(k) { *(LN_FN(vd_mem) *)(p + LN_VD_LANES * k) = a.v[k]; }
}

static LN_ALWAYS_INLINE GF LN_FN(gf_splat)(float value)
{
    GF r;
    FOR_VF(k) { r.v[k] = (LN_FN(vf)){0} + value; }
    return r;
}

static LN_ALWAYS_INLINE GF LN_FN(gf_sub)(GF a, GF b) { FOR_VF(k) { a.v[k] -= b.v[k]; } return a; }
static LN_ALWAYS_INLINE GF LN_FN(gf_add)(GF a, GF b) { FOR_VF(k) { a.v[k] += b.v[k]; } return a; }
static LN_ALWAYS_INLINE GF LN_FN(gf_mul)(GF a, GF b) { FOR_VF(k) { a.v[k] *= b.v[k]; } return a; }

static LN_ALWAYS_INLINE GF LN_FN(gf_load)(const float *p)
{
    GF r;
    FOR_VF(k) { r.v[k] = *(const LN_FN(vf_mem) *)(p + LN_VF_LANES * k); }
    return r;
}

static LN_ALWAYS_INLINE void LN_FN(gf_store)(float *p, GF a)
{
    FOR_VF(k) { *(LN_FN(vf_mem) *)(p + LN_VF_LANES * k) = a.v[k]; }
}

#if LN_ISA_LEVEL == 0

static LN_ALWAYS_INLINE GD LN_FN(gd_load_f32)(const float *p)
{
    GD r;
    FOR_VD(k) { r.v[k] = (double)p[k]; }
    return r;
}

static LN_ALWAYS_INLINE GD LN_FN(gd_sqrt)(GD a)
{
    FOR_VD(k) { a.v[k] = sqrt(a.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GD LN_FN(gd_fma)(GD a, GD b, GD c)
{
    FOR_VD(k) { a.v[k] = fma(a.v[k], b.v[k], c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GF LN_FN(gf_fma)(GF a, GF b, GF c)
{
    FOR_VF(k) { a.v[k] = fmaf(a.v[k], b.v[k], c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GD LN_FN(gf_widen)(GF a)
{
    GD r;
    FOR_VD(k) { r.v[k] = (double)a.v[k]; }
    return r;
}

static LN_ALWAYS_INLINE GF LN_FN(gd_narrow)(GD a)
{
    GF r;
    FOR_VF(k) { r.v[k] = (float)a.v[k]; }
    return r;
}

static LN_ALWAYS_INLINE GF LN_FN(gf_load_f16)(const uint16_t *p)
{
    GF r;
    FOR_VF(k) { r.v[k] = ln_half_to_float(p[k]); }
    return r;
}

static LN_ALWAYS_INLINE void LN_FN(gf_store_f16)(uint16_t *p, GF a)
{
    FOR_VF(k) { p[k] = ln_float_to_half(a.v[k]); }
}

#elif LN_ISA_LEVEL == 1

static LN_ALWAYS_INLINE GD LN_FN(gd_load_f32)(const float *p)
{
    GD r;
    FOR_VD(k) { r.v[k] = (LN_FN(vd))_mm256_cvtps_pd(_mm_loadu_ps(p + 4 * k)); }
    return r;
}

static LN_ALWAYS_INLINE GD LN_FN(gd_sqrt)(GD a)
{
    FOR_VD(k) { a.v[k] = (LN_FN(vd))_mm256_sqrt_pd((__m256d)a.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GD LN_FN(gd_fma)(GD a, GD b, GD c)
{
    FOR_VD(k) { a.v[k] = (LN_FN(vd))_mm256_fmadd_pd((__m256d)a.v[k], (__m256d)b.v[k], (__m256d)c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GF LN_FN(gf_fma)(GF a, GF b, GF c)
{
    FOR_VF(k) { a.v[k] = (LN_FN(vf))_mm256_fmadd_ps((__m256)a.v[k], (__m256)b.v[k], (__m256)c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GD LN_FN(gf_widen)(GF a)
{
    GD r;
    FOR_VF(k) {
        r.v[2 * k] = (LN_FN(vd))_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)a.v[k]));
        r.v[2 * k + 1] = (LN_FN(vd))_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)a.v[k], 1));
    }
    return r;
}

static LN_ALWAYS_INLINE GF LN_FN(gd_narrow)(GD a)
{
    GF r;
    FOR_VF(k) {
        __m128 lo = _mm256_cvtpd_ps((__m256d)a.v[2 * k]);
        __m128 hi = _mm256_cvtpd_ps((__m256d)a.v[2 * k + 1]);
        r.v[k] = (LN_FN(vf))_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
    }
    return r;
}

static LN_ALWAYS_INLINE GF LN_FN(gf_load_f16)(const uint16_t *p)
{
    GF r;
    FOR_VF(k) { r.v[k] = (LN_FN(vf))_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * k))); }
    return r;
}

static LN_ALWAYS_INLINE void LN_FN(gf_store_f16)(uint16_t *p, GF a)
{
    FOR_VF(k) {
        _mm_storeu_si128((__m128i *)(p + 8 * k), _mm256_cvtps_ph((__m256)a.v[k], _MM_FROUND_TO_NEAREST_INT));
    }
}

#else

static LN_ALWAYS_INLINE GD LN_FN(gd_load_f32)(const float *p)
{
    GD r;
    FOR_VD(k) { r.v[k] = (LN_FN(vd))_mm512_cvtps_pd(_mm256_loadu_ps(p + 8 * k)); }
    return r;
}

static LN_ALWAYS_INLINE GD LN_FN(gd_sqrt)(GD a)
{
    FOR_VD(k) { a.v[k] = (LN_FN(vd))_mm512_sqrt_pd((__m512d)a.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GD LN_FN(gd_fma)(GD a, GD b, GD c)
{
    FOR_VD(k) { a.v[k] = (LN_FN(vd))_mm512_fmadd_pd((__m512d)a.v[k], (__m512d)b.v[k], (__m512d)c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GF LN_FN(gf_fma)(GF a, GF b, GF c)
{
    FOR_VF(k) { a.v[k] = (LN_FN(vf))_mm512_fmadd_ps((__m512)a.v[k], (__m512)b.v[k], (__m512)c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE GD LN_FN(gf_widen)(GF a)
{
    GD r;
    const __m512 v = (__m512)a.v[0];
    r.v[0] = (LN_FN(vd))_mm512_cvtps_pd(_mm512_castps512_ps256(v));
    r.v[1] = (LN_FN(vd))_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return r;
}

static LN_ALWAYS_INLINE GF LN_FN(gd_narrow)(GD a)
{
    GF r;
    const __m256 lo = _mm512_cvtpd_ps((__m512d)a.v[0]);
    const __m256 hi = _mm512_cvtpd_ps((__m512d)a.v[1]);
    r.v[0] = (LN_FN(vf))_mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
    return r;
}

static LN_ALWAYS_INLINE GF LN_FN(gf_load_f16)(const uint16_t *p)
{
    GF r;
    r.v[0] = (LN_FN(vf))_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return r;
}

static LN_ALWAYS_INLINE void LN_FN(gf_store_f16)(uint16_t *p, GF a)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)a.v[0], _MM_FROUND_TO_NEAREST_INT));
}

#endif

#if LN_ISA_LEVEL > 0
/* A group stored by 16-byte non-temporal stores (SSE2 movntpd/movntps): p must be 16-byte
   aligned, which NumPy's allocations and rows of a multiple of 16 bytes guarantee where a
   32- or 64-byte alignment would not.  The caller ends with _mm_sfence(). */
static LN_ALWAYS_INLINE void LN_FN(stream16_256)(char *p, __m256 v)
{
    _mm_stream_ps((float *)p, _mm256_castps256_ps128(v));
    _mm_stream_ps((float *)(p + 16), _mm256_extractf128_ps(v, 1));
}
static LN_ALWAYS_INLINE void LN_FN(gd_stream16)(double *p, GD a)
{
#if LN_ISA_LEVEL == 1
    FOR_VD(k) { LN_FN(stream16_256)((char *)(p + 4 * k), _mm256_castpd_ps((__m256d)a.v[k])); }
#else
    FOR_VD(k) {
        const __m512d v = (__m512d)a.v[k];
        LN_FN(stream16_256)((char *)(p + 8 * k), _mm256_castpd_ps(_mm512_castpd512_pd256(v)));
        LN_FN(stream16_256)((char *)(p + 8 * k + 4), _mm256_castpd_ps(_mm512_extractf64x4_pd(v, 1)));
    }
#endif
}
static LN_ALWAYS_INLINE void LN_FN(gf_stream16)(float *p, GF a)
{
#if LN_ISA_LEVEL == 1
    FOR_VF(k) { LN_FN(stream16_256)((char *)(p + 8 * k), (__m256)a.v[k]); }
#else
    const __m512d v = _mm512_castps_pd((__m512)a.v[0]);
    LN_FN(stream16_256)((char *)p, _mm256_castpd_ps(_mm512_castpd512_pd256(v)));
    LN_FN(stream16_256)((char *)(p + 8), _mm256_castpd_ps(_mm512_extractf64x4_pd(v, 1)));
#endif
}
#endif

/* ------------------------------------------------------------------------ */
/* Loads and stores by element type (dtype is a constant after inlining)     */
/* ------------------------------------------------------------------------ */

/* 16 elements from p[i] as float32 (float16 and float32 only). */
static LN_ALWAYS_INLINE GF LN_FN(load_as_f32)(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    if (dtype == LN_F16) {
        return LN_FN(gf_load_f16)((const uint16_t *)p + i);
    }
    return LN_FN(gf_load)((const float *)p + i);
}

static LN_ALWAYS_INLINE void LN_FN(store_from_f32)(ln_dtype dtype, void *p, ptrdiff_t i, GF v)
{
    if (dtype == LN_F16) {
        LN_FN(gf_store_f16)((uint16_t *)p + i, v);
    }
    else {
        LN_FN(gf_store)((float *)p + i, v);
    }
}

/* 16 elements from p[i] as float64. */
static LN_ALWAYS_INLINE GD LN_FN(load_as_f64)(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    if (dtype == LN_F64) {
        return LN_FN(gd_load)((const double *)p + i);
    }
    if (dtype == LN_F32) {
        return LN_FN(gd_load_f32)((const float *)p + i);
    }
    return LN_FN(gf_widen)(LN_FN(gf_load_f16)((const uint16_t *)p + i));
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */
/* ------------------------------------------------------------------------ */

/* Mean and M2 of one chunk of 1 <= n <= LN_CHUNK elements in one pass, in float64,
   with the sums taken about the chunk's first element K.  Because K is one of the data,
   M2 >= (K - mean)^2, so S2 = M2 + n (mean - K)^2 is at most (n + 1) M2 and the
   subtraction below loses at most log2(n + 1) bits of float64's 53; x - K is exact for
   float16/float32 data.  Even and odd groups use separate accumulators, so no add waits
   on the one before it.  The accumulator is a type of its own so that the pipelined row
   loop (forward_rows_pipelined) performs exactly the same operations. */
#define LN_F16_BLOCK 8
typedef struct {
    double shift;
    GD shift_v, s1_even, s2_even, s1_odd, s2_odd;
    /* float16 data: float32 sums over blocks of LN_F16_BLOCK groups, added into s1_even and
       s2_even (float64) at the end of each block */
    GF shift_f, block_s1_even, block_s2_even, block_s1_odd, block_s2_odd;
} LN_FN(moments_acc);
static LN_ALWAYS_INLINE void LN_FN(moments_start)(LN_FN(moments_acc) *acc, ln_dtype dtype, const void *x)
{
    acc->shift = ln_load1_as_f64(dtype, x, 0);
    acc->shift_v = LN_FN(gd_splat)(acc->shift);
    acc->s1_even = acc->s2_even = acc->s1_odd = acc->s2_odd = LN_FN(gd_splat)(0.0);
    if (dtype == LN_F16) {
        acc->shift_f = LN_FN(gf_splat)((float)acc->shift);
        acc->block_s1_even = acc->block_s2_even = acc->block_s1_odd = acc->block_s2_odd =
            LN_FN(gf_splat)(0.0f);
    }
}
/* float16: the block's float32 sums into the float64 ones. */
static LN_ALWAYS_INLINE void LN_FN(moments_flush_f16)(LN_FN(moments_acc) *acc)
{
    acc->s1_even = LN_FN(gd_add)(acc->s1_even,
                                 LN_FN(gf_widen)(LN_FN(gf_add)(acc->block_s1_even, acc->block_s1_odd)));
    acc->s2_even = LN_FN(gd_add)(acc->s2_even,
                                 LN_FN(gf_widen)(LN_FN(gf_add)(acc->block_s2_even, acc->block_s2_odd)));
    acc->block_s1_even = acc->block_s2_even = acc->block_s1_odd = acc->block_s2_odd =
        LN_FN(gf_splat)(0.0f);
}
/* Adds the group of 16 at x[i]; `odd` picks the accumulators: (i / 16) % 2. */
static LN_ALWAYS_INLINE void LN_FN(moments_add)(LN_FN(moments_acc) *acc, ln_dtype dtype, const void *x,
                                                ptrdiff_t i, int odd)
{
    if (dtype == LN_F16) {
        /* x - K is exact in float32 for float16 values of similar size, and the squares of
           such differences are too; the float32 block sums of 8 terms round at 2^-24
           relative, far below float16's 2^-11 (the float64 path made this case
           conversion-bound: 2048x1024 float16, AVX2, 2 threads: 488 -> 351 us). */
        const GF d = LN_FN(gf_sub)(LN_FN(load_as_f32)(dtype, x, i), acc->shift_f);
        if (odd) {
            acc->block_s1_odd = LN_FN(gf_add)(acc->block_s1_odd, d);
            acc->block_s2_odd = LN_FN(gf_fma)(d, d, acc->block_s2_odd);
        }
        else {
            acc->block_s1_even = LN_FN(gf_add)(acc->block_s1_even, d);
            acc->block_s2_even = LN_FN(gf_fma)(d, d, acc->block_s2_even);
        }
        if ((i / 16) % LN_F16_BLOCK == LN_F16_BLOCK - 1) {
            LN_FN(moments_flush_f16)(acc);
        }
        return;
    }
    const GD d = LN_FN(gd_sub)(LN_FN(load_as_f64)(dtype, x, i), acc->shift_v);
    if (odd) {
        acc->s1_odd = LN_FN(gd_add)(acc->s1_odd, d);
        acc->s2_odd = LN_FN(gd_fma)(d, d, acc->s2_odd);
    }
    else {
        acc->s1_even = LN_FN(gd_add)(acc->s1_even, d);
        acc->s2_even = LN_FN(gd_fma)(d, d, acc->s2_even);
    }
}
/* The moments, once every whole group before x[i] has been added: the elements from i
   to n go into the lanes one by one. */
static LN_ALWAYS_INLINE ln_moments LN_FN(moments_finish)(LN_FN(moments_acc) *acc, ln_dtype dtype,
                                                         const void *x, ptrdiff_t i, ptrdiff_t n)
{
    double s1_lanes[16], s2_lanes[16];
    if (dtype == LN_F16) {
        LN_FN(moments_flush_f16)(acc);
    }
    LN_FN(gd_store)(s1_lanes, LN_FN(gd_add)(acc->s1_even, acc->s1_odd));
    LN_FN(gd_store)(s2_lanes, LN_FN(gd_add)(acc->s2_even, acc->s2_odd));
    for (; i < n; i++) {
        const double d = ln_load1_as_f64(dtype, x, i) - acc->shift;
        s1_lanes[i & 15] += d;
        s2_lanes[i & 15] = fma(d, d, s2_lanes[i & 15]);
    }
    const double sum1 = ln_sum_lanes(s1_lanes), sum2 = ln_sum_lanes(s2_lanes);
    const double mean_offset = sum1 / (double)n;
    ln_moments m = {(double)n, acc->shift + mean_offset, sum2 - sum1 * mean_offset};
    return m;
}
static LN_ALWAYS_INLINE ln_moments LN_FN(chunk_moments)(ln_dtype dtype, const void *x, ptrdiff_t n)
{
    LN_FN(moments_acc) acc;
    LN_FN(moments_start)(&acc, dtype, x);
    ptrdiff_t i = 0;
    for (; i + 32 <= n; i += 32) {
        LN_FN(moments_add)(&acc, dtype, x, i, 0);
        LN_FN(moments_add)(&acc, dtype, x, i + 16, 1);
    }
    if (i + 16 <= n) {
        LN_FN(moments_add)(&acc, dtype, x, i, 0);
        i += 16;
    }
    return LN_FN(moments_finish)(&acc, dtype, x, i, n);
}

/* Moments of a whole row: its chunks, merged left to right. */
static LN_ALWAYS_INLINE ln_moments LN_FN(row_moments)(ln_dtype dtype, const char *x, ptrdiff_t n)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    ln_moments m = LN_FN(chunk_moments)(dtype, x, n < LN_CHUNK ? n : LN_CHUNK);
    for (ptrdiff_t start = LN_CHUNK; start < n; start += LN_CHUNK) {
        const ptrdiff_t len = n - start < LN_CHUNK ? n - start : LN_CHUNK;
        m = ln_merge(m, LN_FN(chunk_moments)(dtype, x + start * elsize, len));
    }
    return m;
}

/* One row's normalization, per element:
       float16/float32: y = fma((x - mean_hi) - mean_lo, float(rstd) * w, b), computed in
                        float32, mean_hi = float(mean), mean_lo = float(mean - mean_hi)
       float64:         y = fma(x - mean, rstd * w, b)
   weight and bias are of the param type (float32, or float64 for float64 data), or NULL. */
typedef struct {
    float mean_hi, mean_lo, scale;
    GF mean_hi_v, mean_lo_v, scale_v;
    double mean, rstd;
    GD mean_v, rstd_v;
} LN_FN(row_norm);
static LN_ALWAYS_INLINE LN_FN(row_norm) LN_FN(row_norm_of)(ln_dtype dtype, double mean, double rstd)
{
    LN_FN(row_norm) k = {0};
    if (dtype == LN_F64) {
        k.mean = mean; k.rstd = rstd;
        k.mean_v = LN_FN(gd_splat)(mean); k.rstd_v = LN_FN(gd_splat)(rstd);
    }
    else {
        k.mean_hi = (float)mean; k.mean_lo = (float)(mean - (double)k.mean_hi); k.scale = (float)rstd;
        k.mean_hi_v = LN_FN(gf_splat)(k.mean_hi); k.mean_lo_v = LN_FN(gf_splat)(k.mean_lo); k.scale_v = LN_FN(gf_splat)(k.scale);
    }
    return k;
}
/* y[i .. i + 16) from x[i .. i + 16). */
static LN_ALWAYS_INLINE void LN_FN(normalize_group_to)(ln_dtype dtype, const LN_FN(row_norm) *k, const void *x,
                                                       void *y, ptrdiff_t i, const void *weight, const void *bias,
                                                       int streaming)
{
    if (dtype == LN_F64) {
        const GD centred = LN_FN(gd_sub)(LN_FN(gd_load)((const double *)x + i), k->mean_v);
        const GD a = weight ? LN_FN(gd_mul)(LN_FN(gd_load)((const double *)weight + i), k->rstd_v) : k->rstd_v;
        const GD b = bias ? LN_FN(gd_load)((const double *)bias + i) : LN_FN(gd_splat)(0.0);
        const GD value = LN_FN(gd_fma)(centred, a, b);
#if LN_ISA_LEVEL > 0
        if (streaming) {
            FOR_VD(j) { LN_STREAM_PD((double *)y + i + LN_VD_LANES * j, value.v[j]); }
            return;
        }
#endif
        LN_FN(gd_store)((double *)y + i, value);
    }
    else {
        const GF centred = LN_FN(gf_sub)(LN_FN(gf_sub)(LN_FN(load_as_f32)(dtype, x, i), k->mean_hi_v), k->mean_lo_v);
        const GF a = weight ? LN_FN(gf_mul)(LN_FN(gf_load)((const float *)weight + i), k->scale_v) : k->scale_v;
        const GF b = bias ? LN_FN(gf_load)((const float *)bias + i) : LN_FN(gf_splat)(0.0f);
        const GF value = LN_FN(gf_fma)(centred, a, b);
#if LN_ISA_LEVEL > 0
        if (streaming && dtype == LN_F32) {
            FOR_VF(j) { LN_STREAM_PS((float *)y + i + LN_VF_LANES * j, value.v[j]); }
            return;
        }
#endif
        LN_FN(store_from_f32)(dtype, y, i, value);
    }
}

static LN_ALWAYS_INLINE void LN_FN(normalize_group)(ln_dtype dtype, const LN_FN(row_norm) *k, const void *x,
                                                    void *y, ptrdiff_t i, const void *weight, const void *bias)
{
    LN_FN(normalize_group_to)(dtype, k, x, y, i, weight, bias, 0);
}

/* y[i] from x[i]: the same arithmetic, one element. */
static LN_ALWAYS_INLINE void LN_FN(normalize_one)(ln_dtype dtype, const LN_FN(row_norm) *k, const void *x,
                                                  void *y, ptrdiff_t i, const void *weight, const void *bias)
{
    if (dtype == LN_F64) {
        const double a = weight ? ((const double *)weight)[i] * k->rstd : k->rstd;
        ((double *)y)[i] = fma(((const double *)x)[i] - k->mean, a, bias ? ((const double *)bias)[i] : 0.0);
        return;
    }
    const float centred = ((float)ln_load1_as_f64(dtype, x, i) - k->mean_hi) - k->mean_lo;
    const float a = weight ? ((const float *)weight)[i] * k->scale : k->scale;
    const float out = fmaf(centred, a, bias ? ((const float *)bias)[i] : 0.0f);
    if (dtype == LN_F16) { ((uint16_t *)y)[i] = ln_float_to_half(out); }
    else { ((float *)y)[i] = out; }
}
static LN_ALWAYS_INLINE void LN_FN(normalize)(ln_dtype dtype, const void *x, void *y, ptrdiff_t n,
                                              double mean, double rstd, const void *weight, const void *bias)
{
    const LN_FN(row_norm) k = LN_FN(row_norm_of)(dtype, mean, rstd);
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) { LN_FN(normalize_group)(dtype, &k, x, y, i, weight, bias); }
    for (; i < n; i++) { LN_FN(normalize_one)(dtype, &k, x, y, i, weight, bias); }
}

/* normalize() with non-temporal stores: for rows too long to stay in cache, the output
   bypasses the caches, so it does not evict the input that the loop is about to read
   again, and costs no read for ownership.  The head up to a 64-byte boundary and the
   tail go one element at a time; the values are normalize()'s.  float16 output is stored
   as usual (its 32-byte groups are half a cache line): only float32 and float64 stream. */
static LN_ALWAYS_INLINE void LN_FN(normalize_streaming)(ln_dtype dtype, const void *x, void *y, ptrdiff_t n,
                                                        double mean, double rstd, const void *weight,
                                                        const void *bias)
{
    const LN_FN(row_norm) k = LN_FN(row_norm_of)(dtype, mean, rstd);
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    ptrdiff_t i = 0;
    for (; i < n && ((uintptr_t)((char *)y + i * elsize) & 63) != 0; i++) {
        LN_FN(normalize_one)(dtype, &k, x, y, i, weight, bias);
    }
    for (; i + 16 <= n; i += 16) {
        LN_FN(normalize_group_to)(dtype, &k, x, y, i, weight, bias, 1);
    }
    for (; i < n; i++) {
        LN_FN(normalize_one)(dtype, &k, x, y, i, weight, bias);
    }
#if LN_ISA_LEVEL > 0
    _mm_sfence();  /* streaming stores are weakly ordered: finish them before y is handed on */
#endif
}

/* The weight/bias branches are hoisted out of the loops by compiling one copy per
   case (the compiler drops the dead branch of each). */
#define LN_NORMALIZE_CASES(call, weight, bias)                                  \
    do {                                                                        \
        if (weight && bias) { call(weight, bias); }                             \
        else if (weight) { call(weight, NULL); }                                \
        else if (bias) { call(NULL, bias); }                                    \
        else { call(NULL, NULL); }                                              \
    } while (0)

static ln_moments LN_FN(chunk_moments_of_f16)(const void *x, ptrdiff_t n)
{
    return LN_FN(chunk_moments)(LN_F16, x, n);
}

static ln_moments LN_FN(chunk_moments_of_f32)(const void *x, ptrdiff_t n)
{
    return LN_FN(chunk_moments)(LN_F32, x, n);
}

static ln_moments LN_FN(chunk_moments_of_f64)(const void *x, ptrdiff_t n)
{
    return LN_FN(chunk_moments)(LN_F64, x, n);
}

/* The row functions of the table, one per dtype and store kind, each with the
   weight/bias cases compiled apart. */
#define LN_NORMALIZE_ROW(name, normalize_fn, DTYPE)                                             \
    static void LN_FN(name)(const void *x, void *y, ptrdiff_t n, double mean, double rstd,      \
                            const void *weight, const void *bias)                               \
    {                                                                                           \
        if (weight && bias) {                                                                   \
            LN_FN(normalize_fn)(DTYPE, x, y, n, mean, rstd, weight, bias);                      \
        }                                                                                       \
        else if (weight) {                                                                      \
            LN_FN(normalize_fn)(DTYPE, x, y, n, mean, rstd, weight, NULL);                      \
        }                                                                                       \
        else if (bias) {                                                                        \
            LN_FN(normalize_fn)(DTYPE, x, y, n, mean, rstd, NULL, bias);                        \
        }                                                                                       \
        else {                                                                                  \
            LN_FN(normalize_fn)(DTYPE, x, y, n, mean, rstd, NULL, NULL);                        \
        }                                                                                       \
    }

LN_NORMALIZE_ROW(normalize_row_f16, normalize, LN_F16)
LN_NORMALIZE_ROW(normalize_row_f32, normalize, LN_F32)
LN_NORMALIZE_ROW(normalize_row_f64, normalize, LN_F64)
LN_NORMALIZE_ROW(normalize_row_streaming_f16, normalize_streaming, LN_F16)
LN_NORMALIZE_ROW(normalize_row_streaming_f32, normalize_streaming, LN_F32)
LN_NORMALIZE_ROW(normalize_row_streaming_f64, normalize_streaming, LN_F64)
#undef LN_NORMALIZE_ROW

static const ln_normalize_fn LN_FN(kernels_normalize_streaming)[3] = {
    LN_FN(normalize_row_streaming_f16), LN_FN(normalize_row_streaming_f32), LN_FN(normalize_row_streaming_f64)};

static const ln_normalize_fn LN_FN(normalize_rows_by_dtype)[3] = {
    LN_FN(normalize_row_f16), LN_FN(normalize_row_f32), LN_FN(normalize_row_f64)};

/* Rows shorter than one group (n < 16), where per-row overhead dominates.  Rows go
   in blocks of 16: per row, the textbook two passes in float64; per block, the
   divisions and square roots as one group operation (IEEE division and sqrt are
   correctly rounded, so lane and scalar results agree bit for bit). */
static LN_ALWAYS_INLINE void LN_FN(forward_short_rows)(ln_dtype dtype, const ln_forward_args *a,
                                                       ptrdiff_t begin, ptrdiff_t end)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), n = a->row_len;
    const GD n_v = LN_FN(gd_splat)((double)n), eps_v = LN_FN(gd_splat)(a->eps);
    const GD one_v = LN_FN(gd_splat)(1.0);
    for (ptrdiff_t block = begin; block < end; block += 16) {
        const ptrdiff_t rows = end - block < 16 ? end - block : 16;
        double values[16][16], firsts[16], means[16], m2s[16], rstds[16];
        for (ptrdiff_t k = 0; k < 16; k++) {
            /* sums about the first element, so that a constant row has mean == x exactly */
            double sum = 0.0;
            firsts[k] = 0.0;
            if (k < rows) {
                const char *x = (const char *)a->input + (block + k) * a->input_row_step * elsize;
                firsts[k] = ln_load1_as_f64(dtype, x, 0);
                for (ptrdiff_t i = 0; i < n; i++) {
                    values[k][i] = ln_load1_as_f64(dtype, x, i);
                    sum += values[k][i] - firsts[k];
                }
            }
            means[k] = sum;
        }
        LN_FN(gd_store)(means, LN_FN(gd_add)(LN_FN(gd_load)(firsts),
                                             LN_FN(gd_div)(LN_FN(gd_load)(means), n_v)));
        for (ptrdiff_t k = 0; k < 16; k++) {
            double m2 = 0.0;
            for (ptrdiff_t i = 0; k < rows && i < n; i++) {
                const double d = values[k][i] - means[k];
                m2 += d * d;
            }
            m2s[k] = m2;
        }
        const GD var = LN_FN(gd_div)(LN_FN(gd_load)(m2s), n_v);
        LN_FN(gd_store)(rstds, LN_FN(gd_div)(one_v, LN_FN(gd_sqrt)(LN_FN(gd_add)(var, eps_v))));
        for (ptrdiff_t k = 0; k < rows; k++) {
            const double mean = means[k];
            const double rstd = isfinite(mean) ? rstds[k] : NAN;
            char *y = (char *)a->output + (block + k) * n * elsize;
            ln_store_stats(a, block + k, mean, rstd);
            if (dtype == LN_F64) {
                const double *weight = a->weight, *bias = a->bias;
                for (ptrdiff_t i = 0; i < n; i++) {
                    const double scale = weight ? weight[i] * rstd : rstd;
                    ((double *)y)[i] = fma(values[k][i] - mean, scale, bias ? bias[i] : 0.0);
                }
            }
            else {
                const float *weight = a->weight, *bias = a->bias;
                const float mean_hi = (float)mean, mean_lo = (float)(mean - (double)mean_hi);
                const float scale = (float)rstd;
                for (ptrdiff_t i = 0; i < n; i++) {
                    const float centred = ((float)values[k][i] - mean_hi) - mean_lo;
                    const float out = fmaf(centred, weight ? weight[i] * scale : scale, bias ? bias[i] : 0.0f);
                    if (dtype == LN_F16) {
                        ((uint16_t *)y)[i] = ln_float_to_half(out);
                    }
                    else {
                        ((float *)y)[i] = out;
                    }
                }
            }
        }
    }
}

/* Rows of 16 to LN_CHUNK elements, software-pipelined: one loop normalizes row r - 1
   while it gathers the statistics of row r, so the statistics' float64 arithmetic and
   the normalized row's loads and stores overlap instead of taking turns (16x768 float32:
   3.2 -> 2.7 us).  It runs the same operations as chunk_moments and normalize, so the
   results are the plain path's, bit for bit. */
static LN_ALWAYS_INLINE void LN_FN(forward_rows_pipelined)(ln_dtype dtype, const ln_forward_args *a,
                                                           ptrdiff_t begin, ptrdiff_t end,
                                                           const void *weight, const void *bias)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), n = a->row_len;
    LN_FN(row_norm) previous = LN_FN(row_norm_of)(dtype, 0.0, 0.0);
    for (ptrdiff_t r = begin; r <= end; r++) {
        const int gather = r < end, emit = r > begin;
        /* pointers only to rows that exist: row end and row begin - 1 may lie outside */
        const char *x = gather ? (const char *)a->input + r * a->input_row_step * elsize : NULL;
        const char *x_previous =
            emit ? (const char *)a->input + (r - 1) * a->input_row_step * elsize : NULL;
        char *y_previous = emit ? (char *)a->output + (r - 1) * n * elsize : NULL;
        LN_FN(moments_acc) acc = {0};
        if (gather) {
            LN_FN(moments_start)(&acc, dtype, x);
        }
        ptrdiff_t i = 0;
        for (; i + 32 <= n; i += 32) {
            if (gather) {
                LN_FN(moments_add)(&acc, dtype, x, i, 0);
                LN_FN(moments_add)(&acc, dtype, x, i + 16, 1);
            }
            if (emit) {
                LN_FN(normalize_group)(dtype, &previous, x_previous, y_previous, i, weight, bias);
                LN_FN(normalize_group)(dtype, &previous, x_previous, y_previous, i + 16, weight, bias);
            }
        }
        if (i + 16 <= n) {
            if (gather) { LN_FN(moments_add)(&acc, dtype, x, i, 0); }
            if (emit) { LN_FN(normalize_group)(dtype, &previous, x_previous, y_previous, i, weight, bias); }
            i += 16;
        }
        for (ptrdiff_t j = i; emit && j < n; j++) {
            LN_FN(normalize_one)(dtype, &previous, x_previous, y_previous, j, weight, bias);
        }
        if (gather) {
            const ln_moments m = LN_FN(moments_finish)(&acc, dtype, x, i, n);
            const double rstd = ln_rstd_of(m, a->eps);
            ln_store_stats(a, r, m.mean, rstd);
            previous = LN_FN(row_norm_of)(dtype, m.mean, rstd);
        }
    }
}

/* Rows [begin, end): statistics, then the normalized row, while the row is in cache. */
static LN_ALWAYS_INLINE void LN_FN(forward_rows)(ln_dtype dtype, const ln_forward_args *a,
                                                 ptrdiff_t begin, ptrdiff_t end)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype);
    const ln_normalize_fn normalize = ln_forward_streams(a) ? LN_FN(kernels_normalize_streaming)[dtype]
                                                           : LN_FN(normalize_rows_by_dtype)[dtype];
    if (a->row_len < 16) {
        LN_FN(forward_short_rows)(dtype, a, begin, end);
        return;
    }
    if (a->row_len >= 16 && a->row_len <= LN_CHUNK) {
#define LN_CALL(w, b) LN_FN(forward_rows_pipelined)(dtype, a, begin, end, w, b)
        LN_NORMALIZE_CASES(LN_CALL, a->weight, a->bias);
#undef LN_CALL
        return;
    }
    for (ptrdiff_t r = begin; r < end; r++) {
        const char *x = (const char *)a->input + r * a->input_row_step * elsize;
        char *y = (char *)a->output + r * a->row_len * elsize;
        const ln_moments m = LN_FN(row_moments)(dtype, x, a->row_len);
        const double rstd = ln_rstd_of(m, a->eps);
        ln_store_stats(a, r, m.mean, rstd);
        ln_normalize_spans_backwards(normalize, dtype, x, y, 0, a->row_len, m.mean, rstd, a->weight, a->bias);
    }
}

static void LN_FN(forward_rows_f16)(const ln_forward_args *a, ptrdiff_t begin, ptrdiff_t end)
{
    LN_FN(forward_rows)(LN_F16, a, begin, end);
}

static void LN_FN(forward_rows_f32)(const ln_forward_args *a, ptrdiff_t begin, ptrdiff_t end)
{
    LN_FN(forward_rows)(LN_F32, a, begin, end);
}

static void LN_FN(forward_rows_f64)(const ln_forward_args *a, ptrdiff_t begin, ptrdiff_t end)
{
    LN_FN(forward_rows)(LN_F64, a, begin, end);
}

/* ------------------------------------------------------------------------ */
/* Backward                                                                  */
/* ------------------------------------------------------------------------ */

/* Pass 1 over a span of n elements of one row, for float16/float32 data:
       sums[0] = sum(g),  sums[1] = sum(g * xhat),   g = dy * weight, xhat = (x - mean) * rstd
   The products are formed in float32 (mean and rstd are float32 for this data, so x - mean
   is exact for x near the mean) and summed in float32 over blocks of LN_BLOCK groups whose
   sums are added in float64.  `weight` points at the span's first column, or is NULL. */
#define LN_BLOCK 8
static LN_ALWAYS_INLINE void LN_FN(grad_sums_single)(ln_dtype dtype, const void *dy, const void *x,
                                                  const float *weight, ptrdiff_t n, double mean,
                                                  double rstd, double sums[2])
{
    const GF mean_v = LN_FN(gf_splat)((float)mean);
    GD g_sum = LN_FN(gd_splat)(0.0), gc_sum = LN_FN(gd_splat)(0.0);
    double g_lanes[16], gc_lanes[16];
    ptrdiff_t i = 0;
    const GF zero_v = LN_FN(gf_splat)(0.0f);
    while (i + 16 <= n) {
        /* even and odd groups in separate accumulators, so no add waits on the one before */
        GF even_g = zero_v, even_gc = zero_v, odd_g = zero_v, odd_gc = zero_v;
        do {
            GF g = LN_FN(load_as_f32)(dtype, dy, i);
            if (weight) {
                g = LN_FN(gf_mul)(g, LN_FN(gf_load)(weight + i));
            }
            const GF centred = LN_FN(gf_sub)(LN_FN(load_as_f32)(dtype, x, i), mean_v);
            if ((i / 16) % 2 == 0) {
                even_g = LN_FN(gf_add)(even_g, g);
                even_gc = LN_FN(gf_fma)(g, centred, even_gc);
            }
            else {
                odd_g = LN_FN(gf_add)(odd_g, g);
                odd_gc = LN_FN(gf_fma)(g, centred, odd_gc);
            }
            i += 16;
        } while (i + 16 <= n && (i / 16) % LN_BLOCK != 0);
        g_sum = LN_FN(gd_add)(g_sum, LN_FN(gf_widen)(LN_FN(gf_add)(even_g, odd_g)));
        gc_sum = LN_FN(gd_add)(gc_sum, LN_FN(gf_widen)(LN_FN(gf_add)(even_gc, odd_gc)));
    }
    LN_FN(gd_store)(g_lanes, g_sum);
    LN_FN(gd_store)(gc_lanes, gc_sum);
    for (; i < n; i++) {
        float g = (float)ln_load1_as_f64(dtype, dy, i);
        if (weight) {
            g *= weight[i];
        }
        const float centred = (float)ln_load1_as_f64(dtype, x, i) - (float)mean;
        g_lanes[i & 15] += g;
        gc_lanes[i & 15] += g * centred;
    }
    sums[0] = ln_sum_lanes(g_lanes);
    sums[1] = ln_sum_lanes(gc_lanes) * rstd;
}
#undef LN_BLOCK

/* The same for float64 data, all in float64. */
static LN_ALWAYS_INLINE void LN_FN(grad_sums_double)(const double *dy, const double *x, const double *weight,
                                                  ptrdiff_t n, double mean, double rstd, double sums[2])
{
    const GD mean_v = LN_FN(gd_splat)(mean), rstd_v = LN_FN(gd_splat)(rstd);
    GD g_sum = LN_FN(gd_splat)(0.0), gx_sum = LN_FN(gd_splat)(0.0);
    double g_lanes[16], gx_lanes[16];
    ptrdiff_t i = 0;
    for (; i + 16 <= n; i += 16) {
        GD g = LN_FN(gd_load)(dy + i);
        if (weight) {
            g = LN_FN(gd_mul)(g, LN_FN(gd_load)(weight + i));
        }
        const GD xhat = LN_FN(gd_mul)(LN_FN(gd_sub)(LN_FN(gd_load)(x + i), mean_v), rstd_v);
        g_sum = LN_FN(gd_add)(g_sum, g);
        gx_sum = LN_FN(gd_add)(gx_sum, LN_FN(gd_mul)(g, xhat));
    }
    LN_FN(gd_store)(g_lanes, g_sum);
    LN_FN(gd_store)(gx_lanes, gx_sum);
    for (; i < n; i++) {
        const double g = weight ? dy[i] * weight[i] : dy[i];
        g_lanes[i & 15] += g;
        gx_lanes[i & 15] += g * ((x[i] - mean) * rstd);
    }
    sums[0] = ln_sum_lanes(g_lanes);
    sums[1] = ln_sum_lanes(gx_lanes);
}

static LN_ALWAYS_INLINE void LN_FN(grad_sums)(ln_dtype dtype, const void *dy, const void *x,
                                              const void *weight, ptrdiff_t n, double mean,
                                              double rstd, double sums[2])
{
    if (dtype == LN_F64) {
        LN_FN(grad_sums_double)(dy, x, weight, n, mean, rstd, sums);
    }
    else {
        LN_FN(grad_sums_single)(dtype, dy, x, weight, n, mean, rstd, sums);
    }
}

/* Pass 2 over one span of the rows of `group` (all pointers at the span's first column),
   given each row's g_mean = mean(g) and gx_mean = mean(g * xhat).  With xc = x - mean,
       dx_j       = rstd * ((g_j - g_mean) - xhat_j * gx_mean)
                  = fma(rstd, g_j, fma(-rstd^2 * gx_mean, xc_j, -rstd * g_mean))
       dweight_j += dy_j * xhat_j = fma(dy_j * xc_j, rstd, ...),   dbias_j += dy_j
   in float32 for float16/float32 data (the per-row constants rounded once from float64).
   dx, dweight and dbias may each be NULL.  A group's rows pass over a column together:
   their (at most LN_GRAD_ROWS) terms are summed in registers, and dweight and dbias, in
   float64, go to memory once per group instead of once per row. */
static LN_ALWAYS_INLINE void LN_FN(grad_apply_single)(ln_dtype dtype, const ln_grad_rows *group,
                                                      const float *weight, ptrdiff_t n,
                                                      double *dweight, double *dbias)
{
    GF mean_v[LN_GRAD_ROWS], rstd_v[LN_GRAD_ROWS], xc_scale_v[LN_GRAD_ROWS], offset_v[LN_GRAD_ROWS];
    float mean[LN_GRAD_ROWS], rstd[LN_GRAD_ROWS], xc_scale[LN_GRAD_ROWS], offset[LN_GRAD_ROWS];
    const int count = group->count;
    for (int k = 0; k < count; k++) {
        mean[k] = (float)group->mean[k];
        rstd[k] = (float)group->rstd[k];
        xc_scale[k] = (float)(-group->rstd[k] * group->rstd[k] * group->gx_mean[k]);
        offset[k] = (float)(-group->rstd[k] * group->g_mean[k]);
        mean_v[k] = LN_FN(gf_splat)(mean[k]);
        rstd_v[k] = LN_FN(gf_splat)(rstd[k]);
        xc_scale_v[k] = LN_FN(gf_splat)(xc_scale[k]);
        offset_v[k] = LN_FN(gf_splat)(offset[k]);
    }
    const int want_dx = group->dx[0] != NULL;
    ptrdiff_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const GF w = weight ? LN_FN(gf_load)(weight + j) : LN_FN(gf_splat)(1.0f);
        GF group_dweight = LN_FN(gf_splat)(0.0f), group_dbias = group_dweight;
        for (int k = 0; k < count; k++) {
            const GF dy_v = LN_FN(load_as_f32)(dtype, group->dy[k], j);
            const GF xc = LN_FN(gf_sub)(LN_FN(load_as_f32)(dtype, group->x[k], j), mean_v[k]);
            if (want_dx) {
                const GF g = weight ? LN_FN(gf_mul)(dy_v, w) : dy_v;
                const GF dx = LN_FN(gf_fma)(rstd_v[k], g, LN_FN(gf_fma)(xc_scale_v[k], xc, offset_v[k]));
#if LN_ISA_LEVEL > 0
                if (dtype == LN_F32 && group->stream_dx) {
                    LN_FN(gf_stream16)((float *)group->dx[k] + j, dx);
                }
                else
#endif
                LN_FN(store_from_f32)(dtype, group->dx[k], j, dx);
            }
            if (dweight) {
                group_dweight = LN_FN(gf_fma)(LN_FN(gf_mul)(dy_v, xc), rstd_v[k], group_dweight);
            }
            if (dbias) {
                group_dbias = LN_FN(gf_add)(group_dbias, dy_v);
            }
        }
        if (dweight) {
            LN_FN(gd_store)(dweight + j, LN_FN(gd_add)(LN_FN(gd_load)(dweight + j), LN_FN(gf_widen)(group_dweight)));
        }
        if (dbias) {
            LN_FN(gd_store)(dbias + j, LN_FN(gd_add)(LN_FN(gd_load)(dbias + j), LN_FN(gf_widen)(group_dbias)));
        }
    }
    for (; j < n; j++) {
        float group_dweight = 0.0f, group_dbias = 0.0f;
        for (int k = 0; k < count; k++) {
            const float dy_1 = (float)ln_load1_as_f64(dtype, group->dy[k], j);
            const float xc = (float)ln_load1_as_f64(dtype, group->x[k], j) - mean[k];
            if (want_dx) {
                const float g = weight ? dy_1 * weight[j] : dy_1;
                ln_store1_from_f64(dtype, group->dx[k], j, fmaf(rstd[k], g, fmaf(xc_scale[k], xc, offset[k])));
            }
            group_dweight = fmaf(dy_1 * xc, rstd[k], group_dweight);
            group_dbias += dy_1;
        }
        if (dweight) {
            dweight[j] += (double)group_dweight;
        }
        if (dbias) {
            dbias[j] += (double)group_dbias;
        }
    }
}

/* The same for float64 data, all in float64. */
static LN_ALWAYS_INLINE void LN_FN(grad_apply_double)(const ln_grad_rows *group, const double *weight,
                                                      ptrdiff_t n, double *dweight, double *dbias)
{
    GD mean_v[LN_GRAD_ROWS], rstd_v[LN_GRAD_ROWS], xc_scale_v[LN_GRAD_ROWS], offset_v[LN_GRAD_ROWS];
    double xc_scale[LN_GRAD_ROWS], offset[LN_GRAD_ROWS];
    const int count = group->count;
    for (int k = 0; k < count; k++) {
        xc_scale[k] = -group->rstd[k] * group->rstd[k] * group->gx_mean[k];
        offset[k] = -group->rstd[k] * group->g_mean[k];
        mean_v[k] = LN_FN(gd_splat)(group->mean[k]);
        rstd_v[k] = LN_FN(gd_splat)(group->rstd[k]);
        xc_scale_v[k] = LN_FN(gd_splat)(xc_scale[k]);
        offset_v[k] = LN_FN(gd_splat)(offset[k]);
    }
    const int want_dx = group->dx[0] != NULL;
    ptrdiff_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const GD w = weight ? LN_FN(gd_load)(weight + j) : LN_FN(gd_splat)(1.0);
        GD dweight_v = dweight ? LN_FN(gd_load)(dweight + j) : LN_FN(gd_splat)(0.0);
        GD dbias_v = dbias ? LN_FN(gd_load)(dbias + j) : LN_FN(gd_splat)(0.0);
        for (int k = 0; k < count; k++) {
            const GD dy_v = LN_FN(gd_load)((const double *)group->dy[k] + j);
            const GD xc = LN_FN(gd_sub)(LN_FN(gd_load)((const double *)group->x[k] + j), mean_v[k]);
            if (want_dx) {
                const GD g = weight ? LN_FN(gd_mul)(dy_v, w) : dy_v;
                const GD dx = LN_FN(gd_fma)(rstd_v[k], g, LN_FN(gd_fma)(xc_scale_v[k], xc, offset_v[k]));
#if LN_ISA_LEVEL > 0
                if (group->stream_dx) {
                    LN_FN(gd_stream16)((double *)group->dx[k] + j, dx);
                }
                else
#endif
                LN_FN(gd_store)((double *)group->dx[k] + j, dx);
            }
            if (dweight) {
                dweight_v = LN_FN(gd_fma)(LN_FN(gd_mul)(dy_v, xc), rstd_v[k], dweight_v);
            }
            if (dbias) {
                dbias_v = LN_FN(gd_add)(dbias_v, dy_v);
            }
        }
        if (dweight) {
            LN_FN(gd_store)(dweight + j, dweight_v);
        }
        if (dbias) {
            LN_FN(gd_store)(dbias + j, dbias_v);
        }
    }
    for (; j < n; j++) {
        for (int k = 0; k < count; k++) {
            const double dy_1 = ((const double *)group->dy[k])[j];
            const double xc = ((const double *)group->x[k])[j] - group->mean[k];
            if (want_dx) {
                const double g = weight ? dy_1 * weight[j] : dy_1;
                ((double *)group->dx[k])[j] = fma(group->rstd[k], g, fma(xc_scale[k], xc, offset[k]));
            }
            if (dweight) {
                dweight[j] = fma(dy_1 * xc, group->rstd[k], dweight[j]);
            }
            if (dbias) {
                dbias[j] += dy_1;
            }
        }
    }
}

static LN_ALWAYS_INLINE void LN_FN(grad_apply)(ln_dtype dtype, const ln_grad_rows *group,
                                               const void *weight, ptrdiff_t n, double *dweight,
                                               double *dbias)
{
    if (dtype == LN_F64) {
        LN_FN(grad_apply_double)(group, weight, n, dweight, dbias);
    }
    else {
        LN_FN(grad_apply_single)(dtype, group, weight, n, dweight, dbias);
    }
}

/* Rows shorter than one group (n < 16), where per-row overhead would dominate: 16 rows
   at a time, one row per lane, all in float64.  Lane k of the parameter accumulators
   takes rows block + k; the lanes are added by the fixed tree when the range is done. */
static LN_ALWAYS_INLINE void LN_FN(backward_short_rows)(ln_dtype dtype, const ln_backward_args *a,
                                                        ptrdiff_t begin, ptrdiff_t end,
                                                        double *dweight, double *dbias)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), n = a->row_len;
    const GD n_v = LN_FN(gd_splat)((double)n), zero_v = LN_FN(gd_splat)(0.0);
    GD dweight_lanes[16], dbias_lanes[16];   /* [column], a lane per row slot */
    for (ptrdiff_t i = 0; i < n; i++) {
        dweight_lanes[i] = zero_v;
        dbias_lanes[i] = zero_v;
    }
    for (ptrdiff_t block = begin; block < end; block += 16) {
        const ptrdiff_t rows = end - block < 16 ? end - block : 16;
        double dy_t[16][16], x_t[16][16], dx_t[16][16];   /* [column][row slot] */
        double means[16], rstds[16];
        for (ptrdiff_t k = 0; k < 16; k++) {
            if (k >= rows) {   /* padding slots past the last row: zeros */
                means[k] = rstds[k] = 0.0;
                for (ptrdiff_t i = 0; i < n; i++) {
                    dy_t[i][k] = x_t[i][k] = 0.0;
                }
                continue;
            }
            const ptrdiff_t r = block + k;
            const char *dy = (const char *)a->grad_output + r * a->grad_output_row_step * elsize;
            const char *x = (const char *)a->input + r * a->input_row_step * elsize;
            means[k] = ln_load1_param_as_f64(dtype, a->mean, r);
            rstds[k] = ln_load1_param_as_f64(dtype, a->rstd, r);
            for (ptrdiff_t i = 0; i < n; i++) {
                dy_t[i][k] = ln_load1_as_f64(dtype, dy, i);
                x_t[i][k] = ln_load1_as_f64(dtype, x, i);
            }
        }
        const GD mean_v = LN_FN(gd_load)(means), rstd_v = LN_FN(gd_load)(rstds);
        GD g_sum = zero_v, gx_sum = zero_v;
        for (ptrdiff_t i = 0; i < n; i++) {
            const GD dy_v = LN_FN(gd_load)(dy_t[i]);
            const GD xhat = LN_FN(gd_mul)(LN_FN(gd_sub)(LN_FN(gd_load)(x_t[i]), mean_v), rstd_v);
            const GD g = a->weight ? LN_FN(gd_mul)(dy_v, LN_FN(gd_splat)(ln_load1_param_as_f64(dtype, a->weight, i)))
                                   : dy_v;
            g_sum = LN_FN(gd_add)(g_sum, g);
            gx_sum = LN_FN(gd_add)(gx_sum, LN_FN(gd_mul)(g, xhat));
            if (dweight) {
                dweight_lanes[i] = LN_FN(gd_add)(dweight_lanes[i], LN_FN(gd_mul)(dy_v, xhat));
            }
            if (dbias) {
                dbias_lanes[i] = LN_FN(gd_add)(dbias_lanes[i], dy_v);
            }
            LN_FN(gd_store)(x_t[i], xhat);
            LN_FN(gd_store)(dy_t[i], g);
        }
        if (!a->grad_input) {
            continue;
        }
        const GD g_mean = LN_FN(gd_div)(g_sum, n_v), gx_mean = LN_FN(gd_div)(gx_sum, n_v);
        for (ptrdiff_t i = 0; i < n; i++) {
            const GD inner = LN_FN(gd_sub)(LN_FN(gd_sub)(LN_FN(gd_load)(dy_t[i]), g_mean),
                                           LN_FN(gd_mul)(LN_FN(gd_load)(x_t[i]), gx_mean));
            LN_FN(gd_store)(dx_t[i], LN_FN(gd_mul)(inner, rstd_v));
        }
        for (ptrdiff_t k = 0; k < rows; k++) {
            char *dx = (char *)a->grad_input + (block + k) * n * elsize;
            for (ptrdiff_t i = 0; i < n; i++) {
                ln_store1_from_f64(dtype, dx, i, dx_t[i][k]);
            }
        }
    }
    for (ptrdiff_t i = 0; i < n; i++) {
        double lanes[16];
        if (dweight) {
            LN_FN(gd_store)(lanes, dweight_lanes[i]);
            dweight[i] += ln_sum_lanes(lanes);
        }
        if (dbias) {
            LN_FN(gd_store)(lanes, dbias_lanes[i]);
            dbias[i] += ln_sum_lanes(lanes);
        }
    }
}

/* Rows [begin, end): pass 1 row by row, pass 2 over groups of LN_GRAD_ROWS rows, each
   group still in cache from pass 1. */
static LN_ALWAYS_INLINE void LN_FN(backward_rows)(ln_dtype dtype, const ln_backward_args *a,
                                                  ptrdiff_t begin, ptrdiff_t end,
                                                  double *dweight, double *dbias)
{
    const ptrdiff_t elsize = (ptrdiff_t)ln_dtype_size(dtype), n = a->row_len;
    if (n < 16) {
        LN_FN(backward_short_rows)(dtype, a, begin, end, dweight, dbias);
        return;
    }
    const int stream_dx = ln_backward_streams_dx(a);
    for (ptrdiff_t first = begin; first < end; first += LN_GRAD_ROWS) {
        ln_grad_rows group = {.count = (int)(end - first < LN_GRAD_ROWS ? end - first : LN_GRAD_ROWS),
                              .stream_dx = stream_dx};
        for (int k = 0; k < group.count; k++) {
            const ptrdiff_t r = first + k;
            group.dy[k] = (const char *)a->grad_output + r * a->grad_output_row_step * elsize;
            group.x[k] = (const char *)a->input + r * a->input_row_step * elsize;
            group.dx[k] = a->grad_input ? (char *)a->grad_input + r * n * elsize : NULL;
            group.mean[k] = ln_load1_param_as_f64(dtype, a->mean, r);
            group.rstd[k] = ln_load1_param_as_f64(dtype, a->rstd, r);
            double sums[2] = {0.0, 0.0};
            if (a->grad_input) {
                LN_FN(grad_sums)(dtype, group.dy[k], group.x[k], a->weight, n, group.mean[k], group.rstd[k], sums);
            }
            group.g_mean[k] = sums[0] / (double)n;
            group.gx_mean[k] = sums[1] / (double)n;
        }
        LN_FN(grad_apply)(dtype, &group, a->weight, n, dweight, dbias);
    }
#if LN_ISA_LEVEL > 0
    if (stream_dx) {
        _mm_sfence();
    }
#endif
}

/* One concrete function per dtype for the table; dtype is a constant inside each. */
#define LN_BACKWARD_FOR(suffix, DTYPE)                                                          \
    static void LN_FN(backward_rows_##suffix)(const ln_backward_args *a, ptrdiff_t begin,       \
                                              ptrdiff_t end, double *dweight, double *dbias)    \
    {                                                                                           \
        LN_FN(backward_rows)(DTYPE, a, begin, end, dweight, dbias);                             \
    }                                                                                           \
    static void LN_FN(grad_sums_##suffix)(const void *dy, const void *x, const void *weight,    \
                                          ptrdiff_t n, double mean, double rstd, double sums[2]) \
    {                                                                                           \
        LN_FN(grad_sums)(DTYPE, dy, x, weight, n, mean, rstd, sums);                            \
    }                                                                                           \
    static void LN_FN(grad_apply_##suffix)(const ln_grad_rows *group, const void *weight,       \
                                           ptrdiff_t n, double *dweight, double *dbias)         \
    {                                                                                           \
        LN_FN(grad_apply)(DTYPE, group, weight, n, dweight, dbias);                             \
    }

LN_BACKWARD_FOR(f16, LN_F16)
LN_BACKWARD_FOR(f32, LN_F32)
LN_BACKWARD_FOR(f64, LN_F64)
#undef LN_BACKWARD_FOR

static const ln_kernel_table LN_FN(kernels) = {
    .forward_rows = {LN_FN(forward_rows_f16), LN_FN(forward_rows_f32), LN_FN(forward_rows_f64)},
    .chunk_moments = {LN_FN(chunk_moments_of_f16), LN_FN(chunk_moments_of_f32), LN_FN(chunk_moments_of_f64)},
    .normalize_row = {LN_FN(normalize_row_f16), LN_FN(normalize_row_f32), LN_FN(normalize_row_f64)},
    .normalize_row_streaming = {LN_FN(normalize_row_streaming_f16), LN_FN(normalize_row_streaming_f32),
                                LN_FN(normalize_row_streaming_f64)},
    .backward_rows = {LN_FN(backward_rows_f16), LN_FN(backward_rows_f32), LN_FN(backward_rows_f64)},
    .grad_sums = {LN_FN(grad_sums_f16), LN_FN(grad_sums_f32), LN_FN(grad_sums_f64)},
    .grad_apply = {LN_FN(grad_apply_f16), LN_FN(grad_apply_f32), LN_FN(grad_apply_f64)},
};

#undef LN_NORMALIZE_CASES
#undef LN_STREAM_PS
#undef LN_STREAM_PD
#undef FOR_VD
#undef FOR_VF
#undef GD
#undef GF
#undef LN_VD_PER_GROUP
#undef LN_VD_LANES
#undef LN_VF_LANES
#undef LN_VF_PER_GROUP
#undef LN_FN
#undef LN_CAT
#undef LN_CAT_

