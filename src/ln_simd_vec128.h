/*
 * ln_simd_vec128.h -- the group primitives of the 128-bit level, in GCC/Clang vector
 * extensions: SSE2 on x86-64 and NEON on aarch64, the baseline of each, so the translation
 * unit needs no extra flags.  A group is 8 vectors of 2 float64 or 4 of 4 float32.
 *
 * Bit-identity with the other levels needs a true fused multiply-add.  aarch64 has one
 * (vfmaq) and converts float16 in hardware (vcvt).  SSE2 has neither: its fused multiply-adds
 * are computed exactly from float64 operations rounded to odd (below), and its float16
 * conversions run lane by lane; x86-64 CPUs with FMA take the avx2 level anyway.
 */
#ifndef LN_SIMD_VEC128_H
#define LN_SIMD_VEC128_H

#if defined(__aarch64__)
#include <arm_neon.h>
#elif defined(__x86_64__)
#include <emmintrin.h>
#else
#error "the 128-bit level is built for x86-64 (SSE2) and aarch64 (NEON)"
#endif

#include "ln_internal.h"

typedef double ln_vd __attribute__((vector_size(16)));
typedef float ln_vf __attribute__((vector_size(16)));
#define LN_VD_PER_GROUP 8
#define LN_VF_PER_GROUP 4
#if defined(__aarch64__)
#define LN_AFFINE_LOOP_APART 1
#else
#define LN_AFFINE_LOOP_APART 0  /* SSE2: the loops' tests are small beside its emulated fma */
#endif
#define LN_ROWS8_F32_TRANSPOSE 1  /* rows8_f32_to_columns and rows8_f32_from_columns, below */
#define LN_GF_TRANSPOSE 1  /* gf_transpose, below */
#define LN_BF16_PAIR_STORE 0

#include "ln_simd_group.h"

static LN_ALWAYS_INLINE gd gd_load_f32(const float *p)
{
    gd r;
    FOR_VD(k) { r.v[k] = (ln_vd){p[2 * k], p[2 * k + 1]}; }
    return r;
}

static LN_ALWAYS_INLINE gd gd_sqrt(gd a)
{
#if defined(__aarch64__)
    FOR_VD(k) { a.v[k] = (ln_vd)vsqrtq_f64((float64x2_t)a.v[k]); }
#else
    FOR_VD(k) { a.v[k] = (ln_vd)_mm_sqrt_pd((__m128d)a.v[k]); }
#endif
    return a;
}

#if !defined(__aarch64__)
/* Fused multiply-adds from SSE2's float64 operations.  Both rest on rounding to odd: x + y
   rounded toward zero, and then, if that was inexact, its last significand bit set.  A sum
   rounded to odd in float64 and then rounded to nearest in a format of p <= 25 bits is the
   sum rounded once to nearest in that format (Boldo and Melquiond, "Emulation of FMA and
   correctly rounded sums: proved algorithms using rounding to odd", IEEE Trans. Computers
   57(4), 2008; their condition is 53 >= 2p + 2).  Rounding to odd comes from the sum rounded
   to nearest, s, and its exact error e (Knuth's TwoSum): where e != 0, s rounded toward zero
   is s itself if e has s's sign, else one unit below it in magnitude, and either with its last
   bit set is the answer.  A sum that is not finite is left as it is. */
static LN_ALWAYS_INLINE __m128d sse2_two_sum(__m128d x, __m128d y, __m128d *error)
{
    const __m128d s = _mm_add_pd(x, y);
    const __m128d y_part = _mm_sub_pd(s, x), x_part = _mm_sub_pd(s, y_part);
    *error = _mm_add_pd(_mm_sub_pd(x, x_part), _mm_sub_pd(y, y_part));
    return s;
}

