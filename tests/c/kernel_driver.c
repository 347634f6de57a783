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
 * The cases cover both norm kinds, both routes through the kernels (rows of adjacent
 * elements; channels-first, transposed and gathered rows, one lane a row), outputs laid out
 * unlike their inputs, statistics broadcast in backward, the fused residual add, in place
 * too, and the entry points for rows split across arrays.  An output's whole buffer is
 * hashed, gaps between its elements included, so a stray write shows.
 *
 * Inputs are made with exact double arithmetic only (no libm calls, whose last bits may
 * differ between architectures) and rounded once to the element type.
 *
 *     bash tests/c/build-driver.sh gcc build/kernel-driver/x86_64-gcc
 *     build/kernel-driver/x86_64-gcc > x86_64-gcc.txt
 *
 * .ci/kernel-bits.sh does this for clang and for aarch64 (under qemu).
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

/* Where an array's elements lie in its buffer, for a call's blocks x rows x row_len. */
typedef enum {
    ROWS,            /* row after row, row_len + row_pad elements apart (last to first if
                        reversed); C-contiguous without padding */
    CHANNELS_FIRST,  /* blocks x row_len x rows, C-contiguous: NCHW over C, rows = H*W */
    TRANSPOSED,      /* row_len x (blocks x rows), C-contiguous: a 2-D array over axis 0 */
    SPREAD,          /* CHANNELS_FIRST with rows 2 elements apart and elements 2 rows + 1
                        apart: neither adjacent, so the kernels gather and scatter */
} layout;

/* Which statistics backward reads for a row. */
typedef enum {
    OWN_STATS,       /* its own */
    BLOCK_0_STATS,   /* block 0's row of the same index (zero block step) */
    ROW_0_STATS,     /* row 0's (zero steps) */
} stats_walk;

/* What one call does; every variant runs on every shape of its set and every dtype. */
typedef struct {
    const char *name;
    ln_norm_kind kind;
    int backward;           /* 0: ln_forward, 1: ln_backward */
    int weight;             /* pass a weight (else NULL: ones) */
    int bias;               /* forward, LayerNorm: pass a bias (else NULL: zeros) */
    int stats;              /* forward: write the statistics (mean for LayerNorm, and rstd) */
    int grad_input;         /* backward: write dx */
    int grad_params;        /* backward: write dweight (and dbias for LayerNorm) */
    layout in;              /* input, grad_output and residual */
    layout out;             /* output, sum and grad_input (ROWS: without padding) */
    int row_pad;            /* ROWS input: elements between rows beyond row_len */
    int reversed;           /* ROWS input: rows stored last to first (a negative row step) */
    int special_rows;       /* NaN, +-Inf and constant rows among the ordinary ones */
    int tiny_params;        /* weight and bias near 2^-124 and 2^-127: outputs (and dx) about
                               the smallest normal float32, many of them float32-subnormal */
    int residual;           /* forward: normalize input + residual, the sum in its own buffer */
    int sum_over_input;     /* forward with a residual: the sum written over the input */
    int output_over_input;  /* forward: the output written over the input (or over the sum
                               when that is written over the input) */
    stats_walk stats_in;    /* backward: the statistics each row reads */
    int parts;              /* by the part entry points.  Forward: ln_part_moments (its float64
                               mean and m2 are outputs), then ln_part_normalize with the rstd
                               of those moments.  Backward: ln_part_grad_sums (outputs), then
                               ln_part_grad_input with the means of those sums */
} variant;

#define LN LN_NORM_LAYER
#define RMS LN_NORM_RMS

