"""What ours is compared with: torch when installed, ONNX Runtime and JAX when installed (the
`bench` extra), the NumPy formula, and a plain copy of the same bytes, the memory floor.

Each peer is a function of the case that returns its Timed call, or None when the peer is not
installed or cannot run the case; a report column of a peer that returned None says n/a.
"""

from __future__ import annotations

import concurrent.futures
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


class OrtNormalization:
    """One ONNX normalization node (LayerNormalization, opset 17; RMSNormalization, opset 23)
    over the last axis of x, run by ONNX Runtime on NumPy arrays: inputs X and its parameters
    (Scale, and B for LayerNormalization) in x's dtype.  A session per thread count (ORT fixes a
    session's pool when it creates it), chosen by set_num_threads."""

    OPS = {"LayerNormalization": (17, ["X", "Scale", "B"]), "RMSNormalization": (23, ["X", "Scale"])}

    def __init__(self, op_type, x, eps):
        import onnx
        from onnx import TensorProto, helper

        opset, names = self.OPS[op_type]
        elem = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT,
                np.dtype(np.float64): TensorProto.DOUBLE}[x.dtype]
        shapes = [list(x.shape)] + [[x.shape[-1]]] * (len(names) - 1)
        node = helper.make_node(op_type, names, ["Y"], axis=-1, epsilon=eps)
        graph = helper.make_graph(
            [node], op_type,
            [helper.make_tensor_value_info(name, elem, shape) for name, shape in zip(names, shapes)],
            [helper.make_tensor_value_info("Y", elem, list(x.shape))])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        onnx.checker.check_model(model)
        self.model_bytes = model.SerializeToString()
        self.input_names = names
        self.sessions = {}
        self.session = None

    def set_num_threads(self, threads):
        if threads not in self.sessions:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            self.sessions[threads] = onnxruntime.InferenceSession(
                self.model_bytes, options, providers=["CPUExecutionProvider"])
        self.session = self.sessions[threads]

    def __call__(self, *arrays):
        return self.session.run(None, dict(zip(self.input_names, arrays)))[0]


def ort_timed(op_type, label, x, *params):
    """The Timed call of ONNX Runtime's op_type on x and params (cast to x's dtype), checked to
    run; None without onnxruntime, or for a dtype its CPU kernels lack (bfloat16: its Python API
    takes no ml_dtypes arrays)."""
    if x.dtype.name == "bfloat16":
        return None
    try:
        node = OrtNormalization(op_type, x, EPS)
        timed = Timed(node, (x, *(param.astype(x.dtype) for param in params)), set_num_threads=node.set_num_threads)
        timed.run()
    except ImportError:
        return None
    except Exception as error:  # a type or shape ORT's CPU kernels do not take
        print(f"  onnxruntime cannot run {label}: {type(error).__name__}", file=sys.stderr)
        return None
    return timed


def ort_forward(case, data):
    """ONNX Runtime's LayerNormalization, weight/bias in x's dtype (None: see ort_timed)."""
    return ort_timed("LayerNormalization", case.label, data.x, data.weight, data.bias)


def jax_forward(case, data):
    """A jitted JAX layer norm in x's dtype (flax.linen.LayerNorm's formula), called on the NumPy
    arrays and its result brought back as one, as a NumPy user would; None without jax.  XLA's
    CPU pool is sized once per process, so the call counts as unthreaded: one time for all."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    jax.config.update("jax_enable_x64", True)  # float64 cases stay float64

    @jax.jit
    def layer_norm(x, weight, bias):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        centred = x - mean
        var = jnp.mean(centred * centred, axis=-1, keepdims=True)
        return centred * jax.lax.rsqrt(var + EPS) * weight + bias

    def call(x, weight, bias):
        return np.asarray(layer_norm(x, weight, bias))

    x = data.x
    timed = Timed(call, (x, data.weight.astype(x.dtype), data.bias.astype(x.dtype)))
    timed.run()  # compile
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


# The copy's thread count, and the workers that copy the parts past the first (with their count).
_copy_threads = 1
_copy_workers = None
_copy_worker_count = 0


def set_copy_threads(threads):
    """The thread count of copyto_in_parts, as set_num_threads sets ours."""
    global _copy_threads
    _copy_threads = threads


def copyto_in_parts(destination, source):
    """np.copyto(destination, source), both C-contiguous, cut into one contiguous part per thread
    of set_copy_threads, copied at once (np.copyto lets go of the GIL while it copies)."""
    global _copy_workers, _copy_worker_count
    if _copy_threads == 1:
        np.copyto(destination, source)
        return
    if _copy_worker_count < _copy_threads - 1:
        if _copy_workers is not None:
            _copy_workers.shutdown()
        _copy_workers = concurrent.futures.ThreadPoolExecutor(_copy_threads - 1)
        _copy_worker_count = _copy_threads - 1
    parts = zip(np.array_split(destination.reshape(-1), _copy_threads),
                np.array_split(source.reshape(-1), _copy_threads))
    first = next(parts)
    pending = [_copy_workers.submit(np.copyto, *part) for part in parts]
    np.copyto(*first)
    for part in pending:
        part.result()


def copy(array):
    """The memory-bandwidth floor: a copy of the array into another one of its size, at each
    thread count as ours (cut into a part per thread: copyto_in_parts).  A table of n threads
    takes the fastest copy of at most n threads (floor_times), as cutting a small array costs
    more than it saves."""
    return Timed(copyto_in_parts, (np.empty_like(array), array), set_num_threads=set_copy_threads)


def floor_thread_counts(name, thread_counts):
    """The thread counts to time call `name` at: the floor's at 1 thread too, which floor_times
    needs (a small copy is fastest on one thread: handing half of it to another costs more)."""
    return sorted(set(thread_counts) | {1}) if name == "copy" else thread_counts


def floor_times(times, name="copy"):
    """times ({(name, threads): seconds}) with each thread count's `name` time made the fastest
    of those at that count or fewer."""
    counts = sorted(threads for peer, threads in times if peer == name and threads is not None)
    floors = dict(times)
    for threads in counts:
        floors[name, threads] = min(times[name, fewer] for fewer in counts if fewer <= threads)
    return floors
