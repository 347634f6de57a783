/*
 * ln_simd_avx2.h -- the group primitives of the avx2 level: AVX2 + FMA + F16C, x86-64
 * only; the translation unit is compiled with -mavx2 -mfma -mf16c.  A group is 4 __m256d
 * or 2 __m256.
 */
#ifndef LN_SIMD_AVX2_H
#define LN_SIMD_AVX2_H

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 level is compiled with -mavx2 -mfma -mf16c"
#endif

#include <immintrin.h>

#include "ln_internal.h"

typedef double ln_vd __attribute__((vector_size(32)));  /* __m256d */
typedef float ln_vf __attribute__((vector_size(32)));   /* __m256 */
#define LN_VD_PER_GROUP 4
#define LN_VF_PER_GROUP 2
#define LN_AFFINE_LOOP_APART 1
#define LN_ROWS8_F32_TRANSPOSE 1  /* rows8_f32_to_columns and rows8_f32_from_columns, below */
#define LN_GF_TRANSPOSE 1  /* gf_transpose, below */
#define LN_BF16_PAIR_STORE 0
#define LN_LANE_REDUCTIONS 1  /* gd_sum_lanes and gf_largest_lane, below */
#define LN_GF_KEEP 1          /* gf_kept: AVX registers */
#define LN_GF_LANE_TESTS 1    /* gf_any_at_least and gf_all_at_most, below */
#define LN_LOAD_PART 1        /* gf_load_part, its 16-bit forms and gd_load_part, below */

#include "ln_simd_group.h"

static LN_ALWAYS_INLINE int gf_any_at_least(gf a, float t)
{
    const __m256 bound = _mm256_set1_ps(t);
    const __m256 hit = _mm256_or_ps(_mm256_cmp_ps((__m256)a.v[0], bound, _CMP_GE_OQ),
                                    _mm256_cmp_ps((__m256)a.v[1], bound, _CMP_GE_OQ));
    return _mm256_movemask_ps(hit) != 0;
}

static LN_ALWAYS_INLINE int gf_all_at_most(gf a, float t)
{
    const __m256 bound = _mm256_set1_ps(t);
    const __m256 inside = _mm256_and_ps(_mm256_cmp_ps((__m256)a.v[0], bound, _CMP_LE_OQ),
                                        _mm256_cmp_ps((__m256)a.v[1], bound, _CMP_LE_OQ));
    return _mm256_movemask_ps(inside) == 0xff;
}

/* ln_sum_lanes' order by halving, as the avx512 level's: lanes k + (k + 8) are vectors 0 + 2
   and 1 + 3, whose sum holds lanes k + (k + 4). */
static LN_ALWAYS_INLINE double gd_sum_lanes(gd a)
{
    const __m256d quarters = _mm256_add_pd(_mm256_add_pd((__m256d)a.v[0], (__m256d)a.v[2]),
                                           _mm256_add_pd((__m256d)a.v[1], (__m256d)a.v[3]));
    const __m128d halves = _mm_add_pd(_mm256_castpd256_pd128(quarters), _mm256_extractf128_pd(quarters, 1));
    return _mm_cvtsd_f64(_mm_add_sd(halves, _mm_unpackhi_pd(halves, halves)));
}

