"""layernorm.LayerNorm and layernorm.RMSNorm against torch.nn.LayerNorm and torch.nn.RMSNorm (the
oracles) and layernorm._reference: repr, attributes, parameters, state_dict, forward, train/eval,
copies, training (backward with gradient accumulation), and axis= (ConvNeXt's channels-first
LayerNorm).

What NormModule gives every kind (state_dict, load_state_dict, modes, copies, backward and its
refusals) is tested once per kind: each test takes a Kind.  Every comparison builds the torch
module next to ours with the same arguments, so the expected repr, attributes, state_dict and
outputs come from torch itself, never from a run of our code.
"""

import copy
import pickle
import re
from typing import NamedTuple, Tuple

import numpy as np
import pytest

import layernorm
from helpers import (
    BF16,
    LAYER_NORM,
    RMS_NORM,
    NormKind,
    assert_close,
    requires_torch,
    torch,
    torch_dtype,
    torch_message,
)
from layernorm import _reference

# Tolerances for our output against torch's or the float64 reference, by the dtype of the output.
ATOL = {np.dtype(np.float16): 4e-3, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12}


# ---------------------------------------------------------------------------------------------
# The kinds of module
# ---------------------------------------------------------------------------------------------

class Kind(NamedTuple):
    """A norm module: ours (looked up in layernorm when a test runs, so that a missing class fails
    its tests, not the file) and torch's of the same name."""

    name: str  # the class's name in layernorm and in torch.nn
    parameters: Tuple[Tuple[str, float], ...]  # (name, initial value) of a default module's parameters
    functional: NormKind  # its functions and float64 reference (helpers)

    def __str__(self):
        return self.name

    def ours(self, *args, **kwargs):
        return getattr(layernorm, self.name)(*args, **kwargs)

    def theirs(self, *args, **kwargs):
        return getattr(torch.nn, self.name)(*args, **kwargs)

    @property
    def names(self):
        return tuple(name for name, _ in self.parameters)

    def reference(self, x, module, weight=None, bias=None):
        """The float64 output of a module with these settings and parameters."""
        return self.functional.reference(x, module.normalized_shape, weight, bias, module.eps,
                                         axis=getattr(module, "axis", None))[0]

    def module_reference(self, x, module):
        """The float64 output of `module` (ours or torch's) on x."""
        return self.reference(x, module, *map(to_numpy, param_values(self, module)))

    def reference_backward(self, dy, x, module):
        """The float64 (grad_input, {name: gradient}) of `module` (ours) at x."""
        eps = self.functional.eps_value(x, module.eps)
        centred = self.functional.centred
        ns, axis = module.normalized_shape, getattr(module, "axis", None)
        values = param_values(self, module)
        if centred:
            gi, gw, gb = _reference.layer_norm_backward(dy, x, ns, *values, eps, axis=axis)
        else:
            (gi, gw), gb = _reference.rms_norm_backward(dy, x, ns, *values, eps, axis=axis), None
        return gi, dict(zip(self.names, (gw, gb)))


LAYER = Kind("LayerNorm", (("weight", 1.0), ("bias", 0.0)), LAYER_NORM)
RMS = Kind("RMSNorm", (("weight", 1.0),), RMS_NORM)
KINDS = (LAYER, RMS)
BY_KIND = pytest.mark.parametrize("kind", KINDS, ids=str)


def by_kind(cases):
    """pytest params (kind, *case) from {kind: [(case id, ...), ...]}, with ids kind-case."""
    return [pytest.param(kind, *case, id=f"{kind}-{case[0]}") for kind, kind_cases in cases.items()
            for case in kind_cases]


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


def param_values(kind, module):
    """The module's parameters (ours or torch's) in the kind's order, None where absent."""
    return tuple(getattr(module, name, None) for name in kind.names)


def randomize(module, seed):
    """Give one of our modules non-default parameters drawn with NumPy; return it."""
    rng = np.random.default_rng(seed)
    module.load_state_dict({name: rng.standard_normal(value.shape) for name, value in module.named_parameters()})
    return module


