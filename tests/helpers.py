"""Helpers the test files share: dtypes and test ids, data, the norm family's kinds (LayerNorm and
RMSNorm called alike), memory layouts, the float64 reference with the tolerances results are held
to, torch as the oracle (over any axes by the permute route), and child processes for calls that
might crash.

layernorm._reference (float64 NumPy) is the ground truth for values; torch is the oracle for
behaviour and messages.  torch is optional: without it ``torch`` and ``F`` are None, and every
test that asks torch carries ``requires_torch`` (or its file skips as a whole).
"""

import functools
import json
import os
import subprocess
import sys
from typing import NamedTuple, Optional, Tuple

import numpy as np
import pytest

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = F = None

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

import layernorm
from layernorm import _reference

# ---------------------------------------------------------------------------
# dtypes and ids
# ---------------------------------------------------------------------------

FLOAT_DTYPES = (np.float16, np.float32, np.float64)

# bfloat16 is ml_dtypes' NumPy dtype; ml_dtypes is optional, and without it the bfloat16 cases skip.
BF16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes else None
requires_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed: NumPy has no bfloat16")
HALF_DTYPES = [pytest.param("float16", id="float16"),
               pytest.param("bfloat16", id="bfloat16", marks=requires_ml_dtypes)]


def dtype_named(name):
    """The dtype called `name`, "bfloat16" included."""
    return BF16 if name == "bfloat16" else np.dtype(name)


def bits(array):
    """The bytes of an array in C order: equal bits, -0.0 and NaN payloads included."""
    return np.ascontiguousarray(array).tobytes()


def same_bits(a, b):
    """bits(a) == bits(b), shape and dtype included, without copies to bytes (for large arrays)."""
    a, b = np.asarray(a), np.asarray(b)
    unsigned = np.dtype(f"u{a.dtype.itemsize}")
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(unsigned), b.view(unsigned))


def param_dtype(dtype):
    """The compute ("param") dtype of the spec: float32 for f16/f32 input, float64 for f64."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def dtype_id(dtype):
    return np.dtype(dtype).name


def shape_id(shape):
    return "x".join(str(s) for s in shape) if len(shape) else "scalar"


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------

AFFINES = ("weight+bias", "weight", "bias", "none")


def empty_at(shape, dtype, offset, boundary=64):
    """An uninitialised array of shape and dtype starting `offset` bytes past a `boundary`-byte
    boundary (64: a cache line, 4096: a page), in a buffer of its own."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buffer = np.empty(nbytes + 2 * boundary, np.uint8)
    start = (-buffer.ctypes.data) % boundary + offset
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


def make_input(shape, dtype, seed=0, scale=2.0, offset=0.0):
    """Deterministic values exactly representable in ``dtype``, C-contiguous."""
    rng = np.random.default_rng(seed)
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


def nan_pairs(dtype, shape):
    """(input, residual) holding NaNs of either sign, quiet and signalling, with payloads, one
    operand a NaN or both, where the rest are random numbers."""
    uint = np.dtype(f"u{np.dtype(dtype).itemsize}")
    width = 8 * uint.itemsize
    mantissa = {2: 10 if np.dtype(dtype) == np.float16 else 7, 4: 23, 8: 52}[uint.itemsize]
    exponent_all = ((1 << (width - 1)) - 1) & ~((1 << mantissa) - 1)
    quiet = 1 << (mantissa - 1)
    sign = 1 << (width - 1)
    nans = np.array([exponent_all | quiet, exponent_all | quiet | 3, sign | exponent_all | quiet | 5,
                     exponent_all | 1, sign | exponent_all | 2], uint)  # quiet ones, then signalling
    rng = np.random.default_rng(61)
    x = make_input(shape, dtype, seed=61)
    residual = make_input(shape, dtype, seed=62)
    for array in (x, residual):
        places = rng.random(shape) < 0.3
        array.view(uint)[places] = rng.choice(nans, size=int(places.sum()))
    return x, residual


def make_params(normalized_shape, dtype, affine, seed=1):
    """(weight, bias) for affine in AFFINES."""
    rng = np.random.default_rng(seed)
    weight = (1.0 + 0.5 * rng.standard_normal(normalized_shape)).astype(dtype)
    bias = rng.standard_normal(normalized_shape).astype(dtype)
    return (
        weight if affine in ("weight+bias", "weight") else None,
        bias if affine in ("weight+bias", "bias") else None,
    )


