"""layer_norm_backward values: against layernorm._reference (the truth), torch's backward
kernel fed the same mean and rstd, torch autograd of F.layer_norm, and central finite
differences; output_mask, empty batches, and the rows that are special (NaN/Inf, eps=0, N == 1).
"""

import numpy as np
import pytest

import layernorm
from helpers import (
    AFFINES,
    FLOAT_DTYPES,
    GRAD_REFERENCE_RTOL,
    GRAD_TORCH_RTOL,
    HALF_DTYPES,
    KINDS,
    assert_close,
    backward_args,
    call_backward,
    dtype_id,
    dtype_named,
    grad_input_scale,
    grad_weight_scale,
    make_backward_data,
    param_dtype,
    reference_backward,
    reference_output,
    requires_torch,
    same_bits,
    to_torch,
    torch,
    torch_autograd,
    torch_native_backward,
)

EPS = 1e-5


def stats(x, normalized_shape, w, b):
    """(mean, rstd) as native_layer_norm returns them."""
    _, mean, rstd = layernorm.native_layer_norm(x, normalized_shape, w, b, EPS)
    return mean, rstd


SHAPES = [
    ("4x8", (4, 8), (8,)),
    ("3x17", (3, 17), (17,)),
    ("2x3x4_ns3x4", (2, 3, 4), (3, 4)),
    ("2x3x5x5_ns3x5x5", (2, 3, 5, 5), (3, 5, 5)),
    ("N1_5x1", (5, 1), (1,)),
    ("empty_0x6", (0, 6), (6,)),
    ("1d_7", (7,), (7,)),
    ("odd_5x4097", (5, 4097), (4097,)),
]
SHAPE_IDS = [s[0] for s in SHAPES]


# ---------------------------------------------------------------------------------------------
# dtype x shape x affine against torch and the reference
# ---------------------------------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case_id, shape, ns", SHAPES, ids=SHAPE_IDS)
def test_backward_matches_torch_native(case_id, shape, ns, affine, dtype):
    x, dy, w, b = make_backward_data(shape, ns, dtype, affine, seed=1)
    mean, rstd = stats(x, ns, w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
    tgi, tgw, tgb = torch_native_backward(dy, x, ns, mean, rstd, w, b)
    rtol = GRAD_TORCH_RTOL[np.dtype(dtype)]
    assert_close(gi, tgi, rtol, "grad_input", scale=grad_input_scale(dy, x, ns, w))
    assert gi.dtype == np.dtype(dtype)
    gw_scale = grad_weight_scale(dy, x, ns)
    for name, mine, theirs, scale in (("grad_weight", gw, tgw, gw_scale), ("grad_bias", gb, tgb, 1.0)):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, theirs, rtol, name, scale)


def assert_gradients_close(got, expected, dy, x, ns, w, rtol, what):
    """(grad_input, grad_weight, grad_bias) against `expected`, each relative to the size of its
    terms; None where the expected gradient is None."""
    scales = (grad_input_scale(dy, x, ns, w), grad_weight_scale(dy, x, ns), 1.0)
    for name, mine, theirs, scale in zip(("grad_input", "grad_weight", "grad_bias"), got, expected, scales):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, theirs, rtol, f"{name} vs {what}", scale)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case_id, shape, ns", SHAPES, ids=SHAPE_IDS)
def test_backward_matches_reference(case_id, shape, ns, affine, dtype):
    x, dy, w, b = make_backward_data(shape, ns, dtype, affine, seed=2)
    mean, rstd = stats(x, ns, w, b)
    got = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
    expected = reference_backward(dy, x, ns, w, b)
    assert_gradients_close(got, expected, dy, x, ns, w, GRAD_REFERENCE_RTOL[np.dtype(dtype)], "float64")


