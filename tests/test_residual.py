"""add_layer_norm and add_rms_norm, the fused residual add of pre-LN transformers: ``sum`` is
input + residual rounded in the input's dtype, bit for bit what NumPy's ``input + residual``
gives (float16 too, which NumPy rounds through float32), and the output is layer_norm(sum) /
rms_norm(sum) bit for bit, over the same axes; residual_out= and out= in place; the backward
of the fused op (the norm's backward on sum, plus the upstream gradient of sum, for both input
and residual) against torch autograd of the unfused graph.
"""

import functools

import numpy as np
import pytest

import layernorm
from helpers import (
    FLOAT_DTYPES,
    GRAD_TORCH_RTOL,
    KINDS,
    assert_close,
    axes_last,
    bits,
    dtype_id,
    dtype_named,
    empty_at,
    grad_input_scale,
    grad_weight_scale,
    kind_affines,
    make_input,
    make_params,
    nan_pairs,
    param_dtype,
    requires_ml_dtypes,
    requires_torch,
    same_bits,
    torch,
    F,
)
from layernorm import _reference

# (id, input shape, normalized_shape, axis)
CASES = [
    ("4x8", (4, 8), (8,), None),
    ("7x17", (7, 17), (17,), None),
    ("3x4097", (3, 4097), (4097,), None),
    ("2x3x4-ns3x4", (2, 3, 4), (3, 4), None),
    ("1d-9", (9,), (9,), None),
    ("empty-0x5", (0, 5), (5,), None),
    ("512x64", (512, 64), (64,), None),
    ("nchw-axis1", (2, 8, 3, 5), (8,), 1),
    ("nhwc-axis-1", (2, 3, 5, 8), (8,), -1),
    ("3d-axes20", (3, 4, 5), (5, 3), (2, 0)),
]
CASE_IDS = [c[0] for c in CASES]


def case_data(dtype, shape, ns, affine, seed=0):
    """(input, residual, weight, bias)."""
    x = make_input(shape, dtype, seed=seed)
    residual = make_input(shape, dtype, seed=seed + 1, scale=3.0, offset=0.25)
    w, b = make_params(ns, param_dtype(dtype), affine)
    return x, residual, w, b


def destination_keywords(x, residual, residual_out, out):
    """add_*'s residual_out= and out= for destinations named as in DESTINATIONS: "input" and
    "residual" are x and residual themselves (in place), "new" a new array, None the keyword
    left out."""
    arrays = {"input": x, "residual": residual}
    keywords = {}
    for keyword, name in (("residual_out", residual_out), ("out", out)):
        if name is not None:
            keywords[keyword] = arrays[name] if name != "new" else np.empty_like(x)
    return keywords


# ---------------------------------------------------------------------------
# sum and output, bit for bit
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case_id, shape, ns, axis", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind, affine", kind_affines(affines=("weight+bias", "weight", "none")))
def test_sum_and_output_bit_for_bit(kind, affine, dtype, case_id, shape, ns, axis):
    x, residual, w, b = case_data(dtype, shape, ns, affine)
    before = x.copy(), residual.copy()
    out, total = kind.add(x, residual, ns, w, b, axis=axis)
    expected_sum = x + residual
    assert isinstance(total, np.ndarray) and total.dtype == dtype and total.shape == shape
    assert bits(total) == bits(expected_sum)
    assert out.dtype == dtype and out.shape == shape
    assert bits(out) == bits(kind.forward(expected_sum, ns, w, b, axis=axis))
    # new arrays, the arguments untouched
    for result in (out, total):
        assert not np.shares_memory(result, x) and not np.shares_memory(result, residual)
    np.testing.assert_array_equal(x, before[0])
    np.testing.assert_array_equal(residual, before[1])


@pytest.mark.parametrize("eps", [0.0, 1e-3, 0.5], ids=lambda e: f"eps{e:g}")
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_eps_is_the_norms(kind, eps):
    x, residual, w, b = case_data(np.float32, (6, 33), (33,), kind.affines[0], seed=2)
    out, total = kind.add(x, residual, (33,), w, b, eps)
    assert bits(out) == bits(kind.forward(total, (33,), w, b, eps))