def make_backward_data(shape, normalized_shape, dtype, affine, seed):
    """(x, grad_output, weight, bias) from one generator; params of the compute dtype."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    pdt = param_dtype(dtype)
    w = (1 + 0.5 * rng.standard_normal(normalized_shape)).astype(pdt) if affine in ("weight+bias", "weight") else None
    b = rng.standard_normal(normalized_shape).astype(pdt) if affine in ("weight+bias", "bias") else None
    return x, dy, w, b


def stats_shape(shape, axes):
    """The shape of mean and rstd for an input of `shape` normalized over `axes` (indices)."""
    return tuple(1 if a in axes else n for a, n in enumerate(shape))


class BackwardArgs(NamedTuple):
    """layer_norm_backward's array arguments, in its order (normalized_shape left out)."""

    grad_output: np.ndarray
    input: np.ndarray
    mean: np.ndarray
    rstd: np.ndarray
    weight: np.ndarray
    bias: np.ndarray


def backward_args(shape, dtype, seed, eps=1e-5, edit=None):
    """BackwardArgs over the last axis: input seed, grad_output seed + 1, weight and bias
    seed + 2, mean and rstd from native_layer_norm; ``edit(x)`` changes the input first."""
    n = shape[-1]
    x = make_input(shape, dtype, seed=seed)
    if edit is not None:
        edit(x)
    dy = make_input(shape, dtype, seed=seed + 1)
    w, b = make_params((n,), param_dtype(dtype), "weight+bias", seed=seed + 2)
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), w, b, eps)
    return BackwardArgs(dy, x, mean, rstd, w, b)


def call_backward(args, normalized_shape=None, output_mask=(True, True, True)):
    """layer_norm_backward on BackwardArgs (normalized over the last axis by default)."""
    ns = (args.input.shape[-1],) if normalized_shape is None else normalized_shape
    return layernorm.layer_norm_backward(args.grad_output, args.input, ns, args.mean, args.rstd,
                                         args.weight, args.bias, output_mask)


# ---------------------------------------------------------------------------
# The norm family: LayerNorm and RMSNorm called alike
# ---------------------------------------------------------------------------

_KIND_DEFAULT = object()  # a kind's own default eps: 1e-5 for LayerNorm, None (torch's rule) for RMSNorm


class NormKind(NamedTuple):
    """LayerNorm or RMSNorm as the tests call them.  The functions are looked up in layernorm at
    each call, so a missing one fails the tests that call it, not the collection of a file.
    Statistics are (mean, rstd) for LayerNorm and (rstd,) for RMSNorm; gradients always three,
    grad_bias None for RMSNorm."""

    name: str  # "layer_norm" or "rms_norm", the functional's name
    centred: bool  # the mean taken out (LayerNorm), or fixed at 0 (RMSNorm)
    affines: Tuple[str, ...]  # the AFFINES it has
    default_eps: Optional[float]

    def __str__(self):
        return self.name

    def _eps(self, eps):
        return self.default_eps if eps is _KIND_DEFAULT else eps

    def _params(self, weight, bias):
        if self.centred:
            return (weight, bias)
        assert bias is None, "RMSNorm has no bias"
        return (weight,)

    def forward(self, x, ns, weight=None, bias=None, eps=_KIND_DEFAULT, **keywords):
        """layer_norm / rms_norm; keywords (axis=, out=) passed on."""
        fn = getattr(layernorm, self.name)
        return fn(x, ns, *self._params(weight, bias), self._eps(eps), **keywords)

    def native(self, x, ns, weight=None, bias=None, eps=_KIND_DEFAULT, **keywords):
        """native_layer_norm's (output, mean, rstd) / native_rms_norm's (output, rstd)."""
        fn = getattr(layernorm, "native_" + self.name)
        return fn(x, ns, *self._params(weight, bias), self._eps(eps), **keywords)

    def backward(self, dy, x, ns, stats, weight=None, bias=None, output_mask=None, **keywords):
        """(grad_input, grad_weight, grad_bias) from the statistics native() returned."""
        fn = getattr(layernorm, self.name + "_backward")
        mask = (True,) * (2 + self.centred) if output_mask is None else tuple(output_mask)[: 2 + self.centred]
        grads = fn(dy, x, ns, *stats, *self._params(weight, bias), mask, **keywords)
        return tuple(grads) + (() if self.centred else (None,))

    def add(self, x, residual, ns, weight=None, bias=None, eps=_KIND_DEFAULT, **keywords):
        """add_layer_norm / add_rms_norm: (output, sum); keywords (axis=, out=, residual_out=) passed on."""
        fn = getattr(layernorm, "add_" + self.name)
        return fn(x, residual, ns, *self._params(weight, bias), self._eps(eps), **keywords)

    def reference(self, x, ns, weight=None, bias=None, eps=_KIND_DEFAULT, *, axis=None):
        """layernorm._reference's float64 (output, *statistics)."""
        eps = self._eps(eps)
        if self.centred:
            return _reference.layer_norm(x, ns, weight, bias, eps, axis=axis)
        return _reference.rms_norm(x, ns, weight, eps, axis=axis)

    def reference_backward(self, dy, x, ns, stats, weight=None, *, axis=None):
        """layernorm._reference's float64 (grad_input, grad_weight, grad_bias) for the statistics
        given (as native() returns them), grad_bias None for RMSNorm."""
        if self.centred:
            return _reference.layer_norm_backward_given_stats(dy, x, ns, *stats, weight, axis=axis)
        return _reference.rms_norm_backward_given_stats(dy, x, ns, *stats, weight, axis=axis) + (None,)

    def eps_value(self, x, eps=_KIND_DEFAULT):
        """The number eps stands for with input x (torch's rule for RMSNorm's None)."""
        eps = self._eps(eps)
        return _reference.rms_norm_default_eps(np.asarray(x).dtype) if eps is None else eps


