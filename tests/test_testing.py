"""layernorm.testing: each classic mistake gets its own code, correct outputs get none.

The wrong versions are one hand-written LayerNorm and one RMSNorm with a ``mistake`` switch, in
NumPy and in torch: each mistake changes one line, so the same function without it must pass,
and a different mistake must give a different code.  torch is optional here: the torch cases
skip without it, and the rest runs in an environment that has no torch.
"""

import functools
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import layernorm
from layernorm import _reference
from layernorm.testing import assert_layer_norm_close, assert_rms_norm_close, diagnose

from helpers import BF16, requires_ml_dtypes

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
no_torch_only = pytest.mark.skipif(torch is not None, reason="checks the path taken without torch")

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROW_LEN = 16
FLOAT32_EPS = float(np.finfo(np.float32).eps)  # torch's RMSNorm eps=None for float32

LAYER_NORM_MISTAKES = ["unbiased-variance", "one-pass-variance", "eps-outside-sqrt", "eps-value", "wrong-axes",
                       "no-affine", "weight-bias-swapped"]
RMS_NORM_MISTAKES = ["rms-centred", "rms-one-plus-weight", "eps-outside-sqrt", "eps-value", "wrong-axes",
                     "no-affine"]


class NumpyOps:
    """The few operations a hand-written norm uses, in NumPy."""

    name = "numpy"

    @staticmethod
    def array(values):
        return np.array(values)

    @staticmethod
    def mean(x, axes):
        return x.mean(axis=axes, keepdims=True)

    @staticmethod
    def var(x, axes, ddof):
        return x.var(axis=axes, ddof=ddof, keepdims=True)

    @staticmethod
    def sqrt(x):
        return np.sqrt(x)

    @staticmethod
    def rms_norm_eps(x):
        return float(np.finfo(np.float64 if x.dtype == np.float64 else np.float32).eps)


class TorchOps:
    """The same in torch: given a NumPy array these raise, so diagnose retries with a tensor."""

    name = "torch"

    @staticmethod
    def array(values):
        return torch.nn.Parameter(torch.from_numpy(np.array(values)))

    @staticmethod
    def mean(x, axes):
        return x.mean(dim=axes, keepdim=True)

    @staticmethod
    def var(x, axes, ddof):
        return x.var(dim=axes, correction=ddof, keepdim=True)

    @staticmethod
    def sqrt(x):
        return torch.sqrt(x)

    @staticmethod
    def rms_norm_eps(x):
        return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


OPS = [pytest.param(NumpyOps, id="numpy"), pytest.param(TorchOps, id="torch", marks=needs_torch)]


def layer_norm_by_hand(ops, x, weight, bias, mistake=None):
    """LayerNorm over the last axis as people write it; ``mistake`` changes one line."""
    eps = 1e-4 if mistake == "eps-value" else 1e-5
    axes = (-2, -1) if mistake == "wrong-axes" else (-1,)
    mean = ops.mean(x, axes)
    if mistake == "one-pass-variance":
        var = ops.mean(x * x, axes) - mean * mean
    else:
        var = ops.var(x, axes, ddof=1 if mistake == "unbiased-variance" else 0)
    if mistake == "eps-outside-sqrt":
        xhat = (x - mean) / (ops.sqrt(var) + eps)
    else:
        xhat = (x - mean) / ops.sqrt(var + eps)
    if mistake == "no-affine":
        return xhat
    if mistake == "weight-bias-swapped":
        return xhat * bias + weight
    return xhat * weight + bias


def rms_norm_by_hand(ops, x, weight, mistake=None):
    """RMSNorm over the last axis as people write it; ``mistake`` changes one line."""
    eps = 1e-4 if mistake == "eps-value" else ops.rms_norm_eps(x)  # torch's eps=None
    axes = (-2, -1) if mistake == "wrong-axes" else (-1,)
    if mistake == "rms-centred":
        x = x - ops.mean(x, axes)
    mean_square = ops.mean(x * x, axes)
    if mistake == "eps-outside-sqrt":
        y = x / (ops.sqrt(mean_square) + eps)
    else:
        y = x / ops.sqrt(mean_square + eps)
    if mistake == "no-affine":
        return y
    if mistake == "rms-one-plus-weight":
        return y * (1 + weight)
    return y * weight


class ByHand:
    """A module around the hand-written norms, with ``weight`` (and ``bias``) attributes."""

    def __init__(self, ops, kind, mistake=None, size=ROW_LEN):
        self.ops, self.kind, self.mistake = ops, kind, mistake
        self.weight = ops.array(np.ones(size, np.float32))
        if kind == "layer_norm":
            self.bias = ops.array(np.zeros(size, np.float32))

    def __call__(self, x):
        if self.kind == "layer_norm":
            return layer_norm_by_hand(self.ops, x, self.weight, self.bias, self.mistake)
        return rms_norm_by_hand(self.ops, x, self.weight, self.mistake)


def rows_of_different_scales(dtype=np.float32):
    """(2, 3, 16): six rows whose standard deviations run from 3e-4 (where eps shows) to 40, with
    different means (one 40 times its row's standard deviation, where a variance taken as
    mean(x**2) - mean**2 in float32 loses its digits), so that each mistake gives an output no
    other mistake gives."""
    rng = np.random.default_rng(7)
    z = rng.standard_normal((6, ROW_LEN))
    z = (z - z.mean(axis=1, keepdims=True)) / z.std(axis=1, keepdims=True)
    stds = np.array([3e-4, 3e-3, 0.3, 1.0, 6.0, 40.0])[:, None]
    means = np.array([5e-4, -3e-3, 12.0, -1.0, 18.0, -10.0])[:, None]
    return (means + stds * z).reshape(2, 3, ROW_LEN).astype(dtype)


