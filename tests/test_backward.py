"""Backward pass (issue 3): layernorm.layer_norm_backward and LayerNorm.backward.

Oracles: torch.ops.aten.native_layer_norm_backward (fed the same mean/rstd), torch autograd of
F.layer_norm, a float64 NumPy formula, and central finite differences in float64.
"""

import gc
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import layernorm
from layernorm import LayerNorm

EPS = 1e-5
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-9}
COMPUTE = {np.dtype(np.float16): np.dtype(np.float32), np.dtype(np.float32): np.dtype(np.float32),
           np.dtype(np.float64): np.dtype(np.float64)}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def assert_close(actual, expected, rtol, what="", scale=1.0):
    """Relative to the largest expected magnitude (at least `scale`), so near-zero entries that
    come out of a cancellation are judged against the size of the terms that cancelled."""
    assert actual is not None, what
    actual = np.asarray(actual)
    assert actual.shape == np.shape(expected), what
    scale = max(float(np.max(np.abs(np.asarray(expected, np.float64)), initial=0.0)), scale)
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol, atol=rtol * scale, err_msg=what)


def ref_backward(grad_out, x, normalized_shape, weight, bias, eps=EPS):
    """Float64 ground truth: per row g = dy*w, xhat = (x-mean)*rstd,
    dx = rstd*(g - mean(g) - xhat*mean(g*xhat)), dw = sum_rows dy*xhat, db = sum_rows dy."""
    n = int(np.prod(normalized_shape))
    x2 = np.asarray(x, np.float64).reshape(-1, n)
    dy = np.asarray(grad_out, np.float64).reshape(-1, n)
    mean = x2.mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x2 - mean) ** 2).mean(axis=1, keepdims=True) + eps)
    xhat = (x2 - mean) * rstd
    g = dy * (np.asarray(weight, np.float64).reshape(1, n) if weight is not None else 1.0)
    if x2.shape[0]:
        dx = rstd * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    else:
        dx = g
    dw = (dy * xhat).sum(axis=0).reshape(normalized_shape) if weight is not None else None
    db = dy.sum(axis=0).reshape(normalized_shape) if bias is not None else None
    return dx.reshape(np.shape(x)), dw, db


def ref_forward(x, normalized_shape, weight, bias, eps=EPS):
    x = np.asarray(x, np.float64)
    axes = tuple(range(-len(normalized_shape), 0))
    mean = x.mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def grad_input_scale(dy, x, normalized_shape, w):
    """Size of the terms grad_input is a cancellation of: max over elements of rstd * |dy * w|."""
    n = int(np.prod(normalized_shape))
    x2 = np.asarray(x, np.float64).reshape(-1, n)
    rstd = 1.0 / np.sqrt(x2.var(axis=1, keepdims=True) + EPS) if x2.shape[0] else np.ones((0, 1))
    g = np.abs(np.asarray(dy, np.float64).reshape(-1, n))
    if w is not None:
        g = g * np.abs(np.asarray(w, np.float64).reshape(1, n))
    return max(float(np.max(rstd * g, initial=0.0)), 1.0)


def grad_weight_scale(dy, x, normalized_shape):
    """Size of the products grad_weight sums: per column sum_rows |dy| * (|x| + |mean|) * rstd
    (an implementation may form x*rstd - mean*rstd, which cancels exactly when N == 1)."""
    n = int(np.prod(normalized_shape))
    x2 = np.asarray(x, np.float64).reshape(-1, n)
    if not x2.shape[0]:
        return 1.0
    mean = x2.mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(x2.var(axis=1, keepdims=True) + EPS)
    dy2 = np.abs(np.asarray(dy, np.float64).reshape(-1, n))
    return max(float(np.max((dy2 * (np.abs(x2) + np.abs(mean)) * rstd).sum(axis=0))), 1.0)


