/*
 * kernel_driver.c -- runs the C kernel layer (src/ln_kernels.h) over a fixed list of cases at
 * every SIMD level this CPU runs and at 1 and 2 threads, and prints one line per run:
 *
 *     <case> <level> t<threads> <FNV-1a 64 of the outputs' bytes, hex>
 *
 * The kernels promise bit-identical results at every level, thread count and architecture;
 * tests/c/check_levels.py compares these lines across levels, threads and machines.  No
 * Python and no NumPy: the inputs come from a fixed pseudo-random generator, so the same
 * program cross-compiled for another architecture sees the same bytes.
 *
 * Inputs are made with exact double arithmetic only (no libm calls, whose last bits may
 * differ between architectures) and rounded once to the element type.
 *
 *     bash tests/c/build-driver.sh gcc build/kernel-driver/x86_64-gcc
 *     build/kernel-driver/x86_64-gcc > x86_64-gcc.txt
 *
 * .ci/cross-aarch64.sh and .ci/clang.sh do this for aarch64 (under qemu) and for clang.
 */
#include "ln_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* The cases                                                                 */
/* ------------------------------------------------------------------------ */

/* What one call does; every variant runs on every shape and dtype. */
typedef struct {
    const char *name;
    int backward;      /* 0: ln_forward, 1: ln_backward */
    int weight;        /* pass a weight (else NULL: ones) */
    int bias;          /* forward: pass a bias (else NULL: zeros) */
    int stats;         /* forward: write mean and rstd */
    int grad_input;    /* backward: write dx */
    int grad_params;   /* backward: write dweight and dbias */
    int row_pad;       /* elements between input rows beyond row_len */
    int reversed;      /* input rows stored last to first (a negative row step) */
    int special_rows;  /* NaN, +-Inf and constant rows among the ordinary ones */
} variant;

static const variant variants[] = {
    {.name = "fwd", .weight = 1, .bias = 1, .stats = 1},
    {.name = "fwd-plain"},
    {.name = "fwd-weight-strided", .weight = 1, .row_pad = 5},
    {.name = "fwd-reversed", .weight = 1, .bias = 1, .stats = 1, .row_pad = 3, .reversed = 1},
    {.name = "fwd-special", .weight = 1, .bias = 1, .stats = 1, .special_rows = 1},
    {.name = "bwd", .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1},
    {.name = "bwd-dx-reversed", .backward = 1, .grad_input = 1, .row_pad = 5, .reversed = 1},
    {.name = "bwd-params", .backward = 1, .weight = 1, .grad_params = 1},
    {.name = "bwd-special", .backward = 1, .weight = 1, .grad_input = 1, .special_rows = 1},
};

/* Row lengths that take every route through the kernels (LN_CHUNK is 2048), with enough
   rows that most inputs have the 65536 elements a call needs before it uses threads.  Every
   variant runs on every shape in every dtype. */
static const struct {
    ptrdiff_t rows, row_len;
} shapes[] = {
    {5, 0},                   /* empty rows: mean 0, rstd NaN */
    {70000, 1},               /* short rows (< 16 elements), one row at a time */
    {10000, 7},
    {20000, 8},
    {5000, 15},
    {5000, 16},               /* 16 to LN_CHUNK: the pipelined loop */
    {3000, 31},
    {3000, 32},
    {1000, 100},
    {100, 768},
    {40, 2047},
    {40, 2048},
    {40, 2049},               /* longer than one chunk: statistics merged chunk by chunk */
    {20, 5000},
    {5, 8 * 2048 + 5},        /* few huge rows: forward splits each row across threads,
                                 backward goes by column spans */
    {16, 8 * 2048 + 6},       /* huge rows, but enough of them to share out whole */
    {2, 64 * 2048 + 3},       /* float64 rows of 1 MiB: forward's non-temporal stores */
};

