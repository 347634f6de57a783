"""Runtime controls: every SIMD level and every thread count gives the same bits, forward and
backward, for every route of the norm family (LayerNorm, RMSNorm, strided axes, the fused residual
add), and those bits match layernorm._reference; the controls' own errors; environment
variables honoured at import.
"""

import os
import subprocess
import sys
from typing import Any, NamedTuple, Tuple

import numpy as np
import pytest

import layernorm
from helpers import (
    FLOAT_DTYPES,
    LAYER_NORM,
    RMS_NORM,
    NormKind,
    assert_backward_matches_reference,
    assert_matches_reference,
    dtype_id,
    dtype_named,
    make_backward_data,
    make_input,
    make_params,
    param_dtype,
    requires_ml_dtypes,
    same_bits,
)
from layernorm import LayerNorm

LEVELS = layernorm.available_simd_levels()
# Every level name of any build, slowest first: the 128-bit level is sse2 on x86-64, neon on aarch64.
ALL_LEVEL_NAMES = ("scalar", "sse2", "neon", "avx2", "avx512", "avx512bf16")

# Row lengths 0 .. 2 * 16 + 1: every tail length up to twice the widest vector (16 float32
# lanes in AVX-512), so each SIMD body + scalar tail split is exercised.
ROW_LENGTHS = list(range(0, 2 * 16 + 2))


def test_available_levels_shape():
    assert isinstance(LEVELS, tuple)
    assert LEVELS[0] == "scalar"
    assert list(LEVELS) == [name for name in ALL_LEVEL_NAMES if name in LEVELS]
    assert len(set(LEVELS)) == len(LEVELS)
    assert layernorm.simd_level() in LEVELS


@pytest.mark.parametrize("level", LEVELS)
def test_set_simd_level_round_trip(level, restore_runtime):
    assert layernorm.set_simd_level(level) is None
    assert layernorm.simd_level() == level


@pytest.mark.parametrize("level", [n for n in ALL_LEVEL_NAMES if n not in LEVELS] or ["<none>"])
def test_unsupported_level_raises(level, restore_runtime):
    if level == "<none>":
        pytest.skip("this CPU runs every level")
    with pytest.raises(ValueError):
        layernorm.set_simd_level(level)


@pytest.mark.parametrize("n", [0, -1, -100])
def test_set_num_threads_below_one(n, restore_runtime):
    before = layernorm.get_num_threads()
    with pytest.raises(ValueError):
        layernorm.set_num_threads(n)
    assert layernorm.get_num_threads() == before


@pytest.mark.parametrize("n", ["2", None, 2.5])
def test_set_num_threads_not_int(n, restore_runtime):
    with pytest.raises(TypeError):
        layernorm.set_num_threads(n)


@pytest.mark.parametrize("name", ["", "AVX2x", "fast", "sse9000", "avx1024"])
def test_set_simd_level_unknown(name, restore_runtime):
    before = layernorm.simd_level()
    with pytest.raises(ValueError):
        layernorm.set_simd_level(name)
    assert layernorm.simd_level() == before