LAYER_NORM = NormKind("layer_norm", True, AFFINES, 1e-5)
RMS_NORM = NormKind("rms_norm", False, ("weight", "none"), None)
KINDS = (LAYER_NORM, RMS_NORM)


def kind_affines(kinds=KINDS, affines=None):
    """pytest params (kind, affine) over each kind's affine options (or those of `affines` it has)."""
    return [pytest.param(kind, affine, id=f"{kind}-{affine}") for kind in kinds for affine in kind.affines
            if affines is None or affine in affines]


# ---------------------------------------------------------------------------
# Memory layouts: each maker returns an array-like with exactly the values of ``base``
# (a C-contiguous ndarray) but laid out differently.
# ---------------------------------------------------------------------------


def _c_order(base):
    return np.ascontiguousarray(base).copy()


def _fortran(base):
    out = np.asfortranarray(base)
    if base.ndim >= 2:
        assert not out.flags.c_contiguous or base.size <= 1 or 1 in base.shape
    return out


def _transposed(base):
    # A C-contiguous array of the reversed shape, viewed transposed: strides reversed.
    return np.ascontiguousarray(base.transpose()).transpose()


def _step_sliced(base):
    # Every other element along every axis of a twice-as-large buffer.
    big = np.zeros(tuple(2 * s for s in base.shape), dtype=base.dtype)
    view = big[tuple(slice(None, None, 2) for _ in base.shape)]
    view[...] = base
    return view


def _negative_strides(base):
    # Reversed along every axis, then reversed back in a view: all strides negative.
    flipped = np.ascontiguousarray(base[tuple(slice(None, None, -1) for _ in base.shape)])
    return flipped[tuple(slice(None, None, -1) for _ in base.shape)]


def _byte_swapped(base):
    return base.astype(base.dtype.newbyteorder("S"))


def _read_only(base):
    out = base.copy()
    out.flags.writeable = False
    return out


def _column_slice(base):
    # x[..., :N] of a wider array: rows are contiguous but further apart than N.
    if base.ndim == 0:
        return base.copy()
    wide = np.full(base.shape[:-1] + (base.shape[-1] + 3,), 7.0, dtype=base.dtype)
    wide[..., : base.shape[-1]] = base
    return wide[..., : base.shape[-1]]


def _unaligned(base):
    # Data starting one byte past an aligned address (numpy allows misaligned arrays).
    raw = np.zeros(base.nbytes + base.itemsize + 1, dtype=np.uint8)
    out = raw[1 : 1 + base.nbytes].view(base.dtype).reshape(base.shape)
    out[...] = base
    return out


