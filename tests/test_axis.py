"""axis=: every function of the family normalizing over any axes of any layout, against
layernorm._reference (the truth) and torch's permute route (the oracle: move the axes to the end,
normalize, move them back).

axis is an int or a tuple of ints (negatives allowed); normalized_shape lists the sizes of those
axes in the order given, and element j of a row is their multi-index in that order, to which
weight[j] belongs.  Statistics have the input's shape with size 1 on the normalized axes.  The
output has the input's shape and memory order: a C-contiguous input gives a C-contiguous output,
a Fortran-ordered one a Fortran-ordered output, gradients likewise.
"""

import numpy as np
import pytest

import layernorm

from helpers import (
    FLOAT_DTYPES,
    GRAD_REFERENCE_RTOL,
    GRAD_TORCH_RTOL,
    KINDS,
    LAYER_NORM,
    RMS_NORM,
    assert_close,
    assert_matches_reference,
    assert_matches_torch,
    assert_within,
    axes_back,
    axes_last,
    dtype_id,
    dtype_named,
    empty_at,
    grad_input_scale,
    grad_weight_scale,
    kind_affines,
    layout,
    make_backward_data,
    make_input,
    make_params,
    param_dtype,
    requires_ml_dtypes,
    requires_torch,
    same_bits,
    shape_id,
    stats_shape,
    torch_autograd,
    torch,
    torch_norm,
    torch_scale,
)
from layernorm import _reference

# (id, input shape, axis, normalized_shape)
AXIS_CASES = [
    ("nchw-axis1", (2, 8, 3, 5), 1, (8,)),  # channels-first: ConvNeXt's LayerNorm
    ("nchw-axis1-tuple", (2, 8, 3, 5), (1,), (8,)),
    ("nchw-axis-3", (2, 8, 3, 5), -3, (8,)),
    ("nhwc-axis-1", (2, 3, 5, 8), -1, (8,)),
    ("3d-axes12", (3, 4, 5), (1, 2), (4, 5)),
    ("3d-axes21", (3, 4, 5), (2, 1), (5, 4)),  # out of order: weight is (5, 4)
    ("3d-axes02", (3, 4, 5), (0, 2), (3, 5)),
    ("3d-axes20", (3, 4, 5), (2, 0), (5, 3)),
    ("4d-axes-3-1", (2, 3, 4, 5), (-3, -1), (3, 5)),
    ("3d-all-axes", (3, 4, 5), (0, 1, 2), (3, 4, 5)),
    ("2d-axis0", (17, 6), 0, (17,)),  # columns
    ("1d-axis0", (9,), 0, (9,)),
    ("empty-batch", (0, 4, 3), 1, (4,)),
    ("long-strided-rows", (2, 40, 3), 1, (40,)),  # rows longer than a tile of 16
    ("many-strided-rows", (2, 16, 9, 9), 1, (16,)),  # 162 rows: tiles of 16 and a remainder
    ("nchw-tile-runs", (2, 8, 13, 11), 1, (8,)),  # 143 rows an image: a run of 8 whole tiles
]
CASE_IDS = [c[0] for c in AXIS_CASES]
FOUR_D = [c for c in AXIS_CASES if len(c[1]) == 4]

# Layouts of the input: helpers.LAYOUTS, and the normalized axes innermost in memory (the
# contiguous route of a norm over other axes, e.g. NHWC memory viewed as NCHW)
AXIS_LAYOUTS = ["C", "fortran", "transposed", "step_sliced", "negative_strides", "column_slice",
                "byte_swapped", "unaligned", "read_only", "list", "torch_tensor", "normalized_innermost"]


def resolved_axes(shape, ns, axis):
    return _reference.normalized_axes(len(shape), ns, axis)


def lay_out(name, base, ns, axis):
    """`base` laid out as `name` (AXIS_LAYOUTS)."""
    if name == "normalized_innermost":
        axes = resolved_axes(base.shape, ns, axis)
        made = axes_back(np.ascontiguousarray(axes_last(base, axes)), axes)
        np.testing.assert_array_equal(made, base)
        return made
    return layout(name, base)


