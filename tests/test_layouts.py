"""Memory layouts and array types: every layout of every argument gives the bits of the
C-contiguous call, forward and backward, and arrays of other libraries (torch tensors) and
array-likes are read as NumPy reads them.

The expected values are the same call on C-contiguous copies (bit for bit: the kernel sees the
same numbers), which test_forward_values.py and test_backward_values.py check against
layernorm._reference and torch.
"""

import numpy as np
import pytest

import layernorm
from helpers import (
    FLOAT_DTYPES,
    GRAD_REFERENCE_RTOL,
    LAYOUTS,
    STRIDED_LAYOUTS,
    assert_close,
    assert_matches_reference,
    assert_matches_torch,
    backward_args,
    call_backward,
    check_output_array,
    dtype_id,
    layout,
    make_backward_data,
    make_input,
    make_params,
    param_dtype,
    reference_backward,
    requires_torch,
    same_bits,
    shape_id,
    torch,
    torch_layer_norm,
    torch_scale,
)

# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------

LAYOUT_SHAPES = [((6, 17), (17,)), ((3, 4, 5), (4, 5)), ((9,), (9,))]


def laid_out_input(dtype, layout_name, shape, ns):
    """(C-contiguous input, its layout, the dtype its values have, weight, bias)."""
    base = make_input(shape, dtype, seed=3)
    x = layout(layout_name, base)
    # A list of Python floats is float64 data, whatever it was made from.
    eff_dtype = np.float64 if layout_name == "list" else dtype
    weight, bias = make_params(ns, param_dtype(eff_dtype), "weight+bias")
    return base, x, eff_dtype, weight, bias


LAYOUT_SHAPE_IDS = [f"in{shape_id(s)}-ns{shape_id(n)}" for s, n in LAYOUT_SHAPES]


@pytest.mark.parametrize("shape,ns", LAYOUT_SHAPES, ids=LAYOUT_SHAPE_IDS)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_layout(dtype, layout_name, shape, ns):
    base, x, eff_dtype, weight, bias = laid_out_input(dtype, layout_name, shape, ns)
    out = layernorm.layer_norm(x, ns, weight, bias)
    check_output_array(out, x, eff_dtype)
    # The values do not depend on the layout: same bits as the C-contiguous input.
    np.testing.assert_array_equal(out, layernorm.layer_norm(base.astype(eff_dtype), ns, weight, bias))
    assert_matches_reference(out, base, ns, weight, bias)


@requires_torch
@pytest.mark.parametrize("shape,ns", LAYOUT_SHAPES, ids=LAYOUT_SHAPE_IDS)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_layout_matches_torch(dtype, layout_name, shape, ns):
    base, x, eff_dtype, weight, bias = laid_out_input(dtype, layout_name, shape, ns)
    out = layernorm.layer_norm(x, ns, weight, bias)
    expected = torch_layer_norm(base.astype(eff_dtype), ns, weight, bias)
    assert_matches_torch(out, expected, torch_scale(base.astype(eff_dtype), ns, weight, bias))