static LN_ALWAYS_INLINE float gf_largest_lane(gf top)
{
    const __m256 eighths = _mm256_max_ps((__m256)top.v[0], (__m256)top.v[1]);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(eighths), _mm256_extractf128_ps(eighths, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static LN_ALWAYS_INLINE gd gd_load_f32(const float *p)
{
    gd r;
    FOR_VD(k) { r.v[k] = (ln_vd)_mm256_cvtps_pd(_mm_loadu_ps(p + 4 * k)); }
    return r;
}

static LN_ALWAYS_INLINE gd gd_sqrt(gd a)
{
    FOR_VD(k) { a.v[k] = (ln_vd)_mm256_sqrt_pd((__m256d)a.v[k]); }
    return a;
}

/* a * b + c, rounded once */
static LN_ALWAYS_INLINE gd gd_fma(gd a, gd b, gd c)
{
    FOR_VD(k) { a.v[k] = (ln_vd)_mm256_fmadd_pd((__m256d)a.v[k], (__m256d)b.v[k], (__m256d)c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE gf gf_fma(gf a, gf b, gf c)
{
    FOR_VF(k) { a.v[k] = (ln_vf)_mm256_fmadd_ps((__m256)a.v[k], (__m256)b.v[k], (__m256)c.v[k]); }
    return a;
}

/* Per lane, the larger of top (magnitudes) and |a|; a NaN lane of a leaves top as it was. */
static LN_ALWAYS_INLINE gd gd_max_magnitude(gd top, gd a)
{
    const __m256d magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffff));
    FOR_VD(k) { top.v[k] = (ln_vd)_mm256_max_pd(_mm256_and_pd((__m256d)a.v[k], magnitude), (__m256d)top.v[k]); }
    return top;
}

static LN_ALWAYS_INLINE gf gf_max_magnitude(gf top, gf a)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    FOR_VF(k) { top.v[k] = (ln_vf)_mm256_max_ps(_mm256_and_ps((__m256)a.v[k], magnitude), (__m256)top.v[k]); }
    return top;
}

static LN_ALWAYS_INLINE gf gf_max_magnitude_folded(gf top, gf a)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 larger = _mm256_max_ps(_mm256_and_ps((__m256)a.v[1], magnitude),
                                        _mm256_and_ps((__m256)a.v[0], magnitude));
    top.v[0] = (ln_vf)_mm256_max_ps(larger, (__m256)top.v[0]);
    return top;
}

static LN_ALWAYS_INLINE gd gf_widen(gf a)
{
    gd r;
    FOR_VF(k) {
        r.v[2 * k] = (ln_vd)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)a.v[k]));
        r.v[2 * k + 1] = (ln_vd)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)a.v[k], 1));
    }
    return r;
}

static LN_ALWAYS_INLINE gf gf_load_f16(const uint16_t *p)
{
    gf r;
    FOR_VF(k) { r.v[k] = (ln_vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * k))); }
    return r;
}

/* One 32-byte store, not a 16-byte store per half: a 32-byte load of the group (the streaming
   store's, halves_stream) cannot take its bytes from two stores still in flight, and waits
   for both to reach the cache (2048x4096 float16 forward, streamed, one thread, AMD Zen 3:
   4.95-5.05 -> 1.96-2.00 ms). */
static LN_ALWAYS_INLINE void gf_store_f16(uint16_t *p, gf a)
{
    const __m128i low = _mm256_cvtps_ph((__m256)a.v[0], _MM_FROUND_TO_NEAREST_INT);
    const __m128i high = _mm256_cvtps_ph((__m256)a.v[1], _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256((__m256i *)p, _mm256_set_m128i(high, low));
}

/* Lane l of the 32-bit mask at lane_masks + 16 - count is set (all ones) where l < count:
   the masks of the part loads, whose masked-out lanes read no memory and come back 0.  A
   part loaded through a buffer instead (the other levels) stalls its vector load on the
   buffer's narrower stores, which cannot forward to it (float32, one thread, rows of n
   elements, alternating processes: n = 24 forward 37.3 -> 23.4 ns a row, backward 106.5 ->
   62.6; n = 100 backward 157 -> 100; rows of 32, no part, backward 60). */
static const int32_t lane_masks[32] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};

static LN_ALWAYS_INLINE __m256i lanes_below(int count, int first)
{
    return _mm256_loadu_si256((const __m256i *)(lane_masks + 16 - count + first));
}

/* The first `count` (1 to 15) of the 16 elements at p into lanes 0 .. count - 1, the other
   lanes 0.0. */
static LN_ALWAYS_INLINE gf gf_load_part(const float *p, int count)
{
    gf r;
    FOR_VF(k) { r.v[k] = (ln_vf)_mm256_maskload_ps(p + 8 * k, lanes_below(count, 8 * k)); }
    return r;
}

static LN_ALWAYS_INLINE gd gd_load_part(const double *p, int count)
{
    gd r;
    FOR_VD(k) {
        const __m128i mask = _mm_loadu_si128((const __m128i *)(lane_masks + 16 - count + 4 * k));
        r.v[k] = (ln_vd)_mm256_maskload_pd(p + 4 * k, _mm256_cvtepi32_epi64(mask));
    }
    return r;
}

