"""The kernel layer's entry points for rows split across arrays (layernorm._dask's chunks cut
along the normalized axes), called directly: each part's float64 moments, a part normalized
with float64 statistics given, backward's row sums of a part and its grad_input from the
rows' means of them.

    mean, m2, scale = _layer_norm_part_moments(x, sizes, axis=axes)   # m2: sum((x - mean) ** 2)
    m2, scale = _rms_norm_part_moments(x, sizes, axis=axes)           # the sum of squares
    y = _layer_norm_part_normalize(x, sizes, mean, rstd, weight, bias, axis=axes, scale=scale, row_len=n)
    y = _rms_norm_part_normalize(x, sizes, rstd, weight, axis=axes, scale=scale, row_len=n)
    g_sum, g_xhat_sum, *largest = _layer_norm_part_grad_sums(dy, x, sizes, mean, rstd, weight, axis=axes)
    dx = _layer_norm_part_grad_input(dy, x, sizes, mean, rstd, g_mean, g_xhat_mean, *largest, weight, axis=axes)
    (RMSNorm: no mean, no g_sum, no g_mean; largest = (g_largest, dy_largest, xc_largest): the
    largest |g|, |dy| and |x - mean| (|x| for RMSNorm), of the part from the sums, of the whole
    row into grad_input)

(moments in units of scale, a power of two, 1 but for parts of extreme magnitude; normalize
takes mean / scale and rstd * scale, and row_len, the whole row's length) held to the float64
reference (layernorm._reference) over dtype x layout x kind; a whole row as its one part gives
layer_norm's bits; every SIMD level and layout gives the same bits; rows of extreme magnitude
get the whole-array call's answer.
"""

import numpy as np
import pytest

import layernorm
from layernorm import _layernorm as core
from tests.helpers import (FLOAT_DTYPES, GRAD_REFERENCE_RTOL, KINDS, assert_close, assert_matches_reference, assert_within, dtype_id,
                           grad_input_scale, layout, make_input, make_params, param_dtype)

# (shape, axes): rows of one chunk, of several (LN_CHUNK is 2048) and shorter than a group; a
# row along axis 0 (elements a row apart: the strided route); two normalized axes out of order
CASES = [
    ((5, 700), (1,)),
    ((3, 5000), (1,)),
    ((17, 9), (1,)),
    ((4100, 3), (0,)),
    ((3, 40, 6), (2, 0)),
]
CASE_IDS = [f"{'x'.join(map(str, shape))}-axis{''.join(map(str, axes))}" for shape, axes in CASES]
PART_LAYOUTS = ("C", "fortran", "transposed", "step_sliced", "negative_strides", "byte_swapped", "unaligned",
                "column_slice")
LEVELS = layernorm.available_simd_levels()
# Relative error of the moments: float16 data's sums go in float32 over blocks of 8 groups
# (ln_rows.h), the others' in float64.
MOMENTS_REL_TOL = {np.dtype(np.float16): 1e-6, np.dtype(np.float32): 1e-12, np.dtype(np.float64): 1e-12}


def sizes_of(shape, axes):
    return tuple(shape[a] for a in axes)


def moments(kind, x, axes):
    """(mean, m2, scale) of each row's part; RMSNorm's mean is 0."""
    sizes = sizes_of(np.shape(x), axes)
    if kind.centred:
        return core._layer_norm_part_moments(x, sizes, axis=axes)
    return (np.zeros(1),) + core._rms_norm_part_moments(x, sizes, axis=axes)


def normalize(kind, x, axes, mean, rstd, weight=None, bias=None, scale=None, row_len=None):
    sizes = sizes_of(np.shape(x), axes)
    if kind.centred:
        return core._layer_norm_part_normalize(x, sizes, mean, rstd, weight, bias, axis=axes, scale=scale,
                                               row_len=row_len)
    return core._rms_norm_part_normalize(x, sizes, rstd, weight, axis=axes, scale=scale, row_len=row_len)


def grad_sums(kind, dy, x, axes, mean, rstd, weight=None):
    """(g_sum, g_xhat_sum, (g_largest, dy_largest, xc_largest)) of each row's part; RMSNorm's g_sum is 0."""
    sizes = sizes_of(np.shape(x), axes)
    if kind.centred:
        g_sum, g_xhat_sum, *largest = core._layer_norm_part_grad_sums(dy, x, sizes, mean, rstd, weight, axis=axes)
    else:
        g_sum = np.zeros(1)
        g_xhat_sum, *largest = core._rms_norm_part_grad_sums(dy, x, sizes, rstd, weight, axis=axes)
    return g_sum, g_xhat_sum, tuple(largest)