def make_case(shape, normalized_shape, dtype, affine, seed):
    """x, grad_out, weight, bias for one case; params are float32/float64 (the compute dtype)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    pdt = COMPUTE[dtype]
    w = (1 + 0.5 * rng.standard_normal(normalized_shape)).astype(pdt) if affine in ("both", "weight") else None
    b = rng.standard_normal(normalized_shape).astype(pdt) if affine in ("both", "bias") else None
    return x, dy, w, b


def ours_stats(x, normalized_shape, w, b):
    _, mean, rstd = layernorm.native_layer_norm(x, normalized_shape, w, b, EPS)
    return mean, rstd


def t(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


def torch_native_backward(dy, x, normalized_shape, mean, rstd, w, b, upcast=False):
    """torch's kernel on the same data and the same mean/rstd; float16 data upcast to float32."""
    if upcast:
        dy, x = dy.astype(np.float32), x.astype(np.float32)
    mask = [True, w is not None, b is not None]  # torch refuses True for a missing parameter
    gi, gw, gb = torch.ops.aten.native_layer_norm_backward(
        t(dy), t(x), list(normalized_shape), t(mean), t(rstd), t(w), t(b), mask)
    return tuple(None if r is None else r.numpy() for r in (gi, gw, gb))


def torch_autograd(dy, x, normalized_shape, w, b):
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    wt = None if w is None else torch.from_numpy(w.copy()).requires_grad_(True)
    bt = None if b is None else torch.from_numpy(b.copy()).requires_grad_(True)
    F.layer_norm(xt, list(normalized_shape), wt, bt, EPS).backward(torch.from_numpy(dy.copy()))
    return tuple(None if p is None else p.grad.numpy() for p in (xt, wt, bt))


SHAPES = [
    ("4x8", (4, 8), (8,)),
    ("3x17", (3, 17), (17,)),
    ("2x3x4_ns3x4", (2, 3, 4), (3, 4)),
    ("2x3x5x5_ns3x5x5", (2, 3, 5, 5), (3, 5, 5)),
    ("N1_5x1", (5, 1), (1,)),
    ("empty_0x6", (0, 6), (6,)),
    ("1d_7", (7,), (7,)),
    ("odd_5x4097", (5, 4097), (4097,)),
]
SHAPE_IDS = [s[0] for s in SHAPES]
AFFINE = ["both", "weight", "bias", "neither"]


# ---------------------------------------------------------------------------------------------
# layer_norm_backward vs torch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("case_id, shape, ns", SHAPES, ids=SHAPE_IDS)
def test_backward_matches_torch_native(case_id, shape, ns, affine, dtype):
    x, dy, w, b = make_case(shape, ns, dtype, affine, seed=1)
    mean, rstd = ours_stats(x, ns, w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
    tgi, tgw, tgb = torch_native_backward(dy, x, ns, mean, rstd, w, b)
    rtol = RTOL[np.dtype(dtype)]
    assert_close(gi, tgi, rtol, "grad_input", scale=grad_input_scale(dy, x, ns, w))
    assert gi.dtype == np.dtype(dtype)
    gw_scale = grad_weight_scale(dy, x, ns)
    for name, mine, theirs, scale in (("grad_weight", gw, tgw, gw_scale), ("grad_bias", gb, tgb, 1.0)):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, theirs, rtol, name, scale)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("case_id, shape, ns", SHAPES, ids=SHAPE_IDS)
def test_backward_matches_torch_autograd_and_float64(case_id, shape, ns, affine, dtype):
    x, dy, w, b = make_case(shape, ns, dtype, affine, seed=2)
    mean, rstd = ours_stats(x, ns, w, b)
    got = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
    auto = torch_autograd(dy, x, ns, w, b)
    ref = ref_backward(dy, x, ns, w, b)
    rtol = RTOL[np.dtype(dtype)]
    gi_scale = grad_input_scale(dy, x, ns, w)
    for name, mine, theirs, truth in zip(("grad_input", "grad_weight", "grad_bias"), got, auto, ref):
        if truth is None:
            assert mine is None, name
            continue
        scale = {"grad_input": gi_scale, "grad_weight": grad_weight_scale(dy, x, ns)}.get(name, 1.0)
        assert_close(mine, theirs, rtol, name + " vs autograd", scale)
        assert_close(mine, truth, rtol, name + " vs float64", scale)


