"""layer_norm_backward's dtype and argument errors (issue 3: "Shape and dtype errors are as
clear as the forward's": TypeError for types, ValueError for shapes and values).

tests/test_backward.py covers the shape texts; this covers types and argument values.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import layernorm
from conftest import torch_message


def good_args(dtype=np.float32):
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


INPUT_DTYPES = {
    "int64": (np.int64, torch.int64),
    "int32": (np.int32, torch.int32),
    "uint8": (np.uint8, torch.uint8),
    "bool": (np.bool_, torch.bool),
    "complex64": (np.complex64, torch.complex64),
    "complex128": (np.complex128, torch.complex128),
}


@pytest.mark.parametrize("kind", list(INPUT_DTYPES))
def test_non_float_input_raises_type_error_like_the_forward(kind):
    np_dtype, torch_dtype = INPUT_DTYPES[kind]
    # The forward's text for the same dtype (torch names the dtype the same way in both).
    expected = torch_message(lambda: F.layer_norm(torch.ones((4, 8), dtype=torch_dtype), (8,)))
    args = good_args()
    args["input"] = args["input"].astype(np_dtype)
    with pytest.raises(TypeError) as info:
        call(args)
    msg = str(info.value)
    assert expected.split(" not implemented for ")[1] in msg  # torch's dtype name, e.g. 'Long'
    assert np.dtype(np_dtype).name in msg and "astype" in msg  # the NumPy dtype and the fix


OTHER = {
    "str": lambda a: a.astype(str),
    "object": lambda a: a.astype(object),
    "datetime64": lambda a: np.zeros(a.shape, "datetime64[D]"),
}


@pytest.mark.parametrize("kind", list(OTHER))
def test_other_input_dtypes_raise_type_error(kind):
    args = good_args()
    args["input"] = OTHER[kind](args["input"])
    with pytest.raises(TypeError) as info:
        call(args)
    assert str(args["input"].dtype) in str(info.value)


@pytest.mark.parametrize("kind", ["int64", "bool", "complex128", "str", "object"])
@pytest.mark.parametrize("which", ["grad_output", "weight", "bias"])
def test_non_float_grad_output_or_param_raises_type_error(which, kind):
    args = good_args()
    args[which] = args[which].astype(np.dtype(kind) if kind != "str" else str)
    with pytest.raises(TypeError) as info:
        call(args)
    assert which in str(info.value) and str(args[which].dtype) in str(info.value)


@pytest.mark.parametrize("kind", ["int64", "complex128", "str", "None"])
@pytest.mark.parametrize("which", ["mean", "rstd"])
def test_non_float_stats_raise_type_error(which, kind):
    args = good_args()
    args[which] = None if kind == "None" else args[which].astype(np.dtype(kind) if kind != "str" else str)
    with pytest.raises(TypeError) as info:
        call(args)
    assert which in str(info.value)


@pytest.mark.parametrize("mask", [(True, False), (True, True, True, True), ()],
                         ids=["two", "four", "empty"])
def test_output_mask_wrong_length_raises_value_error(mask):
    args = good_args()
    args["output_mask"] = mask
    with pytest.raises(ValueError, match="output_mask"):
        call(args)


@pytest.mark.parametrize("mask", [None, 1, 1.5], ids=["None", "int", "float"])
def test_output_mask_not_a_sequence_raises_type_error(mask):
    args = good_args()
    args["output_mask"] = mask
    with pytest.raises(TypeError, match="output_mask"):
        call(args)


@pytest.mark.parametrize("mask", [("False", "False", "False"), "FFF", (None, [], "x"),
                                  (True, 0.5, True), (True, np.array(0.5), True),
                                  (True, np.array([0]), True)],
                         ids=["str-False", "str-FFF", "mixed", "float", "0-d-float-array",
                              "1-element-int-array"])
def test_output_mask_non_bool_entries_raise_type_error(mask):
    # torch: output_mask must be a List[bool].  A string "False" is true in Python: taking
    # it silently would return gradients the caller asked not to compute.
    args = good_args()
    args["output_mask"] = mask
    with pytest.raises(TypeError, match="output_mask"):
        call(args)


@pytest.mark.parametrize("mask", [(1, 0, 1), (np.True_, np.False_, np.True_), [True, False, True],
                                  (np.int64(1), np.uint8(0), np.int32(1))],
                         ids=["ints", "numpy-bools", "list", "numpy-ints"])
def test_output_mask_bool_likes_accepted(mask):
    args = good_args()
    args["output_mask"] = mask
    gi, gw, gb = call(args)
    assert gi is not None and gw is None and gb is not None


@pytest.mark.parametrize("ns", [(-8,), (2, -4), -8], ids=["(-8,)", "(2,-4)", "int-8"])
def test_negative_normalized_shape_raises_value_error(ns):
    args = good_args()
    args["normalized_shape"] = ns
    args["weight"] = args["bias"] = None
    with pytest.raises(ValueError, match="normalized_shape"):
        call(args)


@pytest.mark.parametrize("ns", [8.0, (8.0,), "8", ("8",), None], ids=["8.0", "(8.0,)", "'8'", "('8',)", "None"])
def test_non_integer_normalized_shape_raises_type_error(ns):
    args = good_args()
    args["normalized_shape"] = ns
    args["weight"] = args["bias"] = None
    with pytest.raises(TypeError):
        call(args)


def test_fewer_input_dims_than_normalized_shape_torch_text():
    args = good_args()
    args["normalized_shape"] = (3, 4, 8)
    args["weight"] = args["bias"] = None
    x = args["input"]
    expected = torch_message(lambda: F.layer_norm(torch.from_numpy(x), (3, 4, 8)))
    with pytest.raises(ValueError) as info:
        call(args)
    assert expected in str(info.value)


def test_unknown_keyword_and_too_many_arguments():
    args = good_args()
    with pytest.raises(TypeError, match="mask"):
        layernorm.layer_norm_backward(*list(args.values())[:7], mask=(True, True, True))
    with pytest.raises(TypeError):
        layernorm.layer_norm_backward(*args.values(), None)
    with pytest.raises(TypeError):
        layernorm.layer_norm_backward(*list(args.values())[:4])


def test_integer_input_names_torch_backward_kernel():
    args = good_args()
    args["input"] = args["input"].astype(np.int64)
    with pytest.raises(TypeError, match="\"LayerNormBackwardKernelImpl\" not implemented for 'Long'"):
        call(args)


# The module's private route: training_forward saves (input, stats bytes), saved_backward reads
# them.  Statistics that do not belong to the input are an error, never a read past the end.
def _saved(x, n):
    from layernorm._layernorm import training_forward
    return training_forward(x, (n,), None, None, 1e-5)[1]


def test_saved_backward_matches_layer_norm_backward():
    from layernorm._layernorm import saved_backward
    x = np.random.default_rng(5).standard_normal((6, 9)).astype(np.float32)
    dy = np.random.default_rng(6).standard_normal((6, 9)).astype(np.float32)
    w, b = np.linspace(0.5, 2, 9, dtype=np.float32), np.zeros(9, np.float32)
    input_copy, stats = _saved(x, 9)
    assert isinstance(stats, bytes) and len(stats) == 2 * 6 * 4
    _, mean, rstd = layernorm.native_layer_norm(x, (9,), w, b)
    np.testing.assert_array_equal(np.frombuffer(stats, np.float32), np.concatenate([mean.ravel(), rstd.ravel()]))
    got = saved_backward(dy, input_copy, stats, (9,), w, b)
    want = layernorm.layer_norm_backward(dy, x, (9,), mean, rstd, w, b)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g, e)


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