# float16 sums that NumPy rounds (through float32) in the ways that matter: ties to even, past the
# largest finite value (inf, then a NaN row), -0.0 + -0.0, subnormals, inf - inf
FLOAT16_ROWS = [
    ([2048.0, 1.0, -2048.0, 3.0], [1.0, 2048.0, -1.0, 2045.0]),
    ([65504.0, 1.0, 2.0, 3.0], [16.0, 0.0, 0.0, 0.0]),
    ([-0.0, 0.0, 1.0, -1.0], [-0.0, -0.0, 2.0**-24, -(2.0**-24)]),
    ([6e-8, 3e-5, 0.5, 0.25], [6e-8, -3e-5, 0.125, 1e-4]),
    ([np.inf, 1.0, 2.0, 3.0], [-np.inf, 1.0, 1.0, 1.0]),
]


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_float16_sum_rounds_as_numpy(kind):
    x = np.array([row for row, _ in FLOAT16_ROWS], np.float16)
    residual = np.array([row for _, row in FLOAT16_ROWS], np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        expected_sum = x + residual
    expected_sum[np.isnan(expected_sum)] = np.nan  # the one quiet NaN, where Inf - Inf gives x86's -NaN
    out, total = kind.add(x, residual, (4,))
    assert bits(total) == bits(expected_sum)
    assert np.isinf(total[1, 0]) and np.isnan(total[4, 0])
    expected = kind.forward(expected_sum, (4,))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out[[1, 4]]).all() and not np.isnan(out[[0, 2, 3]]).any()
    np.testing.assert_array_equal(out[[0, 2, 3]], expected[[0, 2, 3]])


@pytest.mark.parametrize("case", ["rows-of-5", "rows-of-40", "axis0"])
@pytest.mark.parametrize("dtype_name", ["float16", "float32", "float64",
                                        pytest.param("bfloat16", marks=requires_ml_dtypes)])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_a_nan_sum_is_the_one_quiet_nan_at_every_level(kind, dtype_name, case, restore_runtime):
    # which operand's NaN an add returns is up to the compiler and the CPU; the sum's NaNs are
    # the one quiet NaN, its other elements NumPy's bits
    dtype = dtype_named(dtype_name)
    shape, ns, axis = {"rows-of-5": ((40, 5), (5,), None), "rows-of-40": ((9, 40), (40,), None),
                       "axis0": ((24, 7), (24,), 0)}[case]
    x, residual = nan_pairs(dtype, shape)
    with np.errstate(invalid="ignore"):
        numpy_sum = x + residual
    quiet_nan = np.full(shape, np.nan, dtype)
    expected = np.where(np.isnan(numpy_sum), quiet_nan, numpy_sum).astype(dtype)
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        _, total = kind.add(x, residual, ns, axis=axis)
        assert bits(total) == bits(expected), level


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_output_matches_reference_of_the_sum(kind):
    x, residual, w, b = case_data(np.float32, (5, 4, 6), (5, 6), kind.affines[0], seed=3)
    out, total = kind.add(x, residual, (5, 6), w, b, axis=(0, 2))
    expected = kind.reference(x + residual, (5, 6), w, b, axis=(0, 2))[0]
    assert_close(out, expected, 1e-6)


# ---------------------------------------------------------------------------
# Where the results go: residual_out=, out=
# ---------------------------------------------------------------------------

# (residual_out, out): which argument each result is written into, or None for a new array
DESTINATIONS = [
    ("residual", None),  # the residual stream updated in place: h += attention(h)
    ("input", None),
    (None, "input"),
    ("residual", "input"),
    ("input", "residual"),
    ("new", "new"),
]


@pytest.mark.parametrize("residual_out, out", DESTINATIONS, ids=[f"sum-to-{s}-out-to-{o}" for s, o in DESTINATIONS])
@pytest.mark.parametrize("case_id, shape, ns, axis", [CASES[1], CASES[7]], ids=[CASES[1][0], CASES[7][0]])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_results_written_where_asked(kind, case_id, shape, ns, axis, residual_out, out):
    x, residual, w, b = case_data(np.float32, shape, ns, kind.affines[0], seed=4)
    expected_out, expected_sum = kind.add(x.copy(), residual.copy(), ns, w, b, axis=axis)
    keywords = destination_keywords(x, residual, residual_out, out)
    got_out, got_sum = kind.add(x, residual, ns, w, b, axis=axis, **keywords)
    if residual_out is not None:
        assert got_sum is keywords["residual_out"]
    if out is not None:
        assert got_out is keywords["out"]
    assert bits(got_sum) == bits(expected_sum)
    assert bits(got_out) == bits(expected_out)


# Results over 32 MiB, which go to memory by non-temporal stores: rows of 1000 elements (one
# chunk), 4100 (a 4-element last chunk, rows 16-byte aligned), 4099 (rows not 16-byte aligned).
LARGE_DESTINATIONS = [("residual", None), (None, "input"), ("input", "residual"), ("new", "new")]


