"""rms_norm, native_rms_norm and rms_norm_backward values against layernorm._reference (the
truth) and torch (the oracle: F.rms_norm, aten._fused_rms_norm, autograd through F.rms_norm):
dtype x shape x weight, eps=None (torch's rule), out=, output_mask, and the rows that are special
(all zeros, NaN/Inf, empty, N == 1).

Every test id names its case: dtype, input shape, normalized_shape, eps, weight.
"""

import itertools

import numpy as np
import pytest

import layernorm
from helpers import (
    BF16,
    FLOAT_DTYPES,
    GRAD_REFERENCE_RTOL,
    GRAD_TORCH_RTOL,
    HALF_DTYPES,
    REF_REL_TOL,
    TORCH_REL_TOL,
    assert_close,
    assert_matches_reference,
    assert_matches_torch,
    assert_within,
    check_output_array,
    dtype_id,
    dtype_named,
    grad_input_scale,
    grad_weight_scale,
    make_backward_data,
    make_input,
    make_params,
    param_dtype,
    reference_norm,
    requires_torch,
    shape_id,
    stats_shape,
    to_torch,
    torch,
    torch_autograd,
    torch_norm,
)
from layernorm import _reference

# (input shape, normalized_shape, eps); None is torch's default, the machine epsilon
CASES = [
    ((5,), (5,), None),  # 1-D input, a single row
    ((3, 1), (1,), None),  # N == 1
    ((7, 17), (17,), None),  # odd row length (SIMD tails)
    ((3, 4097), (4097,), 1e-6),  # odd, long row
    ((2, 3, 4), (4,), 1e-5),
    ((0, 5), (5,), None),  # empty batch
    ((2, 3, 5, 5), (3, 5, 5), None),  # multi-dim normalized_shape
    # torch's OpInfo sample inputs for nn.functional.rms_norm
    ((1, 2, 3), (1, 2, 3), 0.5),
    ((2, 2, 3), (2, 3), -0.5),
    ((1,), (1,), None),
    ((1, 2), (2,), None),
    ((0, 1), (1,), None),
    # torch's ModuleInfo inputs for nn.RMSNorm
    ((4, 5, 5), (5,), 1e-3),
    ((128, 5, 5), (5,), 1e-3),
    ((4, 2, 2, 5), (2, 2, 5), 1e-3),
]
WEIGHTS = ("weight", "none")


def case_id(case):
    shape, ns, eps = case
    return f"in{shape_id(shape)}-ns{shape_id(ns)}-eps{'None' if eps is None else f'{eps:g}'}"


def case_data(dtype, case, weighted):
    """(x, normalized_shape, weight, eps) of one CASES entry; rows whose mean square stays above
    0.5, so that eps=-0.5 keeps them finite."""
    shape, ns, eps = case
    weight, _ = make_params(ns, param_dtype(dtype), "weight" if weighted == "weight" else "none")
    return make_input(shape, dtype, offset=1.0), ns, weight, eps


# ---------------------------------------------------------------------------
# dtype x shape x weight
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", WEIGHTS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_rms_norm_matches_reference(dtype, case, weighted):
    x, ns, weight, eps = case_data(dtype, case, weighted)
    out = layernorm.rms_norm(x, ns, weight, eps)
    check_output_array(out, x, dtype)
    assert out.shape == x.shape
    assert_matches_reference(out, x, ns, weight, None, eps, centred=False)


