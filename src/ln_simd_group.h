/*
 * ln_simd_group.h -- the group operations that every SIMD level writes the same way.
 *
 * A group is 16 consecutive elements held in the level's native registers: gd as float64,
 * gf as float32.  Storing a group writes its elements in order, which is what makes "lane
 * k takes the elements i with i % 16 == k" hold at every level.  A level's header defines
 * its native types ln_vd and ln_vf (a vector_size type, or a plain double and float) and
 * how many of each make a group, LN_VD_PER_GROUP and LN_VF_PER_GROUP, then includes this;
 * GCC/Clang vector extensions give +, -, *, / lane by lane at every width.
 *
 * A level's header also says whether ln_rows.h compiles the common case of its hottest
 * loops apart from the loop that serves every case: forward rows with both a weight and a
 * bias, backward rows with dx and every parameter gradient asked for (LN_AFFINE_LOOP_APART
 * 1: that case runs with no tests in its loops, a few percent faster), or not (0: where a
 * group's arithmetic is many instructions or calls anyway).  The idiom is the same call in
 * both branches of `if (LN_AFFINE_LOOP_APART && weight && bias)`: inlined in the first, the
 * loops know the pointers are not NULL, and the compiler drops their tests.
 */
#ifndef LN_SIMD_GROUP_H
#define LN_SIMD_GROUP_H

#include "ln_internal.h"

typedef struct { ln_vd v[LN_VD_PER_GROUP]; } gd;
typedef struct { ln_vf v[LN_VF_PER_GROUP]; } gf;

#define LN_VD_LANES (16 / LN_VD_PER_GROUP)  /* float64 lanes of one ln_vd */
#define LN_VF_LANES (16 / LN_VF_PER_GROUP)  /* float32 lanes of one ln_vf */
#define FOR_VD(k) for (int k = 0; k < LN_VD_PER_GROUP; k++)
#define FOR_VF(k) for (int k = 0; k < LN_VF_PER_GROUP; k++)

/* Unaligned, aliasing-safe views of memory as native vectors. */
typedef ln_vd ln_vd_mem __attribute__((aligned(1), may_alias));
typedef ln_vf ln_vf_mem __attribute__((aligned(1), may_alias));

/* Every lane `value`: value - (+0.0) is value bit for bit, -0.0 included, where the sum
   0.0 + value would make -0.0 into +0.0. */
static LN_ALWAYS_INLINE gd gd_splat(double value)
{
    gd r;
    FOR_VD(k) { r.v[k] = value - (ln_vd){0}; }
    return r;
}

static LN_ALWAYS_INLINE gd gd_add(gd a, gd b) { FOR_VD(k) { a.v[k] += b.v[k]; } return a; }
static LN_ALWAYS_INLINE gd gd_sub(gd a, gd b) { FOR_VD(k) { a.v[k] -= b.v[k]; } return a; }
static LN_ALWAYS_INLINE gd gd_mul(gd a, gd b) { FOR_VD(k) { a.v[k] *= b.v[k]; } return a; }
static LN_ALWAYS_INLINE gd gd_div(gd a, gd b) { FOR_VD(k) { a.v[k] /= b.v[k]; } return a; }

static LN_ALWAYS_INLINE gd gd_load(const double *p)
{
    gd r;
    FOR_VD(k) { r.v[k] = *(const ln_vd_mem *)(p + LN_VD_LANES * k); }
    return r;
}

static LN_ALWAYS_INLINE void gd_store(double *p, gd a)
{
    FOR_VD(k) { *(ln_vd_mem *)(p + LN_VD_LANES * k) = a.v[k]; }
}

/* a with each NaN lane the one quiet NaN (NAN's bits) and the others as they are: a select
   on the lanes' bits where the level has vectors, so that it costs a few vector operations
   instead of a test and a branch per lane. */
#if LN_VD_LANES > 1
typedef uint64_t ln_vu64 __attribute__((vector_size(sizeof(ln_vd))));

static LN_ALWAYS_INLINE gd gd_quiet_nans(gd a)
{
    const ln_vu64 quiet = (ln_vu64)((ln_vd){0} + NAN);
    FOR_VD(k) {
        const ln_vu64 is_number = (ln_vu64)(a.v[k] == a.v[k]);
        a.v[k] = (ln_vd)(((ln_vu64)a.v[k] & is_number) | (quiet & ~is_number));
    }
    return a;
}
#else
static LN_ALWAYS_INLINE gd gd_quiet_nans(gd a)
{
    FOR_VD(k) { a.v[k] = isnan(a.v[k]) ? NAN : a.v[k]; }
    return a;
}
#endif

