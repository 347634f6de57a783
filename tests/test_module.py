"""layernorm.LayerNorm against torch.nn.LayerNorm (the oracle) and layernorm._reference: repr,
attributes, parameters, state_dict, forward, train/eval, copies, and training (backward with
gradient accumulation).

Every comparison builds the torch module next to ours with the same arguments, so the expected
repr, attributes, state_dict and outputs come from torch itself, never from a run of our code.
"""

import copy
import pickle

import numpy as np
import pytest

import layernorm
from helpers import (
    assert_close,
    reference_backward,
    reference_output,
    requires_torch,
    torch,
    torch_dtype,
    torch_message,
)
from layernorm import LayerNorm

# Tolerances for our output against torch's or the float64 reference, by the dtype of the output.
ATOL = {np.dtype(np.float16): 4e-3, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def spread_input(shape, normalized_shape, dtype, seed):
    """Random input whose rows have a variance well above 0.5 (so eps=-0.5 stays finite)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(normalized_shape))
    ramp = np.linspace(-3.0, 3.0, n).reshape(normalized_shape) if n > 1 else np.zeros(normalized_shape)
    return (ramp + 0.3 * rng.standard_normal(shape)).astype(dtype)


def numpy_dtype_of(tensor):
    """The NumPy dtype of a torch tensor's dtype (torch.float32 -> float32)."""
    return np.dtype(str(tensor.dtype).replace("torch.", ""))


def randomize(module, seed):
    """Give one of our modules non-default parameters drawn with NumPy; return it."""
    rng = np.random.default_rng(seed)
    module.load_state_dict({name: rng.standard_normal(value.shape) for name, value in module.named_parameters()})
    return module


def torch_out(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def to_numpy(t):
    return None if t is None else t.detach().numpy()


def randomize_torch(tm, seed):
    """Give a torch module non-default parameters drawn with torch.randn."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return tm


def train_torch(tm, steps, seed):
    """A few plain SGD steps on a regression loss, so the weights are what training produced."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(tm.parameters(), lr=0.1)
    dtype = next(tm.parameters()).dtype
    for _ in range(steps):
        x = torch.randn((6,) + tm.normalized_shape, generator=g, dtype=dtype)
        target = torch.randn((6,) + tm.normalized_shape, generator=g, dtype=dtype)
        opt.zero_grad()
        loss = ((tm(x) - target) ** 2).sum()
        loss.backward()
        opt.step()
    return tm


def params(m):
    return (None if m.weight is None else m.weight.copy(), None if m.bias is None else m.bias.copy())


def assert_params_equal(m, expected):
    w, b = expected
    if w is None:
        assert m.weight is None
    else:
        np.testing.assert_array_equal(m.weight, w)
    if b is None:
        assert m.bias is None
    else:
        np.testing.assert_array_equal(m.bias, b)


# ---------------------------------------------------------------------------------------------
# constructor combinations: (id, normalized_shape, kwargs); "dtype" given as a numpy dtype name
# ---------------------------------------------------------------------------------------------

CTOR_CASES = [
    ("int", 4, {}),
    ("int_one", 1, {}),
    ("numpy_int64", np.int64(4), {}),
    ("list_3d", [3, 5, 5], {}),
    ("tuple_2d", (2, 3), {}),
    ("eps_zero_int", 4, {"eps": 0}),
    ("eps_zero_float", 4, {"eps": 0.0}),
    ("eps_negative", (2, 3), {"eps": -0.5}),
    ("eps_1e-12", 4, {"eps": 1e-12}),
    ("eps_0.1", [2, 2, 5], {"eps": 0.1}),
    ("no_affine", [3, 5, 5], {"elementwise_affine": False}),
    ("no_affine_bias_true", 4, {"elementwise_affine": False, "bias": True}),
    ("no_affine_no_bias", 4, {"elementwise_affine": False, "bias": False}),
    ("no_bias", 4, {"bias": False}),
    ("no_bias_list", [2, 3], {"bias": False}),
    ("dtype_float16", 4, {"dtype": "float16"}),
    ("dtype_float32", 4, {"dtype": "float32"}),
    ("dtype_float64", (2, 3), {"dtype": "float64"}),
    ("dtype_float16_no_bias", [2, 3], {"dtype": "float16", "bias": False}),
    ("dtype_float64_no_affine", 5, {"dtype": "float64", "elementwise_affine": False}),
    ("device_none", 4, {"device": None}),
    ("device_cpu", 4, {"device": "cpu"}),
    ("all_keywords", [6], {"eps": 1e-6, "elementwise_affine": True, "bias": True,
                           "device": "cpu", "dtype": "float32"}),
]
CTOR_IDS = [c[0] for c in CTOR_CASES]


def build_ours(ns, kwargs):
    """Our module for a constructor case."""
    ours_kw = dict(kwargs)
    if "dtype" in kwargs:
        ours_kw["dtype"] = np.dtype(kwargs["dtype"])
    return LayerNorm(ns, **ours_kw)


def build_pair(ns, kwargs):
    """(ours, torch's) for a constructor case."""
    torch_kw = dict(kwargs)
    if "dtype" in kwargs:
        torch_kw["dtype"] = torch_dtype(kwargs["dtype"])
    ns_torch = list(ns) if isinstance(ns, list) else ns
    return build_ours(ns, kwargs), torch.nn.LayerNorm(ns_torch, **torch_kw)


# torch stores a numpy integer as given, so its repr prints "(np.int64(4),)"; we store Python ints
# and print "(4,)". A cosmetic difference we do not mirror, so that case is left out of the repr tests.
REPR_CASES = [c for c in CTOR_CASES if c[0] != "numpy_int64"]
REPR_IDS = [c[0] for c in REPR_CASES]


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", REPR_CASES, ids=REPR_IDS)
def test_repr_identical_to_torch(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    assert repr(ours) == repr(theirs)


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", REPR_CASES, ids=REPR_IDS)
def test_extra_repr_identical_to_torch(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    assert ours.extra_repr() == theirs.extra_repr()


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", CTOR_CASES, ids=CTOR_IDS)
def test_scalar_attributes_match_torch(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    assert type(ours.normalized_shape) is tuple
    assert ours.normalized_shape == theirs.normalized_shape
    assert ours.eps == theirs.eps and type(ours.eps) is type(theirs.eps)  # stored as given
    assert ours.elementwise_affine is theirs.elementwise_affine
    assert ours.training is True


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", CTOR_CASES, ids=CTOR_IDS)
def test_parameters_match_torch(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    for name in ("weight", "bias"):
        mine, ref = getattr(ours, name), getattr(theirs, name)
        if ref is None:
            assert mine is None, name
            continue
        assert isinstance(mine, np.ndarray), name
        assert mine.shape == tuple(ref.shape), name
        assert mine.dtype == numpy_dtype_of(ref), name
        np.testing.assert_array_equal(mine, to_numpy(ref), err_msg=name)


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", CTOR_CASES, ids=CTOR_IDS)
def test_state_dict_matches_torch(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    sd, tsd = ours.state_dict(), theirs.state_dict()
    assert list(sd.keys()) == list(tsd.keys())
    for key, ref in tsd.items():
        assert isinstance(sd[key], np.ndarray), key
        assert sd[key].dtype == numpy_dtype_of(ref), key
        np.testing.assert_array_equal(sd[key], ref.numpy(), err_msg=key)


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", CTOR_CASES, ids=CTOR_IDS)
def test_forward_default_params_matches_torch(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((3,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=1)
    y = ours(x)
    expected = torch_out(theirs, x)
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(y, expected, rtol=ATOL[dtype], atol=ATOL[dtype])


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", CTOR_CASES, ids=CTOR_IDS)
def test_forward_randn_params_matches_torch_and_float64(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    randomize_torch(theirs, seed=2)
    ours.load_state_dict(theirs.state_dict())
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((5,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=3)
    y = ours(x)
    np.testing.assert_allclose(y, torch_out(theirs, x), rtol=ATOL[dtype], atol=ATOL[dtype])
    ref = reference_output(x, ours.normalized_shape, to_numpy(theirs.weight), to_numpy(theirs.bias),
                         theirs.eps)
    np.testing.assert_allclose(y, ref, rtol=ATOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("case_id, ns, kwargs", CTOR_CASES, ids=CTOR_IDS)
def test_forward_random_params_matches_reference(case_id, ns, kwargs):
    ours = randomize(build_ours(ns, kwargs), seed=2)
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((5,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=3)
    y = ours(x)
    assert y.dtype == dtype and y.shape == x.shape
    ref = reference_output(x, ours.normalized_shape, ours.weight, ours.bias, ours.eps)
    np.testing.assert_allclose(y, ref, rtol=ATOL[dtype], atol=ATOL[dtype])


def test_eps_zero_repr_is_eps_0():
    # eps is kept as given: an int 0 prints as "eps=0", not "eps=0.0".
    assert "eps=0," in repr(LayerNorm(4, eps=0))


@requires_torch
def test_eps_zero_repr_is_torchs():
    assert repr(LayerNorm(4, eps=0)) == repr(torch.nn.LayerNorm(4, eps=0))


# ---------------------------------------------------------------------------------------------
# state_dict / load_state_dict
# ---------------------------------------------------------------------------------------------

LOAD_CASES = [
    ("1d", 8, {}),
    ("3d", [3, 5, 5], {}),
    ("no_bias", 8, {"bias": False}),
    ("float64", (2, 3), {"dtype": "float64"}),
]
LOAD_IDS = [c[0] for c in LOAD_CASES]


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", LOAD_CASES, ids=LOAD_IDS)
def test_load_state_dict_from_sgd_trained_torch(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    train_torch(theirs, steps=3, seed=4)
    assert not torch.equal(theirs.weight, torch.ones_like(theirs.weight))  # training moved it
    ours.load_state_dict(theirs.state_dict())
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((7,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=5)
    np.testing.assert_allclose(ours(x), torch_out(theirs, x), rtol=ATOL[dtype], atol=ATOL[dtype])


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", LOAD_CASES, ids=LOAD_IDS)
def test_load_state_dict_from_torch_tensors_copies_values(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    randomize_torch(theirs, seed=6)
    ours.load_state_dict(theirs.state_dict())
    for name, p in theirs.named_parameters():
        mine = getattr(ours, name)
        assert isinstance(mine, np.ndarray)
        assert mine.dtype == numpy_dtype_of(p)
        np.testing.assert_array_equal(mine, to_numpy(p))


@requires_torch
@pytest.mark.parametrize("case_id, ns, kwargs", LOAD_CASES, ids=LOAD_IDS)
def test_load_state_dict_from_numpy_arrays(case_id, ns, kwargs):
    ours, theirs = build_pair(ns, kwargs)
    randomize_torch(theirs, seed=7)
    ours.load_state_dict({k: v.numpy().copy() for k, v in theirs.state_dict().items()})
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((4,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=8)
    np.testing.assert_allclose(ours(x), torch_out(theirs, x), rtol=ATOL[dtype], atol=ATOL[dtype])


def test_load_state_dict_keeps_module_dtype():
    # torch copies into the existing parameter: a float64 checkpoint keeps a float32 module float32.
    ours = LayerNorm(4)
    ours.load_state_dict({"weight": np.full(4, 2.5, np.float64), "bias": np.full(4, 0.5, np.float64)})
    assert ours.weight.dtype == np.float32 and ours.bias.dtype == np.float32
    np.testing.assert_array_equal(ours.weight, np.full(4, 2.5, np.float32))
    np.testing.assert_array_equal(ours.bias, np.full(4, 0.5, np.float32))


def test_load_state_dict_does_not_alias_source():
    ours = LayerNorm(4)
    src = {"weight": np.full(4, 2.0, np.float32), "bias": np.full(4, 1.0, np.float32)}
    ours.load_state_dict(src)
    src["weight"][:] = 99.0
    src["bias"][:] = 99.0
    np.testing.assert_array_equal(ours.weight, np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(ours.bias, np.full(4, 1.0, np.float32))


def test_state_dict_values_are_copies():
    ours = LayerNorm(4)
    sd = ours.state_dict()
    sd["weight"][:] = 7.0
    sd["bias"][:] = 7.0
    np.testing.assert_array_equal(ours.weight, np.ones(4, np.float32))
    np.testing.assert_array_equal(ours.bias, np.zeros(4, np.float32))


def test_state_dict_round_trip_between_two_modules():
    a = LayerNorm((2, 3))
    a.load_state_dict({"weight": np.arange(6.0).reshape(2, 3), "bias": -np.arange(6.0).reshape(2, 3)})
    b = LayerNorm((2, 3))
    b.load_state_dict(a.state_dict())
    x = spread_input((4, 2, 3), (2, 3), np.float32, seed=9)
    np.testing.assert_array_equal(a(x), b(x))


def known_module():
    m = LayerNorm(4)
    m.load_state_dict({"weight": np.array([1.5, -2.0, 0.25, 3.0], np.float32),
                       "bias": np.array([0.1, 0.2, -0.3, 0.4], np.float32)})
    return m


NEW_W = np.full(4, 9.0, np.float32)
NEW_B = np.full(4, 8.0, np.float32)
STRICT_BAD = [
    ("missing_bias", {"weight": NEW_W}),
    ("missing_weight", {"bias": NEW_B}),
    ("missing_both", {}),
    ("unexpected_key", {"weight": NEW_W, "bias": NEW_B, "running_mean": np.zeros(4, np.float32)}),
    ("weight_wrong_shape", {"weight": np.full(5, 9.0, np.float32), "bias": NEW_B}),
    ("bias_wrong_shape_after_good_weight", {"weight": NEW_W, "bias": np.full((1, 4), 8.0, np.float32)}),
    ("weight_wrong_ndim", {"weight": np.full((2, 2), 9.0, np.float32), "bias": NEW_B}),
]


@requires_torch
@pytest.mark.parametrize("case_id, sd", STRICT_BAD, ids=[c[0] for c in STRICT_BAD])
def test_torch_rejects_strict_case(case_id, sd):
    # The oracle: torch refuses every one of these with strict=True.
    tm = torch.nn.LayerNorm(4)
    with pytest.raises(RuntimeError):
        tm.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)


def as_source(sd, source):
    """The state dict as NumPy arrays or as torch tensors (both must be accepted)."""
    return {k: torch.from_numpy(v) if source == "torch" else v for k, v in sd.items()}


SOURCES = ["numpy", pytest.param("torch", marks=requires_torch)]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case_id, sd", STRICT_BAD, ids=[c[0] for c in STRICT_BAD])
def test_load_state_dict_strict_raises_and_leaves_module_unchanged(case_id, sd, source):
    m = known_module()
    before = params(m)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict for LayerNorm"):
        m.load_state_dict(as_source(sd, source), strict=True)
    assert_params_equal(m, before)


@requires_torch
@pytest.mark.parametrize("source", ["numpy", "torch"])
@pytest.mark.parametrize("case_id, sd", STRICT_BAD, ids=[c[0] for c in STRICT_BAD])
def test_load_state_dict_strict_raises_torch_text(case_id, sd, source):
    with pytest.raises(RuntimeError) as info:
        known_module().load_state_dict(as_source(sd, source), strict=True)
    # torch's text (its size-mismatch lines print torch.Size, so compare those by content)
    expected = torch_message(lambda: torch.nn.LayerNorm(4).load_state_dict(as_source(sd, "torch")))
    ours = str(info.value)
    if "size mismatch" in expected:
        assert ours.startswith("Error(s) in loading state_dict for LayerNorm:\n\tsize mismatch for ")
        assert expected.split("size mismatch for ")[1].split(":")[0] in ours  # the same key
    else:
        assert ours == expected


@pytest.mark.parametrize("source", SOURCES)
def test_load_state_dict_checks_everything_before_changing_anything(source):
    # A good weight, then a bias of the wrong shape and an unexpected key: torch lists every
    # problem; nothing may be copied, not even the good weight.
    m = known_module()
    before = params(m)
    sd = {"weight": NEW_W, "bias": np.ones(5, np.float32), "extra": np.zeros(4, np.float32)}
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(as_source(sd, source))
    assert_params_equal(m, before)
    assert 'Unexpected key(s) in state_dict: "extra"' in str(info.value)
    assert "size mismatch for bias" in str(info.value)


NOT_MAPPINGS = [[("weight", NEW_W), ("bias", NEW_B)], None, "weight"]
NOT_MAPPING_IDS = ["list_of_pairs", "None", "str"]


@pytest.mark.parametrize("value", NOT_MAPPINGS, ids=NOT_MAPPING_IDS)
def test_load_state_dict_not_a_mapping_raises_type_error(value):
    m = known_module()
    before = params(m)
    with pytest.raises(TypeError, match="dict-like"):
        m.load_state_dict(value)
    assert_params_equal(m, before)


@requires_torch
@pytest.mark.parametrize("value", NOT_MAPPINGS, ids=NOT_MAPPING_IDS)
def test_load_state_dict_not_a_mapping_raises_torch_text(value):
    with pytest.raises(TypeError) as theirs:
        torch.nn.LayerNorm(4).load_state_dict(value)
    with pytest.raises(TypeError) as ours:
        known_module().load_state_dict(value)
    assert str(ours.value) == str(theirs.value)


def test_load_state_dict_unexpected_weight_on_no_affine_module():
    m = LayerNorm(4, elementwise_affine=False)
    with pytest.raises((RuntimeError, ValueError, KeyError)):
        m.load_state_dict({"weight": NEW_W})
    assert m.weight is None and m.bias is None


def test_load_state_dict_non_strict_missing_key_loads_the_rest():
    m = known_module()
    _, old_b = params(m)
    m.load_state_dict({"weight": NEW_W}, strict=False)
    np.testing.assert_array_equal(m.weight, NEW_W)
    np.testing.assert_array_equal(m.bias, old_b)


def test_load_state_dict_non_strict_ignores_unexpected_key():
    m = known_module()
    m.load_state_dict({"weight": NEW_W, "bias": NEW_B, "extra": np.zeros(3)}, strict=False)
    np.testing.assert_array_equal(m.weight, NEW_W)
    np.testing.assert_array_equal(m.bias, NEW_B)


@requires_torch
def test_torch_non_strict_wrong_shape_still_raises():
    tm = torch.nn.LayerNorm(4)
    with pytest.raises(RuntimeError):
        tm.load_state_dict({"weight": torch.ones(5)}, strict=False)


def test_load_state_dict_non_strict_wrong_shape_still_raises():
    # torch raises "size mismatch" even with strict=False; nothing may change.
    m = known_module()
    before = params(m)
    with pytest.raises((RuntimeError, ValueError)):
        m.load_state_dict({"weight": NEW_W, "bias": np.ones(5, np.float32)}, strict=False)
    assert_params_equal(m, before)


# ---------------------------------------------------------------------------------------------
# reset_parameters, train/eval, copies
# ---------------------------------------------------------------------------------------------

def reset_module(dtype):
    m = LayerNorm((2, 3), dtype=np.dtype(dtype))
    m.load_state_dict({"weight": np.full((2, 3), 3.0), "bias": np.full((2, 3), -1.0)})
    m.reset_parameters()
    return m


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_reset_parameters_restores_ones_and_zeros(dtype):
    m = reset_module(dtype)
    assert m.weight.dtype == np.dtype(dtype) and m.bias.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(m.weight, np.ones((2, 3)))
    np.testing.assert_array_equal(m.bias, np.zeros((2, 3)))


@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_reset_parameters_like_torch(dtype):
    m = reset_module(dtype)
    tm = torch.nn.LayerNorm((2, 3), dtype=torch_dtype(dtype))
    randomize_torch(tm, seed=10)
    tm.reset_parameters()
    np.testing.assert_array_equal(m.weight, to_numpy(tm.weight))
    np.testing.assert_array_equal(m.bias, to_numpy(tm.bias))


def test_reset_parameters_after_in_place_edit():
    m = LayerNorm(4, bias=False)
    m.weight[...] = 5.0
    m.reset_parameters()
    np.testing.assert_array_equal(m.weight, np.ones(4, np.float32))
    assert m.bias is None


def test_reset_parameters_no_affine_is_a_no_op():
    m = LayerNorm(4, elementwise_affine=False)
    m.reset_parameters()
    assert m.weight is None and m.bias is None


def test_training_attribute_follows_train_and_eval():
    m = LayerNorm(4)
    assert m.training is True
    assert m.eval() is m
    assert m.training is False
    assert m.train() is m
    assert m.training is True
    assert m.train(False) is m
    assert m.training is False
    assert m.train(True) is m
    assert m.training is True


def test_train_and_eval_do_not_change_outputs():
    m = known_module()
    x = spread_input((6, 4), (4,), np.float32, seed=11)
    y_train = m(x)
    y_eval = m.eval()(x)
    y_train_again = m.train()(x)
    np.testing.assert_array_equal(y_train, y_eval)
    np.testing.assert_array_equal(y_train, y_train_again)


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_copy_round_trip_outputs_identical(how):
    m = randomize(LayerNorm((3, 4), eps=1e-3, bias=True), seed=12)
    m.eval()
    if how == "pickle":
        m2 = pickle.loads(pickle.dumps(m))
    elif how == "deepcopy":
        m2 = copy.deepcopy(m)
    else:
        m2 = copy.copy(m)
    x = spread_input((5, 3, 4), (3, 4), np.float32, seed=13)
    assert type(m2) is LayerNorm
    assert repr(m2) == repr(m)
    assert m2.training is False and m2.eps == 1e-3 and m2.normalized_shape == (3, 4)
    np.testing.assert_array_equal(m2(x), m(x))
    np.testing.assert_array_equal(m2.weight, m.weight)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copy_is_independent(how):
    m = known_module()
    m2 = pickle.loads(pickle.dumps(m)) if how == "pickle" else copy.deepcopy(m)
    before = params(m)
    m2.weight[...] = 0.0
    m2.bias[...] = 0.0
    assert_params_equal(m, before)


@pytest.mark.parametrize("kwargs", [{"bias": False}, {"elementwise_affine": False}],
                         ids=["no_bias", "no_affine"])
def test_pickle_round_trip_keeps_none_params(kwargs):
    m = LayerNorm(4, **kwargs)
    m2 = pickle.loads(pickle.dumps(m))
    assert repr(m2) == repr(m)
    assert (m2.weight is None) == (m.weight is None) and m2.bias is None


# ---------------------------------------------------------------------------------------------
# device, bad sizes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", [None, "cpu"], ids=["None", "cpu"])
def test_device_cpu_accepted(device):
    m = LayerNorm(4, device=device)
    assert m.weight.shape == (4,)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta"])
def test_device_not_cpu_raises_value_error(device):
    with pytest.raises(ValueError):
        LayerNorm(4, device=device)


@pytest.mark.parametrize("ns", [-1, [2, -1], (-3, 4)], ids=["int", "list", "tuple"])
def test_negative_size_raises(ns):
    with pytest.raises(ValueError):
        LayerNorm(ns)


@requires_torch
@pytest.mark.parametrize("ns", [-1, [2, -1], (-3, 4)], ids=["int", "list", "tuple"])
def test_torch_negative_size_raises(ns):
    with pytest.raises(RuntimeError):  # the oracle
        torch.nn.LayerNorm(ns)


def test_negative_size_no_affine_raises_at_latest_in_forward():
    # torch builds no parameter, so it can only fail when the module is used.
    with pytest.raises(ValueError):
        m = LayerNorm([2, -1], elementwise_affine=False)
        m(np.zeros((3, 2, 1), np.float32))


@requires_torch
def test_torch_empty_normalized_shape_raises_in_forward():
    with pytest.raises(RuntimeError, match="at least 1-dimensional"):
        torch.nn.LayerNorm([])(torch.zeros(3))


def test_empty_normalized_shape_raises_in_forward():
    with pytest.raises(ValueError, match="at least 1-dimensional"):
        m = LayerNorm([])
        m(np.zeros(3, np.float32))


def test_forward_wrong_trailing_shape_raises_torch_text():
    m = LayerNorm([2, 2])
    with pytest.raises(ValueError) as err:
        m(np.zeros((2, 2, 3), np.float32))
    assert ("Given normalized_shape=[2, 2], expected input with shape [*, 2, 2], "
            "but got input of size[2, 2, 3]") in str(err.value)


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------

def test_forward_equals_call():
    m = known_module()
    x = spread_input((3, 4), (4,), np.float32, seed=14)
    np.testing.assert_array_equal(m.forward(x), m(x))


def test_forward_equals_functional_layer_norm():
    m = known_module()
    x = spread_input((3, 4), (4,), np.float32, seed=15)
    np.testing.assert_array_equal(m(x), layernorm.layer_norm(x, (4,), m.weight, m.bias, m.eps))


def test_forward_does_not_mutate_input():
    m = known_module()
    x = spread_input((3, 4), (4,), np.float32, seed=16)
    saved = x.copy()
    m(x)
    np.testing.assert_array_equal(x, saved)


@pytest.mark.parametrize("kind", ["list", pytest.param("torch_tensor", marks=requires_torch)])
def test_forward_accepts_array_likes(kind):
    m = known_module()
    x = spread_input((3, 4), (4,), np.float32, seed=17)
    arg = x.tolist() if kind == "list" else torch.from_numpy(x.copy())
    expected = reference_output(x, (4,), m.weight, m.bias, m.eps)
    y = np.asarray(m(arg))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# torch's own ModuleInfo inputs for nn.LayerNorm (torch-facts.md): (id, ctor args, input shape)
MODULE_INFO = [
    ("ns5_in_4x5x5", ([5],), {}, (4, 5, 5)),
    ("ns5_in_128x5x5", ([5],), {}, (128, 5, 5)),
    ("ns2x2x5_in_4x2x2x5", ([2, 2, 5],), {}, (4, 2, 2, 5)),
    ("ns5_in_0x5", ([5],), {}, (0, 5)),
    ("ns5_no_bias_in_4x5x5", ([5],), {"bias": False}, (4, 5, 5)),
    ("ns5_eps_1e-3_in_4x5x5", ([5], 1e-3), {}, (4, 5, 5)),
]


@requires_torch
@pytest.mark.parametrize("case_id, args, kwargs, shape", MODULE_INFO, ids=[c[0] for c in MODULE_INFO])
@pytest.mark.parametrize("params_kind", ["default", "randn"])
def test_torch_module_info_case(case_id, args, kwargs, shape, params_kind):
    theirs = torch.nn.LayerNorm(*args, **kwargs)
    ours = LayerNorm(*args, **kwargs)
    if params_kind == "randn":
        randomize_torch(theirs, seed=18)
        ours.load_state_dict(theirs.state_dict())
    x = np.random.default_rng(19).standard_normal(shape).astype(np.float32)
    y = ours(x)
    expected = torch_out(theirs, x)
    assert y.shape == expected.shape == shape and y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    ref = reference_output(x, ours.normalized_shape, to_numpy(theirs.weight), to_numpy(theirs.bias),
                         ours.eps)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@requires_torch
def test_float16_input_to_float32_module_matches_torch():
    # torch allows half input with float32 parameters; the output stays float16.
    theirs = randomize_torch(torch.nn.LayerNorm(8), seed=20)
    ours = LayerNorm(8)
    ours.load_state_dict(theirs.state_dict())
    x = spread_input((6, 8), (8,), np.float16, seed=21)
    y = ours(x)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), torch_out(theirs, x).astype(np.float32),
                               rtol=4e-3, atol=4e-3)


@requires_torch
def test_float64_input_to_float32_module_torch_raises():
    # The oracle's behaviour we deliberately differ from (see the next test).
    with pytest.raises(RuntimeError, match="mixed dtype"):
        torch.nn.LayerNorm(8)(torch.zeros(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("shape, ns", [((6, 8), (8,)), ((2, 3, 4, 5), (4, 5)), ((5,), (5,))],
                         ids=["6x8", "2x3x4x5", "1d"])
def test_float64_input_to_float32_module_computed_in_float64(shape, ns):
    # DELIBERATE DIFFERENCE FROM TORCH: torch raises "mixed dtype" for float64 input with float32
    # parameters; we convert the parameters to float64 and compute in float64.
    ours = randomize(LayerNorm(ns), seed=22)
    x = np.random.default_rng(23).standard_normal(shape) * 10 + 1e3  # float64, large offset
    y = ours(x)
    assert y.dtype == np.float64
    expected = reference_output(x, ns, ours.weight.astype(np.float64), ours.bias.astype(np.float64),
                              ours.eps)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# training mode: what forward keeps for backward
# ---------------------------------------------------------------------------------------------

def _overwrite(kind, x):
    """Return (what to pass to forward, a function that changes its values afterwards)."""
    if kind == "ndarray":
        arg = x.copy()
        return arg, lambda: arg.fill(0.0)
    if kind == "read_only_view":  # read-only, but its base is not
        base = x.copy()
        arg = base.view()
        arg.flags.writeable = False
        return arg, lambda: base.fill(0.0)
    if kind == "fortran":
        arg = np.asfortranarray(x)
        return arg, lambda: arg.fill(0.0)
    if kind == "array_interface":  # an object whose __array__ hands out an array it keeps
        arg = KeepsItsArray(x.copy())
        return arg, lambda: arg.kept.fill(0.0)
    arg = torch.from_numpy(x.copy())  # torch_tensor: np.asarray shares its memory
    return arg, lambda: arg.zero_()


class KeepsItsArray:
    """Array-like whose __array__ returns the very (data-owning) array it holds."""

    def __init__(self, kept):
        self.kept = kept

    def __array__(self, dtype=None, copy=None):
        return self.kept


@pytest.mark.parametrize("kind", ["ndarray", "read_only_view", "fortran",
                                  pytest.param("torch_tensor", marks=requires_torch), "array_interface"])
def test_input_changed_after_training_forward_does_not_change_backward(kind):
    # torch's autograd refuses a backward through a modified saved tensor; a silently different
    # gradient would be worse than both: backward must use the input as it was at forward time.
    rng = np.random.default_rng(30)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    dy = rng.standard_normal((5, 6)).astype(np.float32)
    ours = LayerNorm(6)
    ours.load_state_dict({"weight": rng.standard_normal(6), "bias": rng.standard_normal(6)})
    arg, overwrite = _overwrite(kind, x)
    ours(arg)
    overwrite()
    grad_input = ours.backward(dy)
    t_gi, t_dw, t_db = reference_backward(dy, x, (6,), ours.weight, ours.bias)
    np.testing.assert_allclose(grad_input, t_gi, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.weight_grad, t_dw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.bias_grad, t_db, rtol=1e-5, atol=1e-5)


def test_failed_training_forward_leaves_nothing_for_backward():
    # backward() goes through the last training-mode call; when that call raised, there is
    # nothing to go through (not the call before it).
    ours = LayerNorm(6)
    x = np.random.default_rng(31).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    with pytest.raises(ValueError):
        ours(np.zeros((3, 7), np.float32))
    with pytest.raises(RuntimeError):
        ours.backward(np.ones((3, 6), np.float32))
    assert ours.weight_grad is None and ours.bias_grad is None


# ---------------------------------------------------------------------------------------------
# dtype= and device= spelled the torch way
# ---------------------------------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("name", ["float16", "float32", "float64"])
def test_torch_dtype_argument(name):
    # Code ported from torch passes torch dtypes: the parameters get the matching NumPy dtype.
    dtype = torch_dtype(name)
    ours, theirs = LayerNorm((2, 3), dtype=dtype), torch.nn.LayerNorm((2, 3), dtype=dtype)
    for name in ("weight", "bias"):
        mine, ref = getattr(ours, name), getattr(theirs, name)
        assert mine.dtype == numpy_dtype_of(ref), name
        np.testing.assert_array_equal(mine, to_numpy(ref), err_msg=name)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64, np.longdouble, "U4", object],
                         ids=["int32", "bool", "complex64", "longdouble", "str", "object"])
def test_non_float_dtype_argument_raises_type_error(dtype):
    with pytest.raises(TypeError) as info:
        LayerNorm(4, dtype=dtype)
    assert "float" in str(info.value)


@requires_torch
@pytest.mark.parametrize("name", ["int64", "bfloat16", "complex64"], ids=lambda n: f"torch.{n}")
def test_non_float_torch_dtype_argument_raises_type_error(name):
    with pytest.raises(TypeError) as info:
        LayerNorm(4, dtype=torch_dtype(name))
    assert "float" in str(info.value)


@requires_torch
def test_torch_cpu_device_accepted():
    m = LayerNorm(4, device=torch.device("cpu"))
    assert m.weight.shape == (4,)


@requires_torch
def test_torch_meta_device_raises_value_error():
    with pytest.raises(ValueError):
        LayerNorm(4, device=torch.device("meta"))


# ---------------------------------------------------------------------------------------------
# training with float16 / float64 parameters, zero_grad(set_to_none=False)
# ---------------------------------------------------------------------------------------------

# Relative to the largest expected magnitude: float64 to ~1e-9; float16 results are rounded to
# float16 once per step and once more when accumulated: 3 half-ulps (2**-11 each).
MODULE_GRAD_RTOL = {"float16": 3 * 2.0**-11, "float64": 1e-9}


@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_module_two_training_steps_in_param_dtype_match_torch_float64(dtype):
    rng = np.random.default_rng(32)
    ours = LayerNorm((3, 5), dtype=np.dtype(dtype))
    ours.load_state_dict({"weight": rng.standard_normal((3, 5)), "bias": rng.standard_normal((3, 5))})
    # the oracle: torch in float64 on the same (exactly representable) numbers
    theirs = torch.nn.LayerNorm((3, 5), dtype=torch.float64)
    theirs.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in ours.state_dict().items()})
    rtol = MODULE_GRAD_RTOL[dtype]
    for step in range(2):
        x = rng.standard_normal((4, 3, 5)).astype(dtype)
        dy = rng.standard_normal((4, 3, 5)).astype(dtype)
        ours(x)
        grad_input = ours.backward(dy)
        xt = torch.from_numpy(x.astype(np.float64)).requires_grad_(True)
        theirs(xt).backward(torch.from_numpy(dy.astype(np.float64)))
        assert grad_input.dtype == np.dtype(dtype)
        expected = xt.grad.numpy()
        np.testing.assert_allclose(grad_input, expected, rtol=0, atol=rtol * np.abs(expected).max())
    for name in ("weight", "bias"):
        mine, expected = getattr(ours, name + "_grad"), getattr(theirs, name).grad.numpy()
        assert mine.dtype == np.dtype(dtype), name
        np.testing.assert_allclose(mine, expected, rtol=0, atol=rtol * np.abs(expected).max(), err_msg=name)


def test_zero_grad_set_to_none_false_zeroes_in_place():
    x = np.random.default_rng(33).standard_normal((3, 6)).astype(np.float32)
    ours = LayerNorm(6)
    ours(x)
    ours.backward(np.ones((3, 6), np.float32))
    grad = ours.weight_grad
    ours.zero_grad(set_to_none=False)
    assert ours.weight_grad is grad  # the same array, zeroed
    np.testing.assert_array_equal(ours.weight_grad, np.zeros(6))
    np.testing.assert_array_equal(ours.bias_grad, np.zeros(6))


@requires_torch
def test_zero_grad_set_to_none_false_zeroes_in_place_like_torch():
    x = np.random.default_rng(33).standard_normal((3, 6)).astype(np.float32)
    ours, theirs = LayerNorm(6), torch.nn.LayerNorm(6)
    ours(x)
    ours.backward(np.ones((3, 6), np.float32))
    theirs(torch.from_numpy(x)).sum().backward()
    ours.zero_grad(set_to_none=False)
    theirs.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(ours.weight_grad, theirs.weight.grad.numpy())
    np.testing.assert_array_equal(ours.bias_grad, theirs.bias.grad.numpy())


def test_zero_grad_set_to_none_false_without_gradients_leaves_none():
    fresh = LayerNorm(6)
    fresh.zero_grad(set_to_none=False)  # no gradient yet: stays None, as in torch
    assert fresh.weight_grad is None and fresh.bias_grad is None


@requires_torch
def test_torch_zero_grad_set_to_none_false_without_gradients_leaves_none():
    fresh_torch = torch.nn.LayerNorm(6)
    fresh_torch.zero_grad(set_to_none=False)
    assert fresh_torch.weight.grad is None


# ---------------------------------------------------------------------------------------------
# training: backward and gradient accumulation against torch autograd
# ---------------------------------------------------------------------------------------------

def torch_and_ours(ns, seed, **kwargs):
    tm = torch.nn.LayerNorm(ns, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tm.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ours = LayerNorm(ns, **kwargs)
    ours.load_state_dict(tm.state_dict())
    return tm, ours


def torch_step(tm, x, dy):
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    tm(xt).backward(torch.from_numpy(dy.copy()))
    return xt.grad.numpy()


MODULE_KW = [("affine", {}), ("no_bias", {"bias": False}), ("no_affine", {"elementwise_affine": False})]


@requires_torch
@pytest.mark.parametrize("kw_id, kwargs", MODULE_KW, ids=[k[0] for k in MODULE_KW])
def test_module_training_forward_backward_matches_torch(kw_id, kwargs):
    tm, ours = torch_and_ours((3, 5), seed=14, **kwargs)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((4, 3, 5)).astype(np.float32)
    dy = rng.standard_normal((4, 3, 5)).astype(np.float32)
    assert ours.weight_grad is None and ours.bias_grad is None
    y = ours(x)
    with torch.no_grad():
        np.testing.assert_allclose(y, tm(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)
    gi = ours.backward(dy)
    tgi = torch_step(tm, x, dy)
    assert_close(gi, tgi, 1e-5, "grad_input")
    for name in ("weight", "bias"):
        tp = getattr(tm, name)
        mine = getattr(ours, name + "_grad")
        if tp is None:
            assert mine is None, name
        else:
            assert_close(mine, tp.grad.numpy(), 1e-5, name + "_grad")


@requires_torch
def test_module_two_steps_accumulate_like_torch_grad():
    tm, ours = torch_and_ours((3, 5), seed=16)
    rng = np.random.default_rng(17)
    for step in range(2):
        x = rng.standard_normal((4, 3, 5)).astype(np.float32)
        dy = rng.standard_normal((4, 3, 5)).astype(np.float32)
        gi = ours.backward(dy) if ours(x) is not None else None
        tgi = torch_step(tm, x, dy)
        assert_close(gi, tgi, 1e-5, f"grad_input step {step}")
    assert_close(ours.weight_grad, tm.weight.grad.numpy(), 1e-5, "weight_grad")
    assert_close(ours.bias_grad, tm.bias.grad.numpy(), 1e-5, "bias_grad")
    # and the accumulation really is a sum of two different gradients, not the last one
    single = reference_backward(dy, x, (3, 5), ours.weight, ours.bias)[1]
    assert not np.allclose(ours.weight_grad, single, rtol=1e-3, atol=1e-3)


def test_module_zero_grad_sets_none():
    ours = randomize(LayerNorm(6), seed=18)
    x = np.random.default_rng(19).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    ours.backward(np.ones((3, 6), np.float32))
    assert ours.weight_grad is not None and ours.bias_grad is not None
    ours.zero_grad()
    assert ours.weight_grad is None and ours.bias_grad is None


def test_module_zero_grad_then_backward_starts_fresh():
    ours = randomize(LayerNorm(6), seed=20)
    rng = np.random.default_rng(21)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    dy = rng.standard_normal((3, 6)).astype(np.float32)
    ours(x)
    ours.backward(dy)
    ours.zero_grad()
    ours(x)
    ours.backward(dy)
    _, dw, db = reference_backward(dy, x, (6,), ours.weight, ours.bias)
    assert_close(ours.weight_grad, dw, 1e-5, "weight_grad")
    assert_close(ours.bias_grad, db, 1e-5, "bias_grad")


def test_module_backward_before_any_forward_raises():
    ours = LayerNorm(6)
    with pytest.raises(RuntimeError):
        ours.backward(np.ones((3, 6), np.float32))
    assert ours.weight_grad is None and ours.bias_grad is None


def test_module_eval_forward_then_backward_raises():
    ours = LayerNorm(6).eval()
    x = np.random.default_rng(22).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    with pytest.raises(RuntimeError):
        ours.backward(np.ones((3, 6), np.float32))
    assert ours.weight_grad is None and ours.bias_grad is None


# ---------------------------------------------------------------------------------------------
# Parameters changed between the training forward and backward: torch refuses a backward
# through a saved tensor modified in place; silently using the new values would give gradients
# of another function than the one whose output was used
# ---------------------------------------------------------------------------------------------

def _forward_then(change, **kwargs):
    """A module after a training forward and `change(module)`; backward() is what is tested."""
    ours = randomize(LayerNorm(4, **kwargs), seed=40)
    ours(np.random.default_rng(41).standard_normal((3, 4)).astype(np.float32))
    change(ours)
    return ours


def _double(name):
    def change(module):
        getattr(module, name)[...] *= 2
    return change


IN_PLACE_CHANGES = {
    "weight-doubled": (_double("weight"), "weight [float32 array [4]]"),
    "bias-doubled": (_double("bias"), "bias [float32 array [4]]"),
    "weight-loaded": (lambda m: m.load_state_dict({"weight": np.full(4, 3.0), "bias": m.bias}),
                      "weight [float32 array [4]]"),
    "reset_parameters": (lambda m: m.reset_parameters(), "weight [float32 array [4]]"),
}


@pytest.mark.parametrize("kind", list(IN_PLACE_CHANGES))
def test_backward_refuses_a_parameter_changed_in_place(kind):
    change, named = IN_PLACE_CHANGES[kind]
    ours = _forward_then(change)
    with pytest.raises(RuntimeError) as info:
        ours.backward(np.ones((3, 4), np.float32))
    assert str(info.value) == (
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: LayerNorm.{named} changed after the forward call. Call the module on its "
        "input again before backward()."
    )
    assert ours.weight_grad is None and ours.bias_grad is None


@requires_torch
def test_backward_refuses_a_parameter_changed_in_place_in_torchs_words():
    theirs = torch.nn.LayerNorm(4)
    y = theirs(torch.ones(3, 4))
    with torch.no_grad():
        theirs.weight *= 2
    expected = torch_message(lambda: y.backward(torch.ones(3, 4)))
    ours = _forward_then(_double("weight"))
    with pytest.raises(RuntimeError) as info:
        ours.backward(np.ones((3, 4), np.float32))
    assert str(info.value).startswith(expected.split(": [torch.")[0] + ": ")


REPLACEMENTS = {
    "weight-by-None": ("weight", lambda m: None, "float32 array [4] by None"),
    "bias-by-None": ("bias", lambda m: None, "float32 array [4] by None"),
    "weight-by-an-equal-copy": ("weight", lambda m: m.weight.copy(), "float32 array [4] by float32 array [4]"),
    "bias-by-float64": ("bias", lambda m: m.bias.astype(np.float64), "float32 array [4] by float64 array [4]"),
}


@pytest.mark.parametrize("kind", list(REPLACEMENTS))
def test_backward_refuses_a_replaced_parameter(kind):
    name, make, described = REPLACEMENTS[kind]
    ours = _forward_then(lambda m: setattr(m, name, make(m)))
    with pytest.raises(RuntimeError) as info:
        ours.backward(np.ones((3, 4), np.float32))
    assert str(info.value) == (
        f"LayerNorm.{name} was replaced after the forward call ({described}): call the module on "
        "its input again before backward()."
    )


def test_backward_refuses_a_parameter_added_after_the_forward():
    ours = _forward_then(lambda m: setattr(m, "bias", np.zeros(4, np.float32)), bias=False)
    with pytest.raises(RuntimeError, match=r"LayerNorm\.bias was replaced .*\(None by float32 array \[4\]\)"):
        ours.backward(np.ones((3, 4), np.float32))


def test_backward_takes_parameters_changed_and_changed_back():
    # The values are what matters: a parameter changed and restored before backward is the
    # parameter the forward used.
    def change_and_restore(module):
        module.weight *= 2
        module.weight /= 2

    ours = _forward_then(change_and_restore)
    expected = _forward_then(lambda m: None)
    np.testing.assert_array_equal(ours.backward(np.ones((3, 4), np.float32)),
                                  expected.backward(np.ones((3, 4), np.float32)))
    np.testing.assert_array_equal(ours.weight_grad, expected.weight_grad)


def test_parameters_changed_after_backward_are_for_the_next_forward():
    # The optimizer's step: gradients, then an in-place update, then the next forward.
    ours = _forward_then(lambda m: None)
    ours.backward(np.ones((3, 4), np.float32))
    ours.weight -= 0.1 * ours.weight_grad
    ours(np.ones((3, 4), np.float32))
    ours.backward(np.ones((3, 4), np.float32))
