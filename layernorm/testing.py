"""Check a hand-written LayerNorm or RMSNorm against the float64 truth, and name the mistake.

``assert_layer_norm_close`` and ``assert_rms_norm_close`` compare an output with
``layernorm._reference`` (float64, exact input values) at ``torch.testing.assert_close``'s
tolerances for the output's dtype.  When they differ, the AssertionError gives the largest
difference and where, then names each classic mistake the output matches, by a code in square
brackets with its fix: each mistaken formula is computed in float64 on the same input and
compared with the same tolerance.  ``diagnose`` calls a function or module on probe inputs
whose rows tell the mistakes apart::

    >>> from layernorm.testing import assert_layer_norm_close, diagnose
    >>> assert_layer_norm_close(my_output, x, (768,), weight, bias)   # doctest: +SKIP
    >>> print(diagnose(MyLayerNorm(768), 768))                         # doctest: +SKIP

NumPy only: torch is imported when a parameter module needs its values set, or when ``fn``
refuses a NumPy array; tensors given as arguments are read without importing it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _reference as ref
from .functional import _bfloat16_dtype, _is_bfloat16
from .modules import NormModule, _as_shape

__all__ = ["Diagnosis", "assert_layer_norm_close", "assert_rms_norm_close", "diagnose"]

Axis = Union[None, int, Sequence[int]]

# torch.testing.assert_close's default (rtol, atol) by dtype (torch/testing/_comparison.py);
# integer and bool outputs must be exact there too.
_TOLERANCES = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}
_EXACT = (0.0, 0.0)

# ---------------------------------------------------------------------------------- inputs


def _as_array(value: Any) -> Tuple[np.ndarray, str]:
    """value as an ndarray and the name of its dtype; a torch tensor is detached and moved to
    the CPU, and a bfloat16 one (tensor or ml_dtypes array) comes back as float32, exactly."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a tensor, without importing torch
        value = value.detach().cpu()
        name = str(value.dtype).replace("torch.", "")
        if name == "bfloat16":
            value = value.float()
        return np.asarray(value.numpy()), name
    array = np.asarray(value)
    if _is_bfloat16(array.dtype):  # ml_dtypes' bfloat16, widened exactly as a tensor's is
        return array.astype(np.float32), "bfloat16"
    return array, array.dtype.name


def _real(array: np.ndarray, what: str) -> np.ndarray:
    if array.dtype.kind not in "fiub":
        raise TypeError(f"{what} must hold real numbers, got dtype {array.dtype}")
    return array


def _tolerance(dtype_name: str, rtol: Optional[float], atol: Optional[float]) -> Tuple[float, float]:
    if (rtol is None) != (atol is None):
        raise ValueError("rtol and atol must both be given or both be omitted")
    if rtol is not None:
        return float(rtol), float(atol)  # type: ignore[arg-type]
    return _TOLERANCES.get(dtype_name, _EXACT)


class _Problem(NamedTuple):
    """What the output should be: the op, its input and arguments, axes resolved."""

    kind: str  # "layer_norm" or "rms_norm"
    x: np.ndarray
    normalized_shape: Tuple[int, ...]
    axes: Tuple[int, ...]
    weight: Optional[np.ndarray]  # float64, shaped like normalized_shape
    bias: Optional[np.ndarray]
    eps: float
    dtype_name: Optional[str]  # the input's float dtype, which the output should have; None: no dtype

    @property
    def op(self) -> str:
        return "LayerNorm" if self.kind == "layer_norm" else "RMSNorm"


def _normalized_shape(normalized_shape: Any) -> Tuple[int, ...]:
    """normalized_shape as a tuple of ints, as LayerNorm reads it; empty is refused, as torch does."""
    shape = _as_shape(normalized_shape)
    if not shape:
        raise ValueError("normalized_shape must have at least one dimension, as in torch")
    return shape


def _eps(eps: Any) -> float:
    """eps as a float; anything but a real number is a TypeError (float('1e-5') would pass)."""
    if not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    return float(eps)


def _problem(kind: str, input: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Optional[float],
             axis: Axis) -> _Problem:
    x, x_dtype_name = _as_array(input)
    x = _real(x, "input")
    shape = _normalized_shape(normalized_shape)
    axes = ref.normalized_axes(x.ndim, shape, axis)
    if tuple(x.shape[a] for a in axes) != shape:
        where = f"axes {axes}" if axis is not None else f"its last {len(shape)} dims"
        raise ValueError(f"normalized_shape {shape} does not match the input's shape {x.shape} over {where}")
    params = []
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None:
            value = _real(_as_array(value)[0], name).astype(np.float64)
            if value.shape != shape:
                raise ValueError(f"{name} has shape {value.shape}, normalized_shape is {shape}")
        params.append(value)
    # None is RMSNorm's default (torch's rule, by the input's dtype); layer_norm has no such default
    rms_default = kind == "rms_norm" and eps is None
    return _Problem(kind, x, shape, axes, params[0], params[1],
                    ref.rms_norm_default_eps(x.dtype) if rms_default else _eps(eps),
                    x_dtype_name if hasattr(input, "dtype") and x_dtype_name in _TOLERANCES else None)


