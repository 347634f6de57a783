"""Every error of layer_norm, native_layer_norm, layer_norm_backward, the rest of the family (rms_norm,
native_rms_norm, rms_norm_backward, add_layer_norm, add_rms_norm, axis=) and the module's calls:
its exception type (ValueError for shapes and values, TypeError for types) and, where torch has
a message for the same mistake, torch's exact text inside ours.

torch's text is obtained by calling torch on the same mistake, never typed in: without torch,
the exception types are still checked, the texts are not.
"""

import numpy as np
import pytest

import layernorm
from helpers import F, requires_torch, torch, torch_dtype, torch_message


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
def test_bad_shape_pairs_raise_value_error(pair, entry):
    ns, shape = pair
    with pytest.raises(ValueError, match="normalized_shape"):
        ENTRY_POINTS[entry](np.ones(shape, np.float32), ns)


@requires_torch
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
def test_empty_normalized_shape_nonempty_input_raises_value_error(ns):
    with pytest.raises(ValueError, match="at least 1-dimensional"):
        layernorm.layer_norm(np.ones((2, 3), np.float64), ns)


@requires_torch
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


PARAM_SHAPE_IDS = [f"{w}{p!r}-ns{n!r}".replace(" ", "") for w, _, n, p in BAD_PARAM_SHAPES]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("which,shape,ns,pshape", BAD_PARAM_SHAPES, ids=PARAM_SHAPE_IDS)
def test_param_shape_raises_value_error(which, shape, ns, pshape, entry):
    kw = {which: np.ones(pshape, np.float32)}
    with pytest.raises(ValueError, match=which):
        ENTRY_POINTS[entry](np.ones(shape, np.float32), ns, kw.get("weight"), kw.get("bias"))


@requires_torch
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("which,shape,ns,pshape", BAD_PARAM_SHAPES, ids=PARAM_SHAPE_IDS)
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

# NumPy dtypes torch has a name for, with that torch dtype's name.
TORCH_OF = {
    np.int64: "int64",
    np.int32: "int32",
    np.int16: "int16",
    np.int8: "int8",
    np.uint8: "uint8",
    np.uint16: "uint16",
    np.uint32: "uint32",
    np.uint64: "uint64",
    np.bool_: "bool",
    np.complex64: "complex64",
    np.complex128: "complex128",
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("np_dtype", list(TORCH_OF), ids=lambda d: np.dtype(d).name)
def test_int_bool_complex_input_raise_type_error(np_dtype, entry):
    with pytest.raises(TypeError) as info:
        ENTRY_POINTS[entry](np.ones((2, 3), np_dtype), (3,))
    msg = str(info.value)
    assert np.dtype(np_dtype).name in msg  # names the numpy dtype
    assert "astype" in msg  # and the fix


@requires_torch
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("np_dtype", list(TORCH_OF), ids=lambda d: np.dtype(d).name)
def test_int_bool_complex_input_raise_torch_text(np_dtype, entry):
    x = np.ones((2, 3), np_dtype)
    expected = torch_message(lambda: F.layer_norm(torch.ones((2, 3), dtype=torch_dtype(TORCH_OF[np_dtype])), (3,)))
    assert "LayerNormKernelImpl" in expected
    with pytest.raises(TypeError) as info:
        ENTRY_POINTS[entry](x, (3,))
    assert expected in str(info.value)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_module_int_input_raises_type_error(mode):
    # The module's own calls word the refusal as the functions do; training mode names the module.
    module = layernorm.LayerNorm(3).train(mode == "train")
    with pytest.raises(TypeError) as info:
        module(np.ones((2, 3), np.int64))
    assert ("LayerNorm takes" if mode == "train" else "layer_norm takes") in str(info.value)


@requires_torch
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_module_int_input_raises_torch_text(mode):
    expected = torch_message(lambda: F.layer_norm(torch.ones((2, 3), dtype=torch.int64), (3,)))
    module = layernorm.LayerNorm(3).train(mode == "train")
    with pytest.raises(TypeError) as info:
        module(np.ones((2, 3), np.int64))
    assert expected in str(info.value)


@pytest.mark.parametrize("entry", ["layer_norm", "native_layer_norm", "training_forward"])
def test_core_refusal_names_the_dtype_not_torch(entry):
    # The compiled core knows nothing of torch: it raises UnsupportedDTypeError carrying the
    # dtype, and the Python layer adds torch's name for it.
    from layernorm import _layernorm
    with pytest.raises(_layernorm.UnsupportedDTypeError) as info:
        getattr(_layernorm, entry)(np.ones((2, 3), np.int64), (3,))
    assert isinstance(info.value, TypeError)
    assert info.value.dtype == np.dtype(np.int64)
    assert "not implemented" not in str(info.value) and "int64" in str(info.value)


def test_int_list_input_is_int64_data():
    with pytest.raises(TypeError, match="int64"):
        layernorm.layer_norm([[1, 2, 3]], (3,))


@requires_torch
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
    "read-only": (lambda: _ro(np.empty((4, 3), np.float32)), ValueError),
    "list": (lambda: [[0.0] * 3] * 4, TypeError),
    "torch-tensor": (lambda: torch.empty(4, 3), TypeError),
    "tuple": (lambda: (1, 2), TypeError),
}