def grad_input(kind, dy, x, axes, mean, rstd, g_mean, g_xhat_mean, largest, weight=None):
    """largest: the rows' (g_largest, dy_largest, xc_largest)"""
    sizes = sizes_of(np.shape(x), axes)
    if kind.centred:
        return core._layer_norm_part_grad_input(dy, x, sizes, mean, rstd, g_mean, g_xhat_mean, *largest, weight,
                                                axis=axes)
    return core._rms_norm_part_grad_input(dy, x, sizes, rstd, g_xhat_mean, *largest, weight, axis=axes)


def backward_data(shape, axes, dtype, kind):
    """(x, dy, weight, mean, rstd): the statistics as native() returns them (mean None for
    RMSNorm)."""
    x = make_input(shape, dtype, offset=3.0)
    dy = make_input(shape, dtype, seed=5)
    sizes = sizes_of(shape, axes)
    weight, _ = make_params(sizes, param_dtype(dtype), "weight")
    stats = kind.native(x, sizes, weight, axis=axes)[1:]
    mean, rstd = stats if kind.centred else (None, stats[0])
    return x, dy, weight, mean, rstd


# Relative error of backward's row sums: float16/float32 data's products are summed in float32
# over blocks of 8 groups (ln_rows.h), float64 data's in float64.
SUMS_REL_TOL = {np.dtype(np.float16): 1e-6, np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}