@functools.lru_cache(maxsize=1)
def large_case(kind, dtype, row_len):
    """(input, residual, weight, bias, expected sum, expected output) of a result just over
    32 MiB, made once for the destinations tried one after another (pytest runs the last
    parameter's cases in a row); read-only, a test writes into copies."""
    rows = (32 << 20) // (row_len * np.dtype(dtype).itemsize) + 3
    x, residual, w, b = case_data(dtype, (rows, row_len), (row_len,), kind.affines[0], seed=12)
    expected_sum = x + residual
    expected_out = kind.forward(expected_sum, (row_len,), w, b)
    arrays = (x, residual, w, b, expected_sum, expected_out)
    for array in arrays:
        if array is not None:
            array.flags.writeable = False
    return arrays


@pytest.mark.parametrize("residual_out, out", LARGE_DESTINATIONS,
                         ids=[f"sum-to-{s}-out-to-{o}" for s, o in LARGE_DESTINATIONS])
@pytest.mark.parametrize("row_len", [1000, 4100, 4099])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_large_results_written_where_asked(kind, dtype, row_len, residual_out, out):
    x, residual, w, b, expected_sum, expected_out = large_case(kind, dtype, row_len)
    x, residual = x.copy(), residual.copy()
    keywords = destination_keywords(x, residual, residual_out, out)
    got_out, got_sum = kind.add(x, residual, (row_len,), w, b, **keywords)
    assert same_bits(got_sum, expected_sum)
    assert same_bits(got_out, expected_out)


@pytest.mark.parametrize("offset", [16, 8, 0], ids=lambda offset: f"{offset}-past-a-line")
@pytest.mark.parametrize("row_len", [768, 4100])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_large_results_into_arrays_off_a_line(kind, dtype, row_len, offset):
    # out= and residual_out= of 32 MiB and more whose rows start 16 bytes past a cache line (as
    # NumPy's arrays do) or 8 bytes past one: the output by ordinary stores up to a line and in
    # whole lines after it, the sum in 16-byte pieces from its first element (8 bytes past a
    # line, through the cache); at a line both in whole lines: the same bits every way
    x, residual, w, b, expected_sum, expected_out = large_case(kind, dtype, row_len)
    out, total = empty_at(x.shape, dtype, offset), empty_at(x.shape, dtype, offset)
    kind.add(x, residual, (row_len,), w, b, out=out, residual_out=total)
    assert same_bits(total, expected_sum)
    assert same_bits(out, expected_out)


# Page offsets of (input, residual, sum, output), the sum "input" or "residual" for residual_out=
# that array itself: sum or output 16 to 256 bytes above input or residual in a 4 KiB page, where
# a store would hold up the loads of input and residual that follow it, so that the fused pass
# forms a row's sum in a buffer of its own as well (rows of 1 to 16 KiB) and computes the output
# from there; a sum so placed is stored from the buffer, groups behind the loads.
ABOVE_THE_INPUTS = {
    "sum-48-above": (16, 16, 64, 2064),
    "output-48-above": (16, 16, 2064, 64),
    "both-above-the-residual": (16, 1040, 1056, 1280),
    "sum-in-place-output-32-above": (16, 2064, "input", 48),
    "sum-in-place-of-input-48-above-residual": (64, 16, "input", 2064),
    "sum-in-place-of-residual-48-above-input": (16, 64, "residual", 2064),
}
# (size, row length): rows of 300 elements (float16: 600 bytes, not buffered), 1000, 2088 (a last
# chunk of 40, fewer than the groups that sum's stores trail by) and 4100 (16-bit: a last chunk
# of 4; float32: over 16 KiB, not buffered), in 5 rows, every SIMD level; 1024 and 2088 in
# results over 32 MiB, whose sum and output stream, at the default level.
ABOVE_SIZES = [("cached", 300), ("cached", 1000), ("cached", 2088), ("cached", 4100),
               ("streamed", 1024), ("streamed", 2088)]