def _run_all_levels(fn):
    """fn() under each available SIMD level -> {level: result}."""
    results = {}
    for level in LEVELS:
        layernorm.set_simd_level(level)
        assert layernorm.simd_level() == level
        results[level] = fn()
    return results


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("n", ROW_LENGTHS, ids=[f"N{n}" for n in ROW_LENGTHS])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_levels_bit_identical_and_correct(dtype, n, affine, restore_runtime):
    # 5 rows, the input starting one element past a fresh buffer so vector loads are unaligned.
    base = make_input((5, n), dtype, seed=n)
    buf = np.zeros(base.size + 1, dtype)
    x = buf[1:].reshape(5, n)
    x[...] = base
    w, b = make_params((n,), param_dtype(dtype), affine)
    results = _run_all_levels(lambda: layernorm.native_layer_norm(x, (n,), w, b, 1e-5))
    first = results[LEVELS[0]]
    for level, (out, mean, rstd) in results.items():
        assert out.shape == (5, n) and out.dtype == dtype
        if n:
            assert_matches_reference(out, base, (n,), w, b)
        for got, want in zip((out, mean, rstd), first):
            assert same_bits(got, want), f"{level} differs from {LEVELS[0]}"


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 33, 4097], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_levels_bit_identical_on_offset_and_nonfinite_rows(dtype, n, restore_runtime):
    x = make_input((6, n), dtype, seed=100 + n, offset=1000.0)
    x[1] = 7.0  # constant row
    x[2, n // 2] = np.nan
    x[3, n - 1] = np.inf
    results = _run_all_levels(lambda: layernorm.layer_norm(x, (n,)))
    for level, out in results.items():
        assert same_bits(out, results[LEVELS[0]]), level
        assert (out[1] == 0).all()
        assert np.isnan(out[2]).all() and np.isnan(out[3]).all()


@pytest.mark.parametrize("n", ROW_LENGTHS[1:], ids=[f"N{n}" for n in ROW_LENGTHS[1:]])
def test_levels_in_place(n, restore_runtime):
    base = make_input((3, n), np.float32, seed=n)
    expected = None
    for level in LEVELS:
        layernorm.set_simd_level(level)
        x = base.copy()
        assert layernorm.layer_norm(x, (n,), out=x) is x
        if expected is None:
            expected = x
        assert same_bits(x, expected), level


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)],
                         ids=["all", "dx", "params"])
@pytest.mark.parametrize("n", ROW_LENGTHS[1:], ids=[f"N{n}" for n in ROW_LENGTHS[1:]])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_levels_bit_identical_and_correct(dtype, n, mask, restore_runtime):
    # 37 rows: more than one group of 16 short rows and of 4 rows in pass 2, and a remainder.
    x = make_input((37, n), dtype, seed=n, offset=3.0)
    dy = make_input((37, n), dtype, seed=n + 1)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    results = _run_all_levels(lambda: layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b, mask))
    first = results[LEVELS[0]]
    for level, grads in results.items():
        assert [g is None for g in grads] == [not m for m in mask], level
        for got, want in zip(grads, first):
            assert got is None or same_bits(got, want), f"{level} differs from {LEVELS[0]}"
    full = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    assert_backward_matches_reference(full, dy, x, n, w, dtype)


def _rows_of_16(case, dtype):
    """(dy, x) of rows of 16 elements for a case of test_backward_rows_of_16_levels_bit_identical."""
    shape = (3, 48, 16) if case == "blocks" else (4096 * 20, 16) if case == "streamed" else (70, 16)
    x = make_input(shape, dtype, seed=16, offset=3.0)
    dy = make_input(shape, dtype, seed=17)
    if dtype == np.float32 or dtype == np.float64:  # sums whose bits depend on the order of their terms
        dy[..., ::3, ::2] *= 2.0**20
        dy[..., ::3, 1::2] *= 2.0**-14
    if case == "fallback":
        # rows that the 16-row test refuses, so that their 16 rows go group by group: an Inf in
        # the first 16 rows (that row takes the float64 path, before any sums are written), a
        # row of dy all zero in the next 16 (g_mean and gx_mean 0; float32: 1e-35, whose
        # g * (x - mean) lies near float32's subnormals, the float64 path again)
        x[5, 5] = np.inf
        dy[20] = 1e-35 if dtype == np.float32 else 0.0
    if case == "blocks":  # blocks of 40 rows starting 48 rows apart: one ends inside the third 16 rows
        return dy[:, :40], x[:, :40]
    return dy, x


@pytest.mark.parametrize("affine", ["weight", "none"])
@pytest.mark.parametrize("kind", [LAYER_NORM, RMS_NORM], ids=str)
@pytest.mark.parametrize("case", ["rows", "fallback", "blocks", "streamed"])
@pytest.mark.parametrize("dtype_name", ["float16", "float32", "float64",
                                        pytest.param("bfloat16", marks=requires_ml_dtypes)])