@pytest.mark.parametrize("weighted", WEIGHTS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_native_rms_norm_matches_reference(dtype, case, weighted):
    x, ns, weight, eps = case_data(dtype, case, weighted)
    out, rstd = layernorm.native_rms_norm(x, ns, weight, eps)
    check_output_array(out, x, dtype)
    assert isinstance(rstd, np.ndarray)
    assert rstd.shape == stats_shape(x.shape, range(x.ndim - len(ns), x.ndim))
    assert rstd.dtype == param_dtype(dtype)
    # one kernel: the output of rms_norm, bit for bit
    np.testing.assert_array_equal(out, layernorm.rms_norm(x, ns, weight, eps))
    assert_matches_reference(out, x, ns, weight, None, eps, centred=False)
    ref_eps = _reference.rms_norm_default_eps(dtype) if eps is None else eps
    ref_rstd = _reference.rms_norm(x, ns, weight, ref_eps)[1]
    # statistics in float64, rounded once to the param dtype
    stat_tol = 1e-12 if rstd.dtype == np.float64 else float(np.finfo(np.float32).eps)
    assert_within(rstd, ref_rstd, stat_tol * np.abs(ref_rstd) + 1e-300, "rstd vs reference")


@requires_torch
@pytest.mark.parametrize("weighted", WEIGHTS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_rms_norm_matches_torch(dtype, case, weighted):
    x, ns, weight, eps = case_data(dtype, case, weighted)
    out, rstd = layernorm.native_rms_norm(x, ns, weight, eps)
    t_out, t_rstd = torch_norm(x, ns, weight, None, eps, centred=False)
    assert t_rstd.shape == rstd.shape and t_rstd.dtype == rstd.dtype
    _, scale = reference_norm(x, ns, weight, None, eps, centred=False)
    assert_matches_torch(out, t_out, scale)
    # torch accumulates float32 statistics in float32: a few float32 ulps
    rel = TORCH_REL_TOL[np.dtype(rstd.dtype)]
    assert_within(rstd, t_rstd, rel * np.abs(t_rstd.astype(np.float64)) + 1e-300, "rstd vs torch")


@requires_torch
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # float16 input, float32 weight
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_rms_norm_matches_torch_functional(dtype, case):
    # F.rms_norm, the functional form torch code calls (eps=None included)
    x, ns, weight, eps = case_data(dtype, case, "weight")
    expected = torch.nn.functional.rms_norm(to_torch(x), list(ns), to_torch(weight, param_dtype(dtype)), eps)
    _, scale = reference_norm(x, ns, weight, None, eps, centred=False)
    assert_matches_torch(layernorm.rms_norm(x, ns, weight, eps), expected.numpy(), scale)


# ---------------------------------------------------------------------------
# eps=None: the machine epsilon of the compute type, as torch
# ---------------------------------------------------------------------------

# A row of zeros has rstd = 1 / sqrt(eps) exactly, whatever else the kernel does: it shows eps.
DEFAULT_EPS = {np.float16: np.finfo(np.float32).eps, np.float32: np.finfo(np.float32).eps,
               np.float64: np.finfo(np.float64).eps}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_eps_none_is_the_compute_types_machine_epsilon(dtype):
    x = np.zeros((2, 8), dtype)
    _, rstd = layernorm.native_rms_norm(x, (8,))
    expected = 1 / np.sqrt(np.float64(DEFAULT_EPS[dtype]))
    assert rstd.dtype == param_dtype(dtype)
    np.testing.assert_allclose(rstd, np.full((2, 1), expected), rtol=float(np.finfo(rstd.dtype).eps))
    # spelled out, and as None, it is the same number
    np.testing.assert_array_equal(layernorm.native_rms_norm(x, (8,), None, None)[1], rstd)
    np.testing.assert_array_equal(layernorm.native_rms_norm(x, (8,), None, float(DEFAULT_EPS[dtype]))[1], rstd)


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_eps_none_like_torch(dtype):
    x = np.zeros((2, 8), dtype)
    _, rstd = layernorm.native_rms_norm(x, (8,))
    _, t_rstd = torch_norm(x, (8,), eps=None, centred=False)
    np.testing.assert_allclose(rstd, t_rstd, rtol=2 * float(np.finfo(rstd.dtype).eps))  # torch's in float32


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_eps_none_changes_small_rows(dtype):
    # rows of mean square 1e-7: eps=None (1.2e-7, or 2.2e-16 for float64) is not eps=1e-5
    x = np.full((3, 16), np.sqrt(1e-7), dtype)
    x[:, ::2] *= -1
    out = layernorm.rms_norm(x, (16,))
    assert_matches_reference(out, x, (16,), None, None, None, centred=False)
    assert not np.allclose(out, layernorm.rms_norm(x, (16,), eps=1e-5), rtol=1e-2)


# ---------------------------------------------------------------------------
# spellings, out=
# ---------------------------------------------------------------------------


def test_keywords_accepted():
    x = make_input((3, 7), np.float64)
    w, _ = make_params((7,), np.float64, "weight")
    np.testing.assert_array_equal(layernorm.rms_norm(input=x, normalized_shape=(7,), weight=w, eps=1e-3),
                                  layernorm.rms_norm(x, (7,), w, 1e-3))
    np.testing.assert_array_equal(layernorm.native_rms_norm(input=x, normalized_shape=7, weight=w, eps=1e-3)[0],
                                  layernorm.rms_norm(x, [7], w, 1e-3))


@pytest.mark.parametrize("ns", [7, np.int64(7), (7,), [7], np.array([7])],
                         ids=["int", "np.int64", "tuple", "list", "ndarray"])
def test_normalized_shape_spellings(ns):
    x = make_input((3, 7), np.float32)
    np.testing.assert_array_equal(layernorm.rms_norm(x, ns), layernorm.rms_norm(x, (7,)))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_out_written_and_returned(dtype):
    x = make_input((6, 17), dtype, seed=5)
    w, _ = make_params((17,), param_dtype(dtype), "weight")
    expected = layernorm.rms_norm(x, (17,), w)
    out = np.full(x.shape, np.nan, dtype)
    assert layernorm.rms_norm(x, (17,), w, out=out) is out
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("shape", [(6, 17), (512, 64), (64, 4097)], ids=shape_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_out_is_input_in_place(dtype, shape):
    x = make_input(shape, dtype, seed=6)
    expected = layernorm.rms_norm(x, shape[-1:])
    assert layernorm.rms_norm(x, shape[-1:], out=x) is x
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("entry", ["rms_norm", "native_rms_norm"])
def test_input_not_mutated(entry):
    x = make_input((5, 33), np.float32, seed=7)
    w, _ = make_params((33,), np.float32, "weight")
    before_x, before_w = x.copy(), w.copy()
    getattr(layernorm, entry)(x, (33,), w)
    np.testing.assert_array_equal(x, before_x)
    np.testing.assert_array_equal(w, before_w)


# ---------------------------------------------------------------------------
# Special rows
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 64, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_zero_row_gives_zeros(dtype, n):
    x = make_input((3, n), dtype)
    x[1] = 0
    w, _ = make_params((n,), param_dtype(dtype), "weight")
    out = layernorm.rms_norm(x, (n,), w)
    np.testing.assert_array_equal(out[1], np.zeros(n, dtype))
    assert_matches_reference(out, x, (n,), w, None, None, centred=False)


# RMSNorm's output is the product x * rstd * weight, whose sign a zero keeps: each route to it
ZERO_SIGN_ROUTES = {
    "rows": lambda x, n, w: layernorm.rms_norm(x, (n,), w),
    "axis": lambda x, n, w: layernorm.rms_norm(np.ascontiguousarray(x.T), (n,), w, axis=0).T,
    "fused-add": lambda x, n, w: layernorm.add_rms_norm(x, np.full_like(x, -0.0), (n,), w)[0],
}


@pytest.mark.parametrize("route", list(ZERO_SIGN_ROUTES))
@pytest.mark.parametrize("weighted", [False, True], ids=["no-weight", "weight"])
@pytest.mark.parametrize("n", [3, 40, 4097])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"] + HALF_DTYPES)
def test_zeros_keep_their_sign(dtype_name, n, weighted, route):
    dtype = dtype_named(dtype_name)
    x = make_input((20, n), np.float32, seed=5).astype(dtype)
    x[:, ::3] = -0.0
    x[:, 1::3] = 0.0
    x[1] = -0.0  # a row of zeros alone: rstd is 1 / sqrt(eps)
    w = None
    if weighted:
        w = np.where(np.arange(n) % 2 == 0, 1.0, -1.0).astype(param_dtype(dtype))
        w[n // 2] = -0.0
    out = ZERO_SIGN_ROUTES[route](x, n, w)
    product = x.astype(np.float64) * (1.0 if w is None else w.astype(np.float64))
    np.testing.assert_array_equal(np.signbit(out), np.signbit(product))
    if torch is not None and dtype != BF16:
        theirs = torch.nn.functional.rms_norm(to_torch(x), (n,), None if w is None else to_torch(w, dtype))
        np.testing.assert_array_equal(np.signbit(out), np.signbit(theirs.float().numpy()))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_eps_zero_zero_row_is_nan(dtype):
    x = make_input((3, 8), dtype)
    x[1] = 0
    out = layernorm.rms_norm(x, (8,), eps=0.0)
    assert np.isnan(reference_norm(x, (8,), eps=0.0, centred=False)[0][1]).all()
    assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2]]).any()


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_torch_eps_zero_zero_row_is_nan(dtype):
    x = make_input((3, 8), dtype)
    x[1] = 0
    out = torch_norm(x, (8,), eps=0.0, centred=False)[0]
    assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2]]).any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [5, 33, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_poisons_only_its_row(dtype, n, bad):
    x = make_input((4, n), dtype, seed=7)
    clean = layernorm.rms_norm(x, (n,))
    x[2, n // 2] = bad
    out = layernorm.rms_norm(x, (n,))
    assert np.isnan(out[2]).all()
    np.testing.assert_array_equal(out[[0, 1, 3]], clean[[0, 1, 3]])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_constant_row_is_its_sign(dtype):
    # x / sqrt(x**2 + eps) = +-1 up to eps / x**2 (below a float16 ulp for |x| = 300)
    x = np.full((2, 9), 300.0, dtype)
    x[1] = -300.0
    out = layernorm.rms_norm(x, (9,), eps=1e-6)
    np.testing.assert_allclose(out, np.sign(x.astype(np.float64)), rtol=REF_REL_TOL[np.dtype(dtype)] + 1e-9)


@pytest.mark.parametrize("shape,ns", [((0, 5), (5,)), ((0, 3, 4), (3, 4)), ((2, 0, 7), (7,))],
                         ids=["0x5", "0x3x4", "2x0x7"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_empty_batch(dtype, shape, ns):
    x = np.zeros(shape, dtype)
    w, _ = make_params(ns, param_dtype(dtype), "weight")
    out, rstd = layernorm.native_rms_norm(x, ns, w)
    assert out.shape == shape and out.dtype == dtype
    assert rstd.shape == stats_shape(shape, range(len(shape) - len(ns), len(shape)))
    assert rstd.dtype == param_dtype(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_zero_length_rows_match_reference(dtype):
    # N == 0: an empty output and rstd NaN (the reference's answer, as for LayerNorm)
    x = np.zeros((3, 0), dtype)
    out, rstd = layernorm.native_rms_norm(x, (0,))
    assert out.shape == (3, 0)
    np.testing.assert_array_equal(rstd, _reference.rms_norm(x, (0,))[1].astype(rstd.dtype))


# ---------------------------------------------------------------------------
# Parameter dtypes
# ---------------------------------------------------------------------------

PARAM_CONVERSIONS = [(np.float32, np.float16), (np.float32, np.float64), (np.float16, np.float32),
                     (np.float16, np.float64), (np.float64, np.float32)]


@pytest.mark.parametrize("in_dtype,p_dtype", PARAM_CONVERSIONS,
                         ids=[f"in-{dtype_id(a)}-weight-{dtype_id(b)}" for a, b in PARAM_CONVERSIONS])
def test_weight_dtype_converted(in_dtype, p_dtype):
    # as for layer_norm: the weight converted to the param dtype first
    x = make_input((4, 19), in_dtype, seed=10)
    w = make_params((19,), np.float64, "weight")[0].astype(p_dtype)
    out = layernorm.rms_norm(x, (19,), w)
    assert out.dtype == in_dtype
    np.testing.assert_array_equal(out, layernorm.rms_norm(x, (19,), w.astype(param_dtype(in_dtype))))


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


BACKWARD_SHAPES = [
    ("4x8", (4, 8), (8,)),
    ("3x17", (3, 17), (17,)),
    ("2x3x4_ns3x4", (2, 3, 4), (3, 4)),
    ("N1_5x1", (5, 1), (1,)),
    ("empty_0x6", (0, 6), (6,)),
    ("1d_7", (7,), (7,)),
    ("37x33", (37, 33), (33,)),  # groups of 16 short rows and a remainder
    ("odd_5x4097", (5, 4097), (4097,)),
]


def backward_case(shape, ns, dtype, weighted, seed):
    """(x, dy, weight, rstd) with rstd from native_rms_norm (eps=None)."""
    x, dy, w, _ = make_backward_data(shape, ns, dtype, "weight" if weighted == "weight" else "none", seed)
    return x, dy, w, layernorm.native_rms_norm(x, ns, w)[1]


def assert_rms_gradients_close(got, expected, dy, x, ns, w, rtol, what):
    """(grad_input, grad_weight) against `expected`, each relative to the size of its terms."""
    eps = _reference.rms_norm_default_eps(x.dtype)
    scales = (grad_input_scale(dy, x, ns, w, eps, centred=False), grad_weight_scale(dy, x, ns, eps, centred=False))
    for name, mine, theirs, scale in zip(("grad_input", "grad_weight"), got, expected, scales):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, theirs, rtol, f"{name} vs {what}", scale)


@pytest.mark.parametrize("weighted", WEIGHTS)
@pytest.mark.parametrize("case_id, shape, ns", BACKWARD_SHAPES, ids=[s[0] for s in BACKWARD_SHAPES])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_matches_reference(dtype, case_id, shape, ns, weighted):
    x, dy, w, rstd = backward_case(shape, ns, dtype, weighted, seed=2)
    got = layernorm.rms_norm_backward(dy, x, ns, rstd, w)
    assert len(got) == 2
    assert got[0].dtype == np.dtype(dtype) and got[0].shape == x.shape
    if w is None:
        assert got[1] is None
    else:
        assert got[1].dtype == param_dtype(dtype) and got[1].shape == ns
    expected = _reference.rms_norm_backward(dy, x, ns, w)
    assert_rms_gradients_close(got, (expected[0], None if w is None else expected[1]), dy, x, ns, w,
                               GRAD_REFERENCE_RTOL[np.dtype(dtype)], "float64")


@requires_torch
@pytest.mark.parametrize("weighted", WEIGHTS)
@pytest.mark.parametrize("case_id, shape, ns", BACKWARD_SHAPES, ids=[s[0] for s in BACKWARD_SHAPES])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_backward_matches_torch_autograd(dtype, case_id, shape, ns, weighted):
    # torch 2.13 has no CPU kernel for aten._fused_rms_norm_backward: autograd through F.rms_norm
    x, dy, w, rstd = backward_case(shape, ns, dtype, weighted, seed=3)
    got = layernorm.rms_norm_backward(dy, x, ns, rstd, w)
    expected = torch_autograd(dy, x, ns, w, None, None, centred=False)[:2]
    assert_rms_gradients_close(got, expected, dy, x, ns, w, GRAD_TORCH_RTOL[np.dtype(dtype)], "autograd")


@requires_torch
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)], ids=["TT", "TF", "FT"])
def test_backward_matches_torch_fused_rms_norm_backward(mask):
    # torch's own kernel for the same rstd, where torch has one for the CPU (not in 2.13)
    x, dy, w, rstd = backward_case((6, 17), (17,), "float64", "weight", seed=4)
    try:
        theirs = torch.ops.aten._fused_rms_norm_backward(to_torch(dy), to_torch(x), [17], to_torch(rstd), to_torch(w),
                                                         list(mask))
    except NotImplementedError:
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for aten._fused_rms_norm_backward")
    got = layernorm.rms_norm_backward(dy, x, (17,), rstd, w, mask)
    for name, mine, their in zip(("grad_input", "grad_weight"), got, theirs):
        if their is None:
            assert mine is None, name
        else:
            assert_close(mine, their.numpy(), 1e-12, name)


def test_backward_keyword_arguments_and_int_normalized_shape():
    x, dy, w, rstd = backward_case((4, 8), (8,), "float64", "weight", seed=5)
    by_kw = layernorm.rms_norm_backward(grad_output=dy, input=x, normalized_shape=8, rstd=rstd, weight=w,
                                        output_mask=(True, True))
    for mine, positional in zip(by_kw, layernorm.rms_norm_backward(dy, x, (8,), rstd, w)):
        np.testing.assert_array_equal(mine, positional)


MASKS = list(itertools.product([True, False], repeat=2))


@pytest.mark.parametrize("mask", MASKS, ids=["".join("T" if m else "F" for m in k) for k in MASKS])
def test_output_mask_gives_none_entries(mask):
    x, dy, w, rstd = backward_case((4, 8), (8,), "float64", "weight", seed=7)
    got = layernorm.rms_norm_backward(dy, x, (8,), rstd, w, output_mask=mask)
    full = layernorm.rms_norm_backward(dy, x, (8,), rstd, w)
    assert len(got) == 2
    for name, wanted, mine, all_of_them in zip(("grad_input", "grad_weight"), mask, got, full):
        if wanted:
            np.testing.assert_array_equal(mine, all_of_them, err_msg=name)
        else:
            assert mine is None, name


def test_missing_weight_gives_none_even_when_mask_true():
    x, dy, w, rstd = backward_case((4, 8), (8,), "float32", "none", seed=8)
    assert layernorm.rms_norm_backward(dy, x, (8,), rstd, None, (True, True))[1] is None


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_empty_batch_gives_empty_grad_input_and_zero_grad_weight(dtype):
    x, dy, w, rstd = backward_case((0, 6), (6,), dtype, "weight", seed=9)
    gi, gw = layernorm.rms_norm_backward(dy, x, (6,), rstd, w)
    assert gi.shape == (0, 6) and gi.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(gw, np.zeros(6))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_inputs_not_mutated(dtype):
    x, dy, w, rstd = backward_case((5, 33), (33,), dtype, "weight", seed=10)
    before = [a.copy() for a in (x, dy, w, rstd)]
    layernorm.rms_norm_backward(dy, x, (33,), rstd, w)
    for a, b in zip((x, dy, w, rstd), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("wrt", ["input", "weight"])
def test_finite_difference_gradient(wrt):
    rng = np.random.default_rng(11)
    args = {"input": rng.standard_normal((3, 5)), "weight": 1 + 0.5 * rng.standard_normal(5)}
    g = rng.standard_normal((3, 5))  # loss = sum(y * g), so dL/dy = g
    rstd = layernorm.native_rms_norm(args["input"], (5,), args["weight"], 1e-5)[1]
    got = dict(zip(("input", "weight"), layernorm.rms_norm_backward(g, args["input"], (5,), rstd, args["weight"])))
    numeric = np.zeros_like(args[wrt])
    h = 1e-6
    for idx in np.ndindex(numeric.shape):
        losses = []
        for step in (h, -h):
            bumped = {k: v.copy() for k, v in args.items()}
            bumped[wrt][idx] += step
            losses.append(np.sum(_reference.rms_norm(bumped["input"], (5,), bumped["weight"], 1e-5)[0] * g))
        numeric[idx] = (losses[0] - losses[1]) / (2 * h)
    np.testing.assert_allclose(got[wrt], numeric, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_input_poisons_only_its_grad_input_row(dtype, bad):
    x, dy, w, _ = make_backward_data((4, 33), (33,), dtype, "weight", seed=12)
    clean = layernorm.rms_norm_backward(dy, x, (33,), layernorm.native_rms_norm(x, (33,), w)[1], w)[0]
    x[2, 5] = bad
    gi, gw = layernorm.rms_norm_backward(dy, x, (33,), layernorm.native_rms_norm(x, (33,), w)[1], w)
    assert np.isnan(gi[2]).all()
    np.testing.assert_array_equal(gi[[0, 1, 3]], clean[[0, 1, 3]])
    assert np.isnan(gw).any()
