"""Norm modules: NumPy counterparts of torch.nn's normalization layers, on ``layernorm._layernorm``.

``NormModule`` holds what every norm module shares (parameters, ``state_dict``, training mode,
backward with gradient accumulation, pickling, repr); each kind is a small subclass that says
which parameters it has and calls its kernels.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import (Any, Callable, ClassVar, Iterable, NamedTuple, Optional, SupportsIndex, Tuple, TypeVar, cast,
                    overload)

import numpy as np
import numpy.typing as npt

from . import _layernorm as _core
from ._layernorm import ParameterChangedError, UnsupportedDTypeError
from .functional import (
    _FORWARD_KERNEL,
    _RMS_KERNEL,
    _as_numpy,
    _bfloat16_dtype,
    _FloatArray,
    _holds_dask_array,
    _is_bfloat16,
    _is_torch_tensor,
    _torch_worded,
    layer_norm,
    layer_norm_backward,
    native_layer_norm,
    native_rms_norm,
    rms_norm,
    rms_norm_backward,
)

__all__ = ["LayerNorm", "NormModule", "RMSNorm"]

_ndarray = np.ndarray

# Parameter dtypes a module can be made with; torch dtypes are matched by their str().
_FLOAT_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


# A norm module's own class, for train() and eval(), which return the module they are called on.
_Module = TypeVar("_Module", bound="NormModule")
_Destination = TypeVar("_Destination", bound=MutableMapping[str, Any])


class _TrainingModeError(ValueError, TypeError):
    """A non-bool training mode: torch raises ValueError; TypeError names the kind of mistake."""


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns, like torch's ``_IncompatibleKeys``."""

    missing_keys: list[str]
    unexpected_keys: list[str]

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return (
            f"_IncompatibleKeys(missing_keys={self.missing_keys!r}, "
            f"unexpected_keys={self.unexpected_keys!r})"
        )


def _as_shape(normalized_shape: Any) -> tuple[int, ...]:
    """Return normalized_shape as a tuple of Python ints (an integer n becomes (n,))."""
    if isinstance(normalized_shape, (bool, np.bool_)):
        raise TypeError("normalized_shape must be an int or a sequence of ints, not bool")
    sizes: Iterable[Any]
    try:
        # torch's rule: an integer is one size, anything else is iterated (a 0-d array or
        # tensor, which would pass as an index, cannot be)
        if isinstance(normalized_shape, np.ndarray) or type(normalized_shape).__module__.startswith("torch"):
            raise TypeError
        sizes = (operator.index(normalized_shape),)
    except TypeError:
        try:
            sizes = list(normalized_shape)
        except TypeError:
            raise TypeError(
                "normalized_shape must be an int or a sequence of ints, "
                f"got {type(normalized_shape).__name__} {normalized_shape!r}"
            ) from None
    shape = []
    for size in sizes:
        if isinstance(size, (bool, np.bool_)):
            raise TypeError(f"normalized_shape must contain ints, got {size!r}")
        try:
            shape.append(operator.index(size))
        except TypeError:
            raise TypeError(
                f"normalized_shape must contain ints, got {type(size).__name__} {size!r}"
            ) from None
    negative = next((size for size in shape if size < 0), None)
    if negative is not None:
        raise ValueError(
            f"Trying to create tensor with negative dimension {negative}: {shape} "
            "(normalized_shape sizes must be >= 0)"
        )
    return tuple(shape)


def _as_axis(axis: Any, shape: tuple[int, ...]) -> Optional[int | tuple[int, ...]]:
    """Return axis= as given (an int, or a tuple of ints from any sequence), checked against the
    normalized shape's length; the input's dims are checked at each call."""
    if axis is None:
        return None
    if isinstance(axis, tuple):
        items = axis
    elif not isinstance(axis, (bool, np.bool_)) and hasattr(axis, "__index__"):
        items = (axis,)
    else:
        raise TypeError(f"axis must be an int or a tuple of ints, got {axis!r}")
    if any(isinstance(item, (bool, np.bool_)) or not hasattr(item, "__index__") for item in items):
        raise TypeError(f"axis must be an int or a tuple of ints, got {axis!r}")
    try:
        axes = tuple(map(operator.index, items))
    except TypeError:  # an array of several elements, say, which has __index__ but refuses
        raise TypeError(f"axis must be an int or a tuple of ints, got {axis!r}") from None
    if len(axes) != len(shape):
        shown = axes if isinstance(axis, tuple) else axes[0]
        raise ValueError(f"normalized_shape={list(shape)} and axis={shown!r} differ in length")
    return axes if isinstance(axis, tuple) else axes[0]


# torch's float tensor types, by the names Module.type takes, and the dtypes they hold.
_TENSOR_TYPES = {"torch.HalfTensor": "torch.float16", "torch.BFloat16Tensor": "torch.bfloat16",
                 "torch.FloatTensor": "torch.float32", "torch.DoubleTensor": "torch.float64"}