@requires_torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case_id, shape, ns", SHAPES, ids=SHAPE_IDS)
def test_backward_matches_torch_autograd(case_id, shape, ns, affine, dtype):
    x, dy, w, b = make_backward_data(shape, ns, dtype, affine, seed=2)
    mean, rstd = stats(x, ns, w, b)
    got = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
    expected = torch_autograd(dy, x, ns, w, b)
    assert_gradients_close(got, expected, dy, x, ns, w, GRAD_TORCH_RTOL[np.dtype(dtype)], "autograd")


@requires_torch
@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("case_id, shape, ns", SHAPES, ids=SHAPE_IDS)
def test_backward_float16_matches_torch_in_float32(case_id, shape, ns, affine):
    x, dy, w, b = make_backward_data(shape, ns, "float16", affine, seed=3)
    mean, rstd = stats(x, ns, w, b)
    assert mean.dtype == np.float32 and rstd.dtype == np.float32
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
    tgi, tgw, tgb = torch_native_backward(dy, x, ns, mean, rstd, w, b)
    assert gi.dtype == np.float16
    assert_close(gi, tgi, 2e-3, "grad_input", grad_input_scale(dy, x, ns, w))  # rounding to float16 (half an ulp ~ 5e-4)
    gw_scale = grad_weight_scale(dy, x, ns)
    for name, mine, theirs, scale in (("grad_weight", gw, tgw, gw_scale), ("grad_bias", gb, tgb, 1.0)):
        if theirs is None:
            assert mine is None, name
        else:
            assert mine.dtype == np.float32, name
            assert_close(mine, theirs, 1e-5, name, scale)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_backward_output_dtypes_and_shapes(dtype):
    x, dy, w, b = make_backward_data((3, 2, 4), (2, 4), dtype, "weight+bias", seed=4)
    mean, rstd = stats(x, (2, 4), w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, (2, 4), mean, rstd, w, b)
    assert gi.dtype == np.dtype(dtype) and gi.shape == (3, 2, 4)
    assert gw.dtype == param_dtype(dtype) and gw.shape == (2, 4)
    assert gb.dtype == param_dtype(dtype) and gb.shape == (2, 4)


def test_backward_keyword_arguments_and_int_normalized_shape():
    x, dy, w, b = make_backward_data((4, 8), (8,), "float64", "weight+bias", seed=5)
    mean, rstd = stats(x, (8,), w, b)
    by_kw = layernorm.layer_norm_backward(dy, x, 8, mean, rstd, weight=w, bias=b,
                                          output_mask=(True, True, True))
    ref = reference_backward(dy, x, (8,), w, b)
    for mine, truth in zip(by_kw, ref):
        assert_close(mine, truth, 1e-9)


# ---------------------------------------------------------------------------------------------
# output_mask, missing parameters, empty batch
# ---------------------------------------------------------------------------------------------

MASKS = [(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)]


def masked_case():
    x, dy, w, b = make_backward_data((4, 8), (8,), "float64", "weight+bias", seed=7)
    mean, rstd = stats(x, (8,), w, b)
    return dy, x, mean, rstd, w, b


@pytest.mark.parametrize("mask", MASKS, ids=["".join("T" if m else "F" for m in k) for k in MASKS])
def test_output_mask_gives_none_entries(mask):
    dy, x, mean, rstd, w, b = masked_case()
    got = layernorm.layer_norm_backward(dy, x, (8,), mean, rstd, w, b, output_mask=mask)
    full = layernorm.layer_norm_backward(dy, x, (8,), mean, rstd, w, b)
    assert len(got) == 3
    for name, wanted, mine, all_of_them in zip(("grad_input", "grad_weight", "grad_bias"), mask, got, full):
        if not wanted:
            assert mine is None, name
        else:
            np.testing.assert_array_equal(mine, all_of_them, err_msg=name)