PARAM_RNG = np.random.default_rng(8)
WEIGHT = PARAM_RNG.uniform(0.5, 1.5, ROW_LEN).astype(np.float32)
BIAS = PARAM_RNG.uniform(-0.5, 0.5, ROW_LEN).astype(np.float32)


def named_codes(message):
    """The codes of the mistakes a message names, in its order."""
    return re.findall(r"^\s+\[([a-z-]+)\]", message, re.MULTILINE)


def failure_message(check, *args, **kwargs):
    with pytest.raises(AssertionError) as failure:
        check(*args, **kwargs)
    return str(failure.value)


def as_ops_array(ops, x):
    return torch.from_numpy(x) if ops is TorchOps else x


# ------------------------------------------------------------------------------- each code


@pytest.mark.parametrize("mistake", LAYER_NORM_MISTAKES)
@pytest.mark.parametrize("ops", OPS)
def test_layer_norm_mistake_gets_its_code(ops, mistake):
    x = rows_of_different_scales()
    y = layer_norm_by_hand(ops, as_ops_array(ops, x), ops.array(WEIGHT), ops.array(BIAS), mistake)
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS)
    assert named_codes(message) == [mistake], message


@pytest.mark.parametrize("mistake", RMS_NORM_MISTAKES)
@pytest.mark.parametrize("ops", OPS)
def test_rms_norm_mistake_gets_its_code(ops, mistake):
    x = rows_of_different_scales()
    y = rms_norm_by_hand(ops, as_ops_array(ops, x), ops.array(WEIGHT), mistake)
    message = failure_message(assert_rms_norm_close, y, x, ROW_LEN, WEIGHT)
    assert named_codes(message) == [mistake], message


def test_integer_input_compares_without_a_finding():
    x = np.arange(32).reshape(2, ROW_LEN) * np.array([[1], [7]])  # int64, rows of different scales
    message = failure_message(assert_layer_norm_close, np.zeros(x.shape, np.float32), x, ROW_LEN)
    assert "Mismatched elements: 32 / 32" in message and named_codes(message) == []


@pytest.mark.parametrize("ops", OPS)
def test_layer_norm_by_hand_without_the_mistake_passes(ops):
    x = rows_of_different_scales()
    y = layer_norm_by_hand(ops, as_ops_array(ops, x), ops.array(WEIGHT), ops.array(BIAS))
    assert_layer_norm_close(y, x, ROW_LEN, WEIGHT, BIAS)


@pytest.mark.parametrize("ops", OPS)
def test_rms_norm_by_hand_without_the_mistake_passes(ops):
    x = rows_of_different_scales()
    assert_rms_norm_close(rms_norm_by_hand(ops, as_ops_array(ops, x), ops.array(WEIGHT)), x, ROW_LEN, WEIGHT)


def test_failure_gives_the_difference_where_and_the_tolerance():
    x = rows_of_different_scales()
    y = layer_norm_by_hand(NumpyOps, x, WEIGHT, BIAS, "eps-outside-sqrt")
    expected = _reference.layer_norm(x, ROW_LEN, WEIGHT, BIAS)[0]
    worst = np.unravel_index(np.argmax(np.abs(y - expected)), x.shape)
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS)
    assert f"{np.max(np.abs(y - expected)):.3g} at index {tuple(int(i) for i in worst)}" in message
    assert "float32 output: rtol=1.3e-06, atol=1e-05" in message
    assert "fix: (x - mean) / sqrt(var + eps)" in message


def test_eps_value_reports_the_eps_that_fits():
    x = rows_of_different_scales()
    message = failure_message(assert_layer_norm_close, layer_norm_by_hand(NumpyOps, x, WEIGHT, BIAS, "eps-value"),
                              x, ROW_LEN, WEIGHT, BIAS)
    assert "it fits eps=0.0001 in every row, not the eps=1e-05 compared with" in message


def test_layer_norm_eps_none_is_refused_as_layer_norm_refuses_it():
    # RMSNorm's eps=None default is no default of LayerNorm's: the correct output must not be
    # reported as an eps mistake
    x = rows_of_different_scales()
    with pytest.raises(TypeError, match="eps must be a real number, got NoneType"):
        assert_layer_norm_close(layernorm.layer_norm(x, ROW_LEN), x, ROW_LEN, eps=None)
    with pytest.raises(TypeError, match="eps must be a real number, got NoneType"):
        layernorm.layer_norm(x, ROW_LEN, eps=None)


def test_rms_norm_default_eps_follows_the_input_dtype():
    # float64 input: torch's default is float64's machine epsilon, so float32's is a wrong eps
    x = rows_of_different_scales(np.float64)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + FLOAT32_EPS)
    message = failure_message(assert_rms_norm_close, y, x, ROW_LEN)
    assert named_codes(message) == ["eps-value"]
    assert "eps=1.19209e-07 in every row, not the eps=2.22045e-16" in message
    assert_rms_norm_close(y.astype(np.float32), x.astype(np.float32), ROW_LEN)


