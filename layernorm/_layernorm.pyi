"""Type stubs for the compiled module layernorm._layernorm (src/_layernorm.c)."""

from typing import Literal, Sequence, SupportsFloat, SupportsIndex, TypeAlias

import numpy as np
import numpy.typing as npt

_Shape: TypeAlias = SupportsIndex | Sequence[SupportsIndex]
_FloatArray: TypeAlias = npt.NDArray[np.floating]
_SimdLevel: TypeAlias = Literal["scalar", "sse2", "neon", "avx2", "avx512"]

def layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    eps: SupportsFloat = 1e-5,
    *,
    out: _FloatArray | None = None,
) -> _FloatArray:
    """F.layer_norm: normalize over the last len(normalized_shape) dims; output in the input's dtype."""

def native_layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    eps: SupportsFloat = 1e-5,
) -> tuple[_FloatArray, _FloatArray, _FloatArray]:
    """torch.native_layer_norm: (output, mean, rstd); mean/rstd in the compute dtype."""

def layer_norm_backward(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    mean: npt.ArrayLike,
    rstd: npt.ArrayLike,
    weight: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    output_mask: Sequence[bool] = (True, True, True),
) -> tuple[_FloatArray | None, _FloatArray | None, _FloatArray | None]:
    """native_layer_norm_backward: (grad_input, grad_weight, grad_bias), None where masked off."""

def set_num_threads(n: SupportsIndex, /) -> None: ...
def get_num_threads() -> int: ...
def simd_level() -> _SimdLevel: ...
def available_simd_levels() -> tuple[_SimdLevel, ...]: ...
def set_simd_level(name: _SimdLevel, /) -> None: ...
def training_forward(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    eps: SupportsFloat = 1e-5,
) -> tuple[_FloatArray, tuple[_FloatArray, bytes]]:
    """native_layer_norm for LayerNorm's training mode: (output, (input, stats)), input a private
    C-contiguous copy, stats the rows' mean then rstd as bytes; saved_backward reads them."""

def saved_backward(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    stats: bytes,
    normalized_shape: _Shape,
    weight: npt.ArrayLike | None = None,
    bias: npt.ArrayLike | None = None,
    output_mask: Sequence[bool] = (True, True, True),
) -> tuple[_FloatArray | None, _FloatArray | None, _FloatArray | None]:
    """layer_norm_backward from what training_forward saved."""
