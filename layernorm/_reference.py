"""The float64 ground truth: LayerNorm and RMSNorm written as plain NumPy formulas.

The package's tests, its benchmarks and ``layernorm.testing`` compare against these functions, so
there is exactly one definition of what the right answer is::

    LayerNorm:  mean = x.mean(axes)              var = ((x - mean) ** 2).mean(axes)   (biased)
                rstd = 1 / sqrt(var + eps)       y = (x - mean) * rstd * weight + bias
    RMSNorm:    rstd = 1 / sqrt((x ** 2).mean(axes) + eps)
                y = x * rstd * weight

    backward, with g = grad_output * weight and xhat = (x - mean) * rstd (mean = 0 for RMSNorm):
                grad_input  = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMSNorm: no mean(g))
                grad_weight = sum over the other axes of grad_output * xhat
                grad_bias   = sum over the other axes of grad_output

Everything is computed in float64 from the exact input values, two-pass (the centred values are
squared, never E[x^2] - E[x]^2).  Each row is first scaled by a power of two near its largest
magnitude, which is exact, so that squares neither overflow (rows of 1e200) nor underflow: every
finite row gets its right answer, and only rows holding NaN or Inf become NaN.  ``axis`` follows
NumPy (an int or a tuple of ints, negatives allowed); without it the normalized axes are the last
``len(normalized_shape)``, as in torch.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "Normalized",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_given_stats",
    "normalize",
    "normalized_axes",
    "output_scale",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_backward_given_stats",
    "rms_norm_default_eps",
]

Axis = Union[None, int, Sequence[int]]


def rms_norm_default_eps(dtype: Any) -> float:
    """torch's eps=None for RMSNorm: the machine epsilon of the compute type (float64 for
    float64 input, float32 for every narrower float)."""
    compute = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    return float(np.finfo(compute).eps)


def _shape_tuple(normalized_shape: Any) -> Tuple[int, ...]:
    try:
        return (operator.index(normalized_shape),)
    except TypeError:
        return tuple(operator.index(size) for size in normalized_shape)


def normalized_axes(ndim: int, normalized_shape: Any, axis: Axis = None) -> Tuple[int, ...]:
    """The axes normalized over, in the order ``normalized_shape`` lists their sizes."""
    shape = _shape_tuple(normalized_shape)
    if axis is None:
        if len(shape) > ndim:
            raise ValueError(f"normalized_shape {shape} has more dims than the input ({ndim})")
        return tuple(range(ndim - len(shape), ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    resolved = []
    for a in axes:
        a = operator.index(a)
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of bounds for an array of dimension {ndim}")
        resolved.append(a % ndim)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"repeated axis in {axes}")
    if len(resolved) != len(shape):
        raise ValueError(f"axis {axes} names {len(resolved)} axes, normalized_shape {shape} has {len(shape)}")
    return tuple(resolved)


class Normalized(NamedTuple):
    """xhat = (x - mean) * rstd over ``axes``, with mean and rstd shaped like x with size 1 on
    those axes (mean is 0 for RMSNorm)."""

    xhat: np.ndarray
    mean: np.ndarray
    rstd: np.ndarray
    axes: Tuple[int, ...]

    def expand(self, param: Any) -> np.ndarray:
        """A parameter of shape normalized_shape, as float64, broadcastable against x."""
        if param is None:
            return np.ones(())
        p = np.asarray(param, dtype=np.float64)
        order = np.argsort(self.axes)
        p = np.transpose(p, order) if p.ndim else p
        shape = [1] * self.xhat.ndim
        for a in sorted(self.axes):
            shape[a] = self.xhat.shape[a]
        return p.reshape(shape)


def normalize(x: Any, normalized_shape: Any, *, centred: bool, eps: float, axis: Axis = None) -> Normalized:
    """xhat, mean and rstd of x in float64; ``centred`` is LayerNorm, not centred is RMSNorm."""
    x = np.asarray(x)
    axes = normalized_axes(x.ndim, normalized_shape, axis)
    x = x.astype(np.float64)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(x.shape))
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    if x.size == 0 or count == 0:
        # torch: an empty row has mean 0 and rstd NaN
        empty = np.zeros(stats_shape)
        return Normalized(np.zeros(x.shape), empty, np.full(stats_shape, np.nan), axes)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        amax = np.max(np.abs(x), axis=axes, keepdims=True)
        finite = np.isfinite(amax)
        # a power of two near the row's largest magnitude: x / s is exact and below 2 (2**1023
        # at most: a row near the largest float must not scale by an infinite 2**1024)
        _, exponent = np.frexp(np.where(finite & (amax > 0), amax, 1.0))
        s = np.ldexp(1.0, exponent - 1)
        xs = x / s
        mean_s = np.zeros(stats_shape)
        if centred:
            # a second pass takes out the first one's rounding: a constant row's mean is its value
            mean_s = xs.mean(axis=axes, keepdims=True)
            mean_s = mean_s + (xs - mean_s).mean(axis=axes, keepdims=True)
        centred_s = xs - mean_s
        var_s = (centred_s * centred_s).mean(axis=axes, keepdims=True)
        # var + eps = s^2 (var_s + eps / s^2); where eps / s^2 overflows, var is negligible, and
        # where var is 0 (eps / s^2 may underflow then) eps is all there is
        eps_s = np.where(eps == 0, 0.0, eps / (s * s))
        scaled = np.isfinite(eps_s) & (var_s > 0)
        root_s = np.sqrt(var_s + np.where(scaled, eps_s, 0.0))
        rstd = np.where(scaled, 1.0 / root_s / s, 1.0 / np.sqrt(0.0 + eps))  # eps -0.0: +inf
        xhat = np.where(scaled, centred_s / root_s, (x - mean_s * s) * rstd)
        mean = mean_s * s if centred else np.zeros(stats_shape)
        # a row holding NaN or Inf is NaN throughout (its mean is the plain float64 mean)
        rstd = np.where(finite, rstd, np.nan)
        xhat = np.where(finite, xhat, np.nan)
        mean = np.where(finite, mean, x.mean(axis=axes, keepdims=True))
    return Normalized(xhat, mean, rstd, axes)


def layer_norm(x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5,
               *, axis: Axis = None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, mean, rstd) in float64, as torch.native_layer_norm (generalized to ``axis``)."""
    n = normalize(x, normalized_shape, centred=True, eps=eps, axis=axis)
    bias_term = 0.0 if bias is None else n.expand(bias)
    with np.errstate(invalid="ignore", over="ignore"):
        y = n.xhat * n.expand(weight) + bias_term
    return y, n.mean, n.rstd