def test_wrong_axes_reports_the_axes_that_fit():
    x = rows_of_different_scales()
    message = failure_message(assert_layer_norm_close,
                              layer_norm_by_hand(NumpyOps, x, WEIGHT, BIAS, "wrong-axes"), x, ROW_LEN, WEIGHT, BIAS)
    assert "over axes (1, 2) (statistics per x[i]), not over axes (2,) (per x[i, j])" in message


def test_nothing_matching_is_said():
    x = rows_of_different_scales()
    y = layer_norm_by_hand(NumpyOps, x, WEIGHT, BIAS) + 0.01
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS)
    assert named_codes(message) == []
    assert "It matches none of the classic mistakes known here: [unbiased-variance]" in message


def float32_kernel(x, weight, bias, eps=1e-5):
    """A correct LayerNorm over the last axis in float32 arithmetic, as torch's CPU kernel
    computes a float16 input: a float32 mean, then the centred variance."""
    mean = x.mean(-1, keepdims=True, dtype=np.float32)
    centred = x - mean
    rstd = np.float32(1) / np.sqrt((centred * centred).mean(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return centred * rstd * weight + bias


def test_a_correct_kernel_just_outside_the_tolerance_gets_no_mistake_named():
    # float16 rows whose mean is about 1000 times their spread: a float32 kernel misses float16's
    # tolerance on some by a little, and a mistake fitted to such a row (an eps) can fit it as
    # closely as the truth does; none may be named, and the message says rounding can do it
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((200, 100)) + 1000) * 10.0 ** rng.uniform(-2, 1.4, (200, 1))
    x = rows.astype(np.float16)
    w, b = rng.uniform(0.5, 1.5, 100).astype(np.float16), rng.uniform(-0.5, 0.5, 100).astype(np.float16)
    messages = []
    for row in x[:, None]:
        y = float32_kernel(row.astype(np.float32), w.astype(np.float32), b.astype(np.float32)).astype(np.float16)
        try:
            assert_layer_norm_close(y, row, 100, w, b)
        except AssertionError as error:
            messages.append(str(error))
    assert messages, "no row outside the tolerance: the case tests nothing"
    assert [named_codes(m) for m in messages] == [[]] * len(messages)
    assert any("rounding in a correct kernel can put it there" in m for m in messages)


# ------------------------------------------------------------------------------- the output's dtype


def test_float64_output_of_float32_input_is_named_with_values_that_agree():
    x = rows_of_different_scales()
    y = _reference.layer_norm(x, ROW_LEN, WEIGHT, BIAS)[0]
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS)
    assert named_codes(message) == ["output-dtype"], message
    assert message.startswith("The output's dtype is float64, the input's float32")
    assert "Its values agree with the float64 reference at float32's tolerances" in message


def test_check_dtype_false_compares_values_alone():
    x = rows_of_different_scales()
    assert_layer_norm_close(_reference.layer_norm(x, ROW_LEN, WEIGHT, BIAS)[0], x, ROW_LEN, WEIGHT, BIAS,
                            check_dtype=False)
    assert_rms_norm_close(_reference.rms_norm(x, ROW_LEN, WEIGHT)[0], x, ROW_LEN, WEIGHT, check_dtype=False)


def test_float64_parameters_promoting_a_float32_input_are_named():
    x = rows_of_different_scales()
    y = layer_norm_by_hand(NumpyOps, x, WEIGHT.astype(np.float64), BIAS.astype(np.float64))
    assert y.dtype == np.float64  # NumPy's promotion, the mistake
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS)
    assert named_codes(message) == ["output-dtype"], message
    assert "np.ones(n) promote a float32 input" in message


def test_wrong_dtype_is_held_to_the_input_dtypes_tolerances():
    """float16-accurate values in float32 agree at float16's tolerances, not at float32's."""
    x = rows_of_different_scales(np.float16)
    y = layernorm.layer_norm(x, ROW_LEN, WEIGHT, BIAS).astype(np.float32)
    assert "Its values agree" in failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS)
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS, check_dtype=False)
    assert "(float32 output: rtol=1.3e-06, atol=1e-05)" in message


def test_wrong_dtype_and_a_mistake_are_both_named():
    x = rows_of_different_scales()
    y = layer_norm_by_hand(NumpyOps, x, WEIGHT, BIAS, "unbiased-variance").astype(np.float64)
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN, WEIGHT, BIAS)
    assert named_codes(message) == ["output-dtype", "unbiased-variance"], message
    assert "(float32's tolerances: rtol=1.3e-06, atol=1e-05)" in message


def test_an_input_without_a_dtype_leaves_the_output_dtype_alone():
    x = rows_of_different_scales()
    expected = _reference.layer_norm(x, ROW_LEN, WEIGHT, BIAS)[0]
    assert_layer_norm_close(expected, x.tolist(), ROW_LEN, WEIGHT, BIAS)
    assert_layer_norm_close(expected.astype(np.float32).tolist(), x, ROW_LEN, WEIGHT, BIAS)


@needs_torch
def test_an_output_without_a_dtype_is_held_to_the_inputs_tolerances():
    # torch's float32 values as a list: judged at float32's tolerances, which the list cannot
    # name (at float64's, some of torch's float32 roundings fail)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((16, 768)).astype(np.float32))
    assert_layer_norm_close(torch.nn.functional.layer_norm(x, (768,)).tolist(), x, 768)