def test_backward_rows_of_16_levels_bit_identical(dtype_name, case, kind, affine, restore_runtime):
    # Rows of 16 elements go 16 rows at a time where the level turns them in registers (avx512),
    # group by group elsewhere and where one of the 16 is not a common row: the same bits either way.
    dtype = dtype_named(dtype_name)
    dy, x = _rows_of_16(case, dtype)
    w = make_params((16,), param_dtype(dtype), "weight")[0] if affine == "weight" else None
    b = make_params((16,), param_dtype(dtype), "weight+bias")[1] if affine == "weight" and kind.centred else None
    stats = kind.native(x, (16,), w, b)[1:]
    for threads in (1, 2):
        layernorm.set_num_threads(threads)
        results = _run_all_levels(lambda: kind.backward(dy, x, (16,), stats, w, b))
        first = results[LEVELS[0]]
        for level, grads in results.items():
            for got, want in zip(grads, first):
                assert got is None or same_bits(got, want), f"{level} differs from {LEVELS[0]} at {threads} threads"
    if case == "rows" and kind.centred and w is not None and dtype_name != "bfloat16":
        assert_backward_matches_reference(first, dy, x, 16, w, dtype)


# ---------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------

# Large enough to be split across threads: many short rows, few long rows, one huge odd
# row, and very many tiny rows.
THREAD_SHAPES = [(4096, 256), (2, 300000), (1, 1000003), (200000, 8)]


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_threads_bit_identical(dtype, shape, threads, restore_runtime):
    n = shape[-1]
    x = make_input(shape, dtype, seed=sum(shape), offset=10.0)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    layernorm.set_num_threads(1)
    serial = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    layernorm.set_num_threads(threads)
    assert layernorm.get_num_threads() == threads
    parallel = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    for got, want in zip(parallel, serial):
        assert same_bits(got, want)


# Backward takes one of three routes by shape: row blocks, 16 short rows per lane group, or
# column spans for a few huge rows; each must give the same bits at every thread count.  Row
# blocks of at most 4 rows (48x4096: 3 each, 20x5000: 1 or 2) are added to the first block's
# sums as they are done by the thread that has block 0, and after, in parallel, by the others.
BACKWARD_THREAD_SHAPES = THREAD_SHAPES + [(3, 40000), (40, 140000), (40000, 17), (512, 1024), (48, 4096),
                                          (20, 5000)]


def backward_same_at_one_and(threads, dy, x, w, b):
    """LayerNorm's backward over x's last axis at one thread, checked bit for bit against the
    same call at `threads`."""
    n = x.shape[-1]
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    layernorm.set_num_threads(1)
    serial = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    layernorm.set_num_threads(threads)
    parallel = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    for name, got, want in zip(("dx", "dweight", "dbias"), parallel, serial):
        assert same_bits(got, want), name
    return serial


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("shape", BACKWARD_THREAD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_threads_bit_identical_and_correct(dtype, shape, threads, restore_runtime):
    n = shape[-1]
    x = make_input(shape, dtype, seed=sum(shape), offset=10.0)
    dy = make_input(shape, dtype, seed=sum(shape) + 1)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    grads = backward_same_at_one_and(threads, dy, x, w, b)
    if threads == 2:
        assert_backward_matches_reference(grads, dy, x, n, w, dtype)


# The blocks added as they go give each gradient the bits it has when all three are asked
# for, whichever the call asks for, at any thread count.
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mask", [(False, True, False), (False, False, True), (True, True, False), (True, False, True)],
                         ids=lambda m: "".join("xwb"[i] for i in range(3) if m[i]))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_blocks_added_as_they_go_for_each_mask(dtype, mask, threads, restore_runtime):
    shape = (48, 4096)
    n = shape[-1]
    x = make_input(shape, dtype, seed=21, offset=10.0)
    dy = make_input(shape, dtype, seed=22)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    layernorm.set_num_threads(1)
    every = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    layernorm.set_num_threads(threads)
    some = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b, mask)
    for name, asked, got, want in zip(("dx", "dweight", "dbias"), mask, some, every):
        assert (got is None) != asked, name
        assert got is None or same_bits(got, want), name


