"""Dask arrays through the norm family: lazy dask arrays out, the NumPy call's bits where each
chunk holds whole rows, the float64 truth's tolerance where rows are split across chunks."""

import math
import os
import re
import subprocess
import sys
import warnings
from typing import NamedTuple

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

da = pytest.importorskip("dask.array", reason="dask is not installed: pip install 'dask[array,distributed]'")
import dask  # noqa: E402

import layernorm  # noqa: E402
from layernorm import _reference  # noqa: E402

from helpers import (  # noqa: E402
    FLOAT_DTYPES,
    KINDS,
    LAYER_NORM,
    REF_REL_TOL,
    TINY_PRODUCT_MAGNITUDES,
    assert_close,
    assert_matches_reference,
    assert_within,
    dtype_id,
    make_input,
    nan_pairs,
    param_dtype,
    run_in_child,
    tiny_product_id,
)

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------------
# The family's calls, on NumPy or dask arguments alike
# ---------------------------------------------------------------------------------------------


class Layout(NamedTuple):
    """An input's shape, the axes it is normalized over and a chunking of it."""

    shape: tuple
    normalized_shape: tuple
    axis: object  # None: the trailing axes
    chunks: tuple

    @property
    def axes(self):
        return _reference.normalized_axes(len(self.shape), self.normalized_shape, self.axis)

    @property
    def stats_chunks(self):
        return tuple(1 if a in self.axes else c for a, c in enumerate(self.chunks))


WHOLE_ROWS = {
    "trailing": Layout((12, 5, 8), (5, 8), None, (5, 5, 8)),
    "trailing, uneven": Layout((12, 5, 8), (5, 8), None, ((7, 4, 1), 5, 8)),
    "axis=1": Layout((4, 6, 5, 3), (6,), 1, (2, 6, 2, 3)),
    "axis=(2, 1)": Layout((4, 6, 5, 3), (5, 6), (2, 1), (3, 6, 5, 2)),
}
SPLIT_ROWS = {
    "last axis": Layout((12, 5, 8), (5, 8), None, (5, 5, 3)),
    "both axes": Layout((12, 5, 8), (5, 8), None, (5, 2, 3)),
    "uneven": Layout((12, 5, 8), (5, 8), None, ((7, 5), (1, 4), (6, 2))),
    "one row per chunk": Layout((12, 5, 8), (5, 8), None, (12, 1, 8)),
    "axis=1": Layout((4, 6, 5, 3), (6,), 1, (2, 4, 5, 3)),
    "axis=(2, 1)": Layout((4, 6, 5, 3), (5, 6), (2, 1), (2, 2, 3, 3)),
    # empty chunks along a normalized axis: empty views with the strides of their slice
    "empty chunks, last axis": Layout((12, 5, 8), (5, 8), None, (12, 5, (0, 8, 0))),
    "empty chunks, both axes": Layout((12, 5, 8), (5, 8), None, (12, (2, 0, 3), (4, 0, 4))),
}
WHOLE, SPLIT = WHOLE_ROWS["trailing"], SPLIT_ROWS["both axes"]