@pytest.mark.parametrize("route", ["short-rows", "rows", "huge-rows", "axis", "axis-ordinary"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", MASKS[1:], ids=["".join("T" if m else "F" for m in k) for k in MASKS[1:]])
def test_output_mask_keeps_the_bits_of_what_it_returns(mask, dtype, route):
    """Whatever output_mask leaves out (pass 1 is skipped when grad_bias alone is asked for),
    what it returns has the bits of the full call, rows that take the float64 path included
    (the first: tiny values, eps 0; but for axis-ordinary, whose tile of rows takes the
    strided route's float32 path)."""
    n = {"short-rows": 5, "rows": 40, "huge-rows": 70000, "axis": 40, "axis-ordinary": 40}[route]
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((3, n)), rng.standard_normal((3, n))
    if route != "axis-ordinary":
        x[0] *= 1e-30 if dtype == np.float32 else 1e-150
        dy[0] *= 1e-20 if dtype == np.float32 else 1e-170
    x, dy = x.astype(dtype), dy.astype(dtype)
    w, b = rng.uniform(0.5, 2.0, n).astype(dtype), rng.standard_normal(n).astype(dtype)
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 0.0)
    if route.startswith("axis"):
        args, kwargs = (dy.T.copy(), x.T.copy(), (n,), mean.T.copy(), rstd.T.copy(), w, b), {"axis": 0}
    else:
        args, kwargs = (dy, x, (n,), mean, rstd, w, b), {}
    full = layernorm.layer_norm_backward(*args, **kwargs)
    got = layernorm.layer_norm_backward(*args, output_mask=mask, **kwargs)
    for name, wanted, mine, all_of_them in zip(("grad_input", "grad_weight", "grad_bias"), mask, got, full):
        assert (mine is None) != wanted, name
        assert mine is None or mine.tobytes() == all_of_them.tobytes(), name


# float16/bfloat16 calls whose x and dy take 16 MiB or more go through backward in groups of 4
# rows, pass 1 reading ahead of itself or pass 2 asking for the next group's lines (short rows),
# where a call of one row does neither.  A row's gradient has the bits it has as the only row
# of a call, next to a row the float64 path takes (with the tiny weight, dy * weight below what
# float32 products carry) and rows with a NaN; without the NaN rows, the parameter gradients are
# those of the call without grad_input.
@pytest.mark.parametrize("weight_scale", [1.0, 1e-25], ids=["weight", "tiny-weight"])
@pytest.mark.parametrize("n", [16, 773, 4096, 16384], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_half_rows_same_bits_alone_and_in_groups(name, kind, n, weight_scale, restore_runtime):
    dtype = dtype_named(name)
    layernorm.set_num_threads(1)
    rows = (16 << 20) // (4 * n) + 3  # x and dy just over 16 MiB
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((rows, n), dtype=np.float32) * 2 + 0.5).astype(dtype)
    dy = rng.standard_normal((rows, n), dtype=np.float32).astype(dtype)
    dy[2] = 6e-8
    weight = (weight_scale * rng.uniform(0.5, 2.0, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if kind.centred else None
    f32 = np.finfo(np.float32)
    assert (np.abs(dy[2].astype(np.float32) * weight).max() < f32.tiny / f32.eps) == (weight_scale < 1)

    nan_rows = [6, rows - 2]
    x[nan_rows, [n // 2, 0]] = np.nan
    _, *stats = kind.native(x, n, weight, bias, EPS)
    grads = kind.backward(dy, x, n, stats, weight, bias)
    for r in [*range(12), *range(rows - 6, rows)]:
        alone = kind.backward(dy[r:r + 1], x[r:r + 1], n, [s[r:r + 1] for s in stats], weight, bias)
        assert same_bits(alone[0], grads[0][r:r + 1]), r
    assert np.isnan(grads[0][nan_rows]).all()
    assert np.isfinite(grads[0][:6].astype(np.float32)).all()

    x[nan_rows, [n // 2, 0]] = 1.0
    _, *stats = kind.native(x, n, weight, bias, EPS)
    grads = kind.backward(dy, x, n, stats, weight, bias)
    assert np.isfinite(grads[1]).all()
    params_alone = kind.backward(dy, x, n, stats, weight, bias, output_mask=(False, True, True))[1:]
    for mine, full in zip(params_alone, grads[1:]):
        assert (mine is None and full is None) or same_bits(mine, full)


# Once a row's factors are known, pass 2 is elementwise, so a column's grad_input has the same
# bits wherever it sits in the row: in a whole group of 16 or among the columns past the last
# one, which go as one part group.  The columns from 32 on repeat columns 0 .. tail of x, dy and
# the weight.  Rows with a zero dy give zeros whose signs show the operations.
@pytest.mark.parametrize("tail", [1, 4, 12, 15], ids=lambda t: f"tail{t}")
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", ["float32", *HALF_DTYPES])
def test_grad_input_bits_same_in_whole_groups_and_past_them(name, kind, tail):
    dtype = dtype_named(name)
    n = 32 + tail
    rng = np.random.default_rng(tail)
    x = rng.standard_normal((8, n)).astype(dtype)
    dy = rng.standard_normal((8, n)).astype(dtype)
    weight = rng.standard_normal(n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if kind.centred else None
    dy[:2] = 0
    for array in (x, dy, weight):
        array[..., 32:] = array[..., :tail]
    _, *stats = kind.native(x, n, weight, bias, EPS)
    grad_input = kind.backward(dy, x, n, stats, weight, bias)[0]
    assert same_bits(grad_input[:, 32:], grad_input[:, :tail])


# The elements past a row's last whole group are read by each level its own way (masked
# loads, 16-bit pairs with an odd last element put in its lane, a buffer); every count of them
# gives every level's bits, forward and backward, the last element a NaN in one row.
@pytest.mark.parametrize("tail", range(1, 16), ids=lambda t: f"tail{t}")
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", ["float32", "float64", *HALF_DTYPES])
def test_every_count_past_the_last_group_gives_every_levels_bits(name, kind, tail, restore_runtime):
    dtype = dtype_named(name)
    n = 32 + tail
    rng = np.random.default_rng(100 + tail)
    x = (rng.standard_normal((9, n)) * 3 + 1).astype(dtype)
    dy = rng.standard_normal((9, n)).astype(dtype)
    x[4, -1] = np.nan
    weight = rng.standard_normal(n).astype(param_dtype(dtype))
    bias = rng.standard_normal(n).astype(param_dtype(dtype)) if kind.centred else None
    layernorm.set_num_threads(1)
    results = {}
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        y, *stats = kind.native(x, n, weight, bias, EPS)
        results[level] = [y, *stats, *kind.backward(dy, x, n, stats, weight, bias)]
    first = results[layernorm.available_simd_levels()[0]]
    for level, arrays in results.items():
        for i, (a, b) in enumerate(zip(first, arrays)):
            assert (a is None and b is None) or same_bits(a, b), (level, i)
    assert np.isnan(results[level][0][4].astype(np.float64)).all()


@requires_torch
@pytest.mark.parametrize("mask", MASKS, ids=["".join("T" if m else "F" for m in k) for k in MASKS])
def test_output_mask_matches_torch(mask):
    dy, x, mean, rstd, w, b = masked_case()
    got = layernorm.layer_norm_backward(dy, x, (8,), mean, rstd, w, b, output_mask=mask)
    theirs = torch.ops.aten.native_layer_norm_backward(to_torch(dy), to_torch(x), [8], to_torch(mean),
                                                       to_torch(rstd), to_torch(w), to_torch(b), list(mask))
    for name, wanted, mine, ref in zip(("grad_input", "grad_weight", "grad_bias"), mask, got, theirs):
        if not wanted:
            assert mine is None and ref is None, name
        else:
            assert_close(mine, ref.numpy(), 1e-9, name)


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_missing_param_gives_none_even_when_mask_true(affine):
    x, dy, w, b = make_backward_data((4, 8), (8,), "float32", affine, seed=8)
    mean, rstd = stats(x, (8,), w, b)
    _, gw, gb = layernorm.layer_norm_backward(dy, x, (8,), mean, rstd, w, b, output_mask=(True,) * 3)
    assert (gw is None) == (w is None)
    assert (gb is None) == (b is None)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_empty_batch_gives_empty_grad_input_and_zero_param_grads(dtype):
    x, dy, w, b = make_backward_data((0, 6), (6,), dtype, "weight+bias", seed=9)
    mean, rstd = stats(x, (6,), w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, (6,), mean, rstd, w, b)
    assert gi.shape == (0, 6) and gi.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(gw, np.zeros(6))
    np.testing.assert_array_equal(gb, np.zeros(6))
    assert gw.shape == (6,) and gb.shape == (6,)


def test_empty_batch_multi_dim():
    x, dy, w, b = make_backward_data((2, 0, 3, 4), (3, 4), "float32", "weight+bias", seed=10)
    mean, rstd = stats(x, (3, 4), w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, (3, 4), mean, rstd, w, b)
    assert gi.shape == (2, 0, 3, 4)
    np.testing.assert_array_equal(gw, np.zeros((3, 4)))
    np.testing.assert_array_equal(gb, np.zeros((3, 4)))


# ---------------------------------------------------------------------------------------------
# finite differences (float64)
# ---------------------------------------------------------------------------------------------

def fd_setup():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 5))
    w = 1 + 0.5 * rng.standard_normal(5)
    b = rng.standard_normal(5)
    g = rng.standard_normal((3, 5))  # loss = sum(y * g), so dL/dy = g
    return x, w, b, g


@pytest.mark.parametrize("wrt", ["input", "weight", "bias"])
def test_finite_difference_gradient(wrt):
    x, w, b, g = fd_setup()
    mean, rstd = stats(x, (5,), w, b)
    got = dict(zip(("input", "weight", "bias"), layernorm.layer_norm_backward(g, x, (5,), mean, rstd, w, b)))
    args = {"input": x, "weight": w, "bias": b}
    var = args[wrt]
    numeric = np.zeros_like(var)
    h = 1e-6
    for idx in np.ndindex(var.shape):
        vals = []
        for step in (h, -h):
            bumped = {k: v.copy() for k, v in args.items()}
            bumped[wrt][idx] += step
            vals.append(np.sum(reference_output(bumped["input"], (5,), bumped["weight"], bumped["bias"]) * g))
        numeric[idx] = (vals[0] - vals[1]) / (2 * h)
    np.testing.assert_allclose(got[wrt], numeric, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Special rows: a NaN/Inf row poisons only its own grad_input row, a constant row with eps=0
# gives NaN there, N == 1 gives zero grad_input and grad_weight (to rounding).  torch's kernel
# (fed the same mean/rstd) is the oracle for where NaNs appear; clean rows keep every bit.
# ---------------------------------------------------------------------------------------------

def poisoned_args(dtype, n, bad, position):
    col = 0 if position == "first" else n - 1

    def poison(a):
        a[2, col] = bad

    return backward_args((4, n), dtype, seed=n, edit=poison)


@pytest.mark.parametrize("position", ["first", "last"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [5, 33, 1031])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_finite_input_poisons_only_its_grad_input_row(dtype, n, bad, position):
    clean = call_backward(backward_args((4, n), dtype, seed=n))
    args = poisoned_args(dtype, n, bad, position)
    gi, gw, gb = call_backward(args)
    rgi, rgw, _ = reference_backward(args.grad_output, args.input, (n,), args.weight, args.bias)
    np.testing.assert_array_equal(np.isnan(gi), np.isnan(rgi))  # row 2 only
    assert np.isnan(gi[2]).all()
    np.testing.assert_array_equal(gi[[0, 1, 3]], clean[0][[0, 1, 3]])
    # grad_weight sums dy * xhat over rows: NaN wherever the reference's is; grad_bias never sees x.
    np.testing.assert_array_equal(np.isnan(gw), np.isnan(rgw))
    np.testing.assert_array_equal(gb, clean[2])


@requires_torch
@pytest.mark.parametrize("position", ["first", "last"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [5, 33, 1031])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_torch_non_finite_input_poisons_the_same_gradients(dtype, n, bad, position):
    args = poisoned_args(dtype, n, bad, position)
    gi, gw, _ = call_backward(args)
    tgi, tgw, _ = torch_native_backward(*args[:2], (n,), *args[2:])
    np.testing.assert_array_equal(np.isnan(gi), np.isnan(tgi))
    np.testing.assert_array_equal(np.isnan(gw), np.isnan(tgw))


def eps_zero_args(dtype):
    def constant_row(a):
        a[1] = 2.5

    return backward_args((3, 8), dtype, seed=50, eps=0.0, edit=constant_row)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_eps_zero_constant_row_grad_input_is_nan_there_only(dtype):
    args = eps_zero_args(dtype)
    gi, gw, gb = call_backward(args)
    rgi, rgw, _ = reference_backward(args.grad_output, args.input, (8,), args.weight, args.bias, eps=0.0)
    np.testing.assert_array_equal(np.isnan(gi), np.isnan(rgi))
    assert np.isnan(gi[1]).all() and not np.isnan(gi[[0, 2]]).any()
    np.testing.assert_array_equal(np.isnan(gw), np.isnan(rgw))
    assert np.isfinite(gb).all()


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_torch_eps_zero_constant_row_gives_the_same_nans(dtype):
    args = eps_zero_args(dtype)
    gi, gw, _ = call_backward(args)
    tgi, tgw, _ = torch_native_backward(*args[:2], (8,), *args[2:])
    np.testing.assert_array_equal(np.isnan(gi), np.isnan(tgi))
    np.testing.assert_array_equal(np.isnan(gw), np.isnan(tgw))


def single_element_tolerances(args, dtype):
    """(grad_input, grad_weight) tolerances: the rounding of x * rstd - mean * rstd, which a
    kernel may form (torch does), scaled by what multiplies it."""
    dy, x, mean, rstd, w, _ = args
    rtol = GRAD_REFERENCE_RTOL[np.dtype(dtype)]
    terms = np.abs(dy.astype(np.float64)) * (np.abs(x.astype(np.float64)) + np.abs(mean)) * rstd
    return rtol * float((terms * np.abs(w)).max()), rtol * float(terms.sum())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_single_element_rows_give_zero_grad_input_and_grad_weight(dtype):
    # N == 1: xhat = 0 and g - mean(g) = 0, whatever dy, weight and the row are: the true
    # grad_input and grad_weight are 0, up to the rounding of the terms a kernel forms.
    args = backward_args((6, 1), dtype, seed=51)
    gi, gw, gb = call_backward(args)
    for name, got, tol in zip(("grad_input", "grad_weight"), (gi, gw), single_element_tolerances(args, dtype)):
        assert np.abs(got).max() <= tol, (name, got)
    assert gi.dtype == np.dtype(dtype) and gi.shape == (6, 1)
    np.testing.assert_allclose(gb, args.grad_output.astype(np.float64).sum(axis=0),
                               rtol=GRAD_REFERENCE_RTOL[np.dtype(dtype)])


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_torch_single_element_rows_give_zero_grad_input_and_grad_weight(dtype):
    # The oracle agrees to the same tolerance.
    args = backward_args((6, 1), dtype, seed=51)
    theirs = torch_native_backward(*args[:2], (1,), *args[2:])
    for name, their, tol in zip(("grad_input", "grad_weight"), theirs, single_element_tolerances(args, dtype)):
        assert np.abs(their).max() <= tol, ("torch " + name, their)


# ---------------------------------------------------------------------------------------------
# The module's private route: training_forward saves (input, stats bytes), saved_backward reads them
# ---------------------------------------------------------------------------------------------

def test_saved_backward_matches_layer_norm_backward():
    from layernorm._layernorm import saved_backward, training_forward
    x = np.random.default_rng(5).standard_normal((6, 9)).astype(np.float32)
    dy = np.random.default_rng(6).standard_normal((6, 9)).astype(np.float32)
    w, b = np.linspace(0.5, 2, 9, dtype=np.float32), np.zeros(9, np.float32)
    input_copy, saved_stats = training_forward(x, (9,), w, b, 1e-5)[1]
    assert isinstance(saved_stats, bytes) and len(saved_stats) == (2 * 6 + 2 * 9) * 4
    _, mean, rstd = layernorm.native_layer_norm(x, (9,), w, b)
    # the statistics of every row, then the parameters as the kernel read them
    np.testing.assert_array_equal(np.frombuffer(saved_stats, np.float32),
                                  np.concatenate([mean.ravel(), rstd.ravel(), w, b]))
    got = saved_backward(dy, input_copy, saved_stats, (9,), w, b)
    want = layernorm.layer_norm_backward(dy, x, (9,), mean, rstd, w, b)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("layout", ["rows", "channels_first"])
def test_large_grad_input_starts_a_cache_line_and_keeps_its_layout(layout):
    # the binding places a grad_input the kernel streams at a cache line, in the layout and
    # with the values of any other
    rng = np.random.default_rng(41)
    shape, ns, axis = ((300, 4096), (4096,), None) if layout == "rows" else ((4, 64, 64, 64), (64,), 1)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal(ns).astype(np.float32)
    _, mean, rstd = layernorm.native_layer_norm(x, ns, weight, None, 1e-5, axis=axis)
    grad_input = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, weight, None, (True, False, False),
                                               axis=axis)[0]
    assert grad_input.ctypes.data % 64 == 0
    assert grad_input.strides == np.empty_like(x).strides
    half = shape[0] // 2
    expected = layernorm.layer_norm_backward(dy[:half], x[:half], ns, mean[:half], rstd[:half], weight, None,
                                             (True, False, False), axis=axis)[0]
    np.testing.assert_array_equal(grad_input[:half], expected)


@pytest.mark.parametrize("dtype_name", HALF_DTYPES)
def test_half_weights_get_float32_gradients_from_the_functions_and_their_own_from_modules(dtype_name):
    # a deliberate difference: torch returns the weight's dtype from its backward kernel
    dtype = dtype_named(dtype_name)
    x = np.random.default_rng(50).standard_normal((3, 8)).astype(dtype)
    w = b = np.ones(8, dtype)
    _, mean, rstd = layernorm.native_layer_norm(x, 8, w, b)
    grads = layernorm.layer_norm_backward(x, x, 8, mean, rstd, w, b)
    assert [g.dtype for g in grads] == [dtype, np.float32, np.float32]
    _, rms_rstd = layernorm.native_rms_norm(x, 8, w)
    assert [g.dtype for g in layernorm.rms_norm_backward(x, x, 8, rms_rstd, w)] == [dtype, np.float32]
    module = layernorm.LayerNorm(8, dtype=dtype)
    module(x)
    module.backward(x)
    assert module.weight_grad.dtype == dtype and module.bias_grad.dtype == dtype
    if torch is not None:
        tx, tw = (torch.from_numpy(a.astype(np.float32)).to(getattr(torch, dtype_name)) for a in (x, w))
        _, their_mean, their_rstd = torch.ops.aten.native_layer_norm(tx, [8], tw, tw, 1e-5)
        theirs = torch.ops.aten.native_layer_norm_backward(tx, tx, [8], their_mean, their_rstd, tw, tw, [True] * 3)
        assert [g.dtype for g in theirs] == [tx.dtype] * 3