static const variant variants[] = {
    /* rows of adjacent elements (the shapes in `shapes`) */
    {.name = "fwd", .weight = 1, .bias = 1, .stats = 1},
    {.name = "fwd-plain"},
    {.name = "fwd-weight-strided", .weight = 1, .row_pad = 5},
    {.name = "fwd-reversed", .weight = 1, .bias = 1, .stats = 1, .row_pad = 3, .reversed = 1},
    {.name = "fwd-special", .weight = 1, .bias = 1, .stats = 1, .special_rows = 1},
    {.name = "fwd-tiny", .weight = 1, .bias = 1, .tiny_params = 1},
    {.name = "bwd", .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1},
    {.name = "bwd-dx-reversed", .backward = 1, .grad_input = 1, .row_pad = 5, .reversed = 1},
    {.name = "bwd-params", .backward = 1, .weight = 1, .grad_params = 1},
    {.name = "bwd-special", .backward = 1, .weight = 1, .grad_input = 1, .special_rows = 1},
    {.name = "bwd-tiny", .backward = 1, .weight = 1, .grad_input = 1, .tiny_params = 1},
    {.name = "bwd-one-stat", .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1, .stats_in = ROW_0_STATS},
    {.name = "rms-fwd", .kind = RMS, .weight = 1, .stats = 1},
    {.name = "rms-fwd-plain", .kind = RMS},
    {.name = "rms-fwd-special", .kind = RMS, .weight = 1, .stats = 1, .special_rows = 1},
    {.name = "rms-bwd", .kind = RMS, .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1},
    {.name = "rms-bwd-dx-reversed", .kind = RMS, .backward = 1, .grad_input = 1, .row_pad = 5, .reversed = 1},
    {.name = "rms-bwd-special", .kind = RMS, .backward = 1, .weight = 1, .grad_input = 1, .special_rows = 1},
    {.name = "add-fwd", .weight = 1, .bias = 1, .stats = 1, .residual = 1},
    {.name = "add-fwd-reversed", .bias = 1, .stats = 1, .row_pad = 3, .reversed = 1, .residual = 1},
    {.name = "add-fwd-in-place", .weight = 1, .residual = 1, .sum_over_input = 1, .output_over_input = 1},
    {.name = "rms-add-fwd", .kind = RMS, .weight = 1, .stats = 1, .residual = 1},
    {.name = "part-fwd", .weight = 1, .bias = 1, .parts = 1},
    {.name = "part-fwd-reversed", .row_pad = 3, .reversed = 1, .parts = 1},
    {.name = "rms-part-fwd", .kind = RMS, .weight = 1, .parts = 1},
    {.name = "part-bwd", .backward = 1, .weight = 1, .grad_input = 1, .parts = 1},
    {.name = "rms-part-bwd-reversed", .kind = RMS, .backward = 1, .grad_input = 1, .row_pad = 5, .reversed = 1,
     .parts = 1},
    /* rows one lane each (the shapes in `tile_shapes`) */
    {.name = "cf-fwd", .weight = 1, .bias = 1, .stats = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST},
    {.name = "cf-fwd-plain", .in = CHANNELS_FIRST, .out = CHANNELS_FIRST},
    {.name = "cf-fwd-special", .weight = 1, .bias = 1, .stats = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST,
     .special_rows = 1},
    {.name = "cf-fwd-tiny", .weight = 1, .bias = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST,
     .tiny_params = 1},
    {.name = "cf-fwd-in-place", .weight = 1, .bias = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST,
     .output_over_input = 1},
    {.name = "cf-fwd-to-rows", .weight = 1, .stats = 1, .in = CHANNELS_FIRST, .out = ROWS},
    {.name = "rows-fwd-to-cf", .bias = 1, .stats = 1, .in = ROWS, .out = CHANNELS_FIRST},
    {.name = "tr-fwd", .weight = 1, .bias = 1, .stats = 1, .in = TRANSPOSED, .out = TRANSPOSED},
    {.name = "spread-fwd", .weight = 1, .bias = 1, .stats = 1, .in = SPREAD, .out = SPREAD},
    {.name = "rms-cf-fwd", .kind = RMS, .weight = 1, .stats = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST},
    {.name = "rms-spread-fwd", .kind = RMS, .stats = 1, .in = SPREAD, .out = SPREAD},
    {.name = "cf-add-fwd", .weight = 1, .bias = 1, .stats = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST,
     .residual = 1},
    {.name = "cf-add-fwd-in-place", .weight = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST, .residual = 1,
     .sum_over_input = 1, .output_over_input = 1},
    {.name = "rms-spread-add-fwd", .kind = RMS, .weight = 1, .stats = 1, .in = SPREAD, .out = SPREAD,
     .residual = 1},
    {.name = "cf-add-fwd-to-rows", .weight = 1, .bias = 1, .in = CHANNELS_FIRST, .out = ROWS, .residual = 1},
    {.name = "rows-add-fwd-to-cf", .weight = 1, .stats = 1, .in = ROWS, .out = CHANNELS_FIRST, .residual = 1},
    {.name = "cf-part-fwd", .weight = 1, .bias = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST, .parts = 1},
    {.name = "rms-spread-part-fwd", .kind = RMS, .weight = 1, .in = SPREAD, .out = SPREAD, .parts = 1},
    {.name = "cf-part-bwd", .backward = 1, .weight = 1, .grad_input = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST,
     .parts = 1},
    {.name = "cf-bwd", .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1, .in = CHANNELS_FIRST,
     .out = CHANNELS_FIRST},
    {.name = "cf-bwd-params", .backward = 1, .grad_params = 1, .in = CHANNELS_FIRST, .out = CHANNELS_FIRST},
    {.name = "cf-bwd-special", .backward = 1, .weight = 1, .grad_input = 1, .in = CHANNELS_FIRST,
     .out = CHANNELS_FIRST, .special_rows = 1},
    {.name = "cf-bwd-tiny", .backward = 1, .weight = 1, .grad_input = 1, .in = CHANNELS_FIRST,
     .out = CHANNELS_FIRST, .tiny_params = 1},
    {.name = "cf-bwd-broadcast", .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1,
     .in = CHANNELS_FIRST, .out = CHANNELS_FIRST, .stats_in = BLOCK_0_STATS},
    {.name = "cf-bwd-to-rows", .backward = 1, .weight = 1, .grad_input = 1, .in = CHANNELS_FIRST, .out = ROWS},
    {.name = "tr-bwd", .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1, .in = TRANSPOSED,
     .out = TRANSPOSED},
    {.name = "spread-bwd", .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1, .in = SPREAD,
     .out = SPREAD},
    {.name = "rms-cf-bwd", .kind = RMS, .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1,
     .in = CHANNELS_FIRST, .out = CHANNELS_FIRST},
    {.name = "rms-spread-bwd", .kind = RMS, .backward = 1, .grad_input = 1, .grad_params = 1, .in = SPREAD,
     .out = SPREAD},
    {.name = "rms-cf-bwd-broadcast", .kind = RMS, .backward = 1, .weight = 1, .grad_input = 1, .grad_params = 1,
     .in = CHANNELS_FIRST, .out = CHANNELS_FIRST, .stats_in = BLOCK_0_STATS},
};