# A block of rows added to the first block's sums as it is done, but with a row for the exact
# path (rstd**2 below float32's range), is added after the kernel wrote its own sums: the
# bits are still those of every thread count, where other threads add it at the end.
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("exact_row", [0, 4, 47])
def test_backward_block_with_an_exact_row_adds_as_the_others(exact_row, threads, restore_runtime):
    shape, dtype = (48, 4096), np.float32
    n = shape[-1]
    x = make_input(shape, dtype, seed=11, offset=10.0)
    x[exact_row] *= 1e25
    dy = make_input(shape, dtype, seed=12)
    w, b = make_params((n,), np.float32, "weight+bias")
    rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)[2]
    assert float(rstd[exact_row, 0]) ** 2 < np.finfo(np.float32).tiny  # the exact path's row
    grads = backward_same_at_one_and(threads, dy, x, w, b)
    assert_backward_matches_reference(grads, dy, x, n, w, dtype)


# Rows of over a million elements need more than 16 MiB of float64 column sums, which come
# from the large results' blocks: a new mapping (zeros), or a cached block zeroed again.
@pytest.mark.parametrize("cache_bytes", [0, 256 * 2**20], ids=["uncached", "cached"])
def test_backward_column_sums_beyond_the_kept_buffer(cache_bytes, restore_runtime):
    shape = (2, 1_100_000)
    n = shape[-1]
    x = make_input(shape, np.float32, seed=5, offset=10.0)
    dy = make_input(shape, np.float32, seed=6)
    w, b = make_params((n,), np.float32, "weight+bias")
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    layernorm.set_result_cache(cache_bytes)
    layernorm.set_num_threads(1)
    first = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    layernorm.set_num_threads(2)
    again = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    for name, got, want in zip(("dx", "dweight", "dbias"), again, first):
        assert same_bits(got, want), name
    assert_backward_matches_reference(first, dy, x, n, w, np.float32)


@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_threaded_result_correct(shape, restore_runtime):
    layernorm.set_num_threads(4)
    x = make_input(shape, np.float32, seed=1, offset=100.0)
    assert_matches_reference(layernorm.layer_norm(x, (shape[-1],)), x, (shape[-1],))


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_threaded_in_place(threads, restore_runtime):
    layernorm.set_num_threads(1)
    x = make_input((4096, 256), np.float32, seed=2)
    expected = layernorm.layer_norm(x, (256,))
    layernorm.set_num_threads(threads)
    assert layernorm.layer_norm(x, (256,), out=x) is x
    assert same_bits(x, expected)


def test_module_backward_identical_for_1_and_2_threads(restore_runtime):
    x, dy, w, b = make_backward_data((512, 1024), (1024,), np.float32, "weight+bias", seed=24)
    grads = []
    for n in (1, 2):
        layernorm.set_num_threads(n)
        m = LayerNorm(1024)
        m.load_state_dict({"weight": w, "bias": b})
        m(x)
        gi = m.backward(dy)
        grads.append((gi, m.weight_grad, m.bias_grad))
    for name, one, two in zip(("grad_input", "weight_grad", "bias_grad"), *grads):
        assert same_bits(one, two), name


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("level", LEVELS)
def test_long_rows_same_at_every_level(level, dtype, restore_runtime):
    x, dy, w, b = make_backward_data((33, 1031), (1031,), dtype, "weight+bias", seed=25)
    layernorm.set_simd_level("scalar")
    base_fwd = layernorm.native_layer_norm(x, (1031,), w, b, 1e-5)
    base_bwd = layernorm.layer_norm_backward(dy, x, (1031,), base_fwd[1], base_fwd[2], w, b)
    layernorm.set_simd_level(level)
    assert layernorm.simd_level() == level
    fwd = layernorm.native_layer_norm(x, (1031,), w, b, 1e-5)
    bwd = layernorm.layer_norm_backward(dy, x, (1031,), fwd[1], fwd[2], w, b)
    names = ("output", "mean", "rstd", "grad_input", "grad_weight", "grad_bias")
    for name, mine, base in zip(names, fwd + bwd, base_fwd + base_bwd):
        assert same_bits(mine, base), name


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 256])
def test_get_num_threads_reflects_set(n, restore_runtime):
    assert layernorm.set_num_threads(n) is None
    assert layernorm.get_num_threads() == n