/* 16-bit elements: their pairs by a 32-bit masked load, an odd last one put in its lane. */
static LN_ALWAYS_INLINE __m256i halves_load_part(const uint16_t *p, int count)
{
    __m256i halves = _mm256_maskload_epi32((const int *)p, lanes_below(count / 2, 0));
    if (count % 2) {
        const __m256i lane_index = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m256i last = _mm256_cmpeq_epi16(lane_index, _mm256_set1_epi16((short)(count - 1)));
        halves = _mm256_blendv_epi8(halves, _mm256_set1_epi16((short)p[count - 1]), last);
    }
    return halves;
}

static LN_ALWAYS_INLINE gf gf_load_part_f16(const uint16_t *p, int count)
{
    const __m256i halves = halves_load_part(p, count);
    gf r;
    r.v[0] = (ln_vf)_mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    r.v[1] = (ln_vf)_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    return r;
}

static LN_ALWAYS_INLINE gf gf_load_part_bf16(const uint16_t *p, int count)
{
    const __m256i halves = halves_load_part(p, count);
    gf r;
    r.v[0] = bf16_widened((ln_vu32)_mm256_cvtepu16_epi32(_mm256_castsi256_si128(halves)));
    r.v[1] = bf16_widened((ln_vu32)_mm256_cvtepu16_epi32(_mm256_extracti128_si256(halves, 1)));
    return r;
}

/* bfloat16: zero-extending loads (vpmovzxwd); the two vectors' 16-bit results packed into
   one (vpackusdw interleaves them by 128-bit halves, vpermq puts the halves back in order). */
static LN_ALWAYS_INLINE gf gf_load_bf16(const uint16_t *p)
{
    gf r;
    FOR_VF(k) {
        r.v[k] = bf16_widened((ln_vu32)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8 * k))));
    }
    return r;
}

static LN_ALWAYS_INLINE void gf_store_bf16(uint16_t *p, gf a, int nan_lanes)
{
    const __m256i packed = _mm256_packus_epi32((__m256i)bf16_rounded(a.v[0], nan_lanes),
                                               (__m256i)bf16_rounded(a.v[1], nan_lanes));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(packed, 0xd8));
}

/* Streaming stores, p 64-byte aligned: 32-byte non-temporal stores. */
static LN_ALWAYS_INLINE void gd_stream(double *p, gd a)
{
    assert(((uintptr_t)p & 63) == 0);
    FOR_VD(k) { _mm256_stream_pd(p + 4 * k, (__m256d)a.v[k]); }
}

static LN_ALWAYS_INLINE void gf_stream(float *p, gf a)
{
    assert(((uintptr_t)p & 63) == 0);
    FOR_VF(k) { _mm256_stream_ps(p + 8 * k, (__m256)a.v[k]); }
}

/* Streaming stores, p 16-byte aligned: 16-byte non-temporal stores (SSE2 movntps), which
   NumPy's allocations and rows of a multiple of 16 bytes allow where a 32-byte alignment
   would not. */
static LN_ALWAYS_INLINE void stream16_256(char *p, __m256 v)
{
    _mm_stream_ps((float *)p, _mm256_castps256_ps128(v));
    _mm_stream_ps((float *)(p + 16), _mm256_extractf128_ps(v, 1));
}

static LN_ALWAYS_INLINE void gd_stream16(double *p, gd a)
{
    assert(((uintptr_t)p & 15) == 0);
    FOR_VD(k) { stream16_256((char *)(p + 4 * k), _mm256_castpd_ps((__m256d)a.v[k])); }
}

