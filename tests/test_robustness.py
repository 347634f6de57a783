"""The C extension's hygiene, forward and backward: inputs never mutated, references and memory
balanced (also on error paths), what the module keeps, thread safety, and the GIL released
around the kernel.
"""

import gc
import os
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import layernorm
from helpers import (
    ARRAY_LAYOUTS,
    FLOAT_DTYPES,
    backward_args,
    call_backward,
    dtype_id,
    layout,
    make_input,
    make_params,
    param_dtype,
    run_in_child,
)
from layernorm import LayerNorm

# ---------------------------------------------------------------------------
# Inputs are never mutated
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout_name", ARRAY_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_input_and_params_not_mutated(dtype, layout_name):
    base = make_input((6, 4, 33), dtype, seed=1)
    x = layout(layout_name, base)
    w, b = make_params((33,), param_dtype(dtype), "weight+bias")
    w_layout, b_layout = layout(layout_name, w), layout(layout_name, b)
    snapshots = [(a, a.copy(), a.strides, a.dtype, a.flags.writeable) for a in (x, w_layout, b_layout)]
    layernorm.layer_norm(x, (33,), w_layout, b_layout)
    layernorm.layer_norm(x, (4, 33))
    layernorm.native_layer_norm(x, (33,), w_layout, b_layout, 1e-5)
    layernorm.layer_norm(x, (33,), w_layout, b_layout, out=np.empty(x.shape, np.dtype(dtype)))
    for a, copy, strides, dt, writeable in snapshots:
        assert a.strides == strides and a.dtype == dt and a.flags.writeable == writeable
        np.testing.assert_array_equal(a, copy)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_input_not_mutated_on_error(dtype):
    x = make_input((4, 5), dtype)
    copy = x.copy()
    with pytest.raises(ValueError):
        layernorm.layer_norm(x, (5,), np.ones(4, np.float32))
    with pytest.raises(ValueError):
        layernorm.layer_norm(x, (5,), out=np.empty((4, 6), dtype))
    np.testing.assert_array_equal(x, copy)


def test_list_input_not_mutated():
    data = [[1.0, 2.0, 4.0], [3.0, -1.0, 0.5]]
    copy = [row[:] for row in data]
    layernorm.layer_norm(data, (3,))
    assert data == copy


def _overlapping_call(case):
    """(call, expected): `call` writes its results over part of an argument (out= or
    residual_out= a view of the same buffer, one row or half a row along); `expected` is the
    same call on copies of the arguments, into new arrays."""
    rng = np.random.default_rng(5)
    buf = rng.standard_normal(9 * 16 + 8).astype(np.float32)
    other = rng.standard_normal((8, 16)).astype(np.float32)
    w, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    rows, next_rows = buf[:128].reshape(8, 16), buf[16:144].reshape(8, 16)
    weight, over_weight = buf[:16], buf[8:136].reshape(8, 16)
    if case == "out over the input's next rows":
        return (lambda: layernorm.layer_norm(rows, 16, w, b, out=next_rows),
                lambda: layernorm.layer_norm(rows.copy(), 16, w, b))
    if case == "out over the weight":
        return (lambda: layernorm.rms_norm(other, 16, weight, out=over_weight),
                lambda: layernorm.rms_norm(other, 16, weight.copy()))
    if case == "out over the residual's next rows":
        return (lambda: layernorm.add_layer_norm(other, rows, 16, w, b, out=next_rows),
                lambda: layernorm.add_layer_norm(other, rows.copy(), 16, w, b))
    assert case == "residual_out over the input's next rows"
    return (lambda: layernorm.add_rms_norm(rows, other, 16, w, residual_out=next_rows),
            lambda: layernorm.add_rms_norm(rows.copy(), other, 16, w))


@pytest.mark.parametrize("case", ["out over the input's next rows", "out over the weight",
                                  "out over the residual's next rows", "residual_out over the input's next rows"])