/* Outputs large enough for the other non-temporal stores, only in the variant and dtype that
   take them: the whole cross product at this size would be slow under qemu. */
static const struct {
    const char *variant;
    ln_dtype dtype;
    ptrdiff_t rows, row_len;
} large_cases[] = {
    {"fwd", LN_F32, 1, 128 * 2048 + 3},  /* float32 rows of 1 MiB */
    {"bwd", LN_F32, 1030, 1024},         /* dx of 4 MiB and more */
    {"bwd", LN_F64, 520, 1024},
};

static const ln_dtype dtypes[] = {LN_F16, LN_F32, LN_F64};
static const char *const dtype_names[] = {"f16", "f32", "f64"};

static const int thread_counts[] = {1, 2};

#define EPS 1e-5

/* ------------------------------------------------------------------------ */
/* Deterministic inputs                                                      */
/* ------------------------------------------------------------------------ */

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), a multiple of 2^-52, so exact in double. */
static double uniform(uint64_t *state)
{
    return (double)(splitmix64(state) >> 11) * 0x1p-52 - 1.0;
}

/* Each ordinary row is offset + scale * noise, with both drawn from these. */
static const double row_offsets[] = {0.0, -7.5, 1e3, 1e4};
static const double row_scales[] = {1e-3, 0.25, 1.0, 3.0, 1e3};

static size_t element_size(ln_dtype dtype)
{
    return dtype == LN_F16 ? 2 : dtype == LN_F32 ? 4 : 8;
}

/* weight, bias, mean and rstd: float32 for float16/float32 data, float64 for float64 */
static size_t param_size(ln_dtype dtype)
{
    return dtype == LN_F64 ? 8 : 4;
}

/* IEEE binary16 bits of value, rounded to nearest even.  By hand, because not every compiler
   has _Float16 on x86-64 (clang before 15 has not). */
static uint16_t half_bits(double value)
{
    uint64_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint16_t sign = (uint16_t)(bits >> 48) & 0x8000u;
    const uint64_t magnitude = bits & ~(UINT64_C(1) << 63);
    const int exponent = (int)(magnitude >> 52) - 1023;
    if (isnan(value)) {
        return sign | 0x7e00u;
    }
    if (exponent < -25) {
        return sign;  /* below half the smallest subnormal: rounds to zero */
    }
    /* Keep 11 significant bits (fewer for subnormals), rounding the rest to nearest even;
       a carry out of them moves into the exponent field, as it should. */
    const uint64_t significand = (magnitude & ((UINT64_C(1) << 52) - 1)) | UINT64_C(1) << 52;
    const int shift = exponent >= -14 ? 42 : 28 - exponent;
    uint64_t kept = significand >> shift;
    const uint64_t rest = significand & ((UINT64_C(1) << shift) - 1), halfway = UINT64_C(1) << (shift - 1);
    kept += rest > halfway || (rest == halfway && (kept & 1));
    const uint64_t half = exponent >= -14 ? ((uint64_t)(exponent + 14) << 10) + kept : kept;
    return sign | (uint16_t)(half < 0x7c00u ? half : 0x7c00u);  /* too large: infinity */
}

static void store_element(ln_dtype dtype, void *base, ptrdiff_t i, double value)
{
    if (dtype == LN_F16) {
        ((uint16_t *)base)[i] = half_bits(value);
    }
    else if (dtype == LN_F32) {
        ((float *)base)[i] = (float)value;
    }
    else {
        ((double *)base)[i] = value;
    }
}

static void store_param(ln_dtype dtype, void *base, ptrdiff_t i, double value)
{
    if (dtype == LN_F64) {
        ((double *)base)[i] = value;
    }
    else {
        ((float *)base)[i] = (float)value;
    }
}

/* Writes rows x row_len elements, row r from element r * row_step of first_row on.  With
   special rows, rows cycle through: ordinary, one NaN, one +Inf, a -Inf and a +Inf, constant. */
