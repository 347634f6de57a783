"""The public API as a user's typed code calls it.

.ci/typecheck.sh checks this file with ``mypy --strict`` (``assert_type`` pins what each call
returns, so a loosened annotation fails the check) and then runs it.
"""

from collections import OrderedDict
from typing import Any, List, Optional, Tuple

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type

import layernorm
from layernorm import (
    LayerNorm,
    RMSNorm,
    add_layer_norm,
    add_rms_norm,
    available_simd_levels,
    get_num_threads,
    layer_norm,
    layer_norm_backward,
    native_layer_norm,
    native_rms_norm,
    result_cache_info,
    rms_norm,
    rms_norm_backward,
    set_num_threads,
    set_result_cache,
    set_simd_level,
    simd_level,
)
from layernorm.testing import Diagnosis, assert_layer_norm_close, assert_rms_norm_close, diagnose

FloatArray = npt.NDArray[np.floating[Any]]


def functions(x: npt.NDArray[np.float32], weight: FloatArray, bias: FloatArray) -> None:
    y = layer_norm(x, 16, weight, bias, eps=1e-6)
    assert_type(y, FloatArray)
    assert_type(layer_norm(x.tolist(), (16,)), FloatArray)
    assert_type(layer_norm(x, [16], out=np.empty_like(x)), FloatArray)
    out, mean, rstd = native_layer_norm(x, (16,), weight, bias, 1e-5)
    assert_type(out, FloatArray)
    assert_type(mean, FloatArray)
    grads = layer_norm_backward(np.ones_like(x), x, (16,), mean, rstd, weight, bias, (True, True, False))
    assert_type(grads, Tuple[Optional[FloatArray], Optional[FloatArray], Optional[FloatArray]])
    grad_input, grad_weight, grad_bias = grads
    assert grad_input is not None and grad_weight is not None and grad_bias is None
    assert_layer_norm_close(y, x, 16, weight, bias, 1e-6)


def family(x: npt.NDArray[np.float32], weight: FloatArray, bias: FloatArray) -> None:
    assert_type(rms_norm(x, 16, weight), FloatArray)
    assert_type(rms_norm(x, 16, weight, eps=None, axis=-1, out=np.empty_like(x)), FloatArray)
    out, rstd = native_rms_norm(x, (16,), weight, 1e-6)
    assert_type(rstd, FloatArray)
    grads = rms_norm_backward(np.ones_like(x), x, 16, rstd, weight, (True, False))
    assert_type(grads, Tuple[Optional[FloatArray], Optional[FloatArray]])
    assert grads[0] is not None and grads[1] is None
    channels_first = np.ones((2, 16, 3, 3), np.float32)
    assert_type(layer_norm(channels_first, 16, weight, bias, axis=1), FloatArray)
    assert_type(native_layer_norm(channels_first, (16, 3), axis=(1, 3))[1], FloatArray)
    output, total = add_layer_norm(x, x, 16, weight, bias, axis=(-1,))
    assert_type(output, FloatArray)
    assert_type(total, FloatArray)
    output, total = add_rms_norm(x, np.ones_like(x), 16, weight, residual_out=np.empty_like(x))
    assert_type(total, FloatArray)
    rms = RMSNorm(16, eps=None, elementwise_affine=True, dtype=np.float32, axis=-1)
    assert_type(rms, RMSNorm)
    assert_type(rms(x), FloatArray)
    assert_type(rms.backward(np.ones_like(x)), FloatArray)
    assert_type(LayerNorm(16, axis=1)(channels_first), FloatArray)


def module(x: npt.NDArray[np.float32]) -> None:
    ln = LayerNorm((16,), eps=1e-6, elementwise_affine=True, bias=True, dtype=np.float32)
    assert_type(ln, LayerNorm)
    assert_type(ln.train(), LayerNorm)
    y = ln(x)
    assert_type(y, FloatArray)
    assert_type(ln.forward(x), FloatArray)
    grad_input = ln.backward(np.ones_like(x))
    assert_type(grad_input, FloatArray)
    assert_type(ln.weight_grad, Optional[FloatArray])
    ln.zero_grad(set_to_none=False)
    state = ln.state_dict()
    assert_type(state, OrderedDict[str, FloatArray])
    keys = LayerNorm(16).load_state_dict(state)
    assert_type(keys.missing_keys, List[str])
    assert_type(keys.unexpected_keys, List[str])
    assert not keys.missing_keys and not keys.unexpected_keys
    partial = LayerNorm(16).load_state_dict({"weight": [1.0] * 16}, strict=False)
    assert partial.missing_keys == ["bias"]
    try:  # a list of pairs is not a mapping: the type checker says so, and so does the call
        LayerNorm(16).load_state_dict([("weight", [1.0] * 16)])  # type: ignore[arg-type]
    except TypeError:
        pass
    else:
        raise AssertionError("load_state_dict took a list")
    for name, param in ln.named_parameters():
        assert_type(name, str)
        assert_type(param, FloatArray)
    assert len(ln.parameters()) == 2
    ln.reset_parameters()
    evaluated = ln.eval()
    assert_type(evaluated, LayerNorm)
    assert_type(evaluated(x), FloatArray)
    assert_type(ln.normalized_shape, Tuple[int, ...])
    assert_type(ln.training, bool)
    assert_type(repr(ln), str)
    assert_type(ln.extra_repr(), str)


def runtime() -> None:
    levels = available_simd_levels()
    set_simd_level(levels[0])
    level: str = simd_level()  # a Literal of the level names, which a build may extend
    assert level in levels
    threads = get_num_threads()
    assert_type(threads, int)
    set_num_threads(threads)
    cache = result_cache_info()
    limit: int = cache["max_bytes"]
    kept: int = cache["bytes"] + cache["blocks"]
    assert kept >= 0
    set_result_cache(limit)
    assert_type(layernorm.__version__, str)


def testing() -> None:
    report = diagnose(LayerNorm(16), 16)
    assert_type(report, Diagnosis)
    assert_type(report.ok, bool)
    assert_type(report.findings, Tuple[str, ...])
    rms = np.ones((2, 16), np.float32)
    expected = rms / np.sqrt(1.0 + 1.1920928955078125e-07)  # float64: NumPy promotes by the scalar
    assert_rms_norm_close(expected.astype(np.float32), rms, 16)
    assert_rms_norm_close(expected, rms, 16, check_dtype=False)


def main() -> None:
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    weight = np.linspace(0.5, 1.5, 16).astype(np.float32)
    bias = np.zeros(16, np.float32)
    functions(x, weight, bias)
    family(x, weight, bias)
    module(x)
    runtime()
    testing()


if __name__ == "__main__":
    main()