static LN_ALWAYS_INLINE __m128d sse2_add_round_to_odd(__m128d x, __m128d y)
{
    __m128d error;
    const __m128d s = sse2_two_sum(x, y, &error);
    const __m128d magnitude = _mm_and_pd(s, _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffff)));
    const __m128d inexact = _mm_and_pd(_mm_cmpneq_pd(error, _mm_setzero_pd()),
                                       _mm_cmplt_pd(magnitude, _mm_set1_pd((double)INFINITY)));
    const __m128i signs_differ = _mm_castpd_si128(_mm_xor_pd(s, error));
    const __m128i minus_one = _mm_shuffle_epi32(_mm_srai_epi32(signs_differ, 31), _MM_SHUFFLE(3, 3, 1, 1));
    const __m128i odd = _mm_or_si128(_mm_add_epi64(_mm_castpd_si128(s), minus_one), _mm_set1_epi64x(1));
    return _mm_or_pd(_mm_and_pd(inexact, _mm_castsi128_pd(odd)), _mm_andnot_pd(inexact, s));
}

/* float32 a * b + c for two lanes held as float64: the product is exact (24 + 24 bits), the sum
   rounded to odd, and the caller's rounding to float32 the only other rounding. */
static LN_ALWAYS_INLINE __m128d sse2_fmaf_as_f64(__m128d a, __m128d b, __m128d c)
{
    return sse2_add_round_to_odd(_mm_mul_pd(a, b), c);
}

/* a * b split exactly into high + low (Dekker's product, with Veltkamp's split); exact when
   no step overflows or underflows (sse2_fma's range test). */
static LN_ALWAYS_INLINE __m128d sse2_two_product(__m128d a, __m128d b, __m128d *low)
{
    const __m128d splitter = _mm_set1_pd(134217729.0); /* 2^27 + 1 */
    const __m128d a_scaled = _mm_mul_pd(a, splitter), b_scaled = _mm_mul_pd(b, splitter);
    const __m128d a_high = _mm_sub_pd(a_scaled, _mm_sub_pd(a_scaled, a)), a_low = _mm_sub_pd(a, a_high);
    const __m128d b_high = _mm_sub_pd(b_scaled, _mm_sub_pd(b_scaled, b)), b_low = _mm_sub_pd(b, b_high);
    const __m128d high = _mm_mul_pd(a, b);
    const __m128d partial = _mm_add_pd(_mm_add_pd(_mm_sub_pd(_mm_mul_pd(a_high, b_high), high),
                                                  _mm_mul_pd(a_high, b_low)),
                                       _mm_mul_pd(a_low, b_high));
    *low = _mm_add_pd(partial, _mm_mul_pd(a_low, b_low));
    return high;
}

/* Lanes whose magnitude is 0 or within [2^-450, 2^450]: where a, b and c all are, every step of
   sse2_fma is exact (no overflow, no result below the normal range). */
static LN_ALWAYS_INLINE __m128d sse2_in_fma_range(__m128d x)
{
    const __m128d magnitude = _mm_and_pd(x, _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffff)));
    const __m128d inside = _mm_and_pd(_mm_cmpge_pd(magnitude, _mm_set1_pd(0x1p-450)),
                                      _mm_cmple_pd(magnitude, _mm_set1_pd(0x1p450)));
    return _mm_or_pd(inside, _mm_cmpeq_pd(magnitude, _mm_setzero_pd()));
}

/* float64 a * b + c rounded once (Boldo and Melquiond's emulated FMA): a * b = high + low
   exactly, c + high = th + tl exactly, then th + (tl + low rounded to odd) rounded to nearest.
   A zero product makes the sum exactly (so its zero has the right sign); lanes outside
   sse2_in_fma_range go to the C library's fma(). */
