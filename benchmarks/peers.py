"""What ours is compared with: torch when installed, the NumPy formula, and a plain copy of the
same bytes, the memory floor.

Each peer is a function of the case that returns its Timed call, or None when the peer is not
installed or cannot run the case; a report column of a peer that returned None says n/a.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from .cases import EPS
from .timing import Timed

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # torch is optional: without it ours is checked against the float64 reference
    torch = None


def torch_version():
    """torch's version, or None when torch is not installed."""
    return torch.__version__ if torch else None


def torch_no_grad():
    """torch.no_grad() when torch is installed: no call records anything for autograd."""
    return torch.no_grad() if torch else contextlib.nullcontext()


def as_torch(array, dtype):
    """The tensor of `array` converted to `dtype`; a bfloat16 one (ml_dtypes') bit for bit, as
    torch.from_numpy does not know that dtype."""
    array = np.ascontiguousarray(array, dtype=dtype)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def values_of(tensor):
    """A torch result as a NumPy array of the same values (bfloat16 widened to float32, exactly)."""
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def torch_forward(case, data):
    """torch.nn.functional.layer_norm on torch.from_numpy(x), weight/bias in x's dtype."""
    if not torch:
        return None
    x = data.x
    args = (as_torch(x, x.dtype), (case.cols,), as_torch(data.weight, x.dtype), as_torch(data.bias, x.dtype), EPS)
    return Timed(F.layer_norm, args, set_num_threads=torch.set_num_threads)


def torch_backward(case, data):
    """aten.native_layer_norm_backward fed the mean and rstd of torch's own forward pass."""
    if not torch:
        return None
    x_t = as_torch(data.x, data.x.dtype)
    weight_t = as_torch(data.weight, data.x.dtype)
    bias_t = as_torch(data.bias, data.x.dtype)
    shape = [case.cols]
    _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(x_t, shape, weight_t, bias_t, EPS)
    args = (as_torch(data.grad_output, data.x.dtype), x_t, shape, mean_t, rstd_t, weight_t, bias_t, [True, True, True])
    timed = Timed(torch.ops.aten.native_layer_norm_backward, args, set_num_threads=torch.set_num_threads)
    try:
        timed.run()
    except RuntimeError as error:
        print(f"  torch backward unsupported for {case.label}: {error}", file=sys.stderr)
        return None
    return timed


def numpy_layer_norm(x, weight, bias, eps):
    """The textbook formula in x's own dtype (no float64 upcast)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def numpy_forward(data):
    """numpy_layer_norm with weight and bias in x's dtype."""
    x = data.x
    return Timed(numpy_layer_norm, (x, data.weight.astype(x.dtype), data.bias.astype(x.dtype), EPS))


def copy(array):
    """np.copyto of the array into another one of its size: the memory-bandwidth floor."""
    return Timed(np.copyto, (np.empty_like(array), array))