def rms_norm(x: Any, normalized_shape: Any, weight: Any = None, eps: Optional[float] = None,
             *, axis: Axis = None) -> Tuple[np.ndarray, np.ndarray]:
    """(y, rstd) in float64, as torch's _fused_rms_norm; eps=None is torch's dtype rule."""
    x = np.asarray(x)
    eps = rms_norm_default_eps(x.dtype) if eps is None else eps
    n = normalize(x, normalized_shape, centred=False, eps=eps, axis=axis)
    with np.errstate(invalid="ignore", over="ignore"):
        y = n.xhat * n.expand(weight)
    return y, n.rstd


def _backward(grad_output: Any, n: Normalized, weight: Any,
              centred: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    dy = np.asarray(grad_output, dtype=np.float64)
    axes = n.axes
    other = tuple(a for a in range(dy.ndim) if a not in axes)
    count = n.xhat.size // max(1, n.rstd.size) if n.xhat.size else 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = dy * n.expand(weight)
        gx_mean = (g * n.xhat).mean(axis=axes, keepdims=True) if count else np.zeros(n.rstd.shape)
        inner = g - n.xhat * gx_mean
        if centred and count:
            inner = inner - g.mean(axis=axes, keepdims=True)
        grad_input = n.rstd * inner
        # parameter gradients come out in normalized_shape's order of axes
        grad_weight = np.transpose((dy * n.xhat).sum(axis=other, keepdims=True), other + axes)
        grad_bias = np.transpose(dy.sum(axis=other, keepdims=True), other + axes)
    shape = tuple(dy.shape[a] for a in axes)
    return grad_input, grad_weight.reshape(shape), grad_bias.reshape(shape)


def layer_norm_backward(grad_output: Any, x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
                        eps: float = 1e-5, *, axis: Axis = None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grad_input, grad_weight, grad_bias) in float64 for y = layer_norm(x, ...)."""
    n = normalize(x, normalized_shape, centred=True, eps=eps, axis=axis)
    return _backward(grad_output, n, weight, centred=True)


def _given_stats(grad_output: Any, x: Any, normalized_shape: Any, mean: Any, rstd: Any, weight: Any,
                 centred: bool, axis: Axis) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients for the statistics given, reshaped to one value per row."""
    x = np.asarray(x, dtype=np.float64)
    axes = normalized_axes(x.ndim, normalized_shape, axis)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(x.shape))
    mean = np.asarray(mean, dtype=np.float64).reshape(stats_shape)
    rstd = np.asarray(rstd, dtype=np.float64).reshape(stats_shape)
    with np.errstate(invalid="ignore", over="ignore"):
        xhat = (x - mean) * rstd
    return _backward(grad_output, Normalized(xhat, mean, rstd, axes), weight, centred=centred)


