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

from . import _layernorm as _core
from ._layernorm import UnsupportedDTypeError

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "layer_norm",
    "layer_norm_backward",
    "native_layer_norm",
    "native_rms_norm",
    "rms_norm",
    "rms_norm_backward",
]

_Shape = Union[SupportsIndex, Sequence[SupportsIndex]]
_Axis = Union[SupportsIndex, Tuple[SupportsIndex, ...], None]
_FloatArray = npt.NDArray[np.floating[Any]]

_ndarray = np.ndarray

# torch's kernels, as its dtype refusals name them.
_FORWARD_KERNEL = "LayerNormKernelImpl"
_BACKWARD_KERNEL = "LayerNormBackwardKernelImpl"
_RMS_KERNEL = "rms_norm"

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


def _is_bfloat16(dtype: Any) -> bool:
    """Whether `dtype` (a NumPy dtype) is ml_dtypes' bfloat16, known without importing ml_dtypes."""
    return bool(dtype.name == "bfloat16" and dtype.itemsize == 2)


def _bfloat16_dtype() -> np.dtype[Any]:
    """Return ml_dtypes' bfloat16 dtype, importing ml_dtypes only now (it is optional); a
    TypeError says what to install when it is missing."""
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            "bfloat16 arrays need the ml_dtypes package: pip install ml_dtypes "
            "(or pip install layernorm[bfloat16])"
        ) from None
    bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


def _is_torch_tensor(value: Any) -> bool:
    """Whether value is a torch tensor; torch is looked up, never imported: without it there
    are no tensors."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _as_numpy(value: Any) -> Any:
    """Return `value` with an array of another library replaced by a NumPy array.

    Anything else comes back unchanged, for the core to convert as ``np.asarray`` does.
    """
    # The one place where array types other than NumPy's are converted (dask arrays, which
    # stay lazy, are recognised next door, in _holds_dask_array; tensors by _is_torch_tensor).
    masked = sys.modules.get("numpy.ma")
    if masked is not None and isinstance(value, masked.MaskedArray) and masked.getmask(value) is not masked.nomask \
            and value.mask.any():
        raise ValueError("masked arrays with masked elements are not supported (the kernels would read the "
                         "values under the mask): pass a.filled(fill_value), or the rows without masked elements")
    if _is_torch_tensor(value):
        torch = sys.modules["torch"]
        # detached: a tensor that requires grad refuses .numpy(); on the CPU, where we compute
        # resolved: a tensor with the conjugate or negative bit set (a lazy view) refuses .numpy()
        value = value.detach().cpu().resolve_conj().resolve_neg()
        if value.dtype == torch.bfloat16:
            # NumPy has no bfloat16: the same bits, viewed as ml_dtypes' (no float32 round trip)
            return value.view(torch.int16).numpy().view(_bfloat16_dtype())
        try:
            return value.numpy()
        except TypeError:  # torch's bare "Got unsupported ScalarType Float8_e4m3fn"
            if value.layout != torch.strided:
                raise  # torch's own "can't convert Sparse layout tensor to numpy. Use Tensor.to_dense() first."
            raise TypeError(f"a torch tensor of dtype {value.dtype} has no NumPy dtype to compute in: "
                            "convert it first, e.g. tensor.float() (float16, bfloat16, float32 and float64 "
                            "are supported)") from None
    return value


def _holds_dask_array(*values: Any) -> bool:
    """Whether any of `values` is a dask array, whose call layernorm._dask takes over.  dask.array
    is looked up, never imported: until it is imported there are no dask arrays."""
    dask_array = sys.modules.get("dask.array")
    return dask_array is not None and any(isinstance(value, dask_array.Array) for value in values)


def _torch_worded(error: UnsupportedDTypeError, kernel: str) -> TypeError:
    """Return the core's dtype refusal as a TypeError that starts with torch's own text,
    ``"LayerNormKernelImpl" not implemented for 'Long'``, when torch has a name for the dtype."""
    dtype: np.dtype[Any] = error.dtype
    name = _TORCH_TYPE_NAMES.get((dtype.kind, dtype.itemsize))
    if kernel == _RMS_KERNEL and dtype.kind == "c":
        name = None  # torch's rms_norm, a composite of its elementwise ops, computes complex input
    return TypeError(str(error) if name is None else f'"{kernel}" not implemented for \'{name}\': {error}')


_AXIS_DOC = """axis : int or tuple of int, optional
        The axes to normalize over, in the order of ``normalized_shape`` (NumPy's convention,
        negatives count from the end), e.g. ``axis=1`` for the channels of an ``(N, C, H, W)``
        array.  Without it, the last ``len(normalized_shape)`` axes, as torch.  With it, the
        results of the input's shape keep its memory order (``mean`` and ``rstd`` are
        C-contiguous) and strided rows are read in place."""


def layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
    *,
    axis: _Axis = None,
    out: Optional[_FloatArray] = None,
) -> _FloatArray:
    """Layer normalization, as ``torch.nn.functional.layer_norm``.

    Parameters
    ----------
    input : array_like of float16, bfloat16, float32 or float64
        NumPy arrays (bfloat16 as ml_dtypes' dtype), torch tensors (read detached) and anything
        ``np.asarray`` takes.
    normalized_shape : int or sequence of int
        The shape of the axes to normalize over (the trailing ones, unless `axis` says).
    weight, bias : array_like of shape normalized_shape, optional
        Elementwise scale (default ones) and shift (default zeros).
    eps : float
        Added to the (biased) variance inside the square root.
    {axis}
    out : ndarray, optional
        Array of the input's shape and dtype (in native byte order) to write into; may be
        the input itself.

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
        if _holds_dask_array(input, weight, bias):
            from . import _dask

            return _dask.call(layer_norm, input=input, normalized_shape=normalized_shape,
                              weight=weight, bias=bias, eps=eps, axis=axis, out=out)
        input, weight, bias = _as_numpy(input), _as_numpy(weight), _as_numpy(bias)
    try:
        return _core.layer_norm(input, normalized_shape, weight, bias, eps, axis=axis, out=out)
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _FORWARD_KERNEL) from None


