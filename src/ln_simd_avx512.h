/*
 * ln_simd_avx512.h -- the group primitives of the avx512 level: AVX-512F and BW (with AVX2,
 * FMA and F16C), x86-64 only; the translation unit is compiled with -mavx512f -mavx512bw
 * -mavx2 -mfma -mf16c.  A group is 2 __m512d or 1 __m512.
 */
#ifndef LN_SIMD_AVX512_H
#define LN_SIMD_AVX512_H

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx512 level is compiled with -mavx512f -mavx512bw -mavx2 -mfma -mf16c"
#endif

#include <immintrin.h>

#include "ln_internal.h"

typedef double ln_vd __attribute__((vector_size(64)));  /* __m512d */
typedef float ln_vf __attribute__((vector_size(64)));   /* __m512 */
#define LN_VD_PER_GROUP 2
#define LN_VF_PER_GROUP 1
#define LN_AFFINE_LOOP_APART 1

#include "ln_simd_group.h"

static LN_ALWAYS_INLINE gd gd_load_f32(const float *p)
{
    gd r;
    FOR_VD(k) { r.v[k] = (ln_vd)_mm512_cvtps_pd(_mm256_loadu_ps(p + 8 * k)); }
    return r;
}

static LN_ALWAYS_INLINE gd gd_sqrt(gd a)
{
    FOR_VD(k) { a.v[k] = (ln_vd)_mm512_sqrt_pd((__m512d)a.v[k]); }
    return a;
}

/* a * b + c, rounded once */
static LN_ALWAYS_INLINE gd gd_fma(gd a, gd b, gd c)
{
    FOR_VD(k) { a.v[k] = (ln_vd)_mm512_fmadd_pd((__m512d)a.v[k], (__m512d)b.v[k], (__m512d)c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE gf gf_fma(gf a, gf b, gf c)
{
    FOR_VF(k) { a.v[k] = (ln_vf)_mm512_fmadd_ps((__m512)a.v[k], (__m512)b.v[k], (__m512)c.v[k]); }
    return a;
}

/* Per lane, the larger of top (magnitudes) and |a|; a NaN lane of a leaves top as it was. */
static LN_ALWAYS_INLINE gd gd_max_magnitude(gd top, gd a)
{
    FOR_VD(k) { top.v[k] = (ln_vd)_mm512_max_pd(_mm512_abs_pd((__m512d)a.v[k]), (__m512d)top.v[k]); }
    return top;
}

static LN_ALWAYS_INLINE gf gf_max_magnitude(gf top, gf a)
{
    FOR_VF(k) { top.v[k] = (ln_vf)_mm512_max_ps(_mm512_abs_ps((__m512)a.v[k]), (__m512)top.v[k]); }
    return top;
}

static LN_ALWAYS_INLINE gd gf_widen(gf a)
{
    gd r;
    const __m512 v = (__m512)a.v[0];
    r.v[0] = (ln_vd)_mm512_cvtps_pd(_mm512_castps512_ps256(v));
    r.v[1] = (ln_vd)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return r;
}

static LN_ALWAYS_INLINE gf gf_load_f16(const uint16_t *p)
{
    gf r;
    r.v[0] = (ln_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return r;
}

static LN_ALWAYS_INLINE void gf_store_f16(uint16_t *p, gf a)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)a.v[0], _MM_FROUND_TO_NEAREST_INT));
}

/* bfloat16, with AVX-512BW's word permute (vpermw): one shuffle each way instead of a
   widening or narrowing move plus a shift, since 512-bit integer work has only two ports.
   The rounding is bf16_rounded's with its adds masked off the NaN lanes (where nan_lanes), which
   stay as they are: the same bits, since every value stored is a result of float arithmetic,
   whose NaNs are quiet. */
static LN_ALWAYS_INLINE gf gf_load_bf16(const uint16_t *p)
{
    /* word 2i + 1 (the high half of 32-bit lane i) takes element i; the low halves are zeroed */
    const __m512i element_to_high_half = _mm512_set_epi32(15 << 16, 14 << 16, 13 << 16, 12 << 16, 11 << 16,
                                                          10 << 16, 9 << 16, 8 << 16, 7 << 16, 6 << 16, 5 << 16,
                                                          4 << 16, 3 << 16, 2 << 16, 1 << 16, 0);
    const __m512i halves = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    gf r;
    r.v[0] = (ln_vf)_mm512_maskz_permutexvar_epi16(0xaaaaaaaa, element_to_high_half, halves);
    return r;
}