@pytest.mark.parametrize("kind", ["fortran", "strided", "negative-strides"])
def test_out_in_any_layout_gets_the_contiguous_result(kind):
    """out= need not be C-contiguous: the result is written into it, the same bits as a new array."""
    x = np.random.default_rng(5).standard_normal((4, 3)).astype(np.float32)
    out = {"fortran": np.empty((4, 3), np.float32, order="F"),
           "strided": np.empty((4, 6), np.float32)[:, ::2],
           "negative-strides": np.empty((4, 3), np.float32)[::-1, ::-1]}[kind]
    assert layernorm.layer_norm(x, 3, out=out) is out
    assert np.array_equal(out, layernorm.layer_norm(x, 3))


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=requires_torch) if k.startswith("torch") else k for k in BAD_OUTS]
)
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


@pytest.mark.parametrize("args", [(np.ones((2, 3)),), ()], ids=["input-only", "nothing"])
def test_missing_arguments_layer_norm(args):
    with pytest.raises(TypeError):
        layernorm.layer_norm(*args)


@pytest.mark.parametrize("args", [(np.ones((2, 3)),), ()], ids=["input-only", "nothing"])
def test_missing_arguments_native_layer_norm(args):
    with pytest.raises(TypeError):
        layernorm.native_layer_norm(*args)


def test_argument_given_twice():
    with pytest.raises(TypeError):
        layernorm.layer_norm(np.ones((2, 3)), (3,), None, weight=np.ones(3))


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

# ---------------------------------------------------------------------------
# layer_norm_backward: shapes, dtypes, output_mask, calling convention
# ---------------------------------------------------------------------------


def good_args(dtype=np.float32):
    """layer_norm_backward's arguments, by name, for a call that succeeds."""
    rng = np.random.default_rng(40)
    x = rng.standard_normal((4, 8)).astype(dtype)
    dy = rng.standard_normal((4, 8)).astype(dtype)
    pdt = np.float64 if dtype == np.float64 else np.float32
    w, b = np.ones(8, pdt), np.zeros(8, pdt)
    _, mean, rstd = layernorm.native_layer_norm(x, (8,), w, b, 1e-5)
    return {"grad_output": dy, "input": x, "normalized_shape": (8,), "mean": mean, "rstd": rstd,
            "weight": w, "bias": b, "output_mask": (True, True, True)}


def call(args):
    return layernorm.layer_norm_backward(*args.values())


# Input dtypes, with torch's name for each.
INPUT_DTYPES = {
    "int64": (np.int64, "int64"),
    "int32": (np.int32, "int32"),
    "uint8": (np.uint8, "uint8"),
    "bool": (np.bool_, "bool"),
    "complex64": (np.complex64, "complex64"),
    "complex128": (np.complex128, "complex128"),
}