@pytest.mark.parametrize("n", [257, 10**9, 2**63, 10**30])
def test_set_num_threads_above_the_maximum_is_the_maximum(n, restore_runtime):
    # Any positive int is taken, as torch.set_num_threads takes it; 256 is the documented cap.
    assert layernorm.set_num_threads(n) is None
    assert layernorm.get_num_threads() == 256
    assert "n above 256, the most threads the kernels run, counts as 256" in layernorm.set_num_threads.__doc__


# ---------------------------------------------------------------------------
# The norm family's routes: RMSNorm, a norm over strided axes, the fused residual add
# ---------------------------------------------------------------------------


class Route(NamedTuple):
    kind: NormKind
    shape: Tuple[int, ...]
    normalized_shape: Tuple[int, ...]
    axis: Any
    residual: bool  # through add_layer_norm / add_rms_norm


# Small enough for every level, with SIMD tails, tiles of 16 rows and their remainders
LEVEL_ROUTES = {
    "rms-37x33": Route(RMS_NORM, (37, 33), (33,), None, False),
    "rms-5x4097": Route(RMS_NORM, (5, 4097), (4097,), None, False),
    "layer-nchw-axis1": Route(LAYER_NORM, (3, 16, 7, 9), (16,), 1, False),
    "rms-nchw-axis1": Route(RMS_NORM, (3, 16, 7, 9), (16,), 1, False),
    "layer-long-strided-rows": Route(LAYER_NORM, (2, 1031, 5), (1031,), 1, False),
    "layer-axes20": Route(LAYER_NORM, (5, 6, 17), (17, 5), (2, 0), False),
    "layer-residual-37x33": Route(LAYER_NORM, (37, 33), (33,), None, True),
    "rms-residual-37x33": Route(RMS_NORM, (37, 33), (33,), None, True),
    "layer-residual-nchw-axis1": Route(LAYER_NORM, (3, 16, 7, 9), (16,), 1, True),
}
# Large enough for the threads to split the work (as THREAD_SHAPES)
THREAD_ROUTES = {
    "rms-4096x256": Route(RMS_NORM, (4096, 256), (256,), None, False),
    "rms-48x4096": Route(RMS_NORM, (48, 4096), (4096,), None, False),
    "rms-2x300000": Route(RMS_NORM, (2, 300000), (300000,), None, False),
    "layer-nchw-axis1": Route(LAYER_NORM, (8, 64, 28, 28), (64,), 1, False),
    "rms-nchw-axis1": Route(RMS_NORM, (8, 64, 28, 28), (64,), 1, False),
    "layer-few-long-strided-rows": Route(LAYER_NORM, (2, 100003, 3), (100003,), 1, False),
    "layer-residual-4096x256": Route(LAYER_NORM, (4096, 256), (256,), None, True),
    "rms-residual-nchw-axis1": Route(RMS_NORM, (8, 64, 28, 28), (64,), 1, True),
}


def run_route(route, dtype, seed):
    """Every result of the route's forward (and the sum) and backward, as a list of arrays."""
    kind, shape, ns, axis = route.kind, route.shape, route.normalized_shape, route.axis
    x = make_input(shape, dtype, seed=seed, offset=3.0)
    dy = make_input(shape, dtype, seed=seed + 1)
    w, b = make_params(ns, param_dtype(dtype), kind.affines[0])
    results = []
    if route.residual:
        residual = make_input(shape, dtype, seed=seed + 2)
        out, x = kind.add(x, residual, ns, w, b, axis=axis)
        results += [out, x]
    out, *stats = kind.native(x, ns, w, b, axis=axis)
    grads = kind.backward(dy, x, ns, stats, w, b, axis=axis)
    return [out, *stats] + [g for g in grads if g is not None], (x, ns, w, b, axis)


