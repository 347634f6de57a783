/*
 * ln_simd_vec128.h -- the group primitives of the 128-bit level, in GCC/Clang vector
 * extensions: SSE2 on x86-64 and NEON on aarch64, the baseline of each, so the translation
 * unit needs no extra flags.  A group is 8 vectors of 2 float64 or 4 of 4 float32.
 *
 * Bit-identity with the other levels needs a true fused multiply-add.  aarch64 has one
 * (vfmaq) and converts float16 in hardware (vcvt).  SSE2 has neither: there fma()/fmaf()
 * and the scalar float16 conversions run lane by lane -- exact, but slow; x86-64 CPUs with
 * FMA take the avx2 level anyway.
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
#define LN_AFFINE_LOOP_APART 0  /* SSE2: fma() calls, lane by lane */
#endif
#define LN_ROWS8_F32_TRANSPOSE 0
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

/* a * b + c, rounded once */
static LN_ALWAYS_INLINE gd gd_fma(gd a, gd b, gd c)
{
#if defined(__aarch64__)
    FOR_VD(k) { a.v[k] = (ln_vd)vfmaq_f64((float64x2_t)c.v[k], (float64x2_t)a.v[k], (float64x2_t)b.v[k]); }
#else
    FOR_VD(k) {
        a.v[k] = (ln_vd){fma(a.v[k][0], b.v[k][0], c.v[k][0]), fma(a.v[k][1], b.v[k][1], c.v[k][1])};
    }
#endif
    return a;
}

static LN_ALWAYS_INLINE gf gf_fma(gf a, gf b, gf c)
{
#if defined(__aarch64__)
    FOR_VF(k) { a.v[k] = (ln_vf)vfmaq_f32((float32x4_t)c.v[k], (float32x4_t)a.v[k], (float32x4_t)b.v[k]); }
#else
    FOR_VF(k) {
        a.v[k] = (ln_vf){fmaf(a.v[k][0], b.v[k][0], c.v[k][0]), fmaf(a.v[k][1], b.v[k][1], c.v[k][1]),
                         fmaf(a.v[k][2], b.v[k][2], c.v[k][2]), fmaf(a.v[k][3], b.v[k][3], c.v[k][3])};
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

static LN_ALWAYS_INLINE void gf_store_f16(uint16_t *p, gf a)
{
#if defined(__aarch64__)
    FOR_VF(k) { vst1_u16(p + 4 * k, vreinterpret_u16_f16(vcvt_f16_f32((float32x4_t)a.v[k]))); }
#else
    FOR_VF(k) {
        for (int lane = 0; lane < 4; lane++) {
            p[4 * k + lane] = ln_float_to_half(a.v[k][lane]);
        }
    }
#endif
}

/* bfloat16: the lanes widened and narrowed as the compiler does it for the target (NEON's
   vmovl/vmovn, SSE2's unpacks and shuffles). */
typedef uint16_t ln_vu16 __attribute__((vector_size(8)));
typedef ln_vu16 ln_vu16_mem __attribute__((aligned(1), may_alias));

static LN_ALWAYS_INLINE gf gf_load_bf16(const uint16_t *p)
{
    gf r;
    FOR_VF(k) { r.v[k] = bf16_widened(__builtin_convertvector(*(const ln_vu16_mem *)(p + 4 * k), ln_vu32)); }
    return r;
}

static LN_ALWAYS_INLINE void gf_store_bf16(uint16_t *p, gf a, int nan_lanes)
{
    FOR_VF(k) { *(ln_vu16_mem *)(p + 4 * k) = __builtin_convertvector(bf16_rounded(a.v[k], nan_lanes), ln_vu16); }
}

/* Streaming stores (p 64-byte aligned), 16-byte streaming stores (p 16-byte aligned) and
   16-bit elements' streaming stores (halves_stream: 16 of them, p 32-byte aligned): 16-byte
   non-temporal stores on x86-64 (SSE2 movntpd/movntps/movntdq), ordinary stores on aarch64. */
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

#endif