class Args(NamedTuple):
    """A family call's array arguments, NumPy or dask, and its layout."""

    x: object
    dy: object
    residual: object
    stats: dict  # kind name: its statistics, as native_layer_norm / native_rms_norm return them
    weight: object
    bias: object
    layout: Layout

    def lazy(self, params="numpy"):
        """The same values as dask arrays of the layout's chunks (the statistics: size-1 chunks
        on the normalized axes); the parameters stay NumPy, or become dask arrays split in two
        along their first axis with params="dask"."""
        layout = self.layout

        def param(value):
            if value is None or params == "numpy":
                return value
            return da.from_array(value, chunks=tuple(max(1, -(-n // 2)) for n in value.shape))

        return self._replace(
            x=da.from_array(self.x, chunks=layout.chunks), dy=da.from_array(self.dy, chunks=layout.chunks),
            residual=da.from_array(self.residual, chunks=layout.chunks),
            stats={kind: tuple(da.from_array(s, chunks=layout.stats_chunks) for s in stats)
                   for kind, stats in self.stats.items()},
            weight=param(self.weight), bias=param(self.bias),
        )


def make_args(layout, dtype, affine="weight+bias", seed=0, offset=0.0):
    ns = layout.normalized_shape
    x = make_input(layout.shape, dtype, seed=seed, offset=offset)
    dy = make_input(layout.shape, dtype, seed=seed + 1)
    residual = make_input(layout.shape, dtype, seed=seed + 3)
    rng = np.random.default_rng(seed + 2)
    weight = (1 + 0.5 * rng.standard_normal(ns)).astype(param_dtype(dtype)) if "weight" in affine else None
    bias = rng.standard_normal(ns).astype(param_dtype(dtype)) if "bias" in affine else None
    stats = {kind.name: kind.native(x, ns, weight, bias if kind.centred else None, axis=layout.axis)[1:]
             for kind in KINDS}
    return Args(x, dy, residual, stats, weight, bias, layout)


def _bias(kind, args):
    return args.bias if kind.centred else None


def _forward(kind):
    return lambda a: kind.forward(a.x, a.layout.normalized_shape, a.weight, _bias(kind, a), axis=a.layout.axis)


def _native(kind):
    return lambda a: kind.native(a.x, a.layout.normalized_shape, a.weight, _bias(kind, a), axis=a.layout.axis)


def _backward(kind):
    def backward(a):
        mask = (True,) * (2 + kind.centred)
        fn = getattr(layernorm, kind.name + "_backward")
        params = (a.weight, a.bias) if kind.centred else (a.weight,)
        return fn(a.dy, a.x, a.layout.normalized_shape, *a.stats[kind.name], *params, mask, axis=a.layout.axis)

    return backward


def _add(kind):
    return lambda a: kind.add(a.x, a.residual, a.layout.normalized_shape, a.weight, _bias(kind, a),
                              axis=a.layout.axis)


# name: (call, the kinds of its outputs: "row" (the input's shape), "stat" or "grad" (a
# parameter's gradient)); a single kind means the call returns an array, not a tuple
CALLS = {}
for _kind in KINDS:
    _stats = ("stat",) * (1 + _kind.centred)
    _grads = ("grad",) * (1 + _kind.centred)
    CALLS[_kind.name] = (_forward(_kind), ("row",))
    CALLS["native_" + _kind.name] = (_native(_kind), ("row",) + _stats)
    CALLS[_kind.name + "_backward"] = (_backward(_kind), ("row",) + _grads)
    CALLS["add_" + _kind.name] = (_add(_kind), ("row", "row"))


def call(name, args):
    """The call's results as a tuple (a single array becomes a 1-tuple)."""
    function, kinds = CALLS[name]
    result = function(args)
    return (result,) if len(kinds) == 1 else tuple(result)


def computed(results):
    return dask.compute(*results, scheduler="threads")


@pytest.fixture(autouse=True)
def threaded_scheduler():
    with dask.config.set(scheduler="threads", num_workers=2):
        yield


# ---------------------------------------------------------------------------------------------
# Lazy results, their shapes, dtypes and chunks
# ---------------------------------------------------------------------------------------------


class CountingBlocks:
    """A dask array whose blocks count how often they are computed."""

    def __init__(self, values, chunks):
        self.computed = 0
        self.array = da.from_array(values, chunks=chunks).map_blocks(
            self._count, meta=np.empty((0,) * values.ndim, values.dtype))

    def _count(self, block):
        self.computed += 1
        return block


@pytest.mark.parametrize("layout", [WHOLE, SPLIT, SPLIT_ROWS["axis=(2, 1)"]], ids=["whole", "split", "split-axis"])
@pytest.mark.parametrize("name", CALLS)
def test_results_are_lazy_dask_arrays_with_the_numpy_calls_shapes_dtypes_and_chunks(name, layout):
    args = make_args(layout, np.float32)
    expected = call(name, args)
    counting = CountingBlocks(args.x, layout.chunks)
    results = call(name, args.lazy()._replace(x=counting.array))
    assert counting.computed == 0
    for kind, result, want in zip(CALLS[name][1], results, expected):
        assert isinstance(result, da.Array)
        assert (result.shape, result.dtype) == (want.shape, want.dtype)
        assert type(result._meta) is np.ndarray and result._meta.dtype == want.dtype
        assert result._meta.ndim == want.ndim
        if kind == "row":
            assert result.chunks == counting.array.chunks
        elif kind == "stat":
            assert result.chunks == tuple((1,) if a in layout.axes else c for a, c in enumerate(counting.array.chunks))


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_output_mask_and_missing_parameters_give_none_as_numpy_does(kind):
    args = make_args(SPLIT, np.float64, affine="weight")
    lazy = args.lazy()
    fn = getattr(layernorm, kind.name + "_backward")
    ns = SPLIT.normalized_shape
    params = (args.weight, None) if kind.centred else (args.weight,)
    lazy_params = (lazy.weight, None) if kind.centred else (lazy.weight,)
    for mask in [(True, True, True), (False, True, True), (True, False, True), (False, False, False)]:
        mask = mask[: 2 + kind.centred]
        expected = fn(args.dy, args.x, ns, *args.stats[kind.name], *params, mask)
        got = fn(lazy.dy, lazy.x, ns, *lazy.stats[kind.name], *lazy_params, mask)
        assert [g is None for g in got] == [e is None for e in expected]
        for g, e in zip(computed([g for g in got if g is not None]), [e for e in expected if e is not None]):
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Rows held whole: the NumPy call's bits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("layout", WHOLE_ROWS.values(), ids=WHOLE_ROWS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", CALLS)
def test_rows_held_whole_give_the_numpy_calls_bits(name, dtype, layout, affine):
    args = make_args(layout, dtype, affine=affine)
    expected = call(name, args)
    got = computed(call(name, args.lazy(params="dask")))
    for kind, g, e in zip(CALLS[name][1], got, expected):
        if e is None:
            assert g is None
        elif kind == "grad":
            # per-chunk sums added up: close to the NumPy call's, not its bits
            assert g.dtype == e.dtype
            assert_close(g, e, 8 * float(np.finfo(e.dtype).eps))
        else:
            assert g.dtype == e.dtype
            np.testing.assert_array_equal(g, e)


def test_rows_held_whole_run_one_task_per_chunk_and_nothing_else():
    args = make_args(WHOLE, np.float32)
    x = da.from_array(args.x, chunks=WHOLE.chunks)
    y = layernorm.layer_norm(x, WHOLE.normalized_shape, args.weight, args.bias)
    added = set(dict(y.__dask_graph__())) - set(dict(x.__dask_graph__()))
    kernel_tasks = [key for key in added if key[0] == y.name]
    assert len(kernel_tasks) == x.npartitions
    assert len(added) - len(kernel_tasks) <= 2  # the weight and the bias, once each


# ---------------------------------------------------------------------------------------------
# Normalized axes split across chunks: the float64 truth's tolerance
# ---------------------------------------------------------------------------------------------


def assert_stats_within_tolerance(stats, kind, x, layout, weight, bias):
    """mean and rstd against the float64 reference: rounded once to their dtype; float64 ones
    as close as the kernel's own (REF_REL_TOL)."""
    reference = kind.reference(x, layout.normalized_shape, weight, bias, axis=layout.axis)[1:]
    ref_rstd = reference[-1]
    tol = max(2 * float(np.finfo(stats[-1].dtype).eps), REF_REL_TOL[np.dtype(x.dtype)])
    if kind.centred:
        assert_within(stats[0], reference[0], tol * (np.abs(reference[0]) + 1 / ref_rstd), "mean")
    assert_within(stats[-1], ref_rstd, tol * ref_rstd, "rstd")


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("layout", SPLIT_ROWS.values(), ids=SPLIT_ROWS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_split_rows_forward_is_within_the_float64_truths_tolerance(kind, dtype, layout, affine):
    args = make_args(layout, dtype, affine=affine, offset=0.5)
    lazy = args.lazy(params="dask")
    ns, bias = layout.normalized_shape, _bias(kind, args)
    output, *stats = computed(call("native_" + kind.name, lazy))
    assert_matches_reference(output, args.x, ns, args.weight, bias, kind.default_eps, centred=kind.centred,
                             axis=layout.axis)
    assert_stats_within_tolerance(stats, kind, args.x, layout, args.weight, bias)
    output, total = computed(call("add_" + kind.name, lazy))
    np.testing.assert_array_equal(total, args.x + args.residual)  # NumPy's sum, rounded in the dtype
    assert_matches_reference(output, total, ns, args.weight, bias, kind.default_eps, centred=kind.centred,
                             axis=layout.axis)


@pytest.mark.parametrize("dtype, offset", [(np.float64, 1e6), (np.float32, 1e4), (np.float16, 1e2)],
                         ids=["float64-offset1e6", "float32-offset1e4", "float16-offset1e2"])
def test_split_rows_keep_their_digits_at_a_large_offset(dtype, offset):
    layout = Layout((4, 6000), (6000,), None, (2, 700))
    x = make_input(layout.shape, dtype, seed=3, scale=1.0, offset=offset)
    output, *stats = computed(layernorm.native_layer_norm(da.from_array(x, chunks=layout.chunks), 6000))
    assert_matches_reference(output, x, (6000,))
    assert_stats_within_tolerance(stats, LAYER_NORM, x, layout, None, None)
    if dtype == np.float64:
        # the kernel's own float64 promise (tests/test_accuracy.py)
        y, _, _ = _reference.layer_norm(x, 6000)
        assert np.abs(output - y).max() <= 1e-13 + 4 * np.finfo(np.float64).eps * offset


# Rows of extreme magnitude split across chunks: (dtype name, x of EXTREME_SHAPE) for each
# magnitude; each has an extreme row of random values, an extreme constant row, an ordinary
# row and, for float64, a row near the largest float.
EXTREME_SHAPE, EXTREME_CHUNKS = (4, 600), (3, 250)


def _bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed: NumPy has no bfloat16")
    return ml_dtypes.bfloat16


def _extreme_input(dtype, magnitude):
    rng = np.random.default_rng(11)
    rows = rng.uniform(-1.0, 1.0, EXTREME_SHAPE) * magnitude
    rows[1] = magnitude
    rows[2] = rng.standard_normal(EXTREME_SHAPE[1])
    if dtype == np.float64 and magnitude > 1.0:
        rows[3] = rng.uniform(-1.0, 1.0, EXTREME_SHAPE[1]) * np.finfo(np.float64).max
    return rows.astype(dtype)


EXTREMES = {
    "float64-1e300": (np.float64, 1e300),
    "float64-1e-300": (np.float64, 1e-300),
    "float64-subnormal": (np.float64, 1e-310),
    "float32-subnormal": (np.float32, 1e-39),
    "float32-3e38": (np.float32, 3e38),
    "float16-subnormal": (np.float16, 3e-7),
    "float16-6e4": (np.float16, 6e4),
    "bfloat16-1e-39": ("bfloat16", 1e-39),
    "bfloat16-3e38": ("bfloat16", 3e38),
}


def _bfloat16_finfo():
    return pytest.importorskip("ml_dtypes").finfo(_bfloat16())


def extreme_input(name):
    dtype, magnitude = EXTREMES[name]
    return _extreme_input(_bfloat16() if dtype == "bfloat16" else dtype, magnitude)


def extreme_tolerance(want, dtype):
    """The reference's tolerance of each row's largest value (and an ulp of the dtype, whose
    rounding of the float64 truth the whole-array call's exact rows make), plus the smallest
    subnormal, as tests/test_extreme_rows.py holds the whole-array call."""
    info = _bfloat16_finfo() if dtype.name == "bfloat16" else np.finfo(dtype)
    size = np.abs(np.nan_to_num(want, nan=0.0, posinf=0.0, neginf=0.0)).max(axis=-1, keepdims=True, initial=0.0)
    rel = REF_REL_TOL.get(np.dtype(dtype), REF_REL_TOL[np.dtype(np.float32)]) + float(info.eps)
    return rel * size + float(info.smallest_subnormal)


def assert_like_the_whole_array_call(got, whole, want, what):
    """got (split) and whole (NumPy) within the tolerance of want (the float64 truth rounded to
    their dtype); NaN where the NumPy call has NaN, and then the one quiet NaN."""
    dtype, got_bits = whole.dtype, got
    with np.errstate(over="ignore", invalid="ignore"):
        want = want.astype(dtype).astype(np.float64)
    tol = extreme_tolerance(want, dtype)
    finite = np.isfinite(want)
    got, whole = got.astype(np.float64), whole.astype(np.float64)
    assert_within(np.where(finite, whole, 0.0), np.where(finite, want, 0.0), tol, f"{what}: the NumPy call")
    assert_within(np.where(finite, got, 0.0), np.where(finite, want, 0.0), tol, what)
    np.testing.assert_array_equal(got[~finite], whole[~finite], err_msg=what)  # Inf as Inf, NaN as NaN
    quiet = np.array(np.nan, dtype)
    assert all(value.tobytes() == quiet.tobytes() for value in got_bits[np.isnan(got)]), what


@pytest.mark.parametrize("eps", ["default", 0.0])
@pytest.mark.parametrize("magnitude", EXTREMES)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_split_rows_of_extreme_magnitude_get_the_numpy_calls_answer(kind, magnitude, eps):
    x = extreme_input(magnitude)
    ns = (x.shape[1],)
    eps = kind.eps_value(x) if eps == "default" else eps
    whole = kind.native(x, ns, eps=eps)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        split = computed(kind.native(da.from_array(x, chunks=EXTREME_CHUNKS), ns, eps=eps))
        want = kind.reference(x.astype(np.float64), ns, eps=eps)
    for what, got, whole_value, want_value in zip(("output", "mean", "rstd") if kind.centred else ("output", "rstd"),
                                                  split, whole, want):
        assert_like_the_whole_array_call(got, whole_value, want_value, what)


@pytest.mark.parametrize("eps", ["default", 0.0])
@pytest.mark.parametrize("magnitude", EXTREMES)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_split_rows_of_extreme_magnitude_get_the_numpy_calls_gradients(kind, magnitude, eps):
    x = extreme_input(magnitude)
    ns = (x.shape[1],)
    eps = kind.eps_value(x) if eps == "default" else eps
    dy = make_input(x.shape, np.float32, seed=4).astype(x.dtype)
    weight = (1 + 0.5 * np.random.default_rng(5).standard_normal(ns)).astype(np.float64 if x.dtype == np.float64
                                                                             else np.float32)
    stats = kind.native(x, ns, weight, eps=eps)[1:]
    whole = kind.backward(dy, x, ns, stats, weight)
    chunked = [da.from_array(s, chunks=(EXTREME_CHUNKS[0], 1)) for s in stats]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        split = computed([g for g in kind.backward(da.from_array(dy, chunks=EXTREME_CHUNKS),
                                                   da.from_array(x, chunks=EXTREME_CHUNKS), ns, chunked,
                                                   da.from_array(weight, chunks=EXTREME_CHUNKS[1]))
                          if g is not None])
        want = kind.reference_backward(dy, x.astype(np.float64), ns, [s.astype(np.float64) for s in stats], weight)
    for what, got, whole_value, want_value in zip(("grad_input", "grad_weight", "grad_bias"), split, whole, want):
        assert_like_the_whole_array_call(got, whole_value, want_value, what)


@pytest.mark.parametrize("dtype_magnitudes", [(dtype, m) for dtype, ms in TINY_PRODUCT_MAGNITUDES.items() for m in ms],
                         ids=tiny_product_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_split_rows_with_tiny_products_get_the_numpy_calls_gradients(kind, dtype_magnitudes):
    """Rows whose products dy * (x - mean) underflow the compute type (eps 0, or one that
    outweighs their variance), split so that only one chunk holds the row's largest |dy|:
    grad_input is the NumPy call's, within the float64 truth's tolerance (each chunk's kernels
    need the whole row's largest magnitudes)."""
    dtype, (x_size, dy_size, eps) = dtype_magnitudes
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(EXTREME_SHAPE) * x_size).astype(dtype)
    dy = (rng.standard_normal(EXTREME_SHAPE) * dy_size).astype(dtype)
    dy[:, :EXTREME_CHUNKS[1]] *= np.asarray(0.5, dtype)  # the largest |dy| in a later chunk
    ns = (x.shape[1],)
    weight = rng.uniform(0.5, 2.0, ns).astype(param_dtype(dtype))
    stats = kind.native(x, ns, weight, eps=eps)[1:]
    whole = kind.backward(dy, x, ns, stats, weight)
    chunked = [da.from_array(s, chunks=(EXTREME_CHUNKS[0], 1)) for s in stats]
    split = computed([g for g in kind.backward(da.from_array(dy, chunks=EXTREME_CHUNKS),
                                               da.from_array(x, chunks=EXTREME_CHUNKS), ns, chunked,
                                               da.from_array(weight, chunks=EXTREME_CHUNKS[1])) if g is not None])
    want = kind.reference_backward(dy, x.astype(np.float64), ns, [s.astype(np.float64) for s in stats], weight)
    for what, got, whole_value, want_value in zip(("grad_input", "grad_weight", "grad_bias"), split, whole, want):
        assert_like_the_whole_array_call(got, whole_value, want_value, what)


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_a_split_row_whose_grad_input_overflows_in_float32_gets_the_numpy_calls(kind):
    """A float32 row with an outlier in its middle chunk (xhat ~ 24, rstd ~ 12, eps 0) under
    g = 4e37 there: grad_input's inner term -rstd**2 * mean(g * xhat) * (x - mean) passes
    float32's largest where rstd * g cancels it, so the row goes by float64, as the NumPy call
    takes it: the chunks need the row's largest |x - mean| to tell."""
    x = make_input(EXTREME_SHAPE, np.float32, seed=13)
    dy = make_input(EXTREME_SHAPE, np.float32, seed=14)
    x[0], dy[0] = 0.0, 0.0
    x[0, 300], dy[0, 300] = 2.04, 4e34
    ns = (x.shape[1],)
    weight = np.full(ns, 1e3, np.float32)
    stats = kind.native(x, ns, weight, eps=0.0)[1:]
    whole = kind.backward(dy, x, ns, stats, weight)
    chunked = [da.from_array(s, chunks=(EXTREME_CHUNKS[0], 1)) for s in stats]
    split = computed(kind.backward(da.from_array(dy, chunks=EXTREME_CHUNKS), da.from_array(x, chunks=EXTREME_CHUNKS),
                                   ns, chunked, da.from_array(weight, chunks=EXTREME_CHUNKS[1]))[:1])[0]
    want = kind.reference_backward(dy, x.astype(np.float64), ns, [s.astype(np.float64) for s in stats], weight)[0]
    assert np.isfinite(whole[0]).all()
    assert_like_the_whole_array_call(split, whole[0], want, "grad_input")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_split_rows_holding_nan_or_inf_give_the_one_quiet_nan(kind, dtype, value):
    x = make_input(EXTREME_SHAPE, dtype, seed=9)
    x[0, 300] = value  # a middle chunk's
    x[1, 10] = value  # the first chunk's
    x[3, -1] = value  # the last chunk's last element
    ns = (x.shape[1],)
    dy = make_input(x.shape, dtype, seed=10)
    weight = make_input(ns, np.float64 if dtype == np.float64 else np.float32, seed=12)
    whole = kind.native(x, ns, weight)
    with np.errstate(invalid="ignore"):
        split = computed(kind.native(da.from_array(x, chunks=EXTREME_CHUNKS), ns, da.from_array(weight, chunks=250)))
        stats = [da.from_array(s, chunks=(EXTREME_CHUNKS[0], 1)) for s in whole[1:]]
        split_grads = computed([g for g in kind.backward(da.from_array(dy, chunks=EXTREME_CHUNKS),
                                                         da.from_array(x, chunks=EXTREME_CHUNKS), ns, stats,
                                                         da.from_array(weight, chunks=250)) if g is not None])
    whole_grads = [g for g in kind.backward(dy, x, ns, whole[1:], weight) if g is not None]
    quiet = {np.dtype(dtype): np.array(np.nan, dtype).tobytes() for dtype in (np.float16, np.float32, np.float64)}
    # output, statistics (a row holding NaN or Inf has NaN mean too, wherever it is) and gradients
    for got, want in zip(split + split_grads, whole + tuple(whole_grads)):
        nan = np.isnan(want)
        assert nan.any()
        np.testing.assert_array_equal(np.isnan(got), nan)
        assert {value.tobytes() for value in got[nan]} == {quiet[got.dtype]}


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_channels_first_backward_in_chunks_of_whole_rows_is_the_numpy_calls(kind):
    # the strided route takes rows 16 at a time; chunks regroup them, and a row that takes the
    # float64 path must not change the bits of the rows beside it in either grouping
    x = make_input((2, 8, 3, 16), np.float32, seed=17, offset=1.0)
    dy = make_input(x.shape, np.float32, seed=18)
    x[0, :, 1, 15] *= 1e19
    weight = make_input((8,), np.float32, seed=19)
    stats = kind.native(x, (8,), weight, axis=1)[1:]
    whole = kind.backward(dy, x, (8,), stats, weight, axis=1)[0]
    chunks = (1, 8, 2, 5)
    split = computed([kind.backward(da.from_array(dy, chunks=chunks), da.from_array(x, chunks=chunks), (8,),
                                    [da.from_array(s, chunks=(1, 1, 2, 5)) for s in stats], weight, axis=1)[0]])[0]
    assert split.tobytes() == whole.tobytes()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_split_rows_sum_nans_as_the_numpy_call_does(kind, dtype):
    # the fused adds on rows split across chunks sum them chunk by chunk, with the kernels'
    # NaN: the one quiet NaN, whichever NaN either operand held
    x, residual = nan_pairs(dtype, (4, 40))
    whole = kind.add(x, residual, (40,))
    split = computed(kind.add(da.from_array(x, chunks=(2, 15)), da.from_array(residual, chunks=(2, 15)), (40,)))
    assert split[1].tobytes() == whole[1].tobytes()
    np.testing.assert_array_equal(np.isnan(split[0]), np.isnan(whole[0]))


@hypothesis.settings(max_examples=40, derandomize=True, database=None, deadline=None)
@hypothesis.given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    exponent=st.integers(-1080, 1023),
    row_len=st.integers(2, 300),
    chunk=st.integers(1, 120),
    eps=st.sampled_from(["default", 0.0]),
    seed=st.integers(0, 2**16),
)
def test_split_rows_at_any_scale_get_the_numpy_calls_answer(kind, dtype, exponent, row_len, chunk, eps, seed):
    """A row of 2**exponent-sized values (clipped to the dtype's range) split into chunks of any
    length, against the whole-array call and the float64 truth."""
    info = np.finfo(dtype)
    exponent = int(np.clip(exponent, np.log2(float(info.smallest_subnormal)) + 4, info.maxexp - 2))
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1.0, 1.0, (2, row_len)) * 2.0**exponent).astype(dtype)
    ns = (row_len,)
    eps = kind.eps_value(x) if eps == "default" else eps
    whole = kind.native(x, ns, eps=eps)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        split = computed(kind.native(da.from_array(x, chunks=(1, chunk)), ns, eps=eps))
        want = kind.reference(x.astype(np.float64), ns, eps=eps)
    for what, got, whole_value, want_value in zip(("output", "mean", "rstd") if kind.centred else ("output", "rstd"),
                                                  split, whole, want):
        assert_like_the_whole_array_call(got, whole_value, want_value, what)


def per_column(values, layout):
    """Sums over the batch axes, in normalized_shape's order of axes (as a gradient is)."""
    batch = tuple(a for a in range(len(layout.shape)) if a not in layout.axes)
    return np.transpose(values.sum(axis=batch, keepdims=True), batch + layout.axes).reshape(layout.normalized_shape)


def expand(param, layout):
    """A parameter of normalized_shape laid out to broadcast against the input."""
    return _reference.Normalized(np.empty(layout.shape), None, None, layout.axes).expand(param)


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("layout", SPLIT_ROWS.values(), ids=SPLIT_ROWS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_split_rows_backward_is_within_the_float64_truths_tolerance(kind, dtype, layout, affine):
    args = make_args(layout, dtype, affine=affine, offset=0.5)
    got = computed(call(kind.name + "_backward", args.lazy(params="dask")))
    stats = args.stats[kind.name]
    # the exact gradients for exactly these arguments (statistics rounded as given)
    wants = kind.reference_backward(args.dy, args.x, layout.normalized_shape, stats, args.weight, axis=layout.axis)
    mean, rstd = (stats[0] if kind.centred else 0.0), stats[-1]
    xhat = np.abs((args.x.astype(np.float64) - mean) * rstd)
    dy = np.abs(args.dy.astype(np.float64))
    g = dy * np.abs(expand(args.weight, layout))
    scales = (rstd * g.max(axis=layout.axes, keepdims=True) * (1 + xhat.max(axis=layout.axes, keepdims=True)),
              per_column(dy * xhat, layout), per_column(dy, layout))
    tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[np.dtype(dtype).type]
    present = (True, args.weight is not None, kind.centred and args.bias is not None)
    for what, g, want, scale, wanted in zip(("grad_input", "grad_weight", "grad_bias"), got, wants, scales, present):
        if not wanted:
            assert g is None
            continue
        assert_within(g, want, tol * np.maximum(scale, 1.0), what)


def test_empty_rows_split_across_chunks_give_the_kernels_answer():
    x = np.zeros((3, 0, 4), np.float32)
    expected = layernorm.native_layer_norm(x, (0, 4))
    got = computed(layernorm.native_layer_norm(da.from_array(x, chunks=(1, 1, 2)), (0, 4)))
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm", "layer_norm_backward", "rms_norm_backward"])
def test_empty_rows_keep_the_inputs_chunks(name):
    x = da.zeros((4, 0, 3), np.float32, chunks=(2, 1, 1))
    stats = da.zeros((4, 1, 1), np.float32, chunks=(2, 1, 1))
    results = {
        "layer_norm": lambda: (layernorm.layer_norm(x, (0, 3)),),
        "add_layer_norm": lambda: layernorm.add_layer_norm(x, x, (0, 3)),
        "layer_norm_backward": lambda: layernorm.layer_norm_backward(x, x, (0, 3), stats, stats, np.ones((0, 3), np.float32),
                                                                     np.ones((0, 3), np.float32)),
        "rms_norm_backward": lambda: layernorm.rms_norm_backward(x, x, (0, 3), stats, np.ones((0, 3), np.float32)),
    }[name]()
    for result in results:
        expected = x.chunks if result.ndim == x.ndim else x.chunks[1:]
        assert result.chunks == expected


def test_statistics_given_in_another_shape_of_one_value_per_row():
    x = make_input((2, 12, 8), np.float64, seed=3)
    dy = make_input((2, 12, 8), np.float64, seed=4)
    _, mean, rstd = layernorm.native_layer_norm(x, 8)
    expected = layernorm.layer_norm_backward(dy, x, 8, mean.reshape(24), rstd.reshape(4, 6))
    lazy_x, lazy_dy = da.from_array(x, chunks=(1, 5, 8)), da.from_array(dy, chunks=(1, 5, 8))
    got = computed(layernorm.layer_norm_backward(lazy_dy, lazy_x, 8, da.from_array(mean.reshape(24), chunks=5),
                                                 da.from_array(rstd.reshape(4, 6), chunks=(3, 4))))
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_chunks_of_size_zero_along_a_normalized_axis_count_for_nothing():
    layout = Layout((4, 10), (10,), None, ((2, 2), (0, 0, 0, 4, 0, 6, 0)))
    args = make_args(layout, np.float64)
    with dask.config.set(split_every=2):
        output, *stats = computed(call("native_layer_norm", args.lazy()))
    assert_matches_reference(output, args.x, (10,), args.weight, args.bias)
    assert_stats_within_tolerance(stats, LAYER_NORM, args.x, layout, args.weight, args.bias)


@pytest.mark.parametrize("layout", [WHOLE, SPLIT], ids=["whole", "split"])
def test_byte_swapped_chunks_are_read_as_their_values(layout):
    args = make_args(layout, np.float64)
    swapped = args._replace(x=args.x.astype(">f8"), dy=args.dy.astype(">f8"))
    for name in ("native_layer_norm", "layer_norm_backward", "native_rms_norm"):
        expected = call(name, args)
        for g, e in zip(computed(call(name, swapped.lazy())), expected):
            assert g.dtype == e.dtype
            assert_close(g, e, 1e-13)


def test_bfloat16_chunks_work_as_float16_ones():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed: NumPy has no bfloat16")
    x = make_input((6, 64), np.float32, seed=7).astype(ml_dtypes.bfloat16)
    whole = layernorm.rms_norm(da.from_array(x, chunks=(2, 64)), 64).compute()
    np.testing.assert_array_equal(whole, layernorm.rms_norm(x, 64))
    split = layernorm.rms_norm(da.from_array(x, chunks=(2, 16)), 64).compute()
    assert split.dtype == x.dtype
    # one bfloat16 ulp (2 ** -8 relative) of the float64 truth
    y = _reference.rms_norm(x.astype(np.float32), 64)[0]
    assert np.all(np.abs(split.astype(np.float64) - y) <= 2.0 ** -7 * np.maximum(np.abs(y), 1))


# ---------------------------------------------------------------------------------------------
# Mixed arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [WHOLE, SPLIT], ids=["whole", "split"])
def test_numpy_and_dask_arguments_mix(layout):
    args = make_args(layout, np.float32)
    lazy = args.lazy()
    for name in ("layer_norm_backward", "add_layer_norm"):
        expected = computed(call(name, lazy))
        mixes = [
            lazy._replace(dy=args.dy, residual=args.residual),  # NumPy arrays next to a dask input
            lazy._replace(stats=args.stats),
            lazy._replace(x=args.x),  # only grad_output (residual) is a dask array: its chunks are used
            lazy._replace(weight=da.from_array(args.weight, chunks=(3, 3)), bias=args.bias.tolist()),
            lazy._replace(dy=da.from_array(args.dy, chunks=(4, 5, 8)), residual=da.from_array(args.residual, chunks=4)),
        ]
        for mixed in mixes:
            for g, e in zip(computed(call(name, mixed)), expected):
                np.testing.assert_array_equal(g, e)


def test_a_dask_weight_alone_makes_the_call_lazy():
    args = make_args(WHOLE, np.float64)
    ns = WHOLE.normalized_shape
    y = layernorm.layer_norm(args.x, ns, da.from_array(args.weight), args.bias)
    assert isinstance(y, da.Array)
    np.testing.assert_array_equal(y.compute(), layernorm.layer_norm(args.x, ns, args.weight, args.bias))


WRITING_CALLS = {
    "layer_norm out=": lambda x: layernorm.layer_norm(x, 6, out=np.empty((4, 6), np.float32)),
    "rms_norm out=": lambda x: layernorm.rms_norm(x, 6, out=np.empty((4, 6), np.float32)),
    "add_layer_norm residual_out=": lambda x: layernorm.add_layer_norm(x, x, 6, residual_out=np.empty((4, 6), np.float32)),
    "add_rms_norm out=": lambda x: layernorm.add_rms_norm(x, x, 6, out=np.empty((4, 6), np.float32)),
}


@pytest.mark.parametrize("make_call", WRITING_CALLS.values(), ids=WRITING_CALLS)
def test_out_with_a_dask_input_is_a_type_error_before_anything_is_computed(make_call):
    counting = CountingBlocks(np.ones((4, 6), np.float32), (2, 6))
    with pytest.raises(TypeError, match=r"out=.*dask\.array\.store"):
        make_call(counting.array)
    assert counting.computed == 0


# ---------------------------------------------------------------------------------------------
# Errors: the NumPy call's, raised before a graph exists
# ---------------------------------------------------------------------------------------------

BAD_CALLS = {
    "normalized_shape does not match": lambda x, w: layernorm.layer_norm(x, (7,)),
    "normalized_shape too long": lambda x, w: layernorm.layer_norm(x, (2, 3, 4, 8)),
    "normalized_shape not ints": lambda x, w: layernorm.layer_norm(x, "8"),
    "weight of another shape": lambda x, w: layernorm.layer_norm(x, 8, w[:4]),
    "integer weight": lambda x, w: layernorm.layer_norm(x, 8, w.astype(np.int64)),
    "bad eps": lambda x, w: layernorm.layer_norm(x, 8, eps="small"),
    "grad_output of another shape": lambda x, w: layernorm.layer_norm_backward(x[:2], x, 8, x[..., :1], x[..., :1]),
    "statistics of another shape": lambda x, w: layernorm.layer_norm_backward(x, x, 8, x[:2, ..., :1], x[..., :1]),
    "rstd of another shape": lambda x, w: layernorm.rms_norm_backward(x, x, 8, x[..., :2]),
    "axis out of range": lambda x, w: layernorm.rms_norm(x, 8, axis=3),
    "repeated axis": lambda x, w: layernorm.layer_norm(x, (8, 8), axis=(2, -1)),
    "axis and normalized_shape differ in length": lambda x, w: layernorm.layer_norm(x, 8, axis=(1, 2)),
    "sizes along axis": lambda x, w: layernorm.native_rms_norm(x, 3, axis=1),
    "axis not an int": lambda x, w: layernorm.layer_norm(x, 8, axis=1.5),
    "residual of another shape": lambda x, w: layernorm.add_layer_norm(x, x[:2], 8),
    "residual of another dtype": lambda x, w: layernorm.add_rms_norm(x, x.astype(np.float64), 8),
}


@pytest.mark.parametrize("make_call", BAD_CALLS.values(), ids=BAD_CALLS)
def test_bad_arguments_raise_the_numpy_calls_error(make_call):
    x = make_input((3, 4, 8), np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises((TypeError, ValueError)) as numpy_error:
        make_call(x, w)
    with pytest.raises(type(numpy_error.value)) as dask_error:
        make_call(da.from_array(x, chunks=(2, 4, 3)), da.from_array(w, chunks=3))
    assert str(dask_error.value) == str(numpy_error.value)
    assert dask_error.value.__context__ is None  # no error of the stand-ins' shapes before it


@pytest.mark.parametrize("call", [
    "layernorm.layer_norm(x, 8, w)",
    "layernorm.layer_norm(x, 8, None, w)",
    "layernorm.rms_norm(x, 8, w)",
    "layernorm.layer_norm_backward(x, x, 8, x[:, :1], x[:, :1], w)",
    "layernorm.add_rms_norm(x, x, 8, w)",
])
def test_a_dask_parameter_of_a_wrong_and_huge_shape_is_refused_without_memory(call):
    # 2 GiB of float64 parameter for rows of 8: the shape alone refuses it
    setup = ("import dask.array as da; x = da.ones((4, 8), chunks=2, dtype=np.float32); "
             "w = da.zeros(2**28, chunks=2**26, dtype=np.float64)")
    outcome = run_in_child(call, setup, memory=2**30)
    assert (outcome.error, outcome.message) == (
        "ValueError", "Expected {} to be of same shape as normalized_shape, but got {} of shape [268435456] and "
        "normalized_shape = [8]".format(*["bias" if "None, w" in call else "weight"] * 2))
    assert outcome.peak_growth < 64 * 2**20


def test_a_negative_eps_gives_nan_without_warnings_on_split_rows():
    x = make_input((4, 8), np.float32, scale=0.5)
    expected = layernorm.layer_norm(x, 8, eps=-0.5)  # rows of variance below 0.5: NaN
    assert np.isnan(expected).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = layernorm.layer_norm(da.from_array(x, chunks=(3, 4)), 8, eps=-0.5).compute()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))


MASKED_CALLS = {
    "layer_norm input": lambda m, x, w: layernorm.layer_norm(m, 8),
    "rms_norm weight": lambda m, x, w: layernorm.rms_norm(x, 8, da.ma.masked_array(w, w < 0)),
    "layer_norm_backward grad_output": lambda m, x, w: layernorm.layer_norm_backward(m, x, 8, x[..., :1], x[..., :1]),
    "add_layer_norm residual": lambda m, x, w: layernorm.add_layer_norm(x, m, 8),
    "LayerNorm": lambda m, x, w: layernorm.LayerNorm(8)(m),
}


@pytest.mark.parametrize("chunks", [(2, 4, 8), (2, 4, 3)], ids=["whole rows", "split rows"])
@pytest.mark.parametrize("make_call", MASKED_CALLS.values(), ids=MASKED_CALLS)
def test_masked_chunks_are_refused_when_the_call_is_made(make_call, chunks):
    # which elements are masked is known only once computed, and the kernels would read the
    # values under the mask (split rows were normalized over them, mask dropped)
    x = da.from_array(make_input((3, 4, 8), np.float32), chunks=chunks)
    masked = da.ma.masked_array(x, x > 1)
    w = da.from_array(np.ones(8, np.float32), chunks=chunks[-1])
    with pytest.raises(ValueError, match=re.escape("dask arrays of masked arrays (dask.array.ma) are not "
                                                   "supported (the kernels would read the values under the mask)")):
        make_call(masked, x, w)


def test_an_integer_input_is_refused_as_numpy_refuses_it():
    x = np.arange(12).reshape(3, 4)
    with pytest.raises(TypeError) as numpy_error:
        layernorm.layer_norm(x, 4)
    with pytest.raises(TypeError) as dask_error:
        layernorm.layer_norm(da.from_array(x, chunks=2), 4)
    assert str(dask_error.value) == str(numpy_error.value)


# ---------------------------------------------------------------------------------------------
# Unknown chunk sizes
# ---------------------------------------------------------------------------------------------


def test_unknown_chunk_sizes_along_the_batch_axes_are_fine():
    args = make_args(Layout((20, 6), (6,), None, (6, 6)), np.float32)
    keep = args.x[:, 0] > 0
    filtered = args.lazy().x[da.from_array(keep, chunks=6)]
    assert math.isnan(filtered.shape[0])
    for kind in KINDS:
        params = (args.weight, args.bias) if kind.centred else (args.weight,)
        expected = kind.native(args.x[keep], 6, *params)
        for g, e in zip(computed(kind.native(filtered, 6, *params)), expected):
            np.testing.assert_array_equal(g, e)


def filtered_rows(x, chunks):
    """x's rows whose first element is positive, as NumPy and as dask of unknown row chunks."""
    keep = x[:, 0] > 0
    filtered = da.from_array(x, chunks=chunks)[da.from_array(keep, chunks=chunks[0])]
    assert math.isnan(filtered.shape[0])
    return x[keep], filtered


# calls with the input of unknown row chunks and one argument as NumPy (True) or dask (False)
UNKNOWN_ROWS_CALLS = {
    "add_layer_norm residual": lambda x, xd, numpy: layernorm.add_layer_norm(xd, x if numpy else xd, 6),
    "add_rms_norm residual": lambda x, xd, numpy: layernorm.add_rms_norm(xd, x if numpy else xd, 6),
    "layer_norm_backward grad_output": lambda x, xd, numpy: layernorm.layer_norm_backward(
        x if numpy else xd, xd, 6, *layernorm.native_layer_norm(xd, 6)[1:]),
    "layer_norm_backward statistics": lambda x, xd, numpy: layernorm.layer_norm_backward(
        xd, xd, 6, *(layernorm.native_layer_norm(x if numpy else xd, 6)[1:])),
    "rms_norm_backward rstd": lambda x, xd, numpy: layernorm.rms_norm_backward(
        xd, xd, 6, layernorm.native_rms_norm(x if numpy else xd, 6)[1]),
}


@pytest.mark.parametrize("make_call", UNKNOWN_ROWS_CALLS.values(), ids=UNKNOWN_ROWS_CALLS)
def test_unknown_row_chunks_with_a_numpy_argument_say_what_to_pass(make_call):
    x, filtered = filtered_rows(make_input((20, 6), np.float32), (6, 6))
    with pytest.raises(ValueError, match=r"chunks of unknown size along axis 0 .* pass \w+ as a dask array"):
        make_call(x, filtered, True)
    numpy_results = make_call(x, x, True)
    for got, expected in zip(computed(make_call(x, filtered, False)), numpy_results):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("add", [layernorm.add_layer_norm, layernorm.add_rms_norm], ids=lambda f: f.__name__)
@pytest.mark.parametrize("row_chunk", [6, 3], ids=["whole-rows", "split-rows"])
def test_a_residual_of_other_unknown_row_chunks_is_refused(add, row_chunk):
    """Input and residual filtered by different masks: their row chunks, unknown when the
    graph is built, differ, and computing refuses them (a chunk of 1 row would broadcast)."""
    x = make_input((8, 6), np.float32)
    xd = da.from_array(x, chunks=(4, row_chunk))
    input = xd[da.from_array(np.array([1, 0, 0, 0, 1, 1, 1, 1], bool), chunks=4)]
    residual = xd[da.from_array(np.array([1, 0, 0, 0, 1, 0, 0, 0], bool), chunks=4)]
    with pytest.raises(ValueError, match=r"residual has .*shape \[1, \d\], but input has .*shape \[[14], \d\]"):
        computed(add(input, residual, 6))


def test_unknown_chunk_sizes_along_a_normalized_axis_say_to_compute_them():
    x = da.from_array(make_input((4, 20), np.float32), chunks=(2, 5))
    filtered = x[:, da.from_array(np.arange(20) % 3 > 0, chunks=5)]
    with pytest.raises(ValueError, match=r"compute_chunk_sizes\(\)"):
        layernorm.layer_norm(filtered, filtered.shape[1:])
    with pytest.raises(ValueError, match=r"compute_chunk_sizes\(\)"):
        layernorm.layer_norm(filtered, 13)
    filtered.compute_chunk_sizes()
    assert layernorm.layer_norm(filtered, 13).compute().shape == (4, 13)


# ---------------------------------------------------------------------------------------------
# Graph hygiene
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [WHOLE, SPLIT], ids=["whole", "split"])
def test_task_names_are_deterministic_and_change_with_every_argument(layout):
    args = make_args(layout, np.float32)
    ns = layout.normalized_shape

    def names(x=None, normalized_shape=ns, weight=args.weight, bias=args.bias, eps=1e-5, axis=None):
        x = da.from_array(args.x, chunks=layout.chunks) if x is None else x
        results = layernorm.native_layer_norm(x, normalized_shape, weight, bias, eps, axis=axis)
        return tuple(result.name for result in results)

    first = names()
    assert names() == first
    other_weight = args.weight.copy()
    other_weight[0] += 1
    changes_all = [
        names(eps=1e-6),
        names(x=da.from_array(args.x + 1, chunks=layout.chunks)),
        names(x=da.from_array(args.x, chunks=(3, 5, 8))),
        names(normalized_shape=(8,), weight=None, bias=None),
        names(normalized_shape=(12,), weight=None, bias=None, axis=0),
    ]
    for variant in changes_all:
        assert not set(variant) & set(first)
    for variant in [names(weight=other_weight), names(weight=None)]:  # the statistics need no weight
        assert variant[0] != first[0]
    rms = [layernorm.native_rms_norm(da.from_array(args.x, chunks=layout.chunks), ns, args.weight, eps)
           for eps in (None, None, 1e-6)]
    assert rms[0][0].name == rms[1][0].name != rms[2][0].name


def _python_calls_to_build(rows):
    """How many Python functions run while native_layer_norm builds its graph over rows x 4
    chunks; and the array's CountingBlocks.  A count, unlike a time, does not depend on the
    machine's load."""
    counting = CountingBlocks(np.zeros((rows, 64), np.float32), (1, 16))
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        results = layernorm.native_layer_norm(counting.array, 64)
    finally:
        sys.setprofile(None)
    assert all(isinstance(result, da.Array) for result in results)
    return calls, counting


def test_calls_on_many_chunks_build_their_graph_in_linear_work_and_compute_nothing():
    small, _ = _python_calls_to_build(1000)
    large, counting = _python_calls_to_build(4000)  # 16000 chunks
    assert counting.computed == 0
    # linear work gives about 4x the calls (a fixed part makes it less); work quadratic in the
    # chunks, 16x
    assert large < 5 * small, (small, large)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


MODULES = {
    "LayerNorm": lambda: layernorm.LayerNorm(8),
    "RMSNorm": lambda: layernorm.RMSNorm(8),
    "LayerNorm, axis=1": lambda: layernorm.LayerNorm(8, axis=1),
}


@pytest.mark.parametrize("chunks", [(4, 8, 3), (4, 3, 3)], ids=["whole", "split"])
@pytest.mark.parametrize("make_module", MODULES.values(), ids=MODULES)
def test_module_on_a_dask_array_is_lazy_and_its_backward_matches_numpys(make_module, chunks):
    eager, lazy = make_module(), make_module()
    shape = (10, 8, 3) if eager.axis == 1 else (10, 3, 8)
    chunks = chunks if eager.axis == 1 else (chunks[0], chunks[2], chunks[1])
    x = make_input(shape, np.float32, seed=5)
    dy = make_input(shape, np.float32, seed=6)
    eager.weight[:] = np.linspace(0.5, 2, 8)
    lazy.load_state_dict(eager.state_dict())
    expected_output, expected_grad = eager(x), eager.backward(dy)
    counting = CountingBlocks(x, chunks)
    output = lazy(counting.array)
    assert isinstance(output, da.Array) and counting.computed == 0
    grad = lazy.backward(da.from_array(dy, chunks=chunks))
    assert isinstance(grad, da.Array)
    tol = dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(output.compute(), expected_output, **tol)
    np.testing.assert_allclose(grad.compute(), expected_grad, **tol)
    for _, grad_name, _ in eager._PARAMETERS:
        assert isinstance(getattr(lazy, grad_name), np.ndarray)
        np.testing.assert_allclose(getattr(lazy, grad_name), getattr(eager, grad_name), **tol)
    if 8 in chunks:  # rows held whole: the NumPy path's bits
        np.testing.assert_array_equal(output.compute(), expected_output)
        np.testing.assert_array_equal(grad.compute(), expected_grad)
    lazy.eval()
    assert isinstance(lazy(counting.array), da.Array)


def test_module_output_keeps_the_parameters_of_the_call_and_backward_sees_changes():
    x = make_input((6, 4), np.float64)
    module = layernorm.LayerNorm(4, dtype=np.float64)
    output = module(da.from_array(x, chunks=(3, 4)))
    expected = layernorm.layer_norm(x, 4, module.weight, module.bias)
    module.weight += 1  # after the call: the lazy output is the call's
    np.testing.assert_array_equal(output.compute(), expected)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        module.backward(np.ones_like(x))


# ---------------------------------------------------------------------------------------------
# Threads, import hygiene, the distributed scheduler, the example
# ---------------------------------------------------------------------------------------------


def run_child(code, **environment):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPOSITORY, env=dict(os.environ, PYTHONPATH=REPOSITORY, **environment))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_numpy_calls_never_import_dask():
    run_child(
        "import sys, numpy as np, layernorm\n"
        "x = np.ones((4, 8))\n"
        "y, mean, rstd = layernorm.native_layer_norm(x, 8)\n"
        "layernorm.layer_norm(x.tolist(), 8, axis=1)\n"
        "layernorm.layer_norm_backward(x, x, 8, mean, rstd)\n"
        "y, rstd = layernorm.native_rms_norm(x, 8)\n"
        "layernorm.rms_norm(x.tolist(), 8)\n"
        "layernorm.rms_norm_backward(x, x, 8, rstd)\n"
        "layernorm.add_layer_norm(x, x.tolist(), 8)\n"
        "layernorm.add_rms_norm(x, x.tolist(), 8)\n"
        "for module in (layernorm.LayerNorm(8), layernorm.RMSNorm(8)):\n"
        "    module(x.tolist()); module.backward(x)\n"
        "loaded = [name for name in sys.modules if name.split('.')[0] == 'dask' or name == 'layernorm._dask']\n"
        "assert not loaded, loaded\n"
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
@pytest.mark.parametrize("pool", [1, 3])
def test_dask_threads_share_one_kernel_pool(pool):
    # n dask threads calling the kernel at once use at most n + pool - 1 threads: the pool is
    # one per process, and a call that finds it busy runs alone on its own thread.
    out = run_child(
        "import os, threading, numpy as np, dask, dask.array as da, layernorm\n"
        f"layernorm.set_num_threads({pool})\n"
        "native = lambda: len(os.listdir('/proc/self/task')) - threading.active_count()\n"
        "x = da.from_array(np.ones((8192, 1024), np.float32), chunks=(1024, 1024))\n"
        "with dask.config.set(scheduler='threads', num_workers=4):\n"
        "    (x * 1).compute()\n"
        "    before = native()\n"
        "    layernorm.layer_norm(x, 1024).compute()\n"
        "    layernorm.layer_norm(x, 1024).compute()\n"
        "    print(native() - before)\n"
    )
    assert int(out) == pool - 1


@pytest.fixture(scope="module")
def cluster_client():
    distributed = pytest.importorskip("dask.distributed", reason="dask.distributed is not installed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  memory_limit=0) as cluster, distributed.Client(cluster) as client:
        yield client


# (older dask warns about the threaded scheduler's run while the cluster's client exists)
@pytest.mark.filterwarnings("ignore:Running on a single-machine scheduler")
@pytest.mark.parametrize("layout", [WHOLE, SPLIT, SPLIT_ROWS["axis=(2, 1)"]], ids=["whole", "split", "split-axis"])
def test_a_process_cluster_computes_what_the_threaded_scheduler_does(cluster_client, layout):
    lazy = make_args(layout, np.float32).lazy(params="dask")
    results = [result for name in CALLS for result in call(name, lazy)]
    expected = dask.compute(*results, scheduler="threads")
    for g, e in zip(cluster_client.compute(results, sync=True), expected):
        np.testing.assert_array_equal(g, e)


def test_the_larger_than_memory_example_stays_within_a_few_chunks():
    # 128 MiB in chunks of 1 MiB; the example fails if its anonymous memory grows by more
    # than --memory-limit, and checks rows of its output against NumPy
    result = subprocess.run(
        [sys.executable, os.path.join(REPOSITORY, "examples", "dask_larger_than_memory.py"),
         "--rows", "131072", "--cols", "256", "--chunk-rows", "1024", "--memory-limit", "32"],
        capture_output=True, text=True, timeout=120, cwd=REPOSITORY, env=dict(os.environ, PYTHONPATH=REPOSITORY),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bit-identical" in result.stdout
    if "not measured" not in result.stdout:
        added = float(re.search(r"(\d+) MiB above", result.stdout).group(1))
        assert added <= 32
