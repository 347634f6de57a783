"""layer_norm and native_layer_norm values against layernorm._reference (the truth) and torch
(the oracle): dtype x shape x affine, the spellings of their arguments, out=, and the rows that
are special (constant, eps=0, NaN/Inf, empty, N == 1) and parameter dtypes.

Every test id names its case: dtype, input shape, normalized_shape, eps, affine.
"""

import numpy as np
import pytest

import layernorm
from helpers import (
    AFFINES,
    FLOAT_DTYPES,
    KINDS,
    assert_matches_reference,
    assert_matches_torch,
    assert_within,
    check_output_array,
    dtype_id,
    make_input,
    make_params,
    param_dtype,
    reference_layer_norm,
    requires_torch,
    same_bits,
    shape_id,
    torch_layer_norm,
    torch_native_layer_norm,
    torch_scale,
)

# (input shape, normalized_shape, eps)
CASES = [
    ((5,), (5,), 1e-5),  # 1-D input, a single row
    ((3, 1), (1,), 1e-5),  # N == 1
    ((7, 17), (17,), 1e-5),  # odd row length (SIMD tails)
    ((3, 4097), (4097,), 1e-5),  # odd, long row
    ((2, 3, 4), (4,), 1e-5),
    ((0, 5), (5,), 1e-5),  # empty batch
    ((2, 3, 5, 5), (3, 5, 5), 1e-5),  # multi-dim normalized_shape
    # torch's OpInfo sample inputs
    ((1, 2, 3), (1, 2, 3), 0.5),
    ((2, 2, 3), (2, 3), -0.5),
    ((1,), (1,), 1e-5),
    ((1, 2), (2,), 1e-5),
    ((0, 1), (1,), 1e-5),
    # torch's ModuleInfo inputs
    ((4, 5, 5), (5,), 1e-5),
    ((128, 5, 5), (5,), 1e-5),
    ((4, 2, 2, 5), (2, 2, 5), 1e-5),
]


def case_id(case):
    shape, ns, eps = case
    return f"in{shape_id(shape)}-ns{shape_id(ns)}-eps{eps:g}"


# ---------------------------------------------------------------------------
# dtype x shape x affine, C-contiguous input
# ---------------------------------------------------------------------------


def case_data(dtype, case, affine):
    """(x, normalized_shape, weight, bias, eps) of one CASES entry."""
    shape, ns, eps = case
    weight, bias = make_params(ns, param_dtype(dtype), affine)
    return make_input(shape, dtype), ns, weight, bias, eps


@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_layer_norm_matches_reference(dtype, case, affine):
    x, ns, weight, bias, eps = case_data(dtype, case, affine)
    out = layernorm.layer_norm(x, ns, weight, bias, eps)
    check_output_array(out, x, dtype)
    assert out.shape == x.shape
    assert_matches_reference(out, x, ns, weight, bias, eps)


@requires_torch
@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_layer_norm_matches_torch(dtype, case, affine):
    x, ns, weight, bias, eps = case_data(dtype, case, affine)
    out = layernorm.layer_norm(x, ns, weight, bias, eps)
    expected = torch_layer_norm(x, ns, weight, bias, eps)
    assert_matches_torch(out, expected, torch_scale(x, ns, weight, bias, eps))