def rstd_of(m2, count, eps):
    """The kernels' rstd from a row's moments (a one-pass M2 a rounding below 0 is 0)."""
    return 1.0 / np.sqrt(np.maximum(m2, 0.0) / count + eps)


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", PART_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, axes", CASES, ids=CASE_IDS)
def test_moments_match_the_reference(shape, axes, dtype, name, kind):
    base = make_input(shape, dtype, offset=3.0)
    mean, m2, scale = moments(kind, layout(name, base), axes)
    assert np.all(scale == 1.0)
    exact = base.astype(np.float64)
    centre = exact.mean(axis=axes, keepdims=True) if kind.centred else np.zeros(1)
    expected_m2 = ((exact - centre) ** 2).sum(axis=axes, keepdims=True)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(shape))
    assert m2.dtype == np.float64 and m2.shape == stats_shape
    tol = MOMENTS_REL_TOL[np.dtype(dtype)]
    assert_within(m2, expected_m2, tol * expected_m2, "m2")
    if kind.centred:
        assert mean.dtype == np.float64 and mean.shape == stats_shape
        spread = np.sqrt(expected_m2 / np.prod(sizes_of(shape, axes)))
        assert_within(mean, centre, tol * (np.abs(centre) + spread), "mean")


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", PART_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, axes", CASES, ids=CASE_IDS)
def test_normalize_with_the_reference_statistics_matches_the_reference(shape, axes, dtype, name, kind):
    base = make_input(shape, dtype, offset=3.0)
    sizes = sizes_of(shape, axes)
    weight, bias = make_params(sizes, param_dtype(dtype), "weight+bias")
    bias = bias if kind.centred else None
    eps = kind.eps_value(base)
    _, *stats = kind.reference(base, sizes, weight, bias, eps, axis=axes)
    mean, rstd = stats if kind.centred else (None, stats[0])
    out = normalize(kind, layout(name, base), axes, mean, rstd, weight, bias)
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    assert_matches_reference(out, base, sizes, weight, bias, eps, centred=kind.centred, axis=axes)


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("row_len", [16, 700, 5000])
def test_a_whole_row_as_its_one_part_gives_the_forward_bits(row_len, dtype, kind):
    """(rows shorter than a group take a two-pass path of their own in the forward)"""
    x = make_input((6, row_len), dtype, offset=-2.0)
    weight, bias = make_params((row_len,), param_dtype(dtype), "weight+bias")
    bias = bias if kind.centred else None
    eps = kind.eps_value(x)
    mean, m2, _ = moments(kind, x, (1,))
    out = normalize(kind, x, (1,), mean, rstd_of(m2, row_len, eps), weight, bias)
    np.testing.assert_array_equal(out, kind.forward(x, row_len, weight, bias, eps))


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, axes", CASES, ids=CASE_IDS)
def test_every_simd_level_and_layout_gives_the_same_bits(shape, axes, dtype, kind):
    base = make_input(shape, dtype, offset=3.0)
    sizes = sizes_of(shape, axes)
    weight, bias = make_params(sizes, param_dtype(dtype), "weight+bias")
    bias = bias if kind.centred else None
    results = {}
    level = layernorm.simd_level()
    try:
        for name in LEVELS:
            layernorm.set_simd_level(name)
            for arrangement in ("C", "transposed", "step_sliced"):
                x = layout(arrangement, base)
                mean, m2, scale = moments(kind, x, axes)
                out = normalize(kind, x, axes, mean, rstd_of(m2, np.prod(sizes), 1e-5), weight, bias)
                results[name, arrangement] = [a.tobytes() for a in (mean, m2, scale, np.ascontiguousarray(out))]
    finally:
        layernorm.set_simd_level(level)
    first = results[LEVELS[0], "C"]
    for key, bits in results.items():
        assert bits == first, f"{key} differs from {LEVELS[0]}, C"


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", PART_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, axes", CASES, ids=CASE_IDS)
def test_grad_sums_match_the_reference(shape, axes, dtype, name, kind):
    x, dy, weight, mean, rstd = backward_data(shape, axes, dtype, kind)
    g_sum, g_xhat_sum, largest = grad_sums(kind, layout(name, dy), layout(name, x), axes, mean, rstd, weight)
    normalized = np.moveaxis(x.astype(np.float64), axes, range(-len(axes), 0))
    g = np.moveaxis(dy.astype(np.float64), axes, range(-len(axes), 0)) * weight.astype(np.float64)
    row_mean = 0.0 if mean is None else np.moveaxis(mean.astype(np.float64), axes, range(-len(axes), 0))
    xhat = (normalized - row_mean) * np.moveaxis(rstd.astype(np.float64), axes, range(-len(axes), 0))
    summed = tuple(range(-len(axes), 0))
    tol = SUMS_REL_TOL[np.dtype(dtype)]
    expected = np.moveaxis((g * xhat).sum(axis=summed, keepdims=True), range(-len(axes), 0), axes)
    scale = np.moveaxis(np.abs(g * xhat).sum(axis=summed, keepdims=True), range(-len(axes), 0), axes)
    assert g_xhat_sum.dtype == np.float64 and g_xhat_sum.shape == expected.shape
    assert_within(g_xhat_sum, expected, tol * scale, "g_xhat_sum")
    if kind.centred:
        expected = np.moveaxis(g.sum(axis=summed, keepdims=True), range(-len(axes), 0), axes)
        scale = np.moveaxis(np.abs(g).sum(axis=summed, keepdims=True), range(-len(axes), 0), axes)
        assert_within(g_sum, expected, tol * scale, "g_sum")
    g_largest, dy_largest, xc_largest = largest
    expected = np.moveaxis(np.abs(g).max(axis=summed, keepdims=True), range(-len(axes), 0), axes)
    assert_within(g_largest, expected, 1e-7 * expected, "g_largest")  # g formed in float32 for 16-bit/float32
    expected = np.moveaxis(np.abs(dy.astype(np.float64)), axes, range(-len(axes), 0)).max(axis=summed, keepdims=True)
    assert np.array_equal(dy_largest, np.moveaxis(expected, range(-len(axes), 0), axes))
    # x - mean as the kernels form it: in float32 for 16-bit/float32 data, the mean rounded to it
    compute = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    centred = normalized.astype(compute) - np.asarray(row_mean).astype(compute)
    expected = np.moveaxis(np.abs(centred).max(axis=summed, keepdims=True), range(-len(axes), 0), axes)
    assert np.array_equal(xc_largest, expected)


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", PART_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, axes", CASES, ids=CASE_IDS)
def test_grad_input_from_the_row_means_matches_the_reference(shape, axes, dtype, name, kind):
    x, dy, weight, mean, rstd = backward_data(shape, axes, dtype, kind)
    count = np.prod(sizes_of(shape, axes))
    g_sum, g_xhat_sum, largest = grad_sums(kind, dy, x, axes, mean, rstd, weight)
    dx = grad_input(kind, layout(name, dy), layout(name, x), axes, mean, rstd, g_sum / count, g_xhat_sum / count,
                    largest, weight)
    stats = (mean, rstd) if kind.centred else (rstd,)
    expected = kind.reference_backward(dy, x, sizes_of(shape, axes), stats, weight, axis=axes)[0]
    assert dx.dtype == np.dtype(dtype) and dx.shape == shape
    scale = grad_input_scale(dy, x, sizes_of(shape, axes), weight, centred=kind.centred, axis=axes)
    assert_close(dx, expected, GRAD_REFERENCE_RTOL[np.dtype(dtype)], "grad_input", scale=scale)


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape, axes", CASES, ids=CASE_IDS)
def test_backward_every_simd_level_and_layout_gives_the_same_bits(shape, axes, dtype, kind):
    x, dy, weight, mean, rstd = backward_data(shape, axes, dtype, kind)
    count = np.prod(sizes_of(shape, axes))
    results = {}
    level = layernorm.simd_level()
    try:
        for name in LEVELS:
            layernorm.set_simd_level(name)
            for arrangement in ("C", "transposed", "step_sliced"):
                args = (layout(arrangement, dy), layout(arrangement, x), axes, mean, rstd)
                g_sum, g_xhat_sum, largest = grad_sums(kind, *args, weight)
                dx = grad_input(kind, *args, g_sum / count, g_xhat_sum / count, largest, weight)
                results[name, arrangement] = [a.tobytes() for a in (g_sum, g_xhat_sum, *largest,
                                                                    np.ascontiguousarray(dx))]
    finally:
        layernorm.set_simd_level(level)
    first = results[LEVELS[0], "C"]
    for key, bits in results.items():
        assert bits == first, f"{key} differs from {LEVELS[0]}, C"