def _list(base):
    return base.tolist()


def _torch_tensor(base):
    if torch is None:
        pytest.skip("torch is not installed: there is no tensor to lay the values out in")
    return torch.from_numpy(base.copy())


LAYOUTS = {
    "C": _c_order,
    "fortran": _fortran,
    "transposed": _transposed,
    "step_sliced": _step_sliced,
    "negative_strides": _negative_strides,
    "byte_swapped": _byte_swapped,
    "read_only": _read_only,
    "column_slice": _column_slice,
    "unaligned": _unaligned,
    "list": _list,
    "torch_tensor": _torch_tensor,
}

# Layouts that stay numpy arrays (for "the input is never mutated" checks).
ARRAY_LAYOUTS = tuple(k for k in LAYOUTS if k not in ("list", "torch_tensor"))

# Layouts whose arrays are not C-contiguous.
STRIDED_LAYOUTS = ("transposed", "step_sliced", "fortran", "negative_strides")


def layout(name, base):
    """Lay out ``base`` as ``name``; lists of floats are float64 by nature."""
    made = LAYOUTS[name](base)
    if isinstance(made, np.ndarray):
        np.testing.assert_array_equal(made, base)
    return made


# ---------------------------------------------------------------------------
# The ground truth, layernorm._reference, and what results are held to against it
# ---------------------------------------------------------------------------


def reference_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Return (y, mean, rstd, scale) from layernorm._reference (float64, exact input values).

    mean/rstd have shape x.shape[:-D] + (1,) * D.  ``scale`` = |xhat * w| + |w| + |b| per
    element: the size of the terms a kernel rounds while forming y, used to scale tolerances.
    """
    y, mean, rstd = _reference.layer_norm(x, normalized_shape, weight, bias, eps)
    return y, mean, rstd, _reference.output_scale(x, normalized_shape, weight, bias, eps)


def reference_output(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """layernorm._reference's float64 LayerNorm output."""
    return _reference.layer_norm(x, normalized_shape, weight, bias, eps)[0]


def reference_backward(grad_output, x, normalized_shape, weight, bias, eps=1e-5):
    """layernorm._reference's float64 gradients, None for a parameter that is None."""
    dx, dw, db = _reference.layer_norm_backward(grad_output, x, normalized_shape, weight, bias, eps)
    return dx, None if weight is None else dw, None if bias is None else db


def reference_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, centred=True, axis=None):
    """(y, scale) from layernorm._reference: LayerNorm, or RMSNorm when not ``centred`` (no bias;
    eps=None is torch's rule), over ``axis``; scale as reference_layer_norm's."""
    if centred:
        y = _reference.layer_norm(x, normalized_shape, weight, bias, eps, axis=axis)[0]
    else:
        assert bias is None, "RMSNorm has no bias"
        eps = _reference.rms_norm_default_eps(np.asarray(x).dtype) if eps is None else eps
        y = _reference.rms_norm(x, normalized_shape, weight, eps, axis=axis)[0]
    return y, _reference.output_scale(x, normalized_shape, weight, bias, eps, centred=centred, axis=axis)


# Relative (to ``scale``) error a correct kernel may make, per output dtype, against the
# float64 reference.  float64: 1e-12 (~4500 ulps) leaves room for summing 4097 float64 values
# in any order (naive summation error <= N * eps).  float32: 4 ulps: the spec computes the
# statistics in float64, so the output only suffers the handful of float32 roundings of
# (x - mean) * rstd * w + b.  float16: the output rounding is added separately (half an ulp of
# float16, we allow one), the 4 float32 ulps cover an intermediate computed in float32.
REF_REL_TOL = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 4 * float(np.finfo(np.float32).eps),
    np.dtype(np.float16): 4 * float(np.finfo(np.float32).eps),
}
if BF16 is not None:
    REF_REL_TOL[BF16] = REF_REL_TOL[np.dtype(np.float16)]  # float32 arithmetic, then its own rounding


# Gradients, relative to the size of the terms each is a sum or a cancellation of
# (grad_input_scale, grad_weight_scale; assert_close).  Against the float64 reference: a few
# float32 roundings of terms formed from statistics handed over in float32, and a few float64
# roundings for float64 data.  Against torch, whose float32 backward sums in float32: ~80
# float32 ulps.  float16 gradients are rounded to float16 (half an ulp ~ 5e-4) either way.
GRAD_REFERENCE_RTOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-13}
GRAD_TORCH_RTOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}

