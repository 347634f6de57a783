"""Type stubs for the compiled module layernorm._layernorm (src/_layernorm.c).

The public functions are layernorm.functional's; these are the core they call.
"""

from typing import Any, Literal, Optional, Sequence, SupportsFloat, SupportsIndex, Tuple, TypedDict, Union

import numpy as np
import numpy.typing as npt

_Shape = Union[SupportsIndex, Sequence[SupportsIndex]]
_Axis = Union[SupportsIndex, Tuple[SupportsIndex, ...], None]
_FloatArray = npt.NDArray[np.floating[Any]]
_F64 = npt.NDArray[np.float64]
_SimdLevel = Literal["scalar", "sse2", "neon", "avx2", "avx512", "avx512bf16"]
_ResultCacheInfo = TypedDict("_ResultCacheInfo", {"max_bytes": int, "bytes": int, "blocks": int})
_Gradients = Tuple[Optional[_FloatArray], Optional[_FloatArray], Optional[_FloatArray]]

class UnsupportedDTypeError(TypeError):
    """An input dtype the kernels do not take."""

    dtype: np.dtype[Any]

class ParameterChangedError(RuntimeError):
    """A parameter given to saved_backward differs from the one training_forward saved."""

    name: str

def layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
    *,
    axis: _Axis = None,
    out: Optional[_FloatArray] = None,
) -> _FloatArray: ...
def native_layer_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
    *,
    axis: _Axis = None,
) -> Tuple[_FloatArray, _FloatArray, _FloatArray]: ...
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
) -> Tuple[_FloatArray, _FloatArray]: ...
def training_forward(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    eps: SupportsFloat = 1e-5,
    *,
    axis: _Axis = None,
) -> Tuple[_FloatArray, Tuple[_FloatArray, bytes]]:
    """native_layer_norm for LayerNorm's training mode: (output, (input, stats)), input a private
    copy in the input's memory order, stats the rows' mean then rstd, then the weight and bias
    used, as bytes; saved_backward reads them."""

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
) -> _Gradients: ...
def saved_backward(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    stats: bytes,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    output_mask: Sequence[bool] = (True, True, True),
    *,
    axis: _Axis = None,
) -> _Gradients:
    """layer_norm_backward from what training_forward saved."""

def rms_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    eps: Optional[SupportsFloat] = None,
    *,
    axis: _Axis = None,
    out: Optional[_FloatArray] = None,
) -> _FloatArray: ...
def native_rms_norm(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    eps: Optional[SupportsFloat] = None,
    *,
    axis: _Axis = None,
) -> Tuple[_FloatArray, _FloatArray]: ...
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
) -> Tuple[_FloatArray, _FloatArray]: ...
def rms_training_forward(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    eps: Optional[SupportsFloat] = None,
    *,
    axis: _Axis = None,
) -> Tuple[_FloatArray, Tuple[_FloatArray, bytes]]:
    """training_forward for RMSNorm: stats hold the rows' rstd, then the weight used."""

def rms_norm_backward(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    rstd: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    output_mask: Sequence[bool] = (True, True),
    *,
    axis: _Axis = None,
) -> Tuple[Optional[_FloatArray], Optional[_FloatArray]]: ...
def rms_saved_backward(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    stats: bytes,
    normalized_shape: _Shape,
    weight: Optional[npt.ArrayLike] = None,
    output_mask: Sequence[bool] = (True, True),
    *,
    axis: _Axis = None,
) -> Tuple[Optional[_FloatArray], Optional[_FloatArray]]:
    """rms_norm_backward from what rms_training_forward saved."""

# Private: layernorm._dask's chunks of rows split along the normalized axes (float64 statistics).
def _layer_norm_part_moments(
    input: npt.ArrayLike, normalized_shape: _Shape, *, axis: _Axis = None
) -> Tuple[_F64, _F64, _F64]:
    """(mean, m2, scale) of each row's part: its mean and sum of squared deviations from it,
    in units of scale (a power of two, 1 but for parts of extreme magnitude)."""

def _layer_norm_part_normalize(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    mean: npt.ArrayLike,
    rstd: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    bias: Optional[npt.ArrayLike] = None,
    *,
    axis: _Axis = None,
    scale: Optional[npt.ArrayLike] = None,
    row_len: Optional[int] = None,
) -> _FloatArray: ...
def _rms_norm_part_moments(
    input: npt.ArrayLike, normalized_shape: _Shape, *, axis: _Axis = None
) -> Tuple[_F64, _F64]:
    """(m2, scale) of each row's part: the sum of its squares, in units of scale."""

def _rms_norm_part_normalize(
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    rstd: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    *,
    axis: _Axis = None,
    scale: Optional[npt.ArrayLike] = None,
    row_len: Optional[int] = None,
) -> _FloatArray: ...
def _layer_norm_part_grad_sums(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    mean: npt.ArrayLike,
    rstd: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    *,
    axis: _Axis = None,
) -> Tuple[_F64, _F64, _F64, _F64, _F64]:
    """(g_sum, g_xhat_sum, g_largest, dy_largest, xc_largest) of each row's part, g = grad_output * weight."""

def _layer_norm_part_grad_input(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    mean: npt.ArrayLike,
    rstd: npt.ArrayLike,
    g_mean: npt.ArrayLike,
    g_xhat_mean: npt.ArrayLike,
    g_largest: npt.ArrayLike,
    dy_largest: npt.ArrayLike,
    xc_largest: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    *,
    axis: _Axis = None,
) -> _FloatArray: ...
def _rms_norm_part_grad_sums(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    rstd: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    *,
    axis: _Axis = None,
) -> Tuple[_F64, _F64, _F64, _F64]:
    """(g_xhat_sum, g_largest, dy_largest, xc_largest) of each row's part."""

def _rms_norm_part_grad_input(
    grad_output: npt.ArrayLike,
    input: npt.ArrayLike,
    normalized_shape: _Shape,
    rstd: npt.ArrayLike,
    g_xhat_mean: npt.ArrayLike,
    g_largest: npt.ArrayLike,
    dy_largest: npt.ArrayLike,
    xc_largest: npt.ArrayLike,
    weight: Optional[npt.ArrayLike] = None,
    *,
    axis: _Axis = None,
) -> _FloatArray: ...
def set_num_threads(n: SupportsIndex, /) -> None: ...
def get_num_threads() -> int: ...
def set_result_cache(max_bytes: SupportsIndex, /) -> None: ...
def result_cache_info() -> _ResultCacheInfo: ...
def simd_level() -> _SimdLevel: ...
def available_simd_levels() -> Tuple[_SimdLevel, ...]: ...
def set_simd_level(name: _SimdLevel, /) -> None: ...