def case_data(dtype, shape, ns, affine, seed=0):
    """(x, weight, bias): rows whose mean square is well above eps (RMSNorm too)."""
    weight, bias = make_params(ns, param_dtype(dtype), affine)
    return make_input(shape, dtype, seed=seed, offset=0.5), weight, bias


def check_memory_order(result, x):
    """The result follows the input's memory order: C in, C out; Fortran in, Fortran out."""
    assert isinstance(result, np.ndarray) and result.flags.writeable
    if isinstance(x, np.ndarray) and x.ndim >= 2 and x.size > 1:
        if x.flags.c_contiguous:
            assert result.flags.c_contiguous, result.strides
        elif x.flags.f_contiguous:
            assert result.flags.f_contiguous, result.strides


# ---------------------------------------------------------------------------
# Forward: kind x affine x dtype x case (C-contiguous input)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case_id, shape, axis, ns", AXIS_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind, affine", kind_affines(affines=("weight+bias", "weight", "none")))
def test_forward_over_axes_matches_reference(kind, affine, dtype, case_id, shape, axis, ns):
    x, w, b = case_data(dtype, shape, ns, affine)
    before = x.copy()
    out, *stats = kind.native(x, ns, w, b, axis=axis)
    assert out.shape == shape and out.dtype == dtype
    check_memory_order(out, x)
    assert_matches_reference(out, x, ns, w, b, kind.default_eps, centred=kind.centred, axis=axis)
    # the statistics: the input's shape with size 1 on the normalized axes, the param dtype, and
    # within a rounding to it of the truth (the mean: of the row's largest magnitude)
    refs = kind.reference(x, ns, w, b, axis=axis)[1:]
    axes = resolved_axes(shape, ns, axis)
    row_size = np.abs(x.astype(np.float64)).max(axis=axes, keepdims=True, initial=0.0)
    sizes = (row_size, np.abs(refs[-1])) if kind.centred else (np.abs(refs[-1]),)
    for stat, ref, size in zip(stats, refs, sizes):
        assert stat.shape == stats_shape(shape, axes) and stat.dtype == param_dtype(dtype)
        tol = 1e-12 if stat.dtype == np.float64 else float(np.finfo(np.float32).eps)
        assert_within(stat, ref, tol * size + 1e-300, "statistics vs reference")
    # the plain function: the same bits
    np.testing.assert_array_equal(kind.forward(x, ns, w, b, axis=axis), out)
    np.testing.assert_array_equal(x, before)


