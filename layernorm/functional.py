"""The functions of torch.nn.functional's LayerNorm family, on NumPy arrays.

Each function hands NumPy arrays straight to the compiled core (``layernorm._layernorm``).
Arrays of other libraries are turned into NumPy arrays first, in :func:`_as_numpy`, the one
place that knows them; anything else (lists, scalars, objects with ``__array__``) is converted
by the core exactly as ``np.asarray`` converts it.  The core refuses an unsupported input dtype
with ``UnsupportedDTypeError``; this layer words that refusal as torch does.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, SupportsFloat, SupportsIndex, Tuple, Union

import numpy as np
import numpy.typing as npt

from ._layernorm import UnsupportedDTypeError
from ._layernorm import layer_norm as _layer_norm
from ._layernorm import layer_norm_backward as _layer_norm_backward
from ._layernorm import native_layer_norm as _native_layer_norm

__all__ = ["layer_norm", "layer_norm_backward", "native_layer_norm"]

_Shape = Union[SupportsIndex, Sequence[SupportsIndex]]
_FloatArray = npt.NDArray[np.floating[Any]]

_ndarray = np.ndarray

# torch's kernels, as its dtype refusals name them.
_FORWARD_KERNEL = "LayerNormKernelImpl"
_BACKWARD_KERNEL = "LayerNormBackwardKernelImpl"

# torch's names of the dtypes it refuses, by NumPy (kind, itemsize), as "not implemented for
# 'Long'" prints them (any byte order).
_TORCH_TYPE_NAMES = {
    ("b", 1): "Bool",
    ("i", 1): "Char",
    ("i", 2): "Short",
    ("i", 4): "Int",
    ("i", 8): "Long",
    ("u", 1): "Byte",
    ("u", 2): "UInt16",
    ("u", 4): "UInt32",
    ("u", 8): "UInt64",
    ("c", 8): "ComplexFloat",
    ("c", 16): "ComplexDouble",
}


def _as_numpy(value: Any) -> Any:
    """Return `value` with an array of another library replaced by a NumPy array.

    Anything else comes back unchanged, for the core to convert as ``np.asarray`` does.
    """
    # The one place where array types other than NumPy's are recognised: others (e.g. dask
    # arrays) hook in here.  torch is looked up, never imported: without it there are no tensors.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        # detached: a tensor that requires grad refuses .numpy(); on the CPU, where we compute
        return value.detach().cpu().numpy()
    return value


def _torch_worded(error: UnsupportedDTypeError, kernel: str) -> TypeError:
    """Return the core's dtype refusal as a TypeError that starts with torch's own text,
    ``"LayerNormKernelImpl" not implemented for 'Long'``, when torch has a name for the dtype."""
    dtype: np.dtype[Any] = error.dtype
    name = _TORCH_TYPE_NAMES.get((dtype.kind, dtype.itemsize))
    return TypeError(str(error) if name is None else f'"{kernel}" not implemented for \'{name}\': {error}')


def layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
    *,
    out: Optional[_FloatArray] = None,
) -> _FloatArray:
    """Layer normalization over the last ``len(normalized_shape)`` dimensions, as
    ``torch.nn.functional.layer_norm``.

    Parameters
    ----------
    input : array_like of float16, float32 or float64
        NumPy arrays, torch tensors (read detached) and anything ``np.asarray`` takes.
    normalized_shape : int or sequence of int
        The trailing shape to normalize over.
    weight, bias : array_like of shape normalized_shape, optional
        Elementwise scale (default ones) and shift (default zeros).
    eps : float
        Added to the (biased) variance inside the square root.
    out : ndarray, optional
        C-contiguous array of the input's shape and dtype to write into; may be the
        input itself.

    Returns
    -------
    ndarray
        ``(input - mean) / sqrt(var + eps) * weight + bias``, of the input's dtype.
    """
    if not (
        type(input) is _ndarray
        and (weight is None or type(weight) is _ndarray)
        and (bias is None or type(bias) is _ndarray)
    ):
        input, weight, bias = _as_numpy(input), _as_numpy(weight), _as_numpy(bias)
    try:
        if out is None:
            return _layer_norm(input, normalized_shape, weight, bias, eps)
        return _layer_norm(input, normalized_shape, weight, bias, eps, out=out)
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _FORWARD_KERNEL) from None


def native_layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
) -> Tuple[_FloatArray, _FloatArray, _FloatArray]:
    """Layer normalization that also returns its statistics, as ``torch.native_layer_norm``.

    Parameters
    ----------
    input, normalized_shape, weight, bias, eps
        As for :func:`layer_norm`.

    Returns
    -------
    (output, mean, rstd)
        mean and ``rstd = 1 / sqrt(var + eps)`` have shape ``input.shape[:-D] + (1,) * D``,
        ``D = len(normalized_shape)``, and dtype float32 (float64 for float64 input).
    """
    if not (
        type(input) is _ndarray
        and (weight is None or type(weight) is _ndarray)
        and (bias is None or type(bias) is _ndarray)
    ):
        input, weight, bias = _as_numpy(input), _as_numpy(weight), _as_numpy(bias)
    try:
        return _native_layer_norm(input, normalized_shape, weight, bias, eps)
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _FORWARD_KERNEL) from None


def layer_norm_backward(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    mean: npt.ArrayLike,
    rstd: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    output_mask: Sequence[bool] = (True, True, True),
) -> Tuple[Optional[_FloatArray], Optional[_FloatArray], Optional[_FloatArray]]:
    """Gradients of :func:`layer_norm`, as ``torch.ops.aten.native_layer_norm_backward``.

    Parameters
    ----------
    grad_output : array_like
        Gradient of the loss with respect to the output, of the input's shape.
    input, normalized_shape, weight, bias
        What the forward call was given.
    mean, rstd : array_like
        The statistics :func:`native_layer_norm` returned for this input.
    output_mask : sequence of three bools
        Which of (grad_input, grad_weight, grad_bias) to compute.

    Returns
    -------
    (grad_input, grad_weight, grad_bias)
        Each is None where its output_mask entry is False; grad_weight is None
        without a weight and grad_bias None without a bias.  grad_weight and
        grad_bias have shape normalized_shape.
    """
    if not (
        type(grad_output) is _ndarray
        and type(input) is _ndarray
        and type(mean) is _ndarray
        and type(rstd) is _ndarray
        and (weight is None or type(weight) is _ndarray)
        and (bias is None or type(bias) is _ndarray)
    ):
        grad_output, input, mean, rstd, weight, bias = map(
            _as_numpy, (grad_output, input, mean, rstd, weight, bias)
        )
    try:
        return _layer_norm_backward(
            grad_output, input, normalized_shape, mean, rstd, weight, bias, output_mask
        )
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _BACKWARD_KERNEL) from None