def native_layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
    *,
    axis: _Axis = None,
) -> Tuple[_FloatArray, _FloatArray, _FloatArray]:
    """Layer normalization that also returns its statistics, as ``torch.native_layer_norm``.

    Parameters
    ----------
    input, normalized_shape, weight, bias, eps
        As for :func:`layer_norm`.
    {axis}

    Returns
    -------
    (output, mean, rstd)
        mean and ``rstd = 1 / sqrt(var + eps)`` have the input's shape with size 1 on the
        normalized axes (``input.shape[:-D] + (1,) * D`` without `axis`) and dtype float32
        (float64 for float64 input).
    """
    if not (
        type(input) is _ndarray
        and (weight is None or type(weight) is _ndarray)
        and (bias is None or type(bias) is _ndarray)
    ):
        if _holds_dask_array(input, weight, bias):
            from . import _dask

            return _dask.call(native_layer_norm, input=input, normalized_shape=normalized_shape,
                              weight=weight, bias=bias, eps=eps, axis=axis)
        input, weight, bias = _as_numpy(input), _as_numpy(weight), _as_numpy(bias)
    try:
        return _core.native_layer_norm(input, normalized_shape, weight, bias, eps, axis=axis)
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
    *,
    axis: _Axis = None,
) -> Tuple[Optional[_FloatArray], Optional[_FloatArray], Optional[_FloatArray]]:
    """Gradients of :func:`layer_norm`, as ``torch.ops.aten.native_layer_norm_backward``.

    Parameters
    ----------
    grad_output : array_like
        Gradient of the loss with respect to the output, of the input's shape.
    input, normalized_shape, weight, bias
        What the forward call was given.
    mean, rstd : array_like
        The statistics :func:`native_layer_norm` returned for this input (one value per row,
        any shape; broadcast arrays are read as they are).
    output_mask : sequence of three bools
        Which of (grad_input, grad_weight, grad_bias) to compute.
    {axis}

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
        if _holds_dask_array(grad_output, input, mean, rstd, weight, bias):
            from . import _dask

            return _dask.call(layer_norm_backward, grad_output=grad_output, input=input,
                              normalized_shape=normalized_shape, mean=mean, rstd=rstd,
                              weight=weight, bias=bias, output_mask=output_mask, axis=axis)
        grad_output, input, mean, rstd, weight, bias = map(
            _as_numpy, (grad_output, input, mean, rstd, weight, bias)
        )
    try:
        return _core.layer_norm_backward(
            grad_output, input, normalized_shape, mean, rstd, weight, bias, output_mask, axis=axis
        )
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _BACKWARD_KERNEL) from None


def rms_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    eps: Optional[SupportsFloat] = None,
    *,
    axis: _Axis = None,
    out: Optional[_FloatArray] = None,
) -> _FloatArray:
    """Root-mean-square normalization, as ``torch.nn.functional.rms_norm``.

    Parameters
    ----------
    input, normalized_shape
        As for :func:`layer_norm`.
    weight : array_like of shape normalized_shape, optional
        Elementwise scale (default ones).
    eps : float, optional
        Added to the mean of squares inside the square root; None (the default) means the
        machine epsilon of float32 for float16/float32 input and of float64 for float64
        input, as torch.
    {axis}
    out : ndarray, optional
        Array of the input's shape and dtype (in native byte order) to write into; may be
        the input itself.

    Returns
    -------
    ndarray
        ``input / sqrt(mean(input ** 2) + eps) * weight``, of the input's dtype.
    """
    if not (type(input) is _ndarray and (weight is None or type(weight) is _ndarray)):
        if _holds_dask_array(input, weight):
            from . import _dask

            return _dask.call(rms_norm, input=input, normalized_shape=normalized_shape, weight=weight,
                              eps=eps, axis=axis, out=out)
        input, weight = _as_numpy(input), _as_numpy(weight)
    try:
        return _core.rms_norm(input, normalized_shape, weight, eps, axis=axis, out=out)
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _RMS_KERNEL) from None


def native_rms_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    eps: Optional[SupportsFloat] = None,
    *,
    axis: _Axis = None,
) -> Tuple[_FloatArray, _FloatArray]:
    """RMS normalization that also returns its statistic, as ``torch.ops.aten._fused_rms_norm``.

    Parameters
    ----------
    input, normalized_shape, weight, eps
        As for :func:`rms_norm`.
    {axis}

    Returns
    -------
    (output, rstd)
        ``rstd = 1 / sqrt(mean(input ** 2) + eps)`` has the input's shape with size 1 on the
        normalized axes and dtype float32 (float64 for float64 input).
    """
    if not (type(input) is _ndarray and (weight is None or type(weight) is _ndarray)):
        if _holds_dask_array(input, weight):
            from . import _dask

            return _dask.call(native_rms_norm, input=input, normalized_shape=normalized_shape,
                              weight=weight, eps=eps, axis=axis)
        input, weight = _as_numpy(input), _as_numpy(weight)
    try:
        return _core.native_rms_norm(input, normalized_shape, weight, eps, axis=axis)
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _RMS_KERNEL) from None


def rms_norm_backward(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    rstd: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    output_mask: Sequence[bool] = (True, True),
    *,
    axis: _Axis = None,
) -> Tuple[Optional[_FloatArray], Optional[_FloatArray]]:
    """Gradients of :func:`rms_norm`, as ``torch.ops.aten._fused_rms_norm_backward``.

    Parameters
    ----------
    grad_output : array_like
        Gradient of the loss with respect to the output, of the input's shape.
    input, normalized_shape, weight
        What the forward call was given.
    rstd : array_like
        The statistic :func:`native_rms_norm` returned for this input.
    output_mask : sequence of two bools
        Which of (grad_input, grad_weight) to compute.
    {axis}

    Returns
    -------
    (grad_input, grad_weight)
        Each is None where its output_mask entry is False; grad_weight is None without a
        weight, else of shape normalized_shape.
    """
    if not (
        type(grad_output) is _ndarray
        and type(input) is _ndarray
        and type(rstd) is _ndarray
        and (weight is None or type(weight) is _ndarray)
    ):
        if _holds_dask_array(grad_output, input, rstd, weight):
            from . import _dask

            return _dask.call(rms_norm_backward, grad_output=grad_output, input=input,
                              normalized_shape=normalized_shape, rstd=rstd, weight=weight,
                              output_mask=output_mask, axis=axis)
        grad_output, input, rstd, weight = map(_as_numpy, (grad_output, input, rstd, weight))
    try:
        return _core.rms_norm_backward(grad_output, input, normalized_shape, rstd, weight, output_mask, axis=axis)
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _RMS_KERNEL) from None


_ADD_DOC = """
    The sum ``input + residual`` is rounded in the input's dtype exactly as NumPy's add
    rounds it, and the output is bit for bit what normalizing that sum gives; both are
    made in one pass over memory (input and residual read once, sum and output written
    once), as pre-LN transformer layers use them.

    Parameters
    ----------
    input, residual : array_like
        Of one shape and one dtype (float16, bfloat16, float32 or float64).
    {params}
    {axis}
    out : ndarray, optional
        Array for the output; may be `input` or `residual` itself.
    residual_out : ndarray, optional
        Array for the sum; may be `input` or `residual` itself (updated in place, as
        vLLM's fused_add_rms_norm does).  Must not overlap `out`.

    Returns
    -------
    (output, sum)
        The normalized sum and the sum, each of the input's shape and dtype.

    Notes
    -----
    Backward: the gradient of ``sum`` is the norm's backward on ``sum`` plus whatever
    gradient reaches ``sum`` directly (the residual stream); input and residual both get it.
"""


def add_layer_norm(
    input: npt.ArrayLike,
    residual: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
    *,
    axis: _Axis = None,
    out: Optional[_FloatArray] = None,
    residual_out: Optional[_FloatArray] = None,
) -> Tuple[_FloatArray, _FloatArray]:
    if not (
        type(input) is _ndarray
        and type(residual) is _ndarray
        and (weight is None or type(weight) is _ndarray)
        and (bias is None or type(bias) is _ndarray)
    ):
        if _holds_dask_array(input, residual, weight, bias):
            from . import _dask

            return _dask.call(add_layer_norm, input=input, residual=residual,
                              normalized_shape=normalized_shape, weight=weight, bias=bias, eps=eps,
                              axis=axis, out=out, residual_out=residual_out)
        input, residual, weight, bias = map(_as_numpy, (input, residual, weight, bias))
    try:
        return _core.add_layer_norm(
            input, residual, normalized_shape, weight, bias, eps, axis=axis, out=out, residual_out=residual_out
        )
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _FORWARD_KERNEL) from None


def add_rms_norm(
    input: npt.ArrayLike,
    residual: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    eps: Optional[SupportsFloat] = None,
    *,
    axis: _Axis = None,
    out: Optional[_FloatArray] = None,
    residual_out: Optional[_FloatArray] = None,
) -> Tuple[_FloatArray, _FloatArray]:
    if not (
        type(input) is _ndarray
        and type(residual) is _ndarray
        and (weight is None or type(weight) is _ndarray)
    ):
        if _holds_dask_array(input, residual, weight):
            from . import _dask

            return _dask.call(add_rms_norm, input=input, residual=residual,
                              normalized_shape=normalized_shape, weight=weight, eps=eps, axis=axis,
                              out=out, residual_out=residual_out)
        input, residual, weight = map(_as_numpy, (input, residual, weight))
    try:
        return _core.add_rms_norm(
            input, residual, normalized_shape, weight, eps, axis=axis, out=out, residual_out=residual_out
        )
    except UnsupportedDTypeError as error:
        raise _torch_worded(error, _RMS_KERNEL) from None


add_layer_norm.__doc__ = (
    "``(layer_norm(input + residual, ...), input + residual)``, fused.\n"
    + _ADD_DOC.format(
        params="normalized_shape, weight, bias, eps\n        As for :func:`layer_norm`.",
        axis="{axis}",
    )
)
add_rms_norm.__doc__ = (
    "``(rms_norm(input + residual, ...), input + residual)``, fused.\n"
    + _ADD_DOC.format(
        params="normalized_shape, weight, eps\n        As for :func:`rms_norm`.",
        axis="{axis}",
    )
)
for _function in (
    layer_norm,
    native_layer_norm,
    layer_norm_backward,
    rms_norm,
    native_rms_norm,
    rms_norm_backward,
    add_layer_norm,
    add_rms_norm,
):
    _function.__doc__ = (_function.__doc__ or "").replace("{axis}", _AXIS_DOC)
del _function