@pytest.mark.parametrize("placement", list(ABOVE_THE_INPUTS))
@pytest.mark.parametrize("size, row_len", ABOVE_SIZES, ids=[f"{s}-{n}" for s, n in ABOVE_SIZES])
@pytest.mark.parametrize("dtype_name", ["float16", "float32", "float64",
                                        pytest.param("bfloat16", marks=requires_ml_dtypes)])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_sum_and_output_just_above_the_inputs(kind, dtype_name, size, row_len, placement, restore_runtime):
    dtype = dtype_named(dtype_name)
    if size == "streamed":
        x_made, residual_made, w, b, expected_sum, expected_out = large_case(kind, dtype, row_len)
        levels = [layernorm.simd_level()]
    else:
        x_made, residual_made, w, b = case_data(dtype, (5, row_len), (row_len,), kind.affines[0], seed=13)
        x_made[1, 7] = np.inf  # a row of the float64 reference's (ln_forward_exact_row), from sum
        expected_sum = x_made + residual_made
        expected_out = kind.forward(expected_sum, (row_len,), w, b)
        levels = layernorm.available_simd_levels()
    x_offset, residual_offset, sum_offset, out_offset = ABOVE_THE_INPUTS[placement]
    x, residual = empty_at(x_made.shape, dtype, x_offset, 4096), empty_at(x_made.shape, dtype, residual_offset, 4096)
    out = empty_at(x.shape, dtype, out_offset, 4096)
    total = {"input": x, "residual": residual}.get(sum_offset)
    total = empty_at(x.shape, dtype, sum_offset, 4096) if total is None else total
    for level in levels:
        layernorm.set_simd_level(level)
        x[...], residual[...] = x_made, residual_made
        kind.add(x, residual, (row_len,), w, b, out=out, residual_out=total)
        assert same_bits(total, expected_sum), level
        assert same_bits(out, expected_out), level
        if total is not residual:
            assert same_bits(residual, residual_made), level


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_residual_out_strided(kind):
    # a sum written into a view (every other row of a larger buffer)
    x, residual, w, b = case_data(np.float64, (6, 17), (17,), kind.affines[0], seed=5)
    buffer = np.zeros((12, 17))
    out, total = kind.add(x, residual, (17,), w, b, residual_out=buffer[::2])
    assert np.shares_memory(total, buffer)
    assert bits(buffer[::2]) == bits(x + residual)
    np.testing.assert_array_equal(buffer[1::2], 0.0)
    assert bits(out) == bits(kind.forward(x + residual, (17,), w, b))


# out and residual_out in one buffer, sharing no element: (buffer shape, out's part, residual_out's part)
SHARED_BUFFERS = {
    "column-halves": ((6, 34), np.s_[:, :17], np.s_[:, 17:]),
    "alternate-rows": ((12, 17), np.s_[::2], np.s_[1::2]),
    "alternate-elements": ((6, 34), np.s_[:, ::2], np.s_[:, 1::2]),
}


@pytest.mark.parametrize("layout", list(SHARED_BUFFERS))
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_and_residual_out_may_share_a_buffer(kind, layout):
    buffer_shape, out_part, sum_part = SHARED_BUFFERS[layout]
    x, residual, w, b = case_data(np.float32, (6, 17), (17,), kind.affines[0], seed=6)
    buffer = np.zeros(buffer_shape, np.float32)
    out, total = kind.add(x, residual, (17,), w, b, out=buffer[out_part], residual_out=buffer[sum_part])
    assert bits(buffer[sum_part]) == bits(x + residual)
    assert bits(buffer[out_part]) == bits(kind.forward(x + residual, (17,), w, b))


# Two float32 views of one byte buffer, (byte offset, byte strides) each, shaped (12, 26, 19):
# their extents overlap, no element of one shares a byte with the other or with itself, and
# np.shares_memory gives up on them within its budget of 100000 steps (it needs 800000).
HARD_TO_SEPARATE = ((0, (14318, 2882, 16827)), (2562, (10722, 5392, 15185)))


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_and_residual_out_in_one_buffer_with_hard_strides(kind):
    x, residual, w, b = case_data(np.float32, (12, 26, 19), (19,), kind.affines[0], seed=6)
    raw = np.zeros(540_000, np.uint8)
    out, sum_ = (
        np.lib.stride_tricks.as_strided(raw[offset : offset + 4].view(np.float32), x.shape, strides)
        for offset, strides in HARD_TO_SEPARATE
    )
    with pytest.raises(getattr(np, "exceptions", np).TooHardError):  # (numpy.exceptions: NumPy 1.25)
        np.shares_memory(out, sum_, max_work=100_000)
    kind.add(x, residual, (19,), w, b, out=out, residual_out=sum_)
    assert bits(sum_) == bits(x + residual)
    assert bits(out) == bits(kind.forward(x + residual, (19,), w, b))


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_overlapping_residual_out_is_refused(kind):
    x, residual, w, b = case_data(np.float32, (6, 17), (17,), kind.affines[0], seed=6)
    buffer = np.zeros((6, 20), np.float32)
    with pytest.raises(ValueError, match="^out and residual_out overlap: the output would overwrite the sum$"):
        kind.add(x, residual, (17,), w, b, out=buffer[:, :17], residual_out=buffer[:, 3:])
    np.testing.assert_array_equal(buffer, 0.0)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_fortran_input_fortran_output(kind):
    x, residual, w, b = case_data(np.float32, (2, 8, 3, 5), (8,), kind.affines[0], seed=6)
    x, residual = np.asfortranarray(x), np.asfortranarray(residual)
    out, total = kind.add(x, residual, (8,), w, b, axis=1)
    assert out.flags.f_contiguous
    assert bits(total) == bits(x + residual)