def _as_param_dtype(dtype: Any, kind: str) -> np.dtype[Any]:
    """Return the native float16/bfloat16/float32/float64 dtype that `dtype` (None, NumPy-like,
    ml_dtypes' or torch's) names; `kind` (the module's name) is what the refusal says supports them.
    bfloat16, named by a string or a torch dtype, imports ml_dtypes (a TypeError without it)."""
    if dtype is None:
        return _FLOAT_DTYPES["float32"]
    name = str(dtype)
    if isinstance(dtype, type) and dtype.__module__ == "torch":  # a tensor type, torch.DoubleTensor
        name = f"torch.{dtype.__name__}"
    name = _TENSOR_TYPES.get(name, name)  # its name, as Module.type takes it too
    if name in ("bfloat16", "torch.bfloat16"):
        return _bfloat16_dtype()
    if name.startswith("torch."):  # a torch.dtype, recognised without importing torch
        found = _FLOAT_DTYPES.get(name[len("torch."):])
        if found is None:
            raise TypeError(f"{kind} supports float16, bfloat16, float32 and float64 parameters, got {name}")
        return found
    try:
        np_dtype: np.dtype[Any] = np.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(
            f"dtype must be a float dtype (float16, bfloat16, float32, float64), got {dtype!r}"
        ) from None
    if np_dtype.kind != "f" and not _is_bfloat16(np_dtype) or np_dtype.itemsize not in (2, 4, 8):
        raise TypeError(f"{kind} supports float16, bfloat16, float32 and float64 parameters, got {np_dtype}")
    return np_dtype.newbyteorder("=")


def _check_device(device: Any) -> None:
    """Raise ValueError unless device is None or names the CPU."""
    if device is not None and str(device) not in ("cpu", "cpu:0"):
        raise ValueError(
            f"layernorm runs on the CPU only: device must be None or 'cpu', got {device!r}"
        )


def _checkpoint_array(value: Any) -> np.ndarray:
    """Return a state_dict value as an ndarray; a bfloat16 tensor as ml_dtypes' bfloat16, or,
    without ml_dtypes, widened to float32 (exact too); the 8-bit floats (torch's float8
    tensors, ml_dtypes' float8 arrays), which torch loads into a parameter by converting them
    and which NumPy has no arithmetic of its own for, widened to float32 (exact)."""
    dtype_name = str(getattr(value, "dtype", ""))
    if dtype_name == "torch.bfloat16":
        try:
            _bfloat16_dtype()
        except TypeError:
            value = value.float()
    elif dtype_name.startswith("torch.float8"):
        value = value.float()
    array = np.asarray(_as_numpy(value))
    if array.dtype.kind == "V" and array.dtype.name.startswith("float8"):
        array = array.astype(np.float32)
    return array