def test_diagnose_raises_the_functions_own_error():
    # a NumPy function's own mistake, not a torch error from a retry on a tensor it never got
    # (torch's var() takes no ddof: the retry failed with a TypeError of its own)
    def broken(x):
        centred = x - x.mean(axis=-1, keepdims=True)
        return centred / np.sqrt(x.var(axis=-1, ddof=1, keepdims=True) + 1e-5) * np.ones(ROW_LEN + 1)

    with pytest.raises(ValueError, match="could not be broadcast"):
        diagnose(broken, ROW_LEN)


@needs_torch
def test_float16_tensor_input_with_a_float32_tensor_output_is_named():
    x = torch.from_numpy(rows_of_different_scales(np.float16))
    y = torch.nn.functional.layer_norm(x.float(), (ROW_LEN,))
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN)
    assert message.startswith("The output's dtype is float32, the input's float16"), message
    assert_layer_norm_close(y.half(), x, ROW_LEN)


def test_diagnose_names_an_output_of_another_dtype():
    diagnosis = diagnose(lambda x: _reference.layer_norm(x, ROW_LEN)[0], ROW_LEN)
    assert not diagnosis.ok
    assert diagnosis.findings == ("output-dtype",)


# ------------------------------------------------------------------------------- correct outputs

FLOAT_DTYPES = [np.float16, np.float32, np.float64]


def torch_module(module, weight, bias=None):
    """A torch module (dtype given as NumPy's) with these parameter values."""
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(weight))
        if bias is not None:
            module.bias.copy_(torch.from_numpy(bias))
    return module


def numpy_dtype_as_torch(module_class, *args, dtype):
    return module_class(*args, dtype=getattr(torch, np.dtype(dtype).name))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("source", ["truth-rounded", "layernorm.layer_norm",
                                    pytest.param("F.layer_norm", marks=needs_torch),
                                    pytest.param("nn.LayerNorm", marks=needs_torch)])
def test_correct_layer_norm_output_passes(source, dtype):
    x = rows_of_different_scales(dtype)
    w, b = WEIGHT.astype(dtype), BIAS.astype(dtype)
    if source == "truth-rounded":
        y = _reference.layer_norm(x, ROW_LEN, w, b)[0].astype(dtype)
    elif source == "layernorm.layer_norm":
        y = layernorm.layer_norm(x, ROW_LEN, w, b)
    elif source == "F.layer_norm":
        y = torch.nn.functional.layer_norm(torch.from_numpy(x), (ROW_LEN,), torch.from_numpy(w), torch.from_numpy(b))
    else:
        module = torch_module(numpy_dtype_as_torch(torch.nn.LayerNorm, ROW_LEN, dtype=dtype), w, b)
        y = module(torch.from_numpy(x))  # requires grad: the check detaches it
    assert_layer_norm_close(y, x, ROW_LEN, w, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("source", ["truth-rounded", pytest.param("F.rms_norm", marks=needs_torch),
                                    pytest.param("nn.RMSNorm", marks=needs_torch)])
def test_correct_rms_norm_output_passes(source, dtype):
    x = rows_of_different_scales(dtype)
    w = WEIGHT.astype(dtype)
    if source == "truth-rounded":
        y = _reference.rms_norm(x, ROW_LEN, w)[0].astype(dtype)
    elif source == "F.rms_norm":
        y = torch.nn.functional.rms_norm(torch.from_numpy(x), (ROW_LEN,), torch.from_numpy(w))
    else:
        y = torch_module(numpy_dtype_as_torch(torch.nn.RMSNorm, ROW_LEN, dtype=dtype), w)(torch.from_numpy(x))
    assert_rms_norm_close(y, x, ROW_LEN, w)


@needs_torch
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_correct_bfloat16_output_passes(kind):
    x = torch.from_numpy(rows_of_different_scales()).bfloat16()
    w, b = torch.from_numpy(WEIGHT).bfloat16(), torch.from_numpy(BIAS).bfloat16()
    if kind == "layer_norm":
        assert_layer_norm_close(torch.nn.functional.layer_norm(x, (ROW_LEN,), w, b), x, ROW_LEN, w, b)
    else:
        assert_rms_norm_close(torch.nn.functional.rms_norm(x, (ROW_LEN,), w), x, ROW_LEN, w)


@needs_torch
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64] if torch else [],
                         ids=str)
def test_default_tolerances_are_torchs(dtype):
    # torch.testing.assert_close's defaults, from the table it keeps (a private name: it may move)
    rtol, atol = torch.testing._comparison._DTYPE_PRECISIONS[dtype]
    x = torch.from_numpy(rows_of_different_scales()).to(dtype)
    y = torch.nn.functional.layer_norm(x, (ROW_LEN,)) + 0.1
    assert f"rtol={rtol:g}, atol={atol:g}" in failure_message(assert_layer_norm_close, y, x, ROW_LEN)


def test_explicit_tolerances_replace_the_defaults():
    x = rows_of_different_scales()
    y = layernorm.layer_norm(x, ROW_LEN) + np.float32(1e-4)
    failure_message(assert_layer_norm_close, y, x, ROW_LEN)
    assert_layer_norm_close(y, x, ROW_LEN, rtol=0.0, atol=2e-4)
    with pytest.raises(ValueError, match="both be given or both be omitted"):
        assert_layer_norm_close(y, x, ROW_LEN, rtol=1e-3)