static LN_ALWAYS_INLINE __m128d sse2_fma(__m128d a, __m128d b, __m128d c)
{
    const __m128d in_range = _mm_and_pd(_mm_and_pd(sse2_in_fma_range(a), sse2_in_fma_range(b)), sse2_in_fma_range(c));
    if (_mm_movemask_pd(in_range) != 3) {
        double lanes_a[2], lanes_b[2], lanes_c[2];
        _mm_storeu_pd(lanes_a, a);
        _mm_storeu_pd(lanes_b, b);
        _mm_storeu_pd(lanes_c, c);
        return _mm_set_pd(fma(lanes_a[1], lanes_b[1], lanes_c[1]), fma(lanes_a[0], lanes_b[0], lanes_c[0]));
    }
    __m128d low, tl;
    const __m128d high = sse2_two_product(a, b, &low);
    const __m128d th = sse2_two_sum(c, high, &tl);
    const __m128d fused = _mm_add_pd(th, sse2_add_round_to_odd(tl, low));
    const __m128d zero_product = _mm_cmpeq_pd(high, _mm_setzero_pd());
    return _mm_or_pd(_mm_and_pd(zero_product, _mm_add_pd(high, c)), _mm_andnot_pd(zero_product, fused));
}
#endif

/* a * b + c, rounded once */
static LN_ALWAYS_INLINE gd gd_fma(gd a, gd b, gd c)
{
#if defined(__aarch64__)
    FOR_VD(k) { a.v[k] = (ln_vd)vfmaq_f64((float64x2_t)c.v[k], (float64x2_t)a.v[k], (float64x2_t)b.v[k]); }
#else
    FOR_VD(k) { a.v[k] = (ln_vd)sse2_fma((__m128d)a.v[k], (__m128d)b.v[k], (__m128d)c.v[k]); }
#endif
    return a;
}

static LN_ALWAYS_INLINE gf gf_fma(gf a, gf b, gf c)
{
#if defined(__aarch64__)
    FOR_VF(k) { a.v[k] = (ln_vf)vfmaq_f32((float32x4_t)c.v[k], (float32x4_t)a.v[k], (float32x4_t)b.v[k]); }
#else
    FOR_VF(k) {
        const __m128 va = (__m128)a.v[k], vb = (__m128)b.v[k], vc = (__m128)c.v[k];
        const __m128d low = sse2_fmaf_as_f64(_mm_cvtps_pd(va), _mm_cvtps_pd(vb), _mm_cvtps_pd(vc));
        const __m128d high = sse2_fmaf_as_f64(_mm_cvtps_pd(_mm_movehl_ps(va, va)), _mm_cvtps_pd(_mm_movehl_ps(vb, vb)),
                                              _mm_cvtps_pd(_mm_movehl_ps(vc, vc)));
        a.v[k] = (ln_vf)_mm_movelh_ps(_mm_cvtpd_ps(low), _mm_cvtpd_ps(high));
    }
#endif
    return a;
}

/* Per lane, the larger of top (magnitudes) and |a|; a NaN lane of a leaves top as it was. */
static LN_ALWAYS_INLINE gd gd_max_magnitude(gd top, gd a)
{
#if defined(__aarch64__)
    FOR_VD(k) { top.v[k] = (ln_vd)vmaxnmq_f64(vabsq_f64((float64x2_t)a.v[k]), (float64x2_t)top.v[k]); }
#else
    const __m128d magnitude = _mm_castsi128_pd(_mm_set1_epi64x(0x7fffffffffffffff));
    FOR_VD(k) { top.v[k] = (ln_vd)_mm_max_pd(_mm_and_pd((__m128d)a.v[k], magnitude), (__m128d)top.v[k]); }
#endif
    return top;
}

static LN_ALWAYS_INLINE gf gf_max_magnitude(gf top, gf a)
{
#if defined(__aarch64__)
    FOR_VF(k) { top.v[k] = (ln_vf)vmaxnmq_f32(vabsq_f32((float32x4_t)a.v[k]), (float32x4_t)top.v[k]); }
#else
    const __m128 magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    FOR_VF(k) { top.v[k] = (ln_vf)_mm_max_ps(_mm_and_ps((__m128)a.v[k], magnitude), (__m128)top.v[k]); }
#endif
    return top;
}

