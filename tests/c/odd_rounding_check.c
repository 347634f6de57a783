/*
 * odd_rounding_check.c -- checks ln_doubles_to_odd_float_bits (src/ln_types.h), the rounding
 * to odd of 16 float64 values at a time on their bits, against ln_double_to_float_odd, the
 * scalar rounding it stands in for, without Python: built and run by tests/test_c_checks.py.
 *
 *     cc -std=c11 -O3 -ffp-contract=off -Isrc tests/c/odd_rounding_check.c -lm -o check
 *     ./check           prints "odd_rounding_check: ok", or the first differences and exits 1
 *
 * Each lane must give the scalar function's float32, bit for bit (a NaN's payload too), or,
 * at or above 2**128, where the two differ by design (Inf against FLT_MAX), the same float16
 * and bfloat16.  Groups with a lane below float32's normal range must be refused and left as
 * they were.  The values: random bit patterns (every kind of double), random significands at
 * exponents across float32's range and its edges (2**-126, 2**128), float32 values exactly and
 * a hair either side of them, halfway points between neighbouring float32 values and a hair
 * either side (where rounding to nearest and to odd part), zeros, infinities and NaNs; in
 * about one group in 16, a lane below float32's normal range.
 */
#include "ln_types.h"

#include <float.h>
#include <stdio.h>

#include "check_random.h"

#define GROUPS 2000000

static double from_bits(uint64_t bits)
{
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static uint64_t bits_of(double value)
{
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static uint32_t float_bits(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* One test value; `kind` picks how it is made. */
static double test_value(int kind)
{
    const uint64_t sign = random_bits() & 0x8000000000000000u;
    switch (kind) {
    case 0:  /* any bit pattern */
        return from_bits(random_bits());
    case 1: {  /* a random significand at an exponent from 2**-130 to 2**130 */
        const uint64_t exponent = (uint64_t)(1023 - 130 + (int)(random_bits() % 261));
        return from_bits(sign | exponent << 52 | (random_bits() & 0x000fffffffffffffu));
    }
    case 2: {  /* a float32 value, exactly or a few float64 units either side */
        uint32_t f = (uint32_t)random_bits() & 0x7fffffffu;
        if ((f & 0x7f800000u) == 0x7f800000u) {
            f &= 0x7f7fffffu;
        }
        float value;
        memcpy(&value, &f, sizeof value);
        const int64_t step = (int64_t)(random_bits() % 7) - 3;
        return from_bits((bits_of((double)value) + (uint64_t)step) | sign);
    }
    case 3: {  /* halfway between two float32 neighbours, or a few float64 units either side */
        const uint64_t exponent = (uint64_t)(1023 - 126 + (int)(random_bits() % 254));
        const uint64_t halfway = exponent << 52 | (random_bits() & 0x000fffffe0000000u) | 0x10000000u;
        const int64_t step = (int64_t)(random_bits() % 5) - 2;
        return from_bits((halfway + (uint64_t)step) | sign);
    }
    default: {  /* the edges */
        static const double edges[] = {0.0, INFINITY, NAN, FLT_MAX, FLT_MIN, 0x1p128, 0x1p-126, 0x1p-149,
                                       0x1.fffffffp127, 0x1.ffffffp-127, DBL_MAX, DBL_MIN, 1.0, 3.0};
        const double edge = edges[random_bits() % (sizeof edges / sizeof edges[0])];
        const int64_t step = (int64_t)(random_bits() % 5) - 2;
        return from_bits((bits_of(edge) + (uint64_t)step) | sign);
    }
    }
}

static int below_normal(double value)
{
    return value != 0.0 && fabs(value) < 0x1p-126;
}

/* A nonzero value below float32's normal range: a float64 subnormal or normal. */
static double below_normal_value(void)
{
    const uint64_t exponent = random_bits() % (1023 - 126);
    const uint64_t bits = (random_bits() & 0x800fffffffffffffu) | exponent << 52;
    return below_normal(from_bits(bits)) ? from_bits(bits) : 0x1p-127;
}

int main(void)
{
    long failures = 0, refused = 0;
    for (long g = 0; g < GROUPS && failures < 10; g++) {
        double values[16], kept[16];
        const int kind = (int)(random_bits() % 5);
        int expect_refused = 0;
        for (int k = 0; k < 16; k++) {
            /* groups of one kind, drawn again where a value falls below float32's normal range
               (so that most groups are rounded, not refused), and such a lane in a few */
            do {
                values[k] = test_value(kind);
            } while (below_normal(values[k]));
            values[k] = random_bits() % 256 == 0 ? below_normal_value() : values[k];
            expect_refused |= below_normal(values[k]);
        }
        memcpy(kept, values, sizeof kept);
        const int done = ln_doubles_to_odd_float_bits(values);
        if (!done) {
            refused++;
            if (!expect_refused || memcmp(values, kept, sizeof kept) != 0) {
                printf("group %ld refused with no lane below float32's normal range, or changed\n", g);
                failures++;
            }
            continue;
        }
        if (expect_refused) {
            printf("group %ld has a lane below float32's normal range but was rounded\n", g);
            failures++;
            continue;
        }
        for (int k = 0; k < 16; k++) {
            const float got = (float)values[k], want = ln_double_to_float_odd(kept[k]);
            if ((double)got != values[k] && got == got && fabs(kept[k]) < 0x1p128) {
                printf("%a: rounded to %a, which float32 does not hold\n", kept[k], values[k]);
                failures++;
            }
            const int same = float_bits(got) == float_bits(want);  /* NaNs too: the same payload */
            const int beyond = fabs(kept[k]) >= 0x1p128 && kept[k] == kept[k] &&
                               ln_float_to_half(got) == ln_float_to_half(want) &&
                               ln_float_to_bfloat16(got) == ln_float_to_bfloat16(want);
            if (!same && !beyond) {
                printf("%a: %a, where ln_double_to_float_odd gives %a\n", kept[k], (double)got, (double)want);
                failures++;
            }
        }
    }
    /* about 6% of the groups have a lane below the normal range */
    if (failures || refused < GROUPS / 50 || refused > GROUPS / 10) {
        printf("odd_rounding_check: %ld failures, %ld of %d groups refused\n", failures, refused, GROUPS);
        return 1;
    }
    printf("odd_rounding_check: ok\n");
    return 0;
}