# (x, dy, eps) magnitudes whose products dy * (x - mean) lie below the compute type's normal
# range while x, dy and the gradients do not: float32 arithmetic for float16/bfloat16/float32
# data.  With eps 0, |x - mean| ~ 1 / rstd; with an eps that outweighs the variance, |x - mean|
# is far below 1 / rstd (rstd 1e15 for float32, 1e125 for float64).
TINY_PRODUCT_MAGNITUDES = {
    np.dtype(np.float16): [(1e-4, 1e-7, 0.0)],
    np.dtype(np.float32): [(1e-30, 1e-20, 0.0), (1e-20, 1e-30, 0.0), (1e-18, 1e-25, 0.0), (1e-36, 1e-6, 0.0),
                           (1e-36, 1e-11, 1e-30)],
    np.dtype(np.float64): [(1e-150, 1e-170, 0.0), (1e-100, 1e-215, 0.0), (1e-300, 1e-20, 0.0),
                           (1e-300, 1e-20, 1e-250)],
}


def tiny_product_id(case):
    """A test id for a (dtype, (x, dy, eps)) case of TINY_PRODUCT_MAGNITUDES."""
    dtype, (x_size, dy_size, eps) = case
    return f"{dtype.name}-x{x_size:g}-dy{dy_size:g}" + (f"-eps{eps:g}" if eps else "")


def f16_ulp(values, dtype=np.float16):
    """One ulp of `dtype` (float16, or bfloat16) at |values| (the spacing of its value nearest to
    the value); NaN at NaN."""
    mag = np.abs(np.asarray(values, dtype=np.float64)).astype(dtype)
    with np.errstate(invalid="ignore"):
        return np.spacing(mag).astype(np.float64)