@pytest.mark.parametrize("axis", [1, (1,), -3])
def test_axis_is_numpys_convention(axis):
    image = rows_of_different_scales().reshape(2, 4, 3, 4)  # channels-first: C = 4 on axis 1
    y = np.moveaxis(layernorm.layer_norm(np.moveaxis(image, 1, -1), 4), -1, 1)
    assert_layer_norm_close(y, image, 4, axis=axis)
    message = failure_message(assert_layer_norm_close, layernorm.layer_norm(image, [4, 3, 4]), image, 4, axis=axis)
    assert named_codes(message) == ["wrong-axes"]
    assert "over axes (1, 2, 3) (statistics per x[i]), not over axes (1,) (per x[i, :, j, k])" in message


# ------------------------------------------------------------------------------- ambiguity

# 004's input: every row of arange(1, 19).reshape(3, 1, 6) has the same variance, so an eps
# can make up for any row-independent change of it.
EQUAL_VARIANCE_ROWS = np.arange(1, 19, dtype=np.float32).reshape(3, 1, 6)


@pytest.mark.parametrize("mistake, scale", [("unbiased-variance", 1.0), ("eps-outside-sqrt", 1e-3)])
def test_rows_of_one_variance_cannot_tell_a_mistake_from_an_eps(mistake, scale):
    x = EQUAL_VARIANCE_ROWS * np.float32(scale)
    ones, zeros = np.ones(6, np.float32), np.zeros(6, np.float32)
    message = failure_message(assert_layer_norm_close, layer_norm_by_hand(NumpyOps, x, ones, zeros, mistake), x, 6)
    assert sorted(named_codes(message)) == sorted([mistake, "eps-value"])
    assert "The input cannot tell apart" in message
    assert "use rows of different scales" in message


def test_std_plus_eps_is_within_tolerance_on_rows_of_large_variance():
    # 004's own finding: on these rows the std + eps module agrees with nn.LayerNorm
    x = EQUAL_VARIANCE_ROWS
    ones, zeros = np.ones(6, np.float32), np.zeros(6, np.float32)
    assert_layer_norm_close(layer_norm_by_hand(NumpyOps, x, ones, zeros, "eps-outside-sqrt"), x, 6)


# ------------------------------------------------------------------------------- shapes and NaN


def test_transposed_output_is_a_shape_mismatch_with_a_hint():
    x = rows_of_different_scales()
    y = np.moveaxis(layernorm.layer_norm(x, ROW_LEN), -1, 0)
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN)
    assert "The output has shape (16, 2, 3), the input (2, 3, 16)" in message
    assert "its axes in the order (2, 0, 1)" in message


def test_missing_keepdims_is_a_shape_mismatch_with_a_hint():
    x = EQUAL_VARIANCE_ROWS
    message = failure_message(assert_layer_norm_close, x - x.mean(axis=-1), x, 6)
    assert "The output has shape (3, 3, 6), the input (3, 1, 6)" in message
    assert "a statistic of shape (3, 1), taken without keepdims" in message


def test_other_shape_mismatch_gives_both_shapes():
    x = rows_of_different_scales()
    message = failure_message(assert_layer_norm_close, layernorm.layer_norm(x, ROW_LEN)[..., :-1], x, ROW_LEN)
    assert message == ("The output has shape (2, 3, 15), the input (2, 3, 16):"
                       " a LayerNorm output has the input's shape.")


def rows_with_a_nan():
    x = rows_of_different_scales()
    x[1, 2, 5] = np.nan
    return x


def test_nan_where_the_reference_is_nan_passes():
    x = rows_with_a_nan()
    assert_layer_norm_close(layernorm.layer_norm(x, ROW_LEN), x, ROW_LEN)


def test_missing_nan_fails():
    x = rows_with_a_nan()
    y = layernorm.layer_norm(x, ROW_LEN)
    y[1, 2] = 0.0
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN)
    assert "Not NaN where the reference is NaN: 16 elements, the first at index (1, 2, 0)" in message


def test_extra_nan_fails():
    x = rows_of_different_scales()
    y = layernorm.layer_norm(x, ROW_LEN)
    y[0, 1, 3] = np.nan
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN)
    assert "NaN where the reference is not: 1 element, the first at index (0, 1, 3)" in message
    # every finite element passes: no line points at one of them
    assert "Greatest absolute difference" not in message


@pytest.mark.parametrize("value", [np.inf, -np.inf], ids=["inf", "-inf"])
def test_an_infinite_output_is_the_greatest_difference(value):
    x = rows_of_different_scales()
    y = layernorm.layer_norm(x, ROW_LEN)
    y[1, 0, 4] = value
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN)
    assert "Greatest absolute difference: inf at index (1, 0, 4)" in message
    assert diagnose(lambda x: np.full_like(x, value), ROW_LEN).max_error == np.inf


def test_a_nan_output_has_no_finite_max_error():
    assert diagnose(lambda x: np.full_like(x, np.nan), ROW_LEN).max_error == np.inf


def test_the_element_furthest_outside_its_tolerance_is_named():
    # an error that passes on the largest output, a smaller one that fails near zero
    x = rows_of_different_scales()
    y = layernorm.layer_norm(x, ROW_LEN)
    reference = _reference.layer_norm(x, ROW_LEN)[0]
    largest = tuple(int(i) for i in np.unravel_index(np.argmax(np.abs(reference)), y.shape))
    smallest = tuple(int(i) for i in np.unravel_index(np.argmin(np.abs(reference)), y.shape))
    rtol, atol = 1.3e-6, 1e-5  # float32's
    y[largest] = reference[largest] + 0.97 * (atol + rtol * abs(reference[largest]))
    y[smallest] = reference[smallest] + 1.05 * atol
    assert abs(y[largest] - reference[largest]) > abs(y[smallest] - reference[smallest])
    message = failure_message(assert_layer_norm_close, y, x, ROW_LEN)
    assert "Mismatched elements: 1 / 96" in message
    assert f"Greatest absolute difference: {abs(y[largest] - reference[largest]):.3g} at index {largest}" in message
    assert f"Furthest outside its tolerance: {y[smallest]:.7g} at index {smallest}" in message