static void fill_rows(uint64_t *state, ln_dtype dtype, void *first_row, ptrdiff_t row_step,
                      ptrdiff_t rows, ptrdiff_t row_len, int special_rows)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        const double offset = row_offsets[splitmix64(state) % 4];
        const double scale = row_scales[splitmix64(state) % 5];
        const int kind = special_rows ? (int)(r % 5) : 0;
        const ptrdiff_t spot = row_len > 0 ? (r * 7) % row_len : 0;
        const double constant = offset + scale * uniform(state);
        for (ptrdiff_t j = 0; j < row_len; j++) {
            double value = kind == 4 ? constant : offset + scale * uniform(state);
            if (j == spot && kind == 1) {
                value = NAN;
            }
            else if (j == spot && (kind == 2 || kind == 3)) {
                value = INFINITY;
            }
            else if (j == (spot + 1) % row_len && kind == 3) {
                value = -INFINITY;
            }
            store_element(dtype, first_row, r * row_step + j, value);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Hashing                                                                   */
/* ------------------------------------------------------------------------ */

/* Replaces every NaN by the one quiet NaN of its width.  NaN sign and payload are not part
   of the kernels' contract (forward's NaN rows differ in them between levels today), so the
   hashes compare every other bit exactly. */
static void canonicalize_nans(void *data, size_t count, size_t size)
{
    for (size_t i = 0; i < count; i++) {
        if (size == 2) {
            uint16_t *bits = (uint16_t *)data + i;
            if ((*bits & 0x7c00u) == 0x7c00u && (*bits & 0x03ffu) != 0) {
                *bits = 0x7e00u;
            }
        }
        else if (size == 4) {
            uint32_t *bits = (uint32_t *)data + i;
            if ((*bits & 0x7f800000u) == 0x7f800000u && (*bits & 0x007fffffu) != 0) {
                *bits = 0x7fc00000u;
            }
        }
        else {
            uint64_t *bits = (uint64_t *)data + i;
            if ((*bits & UINT64_C(0x7ff0000000000000)) == UINT64_C(0x7ff0000000000000) &&
                (*bits & UINT64_C(0x000fffffffffffff)) != 0) {
                *bits = UINT64_C(0x7ff8000000000000);
            }
        }
    }
}

/* FNV-1a 64 over bytes, continuing from hash. */
static uint64_t fnv1a(uint64_t hash, const void *data, size_t bytes)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < bytes; i++) {
        hash = (hash ^ p[i]) * UINT64_C(0x100000001b3);
    }
    return hash;
}

#define FNV1A_START UINT64_C(0xcbf29ce484222325)

/* ------------------------------------------------------------------------ */
/* Running a case                                                            */
/* ------------------------------------------------------------------------ */

typedef struct {
    void *data;
    size_t count;  /* elements */
    size_t size;   /* bytes per element */
} buffer;

/* One variant on one shape and dtype, with its inputs made and its outputs allocated. */
typedef struct {
    char name[64];
    const variant *variant;
    ln_dtype dtype;
    ptrdiff_t rows, row_len;
    ptrdiff_t row_step;     /* elements from one input row start to the next (any sign) */
    buffer x, dy;           /* the inputs' storage, padding included */
    const void *x_first;    /* first row of x within x.data */
    const void *dy_first;   /* ... and of dy */
    buffer weight, bias;    /* row_len params, or data NULL */
    buffer mean, rstd;      /* backward: rows params from forward at the scalar level */
    buffer outputs[3];      /* what a run writes and the hash covers, in this order */
    int output_count;
} test_case;

/* Reports what went wrong in which case and exits with status 1. */
static void fail(const char *case_name, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fprintf(stderr, "kernel_driver: case %s: ", case_name);
    vfprintf(stderr, format, args);
    fputc('\n', stderr);
    va_end(args);
    exit(1);
}