@pytest.mark.parametrize("layout_name", ["fortran", "transposed", "negative_strides", "byte_swapped", "column_slice"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_layout_native_stats(dtype, layout_name):
    base = make_input((5, 3, 8), dtype, seed=4)
    x = layout(layout_name, base)
    got = layernorm.native_layer_norm(x, (8,), None, None, 1e-5)
    want = layernorm.native_layer_norm(base, (8,), None, None, 1e-5)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_non_contiguous_params(dtype):
    x = make_input((4, 6), dtype)
    cdt = param_dtype(dtype)
    wide = make_input((2, 12), cdt, seed=11)
    w, b = wide[0, ::2], wide[1, ::-2]
    np.testing.assert_array_equal(
        layernorm.layer_norm(x, (6,), w, b), layernorm.layer_norm(x, (6,), w.copy(), b.copy())
    )


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------

SHAPE, NS = (6, 4, 17), (17,)
# Which arguments get the layout: the two big arrays, the statistics, the parameters.
TARGETS = {"input": ("input",), "grad_output": ("grad_output",), "both": ("input", "grad_output"),
           "mean_rstd": ("mean", "rstd"), "weight_bias": ("weight", "bias")}


def laid_out(args, layout_name, target):
    """`args` with the arguments `target` names laid out as `layout_name`."""
    return args._replace(**{name: layout(layout_name, getattr(args, name)) for name in TARGETS[target]})


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("layout_name", [k for k in LAYOUTS if k != "list"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_layout_gives_same_bits(dtype, layout_name, target):
    args = backward_args(SHAPE, dtype, seed=1)
    expected = call_backward(args, NS)
    got = call_backward(laid_out(args, layout_name, target), NS)
    for name, g, e in zip(("grad_input", "grad_weight", "grad_bias"), got, expected):
        assert isinstance(g, np.ndarray) and g.flags.c_contiguous, name
        assert g.dtype == e.dtype and g.shape == e.shape, name
        np.testing.assert_array_equal(g, e, err_msg=name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_backward_list_input_is_float64_data(dtype):
    # A list of Python floats is float64 data, as in the forward.
    args = backward_args(SHAPE, dtype, seed=1)
    got = call_backward(args._replace(input=args.input.tolist(), grad_output=args.grad_output.tolist()), NS)
    as64 = args._replace(input=args.input.astype(np.float64), grad_output=args.grad_output.astype(np.float64))
    for g, e in zip(got, call_backward(as64, NS)):
        np.testing.assert_array_equal(g, e)
    assert got[0].dtype == np.float64


STRIDED_PAIRS = [(g, i) for g in STRIDED_LAYOUTS + ("C",) for i in STRIDED_LAYOUTS + ("C",)
                 if (g, i) != ("C", "C")]


@pytest.mark.parametrize("go_layout, x_layout", STRIDED_PAIRS,
                         ids=[f"grad_{g}-input_{i}" for g, i in STRIDED_PAIRS])
def test_backward_strided_grad_output_and_input(go_layout, x_layout):
    x, dy, w, b = make_backward_data((8, 16), (16,), np.float32, "weight+bias", seed=12)
    _, mean, rstd = layernorm.native_layer_norm(x, (16,), w, b, 1e-5)
    expected = layernorm.layer_norm_backward(dy, x, (16,), mean, rstd, w, b)
    dy_laid, x_laid = layout(go_layout, dy), layout(x_layout, x)
    assert dy_laid.flags.c_contiguous == (go_layout == "C")
    assert x_laid.flags.c_contiguous == (x_layout == "C")
    got = layernorm.layer_norm_backward(dy_laid, x_laid, (16,), mean, rstd, w, b)
    truth = reference_backward(dy, x, (16,), w, b)
    # rows whose elements are adjacent take the contiguous route, whose bits the layout does not
    # change; others the strided route, which may differ from it in the last bit
    adjacent = dy_laid.strides[-1] == x_laid.strides[-1] == x.itemsize
    for name, mine, same, ref in zip(("grad_input", "grad_weight", "grad_bias"), got, expected, truth):
        assert mine.flags.c_contiguous, name
        if adjacent:
            assert same_bits(mine, same), name
        else:
            np.testing.assert_allclose(mine, same, rtol=1e-6, atol=1e-6, err_msg=name)
        assert_close(mine, ref, GRAD_REFERENCE_RTOL[np.dtype(np.float32)], name)


# ---------------------------------------------------------------------------
# Array types: torch tensors, lists, objects with __array__
# ---------------------------------------------------------------------------


@requires_torch
def test_torch_tensor_input_gives_ndarray():
    t = torch.randn(4, 6, dtype=torch.float32)
    out = layernorm.layer_norm(t, (6,))
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert_matches_reference(out, t.numpy(), (6,))


@requires_torch
def test_torch_tensor_with_negative_bit_set():
    # a lazy negation (the imaginary part of a conjugate view): torch's .numpy() refuses it
    t = torch.randn(4, 6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)).conj().imag
    assert t.is_neg()
    out = layernorm.layer_norm(t, (6,))
    assert_matches_reference(out, t.resolve_neg().numpy(), (6,))


@requires_torch
def test_non_contiguous_torch_tensor_input():
    t = torch.randn(6, 4, dtype=torch.float64).t()  # (4, 6), strides (1, 4)
    out = layernorm.layer_norm(t, (6,))
    assert out.shape == (4, 6)
    np.testing.assert_allclose(out, torch.nn.functional.layer_norm(t, (6,)).numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_param_list(dtype):
    x = make_input((4, 5), dtype)
    w, b = make_params((5,), param_dtype(dtype), "weight+bias")
    got = layernorm.layer_norm(x, (5,), w.tolist(), b)
    np.testing.assert_array_equal(got, layernorm.layer_norm(x, (5,), w.astype(param_dtype(dtype)), b))


@requires_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_param_tensor(dtype):
    x = make_input((4, 5), dtype)
    w, b = make_params((5,), param_dtype(dtype), "weight+bias")
    got = layernorm.layer_norm(x, (5,), w, torch.from_numpy(b))
    np.testing.assert_array_equal(got, layernorm.layer_norm(x, (5,), w, b))


@requires_torch
@pytest.mark.parametrize("entry", ["layer_norm", "LayerNorm", "layer_norm_backward"])
def test_torch_tensor_that_requires_grad_is_read_detached(entry):
    # A tensor that requires grad refuses tensor.numpy(); torch users pass them all the time.
    x = torch.randn(3, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    expected = torch.nn.functional.layer_norm(x, (5,))
    if entry == "layer_norm":
        got = layernorm.layer_norm(x, (5,))
        np.testing.assert_allclose(got, expected.detach().numpy(), rtol=0, atol=1e-6)
    elif entry == "LayerNorm":
        got = layernorm.LayerNorm(5)(x)
        np.testing.assert_allclose(got, expected.detach().numpy(), rtol=0, atol=1e-6)
    else:
        dy = torch.ones(3, 5, requires_grad=True) * torch.arange(5.0)
        (expected * dy.detach()).sum().backward()
        _, mean, rstd = layernorm.native_layer_norm(x, (5,))
        grad_input, _, _ = layernorm.layer_norm_backward(dy, x, (5,), mean, rstd)
        np.testing.assert_allclose(grad_input, x.grad.numpy(), rtol=0, atol=1e-5)
    assert x.requires_grad and x.grad_fn is None  # the caller's tensor is untouched


class ArrayThatRaises:
    """Array-like whose conversion fails with `error`; it also looks like a tensor (has
    requires_grad and detach), but only torch's own tensors are read detached."""

    requires_grad = True

    def __init__(self, error):
        self.error = error
        self.detached = False

    def __array__(self, dtype=None, copy=None):
        raise self.error

    def detach(self):
        self.detached = True
        return np.ones((2, 3), np.float32)


@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError, ValueError, RuntimeError],
                         ids=["KeyboardInterrupt", "MemoryError", "ValueError", "RuntimeError"])
def test_conversion_errors_of_other_objects_stand(error):
    # A Ctrl-C, an out-of-memory or any other error while converting an object that is not a
    # torch tensor reaches the caller as it was raised, and nothing is detached.
    obj = ArrayThatRaises(error("from __array__"))
    with pytest.raises(error, match="from __array__"):
        layernorm.layer_norm(obj, 3)
    assert not obj.detached