static LN_ALWAYS_INLINE gf gf_max_magnitude_folded(gf top, gf a)
{
#if defined(__aarch64__)
    const float32x4_t low = vmaxnmq_f32(vabsq_f32((float32x4_t)a.v[1]), vabsq_f32((float32x4_t)a.v[0]));
    const float32x4_t high = vmaxnmq_f32(vabsq_f32((float32x4_t)a.v[3]), vabsq_f32((float32x4_t)a.v[2]));
    top.v[0] = (ln_vf)vmaxnmq_f32(vmaxnmq_f32(high, low), (float32x4_t)top.v[0]);
#else
    const __m128 magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    const __m128 low = _mm_max_ps(_mm_and_ps((__m128)a.v[1], magnitude), _mm_and_ps((__m128)a.v[0], magnitude));
    const __m128 high = _mm_max_ps(_mm_and_ps((__m128)a.v[3], magnitude), _mm_and_ps((__m128)a.v[2], magnitude));
    top.v[0] = (ln_vf)_mm_max_ps(_mm_max_ps(high, low), (__m128)top.v[0]);
#endif
    return top;
}

static LN_ALWAYS_INLINE gd gf_widen(gf a)
{
    gd r;
    FOR_VF(k) {
        r.v[2 * k] = (ln_vd){a.v[k][0], a.v[k][1]};
        r.v[2 * k + 1] = (ln_vd){a.v[k][2], a.v[k][3]};
    }
    return r;
}

static LN_ALWAYS_INLINE gf gf_load_f16(const uint16_t *p)
{
    gf r;
#if defined(__aarch64__)
    FOR_VF(k) { r.v[k] = (ln_vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * k))); }
#else
    FOR_VF(k) {
        r.v[k] = (ln_vf){ln_half_to_float(p[4 * k]), ln_half_to_float(p[4 * k + 1]),
                         ln_half_to_float(p[4 * k + 2]), ln_half_to_float(p[4 * k + 3])};
    }
#endif
    return r;
}

/* Four 16-bit elements, float16 or bfloat16. */
typedef uint16_t ln_vu16 __attribute__((vector_size(8)));
typedef ln_vu16 ln_vu16_mem __attribute__((aligned(1), may_alias));

/* 8 16-bit elements, two vectors of 4, by one 16-byte store: on SSE2, halves_stream's 16-byte
   load of them cannot take its bytes from two 8-byte stores still in flight, and would wait
   for both to reach the cache (on aarch64 halves_stream copies with ordinary stores; there the
   store only matches its loads' width). */
static LN_ALWAYS_INLINE void halves_store8(uint16_t *p, ln_vu16 low, ln_vu16 high)
{
#if defined(__aarch64__)
    vst1q_u16(p, vcombine_u16((uint16x4_t)low, (uint16x4_t)high));
#else
    uint64_t low_bits, high_bits;
    memcpy(&low_bits, &low, sizeof low_bits);
    memcpy(&high_bits, &high, sizeof high_bits);
    _mm_storeu_si128((__m128i *)p, _mm_set_epi64x((long long)high_bits, (long long)low_bits));
#endif
}

static LN_ALWAYS_INLINE ln_vu16 f16_narrowed(ln_vf a)
{
#if defined(__aarch64__)
    return (ln_vu16)vreinterpret_u16_f16(vcvt_f16_f32((float32x4_t)a));
#else
    return (ln_vu16){ln_float_to_half(a[0]), ln_float_to_half(a[1]), ln_float_to_half(a[2]),
                     ln_float_to_half(a[3])};
#endif
}

static LN_ALWAYS_INLINE void gf_store_f16(uint16_t *p, gf a)
{
    halves_store8(p, f16_narrowed(a.v[0]), f16_narrowed(a.v[1]));
    halves_store8(p + 8, f16_narrowed(a.v[2]), f16_narrowed(a.v[3]));
}

/* bfloat16: the lanes widened and narrowed as the compiler does it for the target (NEON's
   vmovl/vmovn, SSE2's unpacks and shuffles). */