# Rows of extreme magnitude (dtype, magnitude): a row of random values of that size, a constant
# one, an ordinary one; several chunks long.
EXTREME_PARTS = {
    "float64-1e300": (np.float64, 1e300),
    "float64-near-max": (np.float64, 1.7e308),
    "float64-1e-300": (np.float64, 1e-300),
    "float64-subnormal": (np.float64, 1e-310),
    "float32-subnormal": (np.float32, 1e-39),
    "float32-3e38": (np.float32, 3e38),
    "float16-6e4": (np.float16, 6e4),
    "float16-subnormal": (np.float16, 3e-7),
}


def extreme_rows(dtype, magnitude, row_len=5000):
    rng = np.random.default_rng(8)
    rows = rng.uniform(-1.0, 1.0, (3, row_len)) * magnitude
    rows[1] = magnitude
    rows[2] = rng.standard_normal(row_len)
    return rows.astype(dtype)


def scaled_moments(x, centred):
    """(mean, m2) of each row of x in float64, safely: in units of a power of two."""
    x = x.astype(np.float64)
    s = np.exp2(np.floor(np.log2(np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-320))))
    xs = x / s
    mean_s = xs.mean(axis=1, keepdims=True) if centred else np.zeros_like(s)
    return mean_s * s, ((xs - mean_s) ** 2).sum(axis=1, keepdims=True), s


@pytest.mark.parametrize("magnitude", EXTREME_PARTS)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_moments_of_extreme_parts_are_in_units_of_a_power_of_two(kind, magnitude):
    x = extreme_rows(*EXTREME_PARTS[magnitude])
    mean, m2, scale = moments(kind, x, (1,))
    mantissa, _ = np.frexp(scale)
    assert np.all(mantissa == 0.5), scale
    assert scale[2] == 1.0  # the ordinary row
    want_mean, want_m2_s, s = scaled_moments(x, kind.centred)
    m2_in_s = m2 * (scale / s) ** 2
    # (and the rounding of a constant row's deviations, of units 2**-52)
    assert_within(m2_in_s, want_m2_s, 1e-6 * want_m2_s + x.shape[1] * 2.0**-90, "m2")
    if kind.centred:
        spread = np.sqrt(want_m2_s / x.shape[1]) * s
        assert_within(mean * scale, want_mean, 1e-6 * (np.abs(want_mean) + spread), "mean")


