/*
 * sse2_fma_check.c -- checks the fused multiply-adds of the SSE2 level (src/ln_simd_vec128.h on
 * x86-64), which are computed from float64 operations rounded to odd, bit for bit against the
 * C library's fma() and fmaf(), without Python: built and run by tests/test_c_checks.py.
 *
 *     cc -std=c11 -O3 -ffp-contract=off -Isrc tests/c/sse2_fma_check.c -lm -o check
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

#include "check_random.h"

#define TRIPLES 2000000

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
   2 s1 s2, of either sign. */
static void near_tie(int bits, double *a, double *b, double *c)
{
    const double u = ldexp(1.0, 1 - bits), s1 = random_scale(), s2 = random_scale();
    const double odd = (double)(2 * (random_bits() % ((uint64_t)1 << (bits - 2))) + 1);
    *a = (1 + u) * s1;
    *b = (1 - u) * s2;
    *c = (ldexp(1.0, bits) + odd * 2) * s1 * s2 * (random_bits() % 2 ? 1 : -1);
}

/* One random triple of one of the kinds above (`bits`: 53 for float64, 24 for float32). */
static void random_triple(int bits, double *a, double *b, double *c)
{
    const int any = random_bits() % 4 == 0, kind = (int)(random_bits() % 5);
    if (kind == 4) {
        near_tie(bits, a, b, c);
        return;
    }
    *a = bits == 53 ? random_double(any) : (double)random_float(any);
    *b = bits == 53 ? random_double(any) : (double)random_float(any);
    if (random_bits() % 32 == 0) {
        *a = random_bits() % 2 ? 0.0 : -0.0;
    }
    const double product = bits == 53 ? *a * *b : (double)((float)*a * (float)*b);
    *c = addend_for(product, kind, any);
}

static long differences;

static void report(const char *name, double a, double b, double c, double expected, double emulated)
{
    if (differences++ < 10) {
        printf("%s(%a, %a, %a): %a, emulated %a\n", name, a, b, c, expected, emulated);
    }
}

int main(void)
{
    /* each lane its own triple, so that one lane's answer turning up in another is seen, and
       the ranges sse2_fma sends to fma() mixed with the others in one vector */
    for (long t = 0; t < TRIPLES / 2; t++) {
        double a[2], b[2], c[2], emulated[2];
        for (int lane = 0; lane < 2; lane++) {
            random_triple(53, &a[lane], &b[lane], &c[lane]);
        }
        _mm_storeu_pd(emulated, sse2_fma(_mm_loadu_pd(a), _mm_loadu_pd(b), _mm_loadu_pd(c)));
        for (int lane = 0; lane < 2; lane++) {
            const double expected = fma(a[lane], b[lane], c[lane]);
            if (!same_double(emulated[lane], expected)) {
                report("fma", a[lane], b[lane], c[lane], expected, emulated[lane]);
            }
        }
    }
    for (long t = 0; t < TRIPLES / 16; t++) {
        gf a, b, c;
        FOR_VF(k) {
            for (int lane = 0; lane < 4; lane++) {
                double triple[3];
                random_triple(24, &triple[0], &triple[1], &triple[2]);
                a.v[k][lane] = (float)triple[0];
                b.v[k][lane] = (float)triple[1];
                c.v[k][lane] = (float)triple[2];
            }
        }
        const gf fused = gf_fma(a, b, c);
        FOR_VF(k) {
            for (int lane = 0; lane < 4; lane++) {
                const float expected = fmaf(a.v[k][lane], b.v[k][lane], c.v[k][lane]);
                if (!same_float(fused.v[k][lane], expected)) {
                    report("fmaf", a.v[k][lane], b.v[k][lane], c.v[k][lane], expected, fused.v[k][lane]);
                }
            }
        }
    }
    if (differences) {
        printf("sse2_fma_check: %ld of %d triples differ\n", differences, 2 * TRIPLES);
        return 1;
    }
    printf("sse2_fma_check: ok\n");
    return 0;
}