static LN_ALWAYS_INLINE gf gf_load_bf16(const uint16_t *p)
{
    gf r;
    FOR_VF(k) { r.v[k] = bf16_widened(__builtin_convertvector(*(const ln_vu16_mem *)(p + 4 * k), ln_vu32)); }
    return r;
}

static LN_ALWAYS_INLINE void gf_store_bf16(uint16_t *p, gf a, int nan_lanes)
{
    ln_vu16 narrowed[LN_VF_PER_GROUP];
    FOR_VF(k) { narrowed[k] = __builtin_convertvector(bf16_rounded(a.v[k], nan_lanes), ln_vu16); }
    halves_store8(p, narrowed[0], narrowed[1]);
    halves_store8(p + 8, narrowed[2], narrowed[3]);
}

/* Streaming stores (p 64-byte aligned), 16-byte streaming stores (p 16-byte aligned, also
   piece_stream's 16 bytes from a buffer) and 16-bit elements' streaming stores
   (halves_stream: 16 of them, p 32-byte aligned): 16-byte non-temporal stores on x86-64
   (SSE2 movntpd/movntps/movntdq), ordinary stores on aarch64. */
#if defined(__x86_64__)

static LN_ALWAYS_INLINE void gd_stream16(double *p, gd a)
{
    assert(((uintptr_t)p & 15) == 0);
    FOR_VD(k) { _mm_stream_pd(p + 2 * k, (__m128d)a.v[k]); }
}

static LN_ALWAYS_INLINE void gf_stream16(float *p, gf a)
{
    assert(((uintptr_t)p & 15) == 0);
    FOR_VF(k) { _mm_stream_ps(p + 4 * k, (__m128)a.v[k]); }
}

static LN_ALWAYS_INLINE void halves_stream(uint16_t *p, const uint16_t *halves)
{
    assert(((uintptr_t)p & 31) == 0);
    _mm_stream_si128((__m128i *)p, _mm_loadu_si128((const __m128i *)halves));
    _mm_stream_si128((__m128i *)(p + 8), _mm_loadu_si128((const __m128i *)(halves + 8)));
}

/* 16 bytes from `from` to p, 16-byte aligned: one 16-byte non-temporal store. */
static LN_ALWAYS_INLINE void piece_stream(char *p, const char *from)
{
    assert(((uintptr_t)p & 15) == 0);
    _mm_stream_si128((__m128i *)p, _mm_loadu_si128((const __m128i *)from));
}

/* Non-temporal stores are weakly ordered: finish them before the output is handed on. */
static LN_ALWAYS_INLINE void stream_fence(void)
{
    _mm_sfence();
}

#else

static LN_ALWAYS_INLINE void gd_stream16(double *p, gd a)
{
    assert(((uintptr_t)p & 15) == 0);
    gd_store(p, a);
}

static LN_ALWAYS_INLINE void gf_stream16(float *p, gf a)
{
    assert(((uintptr_t)p & 15) == 0);
    gf_store(p, a);
}

static LN_ALWAYS_INLINE void halves_stream(uint16_t *p, const uint16_t *halves)
{
    assert(((uintptr_t)p & 31) == 0);
    memcpy(p, halves, 32);
}

static LN_ALWAYS_INLINE void piece_stream(char *p, const char *from)
{
    assert(((uintptr_t)p & 15) == 0);
    memcpy(p, from, 16);
}

static LN_ALWAYS_INLINE void stream_fence(void) {}

#endif

static LN_ALWAYS_INLINE void gd_stream(double *p, gd a)
{
    assert(((uintptr_t)p & 63) == 0);
    gd_stream16(p, a);
}

static LN_ALWAYS_INLINE void gf_stream(float *p, gf a)
{
    assert(((uintptr_t)p & 63) == 0);
    gf_stream16(p, a);
}

/* The 4x4 transpose of float32 m[0..3] (m[r] holds row r): m[c] then holds column c.  Rows
   0 and 1, 2 and 3 interleaved element by element, then those pairs interleaved two elements
   at a time (SSE's _MM_TRANSPOSE4_PS does the same in its own shuffles). */
