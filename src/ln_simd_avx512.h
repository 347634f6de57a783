/*
 * ln_simd_avx512.h -- the group primitives of the avx512 level: AVX-512F and BW (with AVX2,
 * FMA and F16C), x86-64 only; the translation unit is compiled with -mavx512f -mavx512bw
 * -mavx2 -mfma -mf16c.  A group is 2 __m512d or 1 __m512.  The avx512bf16 level's unit adds
 * -mavx512dq -mavx512bf16, for its bfloat16 stores (gf_store_bf16).
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
#define LN_ROWS8_F32_TRANSPOSE 1  /* rows8_f32_to_columns and rows8_f32_from_columns, below */
#define LN_GF_TRANSPOSE 1         /* gf_transpose, below */

#define LN_GD_ALL_WITHIN 1  /* gd_all_within, below */
#define LN_GF_KEEP 1        /* gf_kept: AVX registers */
#define LN_GF_LANE_TESTS 1  /* gf_any_at_least and gf_all_at_most, below */
#define LN_LOAD_PART 1      /* gf_load_part, its 16-bit forms and gd_load_part, below */
#define LN_LANE_REDUCTIONS 1  /* gd_sum_lanes and gf_largest_lane, below */

#include "ln_simd_group.h"

static LN_ALWAYS_INLINE int gf_any_at_least(gf a, float t)
{
    return _mm512_cmp_ps_mask((__m512)a.v[0], _mm512_set1_ps(t), _CMP_GE_OQ) != 0;
}

static LN_ALWAYS_INLINE int gf_all_at_most(gf a, float t)
{
    return _mm512_cmp_ps_mask((__m512)a.v[0], _mm512_set1_ps(t), _CMP_LE_OQ) == 0xffff;
}

static LN_ALWAYS_INLINE int gd_all_within(gd a, double low, double high)
{
    __mmask8 inside = 0xff;
    FOR_VD(k) {
        inside &= _mm512_cmp_pd_mask((__m512d)a.v[k], _mm512_set1_pd(low), _CMP_GE_OQ) &
                  _mm512_cmp_pd_mask((__m512d)a.v[k], _mm512_set1_pd(high), _CMP_LE_OQ);
    }
    return inside == 0xff;
}

/* ln_sum_lanes' order by halving: lanes k + (k + 8) in one vector, then its halves (k + (k +
   4)), then theirs ((0 + 2), (1 + 3)), then those two.  A row's backward takes two of these
   and two of gf_largest_lane; lane by lane they were a fifth of the time of rows of 16. */
static LN_ALWAYS_INLINE double gd_sum_lanes(gd a)
{
    const __m512d eighths = _mm512_add_pd((__m512d)a.v[0], (__m512d)a.v[1]);
    const __m256d quarters = _mm256_add_pd(_mm512_castpd512_pd256(eighths), _mm512_extractf64x4_pd(eighths, 1));
    const __m128d halves = _mm_add_pd(_mm256_castpd256_pd128(quarters), _mm256_extractf128_pd(quarters, 1));
    return _mm_cvtsd_f64(_mm_add_sd(halves, _mm_unpackhi_pd(halves, halves)));
}

static LN_ALWAYS_INLINE float gf_largest_lane(gf top)
{
    return _mm512_reduce_max_ps((__m512)top.v[0]);
}

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

static LN_ALWAYS_INLINE gf gf_max_magnitude_folded(gf top, gf a)
{
    return gf_max_magnitude(top, a);
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
   whose NaNs are quiet.  The avx512bf16 level stores by conversion instead (below). */
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

/* The first `count` (1 to 15) of the 16 elements at p into lanes 0 .. count - 1, the other
   lanes 0.0: masked loads, which read no memory past the elements asked for. */
static LN_ALWAYS_INLINE gf gf_load_part(const float *p, int count)
{
    gf r;
    r.v[0] = (ln_vf)_mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
    return r;
}

static LN_ALWAYS_INLINE gd gd_load_part(const double *p, int count)
{
    const unsigned mask = (1u << count) - 1;
    gd r;
    r.v[0] = (ln_vd)_mm512_maskz_loadu_pd((__mmask8)(mask & 0xff), p);
    /* no lane of the second half is read for count <= 8: its address stays at p then */
    r.v[1] = (ln_vd)_mm512_maskz_loadu_pd((__mmask8)(mask >> 8), p + (count > 8 ? 8 : 0));
    return r;
}

static LN_ALWAYS_INLINE __m512i halves_load_part(const uint16_t *p, int count)
{
    return _mm512_maskz_loadu_epi16((__mmask32)((1u << count) - 1), p);
}

static LN_ALWAYS_INLINE gf gf_load_part_f16(const uint16_t *p, int count)
{
    gf r;
    r.v[0] = (ln_vf)_mm512_cvtph_ps(_mm512_castsi512_si256(halves_load_part(p, count)));
    return r;
}

static LN_ALWAYS_INLINE gf gf_load_part_bf16(const uint16_t *p, int count)
{
    gf r;
    r.v[0] = (ln_vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(halves_load_part(p, count))), 16);
    return r;
}

