"""Memory for large results: kept when a result is freed, for the next result of its size
(set_result_cache, result_cache_info).  The arrays are ordinary NumPy arrays that own their
data; what is kept stays within the limit; reused memory gives the same results as new.
"""

import gc
import os

import numpy as np
import pytest

import layernorm
from helpers import empty_at, make_input, make_params, reference_output, run_in_child

try:  # NumPy >= 2.0
    from numpy._core.multiarray import get_handler_name
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import get_handler_name

MIB = 2**20
HANDLER = "layernorm_result_memory"
LARGE = (1024, 1024)  # 4 MiB of float32: the smallest result kept
SMALL = (1023, 1024)  # just below


@pytest.fixture(autouse=True)
def empty_cache(restore_runtime):
    """Each test starts with nothing kept and the default limit (restored after it)."""
    limit = layernorm.result_cache_info()["max_bytes"]
    layernorm.set_result_cache(0)
    layernorm.set_result_cache(limit)
    gc.collect()


def _results(kind, shape, dtype=np.float32, seed=0):
    """The arrays a call of `kind` returns on an input of `shape`, as a list."""
    x = make_input(shape, dtype, seed=seed)
    n = shape[-1]
    w, b = make_params((n,), dtype, "weight+bias", seed=seed)
    if kind == "layer_norm":
        return [layernorm.layer_norm(x, n, w, b)]
    if kind == "native_layer_norm":
        return list(layernorm.native_layer_norm(x, (n,), w, b, 1e-5))[:1]
    if kind == "rms_norm":
        return [layernorm.rms_norm(x, n, w)]
    if kind == "add_layer_norm":
        return list(layernorm.add_layer_norm(x, x[::-1], n, w, b))
    if kind == "axis":
        return [layernorm.layer_norm(np.moveaxis(x, -1, 0), n, w, b, axis=0)]
    if kind == "layer_norm_backward":
        mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, 1e-5)[1:]  # the output freed
        return [layernorm.layer_norm_backward(x[::-1], x, (n,), mean, rstd, w, b)[0]]
    if kind == "rms_norm_backward":
        rstd = layernorm.native_rms_norm(x, (n,), w)[1]
        return [layernorm.rms_norm_backward(x[::-1], x, (n,), rstd, w)[0]]
    raise AssertionError(kind)


KINDS = ["layer_norm", "native_layer_norm", "rms_norm", "add_layer_norm", "axis", "layer_norm_backward",
         "rms_norm_backward"]


@pytest.mark.parametrize("kind", KINDS)
def test_large_results_are_arrays_owning_memory_from_the_cache(kind):
    for result in _results(kind, LARGE):
        assert get_handler_name(result) == HANDLER
        assert result.flags.owndata and result.base is None
        assert result.ctypes.data % 64 == 0


@pytest.mark.parametrize("kind", KINDS)
def test_smaller_results_are_numpys_own(kind):
    for result in _results(kind, SMALL):
        assert get_handler_name(result) != HANDLER