def _expected(p: _Problem, eps: Optional[float] = None) -> np.ndarray:
    """The float64 truth for p, or for p with another eps."""
    eps = p.eps if eps is None else eps
    if p.kind == "layer_norm":
        return ref.layer_norm(p.x, p.normalized_shape, p.weight, p.bias, eps, axis=p.axes)[0]
    return ref.rms_norm(p.x, p.normalized_shape, p.weight, eps, axis=p.axes)[0]


# ---------------------------------------------------------------------------------- closeness


def _misfit(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """|actual - expected| / (atol + rtol * |expected|) per element: 1 is the tolerance; 0 where
    both are equal (infinities, NaN with NaN), inf where one is NaN and the other is not."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ratio = np.abs(actual - expected) / (atol + rtol * np.abs(expected))
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    both_nan = np.isnan(actual) & np.isnan(expected)
    return np.where((actual == expected) | both_nan, 0.0, ratio)


def _worst(misfit: np.ndarray) -> float:
    return float(misfit.max()) if misfit.size else 0.0


# ---------------------------------------------------------------------------------- the mistakes

# code: (explanation, fix) per op; {fields} are filled in by the variant that matched.
_LAYER_NORM_TEXT = {
    "unbiased-variance": (
        "it divides the variance by N - 1 (torch.var and Tensor.std do by default); LayerNorm's divides by N",
        "x.var(dim, unbiased=False, keepdim=True) in torch, x.var(axis, keepdims=True) (ddof=0) in NumPy"),
    "eps-outside-sqrt": (
        "it divides by std + eps; LayerNorm divides by sqrt(var + eps)",
        "(x - mean) / sqrt(var + eps): eps goes inside the square root, e.g. torch.rsqrt(var + eps)"),
    "no-affine": (
        "{detail}",
        "end with xhat * weight + bias (weight and bias shaped like normalized_shape)"),
    "weight-bias-swapped": (
        "it computes xhat * bias + weight: weight and bias are swapped",
        "xhat * weight + bias; check the order where the parameters are made or loaded"),
    "one-pass-variance": (
        "its variances are off by up to {worst} of the true ones, on rows whose mean is up to {ratio} times"
        " their standard deviation: mean(x**2) - mean**2 in {dtype} cancels away their digits",
        "take the variance of the centred values: ((x - mean)**2).mean(axis), x.var(axis) in NumPy,"
        " torch.var_mean(x, dim, unbiased=False) in torch"),
}
_RMS_NORM_TEXT = {
    "eps-outside-sqrt": (
        "it divides by rms + eps; RMSNorm divides by sqrt(mean(x**2) + eps)",
        "x / sqrt(mean(x**2) + eps): eps goes inside the square root,"
        " e.g. x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)"),
    "no-affine": (
        "the weight is not applied",
        "end with x * rstd * weight (weight shaped like normalized_shape)"),
    "rms-centred": (
        "it subtracts the mean first, which is LayerNorm; RMSNorm scales x itself",
        "x * rsqrt(mean(x**2) + eps) * weight, without subtracting the mean"),
    "rms-one-plus-weight": (
        "it computes x * rstd * (1 + weight): Gemma's convention, which stores the weight as an offset from 1",
        "for a Gemma-style model compare with weight = 1 + weight (here and in torch's RMSNorm);"
        " otherwise multiply by the weight itself"),
}
_SHARED_TEXT = {
    "eps-value": (
        "it fits eps={fitted} in every row, not the eps={eps} compared with",
        "use eps={eps} in your code, or compare with eps={fitted} if that is the eps you mean"),
    "wrong-axes": (
        "it normalizes over axes {found} (statistics per {found_slice}), not over axes {axes} (per {slice})",
        "reduce over axes {axes} only, with keepdims=True: x.mean(axis={axes}, keepdims=True)"),
}
_CODES = {
    "layer_norm": ("unbiased-variance", "one-pass-variance", "eps-outside-sqrt", "eps-value", "wrong-axes",
                   "no-affine", "weight-bias-swapped"),
    "rms_norm": ("rms-centred", "rms-one-plus-weight", "eps-outside-sqrt", "eps-value", "wrong-axes",
                 "no-affine"),
}

# eps values people type, tried before the fitted value itself so the report shows 1e-06, not
# 1.0000003e-06; float32's machine epsilon is torch's RMSNorm default.
_COMMON_EPS = (0.0, 1e-12, 1e-10, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1,
               float(np.finfo(np.float32).eps), float(np.finfo(np.float64).eps))


class _Variant(NamedTuple):
    """One mistaken formula evaluated on the problem's input."""

    code: str
    fields: Dict[str, Any]
    output: np.ndarray


def _slice(ndim: int, axes: Sequence[int]) -> str:
    """x[i, :, j] for statistics over ``axes`` (``:`` on them, an index on the others)."""
    letters = iter("ijklmnpqrs")
    parts = [":" if a in axes else next(letters, "?") for a in range(ndim)]
    while parts and parts[-1] == ":":
        parts.pop()
    return "x[" + ", ".join(parts) + "]" if parts else "the whole x"


def _other_axes(ndim: int, axes: Tuple[int, ...]) -> Iterator[Tuple[int, ...]]:
    """Every other set of axes (contiguous runs only above 5 dims, to bound the count)."""
    subsets: Iterable[Tuple[int, ...]]
    if ndim <= 5:
        subsets = itertools.chain.from_iterable(itertools.combinations(range(ndim), k)
                                                for k in range(1, ndim + 1))
    else:
        subsets = (tuple(range(lo, hi)) for lo in range(ndim) for hi in range(lo + 1, ndim + 1))
    return (s for s in subsets if set(s) != set(axes))


def _fitted_rstd(p: _Problem, actual: np.ndarray, deviation: np.ndarray, w: Any, b: Any) -> np.ndarray:
    """Each row's rstd as the output implies it: y - b = deviation * w * rstd, by least squares."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        signal = deviation * w
        rstd: np.ndarray = (np.sum((actual - b) * signal, axis=p.axes, keepdims=True)
                            / np.sum(signal * signal, axis=p.axes, keepdims=True))
    return rstd


def _fitted_eps(p: _Problem, fitted_rstd: np.ndarray, var: np.ndarray,
                fits: Callable[[np.ndarray], bool]) -> Optional[Tuple[float, np.ndarray]]:
    """The one eps that fits every row, with its output, or None.  Solved from the row of smallest
    variance (where eps shows most): there the row's fitted rstd gives eps = 1 / rstd**2 - var."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        eps_per_row = fitted_rstd ** -2.0 - var
    usable = np.isfinite(eps_per_row) & (fitted_rstd > 0)
    if not usable.any():
        return None
    fitted = float(eps_per_row.flat[int(np.argmin(np.where(usable, var, np.inf)))])
    common = sorted(_COMMON_EPS, key=lambda e: abs(e - fitted))
    rounded = [float(f"{fitted:.{digits}e}") for digits in range(3)]
    for eps in dict.fromkeys(common + rounded + [fitted]):
        if eps != p.eps:
            output = _expected(p, eps)
            if fits(output):
                return eps, output
    return None


def _one_pass_variance(p: _Problem, fitted_rstd: np.ndarray, deviation: np.ndarray, mean: np.ndarray, var: np.ndarray,
                       w: Any, b: Any) -> Optional[_Variant]:
    """The output with each row's variance as the output implies it, when those are what
    mean(x**2) - mean(x)**2 in the input's dtype can give and a centred variance cannot: every
    row's within sqrt(N) units in the last place of mean(x**2) + eps of the true variance, and
    some row's further from it than sqrt(N) units of var + eps.  Else None."""
    if p.x.dtype.kind != "f":
        return None
    unit = float(np.finfo(p.x.dtype).eps) * max(8.0, math.sqrt(math.prod(p.normalized_shape)))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        error = np.abs(fitted_rstd ** -2.0 - p.eps - var)
        rounding = unit * (var + p.eps)  # what the output's own rounding leaves of var + eps
        cancelled = error > rounding
        if not (np.isfinite(error).all() and (error <= rounding + unit * mean ** 2).all() and cancelled.any()):
            return None
        ratio = float(np.max(np.abs(mean) / np.sqrt(var), where=cancelled, initial=0.0))
        worst = float(np.max(error / var))
    fields = {"worst": f"{worst:.2g}", "ratio": f"{ratio:.3g}", "dtype": p.x.dtype.name}
    return _Variant("one-pass-variance", fields, deviation * fitted_rstd * w + b)


def _variants(p: _Problem, actual: np.ndarray, fits: Callable[[np.ndarray], bool]) -> Iterator[_Variant]:
    """Each classic mistake this input can show, computed in float64 from the same input."""
    centred = p.kind == "layer_norm"
    count = math.prod(p.normalized_shape)
    if p.x.size == 0 or count == 0:
        return
    n = ref.normalize(p.x, p.normalized_shape, centred=centred, eps=p.eps, axis=p.axes)
    unregularized = ref.normalize(p.x, p.normalized_shape, centred=centred, eps=0.0, axis=p.axes)
    w = n.expand(p.weight)
    b = 0.0 if p.bias is None else n.expand(p.bias)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        deviation = p.x.astype(np.float64) - n.mean
        var = unregularized.rstd ** -2.0  # mean(x**2) for RMSNorm
        fitted_rstd = _fitted_rstd(p, actual, deviation, w, b)  # each row's, as the output implies it
        if centred and count > 1:
            unbiased = deviation / np.sqrt(var * count / (count - 1) + p.eps)
            yield _Variant("unbiased-variance", {}, unbiased * w + b)
            one_pass = _one_pass_variance(p, fitted_rstd, deviation, n.mean, var, w, b)
            if one_pass is not None:
                yield one_pass
        yield _Variant("eps-outside-sqrt", {}, deviation / (np.sqrt(var) + p.eps) * w + b)
        found = _fitted_eps(p, fitted_rstd, var, fits)
        if found is not None:
            yield _Variant("eps-value", {"fitted": f"{found[0]:.6g}", "eps": f"{p.eps:.6g}"}, found[1])
        for axes in _other_axes(p.x.ndim, p.axes):
            sizes = tuple(p.x.shape[a] for a in axes)
            xhat = ref.normalize(p.x, sizes, centred=centred, eps=p.eps, axis=axes).xhat
            fields = {"found": axes, "found_slice": _slice(p.x.ndim, axes), "axes": p.axes,
                      "slice": _slice(p.x.ndim, p.axes)}
            yield _Variant("wrong-axes", fields, xhat * w + b)
        if p.weight is not None and p.bias is not None:
            yield _Variant("no-affine", {"detail": "the weight and bias are not applied"}, n.xhat)
            yield _Variant("weight-bias-swapped", {}, n.xhat * n.expand(p.bias) + n.expand(p.weight))
        if p.weight is not None:
            yield _Variant("no-affine", {"detail": "the weight is not applied"}, n.xhat + b)
        if p.bias is not None:
            yield _Variant("no-affine", {"detail": "the bias is not added"}, n.xhat * w)
        if not centred:
            yield _Variant("rms-centred", {},
                           ref.layer_norm(p.x, p.normalized_shape, p.weight, None, p.eps, axis=p.axes)[0])
            if p.weight is not None:
                yield _Variant("rms-one-plus-weight", {}, n.xhat * (1.0 + w))


class _Finding(NamedTuple):
    code: str
    misfit: float  # the worst element's misfit, <= 1
    explanation: str
    fix: str


# A mistake is named when it fits the output at least this many times closer than the float64
# reference does.  An output just outside the tolerance (a correct float16, bfloat16 or float32
# kernel on rows whose mean is hundreds of times their spread, torch's among them) lies about
# as near to a mistake fitted to it (an eps, a one-pass variance) as to the reference: over
# 6,000 random calls of torch's F.layer_norm (rows of 2 to 100 elements, means up to 1000
# times their spread), the mistakes that fit those that failed came at most 3.8 times closer.
# Six classic mistakes made on purpose, 600 float32/float64 calls each, came 8 times closer or
# more in 99% or more of the calls where they fit.
_CLEAR_FIT = 8.0


def _findings(p: _Problem, actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float,
              reference_misfit: float) -> Tuple[List[_Finding], List[_Finding]]:
    """The mistakes whose float64 output matches ``actual`` within the tolerance, best fit first
    (one per code): those that fit it _CLEAR_FIT times closer than the reference does (whose
    worst misfit is `reference_misfit`), and the others.  A mistake this input cannot show (its
    output passes as the truth) is skipped."""
    def fits(output: np.ndarray) -> bool:
        return _worst(_misfit(actual, output, rtol, atol)) <= 1.0

    texts = {**_SHARED_TEXT, **(_LAYER_NORM_TEXT if p.kind == "layer_norm" else _RMS_NORM_TEXT)}
    best: Dict[str, _Finding] = {}
    for variant in _variants(p, actual, fits):
        if _worst(_misfit(expected, variant.output, rtol, atol)) <= 1.0:
            continue
        misfit = _worst(_misfit(actual, variant.output, rtol, atol))
        if misfit <= 1.0 and (variant.code not in best or misfit < best[variant.code].misfit):
            explanation, fix = texts[variant.code]
            best[variant.code] = _Finding(variant.code, misfit, explanation.format(**variant.fields),
                                          fix.format(**variant.fields))
    ranked = sorted(best.values(), key=lambda f: f.misfit)
    clear = [f for f in ranked if f.misfit * _CLEAR_FIT <= reference_misfit]  # a prefix of ranked
    return clear, ranked[len(clear):]


# ---------------------------------------------------------------------------------- the report


class _Report(NamedTuple):
    ok: bool
    max_error: float
    findings: Tuple[_Finding, ...]
    lines: Tuple[str, ...]  # what differs and, when not ok, what it matches


def _index(flat: int, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def _shape_hint(actual_shape: Tuple[int, ...], p: _Problem) -> Optional[str]:
    x_shape = p.x.shape
    if len(actual_shape) == len(x_shape) and sorted(actual_shape) == sorted(x_shape):
        unused = list(range(len(x_shape)))
        order = []
        for size in actual_shape:
            axis = next(a for a in unused if x_shape[a] == size)
            unused.remove(axis)
            order.append(axis)
        return (f"it is the input's shape with its axes in the order {tuple(order)}: move them back"
                " (np.moveaxis, Tensor.permute) before returning")
    per_row = tuple(size for a, size in enumerate(x_shape) if a not in p.axes)
    try:
        broadcast = np.broadcast_shapes(x_shape, per_row)
    except ValueError:
        return None
    if broadcast == actual_shape:
        return (f"it is the input broadcast against a statistic of shape {per_row}, taken without"
                " keepdims: reduce with keepdims=True (keepdim=True in torch)")
    return None


def _code_list(findings: Sequence[_Finding]) -> str:
    """``[a]``, ``[a] and [b]``, ``[a], [b] and [c]``."""
    codes = [f"[{f.code}]" for f in findings]
    return codes[-1] if len(codes) == 1 else ", ".join(codes[:-1]) + " and " + codes[-1]


def _finding_lines(findings: Sequence[_Finding], near: Sequence[_Finding], reference_misfit: float,
                   codes: Sequence[str]) -> List[str]:
    if not findings:
        lines = ["It matches none of the classic mistakes known here: " + ", ".join(f"[{c}]" for c in codes) + "."]
        if near:
            lines.append(f"It is {reference_misfit:.2g} times its tolerance from the reference: rounding in a correct"
                         f" kernel can put it there, and {_code_list(near)} fit{'s' if len(near) == 1 else ''} it"
                         " about as well; rows of other scales and means tell them apart (layernorm.testing.diagnose"
                         " does).")
        return lines
    lines = ["It matches a classic mistake:" if len(findings) == 1 else
             f"It matches {len(findings)} classic mistakes, the closest fit first:"]
    for f in findings:
        lines += [f"  [{f.code}] {f.explanation}.", f"    fix: {f.fix}."]
    if len(findings) > 1:
        lines.append(f"The input cannot tell apart {_code_list(findings)}: use rows of different scales and means"
                     " (layernorm.testing.diagnose does).")
    return lines


_DTYPE_FIX = ("compute in the input's dtype, or cast the result back: y.astype(x.dtype) in NumPy, y.to(x.dtype)"
              " in torch (in NumPy, float64 parameters such as np.ones(n) promote a float32 input)")


def _dtype_lines(p: _Problem, dtype_name: str) -> List[str]:
    return [f"The output's dtype is {dtype_name}, the input's {p.dtype_name}: a {p.op} output has the input's"
            " dtype (torch's does, with float32 weight and bias too).",
            f"  [output-dtype] fix: {_DTYPE_FIX}."]


def _compare(actual_value: Any, p: _Problem, rtol: Optional[float], atol: Optional[float],
             check_dtype: bool = True) -> _Report:
    actual, dtype_name = _as_array(actual_value)
    # an output of another dtype is held to the tolerances of the dtype it should have, and one
    # without a dtype of its own (a list) to the input's
    has_dtype = hasattr(actual_value, "dtype")
    expected_dtype = p.dtype_name if check_dtype and has_dtype else None
    wrong_dtype = expected_dtype is not None and dtype_name != expected_dtype
    if not has_dtype and p.dtype_name is not None:
        dtype_name = p.dtype_name
    rtol, atol = _tolerance(expected_dtype or dtype_name, rtol, atol)
    actual = _real(actual, "the output").astype(np.float64)
    if actual.shape != p.x.shape:
        lines = [f"The output has shape {actual.shape}, the input {p.x.shape}: a {p.op} output has the input's shape."]
        hint = _shape_hint(actual.shape, p)
        if hint:
            lines.append(f"Hint: {hint}.")
        return _Report(False, math.inf, (), tuple(lines))
    expected = _expected(p)
    misfit = _misfit(actual, expected, rtol, atol)
    nan_mismatch = np.isnan(actual) != np.isnan(expected)
    with np.errstate(invalid="ignore"):
        # 0 where equal (an infinity of the right sign, NaN with NaN), inf against an infinity
        difference = np.where((actual == expected) | np.isnan(actual) | np.isnan(expected), 0.0,
                              np.abs(actual - expected))
    # an element NaN on one side alone has no finite error either
    max_error = math.inf if nan_mismatch.any() else float(np.max(difference, initial=0.0))
    dtype_finding = (_Finding("output-dtype", 0.0, "", _DTYPE_FIX),) if wrong_dtype else ()
    dtype_lines = _dtype_lines(p, dtype_name) if wrong_dtype else []
    if _worst(misfit) <= 1.0:
        if wrong_dtype:
            return _Report(False, max_error, dtype_finding,
                           tuple(dtype_lines + [f"Its values agree with the float64 reference at {expected_dtype}'s"
                                                f" tolerances (max abs error {max_error:.2g})."]))
        return _Report(True, max_error, (), (f"max abs error {max_error:.2g}",))
    bad = misfit > 1.0
    measure = f"{expected_dtype}'s tolerances" if wrong_dtype else f"{dtype_name} output"
    lines = dtype_lines + [f"{p.op} output differs from the float64 reference ({measure}:"
                           f" rtol={rtol:g}, atol={atol:g}).",
                           f"Mismatched elements: {int(bad.sum())} / {bad.size} ({100 * bad.mean():.1f}%)."]

    def allowed(flat: int) -> str:
        return f"up to {atol + rtol * abs(float(expected.flat[flat])):.2g} allowed there"

    greatest = int(np.argmax(difference))
    # (where the only mismatches are NaNs, the lines below name them; the greatest finite
    # difference would point at an element that passes)
    if difference.flat[greatest] > 0.0 and (bad & ~nan_mismatch).any():
        lines.append(f"Greatest absolute difference: {float(difference.flat[greatest]):.3g} at index"
                     f" {_index(greatest, actual.shape)} ({allowed(greatest)}).")
    # the element furthest outside its own tolerance, where that is another one (an error
    # near zero fails with less difference than one on a large output passes with)
    furthest = int(np.argmax(np.where(nan_mismatch, -1.0, misfit)))
    if furthest != greatest and misfit.flat[furthest] > 1.0 and not nan_mismatch.flat[furthest]:
        lines.append(f"Furthest outside its tolerance: {float(actual.flat[furthest]):.7g} at index"
                     f" {_index(furthest, actual.shape)} where the reference is {float(expected.flat[furthest]):.7g}"
                     f" ({allowed(furthest)}).")
    for where, what in ((np.isnan(actual) & ~np.isnan(expected), "NaN where the reference is not"),
                        (~np.isnan(actual) & np.isnan(expected), "Not NaN where the reference is NaN")):
        if where.any():
            first = _index(int(np.argmax(where)), actual.shape)
            count = int(where.sum())
            lines.append(f"{what}: {count} element{'s' if count > 1 else ''}, the first at index {first}.")
    reference_misfit = _worst(misfit)
    findings, near = _findings(p, actual, expected, rtol, atol, reference_misfit)
    lines += _finding_lines(findings, near, reference_misfit, _CODES[p.kind])
    return _Report(False, max_error, dtype_finding + tuple(findings), tuple(lines))


# ---------------------------------------------------------------------------------- assertions


def assert_layer_norm_close(actual: Any, input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
                            eps: float = 1e-5, *, axis: Axis = None, rtol: Optional[float] = None,
                            atol: Optional[float] = None, check_dtype: bool = True) -> None:
    """Assert that ``actual`` is LayerNorm of ``input``, as torch's F.layer_norm defines it.

    Parameters
    ----------
    actual : array-like or torch tensor
        The output to check (a tensor is detached and moved to the CPU).
    input, normalized_shape, weight, bias, eps
        As for F.layer_norm; the truth is computed in float64 from the exact input values.
    axis : int or tuple of int, optional
        The normalized axes, NumPy's convention; None means the last ``len(normalized_shape)``.
    rtol, atol : float, optional
        Both or neither; by default torch.testing.assert_close's for ``actual``'s dtype (for
        the input's, when ``check_dtype`` finds them different).
    check_dtype : bool
        Whether ``actual`` must have the input's dtype, as torch's output has, when both have
        a dtype (``[output-dtype]``); as torch.testing.assert_close's ``check_dtype``.

    Raises
    ------
    AssertionError
        When a shape, a NaN position or a value differs; the message names each classic mistake
        (``[unbiased-variance]``, ``[eps-outside-sqrt]``, ...) whose output matches ``actual``.
    """
    report = _compare(actual, _problem("layer_norm", input, normalized_shape, weight, bias, eps, axis), rtol, atol,
                      check_dtype)
    if not report.ok:
        raise AssertionError("\n".join(report.lines))


def assert_rms_norm_close(actual: Any, input: Any, normalized_shape: Any, weight: Any = None,
                          eps: Optional[float] = None, *, axis: Axis = None, rtol: Optional[float] = None,
                          atol: Optional[float] = None, check_dtype: bool = True) -> None:
    """Assert that ``actual`` is RMSNorm of ``input``, as torch's F.rms_norm defines it.

    ``eps=None`` is torch's rule: the machine epsilon of float64 for float64 input, of float32
    otherwise.  The rest is as :func:`assert_layer_norm_close` (no bias); the codes include
    ``[rms-centred]`` and ``[rms-one-plus-weight]``.
    """
    report = _compare(actual, _problem("rms_norm", input, normalized_shape, weight, None, eps, axis), rtol, atol,
                      check_dtype)
    if not report.ok:
        raise AssertionError("\n".join(report.lines))


# ---------------------------------------------------------------------------------- diagnose

# Probe rows: standard deviations (the first two scale with sqrt(eps), where eps shows) and
# means as multiples of them, all different, small enough for float32 statistics to be exact
# to a few ulps so that correct float32 kernels pass.  (At a mean 40 times the standard deviation
# a one-pass variance in float32 would show, but so would the rounding of the mean in correct
# float32 kernels with sequential sums: that mistake is left to assert_layer_norm_close.)
_PROBE_MEAN_RATIOS = (1.5, -2.0, 0.5, -1.0, 3.0, -0.25)
_PROBE_SEED = 20240611


def _probe_input(normalized_shape: Tuple[int, ...], axis: Axis, eps: float, dtype: np.dtype) -> np.ndarray:
    """Rows of very different scales and means: (2, 3) + normalized_shape, or for an ``axis`` a
    channels-first array of at least 4 dims with the normalized axes where ``axis`` puts them."""
    if axis is None:
        shape = [2, 3, *normalized_shape]
        axes = tuple(range(2, len(shape)))
    else:
        given = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
        ndim = max([4, len(normalized_shape) + 2] + [a + 1 if a >= 0 else -a for a in given])
        axes = ref.normalized_axes(ndim, normalized_shape, axis)
        others = iter(range(2, 2 + ndim))
        shape = [0] * ndim
        for a in range(ndim):
            shape[a] = normalized_shape[axes.index(a)] if a in axes else next(others)
    root = math.sqrt(eps) if eps > 0 else math.sqrt(1e-5)
    stds = (root, 4 * root, 0.3, 1.0, 6.0, 40.0)
    other_shape = [n for a, n in enumerate(shape) if a not in axes]
    rows, count = math.prod(other_shape), math.prod(normalized_shape)
    rng = np.random.default_rng(_PROBE_SEED)
    z = rng.standard_normal((rows, count))
    z -= z.mean(axis=1, keepdims=True)
    if count > 1:
        z /= z.std(axis=1, keepdims=True)
    std = np.resize(stds, rows)[:, None]
    values = std * (np.resize(_PROBE_MEAN_RATIOS, rows)[:, None] + z)
    # rows run over the other axes in order, the row's elements over the normalized ones
    values = values.reshape(other_shape + [normalized_shape[axes.index(a)] for a in sorted(axes)])
    values = np.moveaxis(values, range(len(other_shape), len(shape)), sorted(axes))
    return values.astype(dtype)


def _probe_params(normalized_shape: Tuple[int, ...]) -> Tuple[np.ndarray, np.ndarray]:
    """A weight in [0.5, 1.5) and a bias in [-0.5, 0.5), multiples of 1/64 (exact in float16
    and bfloat16 parameters)."""
    rng = np.random.default_rng(_PROBE_SEED + 1)
    weight = np.round(rng.uniform(0.5, 1.5, normalized_shape) * 64) / 64
    bias = np.round(rng.uniform(-0.5, 0.5, normalized_shape) * 64) / 64
    return weight, bias


def _torch_or_none() -> Any:
    try:
        import torch
    except Exception:  # not installed, or an install that fails to load: no tensors to write
        return None
    return torch


def _write(param: Any, values: Any) -> None:
    """Set a parameter's values in place (an ndarray or a torch tensor)."""
    if isinstance(param, np.ndarray):
        param[...] = values
        return
    torch = _torch_or_none()
    with torch.no_grad():
        param.copy_(torch.as_tensor(values))


def _writable(param: Any) -> bool:
    if isinstance(param, np.ndarray):
        return param.flags.writeable
    return hasattr(param, "copy_") and hasattr(param, "detach") and _torch_or_none() is not None


# The attribute names a module's parameters go by: torch's, then the papers' gamma and beta
# (hand-written modules) and Flax's and ONNX's scale.  The first is refused if its shape is not
# normalized_shape's; the others are passed over then (a `scale` may be something else).
_PARAM_ATTRIBUTES = {"weight": ("weight", "gamma", "scale"), "bias": ("bias", "beta")}


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or hasattr(value, "detach")


def _module_parameter(fn: Any, role: str, normalized_shape: Tuple[int, ...]) -> Tuple[str, Any]:
    """(attribute name, array or tensor) of fn's parameter for role ("weight" or "bias"), or
    (role, None): a method or a setting of that name is not a parameter."""
    primary, *others = _PARAM_ATTRIBUTES[role]
    param: Any = getattr(fn, primary, None)
    if _is_array(param):
        if tuple(param.shape) != normalized_shape:
            raise ValueError(f"fn's {primary} has shape {tuple(param.shape)}, normalized_shape is "
                             f"{normalized_shape}")
        return primary, param
    for name in others:
        param = getattr(fn, name, None)
        if _is_array(param) and tuple(param.shape) == normalized_shape:
            return name, param
    return role, None


@contextlib.contextmanager
def _parameters(fn: Any, kind: str, normalized_shape: Tuple[int, ...], weight: Any,
                bias: Any) -> Iterator[Tuple[Optional[np.ndarray], Optional[np.ndarray], str]]:
    """(weight, bias, how) for the probe.  Given ones are used as they are; otherwise a module's
    parameters (``.weight`` / ``.bias``, or see _PARAM_ATTRIBUTES) are set to probe values for
    the call and put back afterwards."""
    roles = ("weight", "bias") if kind == "layer_norm" else ("weight",)
    given = {"weight": weight, "bias": bias}
    probe = dict(zip(("weight", "bias"), _probe_params(normalized_shape)))
    values: Dict[str, Any] = {"weight": None, "bias": None}
    hows: Dict[str, List[str]] = {}
    restore = []
    try:
        for role in roles:
            if given[role] is not None:
                name, how = role, "as given"
                values[role] = _as_array(given[role])[0].astype(np.float64)
            else:
                name, param = _module_parameter(fn, role, normalized_shape)
                how = "none"
                if param is not None:
                    how = "fn's own"
                    if _writable(param):
                        original = param.copy() if isinstance(param, np.ndarray) else param.detach().clone()
                        _write(param, probe[role])
                        restore.append((param, original))
                        how = "probe values, set on fn for the call and restored after"
                    values[role] = _as_array(param)[0].astype(np.float64)
            hows.setdefault(how, []).append(name if name == role else f"{name} (the {role})")
        described = "; ".join(" and ".join(which) + ": " + how for how, which in hows.items())
        yield values["weight"], values["bias"], described
    finally:
        for param, original in restore:
            _write(param, original)


def _probe_dtype(dtype: Any, fn: Any, normalized_shape: Tuple[int, ...], weight: Any) -> np.dtype[Any]:
    """The probes' dtype: `dtype` (NumPy's, ml_dtypes' or torch's, or its name), or for None the
    dtype of fn's weight when that is float16 or bfloat16 (a torch module with such parameters
    refuses float32 input), else float32.  bfloat16 probes need ml_dtypes."""
    if dtype is None:
        param = None if weight is not None else _module_parameter(fn, "weight", normalized_shape)[1]
        name = "float32" if param is None else _as_array(param)[1]
        dtype = name if name in ("float16", "bfloat16") else "float32"
    name = str(dtype)
    if name.startswith("torch."):  # a torch dtype, named without importing torch
        dtype = name = name[len("torch."):]
    if name == "bfloat16":
        return _bfloat16_dtype()
    found: Optional[np.dtype[Any]]
    try:
        found = np.dtype(dtype)
    except (TypeError, ValueError):
        found = None
    if found is None or not (found.kind == "f" or _is_bfloat16(found)) or found.itemsize not in (2, 4, 8):
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype if found is None else found}")
    return found


def _as_tensor(torch: Any, x: np.ndarray) -> Any:
    """x as a torch tensor sharing its memory; ml_dtypes' bfloat16 as torch's (the same bits)."""
    if _is_bfloat16(x.dtype):
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _call(fn: Callable[[Any], Any], x: np.ndarray) -> Any:
    """fn(x); if fn refuses a NumPy array as a torch function does (TypeError, AttributeError)
    and torch is installed, fn on the tensor instead; any other error of fn's is its own.  A
    training-mode norm module of ours keeps what its last forward saved for backward."""
    module = fn if isinstance(fn, NormModule) else None
    saved = module._saved if module is not None else None
    try:
        return fn(x.copy())
    except (TypeError, AttributeError):
        torch = _torch_or_none()
        if torch is None:
            raise
        return fn(_as_tensor(torch, x.copy()))
    finally:
        if module is not None:
            module._saved = saved


class Diagnosis(NamedTuple):
    """What :func:`diagnose` found: ``ok``, the ``findings`` (codes, most likely first; empty
    when ok), the largest absolute error (inf where an element is infinite or NaN and the
    float64 reference is not), and a readable ``str()``."""

    ok: bool
    findings: Tuple[str, ...]
    max_error: float
    text: str

    def __str__(self) -> str:
        return self.text


def diagnose(fn: Callable[[Any], Any], normalized_shape: Any, *, kind: str = "layer_norm", weight: Any = None,
             bias: Any = None, eps: Optional[float] = None, axis: Axis = None, dtype: Any = None) -> Diagnosis:
    """Call ``fn`` on probe inputs that tell the classic mistakes apart, and say which it makes.

    Parameters
    ----------
    fn : callable
        A function or module taking one array; if it raises on a NumPy array and torch is
        installed, it is called with a torch tensor instead (the result is converted back).
    normalized_shape : int or sequence of int
        What fn normalizes over.
    kind : {"layer_norm", "rms_norm"}
    weight, bias : array-like, optional
        The parameters fn applies.  Omitted: if fn has ``.weight`` / ``.bias`` attributes (torch's
        modules, ``layernorm.LayerNorm``), or else ``.gamma`` / ``.beta`` (hand-written modules)
        or ``.scale`` for the weight, shaped ``normalized_shape``, they are set to non-trivial
        probe values, different from each other, for the call, then restored; a plain function
        gets none.
    eps : float, optional
        The eps fn should use; None is the op's default (1e-5 for LayerNorm, torch's dtype rule
        for RMSNorm).
    axis : int or tuple of int, optional
        The normalized axes, NumPy's convention (``axis=1``: channels-first probes of 4 dims).
    dtype : float16, bfloat16, float32 or float64, optional
        The probes' dtype, as a NumPy, ml_dtypes or torch dtype or its name (bfloat16 probes need
        ml_dtypes).  None: the dtype of fn's own weight when that is float16 or bfloat16 (a torch
        module with such parameters refuses float32 input), else float32.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a function or a module to call, got {type(fn).__name__}")
    if kind not in _CODES:
        raise ValueError(f"kind must be 'layer_norm' or 'rms_norm', got {kind!r}")
    if kind == "rms_norm" and bias is not None:
        raise ValueError("RMSNorm has no bias")
    shape = _normalized_shape(normalized_shape)
    dtype = _probe_dtype(dtype, fn, shape, weight)
    eps = (1e-5 if kind == "layer_norm" else ref.rms_norm_default_eps(dtype)) if eps is None else _eps(eps)
    x = _probe_input(shape, axis, eps, dtype)
    with _parameters(fn, kind, shape, weight, bias) as (probe_weight, probe_bias, how):
        output = _call(fn, x)
    p = _problem(kind, x, shape, probe_weight, probe_bias, eps, axis)
    report = _compare(output, p, None, None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    deviation = x.astype(np.float64) - x.mean(axis=p.axes, keepdims=True, dtype=np.float64)
    stds = np.sqrt(np.mean(deviation ** 2, axis=p.axes))
    means = x.mean(axis=p.axes, dtype=np.float64)
    lines = [f"diagnose({name}) as {p.op} over normalized_shape {shape}, eps={eps:.6g}",
             f"  probe: {dtype} input {x.shape}, one row per {_slice(x.ndim, p.axes)}: standard deviations"
             f" {stds.min():.2g} to {stds.max():.2g}, means {means.min():.3g} to {means.max():.3g}",
             f"  {how}"]
    if report.ok:
        lines.append(f"  ok: {report.lines[0]}")
    else:
        lines += ["  wrong:"] + ["    " + line for line in report.lines]
    return Diagnosis(report.ok, tuple(f.code for f in report.findings), report.max_error, "\n".join(lines))
