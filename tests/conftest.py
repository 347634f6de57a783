"""Shared helpers for the layernorm test-suite.

torch is the oracle for behaviour and messages; a float64 NumPy formula (below) is the
ground truth for values.  torch is a required test dependency, so it is imported directly.
"""

import numpy as np
import pytest
import torch

import layernorm
from layernorm import _reference

# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------

FLOAT_DTYPES = (np.float16, np.float32, np.float64)

TORCH_DTYPE = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


def param_dtype(dtype):
    """The compute ("param") dtype of the spec: float32 for f16/f32 input, float64 for f64."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def dtype_id(dtype):
    return np.dtype(dtype).name


def shape_id(shape):
    return "x".join(str(s) for s in shape) if len(shape) else "scalar"


# ---------------------------------------------------------------------------
# The ground truth: layernorm._reference, LayerNorm in float64
# ---------------------------------------------------------------------------


def reference_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Return (y, mean, rstd, scale) from layernorm._reference (float64, exact input values).

    mean/rstd have shape x.shape[:-D] + (1,) * D.  ``scale`` = |xhat * w| + |w| + |b| per
    element: the size of the terms a kernel rounds while forming y, used to scale tolerances.
    """
    y, mean, rstd = _reference.layer_norm(x, normalized_shape, weight, bias, eps)
    return y, mean, rstd, _reference.output_scale(x, normalized_shape, weight, bias, eps)


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


def f16_ulp(values):
    """One float16 ulp at |values| (the spacing of the float16 nearest to the value)."""
    mag = np.abs(np.asarray(values, dtype=np.float64)).astype(np.float16)
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


def assert_matches_reference(out, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Check a layer_norm output against the float64 reference at the per-dtype tolerance."""
    dtype = np.dtype(out.dtype).newbyteorder("=")
    y, _, _, scale = reference_layer_norm(x, normalized_shape, weight, bias, eps)
    tol = REF_REL_TOL[dtype] * scale
    if dtype == np.float16:
        tol = tol + f16_ulp(y)
    assert_within(out, y, tol, f"{dtype.name} output vs float64 reference")


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


def make_input(shape, dtype, seed=0, scale=2.0, offset=0.0):
    """Deterministic values exactly representable in ``dtype``, C-contiguous."""
    rng = np.random.default_rng(seed)
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


def make_params(normalized_shape, dtype, affine, seed=1):
    """(weight, bias) for affine in {"weight+bias", "weight", "bias", "none"}."""
    rng = np.random.default_rng(seed)
    weight = (1.0 + 0.5 * rng.standard_normal(normalized_shape)).astype(dtype)
    bias = rng.standard_normal(normalized_shape).astype(dtype)
    return (
        weight if affine in ("weight+bias", "weight") else None,
        bias if affine in ("weight+bias", "bias") else None,
    )


AFFINES = ("weight+bias", "weight", "bias", "none")


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


def layout(name, base):
    """Lay out ``base`` as ``name``; lists of floats are float64 by nature."""
    made = LAYOUTS[name](base)
    if isinstance(made, np.ndarray):
        np.testing.assert_array_equal(made, base)
    return made


# ---------------------------------------------------------------------------
# torch oracle
# ---------------------------------------------------------------------------


def to_torch(a, dtype=None):
    if a is None:
        return None
    a = np.asarray(a)
    if dtype is not None:
        a = a.astype(dtype)
    return torch.from_numpy(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("=")))


def torch_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch's F.layer_norm on numpy data, params cast to what torch accepts."""
    x = np.asarray(x)
    pdt = np.float64 if x.dtype == np.float64 else np.float32
    return torch.nn.functional.layer_norm(
        to_torch(x), list(normalized_shape), to_torch(weight, pdt), to_torch(bias, pdt), eps
    ).numpy()


def torch_native_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    x = np.asarray(x)
    pdt = np.float64 if x.dtype == np.float64 else np.float32
    out, mean, rstd = torch.native_layer_norm(
        to_torch(x), list(normalized_shape), to_torch(weight, pdt), to_torch(bias, pdt), eps
    )
    return out.numpy(), mean.numpy(), rstd.numpy()


def torch_message(fn):
    """The text of the RuntimeError (or subclass) torch raises from ``fn()``."""
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("torch did not raise: the oracle disagrees with the test's premise")


# ---------------------------------------------------------------------------
# Runtime state: SIMD level and thread count are process-global; restore them.
# ---------------------------------------------------------------------------


@pytest.fixture
def restore_runtime():
    level = layernorm.simd_level()
    threads = layernorm.get_num_threads()
    yield
    layernorm.set_simd_level(level)
    layernorm.set_num_threads(threads)