/* bf16_rounded's rounding, by AVX-512's masked adds, stored. */
static LN_ALWAYS_INLINE void bf16_store_rounded(uint16_t *p, __m512 value, int nan_lanes)
{
    /* word i (i < 16) takes word 2i + 1, the high half of 32-bit lane i */
    const __m512i high_halves = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0,
                                                 (31 << 16) | 29, (27 << 16) | 25, (23 << 16) | 21, (19 << 16) | 17,
                                                 (15 << 16) | 13, (11 << 16) | 9, (7 << 16) | 5, (3 << 16) | 1);
    const __m512i bits = _mm512_castps_si512(value);
    const __mmask16 is_number = nan_lanes ? _mm512_cmp_ps_mask(value, value, _CMP_ORD_Q) : 0xffff;
    assert(_mm512_mask_test_epi32_mask(_knot_mask16(is_number), bits, _mm512_set1_epi32(0x00400000)) ==
           _knot_mask16(is_number));
    const __mmask16 kept_lsb_set = _mm512_mask_test_epi32_mask(is_number, bits, _mm512_set1_epi32(0x10000));
    const __m512i half_below = _mm512_mask_add_epi32(bits, is_number, bits, _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_mask_add_epi32(half_below, kept_lsb_set, bits, _mm512_set1_epi32(0x8000));
    _mm256_storeu_si256((__m256i *)p, _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_halves, rounded)));
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
/* The avx512bf16 level's unit.  vcvtneps2bf16 rounds to nearest even as bf16_store_rounded
   does, and gives a quiet NaN its top half (the quiet bit it sets is set already), in one
   instruction, and vcvtne2ps2bf16 converts two groups in one; but both read float32
   subnormals (nonzero |value| < 2^-126: vfpclassps class 0x20) as zero, so a group holding
   one takes bf16_store_rounded.  A normal float32 rounds to a normal bfloat16 (both have 8
   exponent bits), so that is the only difference.  The test and its branch cost enough that
   pairs of groups share one (2048x1024 forward, 1 thread: 426 us by integers, 403 us
   converting a group at a time, 350 us two groups at a time). */
#define LN_BF16_PAIR_STORE 1  /* gf_store2_bf16 */

/* Debug builds: the lanes' NaNs are quiet (vcvtneps2bf16 would quieten a signalling one, which
   bf16_store_rounded keeps), and there are none unless nan_lanes says so. */
static LN_ALWAYS_INLINE int bf16_lanes_valid(__m512 value, int nan_lanes)
{
    const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    const __mmask16 quiet = _mm512_test_epi32_mask(_mm512_castps_si512(value), _mm512_set1_epi32(0x00400000));
    return (nan & (__mmask16)~quiet) == 0 && (nan_lanes || nan == 0);
}

static LN_ALWAYS_INLINE void gf_store_bf16(uint16_t *p, gf a, int nan_lanes)
{
    const __m512 value = (__m512)a.v[0];
    assert(bf16_lanes_valid(value, nan_lanes));
    if (__builtin_expect(_mm512_fpclass_ps_mask(value, 0x20) != 0, 0)) {
        bf16_store_rounded(p, value, nan_lanes);
        return;
    }
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(value));
}

/* Two groups, a then b, at p; `streaming`: by a non-temporal store, p 64-byte aligned. */
static LN_ALWAYS_INLINE void gf_store2_bf16(uint16_t *p, gf a, gf b, int nan_lanes, int streaming)
{
    const __m512 first = (__m512)a.v[0], second = (__m512)b.v[0];
    assert(bf16_lanes_valid(first, nan_lanes) && bf16_lanes_valid(second, nan_lanes));
    uint16_t rounded[32];
    uint16_t *target = streaming ? rounded : p;
    assert(!streaming || ((uintptr_t)p & 63) == 0);
    __m512i both;
    if (__builtin_expect((_mm512_fpclass_ps_mask(first, 0x20) | _mm512_fpclass_ps_mask(second, 0x20)) != 0, 0)) {
        bf16_store_rounded(target, first, nan_lanes);
        bf16_store_rounded(target + 16, second, nan_lanes);
        if (!streaming) {
            return;
        }
        both = _mm512_loadu_si512((const void *)rounded);
    }
    else {
        both = (__m512i)_mm512_cvtne2ps_pbh(second, first);
    }
    if (streaming) {
        _mm512_stream_si512((void *)p, both);
    }
    else {
        _mm512_storeu_si512((void *)p, both);
    }
}
#else
#define LN_BF16_PAIR_STORE 0

static LN_ALWAYS_INLINE void gf_store_bf16(uint16_t *p, gf a, int nan_lanes)
{
    bf16_store_rounded(p, (__m512)a.v[0], nan_lanes);
}
#endif