# ------------------------------------------------------------------------------- diagnose


def correct_implementation(name, kind, dtype):
    """The function or module ``name`` stands for, for probes of ``dtype``."""
    if name == "numpy-by-hand":
        return ByHand(NumpyOps, kind)
    if name == "torch-by-hand":
        return ByHand(TorchOps, kind)
    if name == "reference":  # float64, rounded to the input's dtype as torch's output is
        if kind == "layer_norm":
            return lambda x: _reference.layer_norm(x, ROW_LEN)[0].astype(x.dtype)
        return lambda x: _reference.rms_norm(x, ROW_LEN)[0].astype(x.dtype)
    if name == "layernorm.LayerNorm":
        return layernorm.LayerNorm(ROW_LEN, dtype=dtype)
    if name == "layernorm.layer_norm":
        return functools.partial(layernorm.layer_norm, normalized_shape=ROW_LEN)
    if name == "nn.Module":
        module_class = torch.nn.LayerNorm if kind == "layer_norm" else torch.nn.RMSNorm
        return numpy_dtype_as_torch(module_class, ROW_LEN, dtype=dtype)
    if kind == "layer_norm":  # the functional form
        return lambda x: torch.nn.functional.layer_norm(x, (ROW_LEN,))
    return lambda x: torch.nn.functional.rms_norm(x, (ROW_LEN,))


# the probes' dtypes: each of NumPy's floats, and ml_dtypes' bfloat16
PROBE_DTYPES = [pytest.param(dtype, id=np.dtype(dtype).name) for dtype in FLOAT_DTYPES] + [
    pytest.param(BF16, id="bfloat16", marks=requires_ml_dtypes)]


def by_hand_in_half_precision(name, dtype):
    """Whether `name` is a by-hand norm on float16 or bfloat16 probes: it computes its statistics in
    that dtype and returns float32 (its weight is float32), rightly not ok."""
    return name.endswith("by-hand") and np.dtype(dtype).itemsize == 2


LAYER_NORM_IMPLEMENTATIONS = ["numpy-by-hand", "reference", "layernorm.LayerNorm", "layernorm.layer_norm",
                              pytest.param("torch-by-hand", marks=needs_torch),
                              pytest.param("nn.Module", marks=needs_torch),
                              pytest.param("functional", marks=needs_torch)]
RMS_NORM_IMPLEMENTATIONS = ["numpy-by-hand", "reference", pytest.param("torch-by-hand", marks=needs_torch),
                            pytest.param("nn.Module", marks=needs_torch), pytest.param("functional", marks=needs_torch)]


@pytest.mark.parametrize("dtype", PROBE_DTYPES)
@pytest.mark.parametrize("name", LAYER_NORM_IMPLEMENTATIONS)
def test_diagnose_finds_correct_layer_norms_ok(name, dtype):
    if by_hand_in_half_precision(name, dtype):
        pytest.skip("by hand, half-precision input gets half-precision statistics and a float32 output: rightly not ok")
    diagnosis = diagnose(correct_implementation(name, "layer_norm", dtype), ROW_LEN, dtype=dtype)
    assert diagnosis.ok, str(diagnosis)
    assert diagnosis.findings == ()


@pytest.mark.parametrize("dtype", PROBE_DTYPES)
@pytest.mark.parametrize("name", RMS_NORM_IMPLEMENTATIONS)
def test_diagnose_finds_correct_rms_norms_ok(name, dtype):
    if by_hand_in_half_precision(name, dtype):
        pytest.skip("by hand, half-precision input gets half-precision statistics and a float32 output: rightly not ok")
    diagnosis = diagnose(correct_implementation(name, "rms_norm", dtype), ROW_LEN, kind="rms_norm", dtype=dtype)
    assert diagnosis.ok, str(diagnosis)


# diagnose's probe rows keep their means near their spread, where a one-pass variance in float32
# still passes (see the next test); assert_layer_norm_close names it on rows that show it.
@pytest.mark.parametrize("mistake", [m for m in LAYER_NORM_MISTAKES if m != "one-pass-variance"])
@pytest.mark.parametrize("ops", OPS)
def test_diagnose_names_the_layer_norm_mistake(ops, mistake):
    diagnosis = diagnose(ByHand(ops, "layer_norm", mistake), ROW_LEN)
    assert not diagnosis.ok
    assert diagnosis.findings == (mistake,), str(diagnosis)


@pytest.mark.parametrize("mistake", RMS_NORM_MISTAKES)
@pytest.mark.parametrize("ops", OPS)
def test_diagnose_names_the_rms_norm_mistake(ops, mistake):
    diagnosis = diagnose(ByHand(ops, "rms_norm", mistake), ROW_LEN, kind="rms_norm")
    assert diagnosis.findings == (mistake,), str(diagnosis)


def sequential_layer_norm(x):
    """A correct LayerNorm in float32 whose sums run element by element (float32 cumsum), as a
    plain loop in C would: its mean's rounding grows with the row's length and its mean."""
    n = x.shape[-1]
    mean = np.cumsum(x, axis=-1, dtype=np.float32)[..., -1:] / np.float32(n)
    centred = x - mean
    var = np.cumsum(centred * centred, axis=-1, dtype=np.float32)[..., -1:] / np.float32(n)
    return centred / np.sqrt(var + np.float32(1e-5))


