"""Accuracy: ours against layernorm._reference, float64 from the very same (upcast) input, and
against torch's error on the same data.  A large common offset is where LayerNorm
implementations lose digits: torch accumulates float32 statistics in float32.
"""

import numpy as np
import pytest

import layernorm
from helpers import f16_ulp, reference_layer_norm, requires_torch, torch_layer_norm

OFFSETS = [0.0, 1e2, 1e3, 1e4]
ROW_LENGTHS = [64, 256, 1024, 4096]
ROWS = 8


def offset_rows(offset, n, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (offset + rng.standard_normal((ROWS, n))).astype(dtype)


def max_abs_error(out, reference):
    return float(np.abs(np.asarray(out, np.float64) - reference).max())


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("offset", OFFSETS, ids=[f"offset{o:g}" for o in OFFSETS])
def test_float32_error_within_1e6_of_float64(offset, n):
    x = offset_rows(offset, n)
    y = reference_layer_norm(x, (n,))[0]
    # The spec's promise: within ~1e-6 of float64 even with an offset of 1e4.
    assert max_abs_error(layernorm.layer_norm(x, (n,)), y) <= 1e-6


@requires_torch
@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("offset", OFFSETS, ids=[f"offset{o:g}" for o in OFFSETS])
def test_float32_more_accurate_than_torch(offset, n):
    x = offset_rows(offset, n)
    y = reference_layer_norm(x, (n,))[0]
    ours = max_abs_error(layernorm.layer_norm(x, (n,)), y)
    theirs = max_abs_error(torch_layer_norm(x, (n,)), y)
    if offset == 0:
        # Without an offset torch is already within a few float32 ulps, and a perfectly
        # rounded result can at best tie with it on the worst element: ours may not be worse.
        assert ours <= theirs
    else:
        assert ours < theirs


@requires_torch
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_torch_error_at_offset_1e4_is_large(n):
    # The gap is real: torch's float32 statistics lose more than 1e-4 at offset 1e4.
    x = offset_rows(1e4, n)
    y = reference_layer_norm(x, (n,))[0]
    assert max_abs_error(torch_layer_norm(x, (n,)), y) > 1e-4


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("offset", [1e3, 1e4], ids=["offset1000", "offset10000"])
def test_naive_one_pass_formula_is_far_off(offset, n):
    # Why two passes (or Welford): var = E[x^2] - E[x]^2 in float32 cancels catastrophically.
    x = offset_rows(offset, n)
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    var = (x * x).mean(axis=-1, keepdims=True, dtype=np.float32) - mean * mean
    with np.errstate(invalid="ignore"):
        naive = (x - mean) / np.sqrt(np.maximum(var, 0) + np.float32(1e-5))
    y = reference_layer_norm(x, (n,))[0]
    naive_err = max_abs_error(naive, y)
    assert not naive_err <= 1e-2  # NaN or huge also count as far off
    assert max_abs_error(layernorm.layer_norm(x, (n,)), y) <= 1e-6


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("offset", OFFSETS, ids=[f"offset{o:g}" for o in OFFSETS])
def test_float32_stats_accuracy(offset, n):
    x = offset_rows(offset, n)
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), None, None, 1e-5)
    _, ref_mean, ref_rstd, _ = reference_layer_norm(x, (n,))
    # float64 internally, rounded once to float32: half an ulp, relative.
    half_ulp = np.finfo(np.float32).eps / 2
    assert (np.abs(mean - ref_mean) <= half_ulp * np.abs(ref_mean) + 1e-30).all()
    assert (np.abs(rstd - ref_rstd) <= half_ulp * np.abs(ref_rstd)).all()


@pytest.mark.parametrize("affine", ["none", "weight+bias"])
@pytest.mark.parametrize("n", [64, 1024, 4096])
@pytest.mark.parametrize("offset", [0.0, 1e2, 1e3], ids=["offset0", "offset100", "offset1000"])
def test_float16_within_one_ulp_of_float64(offset, n, affine):
    x = offset_rows(offset, n, dtype=np.float16, seed=1)
    w = b = None
    if affine == "weight+bias":
        rng = np.random.default_rng(2)
        # Bias in [8, 9] keeps y >= 1 (|xhat * w| < 7): near y = 0 a float16 ulp is smaller
        # than the float32 rounding of |b|, and one ulp would be the wrong yardstick.
        w = (0.5 + rng.random(n)).astype(np.float32)
        b = (8.0 + rng.random(n)).astype(np.float32)
    out = layernorm.layer_norm(x, (n,), w, b)
    assert out.dtype == np.float16
    y = reference_layer_norm(x, (n,), w, b)[0]
    err = np.abs(out.astype(np.float64) - y)
    # One float16 ulp of the output: correct rounding gives half, float32 intermediates
    # (relative error ~1e-7) cannot use up the other half.
    assert (err <= f16_ulp(y)).all(), float((err / f16_ulp(y)).max())


