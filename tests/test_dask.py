"""Dask arrays through the norm family: lazy dask arrays out, the NumPy call's bits where each
chunk holds whole rows, the float64 truth's tolerance where rows are split across chunks."""

import math
import os
import re
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import pytest

da = pytest.importorskip("dask.array", reason="dask is not installed: pip install 'dask[array,distributed]'")
import dask  # noqa: E402

import layernorm  # noqa: E402
from layernorm import _reference  # noqa: E402

from helpers import FLOAT_DTYPES, REF_REL_TOL, assert_within, dtype_id, f16_ulp, make_input, param_dtype  # noqa: E402

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------------------------
# The family's calls, on NumPy or dask arguments alike
# ---------------------------------------------------------------------------------------------


class Args(NamedTuple):
    """A family call's array arguments, NumPy or dask, and its normalized_shape."""

    x: object
    dy: object
    mean: object
    rstd: object
    weight: object
    bias: object
    normalized_shape: tuple

    def lazy(self, chunks, params="numpy"):
        """The same values as dask arrays of `chunks` (the statistics: size-1 chunks on the
        normalized axes); the parameters stay NumPy, or become dask arrays split in two
        along their first axis with params="dask"."""
        axes = normalized_axes(self)
        stats_chunks = tuple(1 if a in axes else c for a, c in enumerate(chunks))

        def param(value):
            if value is None or params == "numpy":
                return value
            return da.from_array(value, chunks=tuple(max(1, -(-n // 2)) for n in value.shape))

        return self._replace(
            x=da.from_array(self.x, chunks=chunks), dy=da.from_array(self.dy, chunks=chunks),
            mean=da.from_array(self.mean, chunks=stats_chunks), rstd=da.from_array(self.rstd, chunks=stats_chunks),
            weight=param(self.weight), bias=param(self.bias),
        )


def normalized_axes(args):
    return tuple(range(args.x.ndim - len(args.normalized_shape), args.x.ndim))


def make_args(shape, normalized_shape, dtype, affine="weight+bias", seed=0, offset=0.0):
    x = make_input(shape, dtype, seed=seed, offset=offset)
    dy = make_input(shape, dtype, seed=seed + 1)
    rng = np.random.default_rng(seed + 2)
    weight = (1 + 0.5 * rng.standard_normal(normalized_shape)).astype(param_dtype(dtype))
    bias = rng.standard_normal(normalized_shape).astype(param_dtype(dtype))
    weight = weight if "weight" in affine else None
    bias = bias if "bias" in affine else None
    _, mean, rstd = layernorm.native_layer_norm(x, normalized_shape, weight, bias)
    return Args(x, dy, mean, rstd, weight, bias, tuple(normalized_shape))


# name: (call, the kinds of its outputs: "row" (the input's shape), "stat" or "grad" (a
# parameter's gradient)); a single kind means the call returns an array, not a tuple
CALLS = {
    "layer_norm": (lambda a: layernorm.layer_norm(a.x, a.normalized_shape, a.weight, a.bias), ("row",)),
    "native_layer_norm": (
        lambda a: layernorm.native_layer_norm(a.x, a.normalized_shape, a.weight, a.bias),
        ("row", "stat", "stat"),
    ),
    "layer_norm_backward": (
        lambda a: layernorm.layer_norm_backward(a.dy, a.x, a.normalized_shape, a.mean, a.rstd, a.weight, a.bias),
        ("row", "grad", "grad"),
    ),
}


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


# Chunkings of a (12, 5, 8) input normalized over its last two axes.
WHOLE_ROWS = {"rows of 5": (5, 5, 8), "rows of 1": (1, 5, 8), "uneven": ((7, 4, 1), 5, 8)}
SPLIT_ROWS = {"last axis": (5, 5, 3), "both axes": (5, 2, 3), "uneven": ((7, 5), (1, 4), (6, 2)),
              "one row per chunk": (12, 1, 8)}
SHAPE, NORMALIZED = (12, 5, 8), (5, 8)


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


@pytest.mark.parametrize("chunks", [WHOLE_ROWS["rows of 5"], SPLIT_ROWS["both axes"]], ids=["whole", "split"])
@pytest.mark.parametrize("name", CALLS)
def test_results_are_lazy_dask_arrays_with_the_numpy_calls_shapes_dtypes_and_chunks(name, chunks):
    args = make_args(SHAPE, NORMALIZED, np.float32)
    expected = call(name, args)
    lazy = args.lazy(chunks)
    counting = CountingBlocks(args.x, chunks)
    results = call(name, lazy._replace(x=counting.array))
    assert counting.computed == 0
    for kind, result, want in zip(CALLS[name][1], results, expected):
        assert isinstance(result, da.Array)
        assert (result.shape, result.dtype) == (want.shape, want.dtype)
        assert type(result._meta) is np.ndarray and result._meta.dtype == want.dtype
        assert result._meta.ndim == want.ndim
        if kind == "row":
            assert result.chunks == counting.array.chunks
        elif kind == "stat":
            assert result.chunks == tuple((1,) if a >= 1 else c for a, c in enumerate(counting.array.chunks))


def test_output_mask_and_missing_parameters_give_none_as_numpy_does():
    args = make_args(SHAPE, NORMALIZED, np.float64, affine="weight")
    lazy = args.lazy(SPLIT_ROWS["both axes"])
    for mask in [(True, True, True), (False, True, True), (True, False, True), (False, False, False)]:
        expected = layernorm.layer_norm_backward(args.dy, args.x, NORMALIZED, args.mean, args.rstd, args.weight, None, mask)
        got = layernorm.layer_norm_backward(lazy.dy, lazy.x, NORMALIZED, lazy.mean, lazy.rstd, lazy.weight, None, mask)
        assert [g is None for g in got] == [e is None for e in expected]
        for g, e in zip(computed([g for g in got if g is not None]), [e for e in expected if e is not None]):
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Rows held whole: the NumPy call's bits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("chunks", WHOLE_ROWS.values(), ids=WHOLE_ROWS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", CALLS)
def test_rows_held_whole_give_the_numpy_calls_bits(name, dtype, chunks, affine):
    args = make_args(SHAPE, NORMALIZED, dtype, affine=affine)
    expected = call(name, args)
    got = computed(call(name, args.lazy(chunks, params="dask")))
    for kind, g, e in zip(CALLS[name][1], got, expected):
        if e is None:
            assert g is None
        elif kind == "grad":
            # per-chunk sums added up: the float64 truth's tolerance, not the bits
            assert g.dtype == e.dtype
            np.testing.assert_allclose(g, e, rtol=4 * np.finfo(e.dtype).eps, atol=4 * np.finfo(e.dtype).eps)
        else:
            assert g.dtype == e.dtype
            np.testing.assert_array_equal(g, e)


def test_rows_held_whole_run_one_task_per_chunk_and_nothing_else():
    args = make_args(SHAPE, NORMALIZED, np.float32)
    x = da.from_array(args.x, chunks=WHOLE_ROWS["rows of 5"])
    y = layernorm.layer_norm(x, NORMALIZED, args.weight, args.bias)
    added = set(dict(y.__dask_graph__())) - set(dict(x.__dask_graph__()))
    kernel_tasks = [key for key in added if key[0] == y.name]
    assert len(kernel_tasks) == x.npartitions
    assert len(added) - len(kernel_tasks) <= 2  # the weight and the bias, once each


# ---------------------------------------------------------------------------------------------
# Normalized axes split across chunks: the float64 truth's tolerance
# ---------------------------------------------------------------------------------------------


def assert_forward_within_tolerance(output, mean, rstd, x, normalized_shape, weight, bias):
    dtype = np.dtype(output.dtype)
    y, ref_mean, ref_rstd = _reference.layer_norm(x, normalized_shape, weight, bias)
    tol = REF_REL_TOL[dtype] * _reference.output_scale(x, normalized_shape, weight, bias)
    if dtype == np.float16:
        tol = tol + f16_ulp(y)
    assert_within(output, y, tol, f"{dtype.name} output")
    if mean is not None:
        # rounded once to their dtype; float64 ones as close as the kernel's own (REF_REL_TOL)
        stat_tol = max(2 * float(np.finfo(mean.dtype).eps), REF_REL_TOL[dtype])
        assert_within(mean, ref_mean, stat_tol * (np.abs(ref_mean) + 1 / ref_rstd), "mean")
        assert_within(rstd, ref_rstd, stat_tol * ref_rstd, "rstd")


@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
@pytest.mark.parametrize("chunks", SPLIT_ROWS.values(), ids=SPLIT_ROWS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_split_rows_forward_is_within_the_float64_truths_tolerance(dtype, chunks, affine):
    args = make_args(SHAPE, NORMALIZED, dtype, affine=affine, offset=0.5)
    lazy = args.lazy(chunks, params="dask")
    output = layernorm.layer_norm(lazy.x, NORMALIZED, lazy.weight, lazy.bias).compute()
    assert_forward_within_tolerance(output, None, None, args.x, NORMALIZED, args.weight, args.bias)
    output, mean, rstd = computed(layernorm.native_layer_norm(lazy.x, NORMALIZED, lazy.weight, lazy.bias))
    assert_forward_within_tolerance(output, mean, rstd, args.x, NORMALIZED, args.weight, args.bias)


@pytest.mark.parametrize("dtype, offset", [(np.float64, 1e6), (np.float32, 1e4), (np.float16, 1e2)],
                         ids=["float64-offset1e6", "float32-offset1e4", "float16-offset1e2"])
def test_split_rows_keep_their_digits_at_a_large_offset(dtype, offset):
    x = make_input((4, 6000), dtype, seed=3, scale=1.0, offset=offset)
    output, mean, rstd = computed(layernorm.native_layer_norm(da.from_array(x, chunks=(2, 700)), 6000))
    assert_forward_within_tolerance(output, mean, rstd, x, (6000,), None, None)
    if dtype == np.float64:
        # the kernel's own float64 promise (tests/test_accuracy.py)
        y, _, _ = _reference.layer_norm(x, 6000)
        assert np.abs(output - y).max() <= 1e-13 + 4 * np.finfo(np.float64).eps * offset


def backward_tolerance(dtype):
    return {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[np.dtype(dtype).type]


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("chunks", SPLIT_ROWS.values(), ids=SPLIT_ROWS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_split_rows_backward_is_within_the_float64_truths_tolerance(dtype, chunks, affine):
    args = make_args(SHAPE, NORMALIZED, dtype, affine=affine, offset=0.5)
    got = computed(call("layer_norm_backward", args.lazy(chunks, params="dask")))
    # the exact gradients for exactly these arguments (statistics rounded as given)
    wants = _reference.layer_norm_backward_given_stats(args.dy, args.x, NORMALIZED, args.mean, args.rstd, args.weight)
    x64, dy64 = args.x.astype(np.float64), np.abs(args.dy.astype(np.float64))
    xhat = np.abs((x64 - args.mean) * args.rstd)
    w = np.ones(()) if args.weight is None else np.abs(args.weight.astype(np.float64))
    scales = (args.rstd * (dy64 * w).max(axis=(1, 2), keepdims=True) * (1 + xhat.max(axis=(1, 2), keepdims=True)),
              (dy64 * xhat).sum(axis=0), dy64.sum(axis=0))
    tol = backward_tolerance(dtype)
    for what, g, want, scale, present in zip(("grad_input", "grad_weight", "grad_bias"), got, wants, scales,
                                             (True, args.weight is not None, args.bias is not None)):
        if not present:
            assert g is None
            continue
        assert_within(g, want, tol * np.maximum(scale, 1.0), what)


def test_empty_rows_split_across_chunks_give_the_kernels_answer():
    x = np.zeros((3, 0, 4), np.float32)
    expected = layernorm.native_layer_norm(x, (0, 4))
    got = computed(layernorm.native_layer_norm(da.from_array(x, chunks=(1, 1, 2)), (0, 4)))
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_chunks_of_size_zero_along_a_normalized_axis_count_for_nothing():
    args = make_args((4, 10), (10,), np.float64)
    x = da.from_array(args.x, chunks=((2, 2), (0, 0, 0, 4, 0, 6, 0)))
    with dask.config.set(split_every=2):
        output, mean, rstd = computed(layernorm.native_layer_norm(x, 10, args.weight, args.bias))
    assert_forward_within_tolerance(output, mean, rstd, args.x, (10,), args.weight, args.bias)


# ---------------------------------------------------------------------------------------------
# Mixed arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [WHOLE_ROWS["rows of 5"], SPLIT_ROWS["both axes"]], ids=["whole", "split"])
def test_numpy_and_dask_arguments_mix(chunks):
    args = make_args(SHAPE, NORMALIZED, np.float32)
    lazy = args.lazy(chunks)
    expected = computed(call("layer_norm_backward", lazy))
    mixes = [
        lazy._replace(dy=args.dy),  # a NumPy grad_output next to a dask input
        lazy._replace(mean=args.mean, rstd=args.rstd),
        lazy._replace(x=args.x),  # only grad_output is a dask array: its chunks are used
        lazy._replace(weight=da.from_array(args.weight, chunks=(3, 3)), bias=args.bias.tolist()),
        lazy._replace(dy=da.from_array(args.dy, chunks=(4, 5, 8))),  # other chunks: rechunked
    ]
    for mixed in mixes:
        for g, e in zip(computed(call("layer_norm_backward", mixed)), expected):
            np.testing.assert_array_equal(g, e)


def test_a_dask_weight_alone_makes_the_call_lazy():
    args = make_args(SHAPE, NORMALIZED, np.float64)
    y = layernorm.layer_norm(args.x, NORMALIZED, da.from_array(args.weight), args.bias)
    assert isinstance(y, da.Array)
    np.testing.assert_array_equal(y.compute(), layernorm.layer_norm(args.x, NORMALIZED, args.weight, args.bias))


def test_out_with_a_dask_input_is_a_type_error_before_anything_is_computed():
    x = np.ones((4, 6), np.float32)
    counting = CountingBlocks(x, (2, 6))
    with pytest.raises(TypeError, match=r"out=.*dask\.array\.store"):
        layernorm.layer_norm(counting.array, 6, out=np.empty_like(x))
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
    args = make_args((20, 6), (6,), np.float32)
    x = da.from_array(args.x, chunks=(6, 6))
    keep = args.x[:, 0] > 0
    filtered = x[da.from_array(keep, chunks=6)]
    assert math.isnan(filtered.shape[0])
    output, mean, rstd = layernorm.native_layer_norm(filtered, 6, args.weight, args.bias)
    for g, e in zip(computed((output, mean, rstd)), layernorm.native_layer_norm(args.x[keep], 6, args.weight, args.bias)):
        np.testing.assert_array_equal(g, e)


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


@pytest.mark.parametrize("chunks", [WHOLE_ROWS["rows of 5"], SPLIT_ROWS["both axes"]], ids=["whole", "split"])
def test_task_names_are_deterministic_and_change_with_every_argument(chunks):
    args = make_args(SHAPE, NORMALIZED, np.float32)

    def names(x=None, normalized_shape=NORMALIZED, weight=args.weight, bias=args.bias, eps=1e-5):
        x = da.from_array(args.x, chunks=chunks) if x is None else x
        results = layernorm.native_layer_norm(x, normalized_shape, weight, bias, eps)
        return tuple(result.name for result in results), set(dict(results[0].__dask_graph__()))

    first = names()
    assert names() == first
    other_weight = args.weight.copy()
    other_weight[0] += 1
    changes_all = [
        names(eps=1e-6),
        names(x=da.from_array(args.x + 1, chunks=chunks)),
        names(x=da.from_array(args.x, chunks=(3, 5, 8))),
        names(normalized_shape=(8,), weight=None, bias=None),
    ]
    for variant in changes_all:
        assert not set(variant[0]) & set(first[0])
    for variant in [names(weight=other_weight), names(weight=None)]:  # the statistics need no weight
        assert variant[0][0] != first[0][0]


def test_calls_on_many_chunks_build_their_graph_quickly_and_compute_nothing():
    counting = CountingBlocks(np.zeros((4000, 64), np.float32), (1, 16))  # 16000 chunks, rows split
    started = time.perf_counter()
    results = layernorm.native_layer_norm(counting.array, 64)
    assert time.perf_counter() - started < 5
    assert counting.computed == 0
    assert all(isinstance(result, da.Array) for result in results)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [(4, 8), (4, 3)], ids=["whole", "split"])
def test_module_on_a_dask_array_is_lazy_and_its_backward_matches_numpys(chunks):
    x = make_input((10, 8), np.float32, seed=5)
    dy = make_input((10, 8), np.float32, seed=6)
    eager, lazy = layernorm.LayerNorm(8), layernorm.LayerNorm(8)
    eager.weight[:] = np.linspace(0.5, 2, 8)
    lazy.load_state_dict(eager.state_dict())
    expected_output, expected_grad = eager(x), eager.backward(dy)
    counting = CountingBlocks(x, chunks)
    output = lazy(counting.array)
    assert isinstance(output, da.Array) and counting.computed == 0
    grad = lazy.backward(da.from_array(dy, chunks=chunks))
    assert isinstance(grad, da.Array)
    assert isinstance(lazy.weight_grad, np.ndarray) and isinstance(lazy.bias_grad, np.ndarray)
    tol = dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(output.compute(), expected_output, **tol)
    np.testing.assert_allclose(grad.compute(), expected_grad, **tol)
    np.testing.assert_allclose(lazy.weight_grad, eager.weight_grad, **tol)
    np.testing.assert_allclose(lazy.bias_grad, eager.bias_grad, **tol)
    if chunks == (4, 8):
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
        "x = np.ones((4, 8), np.float32)\n"
        "y, mean, rstd = layernorm.native_layer_norm(x, 8)\n"
        "layernorm.layer_norm(x.tolist(), 8)\n"
        "layernorm.layer_norm_backward(x, x, 8, mean, rstd)\n"
        "module = layernorm.LayerNorm(8)\n"
        "module(x); module.backward(x)\n"
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
@pytest.mark.parametrize("chunks", [WHOLE_ROWS["rows of 5"], SPLIT_ROWS["both axes"]], ids=["whole", "split"])
def test_a_process_cluster_computes_what_the_threaded_scheduler_does(cluster_client, chunks):
    args = make_args(SHAPE, NORMALIZED, np.float32)
    lazy = args.lazy(chunks, params="dask")
    for name in CALLS:
        results = call(name, lazy)
        expected = dask.compute(*results, scheduler="threads")
        got = cluster_client.compute(list(results), sync=True)
        for g, e in zip(got, expected):
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