LONG_ROW_IMPLEMENTATIONS = [pytest.param("sequential", id="numpy-sequential-sums"),
                            pytest.param("torch", id="nn.LayerNorm", marks=needs_torch)]


@pytest.mark.parametrize("row_len", [768, 4096])
@pytest.mark.parametrize("name", LONG_ROW_IMPLEMENTATIONS)
def test_diagnose_passes_correct_float32_kernels_on_long_rows(name, row_len):
    fn = sequential_layer_norm if name == "sequential" else torch.nn.LayerNorm(row_len, elementwise_affine=False)
    diagnosis = diagnose(fn, row_len)
    assert diagnosis.ok, str(diagnosis)


def test_diagnose_text_says_what_was_probed_and_what_was_found():
    text = str(diagnose(ByHand(NumpyOps, "layer_norm", "eps-outside-sqrt"), ROW_LEN))
    assert "diagnose(ByHand) as LayerNorm over normalized_shape (16,), eps=1e-05" in text
    assert "probe: float32 input (2, 3, 16), one row per x[i, j]" in text
    assert "\n  weight and bias: probe values, set on fn for the call and restored after\n" in text
    assert "Greatest absolute difference" in text
    assert "[eps-outside-sqrt] it divides by std + eps" in text
    assert "fix: " in text
    assert "ok: max abs error" in str(diagnose(ByHand(NumpyOps, "layer_norm"), ROW_LEN))


@pytest.mark.parametrize("ops", OPS)
def test_diagnose_puts_the_module_parameters_back(ops):
    module = ByHand(ops, "layer_norm")
    diagnose(module, ROW_LEN)
    assert np.array_equal(np.asarray(module.weight.tolist()), np.ones(ROW_LEN))
    assert np.array_equal(np.asarray(module.bias.tolist()), np.zeros(ROW_LEN))


@pytest.mark.parametrize("module_class", [layernorm.LayerNorm, layernorm.RMSNorm], ids=lambda c: c.__name__)
def test_diagnose_keeps_what_a_training_forward_saved_for_backward(module_class):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, ROW_LEN)).astype(np.float32)
    dy = rng.standard_normal((3, ROW_LEN)).astype(np.float32)
    expected, module = module_class(ROW_LEN), module_class(ROW_LEN)
    expected(x)
    module(x)
    diagnose(module, ROW_LEN)  # calls the module, in training mode, on its probes
    np.testing.assert_array_equal(module.backward(dy), expected.backward(dy))
    np.testing.assert_array_equal(module.weight_grad, expected.weight_grad)


class PaperNames:
    """A hand-written module whose parameters go by the papers' names: gamma and beta, or by
    Flax's scale; trained values, not ones and zeros."""

    def __init__(self, ops, kind, weight_name, mistake=None):
        self.ops, self.kind, self.weight_name, self.mistake = ops, kind, weight_name, mistake
        setattr(self, weight_name, ops.array(WEIGHT))
        if kind == "layer_norm":
            self.beta = ops.array(BIAS)

    def __call__(self, x):
        weight = getattr(self, self.weight_name)
        if self.kind == "layer_norm":
            return layer_norm_by_hand(self.ops, x, weight, self.beta, self.mistake)
        return rms_norm_by_hand(self.ops, x, weight, self.mistake)


