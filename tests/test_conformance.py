"""Conformance with outside test suites: the cases ONNX and torch test their own norms with, run
through ours.

- ONNX: the node test cases of the ``onnx`` package for LayerNormalization and RMSNormalization
  (``onnx.backend.test.case.node``: each export function's ``expect`` calls, captured, with the
  seed ONNX gives them).  ONNX's ``axis`` is the first normalized axis, so normalized_shape is
  ``X.shape[axis:]``; Scale and B are broadcast to it; the outputs are compared at the tolerance
  ONNX judges backends by (rtol 1e-3, atol 1e-7), once over the trailing dims and once with
  ``axis=`` the same axes.  What does not map (other stash_types, input types) skips with its
  reason.
- torch: the OpInfo samples of native_layer_norm, nn.functional.layer_norm and
  nn.functional.rms_norm (``torch.testing._internal.common_methods_invocations.op_db``) and the
  ModuleInfo inputs of nn.LayerNorm and nn.RMSNorm (``common_modules.module_db``), on the CPU in
  float32 and float64: forward against torch's result, backward against torch autograd, and
  OpInfo's error inputs refused with torch's text.

Without onnx, or without torch and expecttest (which torch's test internals import), these skip
with the reason.
"""

import importlib
import re
from typing import Any, Dict, List, NamedTuple

import numpy as np
import pytest

import layernorm
from helpers import (GRAD_TORCH_RTOL, LAYER_NORM, RMS_NORM, assert_close, from_torch, grad_input_scale, grad_weight_scale,
                     torch)

try:
    import onnx
    from onnx.backend.test.case.base import Base as OnnxExporter
    importlib.import_module("onnx.backend.test.case.node.rmsnormalization")  # onnx >= 1.18
    NO_ONNX_REASON = None
except ImportError as error:
    onnx = None
    NO_ONNX_REASON = f"onnx >= 1.18 is not installed ({error}): its node tests are the cases"

try:
    import expecttest  # noqa: F401  (torch's test internals need it)
except ImportError:
    expecttest = None

# ---------------------------------------------------------------------------------------------
# ONNX
# ---------------------------------------------------------------------------------------------

ONNX_MODULES = {"LayerNormalization": "layernormalization", "RMSNormalization": "rmsnormalization"}
# How ONNX's backend test runner compares outputs (onnx.backend.test.case.node.expect's TestCase)
ONNX_RTOL, ONNX_ATOL = 1e-3, 1e-7


class OnnxCase(NamedTuple):
    name: str
    op_type: str
    attributes: Dict[str, Any]  # the node's, with the schema's defaults for those it leaves out
    inputs: List[np.ndarray]
    outputs: List[np.ndarray]


