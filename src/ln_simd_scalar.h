/*
 * ln_simd_scalar.h -- the group primitives of the scalar level: any GCC/Clang target,
 * no vector instructions asked for (the compiler may still vectorize what it can prove
 * equivalent).  A group is 16 plain doubles or floats; the streaming stores are ordinary
 * stores.
 */
#ifndef LN_SIMD_SCALAR_H
#define LN_SIMD_SCALAR_H

#include "ln_internal.h"

typedef double ln_vd;
typedef float ln_vf;
#define LN_VD_PER_GROUP 16
#define LN_VF_PER_GROUP 16
#define LN_AFFINE_LOOP_APART 0  /* 16 scalar operations a group operation */
#define LN_ROWS8_F32_TRANSPOSE 0
#define LN_GF_TRANSPOSE 0
#define LN_BF16_PAIR_STORE 0

#include "ln_simd_group.h"

static LN_ALWAYS_INLINE gd gd_load_f32(const float *p)
{
    gd r;
    FOR_VD(k) { r.v[k] = (double)p[k]; }
    return r;
}

static LN_ALWAYS_INLINE gd gd_sqrt(gd a)
{
    FOR_VD(k) { a.v[k] = sqrt(a.v[k]); }
    return a;
}

/* a * b + c, rounded once */
static LN_ALWAYS_INLINE gd gd_fma(gd a, gd b, gd c)
{
    FOR_VD(k) { a.v[k] = fma(a.v[k], b.v[k], c.v[k]); }
    return a;
}

static LN_ALWAYS_INLINE gf gf_fma(gf a, gf b, gf c)
{
    FOR_VF(k) { a.v[k] = fmaf(a.v[k], b.v[k], c.v[k]); }
    return a;
}

/* Per lane, the larger of top (magnitudes) and |a|; a NaN lane of a leaves top as it was. */
static LN_ALWAYS_INLINE gd gd_max_magnitude(gd top, gd a)
{
    FOR_VD(k) { top.v[k] = fabs(a.v[k]) > top.v[k] ? fabs(a.v[k]) : top.v[k]; }
    return top;
}

static LN_ALWAYS_INLINE gf gf_max_magnitude(gf top, gf a)
{
    FOR_VF(k) { top.v[k] = fabsf(a.v[k]) > top.v[k] ? fabsf(a.v[k]) : top.v[k]; }
    return top;
}

static LN_ALWAYS_INLINE gf gf_max_magnitude_folded(gf top, gf a)
{
    return gf_max_magnitude(top, a);
}

static LN_ALWAYS_INLINE gd gf_widen(gf a)
{
    gd r;
    FOR_VD(k) { r.v[k] = (double)a.v[k]; }
    return r;
}

static LN_ALWAYS_INLINE gf gf_load_f16(const uint16_t *p)
{
    gf r;
    FOR_VF(k) { r.v[k] = ln_half_to_float(p[k]); }
    return r;
}

static LN_ALWAYS_INLINE void gf_store_f16(uint16_t *p, gf a)
{
    FOR_VF(k) { p[k] = ln_float_to_half(a.v[k]); }
}

static LN_ALWAYS_INLINE gf gf_load_bf16(const uint16_t *p)
{
    gf r;
    FOR_VF(k) { r.v[k] = ln_bfloat16_to_float(p[k]); }
    return r;
}

/* nan_lanes: whether a lane may be a NaN, which the scalar conversion tests for anyway */
static LN_ALWAYS_INLINE void gf_store_bf16(uint16_t *p, gf a, int nan_lanes)
{
    (void)nan_lanes;
    FOR_VF(k) { p[k] = ln_float_to_bfloat16(a.v[k]); }
}

/* Streaming stores (p 64-byte aligned), 16-byte streaming stores (p 16-byte aligned, also
   piece_stream's 16 bytes from a buffer) and 16-bit elements' streaming stores
   (halves_stream, p 32-byte aligned): ordinary stores at this level. */
static LN_ALWAYS_INLINE void gd_stream(double *p, gd a)
{
    assert(((uintptr_t)p & 63) == 0);
    gd_store(p, a);
}

static LN_ALWAYS_INLINE void gf_stream(float *p, gf a)
{
    assert(((uintptr_t)p & 63) == 0);
    gf_store(p, a);
}

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
