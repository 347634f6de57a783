/*
 * ln_dispatch.c -- which SIMD levels this build has, which this CPU runs, and which is in
 * use.  The best level the CPU runs is chosen on first use; ln_simd_set changes it for
 * the whole process (results are the same bits at every level).
 */
#include <stdatomic.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "ln_internal.h"

/* Each level's name and kernels; both NULL for a level this build lacks. */
static const struct {
    const char *name;
    const ln_kernel_table *kernels;
} ln_levels[LN_SIMD_LEVELS] = {
    [LN_SIMD_SCALAR] = {"scalar", &ln_kernels_scalar},
#if defined(__x86_64__)
    [LN_SIMD_VEC128] = {"sse2", &ln_kernels_vec128},
    [LN_SIMD_AVX2] = {"avx2", &ln_kernels_avx2},
    [LN_SIMD_AVX512] = {"avx512", &ln_kernels_avx512},
    [LN_SIMD_AVX512_BF16] = {"avx512bf16", &ln_kernels_avx512_bf16},
#elif defined(__aarch64__)
    [LN_SIMD_VEC128] = {"neon", &ln_kernels_vec128},
#endif
};

static _Atomic int ln_simd_current = -1;

#if defined(__x86_64__)
/* F16C, from CPUID leaf 1 (Clang's __builtin_cpu_supports does not know it); the avx2 test
   beside it checks that the OS saves the AVX registers. */
static int ln_cpu_has_f16c(void)
{
    unsigned int eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

/* AVX512DQ (CPUID leaf 7, subleaf 0, EBX bit 17) and AVX512-BF16 (subleaf 1, EAX bit 5; the
   CPU has subleaf 1 when subleaf 0's EAX is 1 or more), read from CPUID directly, as F16C is. */
static int ln_cpu_has_avx512_bf16_dq(void)
{
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || (ebx & (1u << 17)) == 0 || eax < 1) {
        return 0;
    }
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5)) != 0;
}
#endif

ln_simd_level ln_simd_best(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && ln_cpu_has_f16c();
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        return ln_cpu_has_avx512_bf16_dq() ? LN_SIMD_AVX512_BF16 : LN_SIMD_AVX512;
    }
    if (avx2) {
        return LN_SIMD_AVX2;
    }
    return LN_SIMD_VEC128;  /* SSE2 is part of x86-64 */
#elif defined(__aarch64__)
    return LN_SIMD_VEC128;  /* NEON is part of ARMv8-A */
#else
    return LN_SIMD_SCALAR;
#endif
}

ln_simd_level ln_simd_get(void)
{
    int level = atomic_load(&ln_simd_current);
    if (level < 0) {
        level = ln_simd_best();
        atomic_store(&ln_simd_current, level);
    }
    return (ln_simd_level)level;
}

int ln_simd_set(ln_simd_level level)
{
    if (level < LN_SIMD_SCALAR || level > ln_simd_best() || !ln_levels[level].kernels) {
        return -1;
    }
    atomic_store(&ln_simd_current, (int)level);
    return 0;
}

const char *ln_simd_name(ln_simd_level level)
{
    return level >= LN_SIMD_SCALAR && level < LN_SIMD_LEVELS ? ln_levels[level].name : NULL;
}

const ln_dtype_kernels *ln_dtype_kernels_in_use(ln_dtype dtype)
{
    for (int level = (int)ln_simd_get(); level >= LN_SIMD_SCALAR; level--) {
        const ln_kernel_table *kernels = ln_levels[level].kernels;
        if (kernels && kernels->by_dtype[dtype].add_row) {  /* a table's absent types are all NULL */
            return &kernels->by_dtype[dtype];
        }
    }
    assert(0 && "the scalar level has every type's kernels");
    return &ln_kernels_scalar.by_dtype[dtype];
}

void ln_widen_to_f32(ln_dtype dtype, const void *from, float *to, ptrdiff_t n)
{
    const ln_dtype_kernels *kernels = ln_dtype_kernels_in_use(dtype);
    assert(kernels->widen_to_f32 && n >= 0);
    kernels->widen_to_f32(from, to, n);
}