def test_float16_large_values_do_not_overflow():
    # Accumulating in half overflows (sum of 4096 values near 60000); ours accumulates wider.
    rng = np.random.default_rng(3)
    x = (60000 + 100 * rng.standard_normal((4, 4096))).clip(-65504, 65504).astype(np.float16)
    out = layernorm.layer_norm(x, (4096,))
    y = reference_layer_norm(x, (4096,))[0]
    assert np.isfinite(out).all()
    assert (np.abs(out.astype(np.float64) - y) <= f16_ulp(y)).all()


def test_float16_tiny_eps_does_not_underflow():
    # eps=1e-12 underflows to 0 in half; the spec computes float16 in float32 or better.
    x = np.full((2, 16), 3.0, np.float16)
    x[:, 0] = 3.001953125  # one float16 ulp above 3: a tiny but non-zero variance
    out = layernorm.layer_norm(x, (16,), eps=1e-12)
    y = reference_layer_norm(x, (16,), eps=1e-12)[0]
    assert np.isfinite(out).all()
    assert (np.abs(out.astype(np.float64) - y) <= f16_ulp(y)).all()


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("offset", OFFSETS + [1e8], ids=[f"offset{o:g}" for o in OFFSETS + [1e8]])
def test_float64_matches_two_pass_reference(offset, n):
    x = offset_rows(offset, n, dtype=np.float64, seed=4)
    out = layernorm.layer_norm(x, (n,))
    y = reference_layer_norm(x, (n,))[0]
    # The reference itself is a float64 two-pass (error ~ |offset| / std * 1e-16 in xhat):
    # 1e-13 plus that term.
    assert max_abs_error(out, y) <= 1e-13 + 4 * np.finfo(np.float64).eps * offset


@requires_torch
def test_float64_huge_offset_is_not_torchs_problem():
    # float64 torch is accurate too: both agree to 1e-12 at offset 1e4.
    x = offset_rows(1e4, 1024, dtype=np.float64, seed=5)
    np.testing.assert_allclose(layernorm.layer_norm(x, (1024,)), torch_layer_norm(x, (1024,)), rtol=0, atol=1e-11)


def test_float32_values_near_1e30():
    # torch's float32 variance overflows (its output is NaN: test_torch_nan_near_1e30); the
    # float64 statistics of the spec do not: the output is the float64 reference.
    rng = np.random.default_rng(6)
    x = (1e30 * (1 + 0.5 * rng.standard_normal((3, 64)))).astype(np.float32)
    out = layernorm.layer_norm(x, (64,))
    y = reference_layer_norm(x, (64,))[0]
    assert np.isfinite(out).all()
    assert max_abs_error(out, y) <= 1e-6


@requires_torch
def test_torch_nan_near_1e30():
    # What the README says of torch on these rows: its float32 variance overflows, and its
    # output is NaN.
    rng = np.random.default_rng(6)
    x = (1e30 * (1 + 0.5 * rng.standard_normal((3, 64)))).astype(np.float32)
    assert np.isnan(torch_layer_norm(x, (64,))).all()


# ---------------------------------------------------------------------------------------------
# The reference itself at the ends of the float64 range, where plain formulas overflow: rows
# whose exact answers are known
# ---------------------------------------------------------------------------------------------

FMAX = float(np.finfo(np.float64).max)
REFERENCE_EDGE_ROWS = {
    # row: (y, mean, rstd) exactly, eps = 1e-5
    "constant-near-max": ([1.7e308, 1.7e308], [0.0, 0.0], 1.7e308, 1 / np.sqrt(1e-5)),
    "constant-0.1-x10": ([0.1] * 10, [0.0] * 10, 0.1, 1 / np.sqrt(1e-5)),
    "plus-minus-max": ([FMAX, -FMAX], [1.0, -1.0], 0.0, 1 / FMAX),
    "sum-overflows": ([1e308, 1e308, -1e308], [2**-0.5, 2**-0.5, -(2**0.5)], 1e308 / 3, 3 / 8**0.5 / 1e308),
    "squares-overflow": ([1e160, -1e160, 0.0, 0.0], [2**0.5, -(2**0.5), 0.0, 0.0], 0.0, 2**0.5 / 1e160),
}


@pytest.mark.parametrize("kind", list(REFERENCE_EDGE_ROWS))
def test_reference_exact_at_the_ends_of_the_float_range(kind):
    row, y, mean, rstd = REFERENCE_EDGE_ROWS[kind]
    got_y, got_mean, got_rstd, _ = reference_layer_norm(np.array([row]), (len(row),))
    np.testing.assert_allclose(got_y[0], y, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(got_mean.ravel(), [mean], rtol=1e-15)
    np.testing.assert_allclose(got_rstd.ravel(), [rstd], rtol=1e-15)