@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("case_id, shape, ns", SHAPES, ids=SHAPE_IDS)
def test_backward_float16_matches_torch_in_float32(case_id, shape, ns, affine):
    x, dy, w, b = make_case(shape, ns, "float16", affine, seed=3)
    mean, rstd = ours_stats(x, ns, w, b)
    assert mean.dtype == np.float32 and rstd.dtype == np.float32
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, ns, mean, rstd, w, b)
    tgi, tgw, tgb = torch_native_backward(dy, x, ns, mean, rstd, w, b, upcast=True)
    assert gi.dtype == np.float16
    assert_close(gi, tgi, 2e-3, "grad_input", grad_input_scale(dy, x, ns, w))  # rounding to float16 (half an ulp ~ 5e-4)
    gw_scale = grad_weight_scale(dy, x, ns)
    for name, mine, theirs, scale in (("grad_weight", gw, tgw, gw_scale), ("grad_bias", gb, tgb, 1.0)):
        if theirs is None:
            assert mine is None, name
        else:
            assert mine.dtype == np.float32, name
            assert_close(mine, theirs, 1e-5, name, scale)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_backward_output_dtypes_and_shapes(dtype):
    x, dy, w, b = make_case((3, 2, 4), (2, 4), dtype, "both", seed=4)
    mean, rstd = ours_stats(x, (2, 4), w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, (2, 4), mean, rstd, w, b)
    assert gi.dtype == np.dtype(dtype) and gi.shape == (3, 2, 4)
    assert gw.dtype == COMPUTE[np.dtype(dtype)] and gw.shape == (2, 4)
    assert gb.dtype == COMPUTE[np.dtype(dtype)] and gb.shape == (2, 4)


def test_backward_keyword_arguments_and_int_normalized_shape():
    x, dy, w, b = make_case((4, 8), (8,), "float64", "both", seed=5)
    mean, rstd = ours_stats(x, (8,), w, b)
    by_kw = layernorm.layer_norm_backward(dy, x, 8, mean, rstd, weight=w, bias=b,
                                          output_mask=(True, True, True))
    ref = ref_backward(dy, x, (8,), w, b)
    for mine, truth in zip(by_kw, ref):
        assert_close(mine, truth, 1e-9)


def test_backward_does_not_mutate_inputs():
    x, dy, w, b = make_case((4, 8), (8,), "float32", "both", seed=6)
    mean, rstd = ours_stats(x, (8,), w, b)
    saved = [a.copy() for a in (x, dy, w, b, mean, rstd)]
    layernorm.layer_norm_backward(dy, x, (8,), mean, rstd, w, b)
    for before, after in zip(saved, (x, dy, w, b, mean, rstd)):
        np.testing.assert_array_equal(before, after)


# ---------------------------------------------------------------------------------------------
# output_mask, empty batch
# ---------------------------------------------------------------------------------------------

MASKS = [(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)]


@pytest.mark.parametrize("mask", MASKS, ids=["".join("T" if m else "F" for m in k) for k in MASKS])
def test_output_mask_gives_none_entries(mask):
    x, dy, w, b = make_case((4, 8), (8,), "float64", "both", seed=7)
    mean, rstd = ours_stats(x, (8,), w, b)
    got = layernorm.layer_norm_backward(dy, x, (8,), mean, rstd, w, b, output_mask=mask)
    assert len(got) == 3
    theirs = torch.ops.aten.native_layer_norm_backward(t(dy), t(x), [8], t(mean), t(rstd), t(w), t(b),
                                                       list(mask))
    for name, wanted, mine, ref in zip(("grad_input", "grad_weight", "grad_bias"), mask, got, theirs):
        if not wanted:
            assert mine is None and ref is None, name
        else:
            assert_close(mine, ref.numpy(), 1e-9, name)