def max_violation(actual, expected, tol):
    """Largest |actual - expected| / tol, NaNs required in the same places (inf if not)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    if not np.array_equal(nan_a, nan_e):
        return float("inf")
    ok = ~nan_e
    if not ok.any():
        return 0.0
    err = np.abs(actual[ok] - expected[ok])
    bound = np.broadcast_to(tol, expected.shape)[ok]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / bound)
    return float(ratio.max())


def assert_within(actual, expected, tol, what=""):
    """|actual - expected| <= tol elementwise (tol broadcast), NaN where expected is NaN."""
    v = max_violation(actual, expected, tol)
    if v > 1.0:
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        err = np.abs(actual - expected)
        i = np.unravel_index(np.nanargmax(err), err.shape) if err.size and not np.isnan(err).all() else ()
        raise AssertionError(
            f"{what}: error is {v:.3g} x the tolerance; worst at {i}: "
            f"actual={actual[i] if i else actual!r} expected={expected[i] if i else expected!r}"
        )


def assert_matches_reference(out, x, normalized_shape, weight=None, bias=None, eps=1e-5, *, centred=True,
                             axis=None):
    """Check a layer_norm output (an rms_norm one when not ``centred``: eps=None is torch's rule
    then) over ``axis`` against the float64 reference at the per-dtype tolerance."""
    dtype = np.dtype(out.dtype).newbyteorder("=")
    y, scale = reference_norm(x, normalized_shape, weight, bias, eps, centred=centred, axis=axis)
    tol = REF_REL_TOL[dtype] * scale
    if dtype.itemsize == 2:  # float16 or bfloat16: their own rounding of the float32 result
        tol = tol + f16_ulp(y, dtype)
    assert_within(out, y, tol, f"{dtype.name} output vs float64 reference")


def check_output_array(out, x_like, dtype):
    """A result is a new, writeable, C-contiguous ndarray of `dtype` (native byte order)."""
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.dtype(dtype)  # native byte order, the input's precision
    assert out.flags.c_contiguous
    assert out.flags.writeable
    if isinstance(x_like, np.ndarray):
        assert not np.shares_memory(out, x_like)


def assert_close(actual, expected, rtol, what="", scale=1.0):
    """Relative to the largest expected magnitude (at least `scale`), so near-zero entries that
    come out of a cancellation are judged against the size of the terms that cancelled."""
    assert actual is not None, what
    actual = np.asarray(actual)
    assert actual.shape == np.shape(expected), what
    magnitudes = np.abs(np.asarray(expected, np.float64))
    scale = max(float(np.max(magnitudes, where=~np.isnan(magnitudes), initial=0.0)), scale)  # NaN must match NaN
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol, atol=rtol * scale, err_msg=what)


def grad_input_scale(dy, x, normalized_shape, w, eps=1e-5, *, centred=True, axis=None):
    """Size of the terms grad_input is a cancellation of: max over elements of rstd * |dy * w|."""
    stats = _reference.normalize(x, normalized_shape, centred=centred, eps=eps, axis=axis)
    g = np.abs(np.asarray(dy, np.float64)) * np.abs(stats.expand(w))
    return max(float(np.max(stats.rstd * g, initial=0.0)), 1.0)


def grad_weight_scale(dy, x, normalized_shape, eps=1e-5, *, centred=True, axis=None):
    """Size of the products grad_weight sums: per column sum_rows |dy| * (|x| + |mean|) * rstd
    (an implementation may form x*rstd - mean*rstd, which cancels exactly when N == 1)."""
    if not np.size(x):
        return 1.0
    stats = _reference.normalize(x, normalized_shape, centred=centred, eps=eps, axis=axis)
    size = (np.abs(np.asarray(x, np.float64)) + np.abs(stats.mean)) * stats.rstd
    batch_axes = tuple(a for a in range(np.ndim(x)) if a not in stats.axes)
    return max(float(np.max((np.abs(np.asarray(dy, np.float64)) * size).sum(axis=batch_axes))), 1.0)


def assert_backward_matches_reference(grads, dy, x, n, w, dtype):
    """Each of (dx, dweight, dbias) against layernorm._reference's float64 ones, relative to the
    size of the terms it is made of: per row rstd * |dy * w| * (1 + (|x| + |mean|) * rstd) for
    dx (the kernel is handed statistics rounded to the param dtype), the column sums of
    |dy| * (|x| + |mean|) * rstd for dweight and of |dy| for dbias."""
    tol = GRAD_REFERENCE_RTOL[np.dtype(dtype)]
    stats = _reference.normalize(x, (n,), centred=True, eps=1e-5)
    x64, dy64 = np.abs(x.astype(np.float64)), np.abs(dy.astype(np.float64))
    size = (x64 + np.abs(stats.mean)) * stats.rstd
    g = dy64 * np.abs(w.astype(np.float64))
    scales = (stats.rstd * g.max(axis=-1, keepdims=True) * (1 + size.max(axis=-1, keepdims=True)),
              (dy64 * size).sum(axis=0), dy64.sum(axis=0))
    wants = _reference.layer_norm_backward(dy, x, (n,), w)
    for name, got, want, scale in zip(("dx", "dweight", "dbias"), grads, wants, scales):
        err = np.abs(got.astype(np.float64) - want)
        assert (err <= tol * np.maximum(scale, 1.0)).all(), name


# ---------------------------------------------------------------------------
# torch, the oracle
# ---------------------------------------------------------------------------

requires_torch = pytest.mark.skipif(torch is None, reason="torch is not installed: it is this test's oracle")


def torch_dtype(name):
    """The torch dtype called `name` ("int64", "bool", ...), looked up when a test runs."""
    return getattr(torch, name)


# Tolerance against torch, relative to the size of the rounded terms (see reference_layer_norm).
# float64: torch's float64 kernel is accurate too; both are within ~1e-12 of the truth.
# float32: torch accumulates its statistics in float32 (error ~ a few float32 ulps of |x|/std
#   on this zero-mean data); 1e-5 (~80 ulps) is loose for that, yet catches an unbiased variance
#   on short rows or a wrong eps placement on the float64 reference side (tight, REF_REL_TOL).
# float16: both round a float32-or-better value to float16, each within half an ulp plus a few
#   float32 ulps: they may differ by one float16 ulp.
TORCH_REL_TOL = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 8 * float(np.finfo(np.float32).eps),
}


def torch_scale(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, centred=True, axis=None):
    """Size of the terms torch's kernel rounds, per element.

    For float32/float64 torch computes (x - mean) * rstd * w + b: our ``scale``.  For float16
    input torch's CPU LayerNorm kernel computes x * (rstd * w) + (b - mean * rstd * w) in float32,
    so its error also scales with |x| * rstd * |w| and |mean| * rstd * |w| (that is why torch's
    float16 output on a constant row of 1234 is off by ~1e-2, see test_torch_float16_...).
    """
    _, scale = reference_norm(x, normalized_shape, weight, bias, eps, centred=centred, axis=axis)
    if np.asarray(x).dtype != np.float16 or not centred:
        return scale
    n = _reference.normalize(x, normalized_shape, centred=True, eps=eps, axis=axis)
    with np.errstate(invalid="ignore", over="ignore"):
        return scale + (np.abs(np.asarray(x, np.float64)) + np.abs(n.mean)) * np.abs(n.rstd) * np.abs(n.expand(weight))


def assert_matches_torch(out, expected, scale):
    """Check an output against torch's at TORCH_REL_TOL of `scale` (plus a float16 ulp)."""
    dtype = np.dtype(out.dtype).newbyteorder("=")
    tol = TORCH_REL_TOL[dtype] * scale
    if dtype == np.float16:
        tol = tol + np.maximum(f16_ulp(out), f16_ulp(expected))
    assert_within(out, expected, tol, f"{dtype.name} output vs torch")