static LN_ALWAYS_INLINE void transpose4_f32(ln_vf m[4])
{
#if defined(__aarch64__)
    const float32x4_t t0 = vzip1q_f32((float32x4_t)m[0], (float32x4_t)m[1]);
    const float32x4_t t1 = vzip2q_f32((float32x4_t)m[0], (float32x4_t)m[1]);
    const float32x4_t t2 = vzip1q_f32((float32x4_t)m[2], (float32x4_t)m[3]);
    const float32x4_t t3 = vzip2q_f32((float32x4_t)m[2], (float32x4_t)m[3]);
    m[0] = (ln_vf)vzip1q_f64((float64x2_t)t0, (float64x2_t)t2);
    m[1] = (ln_vf)vzip2q_f64((float64x2_t)t0, (float64x2_t)t2);
    m[2] = (ln_vf)vzip1q_f64((float64x2_t)t1, (float64x2_t)t3);
    m[3] = (ln_vf)vzip2q_f64((float64x2_t)t1, (float64x2_t)t3);
#else
    __m128 r0 = (__m128)m[0], r1 = (__m128)m[1], r2 = (__m128)m[2], r3 = (__m128)m[3];
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
    m[0] = (ln_vf)r0;
    m[1] = (ln_vf)r1;
    m[2] = (ln_vf)r2;
    m[3] = (ln_vf)r3;
#endif
}

/* 16 rows of 8 float32 elements, one after another, turned in registers between rows and
   columns (see short_rows_to_columns): rows holds 128 elements, and columns[i] element i of
   each row, as 16 float32 in its first 64 bytes; each 4 rows by 4 columns a 4x4 transpose.
   A transpose undoes itself, so the way back is the same.  Element by element it was 128
   loads and 128 stores each way. */
static LN_ALWAYS_INLINE void rows8_f32_to_columns(const float *rows, double columns[16][16])
{
    for (int a = 0; a < 4; a++) {      /* rows 4a .. 4a + 3 */
        for (int c = 0; c < 2; c++) {  /* columns 4c .. 4c + 3 */
            ln_vf m[4];
            for (int r = 0; r < 4; r++) {
                m[r] = *(const ln_vf_mem *)(rows + 8 * (4 * a + r) + 4 * c);
            }
            transpose4_f32(m);
            for (int j = 0; j < 4; j++) {
                *(ln_vf_mem *)((float *)columns[4 * c + j] + 4 * a) = m[j];
            }
        }
    }
}

static LN_ALWAYS_INLINE void rows8_f32_from_columns(double columns[16][16], float *rows)
{
    for (int a = 0; a < 4; a++) {
        for (int c = 0; c < 2; c++) {
            ln_vf m[4];
            for (int j = 0; j < 4; j++) {
                m[j] = *(const ln_vf_mem *)((const float *)columns[4 * c + j] + 4 * a);
            }
            transpose4_f32(m);
            for (int r = 0; r < 4; r++) {
                *(ln_vf_mem *)(rows + 8 * (4 * a + r) + 4 * c) = m[r];
            }
        }
    }
}

/* 16 groups turned in registers: lane k of group i to lane i of group k (a 16x16 matrix of
   float32 transposed), as sixteen 4x4 transposes: the block of groups 4R .. 4R + 3, lanes
   4C .. 4C + 3 (their vectors v[C]) goes transposed to groups 4C .. 4C + 3, vectors v[R]. */
static LN_ALWAYS_INLINE void gf_transpose(gf groups[16])
{
    gf turned[16];
    for (int r = 0; r < 4; r++) {
        for (int c = 0; c < 4; c++) {
            ln_vf m[4];
            for (int i = 0; i < 4; i++) {
                m[i] = groups[4 * r + i].v[c];
            }
            transpose4_f32(m);
            for (int i = 0; i < 4; i++) {
                turned[4 * c + i].v[r] = m[i];
            }
        }
    }
    memcpy(groups, turned, sizeof(turned));
}

#endif