@pytest.mark.parametrize("affine", ["weight", "bias", "neither"])
def test_missing_param_gives_none_even_when_mask_true(affine):
    x, dy, w, b = make_case((4, 8), (8,), "float32", affine, seed=8)
    mean, rstd = ours_stats(x, (8,), w, b)
    _, gw, gb = layernorm.layer_norm_backward(dy, x, (8,), mean, rstd, w, b, output_mask=(True,) * 3)
    assert (gw is None) == (w is None)
    assert (gb is None) == (b is None)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_empty_batch_gives_empty_grad_input_and_zero_param_grads(dtype):
    x, dy, w, b = make_case((0, 6), (6,), dtype, "both", seed=9)
    mean, rstd = ours_stats(x, (6,), w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, (6,), mean, rstd, w, b)
    assert gi.shape == (0, 6) and gi.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(gw, np.zeros(6))
    np.testing.assert_array_equal(gb, np.zeros(6))
    assert gw.shape == (6,) and gb.shape == (6,)


def test_empty_batch_multi_dim():
    x, dy, w, b = make_case((2, 0, 3, 4), (3, 4), "float32", "both", seed=10)
    mean, rstd = ours_stats(x, (3, 4), w, b)
    gi, gw, gb = layernorm.layer_norm_backward(dy, x, (3, 4), mean, rstd, w, b)
    assert gi.shape == (2, 0, 3, 4)
    np.testing.assert_array_equal(gw, np.zeros((3, 4)))
    np.testing.assert_array_equal(gb, np.zeros((3, 4)))


# ---------------------------------------------------------------------------------------------
# finite differences (float64)
# ---------------------------------------------------------------------------------------------

def fd_setup():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 5))
    w = 1 + 0.5 * rng.standard_normal(5)
    b = rng.standard_normal(5)
    g = rng.standard_normal((3, 5))  # loss = sum(y * g), so dL/dy = g
    return x, w, b, g