def test_a_result_over_part_of_an_argument_reads_the_argument_as_given(case):
    call, expected_call = _overlapping_call(case)
    expected = expected_call()  # first: the copies are taken before the buffer is written
    got = call()
    if not isinstance(got, tuple):  # add_*: (output, sum)
        got, expected = (got,), (expected,)
    for result, expected_result in zip(got, expected):
        assert result.tobytes() == expected_result.tobytes()


@pytest.mark.parametrize("layout_name", ARRAY_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_does_not_mutate_any_argument(dtype, layout_name):
    args = backward_args((6, 4, 17), dtype, seed=1)
    args = args._replace(**{name: layout(layout_name, value) for name, value in args._asdict().items()})
    snapshots = {k: (v.copy(), v.strides, v.dtype, v.flags.writeable) for k, v in args._asdict().items()}
    call_backward(args, (17,))
    layernorm.layer_norm_backward(args.grad_output, args.input, (17,), args.mean, args.rstd, None, None,
                                  (True, False, False))
    for k, v in args._asdict().items():
        copy, strides, dt, writeable = snapshots[k]
        assert v.strides == strides and v.dtype == dt and v.flags.writeable == writeable, k
        np.testing.assert_array_equal(v, copy, err_msg=k)


# ---------------------------------------------------------------------------
# Work follows what a call produces: rows without elements cost nothing when no statistic is
# wanted of them (an unoptimized build once walked 2**40 empty rows for an hour)
# ---------------------------------------------------------------------------

EMPTY_ROWS_CALLS = {
    "layer_norm": "layernorm.layer_norm(np.empty((2**40, 0), np.float32), 0)",
    "layer_norm-out": "layernorm.layer_norm(np.empty((2**40, 0), np.float16), (0,), "
                      "out=np.empty((2**40, 0), np.float16))",
    "module-eval": "layernorm.LayerNorm(0).eval()(np.empty((2**40, 0), np.float64))",
    "layer_norm_backward": "layernorm.layer_norm_backward(np.empty((2**40, 0), np.float32), "
                           "np.empty((2**40, 0), np.float32), 0, np.broadcast_to(np.float32(0), (2**40, 1)), "
                           "np.broadcast_to(np.float32(0), (2**40, 1)), np.empty(0, np.float32), "
                           "np.empty(0, np.float32))",
}


@pytest.mark.parametrize("kind", list(EMPTY_ROWS_CALLS))
def test_empty_rows_cost_nothing(kind):
    outcome = run_in_child(f"{EMPTY_ROWS_CALLS[kind]} is not None", timeout=30)
    assert (outcome.error, outcome.message) == (None, "True")


# Backward of no rows with parameter gradients: zeros, without scratch in proportion to the row
# length (a lazy dask call runs it to learn its result types; it took 4 GiB for rows of 2**24)
NO_ROWS_SETUP = "z = np.zeros((0, 2**24), np.float32); s = np.zeros((0, 1), np.float32); w = np.ones(2**24, np.float32)"
NO_ROWS_BACKWARD = {
    "layer_norm_backward": "[(g.shape, bool(g.any())) for g in layernorm.layer_norm_backward(z, z, 2**24, s, s, w, w)]",
    "rms_norm_backward": "[(g.shape, bool(g.any())) for g in layernorm.rms_norm_backward(z, z, 2**24, s, w)]",
}


@pytest.mark.parametrize("call", list(NO_ROWS_BACKWARD))
def test_backward_of_no_rows_needs_no_scratch(call):
    outcome = run_in_child(NO_ROWS_BACKWARD[call], NO_ROWS_SETUP, memory=2**30, timeout=60)
    grads = [((0, 2**24), False)] + [((2**24,), False)] * (2 if call == "layer_norm_backward" else 1)
    assert (outcome.error, outcome.message) == (None, repr(grads))


# No rows with parameters of 2**30 elements broadcast from one value: the call reads no
# parameter, so it converts none (each was copied to a C-contiguous 4 GiB array, for an empty
# result); a child with 1 GiB to spare
NO_ROWS_BROADCAST_SETUP = ("z = np.zeros((0, 2**30), np.float32); "
                           "w = np.broadcast_to(np.float32(1), (2**30,)); "
                           "s = np.zeros((0, 1), np.float32)")
NO_ROWS_BROADCAST_PARAMS = {
    "layer_norm": "layernorm.layer_norm(z, 2**30, w, w).shape",
    "native_layer_norm": "[a.shape for a in layernorm.native_layer_norm(z, 2**30, w, w)]",
    "rms_norm": "layernorm.rms_norm(z, 2**30, w).shape",
    "add_layer_norm": "[a.shape for a in layernorm.add_layer_norm(z, z, 2**30, w, w)]",
    "add_rms_norm": "[a.shape for a in layernorm.add_rms_norm(z, z, 2**30, w)]",
    "layer_norm-axis": "layernorm.layer_norm(z.T, 2**30, w, w, axis=0).shape",
    "layer_norm_backward": "layernorm.layer_norm_backward(z, z, 2**30, s, s, w, w, (True, False, False))[0].shape",
    "rms_norm_backward": "layernorm.rms_norm_backward(z, z, 2**30, s, w, (True, False))[0].shape",
}


@pytest.mark.parametrize("call", list(NO_ROWS_BROADCAST_PARAMS))
def test_no_rows_convert_no_parameter(call):
    outcome = run_in_child(NO_ROWS_BROADCAST_PARAMS[call], NO_ROWS_BROADCAST_SETUP, memory=2**30, timeout=60)
    assert outcome.error is None, outcome.message
    assert "1073741824" in outcome.message  # the empty result has the rows' length


# Backward of two strided rows of 2**22 elements: scratch memory in proportion to the results (the
# partial sums of the route for strided rows, 16 float64 lanes a column, took 1 GiB here)
FEW_STRIDED_ROWS_SETUP = ("x = np.broadcast_to(np.arange(2, dtype=np.float32), (2**22, 2)); "
                          "s = np.ones((1, 2), np.float32); w = np.ones(2**22, np.float32)")
FEW_STRIDED_ROWS_BACKWARD = {
    "layer_norm_backward": "layernorm.layer_norm_backward(x, x, 2**22, s, s, w, w, axis=0)",
    "rms_norm_backward": "layernorm.rms_norm_backward(x, x, 2**22, s, w, axis=0)",
}


@pytest.mark.parametrize("call", list(FEW_STRIDED_ROWS_BACKWARD))
def test_backward_of_few_strided_rows_takes_memory_in_proportion(call):
    grads = f"[(g.shape, g.nbytes) for g in {FEW_STRIDED_ROWS_BACKWARD[call]}]"
    outcome = run_in_child(grads, FEW_STRIDED_ROWS_SETUP, memory=2**31, timeout=120)
    assert outcome.error is None, outcome.message
    shapes = [((2**22, 2), 2**25)] + [((2**22,), 2**24)] * (2 if call == "layer_norm_backward" else 1)
    assert outcome.message == repr(shapes)
    if outcome.peak_growth is not None:
        results = sum(nbytes for _, nbytes in shapes)
        assert outcome.peak_growth <= 3 * results, f"resident memory grew by {outcome.peak_growth} bytes"


# A sequence argument whose items' own code (__index__, __bool__) empties it while the call
# reads it: the call reads the items it was given, in a child process (a crash ends only it).
EMPTIED_WHILE_READ = """
class Emptying:  # an item that empties `items` when read as an int or as a truth value
    def __init__(self, value):
        self.value = value
    def __index__(self):
        items.clear()
        return self.value
class EmptyingBool(int):
    def __bool__(self):
        items.clear()
        return True
x = np.ones((4, 4), np.float32)
y, mean, rstd = layernorm.native_layer_norm(x, (4, 4))
"""
EMPTIED_CALLS = {
    "normalized_shape": ("items = [Emptying(4), 4]", "layernorm.layer_norm(x, items).shape", "(4, 4)"),
    "output_mask": ("items = [EmptyingBool(1), True, False]",
                    "[g is None for g in layernorm.layer_norm_backward(x, x, (4, 4), mean, rstd, np.ones((4, 4), "
                    "np.float32), np.ones((4, 4), np.float32), output_mask=items)]",
                    "[False, False, True]"),
}


@pytest.mark.parametrize("argument", list(EMPTIED_CALLS))
def test_a_sequence_emptied_while_read(argument):
    items, call, expected = EMPTIED_CALLS[argument]
    outcome = run_in_child(call, EMPTIED_WHILE_READ + items, timeout=60)
    assert (outcome.error, outcome.message) == (None, expected)


# ---------------------------------------------------------------------------
# Reference counts
# ---------------------------------------------------------------------------

CALLS = 1000


def _refcounts(objs):
    return [sys.getrefcount(o) for o in objs]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_refcounts_balanced_success(dtype):
    x = make_input((8, 16), dtype)
    xf = np.asfortranarray(x)  # goes through a converted copy
    w, b = make_params((16,), param_dtype(dtype), "weight+bias")
    w16 = w.astype(np.float16)  # goes through a converted copy
    out = np.empty((8, 16), dtype)
    ns = (16,)
    eps = float("1e-5")
    objs = [x, xf, w, b, w16, out, ns, eps]
    before = _refcounts(objs)
    for _ in range(CALLS):
        layernorm.layer_norm(x, ns, w, b, eps)
        layernorm.layer_norm(xf, ns, w16, None, eps)
        layernorm.layer_norm(x, ns, w, b, eps, out=out)
        layernorm.layer_norm(x, 16, None, b)
        layernorm.native_layer_norm(x, ns, w, b, eps)
        layernorm.native_layer_norm(xf, ns, None, None, eps)
    assert _refcounts(objs) == before


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_result_holds_no_extra_references(dtype):
    result = layernorm.layer_norm(make_input((8, 16), dtype), (16,))
    assert sys.getrefcount(result) == 2  # the name and getrefcount's argument


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_out_result_holds_one_reference_to_out(dtype):
    x = make_input((8, 16), dtype)
    out = np.empty((8, 16), dtype)
    base = sys.getrefcount(out)
    result = layernorm.layer_norm(x, (16,), out=out)
    assert result is out and sys.getrefcount(out) == base + 1
    del result
    assert sys.getrefcount(out) == base


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_native_results_hold_no_extra_references(dtype):
    res = layernorm.native_layer_norm(make_input((8, 16), dtype), (16,), None, None, 1e-5)
    assert sys.getrefcount(res) == 2
    y, mean, rstd = res
    del res
    assert sys.getrefcount(y) == 2
    assert sys.getrefcount(mean) == 2
    assert sys.getrefcount(rstd) == 2


def _error_calls(x, w, b, out_bad, ns):
    """Each call raises; returns how many did."""
    calls = [
        lambda: layernorm.layer_norm(x, ns, w[:-1], b),  # weight shape
        lambda: layernorm.layer_norm(x, ns, w, b[:-1]),  # bias shape
        lambda: layernorm.layer_norm(x, (7,), w, b),  # trailing shape
        lambda: layernorm.layer_norm(x, (), w, b),  # empty normalized_shape
        lambda: layernorm.layer_norm(x, ns, w, b, out=out_bad),  # out shape
        lambda: layernorm.layer_norm(x, ns, w, b, "eps"),  # eps type
        lambda: layernorm.layer_norm(x, ns, w, b, bogus=1),  # keyword
        lambda: layernorm.layer_norm(x.astype(np.int64), ns, w, b),  # dtype
        lambda: layernorm.layer_norm(x, (-1,), w, b),  # negative size
        lambda: layernorm.layer_norm(x, ("a",), w, b),  # non-integer size
        lambda: layernorm.native_layer_norm(x, ns, w[:-1], b, 1e-5),
        lambda: layernorm.native_layer_norm(x, ns, w, b, None),
    ]
    raised = 0
    for call in calls:
        try:
            call()
        except (TypeError, ValueError):
            raised += 1
    return raised


@pytest.mark.parametrize("contiguous", [True, False], ids=["C", "fortran"])
def test_refcounts_balanced_on_errors(contiguous):
    x = make_input((8, 16), np.float32)
    if not contiguous:
        x = np.asfortranarray(x)
    w, b = make_params((16,), np.float64, "weight+bias")  # converted to float32 before checks
    out_bad = np.empty((8, 15), np.float32)
    ns = (16,)
    objs = [x, w, b, out_bad, ns]
    assert _error_calls(x, w, b, out_bad, ns) == 12  # warm-up (and every call really raises)
    before = _refcounts(objs)
    for _ in range(200):
        _error_calls(x, w, b, out_bad, ns)
    assert _refcounts(objs) == before


# ---------------------------------------------------------------------------
# Memory stays flat (C allocations are invisible to tracemalloc: read the RSS)
# ---------------------------------------------------------------------------


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# A leaked output would cost 512 KB per call, leaked statistics 4 KB per call, a leaked
# converted input (Fortran-order input is copied) 512 KB per call: 2000 calls make any of
# them >= 8 MB, above the few MB of allocator noise allowed.
LEAK_LIMIT = 4 * 2**20


@pytest.mark.parametrize("kind", ["layer_norm", "native_layer_norm", "out", "fortran-f16-params",
                                  "module-training-step"])
def test_memory_flat_over_many_calls(kind, restore_runtime):
    # The threaded path once (its per-call scratch is what a leak would most likely be).
    layernorm.set_num_threads(2 if kind == "layer_norm" else 1)
    x = make_input((512, 256), np.float32)
    w, b = make_params((256,), np.float32, "weight+bias")
    out = np.empty_like(x)
    if kind == "layer_norm":
        call = lambda: layernorm.layer_norm(x, (256,), w, b)  # noqa: E731
    elif kind == "native_layer_norm":
        call = lambda: layernorm.native_layer_norm(x, (256,), w, b, 1e-5)  # noqa: E731
    elif kind == "out":
        call = lambda: layernorm.layer_norm(x, (256,), w, b, out=out)  # noqa: E731
    elif kind == "module-training-step":
        # forward saves a 512 KB input copy and the statistics' bytes; backward frees them
        module = layernorm.LayerNorm(256)

        def call():
            module(x)
            module.backward(x)
    else:
        xf, w16 = np.asfortranarray(x), w.astype(np.float16)
        call = lambda: layernorm.layer_norm(xf, (256,), w16, b)  # noqa: E731
    for _ in range(200):
        call()
    gc.collect()
    start = _rss_bytes()
    for _ in range(2000):
        call()
    gc.collect()
    assert _rss_bytes() - start < LEAK_LIMIT


def test_memory_flat_over_error_calls():
    x = np.asfortranarray(make_input((512, 256), np.float32))  # converted copy: 512 KB
    w, b = make_params((256,), np.float64, "weight+bias")
    out_bad = np.empty((512, 255), np.float32)
    for _ in range(20):
        _error_calls(x, w, b, out_bad, (256,))
    gc.collect()
    start = _rss_bytes()
    for _ in range(200):  # 2400 failing calls
        _error_calls(x, w, b, out_bad, (256,))
    gc.collect()
    assert _rss_bytes() - start < LEAK_LIMIT


def retained_bytes_after_forward(training):
    """Bytes still allocated after a forward on a 4 MB input once input and output are dropped."""
    ours = LayerNorm(1024).train(training)
    gc.collect()
    tracemalloc.start()
    try:
        x = np.random.default_rng(23).standard_normal((1024, 1024)).astype(np.float32)
        y = ours(x)
        del x, y
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return retained, ours


def test_module_training_forward_keeps_the_input():
    # Control for the next test: the measurement does see what a training forward keeps.
    retained, ours = retained_bytes_after_forward(True)
    assert retained >= 4 * 1024 * 1024
    del ours


def test_module_eval_forward_keeps_nothing():
    retained, ours = retained_bytes_after_forward(False)
    assert retained < 1024 * 1024
    del ours


# ---------------------------------------------------------------------------
# Threads calling concurrently
# ---------------------------------------------------------------------------


def _run_in_threads(worker, count):
    """worker(0) .. worker(count - 1), each on its own thread, all joined."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


def _workload(seed):
    rng = np.random.default_rng(seed)
    jobs = []
    for i, dtype in enumerate(FLOAT_DTYPES * 2):
        rows, n = int(rng.integers(1, 300)), int(rng.integers(1, 600))
        x = make_input((rows, n), dtype, seed=seed * 100 + i, offset=float(rng.integers(0, 1000)))
        w, b = make_params((n,), param_dtype(dtype), "weight+bias", seed=seed * 100 + i)
        jobs.append((x, n, w, b))
    jobs.append((make_input((2, 300000), np.float32, seed=seed), 300000, None, None))  # threaded kernel
    return jobs


def _run_jobs(jobs):
    return [layernorm.native_layer_norm(x, (n,), w, b, 1e-5) for x, n, w, b in jobs]


@pytest.mark.parametrize("kernel_threads", [1, 2])
def test_concurrent_calls_match_serial(kernel_threads, restore_runtime):
    layernorm.set_num_threads(kernel_threads)
    workloads = [_workload(seed) for seed in range(4)]
    serial = [_run_jobs(jobs) for jobs in workloads]
    results = [None] * 4
    errors = []
    barrier = threading.Barrier(4)

    def worker(i):
        try:
            barrier.wait()
            got = None
            for _ in range(5):
                got = _run_jobs(workloads[i])
                for (o, m, r), (eo, em, er) in zip(got, serial[i]):
                    assert np.array_equal(o, eo) and np.array_equal(m, em) and np.array_equal(r, er)
            results[i] = got
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    _run_in_threads(worker, 4)
    assert not errors, errors
    assert all(r is not None for r in results)


def test_concurrent_in_place_on_separate_arrays(restore_runtime):
    layernorm.set_num_threads(2)
    arrays = [make_input((512, 300), np.float64, seed=s) for s in range(4)]
    expected = [layernorm.layer_norm(a, (300,)) for a in arrays]

    def worker(a):
        layernorm.layer_norm(a, (300,), out=a)

    threads = [threading.Thread(target=worker, args=(a,)) for a in arrays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for a, e in zip(arrays, expected):
        assert np.array_equal(a, e)


# ---------------------------------------------------------------------------
# The GIL is released while the kernel runs
# ---------------------------------------------------------------------------


def _gil_test_call(kind):
    """A kernel call of milliseconds on one thread over 128 MB rows, the input it reads row by row
    from first to last, and the call's output of the first and last rows."""
    x = np.tile(make_input((1, 4096), np.float32, seed=3), (8192, 1))
    if kind == "forward":
        y = np.empty_like(x)

        def forward():
            layernorm.layer_norm(x, (4096,), out=y)
            return y[0].copy(), y[-1].copy()

        return x, forward
    dy = np.tile(make_input((1, 4096), np.float32, seed=4), (8192, 1))
    w, b = make_params((4096,), np.float32, "weight+bias")
    _, mean, rstd = layernorm.native_layer_norm(x, (4096,), w, b, 1e-5)

    def backward():
        dx = layernorm.layer_norm_backward(dy, x, (4096,), mean, rstd, w, b)[0]
        return dx[0].copy(), dx[-1].copy()

    return dy, backward


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_gil_released_during_kernel(kind, restore_runtime):
    # No timing decides the outcome.  Another thread changes the read input's first row, then its
    # last (under a lock that also covers putting them back), while the main thread runs the
    # kernel.  A kernel that holds the GIL sees the input at one instant between that thread's
    # Python statements: both rows old, the first new, or both new.  Only a kernel that runs
    # while the other thread runs Python can read the first row old and the last row new.
    layernorm.set_num_threads(1)  # one thread reads the rows in order
    read, call = _gil_test_call(kind)
    rows = (0, read.shape[0] - 1)
    old = [read[r, 0] for r in rows]
    expected_first, expected_last = call()
    start = time.perf_counter()
    call()
    kernel_time = time.perf_counter() - start
    lock = threading.Lock()
    state = {"call": None, "stop": False}

    def change_rows():
        changed = None
        while not state["stop"]:
            current = state["call"]
            # aim at the middle of the call: on a loaded machine this thread may still miss it
            if current is None or current[0] == changed or time.perf_counter() < current[1] + kernel_time / 2:
                continue
            with lock:
                for r in rows:
                    read[r, 0] += 1
            changed = current[0]

    thread = threading.Thread(target=change_rows)
    thread.start()
    outcomes = {"first row old, last new": 0, "both old": 0, "first new": 0}
    try:
        # up to 100 calls until one shows it: on a busy 2-core machine the other thread may get
        # no core during a call whatever the GIL does
        for attempt in range(100):
            with lock:
                for r, value in zip(rows, old):
                    read[r, 0] = value
            state["call"] = (attempt, time.perf_counter())
            first, last = call()
            state["call"] = None
            first_old = np.array_equal(first, expected_first)
            last_old = np.array_equal(last, expected_last)
            outcome = "first new" if not first_old else "both old" if last_old else "first row old, last new"
            outcomes[outcome] += 1
            if outcome == "first row old, last new":
                break
    finally:
        state["stop"] = True
        thread.join()
    assert outcomes["first row old, last new"], f"a kernel of {kernel_time * 1e3:.1f} ms, outcomes of the calls: {outcomes}"


# ---------------------------------------------------------------------------
# layer_norm_backward: references, memory, threads (its GIL release is tested above)
# ---------------------------------------------------------------------------


def _backward_error_calls(dy, x, ns, mean, rstd, w, b):
    """Each call raises; returns how many did."""
    bw = layernorm.layer_norm_backward
    calls = [
        lambda: bw(dy, x, ns, mean, rstd, w[:-1], b),  # weight shape
        lambda: bw(dy, x, ns, mean, rstd, w, b[:-1]),  # bias shape
        lambda: bw(dy[:-1], x, ns, mean, rstd, w, b),  # grad_output shape
        lambda: bw(dy, x, (x.shape[-1] + 1,), mean, rstd, None, None),  # trailing shape
        lambda: bw(dy, x, ns, mean[:-1], rstd, w, b),  # too few means
        lambda: bw(dy, x, ns, mean, rstd[:-1], w, b),  # too few rstds
        lambda: bw(dy, x, ns, mean, rstd, w, b, (True, False)),  # output_mask length
        lambda: bw(dy, x.astype(np.int64), ns, mean, rstd, w, b),  # input dtype
        lambda: bw(dy.astype(np.int64), x, ns, mean, rstd, w, b),  # grad_output dtype
        lambda: bw(dy, x, ns, mean, rstd, w.astype(np.int64), b),  # weight dtype
        lambda: bw(dy, x, (), mean, rstd, None, None),  # empty normalized_shape
        lambda: bw(dy, x, ns, mean, rstd, w, b, bogus=1),  # keyword
    ]
    raised = 0
    for call in calls:
        try:
            call()
        except (TypeError, ValueError):
            raised += 1
    return raised


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_refcounts_balanced(dtype):
    dy, x, mean, rstd, w, b = backward_args((8, 16), dtype, seed=0)
    xf, dyf = np.asfortranarray(x), np.asfortranarray(dy)  # go through converted copies
    w16 = w.astype(np.float16)  # a converted parameter
    ns, mask = (16,), (True, False, True)
    objs = [x, dy, xf, dyf, w, b, w16, mean, rstd, ns, mask]
    assert _backward_error_calls(dy, x, ns, mean, rstd, w, b) == 12  # each call really raises
    before = _refcounts(objs)
    for _ in range(CALLS // 5):
        layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
        layernorm.layer_norm_backward(dyf, xf, ns, mean, rstd, w16, None, mask)
        layernorm.layer_norm_backward(dy, xf, 16, mean.ravel(), rstd, None, b)
        _backward_error_calls(dy, xf, ns, mean, rstd, w, b)
    assert _refcounts(objs) == before


def test_backward_results_hold_no_extra_references():
    dy, x, mean, rstd, w, b = backward_args((8, 16), np.float32, seed=0)
    res = layernorm.layer_norm_backward(dy, x, (16,), mean, rstd, w, b)
    assert sys.getrefcount(res) == 2
    grad_input, grad_weight, grad_bias = res
    del res
    assert sys.getrefcount(grad_input) == 2
    assert sys.getrefcount(grad_weight) == 2
    assert sys.getrefcount(grad_bias) == 2


@pytest.mark.parametrize("kind", ["success", "errors"])
def test_backward_memory_flat_over_many_calls(kind, restore_runtime):
    # Fortran-order input and grad_output are converted (512 KB each) and grad_input is made
    # (512 KB): a leak of any of them is >= 200 MB over 400 calls.  (Leaks of the small
    # objects, the result tuple and parameter gradients, are the refcount tests' job.)
    layernorm.set_num_threads(2)
    dy, x, mean, rstd, w, b = backward_args((512, 256), np.float32, seed=0)
    x, dy, w = np.asfortranarray(x), np.asfortranarray(dy), w.astype(np.float16)
    if kind == "success":
        def call():
            layernorm.layer_norm_backward(dy, x, (256,), mean, rstd, w, b)
        repeats = 400
    else:
        def call():
            _backward_error_calls(dy, x, (256,), mean, rstd, w, b)
        repeats = 200  # 2400 failing calls
    for _ in range(repeats // 10):
        call()
    gc.collect()
    start = _rss_bytes()
    for _ in range(repeats):
        call()
    gc.collect()
    assert _rss_bytes() - start < LEAK_LIMIT


@pytest.mark.parametrize("kernel_threads", [1, 2])
def test_concurrent_backward_calls_match_serial(kernel_threads, restore_runtime):
    layernorm.set_num_threads(kernel_threads)
    rng = np.random.default_rng(5)
    workloads = []
    for seed in range(4):
        jobs = []
        for i, dtype in enumerate(FLOAT_DTYPES):
            rows, n = int(rng.integers(1, 300)), int(rng.integers(1, 600))
            jobs.append(backward_args((rows, n), dtype, seed=10 * seed + i))
        jobs.append(backward_args((64, 4096), np.float32, seed=10 * seed + 9))  # threaded kernel
        workloads.append(jobs)

    def run(jobs):
        return [call_backward(args) for args in jobs]

    serial = [run(jobs) for jobs in workloads]
    errors = []
    barrier = threading.Barrier(4)

    def worker(i):
        try:
            barrier.wait()
            for _ in range(3):
                for got, want in zip(run(workloads[i]), serial[i]):
                    assert all(np.array_equal(g, e) for g, e in zip(got, want))
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    _run_in_threads(worker, 4)
    assert not errors, errors
