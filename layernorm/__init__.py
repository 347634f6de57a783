"""LayerNorm and RMSNorm for NumPy arrays, mirroring torch.nn's (a C extension, no torch needed).

>>> import numpy as np, layernorm
>>> layernorm.LayerNorm(4)(np.arange(8, dtype=np.float32).reshape(2, 4)).round(4)
array([[-1.3416, -0.4472,  0.4472,  1.3416],
       [-1.3416, -0.4472,  0.4472,  1.3416]], dtype=float32)
"""

from ._layernorm import (
    available_simd_levels,
    get_num_threads,
    result_cache_info,
    set_num_threads,
    set_result_cache,
    set_simd_level,
    simd_level,
)
from .functional import (
    add_layer_norm,
    add_rms_norm,
    layer_norm,
    layer_norm_backward,
    native_layer_norm,
    native_rms_norm,
    rms_norm,
    rms_norm_backward,
)
from .modules import LayerNorm, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "add_layer_norm",
    "add_rms_norm",
    "available_simd_levels",
    "get_num_threads",
    "layer_norm",
    "layer_norm_backward",
    "native_layer_norm",
    "native_rms_norm",
    "result_cache_info",
    "rms_norm",
    "rms_norm_backward",
    "set_num_threads",
    "set_result_cache",
    "set_simd_level",
    "simd_level",
]