/* ln_doubles_to_odd_float_bits on a group (see there): returns 0 and leaves a as it was where
   a lane lies below float32's normal range (not zero).  In vectors where the level has them,
   written so: the compiler's vectorization of the array form came and went with the code
   around it (float16 rows of 8 elements, forward: 24 -> 30 ms for a change elsewhere in the
   same function). */
#if LN_VD_LANES > 1
static LN_ALWAYS_INLINE int gd_to_odd_float_bits(gd *a)
{
    const ln_vu64 magnitude = (ln_vu64){0} + 0x7fffffffffffffffu;
    const ln_vu64 normal_min_less_1 = (ln_vu64){0} + (0x3810000000000000u - 1);  /* 2**-126 */
    const ln_vu64 dropped = (ln_vu64){0} + ((UINT64_C(1) << 29) - 1);
    ln_vu64 below_normal = {0};
    FOR_VD(k) { below_normal |= (ln_vu64)((((ln_vu64)a->v[k] & magnitude) - 1) < normal_min_less_1); }
    uint64_t any_below = 0;
    for (int j = 0; j < LN_VD_LANES; j++) {
        any_below |= below_normal[j];
    }
    if (any_below) {
        return 0;
    }
    FOR_VD(k) {
        const ln_vu64 bits = (ln_vu64)a->v[k];
        const ln_vu64 inexact = (ln_vu64)((bits & dropped) != 0) & (ln_vu64)(a->v[k] == a->v[k]);
        a->v[k] = (ln_vd)((bits & ~(dropped & inexact)) | ((dropped + 1) & inexact));
    }
    return 1;
}
#else
static LN_ALWAYS_INLINE int gd_to_odd_float_bits(gd *a)
{
    return ln_doubles_to_odd_float_bits(a->v);
}
#endif

/* The sum of a's 16 lanes in ln_sum_lanes' order (lanes k and k + 8, those sums k and k + 4,
   then (0 + 2) + (1 + 3)), in registers: a group stored and read back lane by lane waits for
   the store to reach the cache before the loads can take it.  A level with wide vectors
   defines its own, halving its vectors (LN_LANE_REDUCTIONS). */
#if defined(LN_LANE_REDUCTIONS)
#elif LN_VD_LANES > 1
static LN_ALWAYS_INLINE double gd_sum_lanes(gd a)
{
    const int half = LN_VD_PER_GROUP / 2;
    double pairs[8];
    for (int k = 0; k < half; k++) {
        const ln_vd sums = a.v[k] + a.v[k + half];
        for (int j = 0; j < LN_VD_LANES; j++) {
            pairs[k * LN_VD_LANES + j] = sums[j];
        }
    }
    return ((pairs[0] + pairs[4]) + (pairs[2] + pairs[6])) + ((pairs[1] + pairs[5]) + (pairs[3] + pairs[7]));
}
#else
static LN_ALWAYS_INLINE double gd_sum_lanes(gd a)
{
    return ln_sum_lanes(a.v);
}
#endif

/* Whether every lane of a lies in [low, high] (a NaN lane does not); a level with mask
   registers defines its own (LN_GD_ALL_WITHIN). */
#if defined(LN_GD_ALL_WITHIN)
#elif LN_VD_LANES > 1
static LN_ALWAYS_INLINE int gd_all_within(gd a, double low, double high)
{
    ln_vu64 inside = ~(ln_vu64){0};
    FOR_VD(k) { inside &= (ln_vu64)((a.v[k] >= low) & (a.v[k] <= high)); }
    uint64_t all = ~(uint64_t)0;
    for (int j = 0; j < LN_VD_LANES; j++) {
        all &= inside[j];
    }
    return all != 0;
}
#else
static LN_ALWAYS_INLINE int gd_all_within(gd a, double low, double high)
{
    int all = 1;
    FOR_VD(k) { all &= low <= a.v[k] && a.v[k] <= high; }
    return all;
}
#endif