def _rounded_as_torch(value: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """value, to be converted to dtype, first rounded as torch rounds it there: torch converts
    any wider value to float16 or bfloat16 through float32, rounding twice, where NumPy and
    ml_dtypes round once (float64 1 + 2**-11 + 2**-40 becomes float16 1.0, not 1 + 2**-10;
    int64 2**25 + 2**17 + 1 becomes bfloat16 2**25, not 2**25 + 2**18)."""
    if dtype.itemsize == 2 and value.dtype.itemsize >= 4 and value.dtype != np.float32:
        return value.astype(np.float32)
    return value


def _as_gradient(grad_output: Any, output_dtype: np.dtype[Any]) -> Any:
    """grad_output as autograd takes it: a list or a number as the array NumPy makes of it, and
    integers or booleans in the output's dtype (autograd converts a gradient to its tensor's
    dtype).  Anything else (text, objects) is left to the kernel's dtype check."""
    if type(grad_output) is not _ndarray:
        grad_output = _as_numpy(grad_output)
        if isinstance(grad_output, (list, tuple, int, float, bool, np.generic)):
            grad_output = np.asarray(grad_output)
    if isinstance(grad_output, np.ndarray) and grad_output.dtype.kind in "biu":
        return grad_output.astype(output_dtype)
    return grad_output


def _check_grad_output_shape(grad_output: Any, output_shape: Tuple[float, ...]) -> None:
    """Raise ValueError with autograd's text when grad_output, an array, is not of the output's
    shape.  Other values are left to the kernel's checks (a string's dtype is its mistake), and
    so are a dask array's unknown sizes, NaN, which the lazy backward checks when it runs."""
    shape = getattr(grad_output, "shape", None)
    if shape is None or tuple(shape) == output_shape or any(math.isnan(size) for size in (*shape, *output_shape)):
        return
    raise ValueError(
        f"Mismatch in shape: grad_output[0] has a shape of {tuple(shape)} and output[0] has a shape of "
        f"{output_shape}."
    )


def _quote(name: str) -> str:
    return f'"{name}"'


def _param_array(param: Any) -> np.ndarray:
    """A parameter's values as an ndarray: a torch tensor assigned as a parameter is read, and
    written in place (``reset_parameters``, ``load_state_dict``), through the NumPy view that
    shares its memory, as the forward reads it."""
    return np.asarray(_as_numpy(param))


def _describe(param: Any) -> str:
    """``float32 array [4]`` or ``None``: a parameter as backward's refusals name it."""
    if param is None:
        return "None"
    array = _param_array(param)
    return f"{array.dtype} array {list(array.shape)}"


class _ParameterSlot:
    """What may be assigned to a parameter (``ln.weight = value``): an ndarray, a torch tensor
    (read and written through the NumPy view of its memory) or None, as torch takes only a
    Parameter or None.  Anything else, a list say, would be converted afresh by every call, while
    ``reset_parameters`` and ``load_state_dict`` wrote into throwaway conversions.

    It has no ``__get__``: reading the attribute stays a lookup in the instance's dict."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __set__(self, module: Any, value: Any) -> None:
        if not (value is None or isinstance(value, np.ndarray) or _is_torch_tensor(value)):
            kind = type(value)
            kind_name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
            raise TypeError(
                f"cannot assign '{kind_name}' as parameter '{self.name}' "
                "(numpy.ndarray, torch.Tensor or None expected)"
            )
        module.__dict__[self.name] = value


# torch's text when a tensor saved for backward was modified in place after the forward.
_MODIFIED_IN_PLACE = (
    "one of the variables needed for gradient computation has been modified by an inplace operation"
)


def _modified_in_place(module: Any, name: str) -> RuntimeError:
    """torch's error for a parameter changed in place between the forward and backward."""
    where = f"{type(module).__name__}.{name}"
    return RuntimeError(
        f"{_MODIFIED_IN_PLACE}: {where} [{_describe(getattr(module, name))}] changed after "
        "the forward call. Call the module on its input again before backward()."
    )


def _check_accumulates(grad_name: str, total: Any, grad: Any) -> None:
    """Raise what ``total += grad`` would raise (NumPy's in-place casting and shape rules), and
    for a `total` that is not an array backward can write, without writing to `total`."""
    if not isinstance(total, np.ndarray):
        raise TypeError(f"{grad_name} must be a NumPy array or None, got {type(total).__name__}")
    if not total.flags.writeable:
        raise ValueError(f"{grad_name} is read-only: backward() adds the gradient into it in place")
    trial = np.zeros(total.shape, total.dtype)
    trial += grad


class _LazySaved(NamedTuple):
    """What a training-mode call on a dask array keeps for backward: the input and the
    statistics, both lazy, and copies of the parameters' values the output was computed with."""

    input: Any
    stats: Tuple[Any, ...]
    values: Tuple[Optional[np.ndarray], ...]


class NormModule:
    """What every norm module shares, like the parts of ``torch.nn.Module`` a norm layer uses.

    A subclass names the torch class it mirrors in ``_KIND``, its parameters in
    ``_PARAMETERS``: (name, the attribute its gradient accumulates in, the value it starts at
    and ``reset_parameters`` restores), and its functions in ``_FUNCTIONS``: (forward, the
    forward with statistics, backward), as layernorm.functional has them, for dask inputs.  It
    defines ``__call__`` (the forward, ``forward`` its alias), which in training mode stores in
    ``_saved`` what its backward kernel needs and the parameters it used, ``_gradients`` (that
    kernel) and ``extra_repr``.
    """

    _KIND: ClassVar[str]
    _PARAMETERS: ClassVar[Tuple[Tuple[str, str, float], ...]]
    _FUNCTIONS: ClassVar[Tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]]

    normalized_shape: tuple[int, ...]
    axis: Optional[int | tuple[int, ...]]
    weight: Optional[_FloatArray]
    weight_grad: Optional[_FloatArray]
    training: bool
    # what the last call saved for backward, if it was in training mode: (what its kernel
    # saved, with the parameters' values; the parameters it used, in _PARAMETERS order; its
    # normalized_shape and axis); () once backward used it, None when there was none (a single
    # store keeps the training-mode call cheap)
    _saved: Optional[Tuple[Any, ...]]

    def __init__(
        self,
        normalized_shape: SupportsIndex | Iterable[SupportsIndex],
        eps: Any,
        elementwise_affine: bool,
        device: Any,
        dtype: Any,
        present: Iterable[str],
        axis: Any,
    ) -> None:
        """Store the settings; with elementwise_affine, make the parameters named in `present`
        (the others are None)."""
        _check_device(device)
        param_dtype = _as_param_dtype(dtype, self._KIND)
        self.normalized_shape = _as_shape(normalized_shape)
        self.axis = _as_axis(axis, self.normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        made = set(present) if elementwise_affine else set()
        for name, grad_name, initial in self._PARAMETERS:
            setattr(self, name, self._new_parameter(name, initial, param_dtype) if name in made else None)
            setattr(self, grad_name, None)
        self.training = True
        self._saved = None

    def _new_parameter(self, name: str, initial: float, dtype: np.dtype[Any]) -> _FloatArray:
        """A parameter of normalized_shape filled with `initial`; a MemoryError says which and how big."""
        try:
            return np.full(self.normalized_shape, initial, dtype)
        except MemoryError:
            size = math.prod(self.normalized_shape) * dtype.itemsize
            raise MemoryError(
                f"{self._KIND}: could not allocate {name}, a {dtype} array of shape "
                f"{list(self.normalized_shape)}: {size} bytes"
            ) from None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, _, _ in cls.__dict__.get("_PARAMETERS", ()):
            setattr(cls, name, _ParameterSlot(name))
        # __call__ is the fast path and forward its alias: a subclass overriding only
        # forward gets a __call__ that goes through it, as in torch.
        if "forward" in cls.__dict__ and "__call__" not in cls.__dict__:
            def __call__(self: NormModule, *args: Any, **kwargs: Any) -> Any:
                return self.forward(*args, **kwargs)

            cls.__call__ = __call__  # type: ignore[method-assign]

    def __call__(self, input: npt.ArrayLike) -> _FloatArray:
        """The forward: each kind defines it."""
        raise NotImplementedError

    forward = __call__

    def _lazy_call(self, input: Any, params: Tuple[Any, ...]) -> _FloatArray:
        """The forward on a dask array: a lazy output, computed with the parameters' values of
        now (copied: a later in-place update must not change it).  In training mode the lazy
        statistics are kept for backward."""
        values = tuple(None if param is None else _param_array(param).copy() for param in params)
        forward, with_stats, _ = self._FUNCTIONS
        if not self.training:
            self._saved = None
            output: _FloatArray = forward(input, self.normalized_shape, *values, self.eps, axis=self.axis)
            return output
        try:
            output, *stats = with_stats(input, self.normalized_shape, *values, self.eps, axis=self.axis)
        except BaseException:
            self._saved = None
            raise
        self._saved = (_LazySaved(input, tuple(stats), values), params, self.normalized_shape, self.axis)
        return output

    def _lazy_gradients(self, grad_output: Any, saved: _LazySaved, normalized_shape: tuple[int, ...],
                        axis: Optional[int | tuple[int, ...]]) -> Tuple[Any, ...]:
        """(grad_input, *parameter gradients) of a training-mode call on a dask array:
        grad_input lazy, the parameter gradients computed now (into NumPy arrays)."""
        import dask

        for (name, _, _), value in zip(self._PARAMETERS, saved.values):
            current = getattr(self, name)
            if value is not None and not np.array_equal(_param_array(current), value, equal_nan=True):
                raise _modified_in_place(self, name)
        _, _, backward = self._FUNCTIONS
        mask = (True,) + tuple(value is not None for value in saved.values)
        grads = backward(grad_output, saved.input, normalized_shape, *saved.stats, *saved.values, mask, axis=axis)
        return (grads[0], *dask.compute(*grads[1:]))

    # ----------------------------------------------------------------- backward

    def backward(self, grad_output: npt.ArrayLike) -> _FloatArray:
        """Back-propagate `grad_output` through the last call, which must have been in training
        mode (the module may have been put in eval mode since), with the normalized_shape and
        axis it had.

        Accumulates into the parameters' gradients (``weight_grad``, ...; like torch's
        ``.grad``) and frees the saved values, so a second backward needs a new forward.

        Parameters
        ----------
        grad_output : array_like
            Gradient of the loss with respect to the output, same shape as that output.

        Returns
        -------
        ndarray
            Gradient with respect to the input, in the input's dtype.  After a forward on a
            dask array: a lazy dask array, while the parameters' gradients are computed (and
            accumulated) by this call.

        Raises
        ------
        RuntimeError
            When the last call was not a training-mode forward or was back-propagated already,
            or when a parameter was changed in place (torch's text) or replaced since that
            forward.
        """
        saved = self._saved
        if not saved:
            if saved is not None:
                raise RuntimeError(
                    "Trying to backward through the graph a second time: the values saved by "
                    "the last training-mode forward were freed by the previous backward(). "
                    "Call the module on an input again before calling backward()."
                )
            raise RuntimeError(
                "backward() needs a training-mode forward first: put the module in training "
                "mode with .train() and call it on an input before calling backward()."
            )
        kernel_saved, params, normalized_shape, axis = saved
        self._check_parameters_not_replaced(params)
        if isinstance(kernel_saved, _LazySaved):
            _check_grad_output_shape(grad_output, kernel_saved.input.shape)
            grads = self._lazy_gradients(grad_output, kernel_saved, normalized_shape, axis)
        else:
            grad_output = _as_gradient(grad_output, kernel_saved[0].dtype)
            _check_grad_output_shape(grad_output, kernel_saved[0].shape)
            try:
                grads = self._gradients(grad_output, kernel_saved, normalized_shape, axis)
            except ParameterChangedError as error:
                raise _modified_in_place(self, error.name) from None
        # Every addition is tried before any is made: a gradient that cannot be added (a
        # weight_grad of another shape, say) fails the call with no gradient half-accumulated.
        updates = []
        for index, (name, grad_name, _) in enumerate(self._PARAMETERS, 1):
            param = getattr(self, name)
            if param is not None:
                total = getattr(self, grad_name)
                if total is None:
                    dtype = _param_array(param).dtype
                    updates.append((grad_name, None, np.asarray(grads[index], dtype=dtype)))
                else:
                    _check_accumulates(grad_name, total, grads[index])
                    updates.append((grad_name, total, grads[index]))
        for grad_name, total, grad in updates:
            if total is None:
                setattr(self, grad_name, grad)
            else:
                # in place, as torch accumulates into .grad, and as torch rounds: the step's
                # gradient to the parameter's dtype first, then their sum
                total += grad.astype(total.dtype, copy=False)
        self._saved = ()
        return cast(_FloatArray, grads[0])  # never masked off

    def _gradients(self, grad_output: Any, saved: Tuple[Any, ...], normalized_shape: tuple[int, ...],
                   axis: Optional[int | tuple[int, ...]]) -> Tuple[Optional[_FloatArray], ...]:
        """(grad_input, *one gradient per parameter, None where it is None) from what the last
        training-mode call's kernel saved, with that call's normalized_shape and axis."""
        raise NotImplementedError

    def _check_parameters_not_replaced(self, params: Tuple[Any, ...]) -> None:
        """Raise RuntimeError when a parameter is not the one the forward used: the gradients
        would belong to another parameter than the output did.  (A parameter changed in place
        is found by the backward kernel, which compares it with the values it saved.)"""
        for (name, _, _), param in zip(self._PARAMETERS, params):
            current = getattr(self, name)
            if current is not param:
                raise RuntimeError(
                    f"{type(self).__name__}.{name} was replaced after the forward call ({_describe(param)} "
                    f"by {_describe(current)}): call the module on its input again before backward()."
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the parameters' gradients to None (or to zeros if not `set_to_none`)."""
        for _, grad_name, _ in self._PARAMETERS:
            grad = getattr(self, grad_name)
            if set_to_none or grad is None:
                setattr(self, grad_name, None)
            else:
                grad[...] = 0

    # ------------------------------------------------------------- parameters

    def reset_parameters(self) -> None:
        """Set the parameters back to their initial values (weight ones, bias zeros), in place."""
        for name, _, initial in self._PARAMETERS:
            param = getattr(self, name)
            if param is not None:
                _param_array(param)[...] = initial

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> list[tuple[str, _FloatArray]]:
        """Return ``[(name, array), ...]`` for the parameters that exist, as torch orders them;
        names start with ``prefix + "."`` when `prefix` is given.  `recurse` and
        `remove_duplicate` are torch's, with nothing to do here (no submodules, no shared
        parameters)."""
        lead = prefix + "." if prefix else ""
        pairs = ((lead + name, getattr(self, name)) for name, _, _ in self._PARAMETERS)
        return [(name, value) for name, value in pairs if value is not None]

    def parameters(self, recurse: bool = True) -> list[_FloatArray]:
        """Return the parameters that exist, e.g. ``[weight, bias]``, ``[weight]`` or ``[]``."""
        return [value for _, value in self.named_parameters()]

    @overload
    def state_dict(self, *, destination: None = None, prefix: str = "",
                   keep_vars: bool = False) -> OrderedDict[str, _FloatArray]: ...

    @overload
    def state_dict(self, *, destination: _Destination, prefix: str = "", keep_vars: bool = False) -> _Destination: ...

    def state_dict(self, *, destination: Optional[MutableMapping[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> MutableMapping[str, Any]:
        """Return an OrderedDict of copies of the parameters, with torch's keys after `prefix`
        (``"norm."``, say); with `keep_vars`, the parameters themselves instead of copies.
        `destination` is filled and returned instead of a new OrderedDict.  As torch's, a new
        one has ``_metadata``, the module's version under its prefix, ``{"": {"version": 1}}``."""
        state: MutableMapping[str, Any] = OrderedDict() if destination is None else destination
        if destination is None:
            setattr(state, "_metadata", OrderedDict())
        if hasattr(state, "_metadata"):
            state._metadata[prefix[:-1]] = {"version": 1}  # torch's Module._version
        for name, value in self.named_parameters():
            state[prefix + name] = value if keep_vars else _param_array(value).copy()
        return state

    def load_state_dict(self, state_dict: Mapping[str, npt.ArrayLike], strict: bool = True,
                        assign: bool = False) -> IncompatibleKeys:
        """Copy parameters from `state_dict` (NumPy arrays, torch tensors or lists).

        Every key and shape is checked before anything changes; values are cast to the
        parameters' dtype, or with `assign` become the parameters themselves, as arrays of
        their own dtype (torch's ``assign=True``).

        Parameters
        ----------
        state_dict : mapping
            Name to array-like, e.g. ``torch.nn.LayerNorm(...).state_dict()``.
        strict : bool, default True
            Whether missing or unexpected keys are errors. Shapes are always checked.
        assign : bool, default False
            Whether the values replace the parameters instead of being copied into them.

        Returns
        -------
        IncompatibleKeys
            Named tuple ``(missing_keys, unexpected_keys)``.

        Raises
        ------
        TypeError
            If `state_dict` is not a mapping (torch's text).
        RuntimeError
            With torch's "Error(s) in loading state_dict for LayerNorm" text.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        own = OrderedDict(self.named_parameters())
        missing = [name for name in own if name not in state_dict]
        unexpected = [name for name in state_dict if name not in own]
        errors: list[str] = []
        if strict:
            if missing:
                quoted = ", ".join(map(_quote, missing))
                errors.append(f"Missing key(s) in state_dict: {quoted}. ")
            if unexpected:
                quoted = ", ".join(map(_quote, unexpected))
                errors.append(f"Unexpected key(s) in state_dict: {quoted}. ")
        new_values = {}
        for name, param in own.items():
            if name not in state_dict:
                continue
            given = state_dict[name]
            if given is None or isinstance(given, (str, bytes)):
                errors.append(
                    f'While copying the parameter named "{name}", expected torch.Tensor or '
                    f"Tensor-like object from checkpoint but received {type(given)}"
                )
                continue
            try:
                value = _checkpoint_array(given)
            except Exception as exc:  # e.g. a tensor that can't become an array
                errors.append(
                    f'While copying the parameter named "{name}", could not convert it '
                    f"to an array: {exc}"
                )
                continue
            if value.shape == (1,) and _param_array(param).ndim == 0:
                value = value.reshape(())  # torch's rule for checkpoints of 0-d parameters
            if value.dtype.kind not in "biuf" and not _is_bfloat16(value.dtype):
                errors.append(
                    f'While copying the parameter named "{name}", expected real numbers from '
                    f"checkpoint but received an array of dtype {value.dtype}"
                )
            elif value.shape != _param_array(param).shape:
                errors.append(
                    f"size mismatch for {name}: copying a param with shape {value.shape} from "
                    f"checkpoint, the shape in current model is {_param_array(param).shape}."
                )
            elif assign and value.dtype.kind == "f" and value.dtype.itemsize not in (2, 4, 8):
                errors.append(
                    f'While copying the parameter named "{name}", {type(self).__name__} supports '
                    f"float16, bfloat16, float32 and float64 parameters, got {value.dtype}"
                )
            elif not assign and not _param_array(param).flags.writeable:
                errors.append(
                    f'While copying the parameter named "{name}", the parameter is a read-only '
                    "array: load with assign=True to replace it"
                )
            else:
                new_values[name] = value
        if errors:
            header = f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
            raise RuntimeError(header + "\n\t".join(errors))
        grad_names = {name: grad_name for name, grad_name, _ in self._PARAMETERS}
        for name, value in new_values.items():
            if assign:
                float_kind = value.dtype.kind == "f" or _is_bfloat16(value.dtype)
                # a float dtype as it is, in native byte order; integers as the parameter's
                kept = value.astype(value.dtype.newbyteorder("=") if float_kind else _param_array(own[name]).dtype,
                                    copy=False)
                setattr(self, name, kept if kept.flags.writeable else kept.copy())
                setattr(self, grad_names[name], None)  # a new parameter, as torch's, has no gradient yet
            else:
                target = _param_array(own[name])
                np.copyto(target, _rounded_as_torch(value, target.dtype), casting="unsafe")
        return IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------------- modes

    def train(self: _Module, mode: bool = True) -> _Module:
        """Set training mode (the output is the same; only backward support differs); return self."""
        if not isinstance(mode, bool):
            raise _TrainingModeError("training mode is expected to be boolean")
        self.training = mode  # what the last training-mode call saved stays, as torch's graph does
        return self

    def eval(self: _Module) -> _Module:
        """Same as ``train(False)``; return self."""
        return self.train(False)

    # ------------------------------------------------------------ conversions

    def to(self: _Module, *args: Any, **kwargs: Any) -> _Module:
        """torch's ``Module.to`` on the CPU: ``to(dtype)``, ``to("cpu")``, ``to(device, dtype)``,
        ``to(array_or_tensor)`` (its dtype), or the keywords ``device``, ``dtype`` and
        ``non_blocking`` (ignored).  A float dtype (float16, bfloat16, float32, float64, named
        as the constructor takes it) converts the parameters and their gradients to it, as new
        arrays; a device must be the CPU.  Returns self."""
        # torch's three forms, told apart by the first argument: to(device, dtype, non_blocking),
        # to(dtype, non_blocking), to(tensor, non_blocking); a string first is a device
        first = args[0] if args else None
        if isinstance(first, (type, np.dtype)) or type(first).__name__ == "dtype":
            names: Tuple[str, ...] = ("dtype", "non_blocking")
        elif hasattr(first, "dtype") and hasattr(first, "shape"):
            names = ("tensor", "non_blocking")
        else:
            names = ("device", "dtype", "non_blocking")
        given = dict(zip(names, args))
        arguments = {**given, **kwargs}
        if (len(args) > len(names) or set(given) & set(kwargs) or set(kwargs) - set(names) - {"memory_format"}
                or isinstance(arguments.get("device"), bool) or not isinstance(arguments.get("non_blocking", False), bool)):
            raise TypeError(
                f"to() got an unexpected combination of arguments, {args!r} and keywords {sorted(kwargs)}: it takes "
                "(device, dtype, non_blocking), (dtype, non_blocking) or (array_or_tensor, non_blocking)"
            )
        device, dtype = arguments.get("device"), arguments.get("dtype")
        if "tensor" in arguments:
            dtype = arguments["tensor"].dtype  # an array's or a tensor's
        _check_device(device)
        if dtype is not None:
            target = _as_param_dtype(dtype, self._KIND)
            for name, grad_name, _ in self._PARAMETERS:
                for attribute in (name, grad_name):
                    value = getattr(self, attribute)
                    if value is not None and _param_array(value).dtype != target:
                        setattr(self, attribute, _rounded_as_torch(_param_array(value), target).astype(target))
        return self

    def float(self: _Module) -> _Module:
        """``to(float32)``, as torch's ``Module.float()``."""
        return self.to(np.float32)

    def double(self: _Module) -> _Module:
        """``to(float64)``."""
        return self.to(np.float64)

    def half(self: _Module) -> _Module:
        """``to(float16)``."""
        return self.to(np.float16)

    def bfloat16(self: _Module) -> _Module:
        """``to(dtype="bfloat16")`` (needs ml_dtypes)."""
        return self.to(dtype="bfloat16")

    def cpu(self: _Module) -> _Module:
        """Return self: everything is on the CPU already."""
        return self

    def type(self: _Module, dst_type: Any) -> _Module:
        """``to(dst_type)``, a float dtype."""
        return self.to(dtype=dst_type)

    # ------------------------------------------------------------------ printing

    def extra_repr(self) -> str:
        """Return the settings as torch's repr prints them inside the parentheses."""
        return ""

    def __repr__(self) -> str:
        # axis= is ours, not torch's: shown only when set, so the repr is torch's otherwise
        axis = "" if self.axis is None else f", axis={self.axis}"
        return f"{type(self).__name__}({self.extra_repr()}{axis})"

    # ----------------------------------------------------------------- pickling

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle or a deep copy keeps: not the values saved for backward, nor the
        gradients (torch's pickles and deep copies of a module drop each parameter's .grad)."""
        state = self.__dict__.copy()
        state["_saved"] = None
        state.update((grad_name, None) for _, grad_name, _ in self._PARAMETERS)
        return state

    def __copy__(self) -> "NormModule":
        """A shallow copy: the same parameter and gradient arrays, as torch's copy.copy of a
        module shares its parameters and their .grad; nothing saved for backward."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__, _saved=None)
        return copied


class LayerNorm(NormModule):
    """Layer normalization over the last dimensions of an array, like ``torch.nn.LayerNorm``.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, with the mean and the biased
    variance taken over the last ``len(normalized_shape)`` dimensions.

    Parameters
    ----------
    normalized_shape : int or sequence of int
        Shape of the trailing dimensions to normalize over; an int n means ``(n,)``.
    eps : float, default 1e-5
        Added to the variance inside the square root; stored as given.
    elementwise_affine : bool, default True
        Whether to have a learnable ``weight`` (ones) and ``bias`` (zeros).
    bias : bool, default True
        Whether to have ``bias`` (only when ``elementwise_affine``).
    device : None or "cpu"
        Accepted for torch compatibility; anything else raises ValueError.
    dtype : dtype, optional
        Parameter dtype: float16, bfloat16, float32 (default) or float64, as NumPy, ml_dtypes or
        torch dtypes or their names (bfloat16 needs ml_dtypes installed).
    axis : int or tuple of int, optional
        The axes to normalize over, in the order of ``normalized_shape`` (keyword only; not in
        torch): ``LayerNorm(64, axis=1)`` is ConvNeXt's channels-first LayerNorm on
        ``(N, C, H, W)`` arrays, computed in place without transposed copies.

    Attributes
    ----------
    weight, bias : ndarray or None
        Parameters of shape ``normalized_shape``.
    weight_grad, bias_grad : ndarray or None
        Gradients accumulated by :meth:`backward`; None until the first backward.
    training : bool
        True by default. A training-mode call keeps what :meth:`backward` needs.

    Examples
    --------
    >>> ln = LayerNorm(6).eval()
    >>> ln(np.arange(1, 7, dtype=np.float32)).round(4)
    array([-1.4638, -0.8783, -0.2928,  0.2928,  0.8783,  1.4638],
          dtype=float32)
    """

    _KIND = "LayerNorm"
    _PARAMETERS = (("weight", "weight_grad", 1.0), ("bias", "bias_grad", 0.0))
    _FUNCTIONS = (layer_norm, native_layer_norm, layer_norm_backward)

    bias: Optional[_FloatArray]
    bias_grad: Optional[_FloatArray]

    def __init__(
        self,
        normalized_shape: SupportsIndex | Iterable[SupportsIndex],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        axis: Any = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, device, dtype,
            ("weight", "bias") if bias else ("weight",), axis,
        )

    def __call__(self, input: npt.ArrayLike) -> _FloatArray:
        """Normalize `input` (any array-like); return a new array of its dtype.

        Parameters
        ----------
        input : array_like
            Float16/32/64 data whose trailing dimensions (or those `axis` names) equal
            ``normalized_shape``.

        Returns
        -------
        ndarray
            The normalized array, same shape and dtype as `input` (C-contiguous, or in the
            input's memory order with `axis`); for a dask array, a lazy dask array of its chunks.
        """
        params = weight, bias = self.weight, self.bias
        if not (
            type(input) is _ndarray
            and (weight is None or type(weight) is _ndarray)
            and (bias is None or type(bias) is _ndarray)
        ):
            if _holds_dask_array(input):
                return self._lazy_call(input, params)
            input, weight, bias = _as_numpy(input), _as_numpy(weight), _as_numpy(bias)
        if not self.training:
            self._saved = None  # backward() goes through the last call, which kept nothing
            try:
                return _core.layer_norm(input, self.normalized_shape, weight, bias, self.eps, axis=self.axis)
            except UnsupportedDTypeError as error:
                raise _torch_worded(error, _FORWARD_KERNEL) from None
        # The input comes back as a private copy: the caller may change its own array
        # before backward(), which must not change the gradients (torch raises there).
        try:
            output, kernel_saved = _core.training_forward(
                input, self.normalized_shape, weight, bias, self.eps, axis=self.axis
            )
        except BaseException as error:
            # A failed call must not leave the previous call's values for backward() to use.
            self._saved = None
            if isinstance(error, UnsupportedDTypeError):
                raise _torch_worded(error, _FORWARD_KERNEL) from None
            raise
        self._saved = (kernel_saved, params, self.normalized_shape, self.axis)
        return output

    forward = __call__

    def _gradients(self, grad_output: Any, saved: Tuple[Any, ...], normalized_shape: tuple[int, ...],
                   axis: Optional[int | tuple[int, ...]]) -> Tuple[Optional[_FloatArray], ...]:
        weight, bias = _as_numpy(self.weight), _as_numpy(self.bias)
        input, stats = saved
        return _core.saved_backward(
            grad_output, input, stats, normalized_shape, weight, bias,
            (True, weight is not None, bias is not None), axis=axis,
        )

    def extra_repr(self) -> str:
        """Return torch's text: ``(4,), eps=1e-05, elementwise_affine=True, bias=True``."""
        # str.format like torch: eps=0 stays "0", np.float32(1e-5) prints as a Python float.
        return (
            "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}, bias={use_bias}"
        ).format(
            normalized_shape=self.normalized_shape,
            eps=self.eps,
            elementwise_affine=self.elementwise_affine,
            use_bias=self.bias is not None,
        )


class RMSNorm(NormModule):
    """Root-mean-square normalization over the last dimensions, like ``torch.nn.RMSNorm``.

    ``y = x / sqrt(mean(x ** 2) + eps) * weight``, the mean taken over the last
    ``len(normalized_shape)`` dimensions (or those `axis` names); no bias, no centring.

    Parameters
    ----------
    normalized_shape : int or sequence of int
        Shape of the dimensions to normalize over; an int n means ``(n,)``.
    eps : float, optional
        Added to the mean of squares inside the square root; None (the default) means the
        machine epsilon of the compute type (float32 for float16/float32 input), as torch.
    elementwise_affine : bool, default True
        Whether to have a learnable ``weight`` (ones).
    device : None or "cpu"
        Accepted for torch compatibility; anything else raises ValueError.
    dtype : dtype, optional
        Parameter dtype: float16, bfloat16, float32 (default) or float64, as NumPy, ml_dtypes or
        torch dtypes or their names (bfloat16 needs ml_dtypes installed).
    axis : int or tuple of int, optional
        The axes to normalize over, in the order of ``normalized_shape`` (keyword only; not in
        torch).

    Attributes
    ----------
    weight : ndarray or None
        Parameter of shape ``normalized_shape``.
    weight_grad : ndarray or None
        Gradient accumulated by :meth:`backward`; None until the first backward.
    training : bool
        True by default. A training-mode call keeps what :meth:`backward` needs.

    Examples
    --------
    >>> rms = RMSNorm(4).eval()
    >>> rms(np.array([1.0, -1.0, 1.0, -1.0], dtype=np.float32))  # 1 / sqrt(1 + eps), eps 2**-23
    array([ 0.99999994, -0.99999994,  0.99999994, -0.99999994], dtype=float32)
    """

    _KIND = "RMSNorm"
    _PARAMETERS = (("weight", "weight_grad", 1.0),)
    _FUNCTIONS = (rms_norm, native_rms_norm, rms_norm_backward)

    def __init__(
        self,
        normalized_shape: SupportsIndex | Iterable[SupportsIndex],
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        axis: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, ("weight",), axis)

    def __call__(self, input: npt.ArrayLike) -> _FloatArray:
        """Normalize `input` (any array-like); return a new array of its dtype (for a dask array,
        a lazy dask array of its chunks)."""
        params = (weight,) = (self.weight,)
        if not (type(input) is _ndarray and (weight is None or type(weight) is _ndarray)):
            if _holds_dask_array(input):
                return self._lazy_call(input, params)
            input, weight = _as_numpy(input), _as_numpy(weight)
        if not self.training:
            self._saved = None  # see LayerNorm
            try:
                return _core.rms_norm(input, self.normalized_shape, weight, self.eps, axis=self.axis)
            except UnsupportedDTypeError as error:
                raise _torch_worded(error, _RMS_KERNEL) from None
        try:
            output, kernel_saved = _core.rms_training_forward(
                input, self.normalized_shape, weight, self.eps, axis=self.axis
            )
        except BaseException as error:
            self._saved = None
            if isinstance(error, UnsupportedDTypeError):
                raise _torch_worded(error, _RMS_KERNEL) from None
            raise
        self._saved = (kernel_saved, params, self.normalized_shape, self.axis)
        return output

    forward = __call__

    def _gradients(self, grad_output: Any, saved: Tuple[Any, ...], normalized_shape: tuple[int, ...],
                   axis: Optional[int | tuple[int, ...]]) -> Tuple[Optional[_FloatArray], ...]:
        weight = _as_numpy(self.weight)
        input, stats = saved
        return _core.rms_saved_backward(
            grad_output, input, stats, normalized_shape, weight, (True, weight is not None), axis=axis,
        )

    def extra_repr(self) -> str:
        """Return torch's text: ``(4,), eps=None, elementwise_affine=True``."""
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(
            normalized_shape=self.normalized_shape, eps=self.eps, elementwise_affine=self.elementwise_affine
        )