def to_torch(a, dtype=None):
    """A NumPy array (None stays None) as a C-contiguous native torch tensor, cast to dtype."""
    if a is None:
        return None
    a = np.asarray(a)
    if dtype is not None:
        a = a.astype(dtype)
    return torch.from_numpy(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("=")))


def from_torch(value):
    """A torch tensor as a NumPy array, read detached, bit for bit (bfloat16 as ml_dtypes'
    dtype); anything else as it is."""
    if torch is None or not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).numpy().view(BF16)
    return value.numpy()


def torch_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch's F.layer_norm on numpy data, params cast to what torch accepts."""
    x = np.asarray(x)
    pdt = param_dtype(x.dtype)
    return F.layer_norm(
        to_torch(x), list(normalized_shape), to_torch(weight, pdt), to_torch(bias, pdt), eps
    ).numpy()


def torch_native_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.native_layer_norm on numpy data: (output, mean, rstd) as arrays."""
    x = np.asarray(x)
    pdt = param_dtype(x.dtype)
    out, mean, rstd = torch.native_layer_norm(
        to_torch(x), list(normalized_shape), to_torch(weight, pdt), to_torch(bias, pdt), eps
    )
    return out.numpy(), mean.numpy(), rstd.numpy()


def torch_native_backward(dy, x, normalized_shape, mean, rstd, w, b):
    """torch's backward kernel on the same data and the same mean/rstd (float16 data upcast to
    float32, the dtype torch computes it in): (grad_input, grad_weight, grad_bias) arrays."""
    if np.dtype(x.dtype) == np.float16:
        dy, x = dy.astype(np.float32), x.astype(np.float32)
    mask = [True, w is not None, b is not None]  # torch refuses True for a missing parameter
    grads = torch.ops.aten.native_layer_norm_backward(
        to_torch(dy), to_torch(x), list(normalized_shape), to_torch(mean), to_torch(rstd),
        to_torch(w), to_torch(b), mask)
    return tuple(None if g is None else g.numpy() for g in grads)


def axes_last(a, axes):
    """``a`` (an array or a tensor) with ``axes`` moved to the end in the order given: the
    permute route torch code takes for a norm over other axes."""
    other = [d for d in range(a.ndim) if d not in axes]
    order = other + list(axes)
    return a.permute(order) if torch is not None and isinstance(a, torch.Tensor) else np.transpose(a, order)


def axes_back(a, axes):
    """Undo axes_last: an array of the permuted shape back in the original order of axes."""
    other = [d for d in range(a.ndim) if d not in axes]
    return np.transpose(a, np.argsort(other + list(axes)))


def torch_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, centred=True, axis=None):
    """torch.native_layer_norm (centred) or aten._fused_rms_norm on numpy data over ``axis``
    by the permute route: (output, mean, rstd) or (output, rstd) as arrays of x's order of axes."""
    x = np.asarray(x)
    pdt = param_dtype(x.dtype)
    axes = _reference.normalized_axes(x.ndim, normalized_shape, axis)
    xt = axes_last(to_torch(x), axes)
    if centred:
        results = torch.native_layer_norm(xt, list(normalized_shape), to_torch(weight, pdt), to_torch(bias, pdt), eps)
    else:
        assert bias is None, "RMSNorm has no bias"
        results = torch.ops.aten._fused_rms_norm(xt, list(normalized_shape), to_torch(weight, pdt), eps)
    return tuple(axes_back(r.numpy(), axes) for r in results)


