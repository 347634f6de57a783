"""layer_norm_backward on every memory layout the forward accepts (issue 3: "any memory layout
of grad_output and input"), for every argument, with the inputs left untouched.

The expected values are the same call on C-contiguous copies (bit for bit: the kernel sees the
same numbers), which tests/test_backward.py checks against torch and a float64 formula.
"""

import numpy as np
import pytest

import layernorm
from conftest import ARRAY_LAYOUTS, FLOAT_DTYPES, LAYOUTS, dtype_id, layout, make_input, make_params, param_dtype

SHAPE, NS = (6, 4, 17), (17,)
# Which arguments get the layout: the two big arrays, the statistics, the parameters.
TARGETS = ("input", "grad_output", "both", "mean_rstd", "weight_bias")


def case(dtype):
    x = make_input(SHAPE, dtype, seed=1)
    dy = make_input(SHAPE, dtype, seed=2)
    w, b = make_params(NS, param_dtype(dtype), "weight+bias", seed=3)
    _, mean, rstd = layernorm.native_layer_norm(x, NS, w, b, 1e-5)
    return {"grad_output": dy, "input": x, "mean": mean, "rstd": rstd, "weight": w, "bias": b}


def backward(a):
    return layernorm.layer_norm_backward(a["grad_output"], a["input"], NS, a["mean"], a["rstd"],
                                         a["weight"], a["bias"])


def laid_out(args, layout_name, target):
    names = {"both": ("input", "grad_output"), "mean_rstd": ("mean", "rstd"),
             "weight_bias": ("weight", "bias")}.get(target, (target,))
    return {k: layout(layout_name, v) if k in names else v for k, v in args.items()}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout_name", [k for k in LAYOUTS if k != "list"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_layout_gives_same_bits(dtype, layout_name, target):
    args = case(dtype)
    expected = backward(args)
    got = backward(laid_out(args, layout_name, target))
    for name, g, e in zip(("grad_input", "grad_weight", "grad_bias"), got, expected):
        assert isinstance(g, np.ndarray) and g.flags.c_contiguous, name
        assert g.dtype == e.dtype and g.shape == e.shape, name
        np.testing.assert_array_equal(g, e, err_msg=name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_list_input_is_float64_data(dtype):
    # A list of Python floats is float64 data, as in the forward.
    args = case(dtype)
    lists = {k: (v.tolist() if k in ("input", "grad_output") else v) for k, v in args.items()}
    got = backward(lists)
    as64 = dict(args, input=args["input"].astype(np.float64),
                grad_output=args["grad_output"].astype(np.float64))
    for g, e in zip(got, backward(as64)):
        np.testing.assert_array_equal(g, e)
    assert got[0].dtype == np.float64


@pytest.mark.parametrize("layout_name", ARRAY_LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_does_not_mutate_any_argument(dtype, layout_name):
    args = {k: layout(layout_name, v) for k, v in case(dtype).items()}
    snapshots = {k: (v.copy(), v.strides, v.dtype, v.flags.writeable) for k, v in args.items()}
    backward(args)
    layernorm.layer_norm_backward(args["grad_output"], args["input"], NS, args["mean"],
                                  args["rstd"], None, None, (True, False, False))
    for k, v in args.items():
        copy, strides, dt, writeable = snapshots[k]
        assert v.strides == strides and v.dtype == dt and v.flags.writeable == writeable, k
        np.testing.assert_array_equal(v, copy, err_msg=k)