@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_native_layer_norm_matches_reference(dtype, case, affine):
    x, ns, weight, bias, eps = case_data(dtype, case, affine)
    out, mean, rstd = layernorm.native_layer_norm(x, ns, weight, bias, eps)
    check_output_array(out, x, dtype)
    assert out.shape == x.shape
    stats_shape = x.shape[: x.ndim - len(ns)] + (1,) * len(ns)
    cdt = param_dtype(dtype)
    for stat in (mean, rstd):
        assert isinstance(stat, np.ndarray)
        assert stat.shape == stats_shape
        assert stat.dtype == np.dtype(cdt)  # spec: the compute dtype
    # Same output as layer_norm, bit for bit: one kernel.
    np.testing.assert_array_equal(out, layernorm.layer_norm(x, ns, weight, bias, eps))
    _, ref_mean, ref_rstd, _ = reference_layer_norm(x, ns, weight, bias, eps)
    assert_matches_reference(out, x, ns, weight, bias, eps)
    # Statistics are float64 internally, then rounded once to the compute dtype.
    stat_tol = 1e-12 if cdt == np.float64 else float(np.finfo(np.float32).eps)
    assert_within(mean, ref_mean, stat_tol * np.abs(ref_mean) + 1e-300, "mean vs reference")
    assert_within(rstd, ref_rstd, stat_tol * np.abs(ref_rstd) + 1e-300, "rstd vs reference")


@requires_torch
@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_native_layer_norm_matches_torch(dtype, case, affine):
    x, ns, weight, bias, eps = case_data(dtype, case, affine)
    out, mean, rstd = layernorm.native_layer_norm(x, ns, weight, bias, eps)
    _, _, ref_rstd, _ = reference_layer_norm(x, ns, weight, bias, eps)
    t_out, t_mean, t_rstd = torch_native_layer_norm(x, ns, weight, bias, eps)
    assert t_mean.shape == mean.shape and t_rstd.shape == rstd.shape
    assert_matches_torch(out, t_out, torch_scale(x, ns, weight, bias, eps))
    # torch's float32 statistics are accurate to a few float32 ulps of |x| (mean) and of rstd;
    # torch's float16 statistics (float16 input, no float32 params) are rounded to float16.
    if t_mean.dtype == np.float16:
        rel = float(np.finfo(np.float16).eps)
    elif t_mean.dtype == np.float32:
        rel = 1e-5
    else:
        rel = 1e-12
    abs_x = np.abs(x.astype(np.float64)).max() if x.size else 0.0
    assert_within(mean, t_mean, rel * abs_x + 1e-300, "mean vs torch")
    assert_within(rstd, t_rstd, rel * np.abs(ref_rstd) + 1e-300, "rstd vs torch")


# ---------------------------------------------------------------------------
# normalized_shape, eps and keyword spellings
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ns",
    [7, np.int64(7), np.int32(7), (7,), [7], (np.int64(7),), np.array([7])],
    ids=["int", "np.int64", "np.int32", "tuple", "list", "tuple-of-np.int64", "ndarray"],
)
def test_normalized_shape_spellings(ns):
    x = make_input((3, 7), np.float32)
    out = layernorm.layer_norm(x, ns)
    np.testing.assert_array_equal(out, layernorm.layer_norm(x, (7,)))
    out2, mean, rstd = layernorm.native_layer_norm(x, ns, None, None, 1e-5)
    assert mean.shape == (3, 1)
    np.testing.assert_array_equal(out2, out)


def test_keywords_accepted():
    x = make_input((3, 7), np.float64)
    w, b = make_params((7,), np.float64, "weight+bias")
    np.testing.assert_array_equal(
        layernorm.layer_norm(x, (7,), weight=w, bias=b, eps=1e-3),
        layernorm.layer_norm(x, (7,), w, b, 1e-3),
    )
    np.testing.assert_array_equal(
        layernorm.layer_norm(input=x, normalized_shape=(7,)), layernorm.layer_norm(x, (7,))
    )


class ZeroDimensional:  # another library's array of no dimensions, which float() converts (torch's does)
    ndim = 0

    def __float__(self):
        return 0.125


@pytest.mark.parametrize("eps", [1, np.float32(1e-3), np.float64(0.25), 0, np.array(0.5), ZeroDimensional()],
                         ids=["int", "np.float32", "np.float64", "int0", "0-d-ndarray", "0-d-other"])
def test_eps_real_number_types(eps):
    x = make_input((3, 7), np.float64)
    out = layernorm.layer_norm(x, (7,), eps=eps)
    assert_matches_reference(out, x, (7,), eps=float(eps))