@pytest.mark.parametrize("mistake", [None, "eps-outside-sqrt"], ids=["correct", "eps-outside-sqrt"])
@pytest.mark.parametrize("weight_name", ["gamma", "scale"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("ops", OPS)
def test_diagnose_probes_parameters_named_gamma_beta_or_scale(ops, kind, weight_name, mistake):
    module = PaperNames(ops, kind, weight_name, mistake)
    diagnosis = diagnose(module, ROW_LEN, kind=kind)
    assert diagnosis.ok == (mistake is None), str(diagnosis)
    assert diagnosis.findings == (() if mistake is None else (mistake,)), str(diagnosis)
    named = f"{weight_name} (the weight)" + (" and beta (the bias)" if kind == "layer_norm" else "")
    assert f"\n  {named}: probe values, set on fn for the call and restored after\n" in str(diagnosis)
    assert np.array_equal(np.asarray(getattr(module, weight_name).tolist()), WEIGHT)
    if kind == "layer_norm":
        assert np.array_equal(np.asarray(module.beta.tolist()), BIAS)


class BiasAndScale:
    """xhat + beta, with a `scale` attribute that is something else: (3,), not the row's (16,)."""

    def __init__(self):
        self.beta = BIAS.copy()
        self.scale = np.full(3, 2.0, np.float32)

    def __call__(self, x):
        return layer_norm_by_hand(NumpyOps, x, 1.0, self.beta)


def test_diagnose_passes_over_a_scale_of_another_shape():
    module = BiasAndScale()
    diagnosis = diagnose(module, ROW_LEN)
    assert diagnosis.ok, str(diagnosis)
    assert "\n  weight: none; beta (the bias): probe values, set on fn for the call and restored after\n" in str(
        diagnosis)
    assert np.array_equal(module.scale, np.full(3, 2.0, np.float32))


class ColumnWeight:
    """LayerNorm by hand whose module keeps its weight as a (16, 1) column."""

    def __init__(self):
        self.weight = WEIGHT.reshape(ROW_LEN, 1).copy()
        self.bias = BIAS.copy()

    def __call__(self, x):
        return layer_norm_by_hand(NumpyOps, x, self.weight[:, 0], self.bias)


def test_diagnose_refuses_a_weight_of_another_shape_unless_given_one():
    module = ColumnWeight()
    with pytest.raises(ValueError, match=r"fn's weight has shape \(16, 1\), normalized_shape is \(16,\)"):
        diagnose(module, ROW_LEN)
    diagnosis = diagnose(module, ROW_LEN, weight=WEIGHT, bias=BIAS)
    assert diagnosis.ok, str(diagnosis)
    assert "\n  weight and bias: as given\n" in str(diagnosis)


def test_diagnose_uses_the_parameters_it_is_given():
    def with_params(x):
        return layer_norm_by_hand(NumpyOps, x, WEIGHT, BIAS)

    assert diagnose(with_params, ROW_LEN, weight=WEIGHT, bias=BIAS).ok
    unknown = diagnose(with_params, ROW_LEN)  # it applies parameters diagnose is not told of
    assert not unknown.ok and unknown.findings == ()


class ChannelsFirst:
    """LayerNorm over the channels of an (N, C, H, W) array, by hand; ``per_image`` takes one
    mean and variance per image instead of one per pixel."""

    def __init__(self, channels, per_image=False):
        self.weight = np.ones(channels, np.float32)
        self.bias = np.zeros(channels, np.float32)
        self.axes = (1, 2, 3) if per_image else (1,)

    def __call__(self, x):
        centred = x - x.mean(axis=self.axes, keepdims=True)
        xhat = centred / np.sqrt(x.var(axis=self.axes, keepdims=True) + 1e-5)
        return xhat * self.weight[:, None, None] + self.bias[:, None, None]


def test_diagnose_axis_1_probes_channels_first():
    diagnosis = diagnose(ChannelsFirst(3), 3, axis=1)
    assert diagnosis.ok, str(diagnosis)
    assert "probe: float32 input (2, 3, 3, 4), one row per x[i, :, j, k]" in str(diagnosis)


def test_diagnose_axis_1_finds_one_mean_per_image():
    diagnosis = diagnose(ChannelsFirst(3, per_image=True), 3, axis=1)
    assert diagnosis.findings == ("wrong-axes",)
    assert "over axes (1, 2, 3) (statistics per x[i]), not over axes (1,)" in str(diagnosis)


@needs_torch
def test_diagnose_axis_1_on_torch_with_two_permutes():
    module = torch.nn.LayerNorm(3)
    assert diagnose(lambda x: module(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2), 3, axis=1).ok
    assert diagnose(lambda x: module(x.permute(0, 3, 2, 1)).permute(0, 3, 2, 1), 3, axis=1).findings == ()


@needs_torch
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [pytest.param("float16", id="float16"),
                                   pytest.param("bfloat16", id="bfloat16", marks=requires_ml_dtypes)])
def test_diagnose_probes_a_half_precision_module_in_its_dtype(kind, dtype):
    # torch refuses float32 input to a module with float16 or bfloat16 parameters
    module_class = torch.nn.LayerNorm if kind == "layer_norm" else torch.nn.RMSNorm
    diagnosis = diagnose(module_class(ROW_LEN, dtype=getattr(torch, dtype)), ROW_LEN, kind=kind)
    assert diagnosis.ok, str(diagnosis)
    assert f"probe: {dtype} input" in str(diagnosis)


@pytest.mark.parametrize("dtype", ["int32", np.longdouble, "float8"])
def test_diagnose_refuses_a_probe_dtype_it_cannot_make(dtype):
    if np.dtype(np.longdouble).itemsize == 8 and dtype is np.longdouble:
        pytest.skip("long double is float64 here")
    with pytest.raises(TypeError, match="^dtype must be float16, bfloat16, float32 or float64, got "):
        diagnose(layernorm.LayerNorm(4), 4, dtype=dtype)


def test_diagnose_checks_its_arguments():
    with pytest.raises(ValueError, match="kind must be"):
        diagnose(layernorm.LayerNorm(4), 4, kind="batch_norm")
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        diagnose(layernorm.LayerNorm(4), 4, kind="rms_norm", bias=np.zeros(4))


@no_torch_only
def test_without_torch_a_function_refusing_numpy_raises_its_own_error():
    def refuses(x):
        raise TypeError("wants a tensor")

    with pytest.raises(TypeError, match="wants a tensor"):
        diagnose(refuses, ROW_LEN)


# ------------------------------------------------------------------------------- imports


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_import_layernorm_does_not_import_the_testing_module():
    assert run_python("import sys, layernorm; print('layernorm.testing' in sys.modules)").strip() == "False"


def test_the_testing_module_runs_on_numpy_without_importing_torch():
    code = ("import sys, numpy as np, layernorm\n"
            "from layernorm.testing import assert_layer_norm_close, diagnose\n"
            "x = np.arange(12, dtype=np.float32).reshape(3, 4)\n"
            "assert_layer_norm_close(layernorm.layer_norm(x, 4), x, 4)\n"
            "assert diagnose(layernorm.LayerNorm(4), 4).ok\n"
            "print('torch' in sys.modules)")
    assert run_python(code).strip() == "False"


def test_python_m_layernorm_shows_a_diagnosis():
    output = subprocess.run([sys.executable, "-m", "layernorm"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    assert "[eps-outside-sqrt]" in output
