/*
 * ln_types.h -- the element types: their sizes, parameter types and scalar conversions.
 *
 * Data (x, y, dy, dx) is of the element type; weight, bias, mean and rstd are of its
 * parameter type; statistics are float64 inside the kernels whatever the type.
 */
#ifndef LN_TYPES_H
#define LN_TYPES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ln_kernels.h"

/*
 * The one list of element types, in ln_dtype order, as X(dtype, suffix):
 *
 *     LN_F16  IEEE binary16, 2 bytes   params float32   row arithmetic in float32
 *     LN_F32  IEEE binary32, 4 bytes   params float32   row arithmetic in float32
 *     LN_F64  IEEE binary64, 8 bytes   params float64   row arithmetic in float64
 *     LN_BF16 bfloat16, 2 bytes        params float32   row arithmetic in float32
 *
 * (bfloat16 is the top half of a binary32: 8 exponent bits, 8 significant bits.)
 */
#define LN_FOR_EACH_DTYPE(X) \
    X(LN_F16, f16)           \
    X(LN_F32, f32)           \
    X(LN_F64, f64)           \
    X(LN_BF16, bf16)
#define LN_DTYPES 4

/* The 2-byte types, whose rows are computed in float32 from 16-bit loads and stores. */
static inline int ln_dtype_is_16bit(ln_dtype dtype)
{
    return dtype == LN_F16 || dtype == LN_BF16;
}

static inline size_t ln_dtype_size(ln_dtype dtype)
{
    return ln_dtype_is_16bit(dtype) ? 2 : dtype == LN_F32 ? 4 : 8;
}

/* Bytes per weight, bias, mean and rstd: float32, or float64 for float64 data. */
static inline size_t ln_param_size(ln_dtype dtype)
{
    return dtype == LN_F64 ? 8 : 4;
}

/*
 * IEEE binary16 <-> binary32, rounding to nearest even, NaN kept quiet with the top of its
 * payload (what F16C and NEON do).  F16C's instructions where the unit is compiled for them
 * (GCC's _Float16 converts to float64 by a library call there); else _Float16 where the
 * compiler has it on this target; otherwise (Clang 14 on x86-64) the same conversions on
 * the bits.
 */
#if defined(__F16C__)
#include <immintrin.h>

static inline float ln_half_to_float(uint16_t h)
{
    return _cvtsh_ss(h);
}