/* Whether a variant lays rows out one a lane (its shapes are tile_shapes). */
static int by_tiles(const variant *v)
{
    return v->in != ROWS || v->out != ROWS;
}

/* Row lengths that take every route through the row kernels (LN_CHUNK is 2048), with enough
   rows that most inputs have the 65536 elements a call needs before it uses threads.  Every
   row variant runs on every shape in every dtype. */
static const struct {
    ptrdiff_t rows, row_len;
} shapes[] = {
    {5, 0},                   /* empty rows: mean 0, rstd NaN */
    {70000, 1},               /* short rows (< 16 elements), one row at a time */
    {10000, 7},
    {20000, 8},
    {5000, 15},
    {5000, 16},               /* 16 and more: the pipelined loop */
    {3000, 31},
    {3000, 32},
    {1000, 100},
    {100, 768},
    {40, 2047},
    {40, 2048},
    {40, 2049},               /* longer than one chunk: statistics merged chunk by chunk
                                 (pipelined: the outputs stay in cache, float64's excepted) */
    {20, 5000},
    {5, 8 * 2048 + 5},        /* few huge rows: forward splits each row across threads,
                                 backward goes by column spans */
    {16, 8 * 2048 + 6},       /* huge rows, but enough of them to share out whole */
    {2, 64 * 2048 + 3},       /* float64 rows of 1 MiB: forward's non-temporal stores */
};

/* Shapes for rows one lane each (tiles of 16 rows of a block): whole and partial tiles,
   short rows, rows of several chunks, and enough elements for threads. */
static const struct {
    ptrdiff_t blocks, rows, row_len;
} tile_shapes[] = {
    {2, 5, 0},                /* empty rows */
    {3, 1, 7},                /* a tile of one row a block */
    {1, 16, 16},              /* one whole tile */
    {4, 37, 64},              /* a partial tile closing each block */
    {2, 300, 3},
    {2, 17, 300},
    {1, 20, 2049},            /* statistics merged chunk by chunk in each lane */
    {8, 196, 64},             /* NCHW (8, 64, 14, 14) over C: threads, and row blocks in backward */
    {1, 3000, 24},
};

/* Outputs large enough for the other non-temporal stores, only in the variant and dtype that
   take them: the whole cross product at this size would be slow under qemu. */
static const struct {
    const char *variant;
    ln_dtype dtype;
    ptrdiff_t rows, row_len;
} large_cases[] = {
    {"fwd", LN_F32, 1, 128 * 2048 + 3},  /* float32 rows of 1 MiB */
    {"fwd", LN_BF16, 1, 256 * 2048 + 3},  /* bfloat16 rows of 1 MiB */
    {"fwd-tiny", LN_BF16, 4, 256 * 2048 + 3},
    {"bwd", LN_F32, 1030, 1024},         /* dx of 4 MiB and more */
    {"bwd", LN_F64, 520, 1024},
};