@requires_torch
@pytest.mark.parametrize("case_id, shape, axis, ns", AXIS_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind, affine", kind_affines(affines=("weight+bias", "weight")))
def test_forward_over_axes_matches_torch_permute_route(kind, affine, dtype, case_id, shape, axis, ns):
    x, w, b = case_data(dtype, shape, ns, affine)
    out, *stats = kind.native(x, ns, w, b, axis=axis)
    expected, *t_stats = torch_norm(x, ns, w, b, kind.eps_value(x), centred=kind.centred, axis=axis)
    scale = torch_scale(x, ns, w, b, kind.eps_value(x), centred=kind.centred, axis=axis)
    assert_matches_torch(out, expected, scale)
    for stat, t_stat in zip(stats, t_stats):
        assert stat.shape == t_stat.shape


# ---------------------------------------------------------------------------
# Forward: every layout of the input
# ---------------------------------------------------------------------------


# every case in every layout, but for an empty input as a list (which keeps no shape)
LAID_OUT_CASES = [pytest.param(*case, name, id=f"{case[0]}-{name}") for case in AXIS_CASES for name in AXIS_LAYOUTS
                  if not (name == "list" and 0 in case[1])]


@pytest.mark.parametrize("case_id, shape, axis, ns, layout_name", LAID_OUT_CASES)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_forward_over_axes_any_layout(kind, case_id, shape, axis, ns, layout_name):
    base = make_input(shape, np.float32, seed=1, offset=0.5)
    x = lay_out(layout_name, base, ns, axis)
    values = base.astype(np.float64) if layout_name == "list" else base  # a list of floats is float64
    w, b = make_params(ns, param_dtype(values.dtype), kind.affines[0])
    before = np.array(x, copy=True) if isinstance(x, np.ndarray) else None
    out = kind.forward(x, ns, w, b, axis=axis)
    assert out.shape == shape and out.dtype == values.dtype
    check_memory_order(out, x)
    assert_matches_reference(out, values, ns, w, b, kind.default_eps, centred=kind.centred, axis=axis)
    if before is not None:
        np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("case_id, shape, axis, ns", FOUR_D, ids=[c[0] for c in FOUR_D])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_c_contiguous_nchw_gives_c_contiguous_output(kind, case_id, shape, axis, ns):
    x = make_input(shape, np.float32, seed=2)
    assert kind.forward(x, ns, axis=axis).flags.c_contiguous


@pytest.mark.parametrize("case_id, shape, axis, ns", FOUR_D, ids=[c[0] for c in FOUR_D])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_fortran_input_gives_fortran_output(kind, case_id, shape, axis, ns):
    x = np.asfortranarray(make_input(shape, np.float32, seed=3))
    assert kind.forward(x, ns, axis=axis).flags.f_contiguous
    assert kind.native(x, ns, axis=axis)[0].flags.f_contiguous


# ---------------------------------------------------------------------------
# The spellings of axis
# ---------------------------------------------------------------------------

# every spelling of the channel axis of an NCHW input
CHANNEL_AXIS = [1, -3, (1,), (-3,), np.int64(1), (np.int32(1),), np.array(1)]


@pytest.mark.parametrize("axis", CHANNEL_AXIS,
                         ids=["1", "-3", "(1,)", "(-3,)", "np.int64", "(np.int32,)", "0-d-array"])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_axis_spellings_give_the_same_bits(kind, axis):
    x = make_input((2, 8, 3, 5), np.float32, seed=4)
    w, b = make_params((8,), np.float32, kind.affines[0])
    np.testing.assert_array_equal(kind.forward(x, (8,), w, b, axis=axis), kind.forward(x, (8,), w, b, axis=1))


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_axis_none_is_the_last_dims(kind):
    x = make_input((3, 4, 5), np.float64, seed=5)
    np.testing.assert_array_equal(kind.forward(x, (4, 5), axis=None), kind.forward(x, (4, 5)))
    assert_close(kind.forward(x, (4, 5), axis=(1, 2)), kind.forward(x, (4, 5)), 1e-13)
    assert_close(kind.forward(x, (5,), axis=-1), kind.forward(x, (5,)), 1e-13)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_of_order_axes_pair_weight_with_their_multi_index(kind):
    # axis=(2, 1): element j of a row is (index along axis 2, index along axis 1), so
    # weight[k, c] scales x[:, c, k]; the same as normalizing the transposed input over (1, 2)
    x = make_input((3, 4, 5), np.float64, seed=6)
    w, b = make_params((5, 4), np.float64, kind.affines[0])
    swapped = kind.forward(x, (5, 4), w, b, axis=(2, 1))
    transposed = kind.forward(np.ascontiguousarray(x.transpose(0, 2, 1)), (5, 4), w, b, axis=(1, 2))
    assert_close(swapped, transposed.transpose(0, 2, 1), 1e-13)


@requires_torch
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_torch_tensor_input_over_axes(kind):
    x = make_input((2, 8, 3, 5), np.float32, seed=7)
    np.testing.assert_array_equal(kind.forward(torch.from_numpy(x.copy()), (8,), axis=1),
                                  kind.forward(x, (8,), axis=1))


# ---------------------------------------------------------------------------
# out=: any writable array of the right shape and dtype
# ---------------------------------------------------------------------------

OUT_LAYOUTS = ["C", "fortran", "transposed", "step_sliced", "negative_strides", "column_slice"]


@pytest.mark.parametrize("out_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_any_writable_array(kind, out_layout):
    x = make_input((2, 8, 3, 5), np.float32, seed=8)
    w, b = make_params((8,), np.float32, kind.affines[0])
    expected = kind.forward(x, (8,), w, b, axis=1)
    out = layout(out_layout, np.full(x.shape, np.nan, np.float32))
    assert kind.forward(x, (8,), w, b, axis=1, out=out) is out
    assert_close(out, expected, 1e-6)


# The kernels walk rows of adjacent elements by one route and rows of strided elements by
# another, whose bits can differ, and the strided route sums parameter gradients block by block.
# Route and blocks follow the layout of the array normalized (the input, or a fused add's sum)
# alone: the layouts of out=, grad_output and the statistics leave the bits alone.  A long
# float64 row of adjacent elements shows a difference of routes in many of its elements; the
# channels-first input takes the strided route whatever the others' layouts, and one image of
# it (or rows along the first axis) is one block of rows, which other layouts would split.
ROUTE_CASES = [
    ("rows-adjacent", (6, 1000), -1, (1000,)),
    ("nchw-axis1", (2, 8, 3, 5), 1, (8,)),
    ("nchw-one-image", (1, 16, 7, 9), 1, (16,)),
    ("first-axis", (5, 3, 300), 0, (5,)),
    ("nchw-tile-runs", (2, 8, 13, 11), 1, (8,)),  # runs of 8 whole tiles, and runs with a partial one
]
ROUTE_IDS = [c[0] for c in ROUTE_CASES]


@pytest.mark.parametrize("other_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("case_id, shape, axis, ns", ROUTE_CASES, ids=ROUTE_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_layout_leaves_the_bits(kind, dtype, case_id, shape, axis, ns, other_layout):
    x = make_input(shape, dtype, seed=8)
    w, b = make_params(ns, dtype, kind.affines[0])
    out = layout(other_layout, np.full(shape, np.nan, dtype))
    assert kind.forward(x, ns, w, b, axis=axis, out=out) is out
    assert same_bits(out, kind.forward(x, ns, w, b, axis=axis))


@pytest.mark.parametrize("other_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("case_id, shape, axis, ns", ROUTE_CASES, ids=ROUTE_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_grad_output_layout_leaves_the_bits(kind, dtype, case_id, shape, axis, ns, other_layout):
    x, dy = make_input(shape, dtype, seed=8), make_input(shape, dtype, seed=9)
    w, b = make_params(ns, dtype, kind.affines[0])
    stats = kind.native(x, ns, w, b, axis=axis)[1:]
    expected = kind.backward(dy, x, ns, stats, w, b, axis=axis)
    got = kind.backward(layout(other_layout, dy), x, ns, stats, w, b, axis=axis)
    assert all(e is g is None or same_bits(g, e) for e, g in zip(expected, got))


@pytest.mark.parametrize("stats_layout", ["fortran", "transposed"])
@pytest.mark.parametrize("case_id, shape, axis, ns", ROUTE_CASES, ids=ROUTE_IDS)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_statistics_layout_leaves_the_bits(kind, case_id, shape, axis, ns, stats_layout):
    x, dy = make_input(shape, np.float64, seed=8), make_input(shape, np.float64, seed=9)
    w, b = make_params(ns, np.float64, kind.affines[0])
    stats = kind.native(x, ns, w, b, axis=axis)[1:]
    expected = kind.backward(dy, x, ns, stats, w, b, axis=axis)
    got = kind.backward(dy, x, ns, [layout(stats_layout, s) for s in stats], w, b, axis=axis)
    assert all(e is g is None or same_bits(g, e) for e, g in zip(expected, got))


@pytest.mark.parametrize("result", ["out", "residual_out"])
@pytest.mark.parametrize("other_layout", OUT_LAYOUTS)
@pytest.mark.parametrize("case_id, shape, axis, ns", ROUTE_CASES, ids=ROUTE_IDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_fused_add_output_is_the_norm_of_its_sum_in_any_layout(kind, dtype, case_id, shape, axis, ns,
                                                               other_layout, result):
    x, residual = make_input(shape, dtype, seed=8), make_input(shape, dtype, seed=9)
    w, b = make_params(ns, dtype, kind.affines[0])
    given = layout(other_layout, np.full(shape, np.nan, dtype))
    output, total = kind.add(x, residual, ns, w, b, axis=axis, **{result: given})
    assert same_bits(total, x + residual)
    assert same_bits(output, kind.forward(total, ns, w, b, axis=axis))
    assert same_bits(output, kind.forward(total, ns, w, b, axis=axis, out=np.empty_like(given)))


@pytest.mark.parametrize("x_layout", ["C", "fortran", "transposed"])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_is_input_in_place(kind, x_layout):
    base = make_input((2, 16, 9, 9), np.float32, seed=9)
    expected = kind.forward(base, (16,), axis=1)
    x = layout(x_layout, base)
    assert kind.forward(x, (16,), axis=1, out=x) is x
    assert_close(x, expected, 1e-6)


# (N, C, H, W) with H * W a power of two: the channels' strides are multiples of 4 KiB (2 KiB
# for float16), so with the output at the input's page offset (in place, or out= so placed)
# the output loop reads x from the copy its statistics' pass staged, as its loads of x would
# wait on its stores.  256 channels just fit the stage for float32 and 512 for float16; more
# than fit (256 of float64, 512 of float32 or float64) are read from x.  Either way, at every
# SIMD level, the bits of the output placed 1 KiB off at the default level, where nothing is
# staged.
POWER_OF_TWO_SHAPES = [(2, 64, 32, 32), (3, 8, 64, 64), (2, 256, 16, 64), (1, 512, 16, 64)]


@pytest.mark.parametrize("where", ["in-place", "out-at-the-same-page-offset"])
@pytest.mark.parametrize("shape", POWER_OF_TWO_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_output_at_the_inputs_page_offset_gives_the_same_bits(kind, dtype, shape, where, restore_runtime):
    channels = shape[1]
    values = make_input(shape, dtype, seed=10, offset=3.0)
    w, b = make_params((channels,), param_dtype(dtype), kind.affines[0])
    expected = kind.forward(values, (channels,), w, b, axis=1, out=empty_at(shape, dtype, 1024, boundary=4096))
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        x = empty_at(shape, dtype, 0, boundary=4096)
        x[...] = values
        out = x if where == "in-place" else empty_at(shape, dtype, 0, boundary=4096)
        assert kind.forward(x, (channels,), w, b, axis=1, out=out) is out
        assert same_bits(out, expected), level


# ---------------------------------------------------------------------------
# Backward over axes
# ---------------------------------------------------------------------------

BACKWARD_CASES = [c for c in AXIS_CASES if c[0] not in ("nchw-axis1-tuple", "nchw-axis-3")]
BACKWARD_IDS = [c[0] for c in BACKWARD_CASES]
LAYOUT_BACKWARD_CASES = [c for c in BACKWARD_CASES
                         if c[0] in ("nchw-axis1", "nhwc-axis-1", "3d-axes21", "many-strided-rows")]


def backward_case(kind, dtype, shape, ns, axis, affine, seed):
    """(x, dy, weight, bias, statistics from native())."""
    x, dy, w, b = make_backward_data(shape, ns, dtype, affine, seed)
    stats = kind.native(x, ns, w, b, axis=axis)[1:]
    return x, dy, w, b, stats


def assert_grads_close(kind, got, expected, dy, x, ns, w, axis, rtol, what):
    eps = kind.eps_value(x)
    scales = (grad_input_scale(dy, x, ns, w, eps, centred=kind.centred, axis=axis),
              grad_weight_scale(dy, x, ns, eps, centred=kind.centred, axis=axis), 1.0)
    for name, mine, theirs, scale in zip(("grad_input", "grad_weight", "grad_bias"), got, expected, scales):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, theirs, rtol, f"{name} vs {what}", scale)


@pytest.mark.parametrize("case_id, shape, axis, ns", BACKWARD_CASES, ids=BACKWARD_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind, affine", kind_affines(affines=("weight+bias", "weight", "none")))
def test_backward_over_axes_matches_reference(kind, affine, dtype, case_id, shape, axis, ns):
    x, dy, w, b, stats = backward_case(kind, dtype, shape, ns, axis, affine, seed=10)
    before = [a.copy() for a in (x, dy) + tuple(stats)]
    got = kind.backward(dy, x, ns, stats, w, b, axis=axis)
    assert got[0].shape == shape and got[0].dtype == dtype
    check_memory_order(got[0], x)
    for param, grad in zip((w, b), got[1:]):
        assert (grad is None) == (param is None)
        if grad is not None:
            assert grad.shape == ns and grad.dtype == param_dtype(dtype)
    expected = kind.reference_backward(dy, x, ns, stats, w, axis=axis)
    expected = (expected[0],) + tuple(None if p is None else e for p, e in zip((w, b), expected[1:]))
    assert_grads_close(kind, got, expected, dy, x, ns, w, axis, GRAD_REFERENCE_RTOL[np.dtype(dtype)], "float64")
    for a, was in zip((x, dy) + tuple(stats), before):
        np.testing.assert_array_equal(a, was)


@requires_torch
@pytest.mark.parametrize("case_id, shape, axis, ns", BACKWARD_CASES, ids=BACKWARD_IDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind, affine", kind_affines(affines=("weight+bias", "none")))
def test_backward_over_axes_matches_torch_autograd(kind, affine, dtype, case_id, shape, axis, ns):
    x, dy, w, b, stats = backward_case(kind, dtype, shape, ns, axis, affine, seed=11)
    got = kind.backward(dy, x, ns, stats, w, b, axis=axis)
    expected = torch_autograd(dy, x, ns, w, b, kind.eps_value(x), centred=kind.centred, axis=axis)
    assert_grads_close(kind, got, expected, dy, x, ns, w, axis, GRAD_TORCH_RTOL[np.dtype(dtype)], "autograd")


@pytest.mark.parametrize("layout_name", ["fortran", "transposed", "step_sliced", "negative_strides",
                                         "normalized_innermost", "torch_tensor"])
@pytest.mark.parametrize("case_id, shape, axis, ns", LAYOUT_BACKWARD_CASES, ids=[c[0] for c in LAYOUT_BACKWARD_CASES])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_backward_over_axes_any_layout(kind, case_id, shape, axis, ns, layout_name):
    x, dy, w, b, stats = backward_case(kind, np.float32, shape, ns, axis, kind.affines[0], seed=12)
    got = kind.backward(lay_out(layout_name, dy, ns, axis), lay_out(layout_name, x, ns, axis), ns, stats, w, b,
                        axis=axis)
    if layout_name == "fortran":
        assert got[0].flags.f_contiguous
    expected = kind.backward(dy, x, ns, stats, w, b, axis=axis)
    for name, mine, theirs in zip(("grad_input", "grad_weight", "grad_bias"), got, expected):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, theirs, 1e-5, name)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_backward_output_mask_over_axes(kind):
    x, dy, w, b, stats = backward_case(kind, np.float64, (2, 8, 3, 5), (8,), 1, kind.affines[0], seed=13)
    full = kind.backward(dy, x, (8,), stats, w, b, axis=1)
    for masked in range(2 + kind.centred):
        mask = [True] * 3
        mask[masked] = False
        got = kind.backward(dy, x, (8,), stats, w, b, mask, axis=1)
        assert got[masked] is None
        for i, (mine, all_of_them) in enumerate(zip(got, full)):
            if i != masked and all_of_them is not None:
                np.testing.assert_array_equal(mine, all_of_them)


NEIGHBOURS = {
    "nan-dy": lambda x, dy: dy.__setitem__((0, 3, 0, 15), np.nan),
    "huge-row": lambda x, dy: x.__setitem__((0, slice(None), 0, 15), x[0, :, 0, 15] * 1e19),
    "zero-dy-row": lambda x, dy: dy.__setitem__((0, slice(None), 0, 15), 0.0),
}


@pytest.mark.parametrize("change", list(NEIGHBOURS))
@pytest.mark.parametrize("dtype_name", ["float16", "float32", pytest.param("bfloat16", marks=requires_ml_dtypes)])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_backward_over_axes_row_bits_do_not_depend_on_its_neighbours(kind, dtype_name, change, restore_runtime):
    # channels-first rows go 16 at a time; one that takes the float64 path (NaN, a huge row,
    # an all-zero dy) must leave the other 15 rows' float32 results as they were
    dtype = dtype_named(dtype_name)
    x = make_input((1, 8, 1, 16), np.float32, seed=15, offset=1.0).astype(dtype)
    dy = make_input(x.shape, np.float32, seed=16).astype(dtype)
    w = make_params((8,), np.float32, "weight")[0]
    changed_x, changed_dy = x.copy(), dy.copy()
    with np.errstate(over="ignore"):  # float16's huge row is Inf: a row for float64 as well
        NEIGHBOURS[change](changed_x, changed_dy)
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        before, after = (kind.backward(d, v, (8,), kind.native(v, (8,), w, axis=1)[1:], w, axis=1)[0]
                         for v, d in ((x, dy), (changed_x, changed_dy)))
        assert before[..., :15].tobytes() == after[..., :15].tobytes(), level


# ---------------------------------------------------------------------------
# LayerNorm and RMSNorm over axes against the formulas torch code writes for them
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
def test_layer_norm_axis1_is_the_convnext_formula(dtype):
    # ConvNeXt's channels-first LayerNorm, written out in NumPy (in float64)
    x = make_input((2, 16, 7, 7), dtype, seed=14, offset=3.0)
    w, b = make_params((16,), param_dtype(dtype), "weight+bias")
    x64 = x.astype(np.float64)
    u = x64.mean(1, keepdims=True)
    s = ((x64 - u) ** 2).mean(1, keepdims=True)
    expected = (x64 - u) / np.sqrt(s + 1e-6) * w[:, None, None] + b[:, None, None]
    out = LAYER_NORM.forward(x, (16,), w, b, 1e-6, axis=1)
    assert_close(out, expected, 1e-6 if dtype == np.float32 else 1e-13)  # the contract's float32 bound


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
def test_rms_norm_axis1_is_the_formula(dtype):
    x = make_input((2, 16, 7, 7), dtype, seed=15, offset=3.0)
    w, _ = make_params((16,), param_dtype(dtype), "weight")
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-6) * w[:, None, None]
    out = RMS_NORM.forward(x, (16,), w, None, 1e-6, axis=1)
    assert_close(out, expected, 1e-6 if dtype == np.float32 else 1e-13)  # the contract's float32 bound


@pytest.mark.parametrize("shape", [(2, 8, 3, 5), (1, 16, 9, 9)], ids=shape_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_channels_first_equals_channels_last_moved(kind, shape):
    # the same numbers normalized as NCHW over axis 1 and as NHWC over the last axis
    x = make_input(shape, np.float64, seed=16)
    c = shape[1]
    w, b = make_params((c,), np.float64, kind.affines[0])
    nhwc = kind.forward(np.ascontiguousarray(np.moveaxis(x, 1, -1)), (c,), w, b)
    assert_close(kind.forward(x, (c,), w, b, axis=1), np.moveaxis(nhwc, -1, 1), 1e-13)