static buffer new_buffer(const test_case *c, size_t count, size_t size)
{
    buffer b = {.data = malloc(count * size > 0 ? count * size : 1), .count = count, .size = size};
    if (!b.data) {
        fail(c->name, "out of memory");
    }
    return b;
}

static void add_output(test_case *c, size_t count, size_t size)
{
    c->outputs[c->output_count++] = new_buffer(c, count, size);
}

/* Allocates c->rows input rows c->row_step elements apart into storage, the padding between
   them NaN (which a kernel reading it would spread), and returns the first row. */
static const void *new_input(const test_case *c, buffer *storage, uint64_t *state, int special_rows)
{
    const ptrdiff_t step = c->row_step < 0 ? -c->row_step : c->row_step;
    const size_t size = element_size(c->dtype);
    *storage = new_buffer(c, (size_t)(c->rows * step), size);
    for (size_t i = 0; i < storage->count; i++) {
        store_element(c->dtype, storage->data, (ptrdiff_t)i, NAN);
    }
    char *first = (char *)storage->data + (c->row_step < 0 ? (size_t)((c->rows - 1) * step) * size : 0);
    fill_rows(state, c->dtype, first, c->row_step, c->rows, c->row_len, special_rows);
    return first;
}

static buffer new_params(const test_case *c, uint64_t *state, double center, double spread)
{
    buffer b = new_buffer(c, (size_t)c->row_len, param_size(c->dtype));
    for (ptrdiff_t j = 0; j < c->row_len; j++) {
        store_param(c->dtype, b.data, j, center + spread * uniform(state));
    }
    return b;
}

static void case_setup(test_case *c, const variant *v, ln_dtype dtype, ptrdiff_t rows, ptrdiff_t row_len)
{
    *c = (test_case){.variant = v, .dtype = dtype, .rows = rows, .row_len = row_len};
    snprintf(c->name, sizeof c->name, "%s-%s-%tdx%td", v->name, dtype_names[dtype], rows, row_len);
    c->row_step = (row_len + v->row_pad) * (v->reversed ? -1 : 1);
    uint64_t state = fnv1a(FNV1A_START, c->name, strlen(c->name));  /* each case its own inputs */

    c->x_first = new_input(c, &c->x, &state, v->special_rows);
    if (v->weight) {
        c->weight = new_params(c, &state, 1.0, 0.5);
    }
    if (v->bias) {
        c->bias = new_params(c, &state, 0.0, 0.25);
    }
    const size_t size = element_size(dtype), rows_out = (size_t)(rows * row_len);
    if (!v->backward) {
        add_output(c, rows_out, size);
        if (v->stats) {
            add_output(c, (size_t)rows, param_size(dtype));
            add_output(c, (size_t)rows, param_size(dtype));
        }
        return;
    }
    c->dy_first = new_input(c, &c->dy, &state, 0);
    c->mean = new_buffer(c, (size_t)rows, param_size(dtype));
    c->rstd = new_buffer(c, (size_t)rows, param_size(dtype));
    buffer y = new_buffer(c, rows_out, size);
    ln_simd_set(LN_SIMD_SCALAR);
    ln_threads_set(1);
    if (ln_forward(&(ln_forward_args){.dtype = dtype, .rows = rows, .row_len = row_len,
                                      .input = c->x_first, .input_row_step = c->row_step,
                                      .output = y.data, .weight = c->weight.data, .eps = EPS,
                                      .mean = c->mean.data, .rstd = c->rstd.data}) != 0) {
        fail(c->name, "ln_forward returned an error making the mean and rstd for backward");
    }
    free(y.data);
    if (v->grad_input) {
        add_output(c, rows_out, size);
    }
    if (v->grad_params) {
        add_output(c, (size_t)row_len, param_size(dtype));
        add_output(c, (size_t)row_len, param_size(dtype));
    }
}