static LN_ALWAYS_INLINE void gf_stream16(float *p, gf a)
{
    assert(((uintptr_t)p & 15) == 0);
    FOR_VF(k) { stream16_256((char *)(p + 8 * k), (__m256)a.v[k]); }
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

/* 16 rows of 8 float32 elements, one after another, turned in registers between rows and
   columns (see short_rows_to_columns): rows holds 128 elements, and columns[i] element i of
   each row, as 16 float32 in its first 64 bytes.  Each 8 rows are an 8x8 matrix, transposed in
   three rounds of 8: in-lane unpacks pair rows 2j and 2j + 1, in-lane shuffles gather 4 rows of
   a column (column c in the low half, c + 4 in the high), and cross-lane permutes join rows 0-3
   and 4-7.  A transpose undoes itself, so the way back is the same.  Element by element it was
   128 loads and 128 stores each way. */
static LN_ALWAYS_INLINE void transpose8_f32(__m256 m[8])
{
    __m256 pairs[8], quads[8];
    for (int j = 0; j < 4; j++) {
        pairs[2 * j] = _mm256_unpacklo_ps(m[2 * j], m[2 * j + 1]);
        pairs[2 * j + 1] = _mm256_unpackhi_ps(m[2 * j], m[2 * j + 1]);
    }
    for (int h = 0; h < 2; h++) {  /* rows 4h .. 4h + 3 */
        const __m256 *p = pairs + 4 * h;
        quads[4 * h + 0] = _mm256_shuffle_ps(p[0], p[2], _MM_SHUFFLE(1, 0, 1, 0));
        quads[4 * h + 1] = _mm256_shuffle_ps(p[0], p[2], _MM_SHUFFLE(3, 2, 3, 2));
        quads[4 * h + 2] = _mm256_shuffle_ps(p[1], p[3], _MM_SHUFFLE(1, 0, 1, 0));
        quads[4 * h + 3] = _mm256_shuffle_ps(p[1], p[3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; c++) {
        m[c] = _mm256_permute2f128_ps(quads[c], quads[4 + c], 0x20);
        m[c + 4] = _mm256_permute2f128_ps(quads[c], quads[4 + c], 0x31);
    }
}

static LN_ALWAYS_INLINE void rows8_f32_to_columns(const float *rows, double columns[16][16])
{
    for (int half = 0; half < 2; half++) {  /* rows 8 * half .. 8 * half + 7 */
        __m256 m[8];
        for (int r = 0; r < 8; r++) {
            m[r] = _mm256_loadu_ps(rows + 64 * half + 8 * r);
        }
        transpose8_f32(m);
        for (int i = 0; i < 8; i++) {
            _mm256_storeu_ps((float *)columns[i] + 8 * half, m[i]);
        }
    }
}

static LN_ALWAYS_INLINE void rows8_f32_from_columns(double columns[16][16], float *rows)
{
    for (int half = 0; half < 2; half++) {
        __m256 m[8];
        for (int i = 0; i < 8; i++) {
            m[i] = _mm256_loadu_ps((const float *)columns[i] + 8 * half);
        }
        transpose8_f32(m);
        for (int r = 0; r < 8; r++) {
            _mm256_storeu_ps(rows + 64 * half + 8 * r, m[r]);
        }
    }
}

/* 16 groups turned in registers: lane k of group i to lane i of group k (a 16x16 matrix of
   float32 transposed), as four 8x8 transposes: the block of groups 8R .. 8R + 7, lanes
   8C .. 8C + 7 (their vectors v[C]) goes transposed to groups 8C .. 8C + 7, vectors v[R]. */
static LN_ALWAYS_INLINE void gf_transpose(gf groups[16])
{
    __m256 blocks[2][2][8];
    for (int r = 0; r < 16; r++) {
        for (int c = 0; c < 2; c++) {
            blocks[r / 8][c][r % 8] = (__m256)groups[r].v[c];
        }
    }
    for (int r = 0; r < 2; r++) {
        for (int c = 0; c < 2; c++) {
            transpose8_f32(blocks[r][c]);
        }
    }
    for (int r = 0; r < 2; r++) {
        for (int c = 0; c < 2; c++) {
            for (int i = 0; i < 8; i++) {
                groups[8 * c + i].v[r] = (ln_vf)blocks[r][c][i];
            }
        }
    }
}

/* Non-temporal stores are weakly ordered: finish them before the output is handed on. */
static LN_ALWAYS_INLINE void stream_fence(void)
{
    _mm_sfence();
}

#endif