def onnx_cases():
    """Every case the node tests of ONNX_MODULES export, in their order, with their seeds."""
    cases = []

    def capture(node, inputs, outputs, name, **kwargs):
        schema = onnx.defs.get_schema(node.op_type)
        attributes = {key: onnx.helper.get_attribute_value(value.default_value)
                      for key, value in schema.attributes.items() if value.default_value.name}
        attributes.update({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
        cases.append(OnnxCase(name, node.op_type, attributes, list(inputs), list(outputs)))

    for op_type, module_name in ONNX_MODULES.items():
        module = importlib.import_module(f"onnx.backend.test.case.node.{module_name}")
        exporters = [value for value in vars(module).values()
                     if isinstance(value, type) and issubclass(value, OnnxExporter) and value is not OnnxExporter]
        real_expect, module.expect = module.expect, capture
        try:
            for exporter in exporters:
                for attribute, value in vars(exporter).items():
                    if attribute.startswith("export"):
                        np.random.seed(0)  # as ONNX's exporter seeds each export
                        getattr(exporter, attribute)()
        finally:
            module.expect = real_expect
    return cases


ONNX_CASES = onnx_cases() if onnx is not None else []
ONNX_PARAMS = ([pytest.param(case, route, id=f"{case.name}-{route}") for case in ONNX_CASES
                for route in ("trailing", "axis")]
               or [pytest.param(None, None, marks=pytest.mark.skip(reason=NO_ONNX_REASON), id="onnx")])


def unmapped(case):
    """Why a case does not map onto our functions, or None."""
    x = case.inputs[0]
    if x.dtype not in (np.float16, np.float32, np.float64):
        return f"input of dtype {x.dtype}: we take float16, float32 and float64"
    if case.attributes.get("stash_type", 1) != 1:
        return f"stash_type={case.attributes['stash_type']}: our statistics are float32 for float32 input"
    return None


@pytest.mark.parametrize("case, route", ONNX_PARAMS)
def test_onnx_node_case(case, route):
    reason = unmapped(case)
    if reason:
        pytest.skip(reason)
    x, *params = case.inputs
    axis = case.attributes["axis"] % x.ndim
    ns = x.shape[axis:]
    params = [np.broadcast_to(p, ns) for p in params]  # Scale, and B if given
    keywords = {"axis": tuple(range(axis, x.ndim))} if route == "axis" else {}
    eps = case.attributes["epsilon"]
    if case.op_type == "LayerNormalization":
        ours = layernorm.native_layer_norm(x, ns, *params, eps, **keywords)
    else:
        ours = (layernorm.rms_norm(x, ns, *params, eps, **keywords),)
    assert len(ours) >= len(case.outputs)
    for name, mine, expected in zip(("Y", "Mean", "InvStdDev"), ours, case.outputs):
        assert mine.shape == expected.shape and mine.dtype == expected.dtype, name
        np.testing.assert_allclose(mine, expected, rtol=ONNX_RTOL, atol=ONNX_ATOL, err_msg=f"{case.name}: {name}")


@pytest.mark.skipif(onnx is None, reason=str(NO_ONNX_REASON))
@pytest.mark.parametrize("op_type", list(ONNX_MODULES))
def test_onnx_has_cases_for(op_type):
    # an onnx release that moves its cases must not leave this file testing nothing
    assert sum(case.op_type == op_type for case in ONNX_CASES) >= 10


# ---------------------------------------------------------------------------------------------
# torch's OpInfo samples and ModuleInfo inputs
# ---------------------------------------------------------------------------------------------

# our function and norm kind for each OpInfo
OPS = {"native_layer_norm": LAYER_NORM, "nn.functional.layer_norm": LAYER_NORM, "nn.functional.rms_norm": RMS_NORM}
OURS = {"native_layer_norm": "native_layer_norm", "nn.functional.layer_norm": "layer_norm",
        "nn.functional.rms_norm": "rms_norm"}
DTYPES = ("float32", "float64")
RTOL = {"float32": 1e-5, "float64": 1e-12}


def torch_internals_missing():
    if torch is None:
        return "torch is not installed: its OpInfo and ModuleInfo are the cases"
    if expecttest is None:
        return "expecttest is not installed: torch.testing._internal imports it"
    return None


def torch_samples():
    """pytest params (op, dtype name, sample) of OPS' samples and error inputs, and of the
    ModuleInfo inputs of nn.LayerNorm and nn.RMSNorm."""
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.common_modules import module_db

    samples, errors, modules = [], [], []
    for op in op_db:
        if op.name not in OPS:
            continue
        for dtype in DTYPES:
            torch.manual_seed(0)
            for i, sample in enumerate(op.sample_inputs("cpu", getattr(torch, dtype), requires_grad=True)):
                samples.append(pytest.param(op, dtype, sample, id=f"{op.name}-{dtype}-{i}"))
        if op.error_inputs_func is not None:
            for i, error in enumerate(op.error_inputs("cpu")):
                errors.append(pytest.param(op, error, id=f"{op.name}-{i}"))
    for info in module_db:
        if info.module_cls not in (torch.nn.LayerNorm, torch.nn.RMSNorm):
            continue
        for dtype in DTYPES:
            inputs = info.module_inputs_func(info, device="cpu", dtype=getattr(torch, dtype), requires_grad=True,
                                             training=True)
            for i, module_input in enumerate(inputs):
                modules.append(pytest.param(info.module_cls, dtype, module_input,
                                            id=f"{info.module_cls.__name__}-{dtype}-{module_input.desc or i}"))
    return samples, errors, modules


def skipped(reason, arguments):
    """The one param of a test whose cases could not be gathered, skipped with the reason."""
    return [pytest.param(*[None] * arguments, marks=pytest.mark.skip(reason=reason), id="torch")]


MISSING = torch_internals_missing()
if MISSING:
    SAMPLES, ERRORS, MODULES = skipped(MISSING, 3), skipped(MISSING, 2), skipped(MISSING, 3)
else:
    SAMPLES, ERRORS, MODULES = torch_samples()


def unpack(op, args, kwargs):
    """(normalized_shape, weight, bias, eps) of an OpInfo call (None for what it leaves out;
    eps as given, None for RMSNorm's default)."""
    kind = OPS[op.name]
    ns, *params = args
    if op.name == "native_layer_norm":
        weight, bias, eps = params
        return ns, weight, bias, eps
    params += [None] * (2 - len(params))
    return ns, params[0], params[1] if kind.centred else None, kwargs.get("eps", kind.default_eps)


def gradient_scales(kind, dy, x, ns, weight, eps):
    """The size of the terms each of (grad_input, grad_weight, grad_bias) sums, which torch's
    float32 kernels round (a row of one element: grad_input is 0 up to rstd * |dy * w|)."""
    eps = kind.eps_value(x, eps)
    batch = tuple(range(x.ndim - len(ns)))
    return (grad_input_scale(dy, x, ns, weight, eps, centred=kind.centred),
            grad_weight_scale(dy, x, ns, eps, centred=kind.centred),
            max(float(np.abs(dy.astype(np.float64)).sum(axis=batch).max(initial=0.0)), 1.0))


@pytest.mark.parametrize("op, dtype, sample", SAMPLES)
def test_torch_opinfo_sample_forward(op, dtype, sample):
    kind = OPS[op.name]
    with torch.no_grad():
        expected = op(sample.input, *sample.args, **sample.kwargs)
    ours = getattr(layernorm, OURS[op.name])(sample.input, *sample.args, **sample.kwargs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    ours = ours if isinstance(ours, tuple) else (ours,)
    assert len(ours) == len(expected)
    for i, (mine, theirs) in enumerate(zip(ours, expected)):
        theirs = from_torch(theirs)
        assert isinstance(mine, np.ndarray) and mine.shape == theirs.shape and mine.dtype == theirs.dtype, i
        assert_close(mine, theirs, RTOL[dtype], f"{op.name} result {i}")
    # and the float64 truth
    x = from_torch(sample.input)
    ns, weight, bias, eps = unpack(op, sample.args, sample.kwargs)
    truth = kind.reference(x, ns, from_torch(weight), from_torch(bias), kind.eps_value(x, eps))[0]
    assert_close(ours[0], truth, RTOL[dtype], f"{op.name} vs the float64 reference")


@pytest.mark.parametrize("op, dtype, sample", SAMPLES)
def test_torch_opinfo_sample_backward(op, dtype, sample):
    # torch autograd through the op, against native() + backward()
    kind = OPS[op.name]
    x = sample.input.detach().clone().requires_grad_(True)
    args = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in sample.args]
    out = op(x, *args, **sample.kwargs)
    out = out[0] if isinstance(out, tuple) else out
    dy = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    out.backward(dy)
    ns, weight, bias, eps = unpack(op, args, sample.kwargs)
    x_np, w_np, b_np = from_torch(x), from_torch(weight), from_torch(bias)
    stats = kind.native(x_np, ns, w_np, b_np, eps)[1:]
    grads = kind.backward(dy.numpy(), x_np, ns, stats, w_np, b_np)
    scales = gradient_scales(kind, dy.numpy(), x_np, ns, w_np, eps)
    for name, mine, theirs, scale in zip(("grad_input", "grad_weight", "grad_bias"), grads, (x, weight, bias), scales):
        if theirs is None:
            assert mine is None, name
        else:
            assert_close(mine, from_torch(theirs.grad), GRAD_TORCH_RTOL[np.dtype(dtype)], f"{op.name} {name}", scale)


@pytest.mark.parametrize("op, error", ERRORS)
def test_torch_opinfo_error_input(op, error):
    # torch's RuntimeError for a bad value is our ValueError, with torch's text
    sample = error.sample_input
    with pytest.raises((ValueError, TypeError)) as info:
        getattr(layernorm, OURS[op.name])(sample.input, *sample.args, **sample.kwargs)
    assert isinstance(info.value, ValueError if error.error_type is RuntimeError else TypeError)
    assert re.search(error.error_regex, str(info.value)), str(info.value)


@pytest.mark.parametrize("module_cls, dtype, module_input", MODULES)
def test_torch_module_info_input(module_cls, dtype, module_input):
    generator = torch.Generator().manual_seed(0)
    args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    theirs = module_cls(*args, **kwargs).to(getattr(torch, dtype))
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    ours = getattr(layernorm, module_cls.__name__)(*args, **kwargs, dtype=np.dtype(dtype))
    ours.load_state_dict(theirs.state_dict())
    x = module_input.forward_input.args[0].detach().clone().requires_grad_(True)
    out = theirs(x)
    mine = ours(x.detach())
    assert mine.shape == tuple(out.shape) and mine.dtype == np.dtype(dtype)
    assert_close(mine, from_torch(out), RTOL[dtype], "output")
    # one training step: grad_input and the parameters' gradients
    dy = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    out.backward(dy)
    kind = LAYER_NORM if module_cls is torch.nn.LayerNorm else RMS_NORM
    scales = dict(zip(("grad_input", "weight", "bias"), gradient_scales(
        kind, dy.numpy(), from_torch(x), ours.normalized_shape, from_torch(theirs.weight), ours.eps)))
    grad_rtol = GRAD_TORCH_RTOL[np.dtype(dtype)]
    assert_close(ours.backward(dy.numpy()), from_torch(x.grad), grad_rtol, "grad_input", scales["grad_input"])
    for name, param in theirs.named_parameters():
        assert_close(getattr(ours, name + "_grad"), from_torch(param.grad), grad_rtol, name + "_grad", scales[name])