def torch_out(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def to_numpy(t):
    return None if t is None else t.detach().numpy() if torch is not None and isinstance(t, torch.Tensor) else t


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


def params(kind, m):
    return tuple(None if p is None else p.copy() for p in param_values(kind, m))


def assert_params_equal(kind, m, expected):
    for name, now, was in zip(kind.names, param_values(kind, m), expected):
        if was is None:
            assert now is None, name
        else:
            np.testing.assert_array_equal(now, was, err_msg=name)


# ---------------------------------------------------------------------------------------------
# constructor combinations: (id, normalized_shape, kwargs); "dtype" given as a numpy dtype name
# ---------------------------------------------------------------------------------------------

SHARED_CTOR_CASES = [
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
    ("dtype_float16", 4, {"dtype": "float16"}),
    ("dtype_float32", 4, {"dtype": "float32"}),
    ("dtype_float64", (2, 3), {"dtype": "float64"}),
    ("dtype_float64_no_affine", 5, {"dtype": "float64", "elementwise_affine": False}),
    ("device_none", 4, {"device": None}),
    ("device_cpu", 4, {"device": "cpu"}),
]
CTOR_CASES = {
    LAYER: SHARED_CTOR_CASES + [
        ("no_affine_bias_true", 4, {"elementwise_affine": False, "bias": True}),
        ("no_affine_no_bias", 4, {"elementwise_affine": False, "bias": False}),
        ("no_bias", 4, {"bias": False}),
        ("no_bias_list", [2, 3], {"bias": False}),
        ("dtype_float16_no_bias", [2, 3], {"dtype": "float16", "bias": False}),
        ("all_keywords", [6], {"eps": 1e-6, "elementwise_affine": True, "bias": True,
                               "device": "cpu", "dtype": "float32"}),
    ],
    RMS: SHARED_CTOR_CASES + [
        ("eps_None", 4, {"eps": None}),
        ("eps_None_float16", [2, 3], {"eps": None, "dtype": "float16"}),
        ("eps_None_float64", 4, {"eps": None, "dtype": "float64"}),
        ("all_keywords", [6], {"eps": 1e-6, "elementwise_affine": True, "device": "cpu", "dtype": "float32"}),
    ],
}
CTOR_PARAMS = by_kind(CTOR_CASES)


def build_ours(kind, ns, kwargs):
    """Our module for a constructor case."""
    ours_kw = dict(kwargs)
    if "dtype" in kwargs:
        ours_kw["dtype"] = np.dtype(kwargs["dtype"])
    return kind.ours(ns, **ours_kw)


def build_pair(kind, ns, kwargs):
    """(ours, torch's) for a constructor case."""
    torch_kw = dict(kwargs)
    if "dtype" in kwargs:
        torch_kw["dtype"] = torch_dtype(kwargs["dtype"])
    ns_torch = list(ns) if isinstance(ns, list) else ns
    return build_ours(kind, ns, kwargs), kind.theirs(ns_torch, **torch_kw)


# torch stores a numpy integer as given, so its repr prints "(np.int64(4),)"; we store Python ints
# and print "(4,)". A cosmetic difference we do not mirror, so that case is left out of the repr tests.
REPR_PARAMS = by_kind({kind: [c for c in cases if c[0] != "numpy_int64"] for kind, cases in CTOR_CASES.items()})


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", REPR_PARAMS)
def test_repr_identical_to_torch(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    assert repr(ours) == repr(theirs)


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", REPR_PARAMS)
def test_extra_repr_identical_to_torch(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    assert ours.extra_repr() == theirs.extra_repr()


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", CTOR_PARAMS)
def test_scalar_attributes_match_torch(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    assert type(ours.normalized_shape) is tuple
    assert ours.normalized_shape == theirs.normalized_shape
    assert ours.eps == theirs.eps and type(ours.eps) is type(theirs.eps)  # stored as given
    assert ours.elementwise_affine is theirs.elementwise_affine
    assert ours.training is True


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", CTOR_PARAMS)
def test_parameters_match_torch(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    for name in kind.names:
        mine, ref = getattr(ours, name), getattr(theirs, name)
        if ref is None:
            assert mine is None, name
            continue
        assert isinstance(mine, np.ndarray), name
        assert mine.shape == tuple(ref.shape), name
        assert mine.dtype == numpy_dtype_of(ref), name
        np.testing.assert_array_equal(mine, to_numpy(ref), err_msg=name)


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", CTOR_PARAMS)
def test_state_dict_matches_torch(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    sd, tsd = ours.state_dict(), theirs.state_dict()
    assert list(sd.keys()) == list(tsd.keys())
    for key, ref in tsd.items():
        assert isinstance(sd[key], np.ndarray), key
        assert sd[key].dtype == numpy_dtype_of(ref), key
        np.testing.assert_array_equal(sd[key], ref.numpy(), err_msg=key)


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", CTOR_PARAMS)
def test_forward_default_params_matches_torch(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((3,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=1)
    y = ours(x)
    expected = torch_out(theirs, x)
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(y, expected, rtol=ATOL[dtype], atol=ATOL[dtype])


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", CTOR_PARAMS)
def test_forward_randn_params_matches_torch_and_float64(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    randomize_torch(theirs, seed=2)
    ours.load_state_dict(theirs.state_dict())
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((5,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=3)
    y = ours(x)
    np.testing.assert_allclose(y, torch_out(theirs, x), rtol=ATOL[dtype], atol=ATOL[dtype])
    np.testing.assert_allclose(y, kind.module_reference(x, theirs), rtol=ATOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("kind, case_id, ns, kwargs", CTOR_PARAMS)
def test_forward_random_params_matches_reference(kind, case_id, ns, kwargs):
    ours = randomize(build_ours(kind, ns, kwargs), seed=2)
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((5,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=3)
    y = ours(x)
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(y, kind.module_reference(x, ours), rtol=ATOL[dtype], atol=ATOL[dtype])


@BY_KIND
def test_eps_zero_repr_is_eps_0(kind):
    # eps is kept as given: an int 0 prints as "eps=0", not "eps=0.0".
    assert "eps=0," in repr(kind.ours(4, eps=0))


@requires_torch
@BY_KIND
def test_eps_zero_repr_is_torchs(kind):
    assert repr(kind.ours(4, eps=0)) == repr(kind.theirs(4, eps=0))


def test_rms_norm_repr_is_torchs_text():
    assert repr(RMS.ours(4)) == "RMSNorm((4,), eps=None, elementwise_affine=True)"
    assert repr(RMS.ours([2, 3], eps=1e-5, elementwise_affine=False)) == (
        "RMSNorm((2, 3), eps=1e-05, elementwise_affine=False)")


# ---------------------------------------------------------------------------------------------
# RMSNorm's eps=None: torch's rule, the machine epsilon of the input's compute type
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module_dtype, input_dtype", [("float32", "float32"), ("float32", "float16"),
                                                       ("float32", "float64"), ("float64", "float64"),
                                                       ("float16", "float16")])
def test_rms_norm_eps_none_follows_the_input(module_dtype, input_dtype):
    # rows of mean square 1e-14: float32's eps (1.2e-7) and float64's (2.2e-16) give different outputs
    x = np.full((3, 8), 1e-7, input_dtype) if input_dtype == "float64" else np.full((3, 8), 1e-3, input_dtype)
    x[:, ::2] *= -1
    ours = RMS.ours(8, dtype=np.dtype(module_dtype))
    y = ours(x)
    expected = _reference.rms_norm(x, (8,), None, _reference.rms_norm_default_eps(x.dtype))[0]
    np.testing.assert_allclose(y, expected, rtol=ATOL[np.dtype(input_dtype)], atol=ATOL[np.dtype(input_dtype)])


@requires_torch
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # float16 input, float32 weight
@pytest.mark.parametrize("input_dtype", ["float16", "float32", "float64"])
def test_rms_norm_eps_none_like_torch(input_dtype):
    x = np.full((3, 8), 1e-7 if input_dtype == "float64" else 1e-3, input_dtype)
    x[:, ::2] *= -1
    np.testing.assert_allclose(RMS.ours(8)(x), torch_out(RMS.theirs(8), x), rtol=ATOL[np.dtype(input_dtype)],
                               atol=ATOL[np.dtype(input_dtype)])


# ---------------------------------------------------------------------------------------------
# state_dict / load_state_dict
# ---------------------------------------------------------------------------------------------

SHARED_LOAD_CASES = [
    ("1d", 8, {}),
    ("3d", [3, 5, 5], {}),
    ("float64", (2, 3), {"dtype": "float64"}),
]
LOAD_PARAMS = by_kind({LAYER: SHARED_LOAD_CASES + [("no_bias", 8, {"bias": False})], RMS: SHARED_LOAD_CASES})


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", LOAD_PARAMS)
def test_load_state_dict_from_sgd_trained_torch(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    train_torch(theirs, steps=3, seed=4)
    assert not torch.equal(theirs.weight, torch.ones_like(theirs.weight))  # training moved it
    ours.load_state_dict(theirs.state_dict())
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((7,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=5)
    np.testing.assert_allclose(ours(x), torch_out(theirs, x), rtol=ATOL[dtype], atol=ATOL[dtype])


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", LOAD_PARAMS)
def test_load_state_dict_from_torch_tensors_copies_values(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    randomize_torch(theirs, seed=6)
    ours.load_state_dict(theirs.state_dict())
    for name, p in theirs.named_parameters():
        mine = getattr(ours, name)
        assert isinstance(mine, np.ndarray)
        assert mine.dtype == numpy_dtype_of(p)
        np.testing.assert_array_equal(mine, to_numpy(p))


@requires_torch
@pytest.mark.parametrize("kind, case_id, ns, kwargs", LOAD_PARAMS)
def test_load_state_dict_from_numpy_arrays(kind, case_id, ns, kwargs):
    ours, theirs = build_pair(kind, ns, kwargs)
    randomize_torch(theirs, seed=7)
    ours.load_state_dict({k: v.numpy().copy() for k, v in theirs.state_dict().items()})
    dtype = np.dtype(kwargs.get("dtype", "float32"))
    x = spread_input((4,) + ours.normalized_shape, ours.normalized_shape, dtype, seed=8)
    np.testing.assert_allclose(ours(x), torch_out(theirs, x), rtol=ATOL[dtype], atol=ATOL[dtype])


FLOAT8 = ["float8_e4m3fn", "float8_e5m2"]


@requires_torch
@pytest.mark.parametrize("module_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("float8", FLOAT8)
@BY_KIND
def test_load_state_dict_takes_float8_tensors_as_torch(kind, float8, module_dtype):
    # torch loads a float8 checkpoint by converting each value into the module's parameter
    if module_dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    theirs = kind.theirs(8, dtype=getattr(torch, module_dtype))
    randomize_torch(theirs, seed=9)
    checkpoint = {name: value.to(getattr(torch, float8)) for name, value in theirs.state_dict().items()}
    theirs.load_state_dict(checkpoint)
    ours = kind.ours(8, dtype=module_dtype)
    ours.load_state_dict(checkpoint)
    for name, p in theirs.named_parameters():
        assert getattr(ours, name).dtype.name == module_dtype
        np.testing.assert_array_equal(getattr(ours, name).astype(np.float32), p.detach().float().numpy())
    # assigned, they become float32 (torch keeps float8 parameters, which its forward refuses)
    ours.load_state_dict(checkpoint, assign=True)
    for name, p in theirs.named_parameters():
        assert getattr(ours, name).dtype == np.float32
        np.testing.assert_array_equal(getattr(ours, name), p.detach().float().numpy())


@pytest.mark.parametrize("float8", FLOAT8)
@BY_KIND
def test_load_state_dict_takes_ml_dtypes_float8_arrays(kind, float8):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.array([-3.0, -1.25, -0.4375, 0.0, 0.4375, 1.25, 2.0, 3.0])
    ours = kind.ours(8)
    ours.load_state_dict({name: values.astype(getattr(ml_dtypes, float8)) for name in kind.names})
    for name in kind.names:
        assert getattr(ours, name).dtype == np.float32
        np.testing.assert_array_equal(getattr(ours, name), values.astype(np.float32))


@BY_KIND
def test_load_state_dict_keeps_module_dtype(kind):
    # torch copies into the existing parameter: a float64 checkpoint keeps a float32 module float32.
    ours = kind.ours(4)
    ours.load_state_dict({name: np.full(4, 2.5 + i, np.float64) for i, name in enumerate(kind.names)})
    for i, name in enumerate(kind.names):
        assert getattr(ours, name).dtype == np.float32
        np.testing.assert_array_equal(getattr(ours, name), np.full(4, 2.5 + i, np.float32))


@BY_KIND
def test_load_state_dict_does_not_alias_source(kind):
    ours = kind.ours(4)
    src = {name: np.full(4, 2.0 - i, np.float32) for i, name in enumerate(kind.names)}
    ours.load_state_dict(src)
    for value in src.values():
        value[:] = 99.0
    for i, name in enumerate(kind.names):
        np.testing.assert_array_equal(getattr(ours, name), np.full(4, 2.0 - i, np.float32))


@BY_KIND
def test_state_dict_values_are_copies(kind):
    ours = kind.ours(4)
    sd = ours.state_dict()
    for value in sd.values():
        value[:] = 7.0
    for name, initial in kind.parameters:
        np.testing.assert_array_equal(getattr(ours, name), np.full(4, initial, np.float32))


@BY_KIND
@pytest.mark.parametrize("prefix", ["", "blocks.0.norm"])
def test_parameter_and_state_dict_names_take_torchs_prefix(kind, prefix):
    ours = kind.ours(4)
    lead = prefix + "." if prefix else ""
    assert [name for name, _ in ours.named_parameters(prefix=prefix)] == [lead + name for name in kind.names]
    assert list(ours.state_dict(prefix=lead)) == [lead + name for name in kind.names]
    destination = {"other": 1}
    assert ours.state_dict(destination=destination, prefix=lead) is destination
    assert list(destination) == ["other"] + [lead + name for name in kind.names]
    assert len(ours.parameters(recurse=False)) == len(kind.names)
    assert ours.state_dict(prefix=lead)._metadata == {prefix: {"version": 1}}
    if torch is not None:
        theirs = kind.theirs(4)
        assert list(ours.state_dict(prefix=lead)) == list(theirs.state_dict(prefix=lead))
        assert ours.state_dict(prefix=lead)._metadata == theirs.state_dict(prefix=lead)._metadata
        assert ([name for name, _ in ours.named_parameters(prefix=prefix)]
                == [name for name, _ in theirs.named_parameters(prefix=prefix)])


@BY_KIND
def test_state_dict_keep_vars_gives_the_parameters_themselves(kind):
    ours = kind.ours(4)
    kept = ours.state_dict(keep_vars=True)
    assert all(kept[name] is getattr(ours, name) for name in kind.names)


@BY_KIND
def test_load_state_dict_assign_makes_the_values_the_parameters(kind):
    ours = kind.ours(4)
    values = {name: np.full(4, 2.0 - i, np.float64) for i, name in enumerate(kind.names)}
    values["weight"].flags.writeable = False  # a read-only value is copied, so updates still work
    assert tuple(ours.load_state_dict(values, assign=True)) == ([], [])
    for name in kind.names:
        param = getattr(ours, name)
        assert param.dtype == np.float64 and param.flags.writeable
        np.testing.assert_array_equal(param, values[name])
        assert (param is values[name]) == (name != "weight")
    ours.load_state_dict({name: np.arange(4) for name in kind.names}, assign=True)  # integers: cast
    assert all(getattr(ours, name).dtype == np.float64 for name in kind.names)
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        ours.load_state_dict({name: np.ones(5) for name in kind.names}, assign=True)


@BY_KIND
def test_load_state_dict_assign_keeps_only_the_dtypes_a_module_can_have(kind):
    # values in the other byte order become native float32; long doubles are refused as the
    # constructor refuses them, the parameters left as they were
    ours = kind.ours(4)
    swapped = {name: np.full(4, 1.5 + i, ">f4") for i, name in enumerate(kind.names)}
    ours.load_state_dict(swapped, assign=True)
    for name in kind.names:
        param = getattr(ours, name)
        assert param.dtype == np.dtype(np.float32) and param.dtype.isnative
        np.testing.assert_array_equal(param, swapped[name])
    if np.dtype(np.longdouble).itemsize in (2, 4, 8):
        pytest.skip("long double is float64 here")
    with pytest.raises(RuntimeError, match="supports float16, bfloat16, float32 and float64 parameters, got float128"):
        ours.load_state_dict({name: np.ones(4, np.longdouble) for name in kind.names}, assign=True)
    assert all(getattr(ours, name).dtype == np.float32 for name in kind.names)


@BY_KIND
def test_load_state_dict_assign_starts_the_parameters_without_gradients(kind):
    # torch's assign=True makes new parameters, whose .grad is None: the next backward must not
    # add to the gradients of the parameters they replaced
    x = spread_input((3, 4), (4,), np.float32, seed=15)
    grad = np.ones_like(x)
    ours, fresh = kind.ours(4), kind.ours(4)
    ours(x)
    ours.backward(grad)
    ours.load_state_dict(ours.state_dict(), assign=True)
    assert all(getattr(ours, name + "_grad") is None for name in kind.names)
    for m in (ours, fresh):
        m(x)
        m.backward(grad)
    for name in kind.names:
        np.testing.assert_array_equal(getattr(ours, name + "_grad"), getattr(fresh, name + "_grad"))
    if torch is not None:
        theirs = kind.theirs(4)
        theirs(torch.from_numpy(x)).backward(torch.from_numpy(grad))
        theirs.load_state_dict(theirs.state_dict(), assign=True)
        assert all(getattr(theirs, name).grad is None for name in kind.names)


@BY_KIND
def test_load_state_dict_takes_one_element_into_a_0d_parameter_as_torch(kind):
    # torch's rule for old checkpoints: a value of shape (1,) loads into a parameter of shape ()
    values = {name: np.array([2.0 + i]) for i, name in enumerate(kind.names)}
    m = kind.ours(())
    m.load_state_dict(values)
    for name in kind.names:
        assert getattr(m, name).shape == () and getattr(m, name) == values[name][0]
    with pytest.raises(RuntimeError, match=re.escape("shape (2,) from checkpoint, the shape in current model is ()")):
        m.load_state_dict({name: np.ones(2) for name in kind.names})
    if torch is not None:
        theirs = kind.theirs(())
        theirs.load_state_dict({name: torch.from_numpy(value) for name, value in values.items()})
        assert all(getattr(theirs, name).item() == values[name][0] for name in kind.names)
        with pytest.raises(RuntimeError, match="size mismatch for weight"):
            theirs.load_state_dict({name: torch.ones(2) for name in kind.names})


@BY_KIND
def test_state_dict_round_trip_between_two_modules(kind):
    a = kind.ours((2, 3))
    a.load_state_dict({name: (-1.0) ** i * np.arange(6.0).reshape(2, 3) for i, name in enumerate(kind.names)})
    b = kind.ours((2, 3))
    b.load_state_dict(a.state_dict())
    x = spread_input((4, 2, 3), (2, 3), np.float32, seed=9)
    np.testing.assert_array_equal(a(x), b(x))


KNOWN = {"weight": np.array([1.5, -2.0, 0.25, 3.0], np.float32), "bias": np.array([0.1, 0.2, -0.3, 0.4], np.float32)}


def known_module(kind):
    m = kind.ours(4)
    m.load_state_dict({name: KNOWN[name] for name in kind.names})
    return m


NEW_W = np.full(4, 9.0, np.float32)
NEW_B = np.full(4, 8.0, np.float32)
STRICT_BAD = {
    LAYER: [
        ("missing_bias", {"weight": NEW_W}),
        ("missing_weight", {"bias": NEW_B}),
        ("missing_both", {}),
        ("unexpected_key", {"weight": NEW_W, "bias": NEW_B, "running_mean": np.zeros(4, np.float32)}),
        ("weight_wrong_shape", {"weight": np.full(5, 9.0, np.float32), "bias": NEW_B}),
        ("bias_wrong_shape_after_good_weight", {"weight": NEW_W, "bias": np.full((1, 4), 8.0, np.float32)}),
        ("weight_wrong_ndim", {"weight": np.full((2, 2), 9.0, np.float32), "bias": NEW_B}),
    ],
    RMS: [
        ("missing_weight", {}),
        ("unexpected_bias", {"weight": NEW_W, "bias": NEW_B}),
        ("weight_wrong_shape", {"weight": np.full(5, 9.0, np.float32)}),
        ("weight_wrong_ndim", {"weight": np.full((2, 2), 9.0, np.float32)}),
    ],
}
STRICT_PARAMS = by_kind(STRICT_BAD)


@requires_torch
@pytest.mark.parametrize("kind, case_id, sd", STRICT_PARAMS)
def test_torch_rejects_strict_case(kind, case_id, sd):
    # The oracle: torch refuses every one of these with strict=True.
    tm = kind.theirs(4)
    with pytest.raises(RuntimeError):
        tm.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)


def as_source(sd, source):
    """The state dict as NumPy arrays or as torch tensors (both must be accepted)."""
    return {k: torch.from_numpy(v) if source == "torch" else v for k, v in sd.items()}


SOURCES = ["numpy", pytest.param("torch", marks=requires_torch)]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("kind, case_id, sd", STRICT_PARAMS)
def test_load_state_dict_strict_raises_and_leaves_module_unchanged(kind, case_id, sd, source):
    m = known_module(kind)
    before = params(kind, m)
    with pytest.raises(RuntimeError, match=f"Error\\(s\\) in loading state_dict for {kind}"):
        m.load_state_dict(as_source(sd, source), strict=True)
    assert_params_equal(kind, m, before)


@requires_torch
@pytest.mark.parametrize("source", ["numpy", "torch"])
@pytest.mark.parametrize("kind, case_id, sd", STRICT_PARAMS)
def test_load_state_dict_strict_raises_torch_text(kind, case_id, sd, source):
    with pytest.raises(RuntimeError) as info:
        known_module(kind).load_state_dict(as_source(sd, source), strict=True)
    # torch's text (its size-mismatch lines print torch.Size, so compare those by content)
    expected = torch_message(lambda: kind.theirs(4).load_state_dict(as_source(sd, "torch")))
    ours = str(info.value)
    if "size mismatch" in expected:
        assert ours.startswith(f"Error(s) in loading state_dict for {kind}:\n\tsize mismatch for ")
        assert expected.split("size mismatch for ")[1].split(":")[0] in ours  # the same key
    else:
        assert ours == expected


@pytest.mark.parametrize("source", SOURCES)
@BY_KIND
def test_load_state_dict_checks_everything_before_changing_anything(kind, source):
    # Good parameters, then one of the wrong shape and an unexpected key: torch lists every
    # problem; nothing may be copied, not even the good ones.
    m = known_module(kind)
    before = params(kind, m)
    *good, last = kind.names
    sd = {name: NEW_W for name in good}
    sd.update({last: np.ones(5, np.float32), "extra": np.zeros(4, np.float32)})
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(as_source(sd, source))
    assert_params_equal(kind, m, before)
    assert 'Unexpected key(s) in state_dict: "extra"' in str(info.value)
    assert f"size mismatch for {last}" in str(info.value)


@BY_KIND
def test_load_state_dict_into_a_read_only_parameter_changes_nothing(kind):
    # the last parameter read-only (as one loaded with np.load(mmap_mode="r") is): refused
    # before the first is written
    m = known_module(kind)
    getattr(m, kind.names[-1]).flags.writeable = False
    before = params(kind, m)
    with pytest.raises(RuntimeError, match=f'parameter named "{kind.names[-1]}", the parameter is a read-only'):
        m.load_state_dict({name: NEW_W for name in kind.names})
    assert_params_equal(kind, m, before)
    m.load_state_dict({name: NEW_W for name in kind.names}, assign=True)
    assert all(np.array_equal(getattr(m, name), NEW_W) for name in kind.names)


NOT_MAPPINGS = [[("weight", NEW_W), ("bias", NEW_B)], None, "weight"]
NOT_MAPPING_IDS = ["list_of_pairs", "None", "str"]


@pytest.mark.parametrize("value", NOT_MAPPINGS, ids=NOT_MAPPING_IDS)
@BY_KIND
def test_load_state_dict_not_a_mapping_raises_type_error(kind, value):
    m = known_module(kind)
    before = params(kind, m)
    with pytest.raises(TypeError, match="dict-like"):
        m.load_state_dict(value)
    assert_params_equal(kind, m, before)


@requires_torch
@pytest.mark.parametrize("value", NOT_MAPPINGS, ids=NOT_MAPPING_IDS)
@BY_KIND
def test_load_state_dict_not_a_mapping_raises_torch_text(kind, value):
    with pytest.raises(TypeError) as theirs:
        kind.theirs(4).load_state_dict(value)
    with pytest.raises(TypeError) as ours:
        known_module(kind).load_state_dict(value)
    assert str(ours.value) == str(theirs.value)


@BY_KIND
def test_load_state_dict_unexpected_weight_on_no_affine_module(kind):
    m = kind.ours(4, elementwise_affine=False)
    with pytest.raises((RuntimeError, ValueError, KeyError)):
        m.load_state_dict({"weight": NEW_W})
    assert all(p is None for p in param_values(kind, m))


def test_load_state_dict_non_strict_missing_key_loads_the_rest():
    m = known_module(LAYER)
    _, old_b = params(LAYER, m)
    m.load_state_dict({"weight": NEW_W}, strict=False)
    np.testing.assert_array_equal(m.weight, NEW_W)
    np.testing.assert_array_equal(m.bias, old_b)


@BY_KIND
def test_load_state_dict_non_strict_ignores_unexpected_key(kind):
    m = known_module(kind)
    new = {"weight": NEW_W, "bias": NEW_B}
    m.load_state_dict({**{name: new[name] for name in kind.names}, "extra": np.zeros(3)}, strict=False)
    for name in kind.names:
        np.testing.assert_array_equal(getattr(m, name), new[name])


@requires_torch
@BY_KIND
def test_torch_non_strict_wrong_shape_still_raises(kind):
    tm = kind.theirs(4)
    with pytest.raises(RuntimeError):
        tm.load_state_dict({"weight": torch.ones(5)}, strict=False)


@BY_KIND
def test_load_state_dict_non_strict_wrong_shape_still_raises(kind):
    # torch raises "size mismatch" even with strict=False; nothing may change.
    m = known_module(kind)
    before = params(kind, m)
    *good, last = kind.names
    with pytest.raises((RuntimeError, ValueError)):
        m.load_state_dict({**{name: NEW_W for name in good}, last: np.ones(5, np.float32)}, strict=False)
    assert_params_equal(kind, m, before)


# ---------------------------------------------------------------------------------------------
# reset_parameters, train/eval, copies
# ---------------------------------------------------------------------------------------------

def reset_module(kind, dtype):
    m = kind.ours((2, 3), dtype=np.dtype(dtype))
    m.load_state_dict({name: np.full((2, 3), 3.0 - 4 * i) for i, name in enumerate(kind.names)})
    m.reset_parameters()
    return m


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@BY_KIND
def test_reset_parameters_restores_ones_and_zeros(kind, dtype):
    m = reset_module(kind, dtype)
    for name, initial in kind.parameters:
        assert getattr(m, name).dtype == np.dtype(dtype)
        np.testing.assert_array_equal(getattr(m, name), np.full((2, 3), initial))


@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@BY_KIND
def test_reset_parameters_like_torch(kind, dtype):
    m = reset_module(kind, dtype)
    tm = kind.theirs((2, 3), dtype=torch_dtype(dtype))
    randomize_torch(tm, seed=10)
    tm.reset_parameters()
    for name in kind.names:
        np.testing.assert_array_equal(getattr(m, name), to_numpy(getattr(tm, name)))


@BY_KIND
def test_reset_parameters_after_in_place_edit(kind):
    m = kind.ours(4)
    m.weight[...] = 5.0
    m.reset_parameters()
    np.testing.assert_array_equal(m.weight, np.ones(4, np.float32))


def test_reset_parameters_without_bias():
    m = LAYER.ours(4, bias=False)
    m.weight[...] = 5.0
    m.reset_parameters()
    np.testing.assert_array_equal(m.weight, np.ones(4, np.float32))
    assert m.bias is None


@BY_KIND
def test_reset_parameters_no_affine_is_a_no_op(kind):
    m = kind.ours(4, elementwise_affine=False)
    m.reset_parameters()
    assert all(p is None for p in param_values(kind, m))


@BY_KIND
def test_training_attribute_follows_train_and_eval(kind):
    m = kind.ours(4)
    assert m.training is True
    assert m.eval() is m
    assert m.training is False
    assert m.train() is m
    assert m.training is True
    assert m.train(False) is m
    assert m.training is False
    assert m.train(True) is m
    assert m.training is True


@BY_KIND
def test_train_and_eval_do_not_change_outputs(kind):
    m = known_module(kind)
    x = spread_input((6, 4), (4,), np.float32, seed=11)
    y_train = m(x)
    y_eval = m.eval()(x)
    y_train_again = m.train()(x)
    np.testing.assert_array_equal(y_train, y_eval)
    np.testing.assert_array_equal(y_train, y_train_again)


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
@BY_KIND
def test_copy_round_trip_outputs_identical(kind, how):
    m = randomize(kind.ours((3, 4), eps=1e-3), seed=12)
    m.eval()
    if how == "pickle":
        m2 = pickle.loads(pickle.dumps(m))
    elif how == "deepcopy":
        m2 = copy.deepcopy(m)
    else:
        m2 = copy.copy(m)
    x = spread_input((5, 3, 4), (3, 4), np.float32, seed=13)
    assert type(m2) is type(m) and type(m).__name__ == kind.name
    assert repr(m2) == repr(m)
    assert m2.training is False and m2.eps == 1e-3 and m2.normalized_shape == (3, 4)
    np.testing.assert_array_equal(m2(x), m(x))
    np.testing.assert_array_equal(m2.weight, m.weight)


# Conversions as torch's Module has them: (the call on a module, given the library of its
# dtypes, np or torch; the dtype it gives).  bfloat16 needs ml_dtypes.
CONVERSIONS = {
    "half()": (lambda m, lib: m.half(), "float16"),
    "float()": (lambda m, lib: m.float(), "float32"),
    "double()": (lambda m, lib: m.double(), "float64"),
    "bfloat16()": (lambda m, lib: m.bfloat16(), "bfloat16"),
    "to(float16)": (lambda m, lib: m.to(lib.float16), "float16"),
    "to(cpu, float64)": (lambda m, lib: m.to("cpu", lib.float64), "float64"),
    "to(device=, dtype=)": (lambda m, lib: m.to(device="cpu", dtype=lib.float16), "float16"),
    "to(array)": (lambda m, lib: m.to(lib.zeros(2, dtype=lib.float64)), "float64"),
    "to(cpu)": (lambda m, lib: m.to("cpu"), "float32"),
    "cpu()": (lambda m, lib: m.cpu(), "float32"),
    "type(float64)": (lambda m, lib: m.type(lib.float64), "float64"),
    "type('torch.DoubleTensor')": (lambda m, lib: m.type("torch.DoubleTensor"), "float64"),
}


@pytest.mark.parametrize("how", list(CONVERSIONS))
@BY_KIND
def test_conversions_change_the_parameters_dtype_as_torchs_do(kind, how):
    convert, dtype_name = CONVERSIONS[how]
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    x = spread_input((3, 4), (4,), np.float32, seed=15)
    m = randomize(kind.ours(4), seed=16)
    m(x)
    m.backward(np.ones_like(x))
    before = {name: getattr(m, name).copy() for name in kind.names + tuple(n + "_grad" for n in kind.names)}
    assert convert(m, np) is m
    for name, value in before.items():
        assert getattr(m, name).dtype.name == dtype_name
        np.testing.assert_array_equal(getattr(m, name), value.astype(getattr(m, name).dtype))
    assert m(x).dtype == np.float32  # the input's dtype decides the output's
    if torch is not None:
        theirs = kind.theirs(4)
        assert convert(theirs, torch) is theirs
        assert all(str(getattr(theirs, name).dtype) == f"torch.{dtype_name}" for name in kind.names)


@requires_torch
@BY_KIND
def test_type_takes_torchs_tensor_types(kind):
    for tensor_type, dtype in ((torch.HalfTensor, np.float16), (torch.DoubleTensor, np.float64)):
        m, theirs = kind.ours(4).type(tensor_type), kind.theirs(4).type(tensor_type)
        assert m.weight.dtype == dtype and str(theirs.weight.dtype) == f"torch.{np.dtype(dtype).name}"


# Values that a 16-bit float type takes differently rounded once (NumPy's astype, and ml_dtypes'
# for bfloat16) and twice, through float32, as torch converts them: float64 1 + 2**-11 + 2**-40
# is 1 + 2**-11 in float32, a tie that float16 rounds to even, 1.0; int64 2**25 + 2**17 + 1 is
# 2**25 + 2**17 in float32, a tie that bfloat16 rounds to even, 2**25.
TWICE_ROUNDED = {
    "float16": np.array([1 + 2**-11 + 2**-40, 1 - 2**-12 - 2**-40, 2048 + 1 + 2**-30, 0.1]),
    "bfloat16": np.array([1 + 2**-8 + 2**-40, 1 - 2**-9 - 2**-40, 2**8 + 1 + 2**-30, 0.1]),
    "bfloat16-int64": np.array([2**25 + 2**17 + 1, -(2**26 + 2**18 + 1), 2**24 + 1, 3], np.int64),
    "bfloat16-int32": np.array([2**25 + 2**17 + 1, -(2**26 + 2**18 + 1), 2**24 + 1, 3], np.int32),
}
# (how, values): parameters are float arrays, so integers reach them only through loading.
NARROWINGS = [("load_state_dict", values) for values in TWICE_ROUNDED]
NARROWINGS += [("to(dtype)", "float16"), ("half()", "float16"), ("to(dtype)", "bfloat16"), ("bfloat16()", "bfloat16")]


@pytest.mark.parametrize("how, values_id", NARROWINGS, ids=[f"{h}-{v}" for h, v in NARROWINGS])
@BY_KIND
def test_wider_parameters_become_16_bit_floats_as_torchs_do(kind, how, values_id):
    target_name = values_id.partition("-")[0]
    if target_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    target = np.dtype(np.float16) if target_name == "float16" else BF16
    values = TWICE_ROUNDED[values_id]
    expected = values.astype(np.float32).astype(target)
    assert not np.array_equal(expected, values.astype(target))  # the case is one
    n = values.size
    if how == "load_state_dict":
        m = kind.ours(n, dtype=target)
        m.load_state_dict({name: values.copy() for name in kind.names})
    else:
        m = kind.ours(n, dtype=values.dtype)
        for name in kind.names:
            getattr(m, name)[...] = values
        m.to(target) if how == "to(dtype)" else getattr(m, how[:-2])()
    for name in kind.names:
        np.testing.assert_array_equal(getattr(m, name).astype(np.float64), expected.astype(np.float64))
    if torch is not None:
        torch_target = getattr(torch, target_name)
        theirs = kind.theirs(n, dtype=torch_target if how == "load_state_dict" else torch.float64)
        if how == "load_state_dict":
            theirs.load_state_dict({name: torch.from_numpy(values) for name in kind.names})
        else:
            with torch.no_grad():
                for name in kind.names:
                    getattr(theirs, name).copy_(torch.from_numpy(values))
            theirs.to(torch_target)
        for name in kind.names:
            got = getattr(theirs, name).detach().double().numpy()
            np.testing.assert_array_equal(got, expected.astype(np.float64))


@BY_KIND
def test_conversions_refuse_other_dtypes_and_devices(kind):
    m = kind.ours(4)
    with pytest.raises(TypeError, match="float16, bfloat16, float32 and float64"):
        m.to(np.int64)
    with pytest.raises(ValueError, match="CPU only"):
        m.to("cuda")
    with pytest.raises(TypeError, match="unexpected"):
        m.to(copy=True)
    assert m.weight.dtype == np.float32


COPIES = {"pickle": lambda m: pickle.loads(pickle.dumps(m)), "deepcopy": copy.deepcopy, "copy": copy.copy}


@pytest.mark.parametrize("how", list(COPIES))
@BY_KIND
def test_copies_keep_the_gradients_where_torchs_do(kind, how):
    # torch: pickle and deepcopy make parameters without .grad, copy.copy shares them, .grad too
    x = spread_input((3, 4), (4,), np.float32, seed=14)
    m = kind.ours(4)
    m(x)
    m.backward(np.ones_like(x))
    m2 = COPIES[how](m)
    for name in kind.names:
        grad = getattr(m2, name + "_grad")
        assert grad is getattr(m, name + "_grad") if how == "copy" else grad is None
    if torch is not None:
        theirs = kind.theirs(4)
        theirs(torch.from_numpy(x)).sum().backward()
        copied = COPIES[how](theirs)
        assert all((getattr(copied, name).grad is not None) == (how == "copy") for name in kind.names)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@BY_KIND
def test_copy_is_independent(kind, how):
    m = known_module(kind)
    m2 = pickle.loads(pickle.dumps(m)) if how == "pickle" else copy.deepcopy(m)
    before = params(kind, m)
    for p in param_values(kind, m2):
        p[...] = 0.0
    assert_params_equal(kind, m, before)


NONE_PARAM_CASES = by_kind({LAYER: [("no_bias", {"bias": False}), ("no_affine", {"elementwise_affine": False})],
                            RMS: [("no_affine", {"elementwise_affine": False})]})


@pytest.mark.parametrize("kind, case_id, kwargs", NONE_PARAM_CASES)
def test_pickle_round_trip_keeps_none_params(kind, case_id, kwargs):
    m = kind.ours(4, **kwargs)
    m2 = pickle.loads(pickle.dumps(m))
    assert repr(m2) == repr(m)
    for name, mine, theirs in zip(kind.names, param_values(kind, m2), param_values(kind, m)):
        assert (mine is None) == (theirs is None), name


# ---------------------------------------------------------------------------------------------
# device, bad sizes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", [None, "cpu"], ids=["None", "cpu"])
@BY_KIND
def test_device_cpu_accepted(kind, device):
    m = kind.ours(4, device=device)
    assert m.weight.shape == (4,)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta"])
@BY_KIND
def test_device_not_cpu_raises_value_error(kind, device):
    with pytest.raises(ValueError):
        kind.ours(4, device=device)


@pytest.mark.parametrize("ns", [-1, [2, -1], (-3, 4)], ids=["int", "list", "tuple"])
@BY_KIND
def test_negative_size_raises(kind, ns):
    with pytest.raises(ValueError):
        kind.ours(ns)


@requires_torch
@pytest.mark.parametrize("ns", [-1, [2, -1], (-3, 4)], ids=["int", "list", "tuple"])
@BY_KIND
def test_torch_negative_size_raises(kind, ns):
    with pytest.raises(RuntimeError):  # the oracle
        kind.theirs(ns)


@BY_KIND
def test_negative_size_no_affine_raises_at_latest_in_forward(kind):
    # torch builds no parameter, so it can only fail when the module is used.
    with pytest.raises(ValueError):
        m = kind.ours([2, -1], elementwise_affine=False)
        m(np.zeros((3, 2, 1), np.float32))


@requires_torch
@BY_KIND
def test_torch_empty_normalized_shape_raises_in_forward(kind):
    with pytest.raises(RuntimeError, match="at least 1-dimensional"):
        kind.theirs([])(torch.zeros(3))


@BY_KIND
def test_empty_normalized_shape_raises_in_forward(kind):
    with pytest.raises(ValueError, match="at least 1-dimensional"):
        m = kind.ours([])
        m(np.zeros(3, np.float32))


def test_forward_wrong_trailing_shape_raises_torch_text():
    m = LAYER.ours([2, 2])
    with pytest.raises(ValueError) as err:
        m(np.zeros((2, 2, 3), np.float32))
    assert ("Given normalized_shape=[2, 2], expected input with shape [*, 2, 2], "
            "but got input of size[2, 2, 3]") in str(err.value)


def test_rms_norm_forward_wrong_trailing_shape_raises_value_error():
    with pytest.raises(ValueError, match=r"normalized_shape=\[2, 2\]"):
        RMS.ours([2, 2])(np.zeros((2, 2, 3), np.float32))


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------

@BY_KIND
def test_forward_equals_call(kind):
    m = known_module(kind)
    x = spread_input((3, 4), (4,), np.float32, seed=14)
    np.testing.assert_array_equal(m.forward(x), m(x))


@pytest.mark.parametrize("mode", ["train", "eval"])
@BY_KIND
def test_forward_equals_the_functional(kind, mode):
    m = known_module(kind).train(mode == "train")
    x = spread_input((3, 4), (4,), np.float32, seed=15)
    np.testing.assert_array_equal(m(x), kind.functional.forward(x, (4,), *param_values(kind, m), eps=m.eps))


@BY_KIND
def test_forward_does_not_mutate_input(kind):
    m = known_module(kind)
    x = spread_input((3, 4), (4,), np.float32, seed=16)
    saved = x.copy()
    m(x)
    np.testing.assert_array_equal(x, saved)


@pytest.mark.parametrize("how", ["list", pytest.param("torch_tensor", marks=requires_torch)])
@BY_KIND
def test_forward_accepts_array_likes(kind, how):
    m = known_module(kind)
    x = spread_input((3, 4), (4,), np.float32, seed=17)
    arg = x.tolist() if how == "list" else torch.from_numpy(x.copy())
    y = np.asarray(m(arg))
    np.testing.assert_allclose(y, kind.module_reference(x, m), rtol=1e-5, atol=1e-5)


@requires_torch
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's RMSNorm
@BY_KIND
def test_float16_input_to_float32_module_matches_torch(kind):
    # torch allows half input with float32 parameters; the output stays float16.
    theirs = randomize_torch(kind.theirs(8), seed=20)
    ours = kind.ours(8)
    ours.load_state_dict(theirs.state_dict())
    x = spread_input((6, 8), (8,), np.float16, seed=21)
    y = ours(x)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), torch_out(theirs, x).astype(np.float32),
                               rtol=4e-3, atol=4e-3)


@requires_torch
def test_float64_input_to_float32_module_torch_raises():
    # The oracle's behaviour we deliberately differ from (see the next test); torch's RMSNorm
    # computes in float64 there, as we do.
    with pytest.raises(RuntimeError, match="mixed dtype"):
        torch.nn.LayerNorm(8)(torch.zeros(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("shape, ns", [((6, 8), (8,)), ((2, 3, 4, 5), (4, 5)), ((5,), (5,))],
                         ids=["6x8", "2x3x4x5", "1d"])
@BY_KIND
def test_float64_input_to_float32_module_computed_in_float64(kind, shape, ns):
    # DELIBERATE DIFFERENCE FROM TORCH's LayerNorm: torch raises "mixed dtype" for float64 input
    # with float32 parameters; we convert the parameters to float64 and compute in float64.
    ours = randomize(kind.ours(ns), seed=22)
    x = np.random.default_rng(23).standard_normal(shape) * 10 + 1e3  # float64, large offset
    y = ours(x)
    assert y.dtype == np.float64
    expected = kind.reference(x, ours, *(p.astype(np.float64) for p in param_values(kind, ours)))
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# training mode: what forward keeps for backward
# ---------------------------------------------------------------------------------------------

def _overwrite(how, x):
    """Return (what to pass to forward, a function that changes its values afterwards)."""
    if how == "ndarray":
        arg = x.copy()
        return arg, lambda: arg.fill(0.0)
    if how == "read_only_view":  # read-only, but its base is not
        base = x.copy()
        arg = base.view()
        arg.flags.writeable = False
        return arg, lambda: base.fill(0.0)
    if how == "fortran":
        arg = np.asfortranarray(x)
        return arg, lambda: arg.fill(0.0)
    if how == "array_interface":  # an object whose __array__ hands out an array it keeps
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


@pytest.mark.parametrize("how", ["ndarray", "read_only_view", "fortran",
                                 pytest.param("torch_tensor", marks=requires_torch), "array_interface"])
@BY_KIND
def test_input_changed_after_training_forward_does_not_change_backward(kind, how):
    # torch's autograd refuses a backward through a modified saved tensor; a silently different
    # gradient would be worse than both: backward must use the input as it was at forward time.
    rng = np.random.default_rng(30)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    dy = rng.standard_normal((5, 6)).astype(np.float32)
    ours = randomize(kind.ours(6), seed=31)
    arg, overwrite = _overwrite(how, x)
    ours(arg)
    overwrite()
    grad_input = ours.backward(dy)
    t_gi, t_grads = kind.reference_backward(dy, x, ours)
    np.testing.assert_allclose(grad_input, t_gi, rtol=1e-5, atol=1e-5)
    for name in kind.names:
        np.testing.assert_allclose(getattr(ours, name + "_grad"), t_grads[name], rtol=1e-5, atol=1e-5)


# (input shape, normalized_shape, axis, how the input is laid out): each route by which the
# forward kernel copies the input that backward reads, as it normalizes each row
TRAINING_ROUTES = {
    "few_rows": ((5, 6), (6,), None, "C"),
    "rows_split_across_threads": ((96, 1024), (1024,), None, "C"),
    "large_copy_by_streaming_stores": ((400, 1024), (1024,), None, "C"),
    "large_copy_of_odd_rows": ((600, 501), (501,), None, "C"),
    "huge_rows_split_into_chunks": ((2, 40000), (40000,), None, "C"),
    "channels_first": ((3, 16, 40, 40), (16,), 1, "C"),
    "fortran_order": ((128, 768), (768,), None, "F"),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("route", list(TRAINING_ROUTES))
@BY_KIND
def test_training_forward_saves_the_input_it_normalized(kind, route, threads, restore_runtime):
    shape, ns, axis, order = TRAINING_ROUTES[route]
    layernorm.set_num_threads(threads)
    rng = np.random.default_rng(32)
    x = np.asarray(rng.standard_normal(shape).astype(np.float32), order=order)
    dy = rng.standard_normal(shape).astype(np.float32)
    ours, untouched = randomize(kind.ours(ns, axis=axis), seed=33), randomize(kind.ours(ns, axis=axis), seed=33)
    y_train = ours(x)
    y_eval = ours.eval()(x)
    ours.train()(x)
    untouched(x.copy())
    x[...] = rng.standard_normal(shape)
    np.testing.assert_array_equal(y_train, y_eval)
    np.testing.assert_array_equal(ours.backward(dy), untouched.backward(dy))
    for name in kind.names:
        np.testing.assert_array_equal(getattr(ours, name + "_grad"), getattr(untouched, name + "_grad"))


# Memory orders of one (4, 6, 5, 7) array, each holding base's values
SAVED_LAYOUTS = {
    "fortran": np.asfortranarray,
    "channels_last": lambda base: np.ascontiguousarray(base.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2),
    "reversed_rows": lambda base: np.ascontiguousarray(base[::-1])[::-1],
    "every_other_image": lambda base: np.repeat(base, 2, axis=0)[::2],
}


@pytest.mark.parametrize("axis", [None, 1], ids=lambda axis: f"axis_{axis}")
@pytest.mark.parametrize("layout", list(SAVED_LAYOUTS))
@BY_KIND
def test_training_mode_computes_as_the_functions_on_the_callers_layout(kind, layout, axis):
    # The input saved for backward is a copy; made in another memory order, it would send
    # forward and backward down other routes than the functions take on the caller's array
    # (other bits, and a grad_input out of the input's order with axis=).
    rng = np.random.default_rng(34)
    x = SAVED_LAYOUTS[layout]((30 + rng.standard_normal((4, 6, 5, 7))).astype(np.float32))
    dy = rng.standard_normal(x.shape).astype(np.float32)
    ns = (6,) if axis == 1 else (7,)
    module = randomize(kind.ours(ns, axis=axis), seed=35)
    params = [getattr(module, name) for name in kind.names]
    output, *stats = kind.functional.native(x, ns, *params, module.eps, axis=axis)
    grads = kind.functional.backward(dy, x, ns, stats, *params, axis=axis)
    y = module(x)
    grad_input = module.backward(dy)
    np.testing.assert_array_equal(y, output)
    np.testing.assert_array_equal(grad_input, grads[0])
    assert (y.strides, grad_input.strides) == (output.strides, grads[0].strides)
    for name, grad in zip(kind.names, grads[1:]):
        np.testing.assert_array_equal(getattr(module, name + "_grad"), grad)


# Row lengths about the pipelined loop's steps of 32 elements (a pair of groups, one group,
# a tail) and its chunks of 2048 elements (float64 rows longer than one chunk are copied before
# they are normalized).
COPIED_ROW_LENGTHS = [1, 15, 16, 17, 31, 32, 33, 48, 50, 777, 2048, 2049, 4100]
TRAINING_FORWARDS = {"LayerNorm": "training_forward", "RMSNorm": "rms_training_forward"}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", COPIED_ROW_LENGTHS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
@BY_KIND
def test_training_forward_saves_the_input_bit_for_bit(kind, dtype, n, threads, restore_runtime):
    # Every element of the saved input is the input's, whichever route made the copy and
    # whether the row was normalized by the vector loop or the exact one (huge, NaN rows).
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    layernorm.set_num_threads(threads)
    rng = np.random.default_rng(n)
    rows = min(4096, max(40, 70000 // n))  # 2 threads split calls of 65536 elements or more
    x = (3.0 + rng.standard_normal((rows, n))).astype(dtype)
    x[1] = np.finfo(np.float16).max if dtype == "float16" else 1e30
    x[2, n // 2] = np.nan
    x[3, -1] = -np.inf
    weight = rng.standard_normal(n).astype(np.float64 if dtype == "float64" else np.float32)
    training_forward = getattr(layernorm._layernorm, TRAINING_FORWARDS[kind.name])
    params = (weight, None) if kind.functional.centred else (weight,)
    for level in layernorm.available_simd_levels():
        layernorm.set_simd_level(level)
        output, (saved_input, _) = training_forward(x, (n,), *params, 1e-5)
        assert saved_input is not x and saved_input.dtype == x.dtype
        assert saved_input.tobytes() == x.tobytes(), level
        assert output.tobytes() == kind.functional.forward(x, (n,), weight, eps=1e-5).tobytes(), level


@BY_KIND
def test_failed_training_forward_leaves_nothing_for_backward(kind):
    # backward() goes through the last training-mode call; when that call raised, there is
    # nothing to go through (not the call before it).
    ours = kind.ours(6)
    x = np.random.default_rng(31).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    with pytest.raises(ValueError):
        ours(np.zeros((3, 7), np.float32))
    with pytest.raises(RuntimeError):
        ours.backward(np.ones((3, 6), np.float32))
    assert all(getattr(ours, name + "_grad") is None for name in kind.names)


# ---------------------------------------------------------------------------------------------
# dtype= and device= spelled the torch way
# ---------------------------------------------------------------------------------------------

@requires_torch
@pytest.mark.parametrize("name", ["float16", "float32", "float64"])
@BY_KIND
def test_torch_dtype_argument(kind, name):
    # Code ported from torch passes torch dtypes: the parameters get the matching NumPy dtype.
    dtype = torch_dtype(name)
    ours, theirs = kind.ours((2, 3), dtype=dtype), kind.theirs((2, 3), dtype=dtype)
    for param in kind.names:
        mine, ref = getattr(ours, param), getattr(theirs, param)
        assert mine.dtype == numpy_dtype_of(ref), param
        np.testing.assert_array_equal(mine, to_numpy(ref), err_msg=param)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64, np.longdouble, "U4", object],
                         ids=["int32", "bool", "complex64", "longdouble", "str", "object"])
@BY_KIND
def test_non_float_dtype_argument_raises_type_error(kind, dtype):
    with pytest.raises(TypeError) as info:
        kind.ours(4, dtype=dtype)
    assert "float" in str(info.value)


@requires_torch
@pytest.mark.parametrize("name", ["int64", "uint8", "complex64"], ids=lambda n: f"torch.{n}")
@BY_KIND
def test_non_float_torch_dtype_argument_raises_type_error(kind, name):
    with pytest.raises(TypeError) as info:
        kind.ours(4, dtype=torch_dtype(name))
    assert "float" in str(info.value)


@requires_torch
@BY_KIND
def test_torch_cpu_device_accepted(kind):
    m = kind.ours(4, device=torch.device("cpu"))
    assert m.weight.shape == (4,)


@requires_torch
@BY_KIND
def test_torch_meta_device_raises_value_error(kind):
    with pytest.raises(ValueError):
        kind.ours(4, device=torch.device("meta"))


# ---------------------------------------------------------------------------------------------
# training with float16 / float64 parameters, zero_grad(set_to_none=False)
# ---------------------------------------------------------------------------------------------

# Relative to the largest expected magnitude: float64 to ~1e-9; float16 results are rounded to
# float16 once per step and once more when accumulated: 3 half-ulps (2**-11 each).
MODULE_GRAD_RTOL = {"float16": 3 * 2.0**-11, "float64": 1e-9}


@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "float64"])
@BY_KIND
def test_module_two_training_steps_in_param_dtype_match_torch_float64(kind, dtype):
    rng = np.random.default_rng(32)
    ours = randomize(kind.ours((3, 5), eps=1e-5, dtype=np.dtype(dtype)), seed=33)
    # the oracle: torch in float64 on the same (exactly representable) numbers
    theirs = kind.theirs((3, 5), eps=1e-5, dtype=torch.float64)
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
    for name in kind.names:
        mine, expected = getattr(ours, name + "_grad"), getattr(theirs, name).grad.numpy()
        assert mine.dtype == np.dtype(dtype), name
        np.testing.assert_allclose(mine, expected, rtol=0, atol=rtol * np.abs(expected).max(), err_msg=name)


@BY_KIND
def test_zero_grad_set_to_none_false_zeroes_in_place(kind):
    x = np.random.default_rng(33).standard_normal((3, 6)).astype(np.float32)
    ours = kind.ours(6)
    ours(x)
    ours.backward(np.ones((3, 6), np.float32))
    grads = [getattr(ours, name + "_grad") for name in kind.names]
    ours.zero_grad(set_to_none=False)
    for name, grad in zip(kind.names, grads):
        assert getattr(ours, name + "_grad") is grad  # the same array, zeroed
        np.testing.assert_array_equal(grad, np.zeros(6))


@requires_torch
@BY_KIND
def test_zero_grad_set_to_none_false_zeroes_in_place_like_torch(kind):
    x = np.random.default_rng(33).standard_normal((3, 6)).astype(np.float32)
    ours, theirs = kind.ours(6), kind.theirs(6)
    ours(x)
    ours.backward(np.ones((3, 6), np.float32))
    theirs(torch.from_numpy(x)).sum().backward()
    ours.zero_grad(set_to_none=False)
    theirs.zero_grad(set_to_none=False)
    for name in kind.names:
        np.testing.assert_array_equal(getattr(ours, name + "_grad"), getattr(theirs, name).grad.numpy())


@BY_KIND
def test_zero_grad_set_to_none_false_without_gradients_leaves_none(kind):
    fresh = kind.ours(6)
    fresh.zero_grad(set_to_none=False)  # no gradient yet: stays None, as in torch
    assert all(getattr(fresh, name + "_grad") is None for name in kind.names)


@requires_torch
@BY_KIND
def test_torch_zero_grad_set_to_none_false_without_gradients_leaves_none(kind):
    fresh_torch = kind.theirs(6)
    fresh_torch.zero_grad(set_to_none=False)
    assert fresh_torch.weight.grad is None


# ---------------------------------------------------------------------------------------------
# training: backward and gradient accumulation against torch autograd
# ---------------------------------------------------------------------------------------------

def torch_and_ours(kind, ns, seed, **kwargs):
    tm = kind.theirs(ns, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tm.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ours = kind.ours(ns, **kwargs)
    ours.load_state_dict(tm.state_dict())
    return tm, ours


def torch_step(tm, x, dy):
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    tm(xt).backward(torch.from_numpy(dy.copy()))
    return xt.grad.numpy()


MODULE_KW = by_kind({LAYER: [("affine", {}), ("no_bias", {"bias": False}),
                             ("no_affine", {"elementwise_affine": False})],
                     RMS: [("affine", {}), ("eps_1e-5", {"eps": 1e-5}), ("no_affine", {"elementwise_affine": False})]})


@requires_torch
@pytest.mark.parametrize("kind, kw_id, kwargs", MODULE_KW)
def test_module_training_forward_backward_matches_torch(kind, kw_id, kwargs):
    tm, ours = torch_and_ours(kind, (3, 5), seed=14, **kwargs)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((4, 3, 5)).astype(np.float32)
    dy = rng.standard_normal((4, 3, 5)).astype(np.float32)
    assert all(getattr(ours, name + "_grad") is None for name in kind.names)
    y = ours(x)
    with torch.no_grad():
        np.testing.assert_allclose(y, tm(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)
    gi = ours.backward(dy)
    tgi = torch_step(tm, x, dy)
    assert_close(gi, tgi, 1e-5, "grad_input")
    for name in kind.names:
        tp = getattr(tm, name)
        mine = getattr(ours, name + "_grad")
        if tp is None:
            assert mine is None, name
        else:
            assert_close(mine, tp.grad.numpy(), 1e-5, name + "_grad")


@requires_torch
@BY_KIND
def test_module_two_steps_accumulate_like_torch_grad(kind):
    tm, ours = torch_and_ours(kind, (3, 5), seed=16)
    rng = np.random.default_rng(17)
    for step in range(2):
        x = rng.standard_normal((4, 3, 5)).astype(np.float32)
        dy = rng.standard_normal((4, 3, 5)).astype(np.float32)
        gi = ours.backward(dy) if ours(x) is not None else None
        tgi = torch_step(tm, x, dy)
        assert_close(gi, tgi, 1e-5, f"grad_input step {step}")
    for name in kind.names:
        assert_close(getattr(ours, name + "_grad"), getattr(tm, name).grad.numpy(), 1e-5, name + "_grad")
    # and the accumulation really is a sum of two different gradients, not the last one
    single = kind.reference_backward(dy, x, ours)[1]["weight"]
    assert not np.allclose(ours.weight_grad, single, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@BY_KIND
def test_16_bit_gradients_accumulate_rounded_step_by_step_as_torchs(kind, dtype_name):
    # torch rounds each step's parameter gradient to the parameter's dtype, then rounds their
    # sum: two roundings, where one of the float32 sum differs in the last bit here and there
    if dtype_name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    dtype = np.dtype(np.float16) if dtype_name == "float16" else BF16
    ours = randomize(kind.ours(64, dtype=dtype), seed=22)
    rng = np.random.default_rng(23)
    steps = []
    for _ in range(2):
        x = rng.standard_normal((8, 64)).astype(dtype)
        dy = rng.standard_normal((8, 64)).astype(dtype)
        ours(x)
        ours.backward(dy)
        values = param_values(kind, ours)
        stats = kind.functional.native(x, 64, *values)[1:]
        steps.append(kind.functional.backward(dy, x, 64, stats, *values)[1:])
    for name, first, second in zip(kind.names, *steps):
        expected = (first.astype(dtype) + second.astype(dtype)).astype(dtype)
        np.testing.assert_array_equal(getattr(ours, name + "_grad").view(np.uint16), expected.view(np.uint16))
        assert not np.array_equal(expected.view(np.uint16), (first + second).astype(dtype).view(np.uint16))


@requires_torch
@pytest.mark.parametrize("size", ["tensor", "parameter"])
@BY_KIND
def test_zero_dimensional_tensor_is_no_normalized_shape(kind, size):
    made = {"tensor": lambda: torch.tensor(4), "parameter": lambda: torch.nn.Parameter(torch.tensor(4.0))}[size]
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        kind.theirs(made())
    with pytest.raises(TypeError, match="^normalized_shape must be an int or a sequence of ints, got "):
        kind.ours(made())


@pytest.mark.parametrize("given", ["int64", "bool", "list"])
@BY_KIND
def test_backward_takes_integer_and_list_gradients_as_autograd(kind, given):
    # autograd converts a gradient to its tensor's dtype
    x = np.random.default_rng(24).standard_normal((3, 4)).astype(np.float32)
    dy = np.random.default_rng(25).integers(-3, 4, (3, 4))
    grads = {"int64": dy, "bool": dy > 0, "list": (dy > 0).tolist()}
    ours, twin = randomize(kind.ours(4), seed=26), randomize(kind.ours(4), seed=26)
    ours(x)
    twin(x)
    got = ours.backward(grads[given])
    expected = twin.backward(np.asarray(grads[given]).astype(np.float32))
    np.testing.assert_array_equal(got, expected)
    for name in kind.names:
        np.testing.assert_array_equal(getattr(ours, name + "_grad"), getattr(twin, name + "_grad"))
    if torch is not None:  # which torch takes too
        kind.theirs(4)(torch.from_numpy(x)).backward(torch.from_numpy(np.asarray(grads[given])))


@BY_KIND
def test_module_zero_grad_sets_none(kind):
    ours = randomize(kind.ours(6), seed=18)
    x = np.random.default_rng(19).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    ours.backward(np.ones((3, 6), np.float32))
    assert all(getattr(ours, name + "_grad") is not None for name in kind.names)
    ours.zero_grad()
    assert all(getattr(ours, name + "_grad") is None for name in kind.names)


@BY_KIND
def test_module_zero_grad_then_backward_starts_fresh(kind):
    ours = randomize(kind.ours(6), seed=20)
    rng = np.random.default_rng(21)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    dy = rng.standard_normal((3, 6)).astype(np.float32)
    ours(x)
    ours.backward(dy)
    ours.zero_grad()
    ours(x)
    ours.backward(dy)
    _, grads = kind.reference_backward(dy, x, ours)
    for name in kind.names:
        assert_close(getattr(ours, name + "_grad"), grads[name], 1e-5, name + "_grad")


@BY_KIND
def test_module_backward_before_any_forward_raises(kind):
    ours = kind.ours(6)
    with pytest.raises(RuntimeError):
        ours.backward(np.ones((3, 6), np.float32))
    assert all(getattr(ours, name + "_grad") is None for name in kind.names)


@BY_KIND
def test_module_eval_forward_then_backward_raises(kind):
    ours = kind.ours(6).eval()
    x = np.random.default_rng(22).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    with pytest.raises(RuntimeError):
        ours.backward(np.ones((3, 6), np.float32))
    assert all(getattr(ours, name + "_grad") is None for name in kind.names)


def _gradients_after(kind, n, change, seed):
    """(grad_input, *parameter gradients) of a module of ours after a training forward, then
    change(module), then backward, and those of the same module without the change."""
    rng = np.random.default_rng(seed)
    x, dy = rng.standard_normal((2, 3, n)).astype(np.float32)
    results = []
    for changed in (False, True):
        module = randomize(kind.ours(n), seed=seed + 1)
        module(x)
        if changed:
            change(module)
        grad_input = module.backward(dy)
        results.append((grad_input, *(getattr(module, name + "_grad") for name in kind.names)))
    return results


@BY_KIND
def test_module_put_in_eval_mode_after_a_training_forward_still_back_propagates(kind):
    # as torch: eval() changes what later forwards save, not the graph of an earlier one
    expected, got = _gradients_after(kind, 6, lambda module: module.eval(), seed=23)
    assert [g.tobytes() for g in got] == [e.tobytes() for e in expected]


@BY_KIND
def test_module_eval_forward_after_a_training_forward_leaves_nothing_for_backward(kind):
    # backward() follows the module's last call: an eval-mode one kept nothing to go through
    ours = kind.ours(6)
    x = np.random.default_rng(25).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    ours.eval()(x)
    ours.train()
    with pytest.raises(RuntimeError, match="needs a training-mode forward first"):
        ours.backward(np.ones((3, 6), np.float32))


@pytest.mark.parametrize("change", ["axis", "normalized_shape"])
@BY_KIND
def test_module_backward_takes_the_layout_of_its_forward(kind, change):
    # torch's graph keeps the forward's settings; changing the module's afterwards must not
    # turn the gradients into those of another normalization
    value = 0 if change == "axis" else (2, 2)
    expected, got = _gradients_after(kind, 4, lambda module: setattr(module, change, value), seed=26)
    assert [g.tobytes() for g in got] == [e.tobytes() for e in expected]


# ---------------------------------------------------------------------------------------------
# Parameters changed between the training forward and backward: torch refuses a backward
# through a saved tensor modified in place; silently using the new values would give gradients
# of another function than the one whose output was used
# ---------------------------------------------------------------------------------------------

def _forward_then(kind, change, **kwargs):
    """A module after a training forward and `change(module)`; backward() is what is tested."""
    ours = randomize(kind.ours(4, **kwargs), seed=40)
    ours(np.random.default_rng(41).standard_normal((3, 4)).astype(np.float32))
    change(ours)
    return ours


def _double(name):
    def change(module):
        getattr(module, name)[...] *= 2
    return change


def _load_weight(module):
    module.load_state_dict({name: np.full(4, 3.0) if name == "weight" else value
                            for name, value in module.named_parameters()})


IN_PLACE_CHANGES = {
    "weight-doubled": (_double("weight"), "weight [float32 array [4]]"),
    "bias-doubled": (_double("bias"), "bias [float32 array [4]]"),
    "weight-loaded": (_load_weight, "weight [float32 array [4]]"),
    "reset_parameters": (lambda m: m.reset_parameters(), "weight [float32 array [4]]"),
}
IN_PLACE_PARAMS = [pytest.param(kind, name, id=f"{kind}-{name}") for kind in KINDS for name in IN_PLACE_CHANGES
                   if not (name.startswith("bias") and "bias" not in kind.names)]


@pytest.mark.parametrize("kind, change_id", IN_PLACE_PARAMS)
def test_backward_refuses_a_parameter_changed_in_place(kind, change_id):
    change, named = IN_PLACE_CHANGES[change_id]
    ours = _forward_then(kind, change)
    with pytest.raises(RuntimeError) as info:
        ours.backward(np.ones((3, 4), np.float32))
    assert str(info.value) == (
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {kind}.{named} changed after the forward call. Call the module on its "
        "input again before backward()."
    )
    assert all(getattr(ours, name + "_grad") is None for name in kind.names)


@requires_torch
@BY_KIND
def test_backward_refuses_a_parameter_changed_in_place_in_torchs_words(kind):
    theirs = kind.theirs(4)
    y = theirs(torch.ones(3, 4, requires_grad=True))  # torch's RMSNorm saves the weight for grad_input only
    with torch.no_grad():
        theirs.weight *= 2
    expected = torch_message(lambda: y.backward(torch.ones(3, 4)))
    ours = _forward_then(kind, _double("weight"))
    with pytest.raises(RuntimeError) as info:
        ours.backward(np.ones((3, 4), np.float32))
    assert str(info.value).startswith(expected.split(": [torch.")[0] + ": ")


REPLACEMENTS = {
    "weight-by-None": ("weight", lambda m: None, "float32 array [4] by None"),
    "bias-by-None": ("bias", lambda m: None, "float32 array [4] by None"),
    "weight-by-an-equal-copy": ("weight", lambda m: m.weight.copy(), "float32 array [4] by float32 array [4]"),
    "bias-by-float64": ("bias", lambda m: m.bias.astype(np.float64), "float32 array [4] by float64 array [4]"),
}
REPLACEMENT_PARAMS = [pytest.param(kind, name, id=f"{kind}-{name}") for kind in KINDS for name in REPLACEMENTS
                      if REPLACEMENTS[name][0] in kind.names]


@pytest.mark.parametrize("kind, replacement_id", REPLACEMENT_PARAMS)
def test_backward_refuses_a_replaced_parameter(kind, replacement_id):
    name, make, described = REPLACEMENTS[replacement_id]
    ours = _forward_then(kind, lambda m: setattr(m, name, make(m)))
    with pytest.raises(RuntimeError) as info:
        ours.backward(np.ones((3, 4), np.float32))
    assert str(info.value) == (
        f"{kind}.{name} was replaced after the forward call ({described}): call the module on "
        "its input again before backward()."
    )


ADDED_AFTER_FORWARD = by_kind({LAYER: [("bias", {"bias": False})], RMS: [("weight", {"elementwise_affine": False})]})


@pytest.mark.parametrize("kind, name, kwargs", ADDED_AFTER_FORWARD)
def test_backward_refuses_a_parameter_added_after_the_forward(kind, name, kwargs):
    ours = _forward_then(kind, lambda m: setattr(m, name, np.zeros(4, np.float32)), **kwargs)
    with pytest.raises(RuntimeError, match=rf"{kind}\.{name} was replaced .*\(None by float32 array \[4\]\)"):
        ours.backward(np.ones((3, 4), np.float32))


@BY_KIND
def test_backward_takes_parameters_changed_and_changed_back(kind):
    # The values are what matters: a parameter changed and restored before backward is the
    # parameter the forward used.
    def change_and_restore(module):
        module.weight *= 2
        module.weight /= 2

    ours = _forward_then(kind, change_and_restore)
    expected = _forward_then(kind, lambda m: None)
    np.testing.assert_array_equal(ours.backward(np.ones((3, 4), np.float32)),
                                  expected.backward(np.ones((3, 4), np.float32)))
    np.testing.assert_array_equal(ours.weight_grad, expected.weight_grad)


@BY_KIND
def test_parameters_changed_after_backward_are_for_the_next_forward(kind):
    # The optimizer's step: gradients, then an in-place update, then the next forward.
    ours = _forward_then(kind, lambda m: None)
    ours.backward(np.ones((3, 4), np.float32))
    ours.weight -= 0.1 * ours.weight_grad
    ours(np.ones((3, 4), np.float32))
    ours.backward(np.ones((3, 4), np.float32))


# A gradient total backward cannot add into, and what it raises; every total set up before the
# failing one must come out of the failed call unchanged.
def _read_only(array):
    array.flags.writeable = False
    return array


BAD_TOTALS = {
    "wrong-shape": (lambda: np.zeros(3, np.float32), ValueError, "operands could not be broadcast"),
    "read-only": (lambda: _read_only(np.zeros(4, np.float32)), ValueError,
                  "bias_grad is read-only: backward() adds the gradient into it in place"),
    "a-list": (lambda: [0.0] * 4, TypeError, "bias_grad must be a NumPy array or None, got list"),
}


@pytest.mark.parametrize("bad_id", BAD_TOTALS)
def test_failed_accumulation_leaves_every_gradient_as_it_was(bad_id):
    make_bad, error, message = BAD_TOTALS[bad_id]
    dy = np.random.default_rng(42).standard_normal((3, 4)).astype(np.float32)
    once = _forward_then(LAYER, lambda m: None)
    once.backward(dy)
    ours = _forward_then(LAYER, lambda m: None)
    ours.weight_grad = np.zeros(4, np.float32)
    ours.bias_grad = make_bad()
    with pytest.raises(error, match=re.escape(message)):
        ours.backward(dy)
    assert not ours.weight_grad.any()  # nothing added before the bias failed
    ours.bias_grad = None
    ours.backward(dy)  # the saved values are still there: the retry adds each gradient once
    np.testing.assert_array_equal(ours.weight_grad, once.weight_grad)
    np.testing.assert_array_equal(ours.bias_grad, once.bias_grad)


def test_gradient_totals_that_are_one_array_take_both_gradients():
    # as `+=` into each in turn did: weight_grad and bias_grad set to one array sum into it
    dy = np.random.default_rng(44).standard_normal((3, 4)).astype(np.float32)
    separate = _forward_then(LAYER, lambda m: None)
    separate.backward(dy)
    ours = _forward_then(LAYER, lambda m: None)
    ours.weight_grad = ours.bias_grad = np.zeros(4, np.float32)
    ours.backward(dy)
    np.testing.assert_array_equal(ours.weight_grad, separate.weight_grad + separate.bias_grad)


def test_gradient_total_may_be_an_ndarray_subclass(tmp_path):
    dy = np.ones((3, 4), np.float32)
    ours = _forward_then(LAYER, lambda m: None)
    ours.weight_grad = np.memmap(tmp_path / "weight_grad", np.float32, "w+", shape=(4,))
    ours.backward(dy)
    expected = _forward_then(LAYER, lambda m: None)
    expected.backward(dy)
    np.testing.assert_array_equal(ours.weight_grad, expected.weight_grad)


@requires_torch
@BY_KIND
def test_torch_tensor_parameter_gets_a_numpy_gradient(kind):
    expected = _forward_then(kind, lambda m: None)
    expected.backward(np.ones((3, 4), np.float32))
    ours = _forward_then(kind, lambda m: None)
    ours.weight = torch.from_numpy(ours.weight)  # the same values, seen as a tensor
    ours(np.random.default_rng(41).standard_normal((3, 4)).astype(np.float32))
    ours.backward(np.ones((3, 4), np.float32))
    assert type(ours.weight_grad) is np.ndarray and ours.weight_grad.dtype == np.float32
    np.testing.assert_array_equal(ours.weight_grad, expected.weight_grad)


@requires_torch
@BY_KIND
@pytest.mark.parametrize("requires_grad", [False, True], ids=["tensor", "parameter"])
def test_torch_parameters_assigned_work_everywhere(kind, requires_grad):
    # the module's parameters set to torch's own (an nn.Parameter requires grad): backward,
    # state_dict, load_state_dict, reset_parameters and a dask forward read or write them as
    # the forward does, through the NumPy view of their memory
    theirs = kind.theirs(4)
    ours = kind.ours(4)
    x = np.random.default_rng(42).standard_normal((3, 4)).astype(np.float32)
    with torch.no_grad():
        for name in kind.names:
            getattr(theirs, name).copy_(torch.from_numpy(getattr(randomize(kind.ours(4), seed=43), name)))
            param = getattr(theirs, name)
            setattr(ours, name, param if requires_grad else param.detach())
    expected = randomize(kind.ours(4), seed=43)
    np.testing.assert_array_equal(ours(x), expected(x))
    np.testing.assert_array_equal(ours.backward(np.ones_like(x)), expected.backward(np.ones_like(x)))
    for name in kind.names:
        np.testing.assert_array_equal(getattr(ours, f"{name}_grad"), getattr(expected, f"{name}_grad"))
    state = ours.state_dict()
    assert all(type(value) is np.ndarray for value in state.values())
    for name in kind.names:
        np.testing.assert_array_equal(state[name], getattr(expected, name))
    try:
        import dask.array as dask_array
    except ImportError:  # dask is a test dependency, but the suite runs without it too
        dask_array = None
    if dask_array is not None:
        lazy = ours(dask_array.from_array(x, chunks=(2, 4)))
        np.testing.assert_array_equal(lazy.compute(), expected(x))
    ours.reset_parameters()
    for name, initial in kind.parameters:
        assert torch.equal(getattr(theirs, name).detach(), torch.full((4,), initial))
    ours.load_state_dict(state)
    for name in kind.names:
        np.testing.assert_array_equal(getattr(theirs, name).detach().numpy(), state[name])


# what torch refuses as a parameter (it takes a Parameter or None), named as the message names it
NOT_PARAMETERS = [
    pytest.param([1.0, 2.0, 3.0, 4.0], "list", id="list"),
    pytest.param((1.0, 2.0, 3.0, 4.0), "tuple", id="tuple"),
    pytest.param(2.0, "float", id="float"),
    pytest.param(np.float32(2.0), "numpy.float32", id="numpy-scalar"),
    pytest.param("ones", "str", id="str"),
]


@BY_KIND
@pytest.mark.parametrize("value, type_name", NOT_PARAMETERS)
def test_assigning_a_non_array_parameter_is_refused(kind, value, type_name):
    # a list kept as the parameter would be converted afresh by every call, so that
    # reset_parameters and load_state_dict wrote into throwaway copies and changed nothing
    module = randomize(kind.ours(4), seed=44)
    before = module.weight.copy()
    message = f"cannot assign '{type_name}' as parameter 'weight' (numpy.ndarray, torch.Tensor or None expected)"
    with pytest.raises(TypeError, match=re.escape(message)):
        module.weight = value
    np.testing.assert_array_equal(module.weight, before)
    if torch is not None:
        with pytest.raises(TypeError, match=re.escape(f"cannot assign '{type_name}' as parameter 'weight'")):
            kind.theirs(4).weight = value


@BY_KIND
def test_assigning_a_parameter_takes_arrays_and_none(kind):
    module = kind.ours(4)
    x = np.random.default_rng(45).standard_normal((3, 4)).astype(np.float32)
    module.weight = np.full(4, 2.0, np.float32)
    module.reset_parameters()
    np.testing.assert_array_equal(module.weight, np.ones(4, np.float32))
    module.weight = None
    np.testing.assert_array_equal(module(x), kind.ours(4, elementwise_affine=False)(x))
    assert "weight" not in module.state_dict()


# ---------------------------------------------------------------------------------------------
# axis=: ConvNeXt's channels-first LayerNorm (and RMSNorm) on NCHW
# ---------------------------------------------------------------------------------------------

# (axis as given, how the repr prints it)
AXIS_SPELLINGS = [(1, "1"), (-3, "-3"), ((1,), "(1,)"), ((2, 1), "(2, 1)")]


@requires_torch
@pytest.mark.parametrize("axis, printed", AXIS_SPELLINGS, ids=[p for _, p in AXIS_SPELLINGS])
@BY_KIND
def test_repr_with_axis_is_torchs_with_the_axis_appended(kind, axis, printed):
    ns = (64,) if isinstance(axis, int) or len(axis) == 1 else (5, 64)
    assert repr(kind.ours(ns, axis=axis)) == repr(kind.theirs(ns))[:-1] + f", axis={printed})"


def test_repr_with_axis_text():
    assert repr(LAYER.ours(64, axis=1)) == "LayerNorm((64,), eps=1e-05, elementwise_affine=True, bias=True, axis=1)"
    assert repr(RMS.ours(64, axis=(1,))) == "RMSNorm((64,), eps=None, elementwise_affine=True, axis=(1,))"


@BY_KIND
def test_axis_none_prints_nothing(kind):
    assert "axis" not in repr(kind.ours(64)) and "axis" not in repr(kind.ours(64, axis=None))


@BY_KIND
def test_axis_does_not_change_parameters_or_state_dict(kind):
    with_axis, without = kind.ours(8, axis=1), kind.ours(8)
    assert list(with_axis.state_dict()) == list(without.state_dict())
    for name in kind.names:
        np.testing.assert_array_equal(getattr(with_axis, name), getattr(without, name))
        assert getattr(with_axis, name).shape == (8,)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@BY_KIND
def test_axis_survives_copies(kind, how):
    m = randomize(kind.ours(8, axis=1), seed=50).eval()
    m2 = pickle.loads(pickle.dumps(m)) if how == "pickle" else copy.deepcopy(m)
    assert repr(m2) == repr(m)
    x = np.random.default_rng(51).standard_normal((2, 8, 3, 5)).astype(np.float32)
    np.testing.assert_array_equal(m2(x), m(x))


def convnext_formula(x, weight, bias, eps):
    """ConvNeXt's channels-first LayerNorm as its authors write it, in float64 NumPy."""
    u = x.mean(1, keepdims=True)
    s = ((x - u) ** 2).mean(1, keepdims=True)
    return (x - u) / np.sqrt(s + eps) * weight[:, None, None] + bias[:, None, None]


def torch_channels_first(kind, x, weight, bias, eps, dy):
    """The formula written in torch (float64), for both kinds: (output, grads of x, weight, bias)."""
    xt, wt = torch.from_numpy(x).requires_grad_(True), torch.from_numpy(weight).requires_grad_(True)
    bt = None if bias is None else torch.from_numpy(bias).requires_grad_(True)
    if bt is not None:
        u = xt.mean(1, keepdim=True)
        s = ((xt - u) ** 2).mean(1, keepdim=True)
        y = (xt - u) / torch.sqrt(s + eps) * wt[:, None, None] + bt[:, None, None]
    else:
        y = xt / torch.sqrt((xt ** 2).mean(1, keepdim=True) + eps) * wt[:, None, None]
    y.backward(torch.from_numpy(dy))
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(), None if bt is None else bt.grad.numpy()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_layer_norm_axis1_forward_is_the_convnext_formula(dtype):
    rng = np.random.default_rng(52)
    ours = LAYER.ours(16, eps=1e-6, axis=1, dtype=np.dtype(dtype))
    randomize(ours, seed=53)
    x = (rng.standard_normal((2, 16, 7, 7)) + 2.0).astype(dtype)
    expected = convnext_formula(x.astype(np.float64), ours.weight.astype(np.float64), ours.bias.astype(np.float64),
                                1e-6)
    for mode in ("train", "eval"):
        y = ours.train(mode == "train")(x)
        assert y.shape == x.shape and y.dtype == np.dtype(dtype) and y.flags.c_contiguous
        assert_close(y, expected, 1e-6 if dtype == "float32" else 1e-13, f"{mode} output")


@requires_torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@BY_KIND
def test_axis1_training_matches_torch_autograd_of_the_formula(kind, dtype):
    # two steps: grad_input of each, and the parameter gradients accumulated over both
    rng = np.random.default_rng(54)
    ours = randomize(kind.ours(16, eps=1e-6, axis=1, dtype=np.dtype(dtype)), seed=55)
    weight = ours.weight.astype(np.float64)
    bias = ours.bias.astype(np.float64) if kind is LAYER else None
    totals = {}
    rtol = 1e-5 if dtype == "float32" else 1e-9
    for step in range(2):
        x = (rng.standard_normal((2, 16, 5, 7)) + step).astype(dtype)
        dy = rng.standard_normal((2, 16, 5, 7)).astype(dtype)
        y = ours(x)
        grad_input = ours.backward(dy)
        ty, tgx, tgw, tgb = torch_channels_first(kind, x.astype(np.float64), weight, bias, 1e-6, dy.astype(np.float64))
        assert_close(y, ty, rtol, f"output, step {step}")
        assert grad_input.shape == x.shape and grad_input.dtype == np.dtype(dtype)
        assert_close(grad_input, tgx, rtol, f"grad_input, step {step}")
        for name, grad in (("weight", tgw), ("bias", tgb)):
            if grad is not None:
                totals[name] = totals.get(name, 0) + grad
    for name in kind.names:
        assert_close(getattr(ours, name + "_grad"), totals[name], rtol, name + "_grad")


@requires_torch
@BY_KIND
def test_axis1_module_matches_torch_permute_route(kind):
    # what torch code does without axis=: permute NCHW to NHWC, normalize, permute back
    theirs = randomize_torch(kind.theirs(16), seed=56)
    ours = kind.ours(16, axis=1)
    ours.load_state_dict(theirs.state_dict())
    x = np.random.default_rng(57).standard_normal((2, 16, 5, 7)).astype(np.float32)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2).numpy()
    assert_close(ours(x), expected, 1e-5)