def test_training_forward_saves_its_copy_in_the_cache():
    module = layernorm.LayerNorm(1024)
    y = module(make_input(LARGE, np.float32))
    del y
    assert layernorm.result_cache_info()["blocks"] == 1  # the output's
    del module  # and with it the input it saved for backward
    gc.collect()
    assert layernorm.result_cache_info()["blocks"] == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_freed_result_is_reused_by_the_next_of_its_size(kind):
    first = _results(kind, LARGE)
    addresses = {result.ctypes.data for result in first}
    del first
    assert layernorm.result_cache_info()["blocks"] == len(addresses)
    again = _results(kind, LARGE, seed=1)
    assert {result.ctypes.data for result in again} == addresses
    assert layernorm.result_cache_info()["blocks"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_results_in_reused_memory_equal_results_in_new_memory(kind):
    layernorm.set_result_cache(0)
    expected = [result.copy() for result in _results(kind, LARGE, seed=2)]
    layernorm.set_result_cache(256 * MIB)
    # leave NaN in the memory the next results will take
    stale = _results(kind, LARGE, seed=3)
    for result in stale:
        result.fill(np.nan)
    del stale
    for got, want in zip(_results(kind, LARGE, seed=2), expected):
        assert got.tobytes() == want.tobytes()


def test_the_values_are_the_reference_in_reused_memory():
    x = make_input((2048, 1024), np.float32, seed=4)
    w, b = make_params((1024,), np.float32, "weight+bias", seed=4)
    for _ in range(3):
        y = layernorm.layer_norm(x, 1024, w, b)
        np.testing.assert_allclose(y, reference_output(x, (1024,), w, b), rtol=0, atol=1e-5)
        del y


def test_limit_zero_keeps_nothing_and_releases_what_was_kept():
    results = _results("layer_norm", LARGE) + _results("layer_norm", LARGE)
    del results
    assert layernorm.result_cache_info()["blocks"] == 2
    layernorm.set_result_cache(0)
    assert layernorm.result_cache_info() == {"max_bytes": 0, "bytes": 0, "blocks": 0}
    del _results("layer_norm", LARGE)[0]
    assert layernorm.result_cache_info()["bytes"] == 0


def test_what_is_kept_stays_within_the_limit_oldest_released_first():
    layernorm.set_result_cache(20 * MIB)
    sizes = [(1024, 1024), (2048, 1024), (1536, 1024)]  # 4, 8 and 6 MiB (each and a header page)
    results = [layernorm.layer_norm(make_input(shape, np.float32), 1024) for shape in sizes]
    addresses = [result.ctypes.data for result in results]
    while results:
        del results[0]  # freed in order: the 4 MiB block is the oldest kept
    info = layernorm.result_cache_info()
    assert info["bytes"] <= 20 * MIB and info["blocks"] == 3
    # 12 MiB more pushes out the oldest (the 4 MiB block), then the 8 MiB one
    del _results("layer_norm", (3072, 1024))[0]
    info = layernorm.result_cache_info()
    assert info["bytes"] <= 20 * MIB and info["blocks"] == 2
    kept = _results("layer_norm", (1536, 1024))[0]
    assert kept.ctypes.data == addresses[2]
    assert layernorm.result_cache_info()["blocks"] == 1


def test_a_result_larger_than_the_limit_is_not_kept():
    layernorm.set_result_cache(4 * MIB)  # a 4 MiB result's block is a page larger
    del _results("layer_norm", LARGE)[0]
    assert layernorm.result_cache_info()["bytes"] == 0


def test_at_most_sixteen_blocks_are_kept():
    results = [layernorm.layer_norm(make_input((1024 + 128 * i, 1024), np.float32), 1024) for i in range(20)]
    del results
    info = layernorm.result_cache_info()
    assert info["blocks"] == 16 and info["bytes"] <= info["max_bytes"]


def test_a_block_much_larger_than_the_request_is_not_used():
    big = _results("layer_norm", (4096, 1024))[0]  # 16 MiB
    address = big.ctypes.data
    del big
    small = _results("layer_norm", LARGE)[0]
    assert small.ctypes.data != address
    assert layernorm.result_cache_info()["blocks"] == 1


@pytest.mark.parametrize("grow", [True, False])
def test_resizing_a_result_keeps_its_values(grow):
    y = _results("layer_norm", LARGE)[0]
    before = y.copy()
    y.resize((1536 if grow else 1000, 1024), refcheck=False)
    assert get_handler_name(y) == HANDLER
    assert np.array_equal(y[:1024], before) if grow else np.array_equal(y, before[:1000])
    if grow:
        assert not y[1024:].any()  # ndarray.resize fills what it adds with zeros


def test_a_result_shrunk_to_much_less_gives_its_block_back():
    y = _results("layer_norm", (4096, 1024))[0]  # 16 MiB
    before = y[:4].copy()
    y.resize((4, 1024), refcheck=False)
    np.testing.assert_array_equal(y, before)
    # the 16 MiB block went to the cache, where the next large result can take it
    assert layernorm.result_cache_info()["bytes"] >= 16 * MIB
    z = _results("layer_norm", (4096, 1024), seed=1)[0]
    assert layernorm.result_cache_info()["bytes"] < 16 * MIB
    np.testing.assert_array_equal(y, before)  # still its own memory
    assert z.shape == (4096, 1024)


def test_results_shrunk_to_a_few_elements_leave_the_kept_blocks_in_place():
    """Their small blocks, which no result the cache serves fits, are not kept in its slots."""
    del _results("layer_norm", (4096, 1024))[0]  # 16 MiB kept
    for _ in range(20):
        y = _results("layer_norm", LARGE)[0]
        y.resize((4,), refcheck=False)
        del y
    info = layernorm.result_cache_info()
    assert info["blocks"] <= 2 and info["bytes"] >= 16 * MIB


def test_memory_stays_flat_over_calls_of_many_sizes():
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("reads the resident size from /proc")
    x = make_input((9000, 1024), np.float32)
    for rows in range(1024, 9000, 1000):  # warm-up: every size once
        layernorm.layer_norm(x[:rows], 1024)
    start = rss()
    for _ in range(5):
        for rows in range(1024, 9000, 250):
            layernorm.layer_norm(x[:rows], 1024)
    # what is kept is bounded by the limit (256 MiB), whatever the sizes were
    assert rss() - start <= layernorm.result_cache_info()["max_bytes"]
    assert layernorm.result_cache_info()["bytes"] <= layernorm.result_cache_info()["max_bytes"]


def test_threads_taking_and_freeing_results_at_once():
    # in a child: a race in the cache would crash, not fail
    setup = """
import threading
rng = np.random.default_rng(5)
xs = [rng.standard_normal((1024 + 256 * i, 1024)).astype(np.float32) for i in range(4)]
wants = [layernorm.layer_norm(x, 1024).tobytes() for x in xs]
bad = []
def work(i):
    for n in range(40):
        x = xs[(i + n) % 4]
        y = layernorm.layer_norm(x, 1024)
        if y.tobytes() != wants[(i + n) % 4]:
            bad.append((i, n))
        if n % 7 == 0:
            layernorm.set_result_cache((n % 3) * 16 * 2**20)
def run():
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads: t.start()
    for t in threads: t.join()
    return bad
"""
    outcome = run_in_child("run()", setup)
    assert outcome.error is None, outcome.message
    assert outcome.message == "[]"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_takes_and_frees_results():
    setup = """
import os
x = np.random.default_rng(6).standard_normal((2048, 1024)).astype(np.float32)
want = layernorm.layer_norm(x, 1024).tobytes()   # freed at once: kept
def run():
    pid = os.fork()
    if pid == 0:
        ok = all(layernorm.layer_norm(x, 1024).tobytes() == want for _ in range(3))
        os._exit(0 if ok and layernorm.result_cache_info()["blocks"] == 1 else 1)
    return os.waitpid(pid, 0)[1]
"""
    outcome = run_in_child("run()", setup)
    assert outcome.error is None, outcome.message
    assert outcome.message == "0"


def _placed(values, page_offset):
    """A copy of `values` starting `page_offset` bytes past a page boundary."""
    placed = empty_at(values.shape, values.dtype, page_offset, boundary=4096)
    placed[...] = values
    return placed


@pytest.mark.parametrize("page_offset", [0, 16, 64, 112, 2048, 2100, 4032])
@pytest.mark.parametrize("kind", ["layer_norm", "layer_norm_backward"])
def test_a_result_starts_half_a_page_from_its_input(kind, page_offset):
    # a result just above its input in the page slowed forward by 1.75x (4 KiB aliasing)
    x = _placed(make_input(LARGE, np.float32), page_offset)
    if kind == "layer_norm":
        result = layernorm.layer_norm(x, 1024)
    else:
        mean, rstd = layernorm.native_layer_norm(x, (1024,), None, None, 1e-5)[1:]
        result = layernorm.layer_norm_backward(x, x, (1024,), mean, rstd)[0]
    distance = (result.ctypes.data - x.ctypes.data) % 4096
    assert 2048 <= distance < 2048 + 64
    assert result.ctypes.data % 64 == 0


def _page_distance(a, b):
    """How far apart in the page two arrays start, either way round."""
    d = (a.ctypes.data - b.ctypes.data) % 4096
    return min(d, 4096 - d)


@pytest.mark.parametrize("offsets", [(2048, 0), (0, 2048), (16, 16), (1000, 1100), (4000, 100)],
                         ids=lambda o: f"x{o[0]}-other{o[1]}")
@pytest.mark.parametrize("kind", ["add_layer_norm", "layer_norm_backward"])
def test_a_result_of_two_inputs_starts_far_from_both(kind, offsets):
    # backward with x 2048 bytes into a page and dy at 0 was the slowest of 271 placements
    # when grad_input was placed from x alone: half a page from x is dy's place
    x = _placed(make_input(LARGE, np.float32), offsets[0])
    other = _placed(make_input(LARGE, np.float32, seed=1), offsets[1])
    if kind == "add_layer_norm":
        results = layernorm.add_layer_norm(x, other, 1024)
    else:
        mean, rstd = layernorm.native_layer_norm(x, (1024,), None, None, 1e-5)[1:]
        results = layernorm.layer_norm_backward(other, x, (1024,), mean, rstd)[:1]
    widest_gap = max(4096 - abs(offsets[0] - offsets[1]), abs(offsets[0] - offsets[1]))
    for result in results:
        assert min(_page_distance(result, x), _page_distance(result, other)) >= widest_gap // 2 - 64


def test_numpy_allocates_with_its_own_handler_after_a_call():
    default = get_handler_name(np.empty(8 * MIB, np.uint8))
    result = _results("layer_norm", LARGE)[0]
    assert get_handler_name(result) == HANDLER
    assert get_handler_name(np.empty(8 * MIB, np.uint8)) == default


@pytest.mark.parametrize("affine", ["plain", "weight+bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("row_len", [40, 256, 768, 1000, 2048])
def test_large_outputs_of_short_rows_stream_the_same_bits(row_len, dtype, affine, restore_runtime):
    # Rows of up to 2048 elements, a multiple of 16, write an output of 16 MiB or more with
    # non-temporal stores: in whole lines when every row starts a cache line (a result made
    # here), in 16-byte pieces when every row is 16-byte aligned (out= 16 bytes past a line),
    # else with plain stores (out= 8 bytes past a line); rows with elements past their last
    # group of 16 (40, 1000) with plain stores every way: the same values every way, at every
    # level and thread count.  (Which stores a case takes only its speed shows:
    # python -m benchmarks.row_lengths --elements 8388608.)
    rows = (16 * MIB) // (row_len * np.dtype(dtype).itemsize) + 3
    x = make_input((rows, row_len), dtype, seed=7)
    w, b = make_params((row_len,), dtype, affine, seed=7)
    pieces, plain = empty_at(x.shape, dtype, 16), empty_at(x.shape, dtype, 8)
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        for threads in (1, 2):
            layernorm.set_num_threads(threads)
            streamed = layernorm.layer_norm(x, row_len, w, b)
            assert streamed.ctypes.data % 64 == 0
            layernorm.layer_norm(x, row_len, w, b, out=pieces)
            layernorm.layer_norm(x, row_len, w, b, out=plain)
            assert streamed.tobytes() == pieces.tobytes(), (level, threads)
            assert streamed.tobytes() == plain.tobytes(), (level, threads)
            del streamed