def test_backward_weight_shape_torch_text():
    args = good_args()
    args["weight"] = np.ones(7, np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert ("Expected weight to be of same shape as normalized_shape, but got weight of shape [7] "
            "and normalized_shape = [8]") in str(err.value)


def test_backward_bias_shape_torch_text():
    args = good_args()
    args["bias"] = np.ones(7, np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert ("Expected bias to be of same shape as normalized_shape, but got bias of shape [7] "
            "and normalized_shape = [8]") in str(err.value)


def test_backward_input_trailing_shape_torch_text():
    args = good_args()
    args["input"] = np.zeros((4, 9), np.float32)
    args["grad_output"] = np.zeros((4, 9), np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert ("Given normalized_shape=[8], expected input with shape [*, 8], but got input of "
            "size[4, 9]") in str(err.value)


@pytest.mark.parametrize("shape", [(4, 9), (5, 8), (32,)], ids=["4x9", "5x8", "flat_32"])
def test_backward_grad_output_shape_mismatch(shape):
    # DELIBERATE DIFFERENCE: torch does not check grad_output against input; we refuse.
    args = good_args()
    args["grad_output"] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert "grad_out" in str(err.value)


@pytest.mark.parametrize("which", ["mean", "rstd"])
def test_backward_stats_with_too_few_elements(which):
    args = good_args()
    args[which] = args[which][:3]
    with pytest.raises(ValueError):
        call(args)


def test_backward_empty_normalized_shape():
    args = good_args()
    args["normalized_shape"] = ()
    args["weight"] = args["bias"] = None
    with pytest.raises(ValueError, match="at least 1-dimensional"):
        call(args)


@pytest.mark.parametrize("kind", list(INPUT_DTYPES))
def test_backward_non_float_input_raises_type_error(kind):
    args = good_args()
    args["input"] = args["input"].astype(INPUT_DTYPES[kind][0])
    with pytest.raises(TypeError) as info:
        call(args)
    msg = str(info.value)
    assert np.dtype(INPUT_DTYPES[kind][0]).name in msg and "astype" in msg  # the NumPy dtype and the fix


@requires_torch
@pytest.mark.parametrize("kind", list(INPUT_DTYPES))
def test_backward_non_float_input_raises_type_error_like_the_forward(kind):
    np_dtype, torch_name = INPUT_DTYPES[kind]
    # The forward's text for the same dtype (torch names the dtype the same way in both).
    expected = torch_message(lambda: F.layer_norm(torch.ones((4, 8), dtype=torch_dtype(torch_name)), (8,)))
    args = good_args()
    args["input"] = args["input"].astype(np_dtype)
    with pytest.raises(TypeError) as info:
        call(args)
    assert expected.split(" not implemented for ")[1] in str(info.value)  # torch's dtype name, e.g. 'Long'


OTHER = {
    "str": lambda a: a.astype(str),
    "object": lambda a: a.astype(object),
    "datetime64": lambda a: np.zeros(a.shape, "datetime64[D]"),
}


@pytest.mark.parametrize("kind", list(OTHER))
def test_backward_other_input_dtypes_raise_type_error(kind):
    args = good_args()
    args["input"] = OTHER[kind](args["input"])
    with pytest.raises(TypeError) as info:
        call(args)
    assert str(args["input"].dtype) in str(info.value)


@pytest.mark.parametrize("kind", ["int64", "bool", "complex128", "str", "object"])
@pytest.mark.parametrize("which", ["grad_output", "weight", "bias"])
def test_backward_non_float_grad_output_or_param_raises_type_error(which, kind):
    args = good_args()
    args[which] = args[which].astype(np.dtype(kind) if kind != "str" else str)
    with pytest.raises(TypeError) as info:
        call(args)
    assert which in str(info.value) and str(args[which].dtype) in str(info.value)


@pytest.mark.parametrize("kind", ["int64", "complex128", "str", "None"])
@pytest.mark.parametrize("which", ["mean", "rstd"])
def test_backward_non_float_stats_raise_type_error(which, kind):
    args = good_args()
    args[which] = None if kind == "None" else args[which].astype(np.dtype(kind) if kind != "str" else str)
    with pytest.raises(TypeError) as info:
        call(args)
    assert which in str(info.value)


@pytest.mark.parametrize("mask", [(True, False), (True, True, True, True), ()],
                         ids=["two", "four", "empty"])
def test_backward_output_mask_wrong_length_raises_value_error(mask):
    args = good_args()
    args["output_mask"] = mask
    with pytest.raises(ValueError, match="output_mask"):
        call(args)


@pytest.mark.parametrize("mask", [None, 1, 1.5], ids=["None", "int", "float"])
def test_backward_output_mask_not_a_sequence_raises_type_error(mask):
    args = good_args()
    args["output_mask"] = mask
    with pytest.raises(TypeError, match="output_mask"):
        call(args)


@pytest.mark.parametrize("mask", [("False", "False", "False"), "FFF", (None, [], "x"),
                                  (True, 0.5, True), (True, np.array(0.5), True),
                                  (True, np.array([0]), True)],
                         ids=["str-False", "str-FFF", "mixed", "float", "0-d-float-array",
                              "1-element-int-array"])
def test_backward_output_mask_non_bool_entries_raise_type_error(mask):
    # torch: output_mask must be a List[bool].  A string "False" is true in Python: taking
    # it silently would return gradients the caller asked not to compute.
    args = good_args()
    args["output_mask"] = mask
    with pytest.raises(TypeError, match="output_mask"):
        call(args)


@pytest.mark.parametrize("mask", [(1, 0, 1), (np.True_, np.False_, np.True_), [True, False, True],
                                  (np.int64(1), np.uint8(0), np.int32(1))],
                         ids=["ints", "numpy-bools", "list", "numpy-ints"])
def test_backward_output_mask_bool_likes_accepted(mask):
    args = good_args()
    args["output_mask"] = mask
    gi, gw, gb = call(args)
    assert gi is not None and gw is None and gb is not None


@pytest.mark.parametrize("ns", [(-8,), (2, -4), -8], ids=["(-8,)", "(2,-4)", "int-8"])
def test_backward_negative_normalized_shape_raises_value_error(ns):
    args = good_args()
    args["normalized_shape"] = ns
    args["weight"] = args["bias"] = None
    with pytest.raises(ValueError, match="normalized_shape"):
        call(args)


@pytest.mark.parametrize("ns", [8.0, (8.0,), "8", ("8",), None], ids=["8.0", "(8.0,)", "'8'", "('8',)", "None"])
def test_backward_non_integer_normalized_shape_raises_type_error(ns):
    args = good_args()
    args["normalized_shape"] = ns
    args["weight"] = args["bias"] = None
    with pytest.raises(TypeError):
        call(args)


def test_backward_fewer_input_dims_than_normalized_shape_raises_value_error():
    args = good_args()
    args["normalized_shape"] = (3, 4, 8)
    args["weight"] = args["bias"] = None
    with pytest.raises(ValueError, match="normalized_shape"):
        call(args)


@requires_torch
def test_backward_fewer_input_dims_than_normalized_shape_torch_text():
    args = good_args()
    args["normalized_shape"] = (3, 4, 8)
    args["weight"] = args["bias"] = None
    x = args["input"]
    expected = torch_message(lambda: F.layer_norm(torch.from_numpy(x), (3, 4, 8)))
    with pytest.raises(ValueError) as info:
        call(args)
    assert expected in str(info.value)


def test_backward_unknown_keyword():
    args = good_args()
    with pytest.raises(TypeError, match="mask"):
        layernorm.layer_norm_backward(*list(args.values())[:7], mask=(True, True, True))


def test_backward_too_many_arguments():
    with pytest.raises(TypeError):
        layernorm.layer_norm_backward(*good_args().values(), None)


def test_backward_too_few_arguments():
    with pytest.raises(TypeError):
        layernorm.layer_norm_backward(*list(good_args().values())[:4])


def test_backward_integer_input_names_torch_backward_kernel():
    args = good_args()
    args["input"] = args["input"].astype(np.int64)
    with pytest.raises(TypeError, match="\"LayerNormBackwardKernelImpl\" not implemented for 'Long'"):
        call(args)


# The module's private route: training_forward saves (input, stats bytes), saved_backward reads
# them.  Statistics that do not belong to the input are an error, never a read past the end.
def _saved(x, n):
    from layernorm._layernorm import training_forward
    return training_forward(x, (n,), None, None, 1e-5)[1]


@pytest.mark.parametrize("stats", [b"", b"\0" * 47, b"\0" * 49, bytearray(48), None],
                         ids=["empty", "short", "long", "bytearray", "None"])
def test_saved_backward_rejects_stats_of_another_input(stats):
    from layernorm._layernorm import saved_backward
    x = np.ones((6, 9), np.float32)
    with pytest.raises(ValueError, match="training_forward"):
        saved_backward(x, x, stats, (9,))


def test_saved_backward_rejects_stats_of_another_dtype():
    from layernorm._layernorm import saved_backward
    x32 = np.ones((6, 9), np.float32)
    _, stats64 = _saved(x32.astype(np.float64), 9)
    with pytest.raises(ValueError, match="training_forward"):
        saved_backward(x32, x32, stats64, (9,))


def test_saved_backward_rejects_stats_whose_size_overflows():
    # 2 x 2**61 rows x 4 bytes wraps to 0 in 64 bits: the empty bytes must not pass for them.
    from layernorm._layernorm import saved_backward
    x = np.empty((2**61, 0), np.float16)
    with pytest.raises(ValueError, match="training_forward"):
        saved_backward(x, x, b"", (0,))


# ---------------------------------------------------------------------------
# The norm family: rms_norm, native_rms_norm, rms_norm_backward
# ---------------------------------------------------------------------------

RMS_ENTRY_POINTS = {
    "rms_norm": lambda x, ns, w=None: layernorm.rms_norm(x, ns, w),
    "native_rms_norm": lambda x, ns, w=None: layernorm.native_rms_norm(x, ns, w),
}


@pytest.mark.parametrize("entry", list(RMS_ENTRY_POINTS))
@pytest.mark.parametrize("pair", BAD_SHAPE_PAIRS, ids=_pair_id)
def test_rms_bad_shape_pairs_raise_value_error(pair, entry):
    ns, shape = pair
    with pytest.raises(ValueError, match="normalized_shape"):
        RMS_ENTRY_POINTS[entry](np.ones(shape, np.float32), ns)


@requires_torch
@pytest.mark.parametrize("entry", list(RMS_ENTRY_POINTS))
@pytest.mark.parametrize("pair", BAD_SHAPE_PAIRS, ids=_pair_id)
def test_rms_bad_shape_pairs_raise_torch_text(pair, entry):
    # F.rms_norm words a mismatch "[*2, 2]" where F.layer_norm has "[*, 2, 2]", and checks an
    # input of fewer dims than normalized_shape in Python first, with a ValueError of its own
    ns, shape = pair
    ns_list = [ns] if isinstance(ns, int) else list(ns)
    x = np.ones(shape, np.float32)
    with pytest.raises((RuntimeError, ValueError)) as torch_error:  # the oracle: torch refuses them all
        F.rms_norm(torch.from_numpy(x), ns_list)
    with pytest.raises(ValueError) as info:
        RMS_ENTRY_POINTS[entry](x, ns)
    assert str(torch_error.value) in str(info.value)


@pytest.mark.parametrize("entry", list(RMS_ENTRY_POINTS))
@pytest.mark.parametrize("shape,ns,pshape", [((4, 3), (3,), (2,)), ((2, 2, 3), (2, 3), (6,)), ((4, 3), (3,), ())],
                         ids=["3-vs-2", "2x3-vs-6", "3-vs-scalar"])
def test_rms_weight_shape_raises_torch_text(entry, shape, ns, pshape):
    # torch's text (F.rms_norm words it as F.layer_norm does)
    with pytest.raises(ValueError) as info:
        RMS_ENTRY_POINTS[entry](np.ones(shape, np.float32), ns, np.ones(pshape, np.float32))
    assert (f"Expected weight to be of same shape as normalized_shape, but got weight of shape {list(pshape)} "
            f"and normalized_shape = {list(ns)}") in str(info.value)


@requires_torch
def test_torch_rms_weight_shape_text():
    expected = torch_message(lambda: F.rms_norm(torch.ones(4, 3), (3,), torch.ones(2)))
    assert expected == ("Expected weight to be of same shape as normalized_shape, but got weight of shape [2] "
                        "and normalized_shape = [3]")


@pytest.mark.parametrize("entry", list(RMS_ENTRY_POINTS))
@pytest.mark.parametrize("np_dtype", list(TORCH_OF), ids=lambda d: np.dtype(d).name)
def test_rms_int_bool_complex_input_raise_type_error(np_dtype, entry):
    with pytest.raises(TypeError) as info:
        RMS_ENTRY_POINTS[entry](np.ones((2, 3), np_dtype), (3,))
    assert np.dtype(np_dtype).name in str(info.value) and "astype" in str(info.value)


@requires_torch
@pytest.mark.parametrize("np_dtype", [np.complex64, np.complex128], ids=lambda d: np.dtype(d).name)
def test_torch_rms_norm_takes_complex_input(np_dtype):
    # DELIBERATE DIFFERENCE FROM TORCH: F.rms_norm normalizes complex input; we refuse it, as
    # F.layer_norm does (the test above)
    x = torch.ones((2, 3), dtype=torch_dtype(TORCH_OF[np_dtype]))
    assert F.rms_norm(x, (3,)).dtype == x.dtype


@requires_torch
@pytest.mark.parametrize("entry", list(RMS_ENTRY_POINTS))
@pytest.mark.parametrize("np_dtype", [d for d in TORCH_OF if np.dtype(d).kind != "c"], ids=lambda d: np.dtype(d).name)
def test_rms_int_bool_input_raise_torch_text(np_dtype, entry):
    expected = torch_message(lambda: F.rms_norm(torch.ones((2, 3), dtype=torch_dtype(TORCH_OF[np_dtype])), (3,)))
    assert '"rms_norm" not implemented for' in expected
    with pytest.raises(TypeError) as info:
        RMS_ENTRY_POINTS[entry](np.ones((2, 3), np_dtype), (3,))
    assert expected in str(info.value)


@pytest.mark.parametrize("eps", ["1e-5", 1j, [1e-5]], ids=["str", "complex", "list"])
def test_rms_eps_not_real_raises_type_error(eps):
    with pytest.raises(TypeError, match="eps"):
        layernorm.rms_norm(np.ones((2, 3), np.float32), (3,), eps=eps)


def rms_backward_args():
    """rms_norm_backward's arguments, by name, for a call that succeeds."""
    rng = np.random.default_rng(41)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = np.ones(8, np.float32)
    return {"grad_output": rng.standard_normal((4, 8)).astype(np.float32), "input": x, "normalized_shape": (8,),
            "rstd": layernorm.native_rms_norm(x, (8,), w)[1], "weight": w, "output_mask": (True, True)}


@pytest.mark.parametrize("mask", [(True, True, True), (True,), ()], ids=["three", "one", "none"])
def test_rms_backward_output_mask_wrong_length_raises_value_error(mask):
    args = rms_backward_args()
    args["output_mask"] = mask
    with pytest.raises(ValueError, match="output_mask"):
        layernorm.rms_norm_backward(*args.values())


@pytest.mark.parametrize("which,value", [("grad_output", np.ones((5, 8), np.float32)),
                                         ("rstd", np.ones((3, 1), np.float32)),
                                         ("weight", np.ones(7, np.float32))],
                         ids=["grad_output-shape", "rstd-too-short", "weight-shape"])
def test_rms_backward_shapes_raise_value_error(which, value):
    args = rms_backward_args()
    args[which] = value
    with pytest.raises(ValueError):
        layernorm.rms_norm_backward(*args.values())


@pytest.mark.parametrize("which", ["grad_output", "input", "rstd", "weight"])
def test_rms_backward_int_arrays_raise_type_error(which):
    args = rms_backward_args()
    args[which] = args[which].astype(np.int64)
    with pytest.raises(TypeError):
        layernorm.rms_norm_backward(*args.values())


def test_rms_norm_has_no_bias():
    # torch's signature: rms_norm(input, normalized_shape, weight=None, eps=None)
    with pytest.raises(TypeError, match="bias"):
        layernorm.rms_norm(np.ones((2, 3), np.float32), (3,), bias=np.zeros(3, np.float32))


# ---------------------------------------------------------------------------
# axis=: NumPy's AxisError out of range, "repeated axis", and normalized_shape against the axes
# ---------------------------------------------------------------------------

AxisError = np.exceptions.AxisError if hasattr(np, "exceptions") else np.AxisError


def _axis_entries():
    """Every function that takes axis=, called on an NCHW float32 input x."""
    def rstd(x, ns, axis):
        return np.ones(tuple(1 if i == 1 else n for i, n in enumerate(x.shape)), np.float32)

    return {
        "layer_norm": lambda x, ns, axis: layernorm.layer_norm(x, ns, axis=axis),
        "native_layer_norm": lambda x, ns, axis: layernorm.native_layer_norm(x, ns, axis=axis),
        "layer_norm_backward": lambda x, ns, axis: layernorm.layer_norm_backward(
            x, x, ns, rstd(x, ns, axis) * 0, rstd(x, ns, axis), axis=axis),
        "rms_norm": lambda x, ns, axis: layernorm.rms_norm(x, ns, axis=axis),
        "native_rms_norm": lambda x, ns, axis: layernorm.native_rms_norm(x, ns, axis=axis),
        "rms_norm_backward": lambda x, ns, axis: layernorm.rms_norm_backward(x, x, ns, rstd(x, ns, axis), axis=axis),
        "add_layer_norm": lambda x, ns, axis: layernorm.add_layer_norm(x, x, ns, axis=axis),
        "add_rms_norm": lambda x, ns, axis: layernorm.add_rms_norm(x, x, ns, axis=axis),
        "LayerNorm": lambda x, ns, axis: layernorm.LayerNorm(ns, axis=axis)(x),
        "RMSNorm": lambda x, ns, axis: layernorm.RMSNorm(ns, axis=axis)(x),
        "LayerNorm-eval": lambda x, ns, axis: layernorm.LayerNorm(ns, axis=axis).eval()(x),
    }


AXIS_ENTRIES = list(_axis_entries())


def nchw(shape=(2, 8, 3, 5)):
    return np.ones(shape, np.float32)


@pytest.mark.parametrize("axis", [4, -5, (1, 4), (-5,)], ids=["4", "-5", "(1,4)", "(-5,)"])
@pytest.mark.parametrize("entry", AXIS_ENTRIES)
def test_axis_out_of_range_is_numpys_axis_error(entry, axis):
    bad = [a for a in ((axis,) if isinstance(axis, int) else axis) if not -4 <= a < 4][0]
    ns = (8,) * (1 if isinstance(axis, int) else len(axis))
    with pytest.raises(AxisError) as info:
        _axis_entries()[entry](nchw(), ns, axis)
    assert isinstance(info.value, ValueError) and isinstance(info.value, IndexError)
    assert str(info.value) == f"axis {bad} is out of bounds for array of dimension 4"


def test_axis_error_text_is_numpys():
    # the oracle for the text: NumPy's own reductions
    with pytest.raises(AxisError) as info:
        np.sum(nchw(), axis=(1, 4))
    assert str(info.value) == "axis 4 is out of bounds for array of dimension 4"


@pytest.mark.parametrize("axis", [(1, 1), (1, -3), (3, 2, 3)], ids=["(1,1)", "(1,-3)", "(3,2,3)"])
@pytest.mark.parametrize("entry", AXIS_ENTRIES)
def test_repeated_axis_raises_value_error(entry, axis):
    with pytest.raises(ValueError, match="repeated axis") as info:
        _axis_entries()[entry](nchw((2, 8, 8, 8)), (8,) * len(axis), axis)
    assert not isinstance(info.value, AxisError)


@pytest.mark.parametrize("entry", AXIS_ENTRIES)
def test_axis_count_differs_from_normalized_shape(entry):
    with pytest.raises(ValueError) as info:
        _axis_entries()[entry](nchw((2, 64, 3, 3)), (64,), (1, 2))
    assert type(info.value) is ValueError
    assert str(info.value) == "normalized_shape=[64] and axis=(1, 2) differ in length"


@pytest.mark.parametrize("entry", AXIS_ENTRIES)
def test_axis_sizes_differ_from_normalized_shape(entry):
    # an input that takes no memory: the check comes before any reading
    x = np.broadcast_to(np.float32(1), (8, 32, 56, 56))
    with pytest.raises(ValueError) as info:
        _axis_entries()[entry](x, (64,), (1,))
    assert type(info.value) is ValueError
    assert str(info.value) == ("Given normalized_shape=[64] and axis=(1,), expected input with sizes [64] along "
                               "those axes, but got input of size[8, 32, 56, 56]")


@pytest.mark.parametrize("axis", [1.0, "1", [1], (1.0,), ("1",), True, (True,)],
                         ids=["float", "str", "list", "(float,)", "(str,)", "True", "(True,)"])
@pytest.mark.parametrize("entry", AXIS_ENTRIES)
def test_axis_not_an_int_or_tuple_of_ints_raises_type_error(entry, axis):
    # NumPy's convention: np.sum(x, axis=[1]) and axis=True are TypeErrors too
    with pytest.raises(TypeError):
        _axis_entries()[entry](nchw(), (8,), axis)


# ---------------------------------------------------------------------------
# add_layer_norm, add_rms_norm: residual of the input's shape and dtype exactly
# ---------------------------------------------------------------------------

ADD_ENTRIES = ["add_layer_norm", "add_rms_norm"]


@pytest.mark.parametrize("entry", ADD_ENTRIES)
def test_residual_shape_differs(entry):
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError) as info:
        getattr(layernorm, entry)(x, np.ones((2, 3), np.float32), (4,))
    assert type(info.value) is ValueError
    assert str(info.value) == "residual has shape [2, 3], but input has shape [2, 4]"


@pytest.mark.parametrize("residual_shape", [(4,), (1, 4), (2, 1), (3, 2, 4)], ids=["4", "1x4", "2x1", "3x2x4"])
@pytest.mark.parametrize("entry", ADD_ENTRIES)
def test_residual_is_not_broadcast(entry, residual_shape):
    with pytest.raises(ValueError, match=r"^residual has shape \["):
        getattr(layernorm, entry)(np.ones((2, 4), np.float32), np.ones(residual_shape, np.float32), (4,))


@pytest.mark.parametrize("entry", ADD_ENTRIES)
def test_residual_dtype_differs(entry):
    x = np.ones((2, 4), np.float32)
    with pytest.raises(TypeError) as info:
        getattr(layernorm, entry)(x, np.ones((2, 4), np.float64), (4,))
    assert type(info.value) is TypeError
    assert str(info.value) == "residual has dtype float64, but input has dtype float32"


@pytest.mark.parametrize("residual_dtype", [np.float32, np.int32], ids=["float32", "int32"])
@pytest.mark.parametrize("entry", ADD_ENTRIES)
def test_residual_is_not_promoted(entry, residual_dtype):
    # float16 input: neither a float32 residual nor an integer one is converted
    with pytest.raises(TypeError) as info:
        getattr(layernorm, entry)(np.ones((2, 4), np.float16), np.ones((2, 4), residual_dtype), (4,))
    assert str(info.value) == f"residual has dtype {np.dtype(residual_dtype)}, but input has dtype float16"


@pytest.mark.parametrize("entry", ADD_ENTRIES)
def test_residual_list_is_float64_data(entry):
    with pytest.raises(TypeError) as info:
        getattr(layernorm, entry)(np.ones((2, 4), np.float32), [[1.0] * 4] * 2, (4,))
    assert str(info.value) == "residual has dtype float64, but input has dtype float32"


@pytest.mark.parametrize("keyword", ["out", "residual_out"])
@pytest.mark.parametrize("entry", ADD_ENTRIES)
def test_add_destination_of_wrong_shape_or_dtype(entry, keyword):
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError):
        getattr(layernorm, entry)(x, x.copy(), (4,), **{keyword: np.empty((2, 5), np.float32)})
    with pytest.raises(TypeError):
        getattr(layernorm, entry)(x, x.copy(), (4,), **{keyword: np.empty((2, 4), np.float64)})
    read_only = np.empty((2, 4), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError):
        getattr(layernorm, entry)(x, x.copy(), (4,), **{keyword: read_only})
