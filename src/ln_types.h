/*
 * ln_types.h -- the element types: their sizes, parameter types and scalar conversions.
 *
 * Data (x, y, dy, dx) is of the element type; weight, bias, mean and rstd are of its
 * parameter type; statistics are float64 inside the kernels whatever the type.
 */
#ifndef LN_TYPES_H
#define LN_TYPES_H

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
 *
 * bfloat16 goes here: add LN_BF16 to ln_dtype, X(LN_BF16, bf16) to this list, its size and
 * conversions to the functions below, and its group load/store next to float16's in ln_rows.h.
 */
#define LN_FOR_EACH_DTYPE(X) \
    X(LN_F16, f16)           \
    X(LN_F32, f32)           \
    X(LN_F64, f64)
#define LN_DTYPES 3

static inline size_t ln_dtype_size(ln_dtype dtype)
{
    return dtype == LN_F16 ? 2 : dtype == LN_F32 ? 4 : 8;
}

/* Bytes per weight, bias, mean and rstd: float32, or float64 for float64 data. */
static inline size_t ln_param_size(ln_dtype dtype)
{
    return dtype == LN_F64 ? 8 : 4;
}

/* IEEE binary16 <-> binary32, round to nearest even (the hardware's rounding). */
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

/* Element i of p, of the element type, as float64 (exact). */
static inline double ln_load1_as_f64(ln_dtype dtype, const void *p, ptrdiff_t i)
{
    switch (dtype) {
    case LN_F16:
        return ln_half_to_float(((const uint16_t *)p)[i]);
    case LN_F32:
        return ((const float *)p)[i];
    default:
        return ((const double *)p)[i];
    }
}

/* value rounded once to the element type, into element i of p. */
static inline void ln_store1_from_f64(ln_dtype dtype, void *p, ptrdiff_t i, double value)
{
    switch (dtype) {
    case LN_F16:
        ((uint16_t *)p)[i] = ln_float_to_half((float)value);
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
    if (dtype == LN_F64) {
        ((double *)p)[i] = value;
    }
    else {
        ((float *)p)[i] = (float)value;
    }
}

#endif