def torch_autograd(dy, x, normalized_shape, w, b, eps=1e-5, *, centred=True, axis=None):
    """torch autograd through F.layer_norm (F.rms_norm when not ``centred``) over ``axis`` by
    the permute route: (grad_input, grad_weight, grad_bias) arrays, None for a missing one."""
    axes = _reference.normalized_axes(np.ndim(x), normalized_shape, axis)
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    wt = None if w is None else torch.from_numpy(w.copy()).requires_grad_(True)
    bt = None if b is None else torch.from_numpy(b.copy()).requires_grad_(True)
    if centred:
        y = F.layer_norm(axes_last(xt, axes), list(normalized_shape), wt, bt, eps)
    else:
        assert b is None, "RMSNorm has no bias"
        y = F.rms_norm(axes_last(xt, axes), list(normalized_shape), wt, eps)
    y.backward(axes_last(torch.from_numpy(dy.copy()), axes))
    return tuple(None if p is None else p.grad.numpy() for p in (xt, wt, bt))


def torch_message(fn):
    """The text of the RuntimeError (or subclass) torch raises from ``fn()``."""
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("torch did not raise: the oracle disagrees with the test's premise")


@functools.lru_cache(maxsize=None)
def demo_output():
    """What ``python -m layernorm`` prints, run once a session, with no LAYERNORM_* setting of
    the environment in effect."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERNORM_")}
    demo = subprocess.run([sys.executable, "-m", "layernorm"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert demo.returncode == 0, demo.stderr
    return demo.stdout


# ---------------------------------------------------------------------------
# Child processes: calls that might crash, hang or exhaust memory run in a fresh interpreter with
# a memory limit and a timeout, so that such a failure fails one test instead of ending the run
# ---------------------------------------------------------------------------


class ChildOutcome(NamedTuple):
    """What a call made in a child process did."""

    error: object  # the exception's class name ("MemoryError"), or None when the call returned
    message: str  # str() of the exception, or repr() of what the call returned
    peak_growth: object  # bytes the child's peak resident memory grew by during the call (Linux), or None


# The child: set the limit once numpy and layernorm are imported, run `setup` then `call`, and
# print what happened as one line of JSON.
_CHILD_SCRIPT = r"""
import json, os, resource, sys
sys.path.insert(0, os.environ["LAYERNORM_TEST_IMPORT_PATH"])
import numpy as np
import layernorm

def status_bytes(field):
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

setup, call, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
space = {"np": np, "layernorm": layernorm}
exec(setup, space)
in_use = status_bytes("VmSize")
if in_use is not None:
    resource.setrlimit(resource.RLIMIT_AS, (in_use + limit, in_use + limit))
before = status_bytes("VmRSS")
try:
    result = {"error": None, "message": repr(eval(call, space))}
except BaseException as error:
    result = {"error": type(error).__name__, "message": str(error)}
peak = status_bytes("VmHWM")
result["peak_growth"] = None if before is None else peak - before
print(json.dumps(result))
"""


def run_in_child(call, setup="", memory=2 * 2**30, timeout=120):
    """Evaluate the expression `call` after running `setup` (both Python source; numpy is np) in a
    fresh interpreter whose address space may grow by `memory` bytes past what the imports
    took (Linux; elsewhere there is no limit); return its ChildOutcome.

    A child killed by a signal or still running after `timeout` seconds fails the test.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERNORM_")}
    env["LAYERNORM_TEST_IMPORT_PATH"] = os.path.dirname(os.path.dirname(os.path.abspath(layernorm.__file__)))
    env["OPENBLAS_NUM_THREADS"] = "1"  # NumPy's BLAS threads would only take address space
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD_SCRIPT, setup, call, str(memory)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{call} still ran after {timeout} s") from None
    if proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        raise AssertionError(f"{call} ended its process with {how}:\n{proc.stderr[-2000:]}")
    return ChildOutcome(**json.loads(proc.stdout.splitlines()[-1]))