@pytest.mark.parametrize("wrt", ["input", "weight", "bias"])
def test_finite_difference_gradient(wrt):
    x, w, b, g = fd_setup()
    mean, rstd = ours_stats(x, (5,), w, b)
    got = dict(zip(("input", "weight", "bias"), layernorm.layer_norm_backward(g, x, (5,), mean, rstd, w, b)))
    args = {"input": x, "weight": w, "bias": b}
    var = args[wrt]
    numeric = np.zeros_like(var)
    h = 1e-6
    for idx in np.ndindex(var.shape):
        vals = []
        for step in (h, -h):
            bumped = {k: v.copy() for k, v in args.items()}
            bumped[wrt][idx] += step
            vals.append(np.sum(ref_forward(bumped["input"], (5,), bumped["weight"], bumped["bias"]) * g))
        numeric[idx] = (vals[0] - vals[1]) / (2 * h)
    np.testing.assert_allclose(got[wrt], numeric, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# non-contiguous layouts
# ---------------------------------------------------------------------------------------------

def layout(a, kind):
    """The same (8, 16) values in another memory layout."""
    if kind == "contiguous":
        return a
    if kind == "transposed":
        out = np.ascontiguousarray(a.T).T
    elif kind == "step_slice":
        big = np.zeros((8, 32), a.dtype)
        big[:, ::2] = a
        out = big[:, ::2]
    elif kind == "fortran":
        out = np.asfortranarray(a)
    elif kind == "negative_stride":
        out = np.ascontiguousarray(a[::-1])[::-1]
    np.testing.assert_array_equal(out, a)
    assert not out.flags.c_contiguous
    return out


LAYOUTS = ["transposed", "step_slice", "fortran", "negative_stride"]
LAYOUT_CASES = [(g, i) for g in LAYOUTS + ["contiguous"] for i in LAYOUTS + ["contiguous"]
                if (g, i) != ("contiguous", "contiguous")]


@pytest.mark.parametrize("go_layout, x_layout", LAYOUT_CASES,
                         ids=[f"grad_{g}-input_{i}" for g, i in LAYOUT_CASES])
def test_non_contiguous_layouts(go_layout, x_layout):
    x, dy, w, b = make_case((8, 16), (16,), "float32", "both", seed=12)
    mean, rstd = ours_stats(x, (16,), w, b)
    expected = layernorm.layer_norm_backward(dy, x, (16,), mean, rstd, w, b)
    got = layernorm.layer_norm_backward(layout(dy, go_layout), layout(x, x_layout), (16,), mean, rstd,
                                        w, b)
    truth = ref_backward(dy, x, (16,), w, b)
    for name, mine, same, ref in zip(("grad_input", "grad_weight", "grad_bias"), got, expected, truth):
        assert mine.flags.c_contiguous, name
        np.testing.assert_allclose(mine, same, rtol=1e-6, atol=1e-6, err_msg=name)
        assert_close(mine, ref, 1e-5, name)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def good_args():
    x, dy, w, b = make_case((4, 8), (8,), "float32", "both", seed=13)
    mean, rstd = ours_stats(x, (8,), w, b)
    return {"grad_output": dy, "input": x, "normalized_shape": (8,), "mean": mean, "rstd": rstd,
            "weight": w, "bias": b}


def call(args):
    return layernorm.layer_norm_backward(args["grad_output"], args["input"], args["normalized_shape"],
                                         args["mean"], args["rstd"], args["weight"], args["bias"])


def test_error_weight_shape_torch_text():
    args = good_args()
    args["weight"] = np.ones(7, np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert ("Expected weight to be of same shape as normalized_shape, but got weight of shape [7] "
            "and normalized_shape = [8]") in str(err.value)


def test_error_bias_shape_torch_text():
    args = good_args()
    args["bias"] = np.ones(7, np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert ("Expected bias to be of same shape as normalized_shape, but got bias of shape [7] "
            "and normalized_shape = [8]") in str(err.value)


def test_error_input_trailing_shape_torch_text():
    args = good_args()
    args["input"] = np.zeros((4, 9), np.float32)
    args["grad_output"] = np.zeros((4, 9), np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert ("Given normalized_shape=[8], expected input with shape [*, 8], but got input of "
            "size[4, 9]") in str(err.value)


@pytest.mark.parametrize("shape", [(4, 9), (5, 8), (32,)], ids=["4x9", "5x8", "flat_32"])
def test_error_grad_output_shape_mismatch(shape):
    # DELIBERATE DIFFERENCE: torch does not check grad_output against input; we refuse.
    args = good_args()
    args["grad_output"] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError) as err:
        call(args)
    assert "grad_out" in str(err.value)


@pytest.mark.parametrize("which", ["mean", "rstd"])
def test_error_stats_with_too_few_elements(which):
    args = good_args()
    args[which] = args[which][:3]
    with pytest.raises(ValueError):
        call(args)


def test_error_empty_normalized_shape():
    args = good_args()
    args["normalized_shape"] = ()
    args["weight"] = args["bias"] = None
    with pytest.raises(ValueError, match="at least 1-dimensional"):
        call(args)


# ---------------------------------------------------------------------------------------------
# LayerNorm module training support
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
    single = ref_backward(dy, x, (3, 5), ours.weight, ours.bias)[1]
    assert not np.allclose(ours.weight_grad, single, rtol=1e-3, atol=1e-3)


def test_module_zero_grad_sets_none():
    _, ours = torch_and_ours(6, seed=18)
    x = np.random.default_rng(19).standard_normal((3, 6)).astype(np.float32)
    ours(x)
    ours.backward(np.ones((3, 6), np.float32))
    assert ours.weight_grad is not None and ours.bias_grad is not None
    ours.zero_grad()
    assert ours.weight_grad is None and ours.bias_grad is None


def test_module_zero_grad_then_backward_starts_fresh():
    _, ours = torch_and_ours(6, seed=20)
    rng = np.random.default_rng(21)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    dy = rng.standard_normal((3, 6)).astype(np.float32)
    ours(x)
    ours.backward(dy)
    ours.zero_grad()
    ours(x)
    ours.backward(dy)
    _, dw, db = ref_backward(dy, x, (6,), ours.weight, ours.bias)
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


def retained_bytes_after_forward(training):
    """Bytes still allocated after a forward on a 4 MB input once input and output are dropped."""
    ours = LayerNorm(1024).train(training)
    gc.collect()
    tracemalloc.start()
    try:
        x = np.random.default_rng(23).standard_normal((1024, 1024)).astype(np.float32)
        y = ours(x)
        del x, y
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return retained, ours


def test_module_training_forward_keeps_the_input():
    # Control for the next test: the measurement does see what a training forward keeps.
    retained, ours = retained_bytes_after_forward(True)
    assert retained >= 4 * 1024 * 1024
    del ours


def test_module_eval_forward_keeps_nothing():
    retained, ours = retained_bytes_after_forward(False)
    assert retained < 1024 * 1024
    del ours


# ---------------------------------------------------------------------------------------------
# threads and SIMD levels
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def restore_threads():
    saved = layernorm.get_num_threads()
    yield
    layernorm.set_num_threads(saved)


@pytest.fixture
def restore_simd():
    saved = layernorm.simd_level()
    yield
    layernorm.set_simd_level(saved)


def big_case():
    x, dy, w, b = make_case((512, 1024), (1024,), "float32", "both", seed=24)
    mean, rstd = ours_stats(x, (1024,), w, b)
    return x, dy, w, b, mean, rstd


def test_backward_identical_for_1_and_2_threads(restore_threads):
    x, dy, w, b, mean, rstd = big_case()
    results = []
    for n in (1, 2):
        layernorm.set_num_threads(n)
        assert layernorm.get_num_threads() == n
        results.append(layernorm.layer_norm_backward(dy, x, (1024,), mean, rstd, w, b))
    for name, one, two in zip(("grad_input", "grad_weight", "grad_bias"), *results):
        assert np.array_equal(one, two), name


def test_module_backward_identical_for_1_and_2_threads(restore_threads):
    x, dy, w, b, _, _ = big_case()
    grads = []
    for n in (1, 2):
        layernorm.set_num_threads(n)
        m = LayerNorm(1024)
        m.load_state_dict({"weight": w, "bias": b})
        m(x)
        gi = m.backward(dy)
        grads.append((gi, m.weight_grad, m.bias_grad))
    for name, one, two in zip(("grad_input", "weight_grad", "bias_grad"), *grads):
        assert np.array_equal(one, two), name


def test_set_num_threads_rejects_zero(restore_threads):
    with pytest.raises(ValueError):
        layernorm.set_num_threads(0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("level", layernorm.available_simd_levels())
def test_results_independent_of_simd_level(level, dtype, restore_simd):
    x, dy, w, b = make_case((33, 1031), (1031,), dtype, "both", seed=25)
    layernorm.set_simd_level("scalar")
    base_fwd = layernorm.native_layer_norm(x, (1031,), w, b, EPS)
    base_bwd = layernorm.layer_norm_backward(dy, x, (1031,), base_fwd[1], base_fwd[2], w, b)
    layernorm.set_simd_level(level)
    assert layernorm.simd_level() == level
    fwd = layernorm.native_layer_norm(x, (1031,), w, b, EPS)
    bwd = layernorm.layer_norm_backward(dy, x, (1031,), fwd[1], fwd[2], w, b)
    tol = 1e-6 if dtype == "float32" else 1e-12
    names = ("output", "mean", "rstd", "grad_input", "grad_weight", "grad_bias")
    for name, mine, base in zip(names, fwd + bwd, base_fwd + base_bwd):
        assert_close(mine, base, tol, name)


def test_available_simd_levels_includes_scalar():
    levels = layernorm.available_simd_levels()
    assert isinstance(levels, tuple) and "scalar" in levels
    assert layernorm.simd_level() in levels


def test_set_simd_level_unknown_raises(restore_simd):
    with pytest.raises(ValueError):
        layernorm.set_simd_level("sse9000")