@requires_torch
@pytest.mark.parametrize("which", ["input", "residual", "both"])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_torch_tensors_read_as_arrays(kind, which):
    x, residual, w, b = case_data(np.float32, (4, 8), (8,), kind.affines[0], seed=7)
    expected = kind.add(x, residual, (8,), w, b)
    xt = torch.from_numpy(x.copy()) if which in ("input", "both") else x
    rt = torch.from_numpy(residual.copy()) if which in ("residual", "both") else residual
    for got, want in zip(kind.add(xt, rt, (8,), w, b), expected):
        assert isinstance(got, np.ndarray) and bits(got) == bits(want)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_keywords_accepted(kind):
    x, residual, w, b = case_data(np.float64, (3, 7), (7,), kind.affines[0], seed=8)
    fn = getattr(layernorm, "add_" + kind.name)
    params = {"weight": w, "bias": b} if kind.centred else {"weight": w}
    by_keyword = fn(input=x, residual=residual, normalized_shape=7, eps=1e-3, axis=None, out=None,
                    residual_out=None, **params)
    for got, want in zip(by_keyword, kind.add(x, residual, (7,), w, b, 1e-3)):
        assert bits(got) == bits(want)


# ---------------------------------------------------------------------------
# Backward through the fused op, against torch autograd of x + r -> norm
# ---------------------------------------------------------------------------



def torch_unfused_grads(kind, x, residual, dy, dsum, ns, w, b, eps, axis):
    """torch autograd of loss = sum(norm(x + r) * dy) + sum((x + r) * dsum): the gradients of x,
    r, weight and bias (None where there is none)."""
    axes = _reference.normalized_axes(x.ndim, ns, axis)
    leaves = [None if a is None else torch.from_numpy(a.copy()).requires_grad_(True) for a in (x, residual, w, b)]
    xt, rt, wt, bt = leaves
    total = xt + rt
    if kind.centred:
        y = F.layer_norm(axes_last(total, axes), list(ns), wt, bt, eps)
    else:
        y = F.rms_norm(axes_last(total, axes), list(ns), wt, eps)
    loss = (y * axes_last(torch.from_numpy(dy), axes)).sum() + (total * torch.from_numpy(dsum)).sum()
    loss.backward()
    return tuple(None if t is None else t.grad.numpy() for t in leaves)


@requires_torch
@pytest.mark.parametrize("case_id, shape, ns, axis", [c for c in CASES if c[0] != "3x4097"],
                         ids=[c[0] for c in CASES if c[0] != "3x4097"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
@pytest.mark.parametrize("kind, affine", kind_affines(affines=("weight+bias", "none")))
def test_backward_through_the_fused_op_matches_torch_autograd(kind, affine, dtype, case_id, shape, ns, axis):
    x, residual, w, b = case_data(dtype, shape, ns, affine, seed=9)
    dy = make_input(shape, dtype, seed=10)
    dsum = make_input(shape, dtype, seed=11)  # the gradient the residual stream brings back
    _, total = kind.add(x, residual, ns, w, b, axis=axis)
    stats = kind.native(total, ns, w, b, axis=axis)[1:]
    grad_norm, grad_w, grad_b = kind.backward(dy, total, ns, stats, w, b, axis=axis)
    grad_x = grad_r = grad_norm + dsum
    expected = torch_unfused_grads(kind, x, residual, dy, dsum, ns, w, b, kind.eps_value(x), axis)
    rtol = GRAD_TORCH_RTOL[np.dtype(dtype)]
    eps = kind.eps_value(x)
    gi_scale = max(grad_input_scale(dy, total, ns, w, eps, centred=kind.centred, axis=axis),
                   float(np.abs(dsum).max(initial=0.0)))
    gw_scale = grad_weight_scale(dy, total, ns, eps, centred=kind.centred, axis=axis)
    for name, mine, theirs, scale in zip(("input", "residual", "weight", "bias"), (grad_x, grad_r, grad_w, grad_b),
                                         expected, (gi_scale, gi_scale, gw_scale, 1.0)):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, theirs, rtol, f"grad of {name}", scale)