@pytest.mark.parametrize("route_id", list(LEVEL_ROUTES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_family_levels_bit_identical_and_correct(dtype, route_id, restore_runtime):
    route = LEVEL_ROUTES[route_id]
    results = _run_all_levels(lambda: run_route(route, dtype, seed=len(route_id)))
    first, (x, ns, w, b, axis) = results[LEVELS[0]]
    assert_matches_reference(first[0], x, ns, w, b, route.kind.default_eps, centred=route.kind.centred, axis=axis)
    for level, (arrays, _) in results.items():
        assert len(arrays) == len(first)
        for i, (got, want) in enumerate(zip(arrays, first)):
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"result {i}: {level} differs"


@pytest.mark.parametrize("route_id", list(THREAD_ROUTES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_family_threads_bit_identical(dtype, route_id, restore_runtime):
    route = THREAD_ROUTES[route_id]
    layernorm.set_num_threads(1)
    serial, _ = run_route(route, dtype, seed=3)
    layernorm.set_num_threads(2)
    parallel, (x, ns, w, b, axis) = run_route(route, dtype, seed=3)
    for i, (got, want) in enumerate(zip(parallel, serial)):
        assert got.tobytes() == want.tobytes(), f"result {i} differs between 1 and 2 threads"
    if dtype == np.float32:
        assert_matches_reference(parallel[0], x, ns, w, b, route.kind.default_eps, centred=route.kind.centred,
                                 axis=axis)


# ---------------------------------------------------------------------------
# Environment variables, read at import (in a fresh interpreter)
# ---------------------------------------------------------------------------


def _run_python(code, **env_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERNORM_")}
    env.update(env_overrides)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("level", LEVELS)
def test_env_simd_level(level):
    assert _run_python("import layernorm; print(layernorm.simd_level())", LAYERNORM_SIMD=level) == level


@pytest.mark.parametrize("n", [1, 3])
def test_env_num_threads(n):
    out = _run_python("import layernorm; print(layernorm.get_num_threads())", LAYERNORM_NUM_THREADS=str(n))
    assert out == str(n)


def _import_error(**env_overrides):
    """The last line of what importing layernorm printed to stderr, which must fail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERNORM_")}
    env.update(env_overrides)
    proc = subprocess.run([sys.executable, "-c", "import layernorm"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0, "the import succeeded"
    return proc.stderr.strip().splitlines()[-1]


# Whitespace around a value is no part of it, on either side; anything else is refused at import.
@pytest.mark.parametrize("value", [" 4", "4 ", " 4 ", "\t4\n", "+4", "04"],
                         ids=["space-before", "space-after", "spaces-around", "tab-newline", "plus", "leading-zero"])
def test_env_num_threads_whitespace_around(value):
    out = _run_python("import layernorm; print(layernorm.get_num_threads())", LAYERNORM_NUM_THREADS=value)
    assert out == "4"


def test_env_num_threads_above_the_maximum_is_the_maximum():
    out = _run_python("import layernorm; print(layernorm.get_num_threads())",
                      LAYERNORM_NUM_THREADS="100000000000000000000000")
    assert out == "256"


@pytest.mark.parametrize("value", ["", "   "], ids=["empty", "blank"])
def test_env_num_threads_blank_is_unset(value):
    out = _run_python("import layernorm, os; print(layernorm.get_num_threads() == len(os.sched_getaffinity(0)))",
                      LAYERNORM_NUM_THREADS=value)
    assert out == "True"


@pytest.mark.parametrize("value", ["4x", "4 4", "4.0", "0", "-2", "four", "0x10", "4_0"])
def test_env_num_threads_refused_at_import(value):
    assert _import_error(LAYERNORM_NUM_THREADS=value) == (
        f"ValueError: LAYERNORM_NUM_THREADS must be an integer >= 1, got '{value}'")


def test_env_simd_whitespace_around():
    out = _run_python("import layernorm; print(layernorm.simd_level())", LAYERNORM_SIMD=" scalar\n")
    assert out == "scalar"


@pytest.mark.parametrize("value", ["scalar junk", "SCALAR", "sse4"])
def test_env_simd_refused_at_import(value):
    assert _import_error(LAYERNORM_SIMD=value) == (
        f"ValueError: LAYERNORM_SIMD must name a SIMD level of this build, got '{value}'")


def test_env_scalar_and_one_thread_same_bits():
    code = (
        "import numpy as np, layernorm;"
        "x = (np.random.default_rng(0).standard_normal((300, 77)) + 50).astype(np.float32);"
        "print(layernorm.simd_level(), layernorm.get_num_threads(), layernorm.layer_norm(x, 77).tobytes().hex())"
    )
    level, threads, digest = _run_python(code, LAYERNORM_SIMD="scalar", LAYERNORM_NUM_THREADS="1").split()
    assert (level, threads) == ("scalar", "1")
    x = (np.random.default_rng(0).standard_normal((300, 77)) + 50).astype(np.float32)
    assert digest == layernorm.layer_norm(x, 77).tobytes().hex()


def test_defaults_without_env():
    out = _run_python("import layernorm; print(layernorm.simd_level(), layernorm.get_num_threads())")
    level, threads = out.split()
    assert level == LEVELS[-1]
    assert int(threads) == len(os.sched_getaffinity(0))


# Rows of 1 MiB and more, and rows longer than 2048 elements in an output of 16 MiB and more,
# are written with non-temporal stores, from a 64-byte boundary on, the elements before it and
# after the last whole group by ordinary stores: in place, into an output that starts off that
# boundary, and split across threads or not, the bits are those of the plain stores (the
# scalar level has none).  float16 and bfloat16 rows are twice as long, for as many bytes.
STREAMED_SHAPES = [(1, 1 << 18), (2, (1 << 18) + 5), (9, (1 << 17) + 3), (1025, 4099)]
STREAMED_CASES = [
    pytest.param(name, (rows, n * (2 if size == 2 else 1)), id=f"{name}-{rows}x{n * (2 if size == 2 else 1)}",
                 marks=requires_ml_dtypes if name == "bfloat16" else ())
    for name, size in [("float32", 4), ("float64", 8), ("float16", 2), ("bfloat16", 2)]
    for rows, n in STREAMED_SHAPES
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name, shape", STREAMED_CASES)
def test_streamed_rows_same_bits_in_place_and_unaligned(name, shape, threads, restore_runtime):
    dtype = dtype_named(name)
    n = shape[-1]
    x = make_input(shape, dtype, seed=n, offset=5.0)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    layernorm.set_num_threads(threads)
    layernorm.set_simd_level("scalar")
    expected = layernorm.layer_norm(x, (n,), w, b)
    layernorm.set_simd_level(LEVELS[-1])
    assert np.array_equal(layernorm.layer_norm(x, (n,), w, b), expected)
    buf = np.zeros(x.size + 3, dtype)
    unaligned = buf[3:].reshape(shape)  # 3 elements past the allocation: off any 64-byte boundary
    assert layernorm.layer_norm(x, (n,), w, b, out=unaligned) is unaligned
    assert np.array_equal(unaligned, expected) and (buf[:3] == 0).all()
    in_place = x.copy()
    assert layernorm.layer_norm(in_place, (n,), w, b, out=in_place) is in_place
    assert np.array_equal(in_place, expected)
    assert_matches_reference(expected, x, (n,), w, b)


# The normalize pass goes through a long row from the end back, 16384 elements at a time:
# rows of two whole spans and part of a third, not streamed, unaligned, through the row loop
# (one thread) and split across threads, match the float64 reference at every level and the
# bits of the scalar level.
SPANNED_ROW_LEN = 2 * 16384 + 2048 + 5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_rows_of_several_normalize_spans(dtype, threads, restore_runtime):
    n = SPANNED_ROW_LEN
    base = make_input((3, n), dtype, seed=n, offset=5.0)
    buf = np.zeros(base.size + 1, dtype)
    x = buf[1:].reshape(3, n)
    x[...] = base
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    layernorm.set_num_threads(threads)
    results = _run_all_levels(lambda: layernorm.layer_norm(x, (n,), w, b))
    for level, out in results.items():
        assert same_bits(out, results[LEVELS[0]]), level
    assert_matches_reference(results[LEVELS[-1]], base, (n,), w, b)


# Backward writes dx of 4 MiB and more with non-temporal stores when its rows are a multiple
# of 16 bytes, in whole lines where a group's rows each start one and in 16-byte pieces where
# they do not (rows of 4112 bytes): through row blocks and through column spans, the bits are
# those of the plain stores (scalar level), at one thread or two; rows of another length keep
# plain stores.
BACKWARD_STREAMED_CASES = [((1024, 1024), np.float32), ((512, 1024), np.float64),
                           ((4, 1 << 18), np.float32), ((3, (1 << 18) + 2), np.float64),
                           ((1028, 1028), np.float32), ((1026, 514), np.float64),
                           ((1025, 1023), np.float32)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,dtype", BACKWARD_STREAMED_CASES,
                         ids=[f"{s[0]}x{s[1]}-{dtype_id(d)}" for s, d in BACKWARD_STREAMED_CASES])
def test_backward_streamed_dx_same_bits(shape, dtype, threads, restore_runtime):
    n = shape[-1]
    x = make_input(shape, dtype, seed=n, offset=5.0)
    dy = make_input(shape, dtype, seed=n + 1)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias")
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    layernorm.set_num_threads(threads)
    layernorm.set_simd_level("scalar")
    expected = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    layernorm.set_simd_level(LEVELS[-1])
    got = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    for name, g, e in zip(("dx", "dweight", "dbias"), got, expected):
        assert same_bits(g, e), name
    assert_backward_matches_reference(got, dy, x, n, w, dtype)


# Streamed dx whose rows lie a multiple of 2 KiB apart (so that a group's rows' lines share
# their offsets in a page) goes two groups of columns of a row at a time: each row's dx keeps
# the bits of the same rows backward on their own (not streamed), and dweight and dbias those
# of the call without dx (not streamed either), at every level and thread count.  The arrays
# are 8 MiB, twice the size from which dx streams; rows of 1040 elements (4160 bytes apart)
# are the control, streamed without pairing.
PAGE_COLLIDING_CASES = [(2048, 1024), (4096, 512), (1024, 2048), (2048, 1040)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("shape", PAGE_COLLIDING_CASES, ids=[f"{r}x{n}" for r, n in PAGE_COLLIDING_CASES])
def test_backward_streamed_dx_of_page_colliding_rows_same_bits(shape, level, threads, restore_runtime):
    n = shape[-1]
    x = make_input(shape, np.float32, seed=n, offset=5.0)
    dy = make_input(shape, np.float32, seed=n + 1)
    w, b = make_params((n,), np.float32, "weight+bias")
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)
    layernorm.set_num_threads(threads)
    layernorm.set_simd_level(level)
    dx, dweight, dbias = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b)
    _, dweight_alone, dbias_alone = layernorm.layer_norm_backward(dy, x, (n,), mean, rstd, w, b,
                                                                  output_mask=(False, True, True))
    assert same_bits(dweight, dweight_alone)
    assert same_bits(dbias, dbias_alone)
    for rows in (slice(0, 9), slice(500, 507), slice(shape[0] - 5, shape[0])):
        dx_rows, _, _ = layernorm.layer_norm_backward(dy[rows], x[rows], (n,), mean[rows], rstd[rows], w, b)
        assert same_bits(dx[rows], dx_rows), rows
    assert_backward_matches_reference((dx, dweight, dbias), dy, x, n, w, np.float32)
