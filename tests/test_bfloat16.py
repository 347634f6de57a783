"""bfloat16 (ml_dtypes' NumPy dtype, torch's bfloat16 tensors) and mixed-precision parameters.

bfloat16 is computed as float16 is: elements in float32, statistics in float64, mean/rstd and
parameters float32.  ml_dtypes is optional: without it the tests that need a bfloat16 array
skip, and the ones about its absence still run.
"""

import subprocess
import sys

import numpy as np
import pytest

import layernorm
from helpers import (BF16, HALF_DTYPES, KINDS, LAYER_NORM, RMS_NORM, F, dtype_named, empty_at, from_torch,
                     ml_dtypes, requires_ml_dtypes, requires_torch, same_bits, torch)

# Significand bits after the point and the smallest normal exponent, for ulps.
FORMATS = {"float16": (10, -14), "bfloat16": (7, -126)}


def rows(dtype, shape, seed, offset=0.0):
    """Random rows of `dtype`: offset + scale * noise, a scale per row from 1e-2 to 1e2."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-2, 2, shape[:-1] + (1,))
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


def ulps(actual, expected, name):
    """|actual - expected| in units in the last place of `expected` in the 16-bit format `name`."""
    mantissa, min_exponent = FORMATS[name]
    magnitude = np.abs(expected)
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(magnitude)), min_exponent)
    return np.abs(actual.astype(np.float64) - expected) / np.exp2(exponent - mantissa)


# ---------------------------------------------------------------------------------- accuracy

ACCURACY_LENGTHS = (1, 2, 3, 7, 16, 17, 100, 1000, 1024, 4097, 8192)
ACCURACY_OFFSETS = (0.0, 1.0, 1e3, -1e3)


def accuracy_cases(name, kind):
    """(x, weight, bias) per (length, offset): the accuracy test's data, params in x's dtype."""
    dtype = dtype_named(name)
    rng = np.random.default_rng(7)
    for n in ACCURACY_LENGTHS:
        for offset in ACCURACY_OFFSETS:
            x = rows(dtype, (max(1, 8192 // n), n), seed=n, offset=offset)
            weight = (1 + 0.5 * rng.standard_normal(n)).astype(dtype)
            bias = (0.5 * rng.standard_normal(n)).astype(dtype) if kind.centred else None
            yield x, weight, bias


def accuracy(name, kind, compute):
    """(fraction correctly rounded, max ulps, elements outside the contract) of compute(x,
    weight, bias) against the float64 reference over accuracy_cases.  Outside the contract:
    more than 1 ulp off and more than 2**-22 * (|x_hat * weight| + |bias|) off."""
    correct = total = outside = 0
    worst = 0.0
    for x, weight, bias in accuracy_cases(name, kind):
        n = x.shape[-1]
        expected = kind.reference(x, n, weight, bias, 1e-5)[0]
        bias64 = 0.0 if bias is None else bias.astype(np.float64)
        magnitude = np.abs(expected - bias64) + np.abs(bias64)
        actual = compute(x, weight, bias)
        error = ulps(actual, expected, name)
        correct += int(np.count_nonzero(error <= 0.5))
        total += error.size
        worst = max(worst, float(error.max()))
        off = np.abs(actual.astype(np.float64) - expected)
        outside += int(np.count_nonzero((error > 1) & (off > 2.0**-22 * magnitude)))
    return correct / total, worst, outside


def ours(kind):
    return lambda x, weight, bias: kind.forward(x, x.shape[-1], weight, bias, 1e-5)


def torchs(kind):
    def compute(x, weight, bias):
        def tensor(a):
            return None if a is None else torch_tensor(a)
        n = x.shape[-1]
        if kind.centred:
            y = F.layer_norm(tensor(x), (n,), tensor(weight), tensor(bias), 1e-5)
        else:
            y = F.rms_norm(tensor(x), (n,), tensor(weight), 1e-5)
        return from_torch(y)
    return compute


def torch_tensor(array):
    """The torch tensor of a float16 or bfloat16 array, bit for bit."""
    if array.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


# The contract: at least 99.9% of the outputs are the float64 answer correctly rounded, and
# every one is within 1 ulp of it (or, where the bias nearly cancels x_hat * weight, within
# 2**-22 of |x_hat * weight| + |bias|: accuracy's "outside" counts the elements that are not).
CORRECTLY_ROUNDED = 0.999


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_outputs_are_correctly_rounded(name, kind):
    fraction, worst, outside = accuracy(name, kind, ours(kind))
    assert outside == 0 and fraction >= CORRECTLY_ROUNDED, (fraction, worst, outside)


OUTLIER_CASES = [(64, 0, 1e3), (300, 0, -1e4), (4096, 0, 1e4), (5000, 2048, 1e4), (5000, 0, 3e2)]


@pytest.mark.parametrize("n, at, outlier", OUTLIER_CASES, ids=[f"{n}-at{at}-{v:g}" for n, at, v in OUTLIER_CASES])
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_a_chunks_first_element_far_from_its_mean_keeps_the_contract(name, n, at, outlier):
    # The float32 sums of x - K, K a chunk's first element, round at |K - mean| scale: an
    # outlier there (a "massive activation") must not cost the other elements their digits.
    dtype = dtype_named(name)
    x = (0.3 + np.random.default_rng(n).standard_normal((8, n))).astype(dtype)
    x[:, at] = outlier
    y, mean, rstd = layernorm.native_layer_norm(x, (n,))
    expected, want_mean, want_rstd = LAYER_NORM.reference(x, n, None, None, 1e-5)
    error = ulps(y, expected, name)
    assert np.count_nonzero(error <= 0.5) / error.size >= CORRECTLY_ROUNDED and error.max() <= 1, error.max()
    # the statistics are float32 roundings of float64 ones: within a float32 ulp or two
    np.testing.assert_allclose(mean, want_mean, rtol=2**-22)
    np.testing.assert_allclose(rstd, want_rstd, rtol=2**-22)


@requires_ml_dtypes
def test_products_on_bfloat16_ties_stay_within_an_ulp():
    # outside the 99.9%: rstd = 9.99999999995 is 10.0 in float32, so x * 10 of 8-bit values
    # lands exactly on bfloat16 ties that the exact answer lies just below
    x = (np.random.default_rng(31).standard_normal((64, 32)) * 1e-6).astype(BF16)
    y = layernorm.rms_norm(x, 32, None, 1e-2)
    expected = RMS_NORM.reference(x, 32, None, None, 1e-2)[0]
    error = ulps(y, expected, "bfloat16")
    assert error.max() <= 1 and np.count_nonzero(error > 0.5) > 0


@requires_torch
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_rounded_correctly_at_least_as_often_as_torch(name, kind):
    # side by side on the same data: (fraction correctly rounded, max ulps, outside the contract)
    ours_figures = accuracy(name, kind, ours(kind))
    torch_figures = accuracy(name, kind, torchs(kind))
    ours_fraction, ours_worst, ours_outside = ours_figures
    torch_fraction, torch_worst, torch_outside = torch_figures
    # RMSNorm: both round correctly but for a few near-ties (1e-4 is 34 of the 343k elements)
    assert ours_fraction >= torch_fraction - 1e-4 and ours_worst <= max(torch_worst, 1.0), (ours_figures,
                                                                                         torch_figures)
    assert ours_outside <= torch_outside, (ours_figures, torch_figures)


# ------------------------------------------------------------- every function in bfloat16


@requires_ml_dtypes
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_forward_backward_and_add_keep_bfloat16(kind):
    x = rows(BF16, (5, 40), seed=1)
    weight = rows(BF16, (40,), seed=2)
    bias = rows(BF16, (40,), seed=3) if kind.centred else None
    y, *stats = kind.native(x, 40, weight, bias, 1e-5)
    assert y.dtype == BF16 and all(s.dtype == np.float32 for s in stats)
    assert same_bits(kind.forward(x, 40, weight, bias, 1e-5), y)
    dy = rows(BF16, (5, 40), seed=4)
    grads = kind.backward(dy, x, 40, stats, weight, bias)
    assert grads[0].dtype == BF16 and grads[1].dtype == np.float32
    expected = kind.reference_backward(dy, x, 40, stats, weight)
    # float32 arithmetic, one bfloat16 rounding: within an ulp of the largest gradient
    assert np.all(np.abs(grads[0].astype(np.float64) - expected[0]) <= 2.0**-7 * np.abs(expected[0]).max())
    residual = rows(BF16, (5, 40), seed=5)
    out, total = kind.add(x, residual, 40, weight, bias, 1e-5)
    assert same_bits(total, x + residual)  # ml_dtypes' add: float32, rounded once
    assert same_bits(out, kind.forward(x + residual, 40, weight, bias, 1e-5))


@requires_ml_dtypes
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_out_and_axis(kind):
    x = rows(BF16, (6, 3, 20), seed=8)
    out = np.empty_like(x)
    result = kind.forward(x, 20, out=out)
    assert result is out and same_bits(out, kind.forward(x, 20))
    moved = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    along_axis = kind.forward(x, 3, axis=1)
    assert along_axis.dtype == BF16
    assert same_bits(np.moveaxis(along_axis, 1, -1), kind.forward(moved, 3))
    with pytest.raises(TypeError):
        kind.forward(x, 20, out=np.empty(x.shape, np.float32))


@requires_ml_dtypes
def test_conversions_round_to_nearest_even_keep_inf_and_nan():
    # ml_dtypes' own add (float32, rounded to nearest even) is the oracle for the sum
    edge = np.array([0.0, -0.0, np.inf, -np.inf, 3.3895314e38, 1e-40, 1.0 + 2**-8, 1.0 + 3 * 2**-8] * 4,
                    np.float32)
    x = edge.astype(BF16).reshape(2, 16)
    residual = np.full((2, 16), 2**-9, BF16)
    out, total = LAYER_NORM.add(x, residual, 16)
    assert same_bits(total, x + residual)
    assert np.isnan(out.astype(np.float32)).all()  # an infinite element makes its row NaN
    y = LAYER_NORM.forward(np.array([[np.nan, 1, 2, 3]], BF16), 4)
    assert np.isnan(y.astype(np.float32)).all()


@requires_ml_dtypes
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("shape, axis", [((300, 1500), None), ((40, 33), 0)], ids=["rows", "strided"])
def test_bit_identical_across_levels_and_threads(kind, shape, axis, restore_runtime):
    x = rows(BF16, shape, seed=11, offset=3.0)
    n = shape[0] if axis == 0 else shape[-1]
    weight, bias = rows(BF16, (n,), seed=12), rows(BF16, (n,), seed=13) if kind.centred else None
    dy = rows(BF16, shape, seed=14)
    results = {}
    for level in layernorm.available_simd_levels():
        for threads in (1, 2):
            layernorm.set_simd_level(level)
            layernorm.set_num_threads(threads)
            y, *stats = kind.native(x, n, weight, bias, 1e-5, axis=axis)
            grads = kind.backward(dy, x, n, stats, weight, bias, axis=axis)
            out, total = kind.add(x, dy, n, weight, bias, 1e-5, axis=axis)
            results[level, threads] = [y, *stats, *grads, out, total]
    first = next(iter(results.values()))
    for key, arrays in results.items():
        for a, b in zip(first, arrays):
            assert (a is None and b is None) or same_bits(a, b), key


@requires_ml_dtypes
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("shape, axis", [((37, 96), None), ((40, 33), 0)], ids=["rows", "strided"])
def test_results_below_the_float32_normal_range_at_every_level(kind, shape, axis, restore_runtime):
    # Weights near 2**-124 put outputs and dx about float32's smallest normal, 2**-126, many
    # of them below it: float32 subnormals, which vcvtneps2bf16 (the avx512bf16 level's store)
    # reads as zero.  Every level must round them as the scalar one does, and within 1 ulp
    # of the float64 answer.
    n = shape[0] if axis == 0 else shape[-1]
    x = rows(BF16, shape, seed=30)
    rng = np.random.default_rng(31)
    weight = (2.0**-124 * rng.uniform(-1, 1, n)).astype(np.float32)
    bias = (2.0**-127 * rng.uniform(-1, 1, n)).astype(np.float32) if kind.centred else None
    dy = rows(BF16, shape, seed=32)
    results = {}
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        y, *stats = kind.native(x, n, weight, bias, 1e-5, axis=axis)
        dx = kind.backward(dy, x, n, stats, weight, bias, axis=axis)[0]
        results[level] = y, dx
    y, dx = results["scalar"]
    for result in (y, dx):
        magnitude = np.abs(result.astype(np.float32))
        assert np.count_nonzero((magnitude > 0) & (magnitude < 2.0**-126)) > result.size // 4
    for level, arrays in results.items():
        assert same_bits(arrays[0], y) and same_bits(arrays[1], dx), level
    expected = kind.reference(x, n, weight, bias, 1e-5, axis=axis)[0]
    assert np.all(ulps(y, expected, "bfloat16") <= 1)


# ------------------------------------------------------------------------ mixed parameters


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_float32_parameters_with_16_bit_input(name, kind):
    dtype = dtype_named(name)
    x = rows(dtype, (4, 64), seed=20)
    weight = rows(np.float32, (64,), seed=21)
    bias = rows(np.float32, (64,), seed=22) if kind.centred else None
    y, *stats = kind.native(x, 64, weight, bias, 1e-5)
    assert y.dtype == dtype and all(s.dtype == np.float32 for s in stats)
    assert np.all(ulps(y, kind.reference(x, 64, weight, bias, 1e-5)[0], name) <= 1)
    grads = kind.backward(rows(dtype, (4, 64), seed=23), x, 64, stats, weight, bias)
    assert grads[0].dtype == dtype and grads[1].dtype == np.float32


# 16-bit parameters are widened to float32 by the kernels' vector conversions (C-contiguous
# ones) or by NumPy's cast (the others): exact either way, so the results are those of the same
# values given as float32, at every level, with 16-bit or float32 input.  "finite": subnormals,
# the smallest normal, values of odd significands (rows on the kernels' vector paths);
# "extreme": the largest finite values, Inf, quiet and signalling NaNs (rows that go exact).
# Each lands in a group's first and last lanes and past the last whole group.
PARAM_SPECIALS = {
    ("float16", "finite"): (0x0001, 0x8003, 0x03FF, 0x0400, 0x3C01, 0xBBFF, 0x0401, 0x3555, 0x8401),
    ("float16", "extreme"): (0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x7D55, 0x3C00),
    ("bfloat16", "finite"): (0x0001, 0x8003, 0x007F, 0x0080, 0x3F81, 0xBF7F, 0x0081, 0x3EAB, 0x8081),
    ("bfloat16", "extreme"): (0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FA5, 0x3F80),
}


@pytest.mark.parametrize("input_name", ["same", "float32"])
@pytest.mark.parametrize("values", ["finite", "extreme"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "byte-swapped"])
@pytest.mark.parametrize("name", HALF_DTYPES)
def test_16_bit_parameters_give_their_float32_values_results(name, layout, values, input_name, restore_runtime):
    dtype = dtype_named(name)
    n = 37  # two groups of 16 and 5 more
    x = rows(dtype if input_name == "same" else np.float32, (3, n), seed=24)
    params = [rows(dtype, (n,), seed=seed) for seed in (25, 26)]
    for param, at in zip(params, ([32, 15, 16, 31, 20, 0, 5, 9, 36], [33, 14, 17, 30, 25, 1, 3, 10, 34])):
        param.view(np.uint16)[at] = PARAM_SPECIALS[name, values]
    if layout == "strided":
        params = [np.repeat(param, 2)[::2] for param in params]
    elif layout == "byte-swapped":
        params = [param.astype(param.dtype.newbyteorder()) for param in params]
    as_float32 = [param.astype(np.float32) for param in params]
    dy = rows(x.dtype, (3, n), seed=27)
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        y, mean, rstd = layernorm.native_layer_norm(x, n, *params, 1e-5)
        assert same_bits(y, layernorm.layer_norm(x, n, *as_float32, 1e-5)), level
        grads = layernorm.layer_norm_backward(dy, x, n, mean, rstd, *params)
        for got, want in zip(grads, layernorm.layer_norm_backward(dy, x, n, mean, rstd, *as_float32)):
            assert same_bits(got, want), level


# --------------------------------------------------------------------------------- modules


@requires_ml_dtypes
@pytest.mark.parametrize("module", [layernorm.LayerNorm, layernorm.RMSNorm], ids=lambda m: m.__name__)
@pytest.mark.parametrize("dtype", ["ml_dtypes", "name", "torch"])
def test_module_with_bfloat16_parameters(module, dtype):
    if dtype == "torch" and torch is None:
        pytest.skip("torch is not installed")
    given = {"ml_dtypes": ml_dtypes.bfloat16, "name": "bfloat16", "torch": torch and torch.bfloat16}[dtype]
    m = module(16, dtype=given)
    assert m.weight.dtype == BF16
    x = rows(BF16, (3, 16), seed=30)
    y = m(x)
    assert y.dtype == BF16
    grad = m.backward(rows(BF16, (3, 16), seed=31))
    assert grad.dtype == BF16 and m.weight_grad.dtype == BF16


@requires_ml_dtypes
@pytest.mark.parametrize("module", [layernorm.LayerNorm, layernorm.RMSNorm], ids=lambda m: m.__name__)
@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("how", ["constructor", "to"])
def test_a_byte_swapped_dtype_gives_native_parameters(module, half, how):
    # the parameters are handed to torch by their bits (.view(np.int16)): native byte order
    swapped = np.dtype(ml_dtypes.bfloat16 if half == "bfloat16" else np.float16).newbyteorder("S")
    m = module(4, dtype=swapped) if how == "constructor" else module(4).to(swapped)
    m.backward(m(np.ones((2, 4), swapped)))
    for name in m.state_dict():
        assert getattr(m, name).dtype.isnative and getattr(m, name + "_grad").dtype.isnative, name
        assert getattr(m, name).dtype == swapped.newbyteorder("=")


@requires_torch
@requires_ml_dtypes
@pytest.mark.parametrize("module_dtype", ["bfloat16", "float32"])
def test_load_state_dict_from_bfloat16_tensors(module_dtype):
    theirs = torch.nn.LayerNorm(32, dtype=torch.bfloat16)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    m = layernorm.LayerNorm(32, dtype=module_dtype)
    m.load_state_dict(theirs.state_dict())
    assert m.weight.dtype == dtype_named(module_dtype)
    assert np.array_equal(m.weight.astype(np.float32), theirs.weight.detach().float().numpy())
    assert np.array_equal(m.bias.astype(np.float32), theirs.bias.detach().float().numpy())


# ------------------------------------------------------------------- torch and ml_dtypes


@requires_torch
@requires_ml_dtypes
def test_torch_bfloat16_tensor_read_bit_for_bit():
    tensor = torch.randn(4, 24, dtype=torch.bfloat16) * 1000
    x = from_torch(tensor)
    assert x.dtype == BF16
    assert same_bits(layernorm.layer_norm(tensor, 24), layernorm.layer_norm(x, 24))
    assert same_bits(layernorm.layer_norm(tensor.t(), 4), layernorm.layer_norm(x.T.copy(), 4))


@requires_torch
@requires_ml_dtypes
def test_backward_takes_torchs_bfloat16_statistics():
    x, dy = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    weight, bias = torch.randn(16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    _, mean, rstd = torch.native_layer_norm(x, (16,), weight, bias, 1e-5)
    assert mean.dtype == torch.bfloat16
    dx, dw, db = layernorm.layer_norm_backward(dy, x, 16, mean, rstd, weight, bias, (True, True, True))
    assert dx.dtype == BF16 and dw.dtype == np.float32 and db.dtype == np.float32


@requires_torch
def test_torch_bfloat16_tensor_without_ml_dtypes_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now raises ImportError
    with pytest.raises(TypeError, match=r"pip install ml_dtypes \(or pip install layernorm\[bfloat16\]\)"):
        layernorm.layer_norm(torch.ones(2, 4, dtype=torch.bfloat16), 4)
    with pytest.raises(TypeError, match="pip install ml_dtypes"):
        layernorm.LayerNorm(4, dtype="bfloat16")
    m = layernorm.LayerNorm(4)
    m.load_state_dict(torch.nn.LayerNorm(4, dtype=torch.bfloat16).state_dict())  # widened, exactly
    assert m.weight.dtype == np.float32


def test_import_does_not_import_ml_dtypes():
    code = "import sys, layernorm; assert 'ml_dtypes' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@requires_ml_dtypes
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_channels_first_in_place_power_of_two_at_every_level(kind, restore_runtime):
    # 64 channels of 32 x 32 bfloat16 (2 KiB apart): in place, the output loop reads x from the
    # copy the statistics' pass staged (see tests/test_axis.py); the bits are those of an output
    # 1 KiB off, where nothing is staged.
    shape = (2, 64, 32, 32)
    values = rows(BF16, shape, seed=33, offset=3.0)
    weight = np.random.default_rng(34).uniform(0.5, 1.5, 64).astype(np.float32)
    bias = np.linspace(-1, 1, 64, dtype=np.float32) if kind.centred else None
    elsewhere = empty_at(shape, BF16, 1024, boundary=4096)
    expected = kind.forward(values, 64, weight, bias, axis=1, out=elsewhere)
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        x = empty_at(shape, BF16, 0, boundary=4096)
        x[...] = values
        assert kind.forward(x, 64, weight, bias, axis=1, out=x) is x
        assert same_bits(x, expected), level