def test_eps_is_added_to_the_float64_variance():
    # a deliberate difference: torch rounds eps to the input's float32 first, where 1e-50 is 0
    x = np.full((1, 4), 5.0, np.float32)
    np.testing.assert_array_equal(layernorm.layer_norm(x, 4, eps=1e-50), np.zeros((1, 4), np.float32))


@requires_torch
def test_torch_rounds_eps_to_float32():
    x = np.full((1, 4), 5.0, np.float32)
    assert np.isnan(torch_layer_norm(x, (4,), eps=1e-50)).all()


# ---------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape,ns", [((6, 17), (17,)), ((2, 3, 5, 5), (3, 5, 5)), ((64, 4097), (4097,))], ids=["6x17", "2x3x5x5", "64x4097"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_out_written_and_returned(dtype, shape, ns):
    x = make_input(shape, dtype, seed=5)
    w, b = make_params(ns, param_dtype(dtype), "weight+bias")
    expected = layernorm.layer_norm(x, ns, w, b)
    out = np.full(shape, np.nan, dtype=dtype)
    result = layernorm.layer_norm(x, ns, w, b, out=out)
    assert result is out
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("shape,ns", [((6, 17), (17,)), ((2, 3, 5, 5), (3, 5, 5)), ((64, 4097), (4097,)), ((512, 64), (64,))], ids=["6x17", "2x3x5x5", "64x4097", "512x64"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_out_is_input_in_place(dtype, shape, ns, affine):
    x = make_input(shape, dtype, seed=6)
    w, b = make_params(ns, param_dtype(dtype), affine)
    expected = layernorm.layer_norm(x, ns, w, b)
    result = layernorm.layer_norm(x, ns, w, b, out=x)
    assert result is x
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("shape,strides,axis", [((3, 16), (0, 4), None), ((16, 3), (4, 0), 0)],
                         ids=["rows-one-memory", "axis0-columns-one-memory"])
def test_out_is_an_input_whose_rows_share_memory(shape, strides, axis):
    # out=x where x's rows are one row of memory: the result is that of a copy of x, as NumPy's
    # ufuncs give (written over x in place, a row would be read after another row's result
    # had replaced it)
    base = make_input((16,), np.float32, seed=7)
    x = np.lib.stride_tricks.as_strided(base, shape, strides)
    expected = layernorm.layer_norm(x.copy(), 16, axis=axis)
    assert layernorm.layer_norm(x, 16, axis=axis, out=x) is x
    np.testing.assert_array_equal(x, expected)


def test_out_none_explicit():
    x = make_input((3, 7), np.float32)
    np.testing.assert_array_equal(layernorm.layer_norm(x, (7,), out=None), layernorm.layer_norm(x, (7,)))


# ---------------------------------------------------------------------------
# Special rows
# ---------------------------------------------------------------------------

CONSTANTS = [0.0, 1234.0, -3.5, 0.1, 1e4 + 0.1, 65504.0]


@pytest.mark.parametrize("n", [1, 7, 64, 4097])
@pytest.mark.parametrize("value", CONSTANTS, ids=[f"c{v:g}" for v in CONSTANTS])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_constant_row_gives_exactly_bias(dtype, value, n):
    x = np.full((3, n), value, dtype=dtype)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    out = layernorm.layer_norm(x, (n,), w, b)
    np.testing.assert_array_equal(out, np.broadcast_to(b.astype(dtype), out.shape))
    out = layernorm.layer_norm(x, (n,), w, None)
    np.testing.assert_array_equal(out, np.zeros((3, n), dtype))


@requires_torch
@pytest.mark.parametrize("n", [1, 7, 64, 4097])
@pytest.mark.parametrize("value", CONSTANTS, ids=[f"c{v:g}" for v in CONSTANTS])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
def test_torch_constant_row_gives_exactly_bias(dtype, value, n):
    # The oracle agrees, except its float16 kernel (see test_torch_float16_constant_row_is_not_exact).
    x = np.full((3, n), value, dtype=dtype)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    np.testing.assert_array_equal(torch_layer_norm(x, (n,), w, b), np.broadcast_to(b.astype(dtype), x.shape))


@requires_torch
def test_torch_float16_constant_row_is_not_exact():
    # Why the float16 cases above do not ask torch: torch's float16 CPU kernel computes
    # x * rstd - mean * rstd in float32, which cancels badly on a constant row (ours: exact).
    x = np.full((1, 7), 1234.0, np.float16)
    assert np.abs(torch_layer_norm(x, (7,))).max() > 1e-3
    np.testing.assert_array_equal(layernorm.layer_norm(x, (7,)), np.zeros((1, 7), np.float16))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_constant_row_stats(dtype):
    x = np.full((2, 9), 1234.0, dtype=dtype)
    _, mean, rstd = layernorm.native_layer_norm(x, (9,), None, None, 1e-5)
    np.testing.assert_array_equal(mean, np.full((2, 1), 1234.0))
    truth = 1 / np.sqrt(1e-5)
    one_ulp = float(np.spacing(np.asarray(truth, rstd.dtype)))  # of rstd's dtype
    assert_within(rstd, np.full((2, 1), truth), one_ulp, "rstd = 1/sqrt(eps)")


def eps_zero_constant_row(dtype):
    x = make_input((3, 8), dtype)
    x[1] = 2.5
    return x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_eps_zero_constant_row_is_nan(dtype):
    x = eps_zero_constant_row(dtype)
    out = layernorm.layer_norm(x, (8,), eps=0.0)
    assert np.isnan(reference_layer_norm(x, (8,), eps=0.0)[0][1]).all()
    assert np.isnan(out[1]).all()
    assert not np.isnan(out[[0, 2]]).any()
    assert_matches_reference(out[[0, 2]], x[[0, 2]], (8,), eps=0.0)


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_torch_eps_zero_constant_row_is_nan(dtype):
    x = eps_zero_constant_row(dtype)
    expected = torch_layer_norm(x, (8,), eps=0.0)
    assert np.isnan(expected[1]).all() and not np.isnan(expected[[0, 2]]).any()


def poisoned_rows(dtype, n, bad, position):
    """(clean input, the same with row 2 holding `bad` at `position`)."""
    x = make_input((4, n), dtype, seed=7)
    col = {"first": 0, "middle": n // 2, "last": n - 1}[position]
    poisoned = x.copy()
    poisoned[2, col] = bad
    return x, poisoned


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [5, 33, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_poisons_only_its_row(dtype, n, bad, position):
    x, poisoned = poisoned_rows(dtype, n, bad, position)
    clean = layernorm.layer_norm(x, (n,))
    out = layernorm.layer_norm(poisoned, (n,))
    assert np.isnan(reference_layer_norm(poisoned, (n,))[0][2]).all()
    assert np.isnan(out[2]).all()
    np.testing.assert_array_equal(out[[0, 1, 3]], clean[[0, 1, 3]])


@requires_torch
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [5, 33, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_torch_non_finite_poisons_its_row(dtype, n, bad, position):
    _, poisoned = poisoned_rows(dtype, n, bad, position)
    assert np.isnan(torch_layer_norm(poisoned, (n,))[2]).all()


def nan_row_stats_input(dtype):
    x = make_input((3, 6), dtype)
    x[0, 3] = np.nan
    return x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_row_stats(dtype):
    x = nan_row_stats_input(dtype)
    _, mean, rstd = layernorm.native_layer_norm(x, (6,), None, None, 1e-5)
    _, ref_mean, ref_rstd, _ = reference_layer_norm(x, (6,))
    np.testing.assert_array_equal(np.isnan(mean), np.isnan(ref_mean))
    np.testing.assert_array_equal(np.isnan(rstd), np.isnan(ref_rstd))
    assert np.isfinite(mean[1:]).all() and np.isfinite(rstd[1:]).all()


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_torch_non_finite_row_stats(dtype):
    x = nan_row_stats_input(dtype)
    _, mean, rstd = layernorm.native_layer_norm(x, (6,), None, None, 1e-5)
    _, t_mean, t_rstd = torch_native_layer_norm(x, (6,))
    assert np.isnan(mean[0]).all() == np.isnan(t_mean[0]).all()
    assert np.isnan(rstd[0]).all() == np.isnan(t_rstd[0]).all()


@pytest.mark.parametrize("shape,ns", [((0, 5), (5,)), ((0, 3, 4), (3, 4)), ((2, 0, 7), (7,))], ids=["0x5", "0x3x4", "2x0x7"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_empty_batch(dtype, shape, ns):
    x = np.zeros(shape, dtype)
    w, b = make_params(ns, param_dtype(dtype), "weight+bias")
    out = layernorm.layer_norm(x, ns, w, b)
    assert out.shape == shape and out.dtype == dtype and out.flags.c_contiguous
    out, mean, rstd = layernorm.native_layer_norm(x, ns, w, b, 1e-5)
    stats_shape = shape[: len(shape) - len(ns)] + (1,) * len(ns)
    assert mean.shape == stats_shape and rstd.shape == stats_shape
    assert mean.dtype == param_dtype(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_zero_length_rows_match_reference(dtype):
    # N == 0: an empty output, mean 0 and rstd NaN (torch's answer, which the reference gives).
    x = np.zeros((3, 0), dtype)
    out, mean, rstd = layernorm.native_layer_norm(x, (0,), None, None, 1e-5)
    _, ref_mean, ref_rstd, _ = reference_layer_norm(x, (0,))
    assert out.shape == (3, 0)
    assert mean.shape == ref_mean.shape == (3, 1)
    np.testing.assert_array_equal(mean, ref_mean.astype(mean.dtype))
    np.testing.assert_array_equal(rstd, ref_rstd.astype(rstd.dtype))


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_zero_length_rows_match_torch(dtype):
    x = np.zeros((3, 0), dtype)
    out, mean, rstd = layernorm.native_layer_norm(x, (0,), None, None, 1e-5)
    _, t_mean, t_rstd = torch_native_layer_norm(x, (0,))
    assert mean.shape == t_mean.shape == (3, 1)
    np.testing.assert_array_equal(mean, t_mean.astype(mean.dtype))
    np.testing.assert_array_equal(rstd, t_rstd.astype(rstd.dtype))


def single_element_rows(dtype, affine):
    """(x, weight, bias, the exact output: bias, or zeros)."""
    x = make_input((6, 1), dtype, seed=8)
    w, b = make_params((1,), param_dtype(dtype), affine)
    expected = np.zeros((6, 1), dtype) if b is None else np.broadcast_to(b.astype(dtype), (6, 1))
    return x, w, b, expected


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_single_element_rows(dtype, affine):
    x, w, b, expected = single_element_rows(dtype, affine)
    np.testing.assert_array_equal(layernorm.layer_norm(x, (1,), w, b), expected)


@requires_torch
@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
def test_torch_single_element_rows(dtype, affine):
    # torch's float16 kernel is not exact here (x*rstd - mean*rstd): float32 and float64 only.
    x, w, b, expected = single_element_rows(dtype, affine)
    np.testing.assert_array_equal(torch_layer_norm(x, (1,), w, b), expected)


# ---------------------------------------------------------------------------
# Parameter dtypes
# ---------------------------------------------------------------------------


def test_float64_input_float32_params_computed_in_float64():
    x = make_input((5, 33), np.float64, seed=9)
    w32, b32 = make_params((33,), np.float32, "weight+bias")
    out = layernorm.layer_norm(x, (33,), w32, b32)
    assert out.dtype == np.float64
    # The float32 params are exact in float64; compute happens in float64 (torch would raise).
    y, _, _, scale = reference_layer_norm(x, (33,), w32.astype(np.float64), b32.astype(np.float64))
    assert_within(out, y, 1e-12 * scale, "float64 input, float32 params")
    _, mean, rstd = layernorm.native_layer_norm(x, (33,), w32, b32, 1e-5)
    assert mean.dtype == np.float64 and rstd.dtype == np.float64


# (input dtype, weight/bias dtype): params are converted to the compute dtype of the input.
PARAM_CONVERSIONS = [
    (np.float32, np.float16),
    (np.float32, np.float64),
    (np.float16, np.float16),
    (np.float16, np.float32),
    (np.float16, np.float64),
    (np.float64, np.float16),
    (np.float64, np.float32),
]


@pytest.mark.parametrize(
    "in_dtype,p_dtype",
    PARAM_CONVERSIONS,
    ids=[f"in-{dtype_id(a)}-params-{dtype_id(b)}" for a, b in PARAM_CONVERSIONS],
)
def test_param_dtypes_converted(in_dtype, p_dtype):
    x = make_input((4, 19), in_dtype, seed=10)
    w, b = make_params((19,), np.float64, "weight+bias")
    w, b = w.astype(p_dtype), b.astype(p_dtype)
    cdt = param_dtype(in_dtype)
    out = layernorm.layer_norm(x, (19,), w, b)
    assert out.dtype == in_dtype
    # Exactly as if the caller had converted them to the compute dtype first.
    np.testing.assert_array_equal(out, layernorm.layer_norm(x, (19,), w.astype(cdt), b.astype(cdt)))
    assert_matches_reference(out, x, (19,), w.astype(cdt), b.astype(cdt))


# Rows longer than one chunk (2048 elements): where the output stays in cache they are
# pipelined (the next row's statistics gathered as this one is normalized), and where it is
# 16 MiB or more they go row by row; a row's bits are the same either way, next to rows that
# the exact path takes (a huge constant row, a NaN) as well.
@pytest.mark.parametrize("n", [2049, 4100, 6147], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_long_rows_same_bits_in_small_and_large_calls(dtype, n, restore_runtime):
    layernorm.set_num_threads(1)
    rows = -(-(16 << 20) // (n * np.dtype(dtype).itemsize))
    x = make_input((rows, n), dtype, seed=n)
    weight, bias = make_params((n,), param_dtype(dtype), "weight+bias")
    for r in (1, rows - 3):
        x[r] = np.finfo(np.float16).max if dtype == np.float16 else 1e30
        x[r + 1, n // 2] = np.nan
    large = layernorm.layer_norm(x, (n,), weight, bias)
    for part in (slice(0, 5), slice(rows - 5, rows)):
        small = layernorm.layer_norm(x[part], (n,), weight, bias)
        np.testing.assert_array_equal(small, large[part])
        assert_matches_reference(small, x[part], (n,), weight, bias)


# A few huge rows (16384 elements and more, fewer than four a thread) go split into chunks.
# Where a row's output leaves its input as it was, the call learns the range of its weight and
# bias as the first row's normalize reads them, and takes that row again by the exact path if
# its rstd is outside what they allow.  The rows' bits are those of the same rows in a call of
# many rows, which learns that range first: a wide row next to one small weight (rstd * w below
# the normal range), a NaN weight or bias, a first span of only subnormal weights (whose own
# range refuses the rstd that the whole row's allows: the row is normalized again), and in
# place, where the range is learnt first.
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("case", ["ordinary", "small-weight", "subnormal-span", "nan-weight", "nan-bias", "in-place"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_few_huge_rows_same_bits_as_many(kind, dtype, case, rows, threads, restore_runtime):
    if case == "nan-bias" and not kind.centred:
        pytest.skip("RMSNorm has no bias")
    layernorm.set_num_threads(threads)
    n = 70000
    x = make_input((8, n), dtype, seed=n, offset=3.0)
    weight, bias = make_params((n,), param_dtype(dtype), "weight+bias")
    bias = bias if kind.centred else None
    x[0, ::2], x[0, 1::2] = 1e4, -1e4  # rstd ~1e-4
    if case == "small-weight":
        weight[n // 3] = 1e-306 if dtype == np.float64 else 1e-36  # normal, but not times 1e-4
    elif case == "subnormal-span":
        # the row's first span of those normalized from its end back, 16384 elements each
        weight[: n % 16384] = 1e-310 if dtype == np.float64 else 1e-40
    elif case == "nan-weight":
        weight[n // 3] = np.nan
    elif case == "nan-bias":
        bias[n // 3] = np.nan
    many = kind.native(x, (n,), weight, bias)
    if case == "in-place":
        few = x[:rows].copy()
        kind.forward(few, (n,), weight, bias, out=few)
        assert same_bits(few, many[0][:rows])
    else:
        few = kind.native(x[:rows], (n,), weight, bias)
        for got, want in zip(few, many):
            assert same_bits(got, want[:rows])


# Rows of 16 to 256 elements go 16 rows at a time, the ends of their statistics in lanes (each
# row's arithmetic as the row route's, a row per lane), the elements past a row's last whole
# group as one group ending at the row's end, computed before the row's stores.  A row's bits
# are the same in every place of a block, alone, in place, and as the output of the fused add
# (whose rows go one at a time), next to a row the exact path takes and a row with a NaN.
@pytest.mark.parametrize("n", [16, 17, 31, 40, 64, 100, 255, 256], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_short_rows_same_bits_in_blocks_alone_and_in_place(kind, dtype, n, restore_runtime):
    layernorm.set_num_threads(1)
    rows = 37  # two blocks of 16 and part of a third
    x = make_input((rows, n), dtype, seed=n, offset=3.0)
    huge = np.finfo(np.float16).max if dtype == np.float16 else 1e30
    x[5, ::2], x[5, 1::2] = huge, -huge  # a std the call's rstd bounds leave to the exact path
    x[20, n // 2] = np.nan
    weight, bias = make_params((n,), param_dtype(dtype), "weight+bias")
    bias = bias if kind.centred else None
    whole = kind.forward(x, n, weight, bias)
    for r in (0, 5, 15, 16, 20, 31, 32, 36):
        assert same_bits(kind.forward(x[r:r + 1], n, weight, bias), whole[r:r + 1]), r
    assert np.isnan(whole[20]).all() and np.isfinite(whole[np.arange(rows) != 20]).all()
    in_place = x.copy()
    kind.forward(in_place, n, weight, bias, out=in_place)
    assert same_bits(in_place, whole)
    fused, total = kind.add(x, np.zeros_like(x), n, weight, bias)
    assert same_bits(total, x)  # x holds no -0.0, which + 0.0 would turn into +0.0
    assert same_bits(fused, whole)


@pytest.mark.parametrize("threads", [1, 2])
def test_results_made_here_large_enough_to_be_faulted_in_first(threads, restore_runtime):
    # 32 MiB: the binding faults in the pages of its own results this large before the kernel
    # writes them; the values are the ones written into an array the caller gives
    layernorm.set_num_threads(threads)
    rng = np.random.default_rng(40)
    x = rng.standard_normal((2048, 4096)).astype(np.float32)
    dy = rng.standard_normal((2048, 4096)).astype(np.float32)
    weight, bias = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    given = np.empty_like(x)
    layernorm.layer_norm(x, (4096,), weight, bias, out=given)
    np.testing.assert_array_equal(layernorm.layer_norm(x, (4096,), weight, bias), given)
    _, mean, rstd = layernorm.native_layer_norm(x, (4096,), weight, bias, 1e-5)
    grad_input = layernorm.layer_norm_backward(dy, x, (4096,), mean, rstd, weight, bias, (True, False, False))[0]
    expected = layernorm.layer_norm_backward(dy[:1024], x[:1024], (4096,), mean[:1024], rstd[:1024], weight, bias,
                                             (True, False, False))[0]
    np.testing.assert_array_equal(grad_input[:1024], expected)