/* Whether any lane of a is nonzero and of magnitude below bound. */
#if LN_VD_LANES > 1
static LN_ALWAYS_INLINE int gd_any_nonzero_below(gd a, double bound)
{
    ln_vu64 found = {0};
    FOR_VD(k) { found |= (ln_vu64)((a.v[k] != 0.0) & (a.v[k] < bound) & (a.v[k] > -bound)); }
    uint64_t any = 0;
    for (int j = 0; j < LN_VD_LANES; j++) {
        any |= found[j];
    }
    return any != 0;
}
#else
static LN_ALWAYS_INLINE int gd_any_nonzero_below(gd a, double bound)
{
    int any = 0;
    FOR_VD(k) { any |= a.v[k] != 0.0 && fabs(a.v[k]) < bound; }
    return any;
}
#endif

static LN_ALWAYS_INLINE gf gf_splat(float value)
{
    gf r;
    FOR_VF(k) { r.v[k] = value - (ln_vf){0}; }  /* as gd_splat */
    return r;
}

static LN_ALWAYS_INLINE gf gf_add(gf a, gf b) { FOR_VF(k) { a.v[k] += b.v[k]; } return a; }
static LN_ALWAYS_INLINE gf gf_sub(gf a, gf b) { FOR_VF(k) { a.v[k] -= b.v[k]; } return a; }
static LN_ALWAYS_INLINE gf gf_mul(gf a, gf b) { FOR_VF(k) { a.v[k] *= b.v[k]; } return a; }

static LN_ALWAYS_INLINE gf gf_load(const float *p)
{
    gf r;
    FOR_VF(k) { r.v[k] = *(const ln_vf_mem *)(p + LN_VF_LANES * k); }
    return r;
}

static LN_ALWAYS_INLINE void gf_store(float *p, gf a)
{
    FOR_VF(k) { *(ln_vf_mem *)(p + LN_VF_LANES * k) = a.v[k]; }
}

/* bfloat16 groups: each level loads and stores them with its own shuffles (gf_load_bf16,
   gf_store_bf16); the arithmetic on the bits, the scalar conversions of ln_types.h lane by
   lane, is written here once for the vector levels (avx512 does the same with its masks),
   so all convert bit for bit alike. */
#if LN_VF_LANES > 1

typedef uint32_t ln_vu32 __attribute__((vector_size(sizeof(ln_vf))));

/* float32 lanes from bfloat16 values zero-extended into 32-bit lanes: the top halves. */
static LN_ALWAYS_INLINE ln_vf bf16_widened(ln_vu32 halves)
{
    return (ln_vf)(halves << 16);
}

/* The bfloat16 of each lane, in its low 16 bits (the high ones zero): rounded to nearest
   even by adding 0x7fff plus the kept lsb (a carry steps the exponent, up to Inf).  Where
   nan_lanes, NaN lanes get no add and keep their top half, already quiet since every value
   stored is a result of float arithmetic; without it the lanes must hold no NaN (the add
   could carry a NaN's payload into its exponent and sign), and the test is left out. */
static LN_ALWAYS_INLINE ln_vu32 bf16_rounded(ln_vf value, int nan_lanes)
{
    const ln_vu32 bits = (ln_vu32)value;
    const ln_vu32 round = 0x7fff + ((bits >> 16) & 1);
    return (bits + (nan_lanes ? round & (ln_vu32)(value == value) : round)) >> 16;
}

#endif

/* a with each NaN lane the one quiet NaN, as gd_quiet_nans. */
#if LN_VF_LANES > 1
static LN_ALWAYS_INLINE gf gf_quiet_nans(gf a)
{
    const ln_vu32 quiet = (ln_vu32)((ln_vf){0} + NAN);
    FOR_VF(k) {
        const ln_vu32 is_number = (ln_vu32)(a.v[k] == a.v[k]);
        a.v[k] = (ln_vf)(((ln_vu32)a.v[k] & is_number) | (quiet & ~is_number));
    }
    return a;
}
#else
static LN_ALWAYS_INLINE gf gf_quiet_nans(gf a)
{
    FOR_VF(k) { a.v[k] = isnan(a.v[k]) ? NAN : a.v[k]; }
    return a;
}
#endif

/* a in lanes 0 .. count - 1, 0.0 in the rest. */
#if LN_VD_LANES > 1
typedef int64_t ln_vi64 __attribute__((vector_size(sizeof(ln_vd))));
typedef ln_vi64 ln_vi64_mem __attribute__((aligned(1), may_alias));

