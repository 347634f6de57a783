"""Every error: its exception type (spec: ValueError for shapes/values, TypeError for types)
and, where torch has a message for the same mistake, torch's exact text inside ours.

torch's text is obtained by calling torch on the same mistake, never typed in.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import layernorm
from conftest import torch_message


def _native(x, ns, w=None, b=None, eps=1e-5):
    return layernorm.native_layer_norm(x, ns, w, b, eps)


def _functional(x, ns, w=None, b=None, eps=1e-5):
    return layernorm.layer_norm(x, ns, w, b, eps)


ENTRY_POINTS = {"layer_norm": _functional, "native_layer_norm": _native}


# ---------------------------------------------------------------------------
# Shapes: the (normalized_shape, input shape) pairs from torch's own tests that must raise
# ---------------------------------------------------------------------------

BAD_SHAPE_PAIRS = [
    ((), ()),
    ((2, 3), (3,)),
    ((2,), (1, 2, 3)),
    ((10,), (2, 3)),
    (10, (2, 3)),  # an int normalized_shape (torch's functional form needs (10,))
    ((2, 2), (2, 2, 3)),  # the spec's example
    ((3,), ()),  # a 0-d input has no trailing dims at all
    ((2, 3, 4), (3, 4)),  # more normalized dims than input dims
]


def _pair_id(pair):
    ns, shape = pair
    return f"ns{ns!r}-in{shape!r}".replace(" ", "")


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("pair", BAD_SHAPE_PAIRS, ids=_pair_id)
def test_bad_shape_pairs_raise_torch_text(pair, entry):
    ns, shape = pair
    ns_tuple = (ns,) if isinstance(ns, int) else ns
    x = np.ones(shape, np.float32)
    expected = torch_message(lambda: torch.native_layer_norm(torch.from_numpy(x), list(ns_tuple), None, None, 1e-5))
    with pytest.raises(ValueError) as info:
        ENTRY_POINTS[entry](x, ns)
    assert expected in str(info.value)


@pytest.mark.parametrize("ns", [(), []], ids=["tuple", "list"])
def test_empty_normalized_shape_nonempty_input(ns):
    x = np.ones((2, 3), np.float64)
    expected = torch_message(lambda: F.layer_norm(torch.from_numpy(x), list(ns)))
    assert "at least 1-dimensional" in expected
    with pytest.raises(ValueError) as info:
        layernorm.layer_norm(x, ns)
    assert expected in str(info.value)


# (which param, input shape, normalized_shape, param shape)
BAD_PARAM_SHAPES = [
    ("weight", (1, 2, 3), (1, 2, 3), (1, 2)),
    ("bias", (1, 2, 3), (1, 2, 3), (1, 2)),
    ("weight", (4, 3), (3,), (2,)),
    ("bias", (4, 3), (3,), (4,)),
    ("weight", (2, 2, 3), (2, 3), (6,)),  # right size, wrong shape
    ("bias", (2, 2, 3), (2, 3), (3, 2)),
    ("weight", (4, 3), (3,), (3, 1)),
    ("bias", (4, 3), (3,), ()),  # a 0-d param is not broadcast
]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    "which,shape,ns,pshape",
    BAD_PARAM_SHAPES,
    ids=[f"{w}{p!r}-ns{n!r}".replace(" ", "") for w, _, n, p in BAD_PARAM_SHAPES],
)
def test_param_shape_raises_torch_text(which, shape, ns, pshape, entry):
    x = np.ones(shape, np.float32)
    p = np.ones(pshape, np.float32)
    kw = {which: p}
    expected = torch_message(
        lambda: F.layer_norm(torch.from_numpy(x), ns, **{k: torch.from_numpy(v) for k, v in kw.items()})
    )
    with pytest.raises(ValueError) as info:
        ENTRY_POINTS[entry](x, ns, kw.get("weight"), kw.get("bias"))
    assert expected in str(info.value)


# ---------------------------------------------------------------------------
# Input dtypes
# ---------------------------------------------------------------------------

TORCH_OF = {
    np.int64: torch.int64,
    np.int32: torch.int32,
    np.int16: torch.int16,
    np.int8: torch.int8,
    np.uint8: torch.uint8,
    np.uint16: torch.uint16,
    np.uint32: torch.uint32,
    np.uint64: torch.uint64,
    np.bool_: torch.bool,
    np.complex64: torch.complex64,
    np.complex128: torch.complex128,
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("np_dtype", list(TORCH_OF), ids=lambda d: np.dtype(d).name)
def test_int_bool_complex_input_raise_torch_text(np_dtype, entry):
    x = np.ones((2, 3), np_dtype)
    expected = torch_message(lambda: F.layer_norm(torch.ones((2, 3), dtype=TORCH_OF[np_dtype]), (3,)))
    assert "LayerNormKernelImpl" in expected
    with pytest.raises(TypeError) as info:
        ENTRY_POINTS[entry](x, (3,))
    msg = str(info.value)
    assert expected in msg
    assert np.dtype(np_dtype).name in msg  # names the numpy dtype
    assert "astype" in msg  # and the fix


def test_int_list_input_is_long():
    # A list of Python ints is int64 data (torch.tensor makes it Long): the same message.
    expected = torch_message(lambda: F.layer_norm(torch.tensor([[1, 2, 3]]), (3,)))
    with pytest.raises(TypeError) as info:
        layernorm.layer_norm([[1, 2, 3]], (3,))
    assert expected in str(info.value)


OTHER_INPUTS = {
    "str": np.array([["a", "b", "c"]]),
    "bytes": np.array([[b"a", b"b", b"c"]]),
    "object": np.array([[1.0, "b", None]], dtype=object),
    "object-floats": np.array([[1.0, 2.0, 3.0]], dtype=object),
    "datetime64": np.array([["2020-01-01"] * 3], dtype="datetime64[D]"),
    "timedelta64": np.array([[1, 2, 3]], dtype="timedelta64[s]"),
    "void": np.zeros((1, 3), dtype="V4"),
    "structured": np.zeros((1, 3), dtype=[("a", "f4")]),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("kind", list(OTHER_INPUTS))
def test_other_dtypes_raise_type_error(kind, entry):
    x = OTHER_INPUTS[kind]
    with pytest.raises(TypeError) as info:
        ENTRY_POINTS[entry](x, (3,))
    msg = str(info.value)
    assert str(x.dtype) in msg or x.dtype.name in msg, msg  # names the dtype
    assert "astype" in msg, msg  # and the fix


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_ragged_list_input_raises(entry):
    with pytest.raises((TypeError, ValueError)):
        ENTRY_POINTS[entry]([[1.0, 2.0], [3.0]], (2,))


# ---------------------------------------------------------------------------
# normalized_shape values and types
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("ns", [(-3,), (2, -1), -3], ids=["(-3,)", "(2,-1)", "int-3"])
def test_negative_size_raises_value_error(ns, entry):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError) as info:
        ENTRY_POINTS[entry](x, ns)
    assert "normalized_shape" in str(info.value)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize(
    "ns",
    [2.5, (2.5,), "a", ("a",), (3.0,), None, (3, None), object()],
    ids=["2.5", "(2.5,)", "'a'", "('a',)", "(3.0,)", "None", "(3,None)", "object"],
)
def test_non_integer_size_raises_type_error(ns, entry):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError):
        ENTRY_POINTS[entry](x, ns)


# ---------------------------------------------------------------------------
# eps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("eps", ["1e-5", None, 1j, b"1", [1e-5]], ids=["str", "None", "complex", "bytes", "list"])
def test_eps_not_real_raises_type_error(eps, entry):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError):
        ENTRY_POINTS[entry](x, (3,), None, None, eps)


def test_eps_keyword_not_real_raises_type_error():
    with pytest.raises(TypeError):
        layernorm.layer_norm(np.ones((2, 3)), (3,), eps="small")


# ---------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------


def _ro(a):
    a.flags.writeable = False
    return a


BAD_OUTS = {
    "wrong-shape": (lambda: np.empty((5, 3), np.float32), ValueError),
    "wrong-shape-same-size": (lambda: np.empty((3, 4), np.float32), ValueError),
    "wrong-ndim": (lambda: np.empty((12,), np.float32), ValueError),
    "wrong-dtype-f64": (lambda: np.empty((4, 3), np.float64), None),
    "wrong-dtype-f16": (lambda: np.empty((4, 3), np.float16), None),
    "wrong-dtype-int": (lambda: np.empty((4, 3), np.int32), None),
    "byte-swapped": (lambda: np.empty((4, 3), np.dtype(np.float32).newbyteorder("S")), None),
    "fortran": (lambda: np.empty((4, 3), np.float32, order="F"), ValueError),
    "strided": (lambda: np.empty((4, 6), np.float32)[:, ::2], ValueError),
    "read-only": (lambda: _ro(np.empty((4, 3), np.float32)), ValueError),
    "list": (lambda: [[0.0] * 3] * 4, TypeError),
    "torch-tensor": (lambda: torch.empty(4, 3), TypeError),
    "tuple": (lambda: (1, 2), TypeError),
}


@pytest.mark.parametrize("kind", list(BAD_OUTS))
def test_bad_out_raises(kind):
    make, exc = BAD_OUTS[kind]
    x = np.ones((4, 3), np.float32)
    x[:, 0] = 0.0
    out = make()
    with pytest.raises(exc or (TypeError, ValueError)) as info:
        layernorm.layer_norm(x, (3,), out=out)
    assert "out" in str(info.value)
    # Nothing was written into a rejected ndarray out.
    if isinstance(out, np.ndarray) and out.flags.writeable:
        marker = np.full(out.shape, 7, out.dtype)
        out[...] = marker
        with pytest.raises(exc or (TypeError, ValueError)):
            layernorm.layer_norm(x, (3,), out=out)
        np.testing.assert_array_equal(out, marker)


def test_out_shape_error_for_wrong_batch():
    x = np.ones((2, 3, 4), np.float64)
    with pytest.raises(ValueError):
        layernorm.layer_norm(x, (4,), out=np.empty((3, 2, 4)))


# ---------------------------------------------------------------------------
# Calling convention
# ---------------------------------------------------------------------------


def test_unknown_keyword_layer_norm():
    with pytest.raises(TypeError) as info:
        layernorm.layer_norm(np.ones((2, 3)), (3,), epsilon=1e-5)
    assert "epsilon" in str(info.value)


def test_unknown_keyword_native_layer_norm():
    with pytest.raises(TypeError) as info:
        layernorm.native_layer_norm(np.ones((2, 3)), (3,), None, None, 1e-5, out=None)
    assert "out" in str(info.value)


def test_too_many_positional_layer_norm():
    # out is keyword-only: a sixth positional argument is an error.
    with pytest.raises(TypeError):
        layernorm.layer_norm(np.ones((2, 3)), (3,), None, None, 1e-5, np.empty((2, 3)))


def test_too_many_positional_native_layer_norm():
    with pytest.raises(TypeError):
        layernorm.native_layer_norm(np.ones((2, 3)), (3,), None, None, 1e-5, None)


def test_missing_arguments_layer_norm():
    with pytest.raises(TypeError):
        layernorm.layer_norm(np.ones((2, 3)))
    with pytest.raises(TypeError):
        layernorm.layer_norm()


def test_missing_arguments_native_layer_norm():
    with pytest.raises(TypeError):
        layernorm.native_layer_norm(np.ones((2, 3)))
    with pytest.raises(TypeError):
        layernorm.native_layer_norm()


def test_argument_given_twice():
    with pytest.raises(TypeError):
        layernorm.layer_norm(np.ones((2, 3)), (3,), None, weight=np.ones(3))


# ---------------------------------------------------------------------------
# Runtime controls
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1, -100])
def test_set_num_threads_below_one(n, restore_runtime):
    before = layernorm.get_num_threads()
    with pytest.raises(ValueError):
        layernorm.set_num_threads(n)
    assert layernorm.get_num_threads() == before


@pytest.mark.parametrize("n", ["2", None, 2.5])
def test_set_num_threads_not_int(n, restore_runtime):
    with pytest.raises(TypeError):
        layernorm.set_num_threads(n)


@pytest.mark.parametrize("name", ["", "sse4", "AVX2x", "sve", "fast"])
def test_set_simd_level_unknown(name, restore_runtime):
    before = layernorm.simd_level()
    with pytest.raises(ValueError):
        layernorm.set_simd_level(name)
    assert layernorm.simd_level() == before


# ---------------------------------------------------------------------------
# weight / bias dtypes: float dtypes are converted, anything else is a TypeError naming it
# ---------------------------------------------------------------------------

BAD_PARAMS = {
    "int64": np.arange(3, dtype=np.int64),
    "bool": np.ones(3, np.bool_),
    "complex128": np.ones(3, np.complex128),
    "str": np.array(["a", "b", "c"]),
    "object": np.array([1.0, None, 2.0], dtype=object),
}


@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("kind", list(BAD_PARAMS))
def test_non_float_param_raises_type_error(kind, entry, which):
    x = np.ones((2, 3), np.float32)
    param = BAD_PARAMS[kind]
    kw = {"w": param} if which == "weight" else {"b": param}
    with pytest.raises(TypeError) as info:
        ENTRY_POINTS[entry](x, (3,), **kw)
    msg = str(info.value)
    assert which in msg and str(param.dtype) in msg, msg  # names the parameter and its dtype