static const ln_dtype dtypes[] = {LN_F16, LN_F32, LN_F64, LN_BF16};
static const char *const dtype_names[] = {"f16", "f32", "f64", "bf16"};

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
    return dtype == LN_F16 || dtype == LN_BF16 ? 2 : dtype == LN_F32 ? 4 : 8;
}

/* weight, bias, mean and rstd: float32 for float16/bfloat16/float32 data, float64 for float64 */
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

/* bfloat16 bits of value: rounded to float32, then to its top half, to nearest even (the
   double rounding only matters at ties, and these inputs need no exact rounding); NaN stays NaN. */
static uint16_t bfloat16_bits(double value)
{
    const float single = (float)value;
    uint32_t bits;
    memcpy(&bits, &single, sizeof bits);
    if (isnan(single)) {
        return (uint16_t)((bits >> 16) | 0x0040u);
    }
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static void store_element(ln_dtype dtype, void *base, ptrdiff_t i, double value)
{
    if (dtype == LN_F16) {
        ((uint16_t *)base)[i] = half_bits(value);
    }
    else if (dtype == LN_BF16) {
        ((uint16_t *)base)[i] = bfloat16_bits(value);
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

static double load_param(ln_dtype dtype, const void *base, ptrdiff_t i)
{
    return dtype == LN_F64 ? ((const double *)base)[i] : (double)((const float *)base)[i];
}

/* Where a layout puts element j of row `row` of block `block`: offset
   first + block * block_step + row * row_step + j * elem_step, in elements. */
typedef struct {
    ptrdiff_t block_step, row_step, elem_step;
    ptrdiff_t first;  /* offset of block 0's row 0's element 0 */
    size_t count;     /* elements the buffer holds: from the lowest offset to the highest */
} placement;

static placement place(layout where, ln_extent extent, ptrdiff_t row_pad, int reversed)
{
    const ptrdiff_t blocks = extent.blocks, rows = extent.rows, n = extent.row_len;
    placement p = {0};
    switch (where) {
    case ROWS:
        p = (placement){rows * (n + row_pad), (n + row_pad) * (reversed ? -1 : 1), 1};
        break;
    case CHANNELS_FIRST:
        p = (placement){n * rows, 1, rows};
        break;
    case TRANSPOSED:
        p = (placement){rows, 1, blocks * rows};
        break;
    case SPREAD:
        p = (placement){n * (2 * rows + 1), 2, 2 * rows + 1};
        break;
    }
    const ptrdiff_t sizes[3] = {blocks, rows, n}, steps[3] = {p.block_step, p.row_step, p.elem_step};
    ptrdiff_t lowest = 0, highest = 0;
    for (int k = 0; k < 3; k++) {
        const ptrdiff_t reach = (sizes[k] - 1) * steps[k];
        lowest += reach < 0 ? reach : 0;
        highest += reach > 0 ? reach : 0;
    }
    p.first = -lowest;
    p.count = blocks * rows * n > 0 ? (size_t)(highest - lowest + 1) : 0;
    return p;
}

/* Fills the elements of every row of extent placed as p, r = block * rows + row in order.
   With special rows, rows cycle through: ordinary, one NaN, one +Inf, a -Inf and a +Inf,
   constant, huge (near the type's largest value: float64 squares overflow, float32 and
   bfloat16 rstd is subnormal, so the kernels' exact path takes them). */
static void fill_rows(uint64_t *state, ln_dtype dtype, void *base, const placement *p, ln_extent extent,
                      int special_rows)
{
    const ptrdiff_t row_len = extent.row_len;
    for (ptrdiff_t r = 0; r < extent.blocks * extent.rows; r++) {
        const ptrdiff_t first = p->first + (r / extent.rows) * p->block_step + (r % extent.rows) * p->row_step;
        const double offset = row_offsets[splitmix64(state) % 4];
        const double scale = row_scales[splitmix64(state) % 5];
        const int kind = special_rows ? (int)(r % 6) : 0;
        const double huge = dtype == LN_F64 ? 1e307 : dtype == LN_F16 ? 6e4 : 1e38;
        const ptrdiff_t spot = row_len > 0 ? (r * 7) % row_len : 0;
        const double constant = offset + scale * uniform(state);
        for (ptrdiff_t j = 0; j < row_len; j++) {
            double value = kind == 4 ? constant : kind == 5 ? huge * uniform(state) : offset + scale * uniform(state);
            if (j == spot && kind == 1) {
                value = NAN;
            }
            else if (j == spot && (kind == 2 || kind == 3)) {
                value = INFINITY;
            }
            else if (j == (spot + 1) % row_len && kind == 3) {
                value = -INFINITY;
            }
            store_element(dtype, base, first + j * p->elem_step, value);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Hashing                                                                   */
/* ------------------------------------------------------------------------ */

/* Replaces every NaN by the one quiet NaN of its width: backward's NaNs differ in sign
   between levels, so its hashes compare every other bit exactly.  Forward's are hashed as
   written: the forward writes the one quiet NaN only. */
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
    ln_extent extent;
    placement in, out;      /* where the input-side and the output-side arrays' elements lie */
    buffer x, dy, residual; /* the inputs, gaps included */
    buffer x_made;          /* x as made, put back before each run that writes over it */
    buffer weight, bias;    /* row_len params, or data NULL */
    buffer mean, rstd;      /* backward: rows params from forward at the scalar level */
    buffer part_mean, part_rstd;  /* backward parts: mean and rstd as float64 */
    buffer outputs[4];      /* what a run writes (besides x), in the order the hash covers */
    int output_count;
    int output_at, mean_at, rstd_at, sum_at;  /* forward: their indices in outputs, or -1 */
    int scale_at;           /* forward parts: the moments' units' index in outputs, or -1 */
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

/* The index of a new output of count elements of size bytes. */
static int add_output(test_case *c, size_t count, size_t size)
{
    c->outputs[c->output_count] = new_buffer(c, count, size);
    return c->output_count++;
}

/* A new input placed as p, its gaps NaN (which a kernel reading them would spread). */
static buffer new_input(const test_case *c, const placement *p, uint64_t *state, int special_rows)
{
    buffer b = new_buffer(c, p->count, element_size(c->dtype));
    for (size_t i = 0; i < b.count; i++) {
        store_element(c->dtype, b.data, (ptrdiff_t)i, NAN);
    }
    fill_rows(state, c->dtype, b.data, p, c->extent, special_rows);
    return b;
}

static buffer new_params(const test_case *c, uint64_t *state, double center, double spread)
{
    buffer b = new_buffer(c, (size_t)c->extent.row_len, param_size(c->dtype));
    for (ptrdiff_t j = 0; j < c->extent.row_len; j++) {
        store_param(c->dtype, b.data, j, center + spread * uniform(state));
    }
    return b;
}

/* The kernel's view of an element array in b, placed as p; absent when b has no data. */
static ln_array element_array(const test_case *c, const buffer *b, const placement *p)
{
    const ptrdiff_t size = (ptrdiff_t)element_size(c->dtype);
    if (!b->data) {
        return (ln_array){0};
    }
    return (ln_array){(char *)b->data + p->first * size,
                      {p->block_step * size, p->row_step * size, p->elem_step * size}};
}

/* The kernel's view of a statistic of each row in b, one after another, or as `walk` says. */
static ln_array stats_array(const test_case *c, const buffer *b, stats_walk walk)
{
    const ptrdiff_t size = (ptrdiff_t)param_size(c->dtype);
    if (!b->data) {
        return (ln_array){0};
    }
    return (ln_array){b->data, {walk == OWN_STATS ? c->extent.rows * size : 0, walk == ROW_0_STATS ? 0 : size, 0}};
}

/* The kernel's view of a float64 statistic of each row in b (the part entry points'). */
static ln_array part_stats_array(const test_case *c, const buffer *b)
{
    const ptrdiff_t size = (ptrdiff_t)sizeof(double);
    return b->data ? (ln_array){b->data, {c->extent.rows * size, size, 0}} : (ln_array){0};
}

/* outputs[at], or an absent buffer for at -1. */
static const buffer *output_at(const test_case *c, int at)
{
    static const buffer absent = {0};
    return at >= 0 ? &c->outputs[at] : &absent;
}

static ln_forward_args forward_args(const test_case *c)
{
    const variant *v = c->variant;
    ln_forward_args args = {
        .kind = v->kind,
        .dtype = c->dtype,
        .extent = c->extent,
        .input = element_array(c, &c->x, &c->in),
        .weight = c->weight.data,
        .bias = c->bias.data,
        .eps = EPS,
        .mean = stats_array(c, output_at(c, c->mean_at), OWN_STATS),
        .rstd = stats_array(c, output_at(c, c->rstd_at), OWN_STATS),
    };
    if (v->residual) {
        args.residual = element_array(c, &c->residual, &c->in);
        args.sum = v->sum_over_input ? args.input : element_array(c, output_at(c, c->sum_at), &c->out);
    }
    args.output = !v->output_over_input ? element_array(c, output_at(c, c->output_at), &c->out)
                  : v->residual        ? args.sum
                                       : args.input;
    return args;
}

/* The backward arguments of a case, its outputs at outputs[0 ..]: dx if wanted, then dweight
   and dbias if wanted (no dbias for RMSNorm). */
static ln_backward_args backward_args(const test_case *c)
{
    const variant *v = c->variant;
    const int params = v->grad_input ? 1 : 0;
    return (ln_backward_args){
        .kind = v->kind,
        .dtype = c->dtype,
        .extent = c->extent,
        .grad_output = element_array(c, &c->dy, &c->in),
        .input = element_array(c, &c->x, &c->in),
        .mean = stats_array(c, &c->mean, v->stats_in),
        .rstd = stats_array(c, &c->rstd, v->stats_in),
        .weight = c->weight.data,
        .grad_input = element_array(c, output_at(c, v->grad_input ? 0 : -1), &c->out),
        .grad_weight = v->grad_params ? c->outputs[params].data : NULL,
        .grad_bias = v->grad_params && v->kind == LN_NORM_LAYER ? c->outputs[params + 1].data : NULL,
    };
}

static void case_setup(test_case *c, const variant *v, ln_dtype dtype, ln_extent extent)
{
    *c = (test_case){.variant = v, .dtype = dtype, .extent = extent, .output_at = -1, .mean_at = -1,
                     .rstd_at = -1, .sum_at = -1, .scale_at = -1};
    if (extent.blocks == 1) {
        snprintf(c->name, sizeof c->name, "%s-%s-%tdx%td", v->name, dtype_names[dtype], extent.rows,
                 extent.row_len);
    }
    else {
        snprintf(c->name, sizeof c->name, "%s-%s-%tdx%tdx%td", v->name, dtype_names[dtype], extent.blocks,
                 extent.rows, extent.row_len);
    }
    c->in = place(v->in, extent, v->row_pad, v->reversed);
    c->out = place(v->out, extent, 0, 0);
    uint64_t state = fnv1a(FNV1A_START, c->name, strlen(c->name));  /* each case its own inputs */

    c->x = new_input(c, &c->in, &state, v->special_rows);
    if (v->weight) {
        c->weight = v->tiny_params ? new_params(c, &state, 0.0, 0x1p-124) : new_params(c, &state, 1.0, 0.5);
    }
    if (v->bias) {
        c->bias = new_params(c, &state, 0.0, v->tiny_params ? 0x1p-127 : 0.25);
    }
    const size_t size = element_size(dtype), psize = param_size(dtype);
    const size_t rows = (size_t)(extent.blocks * extent.rows);
    if (v->parts && !v->backward) {
        c->output_at = add_output(c, c->out.count, size);
        c->mean_at = v->kind == LN_NORM_LAYER ? add_output(c, rows, sizeof(double)) : -1;
        c->rstd_at = add_output(c, rows, sizeof(double));  /* m2, from which rstd is made */
        c->scale_at = add_output(c, rows, sizeof(double));
        c->rstd = new_buffer(c, rows, sizeof(double));
        return;
    }
    if (!v->backward) {
        if (!v->output_over_input) {
            c->output_at = add_output(c, c->out.count, size);
        }
        if (v->stats && v->kind == LN_NORM_LAYER) {
            c->mean_at = add_output(c, rows, psize);
        }
        if (v->stats) {
            c->rstd_at = add_output(c, rows, psize);
        }
        if (v->residual) {
            c->residual = new_input(c, &c->in, &state, 0);
            if (!v->sum_over_input) {
                c->sum_at = add_output(c, c->out.count, size);
            }
        }
        if (v->output_over_input || v->sum_over_input) {
            c->x_made = new_buffer(c, c->x.count, size);
            memcpy(c->x_made.data, c->x.data, c->x.count * size);
        }
        return;
    }
    c->dy = new_input(c, &c->in, &state, 0);
    c->mean = v->kind == LN_NORM_LAYER ? new_buffer(c, rows, psize) : (buffer){0};
    c->rstd = new_buffer(c, rows, psize);
    buffer y = new_buffer(c, c->out.count, size);
    ln_simd_set(LN_SIMD_SCALAR);
    ln_threads_set(1);
    const ln_forward_args made = {.kind = v->kind, .dtype = dtype, .extent = extent,
                                  .input = element_array(c, &c->x, &c->in), .output = element_array(c, &y, &c->out),
                                  .weight = c->weight.data, .eps = EPS,
                                  .mean = stats_array(c, &c->mean, OWN_STATS),
                                  .rstd = stats_array(c, &c->rstd, OWN_STATS)};
    if (ln_forward(&made) != 0) {
        fail(c->name, "ln_forward returned an error making the statistics for backward");
    }
    free(y.data);
    if (v->parts) {
        /* the statistics as float64, the g and g * xhat sums, their means, and dx */
        c->part_mean = new_buffer(c, rows, sizeof(double));
        c->part_rstd = new_buffer(c, rows, sizeof(double));
        for (size_t r = 0; r < rows; r++) {
            ((double *)c->part_mean.data)[r] = c->mean.data ? load_param(dtype, c->mean.data, (ptrdiff_t)r) : 0.0;
            ((double *)c->part_rstd.data)[r] = load_param(dtype, c->rstd.data, (ptrdiff_t)r);
        }
        c->mean_at = v->kind == LN_NORM_LAYER ? add_output(c, rows, sizeof(double)) : -1;
        c->rstd_at = add_output(c, rows, sizeof(double));  /* the sums of g * xhat */
        c->output_at = add_output(c, c->out.count, size);
        return;
    }
    if (v->grad_input) {
        add_output(c, c->out.count, size);
    }
    if (v->grad_params) {
        add_output(c, (size_t)extent.row_len, psize);
        if (v->kind == LN_NORM_LAYER) {
            add_output(c, (size_t)extent.row_len, psize);
        }
    }
}

static void case_free(test_case *c)
{
    buffer *const owned[] = {&c->x, &c->dy, &c->residual, &c->x_made, &c->weight, &c->bias, &c->mean, &c->rstd,
                             &c->part_mean, &c->part_rstd, &c->outputs[0], &c->outputs[1], &c->outputs[2],
                             &c->outputs[3]};
    for (size_t k = 0; k < sizeof owned / sizeof owned[0]; k++) {
        free(owned[k]->data);
    }
}

/* Adds a buffer's bytes to hash, its NaNs canonicalized where `canonicalize`. */
static uint64_t hash_buffer(uint64_t hash, const buffer *b, int canonicalize)
{
    if (canonicalize) {
        canonicalize_nans(b->data, b->count, b->size);
    }
    return fnv1a(hash, b->data, b->count * b->size);
}

/* A parts case: each row's moments, then the row normalized with the rstd they give
   (correctly rounded float64 operations, the same on every architecture).  Returns 0, or -1
   when an entry point fails. */
static int run_parts(const test_case *c)
{
    const variant *v = c->variant;
    const buffer *mean = output_at(c, c->mean_at), *m2 = output_at(c, c->rstd_at);
    const ln_part_moments_args moments = {
        .kind = v->kind,
        .dtype = c->dtype,
        .extent = c->extent,
        .input = element_array(c, &c->x, &c->in),
        .mean = part_stats_array(c, mean),
        .m2 = part_stats_array(c, m2),
        .scale = part_stats_array(c, output_at(c, c->scale_at)),
    };
    if (ln_part_moments(&moments) != 0) {
        return -1;
    }
    for (size_t r = 0; r < c->rstd.count; r++) {
        const double m2_r = ((const double *)m2->data)[r];
        ((double *)c->rstd.data)[r] = 1.0 / sqrt((m2_r > 0.0 ? m2_r : 0.0) / (double)c->extent.row_len + EPS);
    }
    const ln_part_normalize_args normalize = {
        .kind = v->kind,
        .dtype = c->dtype,
        .extent = c->extent,
        .input = moments.input,
        .output = element_array(c, output_at(c, c->output_at), &c->out),
        .weight = c->weight.data,
        .bias = c->bias.data,
        .mean = moments.mean,
        .rstd = part_stats_array(c, &c->rstd),
        .scale = moments.scale,
        .row_len = c->extent.row_len,
    };
    return ln_part_normalize(&normalize);
}

/* A backward parts case: each row's sums of g and g * xhat, then dx from their means.
   Returns 0, or -1 when an entry point fails. */
static int run_backward_parts(const test_case *c)
{
    const variant *v = c->variant;
    const buffer *g = output_at(c, c->mean_at), *g_xhat = output_at(c, c->rstd_at);
    const size_t rows = c->part_rstd.count;
    /* the largest magnitudes (LN_LARGEST_COUNT per row), then the means */
    double *scratch = malloc((LN_LARGEST_COUNT + 2) * rows * sizeof(double) + 1);
    if (!scratch) {
        return -1;
    }
    ln_part_backward_args args = {
        .kind = v->kind,
        .dtype = c->dtype,
        .extent = c->extent,
        .grad_output = element_array(c, &c->dy, &c->in),
        .input = element_array(c, &c->x, &c->in),
        .weight = c->weight.data,
        .mean = v->kind == LN_NORM_LAYER ? part_stats_array(c, &c->part_mean) : (ln_array){0},
        .rstd = part_stats_array(c, &c->part_rstd),
        .g = part_stats_array(c, g),
        .g_xhat = part_stats_array(c, g_xhat),
    };
    buffer largest[LN_LARGEST_COUNT];
    for (int i = 0; i < LN_LARGEST_COUNT; i++) {
        largest[i] = (buffer){scratch + i * rows, rows, sizeof(double)};
        args.largest[i] = part_stats_array(c, &largest[i]);
    }
    if (ln_part_grad_sums(&args) != 0) {
        free(scratch);
        return -1;
    }
    /* the means, in a buffer of their own: the sums stay as hashed; one part: the largest
       magnitudes are the rows' */
    double *means = scratch + LN_LARGEST_COUNT * rows;
    for (size_t r = 0; r < rows; r++) {
        means[r] = g->data ? ((const double *)g->data)[r] / (double)c->extent.row_len : 0.0;
        means[rows + r] = ((const double *)g_xhat->data)[r] / (double)c->extent.row_len;
    }
    const buffer g_means = {means, rows, sizeof(double)}, g_xhat_means = {means + rows, rows, sizeof(double)};
    args.g = g->data ? part_stats_array(c, &g_means) : (ln_array){0};
    args.g_xhat = part_stats_array(c, &g_xhat_means);
    args.grad_input = element_array(c, output_at(c, c->output_at), &c->out);
    const int status = ln_part_grad_input(&args);
    free(scratch);
    return status;
}

/* Runs the case once at the level and thread count in use; returns the kernel's status
   and sets *hash to the hash of the outputs (and of x, when written over), backward's NaNs
   canonicalized. */
static int run_case(const test_case *c, uint64_t *hash)
{
    const variant *v = c->variant;
    for (int k = 0; k < c->output_count; k++) {
        memset(c->outputs[k].data, 0x55, c->outputs[k].count * c->outputs[k].size);  /* not NaN */
    }
    if (c->x_made.data) {
        memcpy(c->x.data, c->x_made.data, c->x.count * c->x.size);
    }
    int status;
    if (v->parts) {
        status = v->backward ? run_backward_parts(c) : run_parts(c);
    }
    else if (v->backward) {
        const ln_backward_args args = backward_args(c);
        status = ln_backward(&args);
    }
    else {
        const ln_forward_args args = forward_args(c);
        status = ln_forward(&args);
    }
    *hash = FNV1A_START;
    for (int k = 0; k < c->output_count; k++) {
        *hash = hash_buffer(*hash, &c->outputs[k], v->backward);
    }
    if (c->x_made.data) {
        *hash = hash_buffer(*hash, &c->x, v->backward);
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
                     c->variant->parts      ? "a part entry point"
                     : c->variant->backward ? "ln_backward"
                                            : "ln_forward",
                     level_name, thread_counts[t]);
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
                if (!by_tiles(&variants[v])) {
                    case_setup(&c, &variants[v], dtypes[d], (ln_extent){1, shapes[s].rows, shapes[s].row_len});
                    run_everywhere(&c);
                    case_free(&c);
                }
            }
        }
        for (size_t s = 0; s < sizeof tile_shapes / sizeof tile_shapes[0]; s++) {
            for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
                if (by_tiles(&variants[v])) {
                    const ln_extent extent = {tile_shapes[s].blocks, tile_shapes[s].rows, tile_shapes[s].row_len};
                    case_setup(&c, &variants[v], dtypes[d], extent);
                    run_everywhere(&c);
                    case_free(&c);
                }
            }
        }
    }
    for (size_t k = 0; k < sizeof large_cases / sizeof large_cases[0]; k++) {
        case_setup(&c, variant_named(large_cases[k].variant), large_cases[k].dtype,
                   (ln_extent){1, large_cases[k].rows, large_cases[k].row_len});
        run_everywhere(&c);
        case_free(&c);
    }
    return 0;
}