static LN_ALWAYS_INLINE gd gd_first_lanes(gd a, int count)
{
    static const int64_t lane_of[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    FOR_VD(k) {
        const ln_vu64 kept = (ln_vu64)(*(const ln_vi64_mem *)(lane_of + LN_VD_LANES * k) < count);
        a.v[k] = (ln_vd)((ln_vu64)a.v[k] & kept);
    }
    return a;
}
#else
static LN_ALWAYS_INLINE gd gd_first_lanes(gd a, int count)
{
    FOR_VD(k) { a.v[k] = k < count ? a.v[k] : 0.0; }
    return a;
}
#endif

/* a, as it is, in registers from here on: where a loaded group has several uses, GCC folds
   the load into each of them, and a loop bound by its loads makes them again (backward pass
   1, RMSNorm 2048x4096 float32, one thread: 2.8 ms with them kept, 3.2 ms folded).  An empty
   asm that says it changes them, at the levels whose vectors are x86 registers (LN_GF_KEEP);
   elsewhere nothing. */
static LN_ALWAYS_INLINE gf gf_kept(gf a)
{
#if defined(LN_GF_KEEP)
    FOR_VF(k) { __asm__("" : "+v"(a.v[k])); }
#endif
    return a;
}

/* Whether some lane of a is t or more, and whether every lane is t or less (a NaN lane is
   neither); a level with mask registers defines its own (LN_GF_LANE_TESTS). */
#if defined(LN_GF_LANE_TESTS)
#elif LN_VF_LANES > 1
static LN_ALWAYS_INLINE int gf_any_at_least(gf a, float t)
{
    ln_vu32 hit = {0};
    FOR_VF(k) { hit |= (ln_vu32)(a.v[k] >= t); }
    uint32_t any = 0;
    for (int j = 0; j < LN_VF_LANES; j++) {
        any |= hit[j];
    }
    return any != 0;
}

static LN_ALWAYS_INLINE int gf_all_at_most(gf a, float t)
{
    ln_vu32 inside = ~(ln_vu32){0};
    FOR_VF(k) { inside &= (ln_vu32)(a.v[k] <= t); }
    uint32_t all = ~(uint32_t)0;
    for (int j = 0; j < LN_VF_LANES; j++) {
        all &= inside[j];
    }
    return all != 0;
}
#else
static LN_ALWAYS_INLINE int gf_any_at_least(gf a, float t)
{
    int any = 0;
    FOR_VF(k) { any |= a.v[k] >= t; }
    return any;
}

static LN_ALWAYS_INLINE int gf_all_at_most(gf a, float t)
{
    int all = 1;
    FOR_VF(k) { all &= a.v[k] <= t; }
    return all;
}
#endif

/* Each level's gf_max_magnitude(top, a) takes, lane by lane, the larger of top and |a|, a NaN
   lane of a leaving top as it was; gf_max_magnitude_folded(top, a) folds a's vectors into
   top's first (the others left as they are), for a maximum over a row, where lanes do not
   matter: one register for it where a group takes several.  There a NaN of a may also hide
   the lanes it is folded with (the rows holding one go by ln_backward_exact_row anyway).

   The largest lane of top, magnitudes none of which is NaN (gf_max_magnitude's), in
   registers: any order of compares gives it, so the level's vectors are folded lane by
   lane and then one vector's lanes (or halved, where the level defines its own:
   LN_LANE_REDUCTIONS). */
#if !defined(LN_LANE_REDUCTIONS)
static LN_ALWAYS_INLINE float gf_largest_lane(gf top)
{
    float largest = 0.0f;
#if LN_VF_LANES > 1
    ln_vf folded = top.v[0];
    for (int k = 1; k < LN_VF_PER_GROUP; k++) {
        const ln_vu32 larger = (ln_vu32)(top.v[k] > folded);
        folded = (ln_vf)(((ln_vu32)top.v[k] & larger) | ((ln_vu32)folded & ~larger));
    }
    for (int j = 0; j < LN_VF_LANES; j++) {
        largest = folded[j] > largest ? folded[j] : largest;
    }
#else
    FOR_VF(k) { largest = top.v[k] > largest ? top.v[k] : largest; }
#endif
    return largest;
}
#endif

#endif
