"""layer_norm_backward on the forward's special rows (issue 2 item 3 carried over to issue 3):
a NaN/Inf row poisons only its own grad_input row, a constant row with eps=0 gives NaN there,
N == 1 gives zero grad_input and grad_weight (to rounding).  torch's kernel (fed the same mean/rstd)
is the oracle for where NaNs appear; the clean rows must not change by a single bit.
"""

import numpy as np
import pytest
import torch

import layernorm
from conftest import FLOAT_DTYPES, dtype_id, make_input, make_params, param_dtype


def backward_case(shape, dtype, seed, eps=1e-5, edit=None):
    n = shape[-1]
    x = make_input(shape, dtype, seed=seed)
    if edit is not None:
        edit(x)
    dy = make_input(shape, dtype, seed=seed + 1)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias", seed=seed + 2)
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, eps)
    return dy, x, mean, rstd, w, b


def torch_backward(dy, x, mean, rstd, w, b):
    up = (lambda a: a.astype(np.float32)) if x.dtype == np.float16 else (lambda a: a)  # torch: same compute dtype
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    out = torch.ops.aten.native_layer_norm_backward(t(up(dy)), t(up(x)), [x.shape[-1]], t(mean), t(rstd),
                                                    t(w), t(b), [True, True, True])
    return [o.numpy() for o in out]


def bw(dy, x, mean, rstd, w, b):
    return layernorm.layer_norm_backward(dy, x, (x.shape[-1],), mean, rstd, w, b)


@pytest.mark.parametrize("position", ["first", "last"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [5, 33, 1031])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_input_poisons_only_its_grad_input_row(dtype, n, bad, position):
    col = 0 if position == "first" else n - 1
    dy, x, mean, rstd, w, b = backward_case((4, n), dtype, seed=n)
    clean = bw(dy, x, mean, rstd, w, b)

    def poison(a):
        a[2, col] = bad

    dy, x, mean, rstd, w, b = backward_case((4, n), dtype, seed=n, edit=poison)
    gi, gw, gb = bw(dy, x, mean, rstd, w, b)
    tgi, tgw, tgb = torch_backward(dy, x, mean, rstd, w, b)
    np.testing.assert_array_equal(np.isnan(gi), np.isnan(tgi))  # the oracle: row 2 only
    assert np.isnan(gi[2]).all()
    np.testing.assert_array_equal(gi[[0, 1, 3]], clean[0][[0, 1, 3]])
    # grad_weight sums dy * xhat over rows: NaN wherever torch's is; grad_bias never sees x.
    np.testing.assert_array_equal(np.isnan(gw), np.isnan(tgw))
    np.testing.assert_array_equal(gb, clean[2])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_eps_zero_constant_row_grad_input_is_nan_there_only(dtype):
    def constant_row(a):
        a[1] = 2.5

    dy, x, mean, rstd, w, b = backward_case((3, 8), dtype, seed=50, eps=0.0, edit=constant_row)
    gi, gw, gb = bw(dy, x, mean, rstd, w, b)
    tgi, tgw, _ = torch_backward(dy, x, mean, rstd, w, b)
    np.testing.assert_array_equal(np.isnan(gi), np.isnan(tgi))
    assert np.isnan(gi[1]).all() and not np.isnan(gi[[0, 2]]).any()
    np.testing.assert_array_equal(np.isnan(gw), np.isnan(tgw))
    assert np.isfinite(gb).all()


# Issue 3's agreement with torch: float64 to ~1e-9, float32 to ~1e-5 relative; float16 results
# are rounded to float16 (half an ulp ~ 5e-4).
RTOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-9}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_single_element_rows_give_zero_grad_input_and_grad_weight(dtype):
    # N == 1: xhat = 0 and g - mean(g) = 0, whatever dy, weight and the row are: the true
    # grad_input and grad_weight are 0.  A kernel may form x * rstd - mean * rstd (torch does)
    # and be off by the rounding of those terms: the tolerance scales with them.
    dy, x, mean, rstd, w, b = backward_case((6, 1), dtype, seed=51)
    gi, gw, gb = bw(dy, x, mean, rstd, w, b)
    rtol = RTOL[np.dtype(dtype)]
    dy64, x64 = dy.astype(np.float64), x.astype(np.float64)
    terms = np.abs(dy64) * (np.abs(x64) + np.abs(mean)) * rstd  # what a kernel rounds, per row
    gi_tol = rtol * float((terms * np.abs(w)).max())
    gw_tol = rtol * float(terms.sum())
    for name, got, tol in (("grad_input", gi, gi_tol), ("grad_weight", gw, gw_tol)):
        assert np.abs(got).max() <= tol, (name, got)
    for name, theirs, tol in zip(("grad_input", "grad_weight"), torch_backward(dy, x, mean, rstd, w, b),
                                 (gi_tol, gw_tol)):
        assert np.abs(theirs).max() <= tol, ("torch " + name, theirs)  # the oracle agrees
    assert gi.dtype == np.dtype(dtype) and gi.shape == (6, 1)
    np.testing.assert_allclose(gb, dy64.sum(axis=0), rtol=rtol)