static LN_ALWAYS_INLINE void gf_store_bf16(uint16_t *p, gf a, int nan_lanes)
{
    /* word i (i < 16) takes word 2i + 1, the high half of 32-bit lane i */
    const __m512i high_halves = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0,
                                                 (31 << 16) | 29, (27 << 16) | 25, (23 << 16) | 21, (19 << 16) | 17,
                                                 (15 << 16) | 13, (11 << 16) | 9, (7 << 16) | 5, (3 << 16) | 1);
    const __m512 value = (__m512)a.v[0];
    const __m512i bits = _mm512_castps_si512(value);
    const __mmask16 is_number = nan_lanes ? _mm512_cmp_ps_mask(value, value, _CMP_ORD_Q) : 0xffff;
    assert(_mm512_mask_test_epi32_mask((__mmask16)~is_number, bits, _mm512_set1_epi32(0x00400000)) == (__mmask16)~is_number);
    const __mmask16 kept_lsb_set = _mm512_mask_test_epi32_mask(is_number, bits, _mm512_set1_epi32(0x10000));
    const __m512i half_below = _mm512_mask_add_epi32(bits, is_number, bits, _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_mask_add_epi32(half_below, kept_lsb_set, bits, _mm512_set1_epi32(0x8000));
    _mm256_storeu_si256((__m256i *)p, _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_halves, rounded)));
}

/* Streaming stores, p 64-byte aligned: 64-byte non-temporal stores. */
static LN_ALWAYS_INLINE void gd_stream(double *p, gd a)
{
    assert(((uintptr_t)p & 63) == 0);
    FOR_VD(k) { _mm512_stream_pd(p + 8 * k, (__m512d)a.v[k]); }
}

static LN_ALWAYS_INLINE void gf_stream(float *p, gf a)
{
    assert(((uintptr_t)p & 63) == 0);
    _mm512_stream_ps(p, (__m512)a.v[0]);
}

/* Streaming stores, p 16-byte aligned: 16-byte non-temporal stores (SSE2 movntps), which
   NumPy's allocations and rows of a multiple of 16 bytes allow where a 64-byte alignment
   would not. */
static LN_ALWAYS_INLINE void stream16_256(char *p, __m256 v)
{
    _mm_stream_ps((float *)p, _mm256_castps256_ps128(v));
    _mm_stream_ps((float *)(p + 16), _mm256_extractf128_ps(v, 1));
}

static LN_ALWAYS_INLINE void gd_stream16(double *p, gd a)
{
    assert(((uintptr_t)p & 15) == 0);
    FOR_VD(k) {
        const __m512d v = (__m512d)a.v[k];
        stream16_256((char *)(p + 8 * k), _mm256_castpd_ps(_mm512_castpd512_pd256(v)));
        stream16_256((char *)(p + 8 * k + 4), _mm256_castpd_ps(_mm512_extractf64x4_pd(v, 1)));
    }
}

static LN_ALWAYS_INLINE void gf_stream16(float *p, gf a)
{
    assert(((uintptr_t)p & 15) == 0);
    const __m512d v = _mm512_castps_pd((__m512)a.v[0]);
    stream16_256((char *)p, _mm256_castpd_ps(_mm512_castpd512_pd256(v)));
    stream16_256((char *)(p + 8), _mm256_castpd_ps(_mm512_extractf64x4_pd(v, 1)));
}

/* 16 16-bit elements, p 32-byte aligned: one 32-byte non-temporal store. */
static LN_ALWAYS_INLINE void halves_stream(uint16_t *p, const uint16_t *halves)
{
    assert(((uintptr_t)p & 31) == 0);
    _mm256_stream_si256((__m256i *)p, _mm256_loadu_si256((const __m256i *)halves));
}

/* Non-temporal stores are weakly ordered: finish them before the output is handed on. */
static LN_ALWAYS_INLINE void stream_fence(void)
{
    _mm_sfence();
}

#endif