static void case_free(test_case *c)
{
    buffer *const owned[] = {&c->x, &c->dy, &c->weight, &c->bias, &c->mean, &c->rstd,
                             &c->outputs[0], &c->outputs[1], &c->outputs[2]};
    for (size_t k = 0; k < sizeof owned / sizeof owned[0]; k++) {
        free(owned[k]->data);
    }
}

/* Runs the case once at the level and thread count in use; returns the kernel's status
   and sets *hash to the hash of the outputs, NaNs canonicalized. */
static int run_case(const test_case *c, uint64_t *hash)
{
    const variant *v = c->variant;
    for (int k = 0; k < c->output_count; k++) {
        memset(c->outputs[k].data, 0x55, c->outputs[k].count * c->outputs[k].size);  /* not NaN */
    }
    int status;
    if (v->backward) {
        void *const dx = v->grad_input ? c->outputs[0].data : NULL;
        const int params = v->grad_input ? 1 : 0;  /* where dweight and dbias sit in outputs */
        status = ln_backward(&(ln_backward_args){
            .dtype = c->dtype, .rows = c->rows, .row_len = c->row_len,
            .grad_output = c->dy_first, .grad_output_row_step = c->row_step,
            .input = c->x_first, .input_row_step = c->row_step,
            .mean = c->mean.data, .rstd = c->rstd.data, .weight = c->weight.data,
            .grad_input = dx,
            .grad_weight = v->grad_params ? c->outputs[params].data : NULL,
            .grad_bias = v->grad_params ? c->outputs[params + 1].data : NULL});
    }
    else {
        status = ln_forward(&(ln_forward_args){
            .dtype = c->dtype, .rows = c->rows, .row_len = c->row_len,
            .input = c->x_first, .input_row_step = c->row_step, .output = c->outputs[0].data,
            .weight = c->weight.data, .bias = c->bias.data, .eps = EPS,
            .mean = v->stats ? c->outputs[1].data : NULL, .rstd = v->stats ? c->outputs[2].data : NULL});
    }
    *hash = FNV1A_START;
    for (int k = 0; k < c->output_count; k++) {
        canonicalize_nans(c->outputs[k].data, c->outputs[k].count, c->outputs[k].size);
        *hash = fnv1a(*hash, c->outputs[k].data, c->outputs[k].count * c->outputs[k].size);
    }
    return status;
}

/* Runs the case at every level the build has and the CPU runs, at every thread count,
   printing a line for each. */
static void run_everywhere(const test_case *c)
{
    for (int level = 0; level <= (int)ln_simd_best(); level++) {
        const char *level_name = ln_simd_name((ln_simd_level)level);
        if (ln_simd_set((ln_simd_level)level) != 0 || !level_name) {
            continue;
        }
        for (size_t t = 0; t < sizeof thread_counts / sizeof thread_counts[0]; t++) {
            uint64_t hash;
            ln_threads_set(thread_counts[t]);
            if (run_case(c, &hash) != 0) {
                fail(c->name, "%s returned an error at level %s, %d threads",
                     c->variant->backward ? "ln_backward" : "ln_forward", level_name, thread_counts[t]);
            }
            printf("%s %s t%d %016llx\n", c->name, level_name, thread_counts[t], (unsigned long long)hash);
        }
    }
}

static const variant *variant_named(const char *name)
{
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
        if (strcmp(variants[v].name, name) == 0) {
            return &variants[v];
        }
    }
    fail(name, "no such variant");
    return NULL;
}

int main(void)
{
    test_case c;
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
                case_setup(&c, &variants[v], dtypes[d], shapes[s].rows, shapes[s].row_len);
                run_everywhere(&c);
                case_free(&c);
            }
        }
    }
    for (size_t k = 0; k < sizeof large_cases / sizeof large_cases[0]; k++) {
        case_setup(&c, variant_named(large_cases[k].variant), large_cases[k].dtype, large_cases[k].rows,
                   large_cases[k].row_len);
        run_everywhere(&c);
        case_free(&c);
    }
    return 0;
}
