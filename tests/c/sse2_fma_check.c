/*
 * sse2_fma_check.c -- checks the fused multiply-adds of the SSE2 level (src/ln_simd_vec128.h on
 * x86-64), which are computed from float64 operations rounded to odd, bit for bit against the
 * C library's fma() and fmaf(), without Python: built and run by tests/test_c_checks.py.
 *
 *     cc -std=c11 -O2 -ffp-contract=off -Isrc tests/c/sse2_fma_check.c -lm -o check
 *     ./check           prints "sse2_fma_check: ok", or the first differences and exits 1
 *
 * The triples: random significands with exponents near 0; c = -(a * b) and c a few units away
 * from it, where the sum cancels; zeros of both signs; random bit patterns (subnormals, huge
 * values, infinities, NaNs: any NaN matches any NaN); and sums a hair's breadth from halfway
 * between two results, (1 + u)(1 - u) = 1 - u^2 added to an odd c whose half unit is 1, which
 * come out wrong if any step rounds to nearest where it should round to odd.
 */
#include "ln_simd_vec128.h"

#include <stdio.h>
#include <string.h>

#define TRIPLES 2000000

static uint64_t random_state = 0x9e3779b97f4a7c15u;

static uint64_t random_bits(void)
{
    random_state ^= random_state << 13;
    random_state ^= random_state >> 7;
    random_state ^= random_state << 17;
    return random_state;
}

/* A random double: any bit pattern when `any`, else an exponent in [-60, 60]. */
static double random_double(int any)
{
    uint64_t bits = random_bits();
    if (!any) {
        bits = (bits & 0x800fffffffffffffu) | ((uint64_t)(random_bits() % 121 + 1023 - 60) << 52);
    }
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static float random_float(int any)
{
    uint32_t bits = (uint32_t)random_bits();
    if (!any) {
        bits = (bits & 0x807fffffu) | ((uint32_t)(random_bits() % 61 + 127 - 30) << 23);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The addend of a triple: random, the product's negation, or that a few units off. */
static double addend_for(double product, int kind, int any)
{
    if (kind == 1) {
        return -product;
    }
    if (kind == 2) {
        return -product * (1.0 + ldexp((double)(int)(random_bits() % 64) - 32, -55));
    }
    if (kind == 3) {
        return random_bits() % 2 ? 0.0 : -0.0;
    }
    return random_double(any);
}

static int same_double(double x, double y)
{
    return (x != x && y != y) || memcmp(&x, &y, sizeof x) == 0;
}

static int same_float(float x, float y)
{
    return (x != x && y != y) || memcmp(&x, &y, sizeof x) == 0;
}

/* A power of two in [2^-40, 2^40] with a random sign. */
static double random_scale(void)
{
    return ldexp(random_bits() % 2 ? 1.0 : -1.0, (int)(random_bits() % 81) - 40);
}

/* a * b + c just off halfway between two neighbours of c, for a format of `bits` significand
   bits: a = (1 + u) s1, b = (1 - u) s2, u = 2^(1 - bits), and c an odd multiple of the unit
   2 s1 s2 with the product's sign. */
static void near_tie(int bits, double *a, double *b, double *c)
{
    const double u = ldexp(1.0, 1 - bits), s1 = random_scale(), s2 = random_scale();
    const double odd = (double)(2 * (random_bits() % ((uint64_t)1 << (bits - 2))) + 1);
    *a = (1 + u) * s1;
    *b = (1 - u) * s2;
    *c = (ldexp(1.0, bits) + odd * 2) * s1 * s2 * (random_bits() % 2 ? 1 : -1);
}

int main(void)
{
    long differences = 0;
    for (long t = 0; t < TRIPLES; t++) {
        const int any = random_bits() % 4 == 0, kind = (int)(random_bits() % 5);

        double a = random_double(any), b = random_double(any), c;
        if (random_bits() % 32 == 0) {
            a = random_bits() % 2 ? 0.0 : -0.0;
        }
        c = addend_for(a * b, kind, any);
        if (kind == 4) {
            near_tie(53, &a, &b, &c);
        }
        double emulated[2];
        _mm_storeu_pd(emulated, sse2_fma(_mm_set1_pd(a), _mm_set1_pd(b), _mm_set1_pd(c)));
        const double expected = fma(a, b, c);
        if (!same_double(emulated[0], expected) && differences++ < 10) {
            printf("fma(%a, %a, %a): %a, emulated %a\n", a, b, c, expected, emulated[0]);
        }

        float fa = random_float(any), fb = random_float(any);
        float fc = (float)addend_for((double)(fa * fb), kind, any);
        if (kind == 4) {
            double tie_a, tie_b, tie_c;
            near_tie(24, &tie_a, &tie_b, &tie_c);
            fa = (float)tie_a;
            fb = (float)tie_b;
            fc = (float)tie_c;
        }
        gf ga, gb, gc;
        FOR_VF(k) {
            ga.v[k] = (ln_vf){fa, fa, fa, fa};
            gb.v[k] = (ln_vf){fb, fb, fb, fb};
            gc.v[k] = (ln_vf){fc, fc, fc, fc};
        }
        const gf fused = gf_fma(ga, gb, gc);
        const float expected_float = fmaf(fa, fb, fc);
        int lanes_differ = 0;
        FOR_VF(k) {
            for (int lane = 0; lane < 4; lane++) {
                lanes_differ |= !same_float(fused.v[k][lane], expected_float);
            }
        }
        if (lanes_differ && differences++ < 10) {
            printf("fmaf(%a, %a, %a): %a, emulated %a\n", fa, fb, fc, expected_float, fused.v[0][0]);
        }
    }
    if (differences) {
        printf("sse2_fma_check: %ld of %d triples differ\n", differences, 2 * TRIPLES);
        return 1;
    }
    printf("sse2_fma_check: ok\n");
    return 0;
}