/* The short-row route's commonest case, rows of 8 float32 elements, turned 16 rows at a time
   between rows and columns (see short_rows_to_columns): rows holds the 16 rows one after
   another, 128 elements, and columns[i] element i of each row, as 16 float32 in its first 64
   bytes.  Element k * 8 + i of rows is element k of column i: as 8 vectors of 16, the
   permutation takes lane (k % 2) * 8 + i of vector k / 2 to lane k of vector i.  Three rounds
   of two-source permutes (vpermt2ps) do it, each round pairing vectors and halving the rows
   that a vector's elements come from: rounds of 8 permutes, where element by element it was
   128 loads and 128 stores. */
static LN_ALWAYS_INLINE __m512 rows8_permute(__m512 a, const int index[16], __m512 b)
{
    return _mm512_permutex2var_ps(a, _mm512_loadu_si512(index), b);
}

static LN_ALWAYS_INLINE void rows8_f32_to_columns(const float *rows, double columns[16][16])
{
    /* round 1: rows 4a .. 4a + 3 (vectors 2a and 2a + 1), columns 4h .. 4h + 3, lane 4 * (column % 4) + row % 4 */
    static const int round1[2][16] = {{0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27},
                                      {4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31}};
    /* round 2: rows 8b .. 8b + 7, columns 4h + 2q and 4h + 2q + 1, lane 8 * (column % 2) + row % 8 */
    static const int round2[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                      {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
    /* round 3: column i, lane k = row */
    static const int round3[2][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
    __m512 v[8], p[4][2], q[2][2][2];
    for (int m = 0; m < 8; m++) {
        v[m] = _mm512_loadu_ps(rows + 16 * m);
    }
    for (int a = 0; a < 4; a++) {
        for (int h = 0; h < 2; h++) {
            p[a][h] = rows8_permute(v[2 * a], round1[h], v[2 * a + 1]);
        }
    }
    for (int b = 0; b < 2; b++) {
        for (int h = 0; h < 2; h++) {
            for (int pair = 0; pair < 2; pair++) {
                q[b][h][pair] = rows8_permute(p[2 * b][h], round2[pair], p[2 * b + 1][h]);
            }
        }
    }
    for (int i = 0; i < 8; i++) {
        const int h = i / 4, pair = i % 4 / 2;
        _mm512_storeu_ps(columns[i], rows8_permute(q[0][h][pair], round3[i % 2], q[1][h][pair]));
    }
}

/* rows8_f32_to_columns undone, its rounds in reverse. */
static LN_ALWAYS_INLINE void rows8_f32_from_columns(double columns[16][16], float *rows)
{
    static const int round3[2][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
    static const int round2[2][16] = {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                                      {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}};
    static const int round1[2][16] = {{0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29},
                                      {2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31}};
    __m512 c[8], p[4][2], q[2][2][2];
    for (int i = 0; i < 8; i++) {
        c[i] = _mm512_loadu_ps(columns[i]);
    }
    for (int b = 0; b < 2; b++) {
        for (int h = 0; h < 2; h++) {
            for (int pair = 0; pair < 2; pair++) {
                q[b][h][pair] = rows8_permute(c[4 * h + 2 * pair], round3[b], c[4 * h + 2 * pair + 1]);
            }
        }
    }
    for (int a = 0; a < 4; a++) {
        for (int h = 0; h < 2; h++) {
            p[a][h] = rows8_permute(q[a / 2][h][0], round2[a % 2], q[a / 2][h][1]);
        }
    }
    for (int m = 0; m < 8; m++) {
        _mm512_storeu_ps(rows + 16 * m, rows8_permute(p[m / 2][0], round1[m % 2], p[m / 2][1]));
    }
}

/* 16 groups turned in registers: lane k of group i to lane i of group k (a 16x16 matrix of
   float32 transposed), in four rounds that each pair the vectors: 32-bit lanes, 64-bit
   lanes, then 128-bit quarters twice. */
static LN_ALWAYS_INLINE void gf_transpose(gf groups[16])
{
    __m512 a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_ps((__m512)groups[2 * i].v[0], (__m512)groups[2 * i + 1].v[0]);
        a[2 * i + 1] = _mm512_unpackhi_ps((__m512)groups[2 * i].v[0], (__m512)groups[2 * i + 1].v[0]);
    }
    for (int i = 0; i < 4; i++) {
        for (int h = 0; h < 2; h++) {
            const __m512d low = _mm512_castps_pd(a[4 * i + h]), high = _mm512_castps_pd(a[4 * i + h + 2]);
            b[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(low, high));
            b[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(low, high));
        }
    }
    for (int h = 0; h < 2; h++) {
        for (int i = 0; i < 4; i++) {
            a[8 * h + i] = _mm512_shuffle_f32x4(b[8 * h + i], b[8 * h + 4 + i], 0x88);
            a[8 * h + 4 + i] = _mm512_shuffle_f32x4(b[8 * h + i], b[8 * h + 4 + i], 0xdd);
        }
    }
    for (int i = 0; i < 8; i++) {
        groups[i].v[0] = (ln_vf)_mm512_shuffle_f32x4(a[i], a[8 + i], 0x88);
        groups[8 + i].v[0] = (ln_vf)_mm512_shuffle_f32x4(a[i], a[8 + i], 0xdd);
    }
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

#endif