@pytest.mark.parametrize("magnitude", EXTREME_PARTS)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_extreme_parts_give_the_same_bits_at_every_simd_level_and_layout(kind, magnitude):
    """moments, normalize (from a row's statistics in its moments' units, over three parts),
    grad sums and grad_input (from the statistics native() returns)"""
    x = extreme_rows(*EXTREME_PARTS[magnitude])
    dy = make_input(x.shape, np.float32, seed=6).astype(x.dtype)
    weight, bias = make_params((x.shape[1],), param_dtype(x.dtype), "weight+bias")
    bias = bias if kind.centred else None
    stats = kind.native(x, (x.shape[1],), weight, bias, eps=0.0)[1:]
    mean, rstd = stats if kind.centred else (None, stats[0])
    results = {}
    level = layernorm.simd_level()
    try:
        for name in LEVELS:
            layernorm.set_simd_level(name)
            for arrangement in ("C", "transposed", "step_sliced"):
                bits = []
                for part in (slice(0, 1500), slice(1500, 4000), slice(4000, 5000)):
                    xs, dys = layout(arrangement, x[:, part]), layout(arrangement, dy[:, part])
                    part_weight = weight[part]
                    part_bias = None if bias is None else bias[part]
                    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                        part_mean, m2, scale = moments(kind, xs, (1,))
                        rstd_s = 1.0 / np.sqrt(m2 / xs.shape[1])
                        out = normalize(kind, xs, (1,), part_mean, rstd_s, part_weight, part_bias, scale, x.shape[1])
                        g_sum, g_xhat_sum, largest = grad_sums(kind, dys, xs, (1,), mean, rstd, part_weight)
                        dx = grad_input(kind, dys, xs, (1,), mean, rstd, g_sum / 5000, g_xhat_sum / 5000, largest,
                                        part_weight)
                    bits += [a.tobytes() for a in (part_mean, m2, scale, np.ascontiguousarray(out), g_sum, g_xhat_sum,
                                                   *largest, np.ascontiguousarray(dx))]
                results[name, arrangement] = bits
    finally:
        layernorm.set_simd_level(level)
    first = results[LEVELS[0], "C"]
    for key, bits in results.items():
        assert bits == first, f"{key} differs from {LEVELS[0]}, C"


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_parts_without_elements_or_rows(kind):
    x = np.zeros((4, 0), np.float32)
    mean, m2, _ = moments(kind, x, (1,))
    assert m2.shape == (4, 1) and not m2.any() and not np.any(mean)
    out = normalize(kind, x, (1,), np.zeros((4, 1)), np.ones((4, 1)))
    assert out.shape == (4, 0)
    assert moments(kind, np.zeros((0, 5), np.float64), (1,))[1].shape == (0, 1)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_normalize_writes_a_new_array_and_leaves_its_arguments(kind):
    x = make_input((3, 100), np.float32)
    kept = x.copy()
    mean, m2, _ = moments(kind, x, (1,))
    out = normalize(kind, x, (1,), mean, rstd_of(m2, 100, 1e-5))
    assert not np.shares_memory(out, x)
    np.testing.assert_array_equal(x, kept)


def test_statistics_of_another_number_of_rows_are_refused():
    x = make_input((3, 100), np.float32)
    with pytest.raises(ValueError, match=r"mean must be a float array with one value per normalized row \(3\); got"):
        core._layer_norm_part_normalize(x, (100,), np.zeros(2), np.ones(3), axis=(1,))
    with pytest.raises(ValueError, match="one value per normalized row"):
        core._rms_norm_part_normalize(x, (100,), np.ones(4), axis=(1,))
    with pytest.raises(ValueError, match="scale must be a float array with one value per normalized row"):
        core._rms_norm_part_normalize(x, (100,), np.ones(3), axis=(1,), scale=np.ones(2))


def test_a_row_length_shorter_than_the_part_is_refused():
    with pytest.raises(ValueError, match="row_len must be the whole row's length"):
        core._layer_norm_part_normalize(make_input((3, 100), np.float32), (100,), np.zeros(3), np.ones(3),
                                        axis=(1,), row_len=99)


def test_parameters_of_another_size_than_the_part_are_refused():
    x = make_input((3, 100), np.float32)
    with pytest.raises(ValueError, match="same shape as normalized_shape"):
        core._layer_norm_part_normalize(x, (100,), np.zeros(3), np.ones(3), np.ones(99, np.float32), axis=(1,))


def test_sizes_that_are_not_the_parts_are_refused():
    with pytest.raises(ValueError):
        core._layer_norm_part_moments(make_input((3, 100), np.float32), (99,), axis=(1,))


def test_inputs_the_kernels_do_not_take_are_refused():
    with pytest.raises(core.UnsupportedDTypeError):
        core._rms_norm_part_moments(np.ones((3, 4), np.int32), (4,))
    with pytest.raises(TypeError, match="unexpected keyword"):
        core._layer_norm_part_moments(np.ones((3, 4)), (4,), eps=1.0)