def layer_norm_backward_given_stats(grad_output: Any, x: Any, normalized_shape: Any, mean: Any, rstd: Any,
                                    weight: Any = None, *,
                                    axis: Axis = None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grad_input, grad_weight, grad_bias) in float64 from the statistics given, as
    torch.ops.aten.native_layer_norm_backward takes them (e.g. rounded to float32), instead of
    recomputed from x: the exact answer for exactly these arguments.  mean and rstd hold one
    value per row, shaped as native_layer_norm returns them for this ``axis``."""
    return _given_stats(grad_output, x, normalized_shape, mean, rstd, weight, True, axis)


def rms_norm_backward_given_stats(grad_output: Any, x: Any, normalized_shape: Any, rstd: Any,
                                  weight: Any = None, *, axis: Axis = None) -> Tuple[np.ndarray, np.ndarray]:
    """(grad_input, grad_weight) in float64 from the rstd given (as native_rms_norm returns it),
    not recomputed from x: the exact answer for exactly these arguments."""
    mean = np.zeros(np.shape(rstd))
    grad_input, grad_weight, _ = _given_stats(grad_output, x, normalized_shape, mean, rstd, weight, False, axis)
    return grad_input, grad_weight


def rms_norm_backward(grad_output: Any, x: Any, normalized_shape: Any, weight: Any = None,
                      eps: Optional[float] = None, *, axis: Axis = None) -> Tuple[np.ndarray, np.ndarray]:
    """(grad_input, grad_weight) in float64 for y = rms_norm(x, ...)."""
    x = np.asarray(x)
    eps = rms_norm_default_eps(x.dtype) if eps is None else eps
    n = normalize(x, normalized_shape, centred=False, eps=eps, axis=axis)
    grad_input, grad_weight, _ = _backward(grad_output, n, weight, centred=False)
    return grad_input, grad_weight


def output_scale(x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5,
                 *, centred: bool = True, axis: Axis = None) -> np.ndarray:
    """|xhat * w| + |w| + |b| per element: the size of the terms a kernel rounds while forming
    y, which scales a tolerance for the output."""
    n = normalize(x, normalized_shape, centred=centred, eps=eps, axis=axis)
    w = np.abs(n.expand(weight))
    b = 0.0 if bias is None else np.abs(n.expand(bias))
    with np.errstate(invalid="ignore", over="ignore"):
        scale: np.ndarray = np.abs(n.xhat) * w + w + b
    return scale