static inline uint16_t ln_float_to_half(float f)
{
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

#elif defined(__FLT16_MANT_DIG__)

static inline float ln_half_to_float(uint16_t h)
{
    _Float16 value;
    memcpy(&value, &h, sizeof value);
    return (float)value;
}

static inline uint16_t ln_float_to_half(float f)
{
    _Float16 value = (_Float16)f;
    uint16_t h;
    memcpy(&h, &value, sizeof h);
    return h;
}

#else

static inline float ln_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {  /* Inf, or NaN made quiet */
        bits = sign | 0x7f800000 | (mantissa << 13) | (mantissa ? 0x400000 : 0);
    }
    else if (exponent != 0) {  /* normal: rebias the exponent from 15 to 127 */
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    else {  /* zero or subnormal: mantissa * 2^-24, exact in float32 */
        const float magnitude = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t ln_float_to_half(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    uint32_t magnitude = bits & 0x7fffffff;
    if (magnitude > 0x7f800000) {  /* NaN: quiet, the top 10 bits of the payload */
        return (uint16_t)(sign | 0x7e00 | ((magnitude >> 13) & 0x3ff));
    }
    if (magnitude >= 0x47800000) {  /* 2^16 or more (and Inf): Inf */
        return (uint16_t)(sign | 0x7c00);
    }
    if (magnitude < 0x38800000) {
        /* below 2^-14, a subnormal half: adding 0.5, whose float32 ulp is 2^-24 (the half
           subnormal step), rounds |f| to a multiple of 2^-24, to nearest even */
        float rounded;
        memcpy(&rounded, &magnitude, sizeof rounded);
        rounded += 0.5f;
        memcpy(&magnitude, &rounded, sizeof magnitude);
        return (uint16_t)(sign | (magnitude - 0x3f000000));
    }
    /* normal: rebias the exponent from 127 to 15 and round the 13 dropped bits to nearest
       even (a carry out of the mantissa steps the exponent, up to Inf from 65520 on) */
    magnitude += ((uint32_t)(15 - 127) << 23) + 0xfff + ((magnitude >> 13) & 1);
    return (uint16_t)(sign | (magnitude >> 13));
}

#endif

/* bfloat16 -> binary32: the 16 bits are the float's top half (exact). */
static inline float ln_bfloat16_to_float(uint16_t b)
{
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* binary32 -> bfloat16, rounding to nearest even (a carry out of the mantissa steps the
   exponent, up to Inf); NaN made quiet, keeping its sign and the top of its payload. */
static inline uint16_t ln_float_to_bfloat16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffff) > 0x7f800000) {
        return (uint16_t)((bits | 0x00400000) >> 16);
    }
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* Element i of p, of the element type, as float64 (exact). */
static inline double ln_load1_as_f64(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    switch (dtype) {
    case LN_F16:
        return ln_half_to_float(((const uint16_t *)p)[i]);
    case LN_BF16:
        return ln_bfloat16_to_float(((const uint16_t *)p)[i]);
    case LN_F32:
        return ((const float *)p)[i];
    default:
        return ((const double *)p)[i];
    }
}

/* value rounded to float32 to odd: toward zero, then the last bit set if that was inexact.
   Rounding that to nearest even in 8 or 11 bits gives value's own rounding there (float32
   keeps at least 2 more bits), where rounding to nearest twice can land on the wrong side
   of a tie. */
static inline float ln_double_to_float_odd(double value)
{
    float f = (float)value;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    /* inexact with an even last bit: the other float32 neighbour of value, one step in
       magnitude (f and value share a sign), by arithmetic instead of a branch that would go
       either way at random */
    const uint32_t step = ((double)f != value) & (value == value) & ((bits & 1) == 0);
    const uint32_t rounded_up = fabs((double)f) > fabs(value);
    bits += step * (1u - 2u * rounded_up);
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ln_double_to_float_odd of values[0 .. 16), in place, as float64 values that convert to
   float32 exactly, where every lane is in float32's normal range, zero, Inf or NaN; returns
   0 and leaves values as they were where a lane lies below float32's normal range (not
   zero), whose precision is shorter.  On the bits, rounding to odd is truncation (of the 29
   bits below float32's last) with the last kept bit set where a dropped bit was set, a few
   integer operations a lane, where the scalar function's conversions and tests take longer
   (float16 rows of 4 elements, forward: 1.5x as fast); the vector levels do the same on
   vectors (gd_to_odd_float_bits).  Values at or above
   2**128 stay there, and the conversion to float32 rounds them to Inf where
   ln_double_to_float_odd gives FLT_MAX, which float16 and bfloat16 both round to Inf. */
static inline int ln_doubles_to_odd_float_bits(double values[16])
{
    const uint64_t magnitude = 0x7fffffffffffffffu, float_normal_min = 0x3810000000000000u;  /* 2**-126 */
    const uint64_t dropped = (UINT64_C(1) << 29) - 1;
    uint64_t bits[16];
    memcpy(bits, values, sizeof bits);
    int below_normal = 0;
    for (int k = 0; k < 16; k++) {
        below_normal |= (bits[k] & magnitude) - 1 < float_normal_min - 1;
    }
    if (below_normal) {
        return 0;
    }
    for (int k = 0; k < 16; k++) {
        const int inexact = (bits[k] & dropped) != 0 && values[k] == values[k];
        bits[k] = inexact ? (bits[k] & ~dropped) | (dropped + 1) : bits[k];
    }
    memcpy(values, bits, sizeof bits);
    return 1;
}

/* value rounded once to the element type, into element i of p. */
static inline void ln_store1_from_f64(ln_dtype dtype, void *p, ptrdiff_t i, double value)
{
    switch (dtype) {
    case LN_F16:
        ((uint16_t *)p)[i] = ln_float_to_half(ln_double_to_float_odd(value));
        break;
    case LN_BF16:
        ((uint16_t *)p)[i] = ln_float_to_bfloat16(ln_double_to_float_odd(value));
        break;
    case LN_F32:
        ((float *)p)[i] = (float)value;
        break;
    default:
        ((double *)p)[i] = value;
    }
}

/* Parameter i of p, of dtype's parameter type, as float64 (exact). */
static inline double ln_load1_param_as_f64(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    return dtype == LN_F64 ? ((const double *)p)[i] : ((const float *)p)[i];
}

/* value rounded once to dtype's parameter type, into parameter i of p. */
static inline void ln_store1_param(ln_dtype dtype, void *p, ptrdiff_t i, double value)
{
    value = isnan(value) ? NAN : value;  /* the one quiet NaN (x86's sqrt of a negative is -NaN) */
    if (dtype == LN_F64) {
        ((double *)p)[i] = value;
    }
    else {
        ((float *)p)[i] = (float)value;
    }
}

#endif
