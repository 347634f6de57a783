"""ConvNeXt's channels-first LayerNorm on NCHW arrays with ``layernorm.LayerNorm(C, axis=1)``.

ConvNeXt normalizes each pixel's C channels of an (N, C, H, W) array.  torch's LayerNorm only
normalizes trailing dims, so torch code either writes the formula out::

    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    x = (x - u) / torch.sqrt(s + eps)
    x = weight[:, None, None] * x + bias[:, None, None]

or permutes to (N, H, W, C), calls F.layer_norm and permutes back.  ``LayerNorm(C, axis=1)``
reads the NCHW array where it is and gives a C-contiguous NCHW output, forward and backward.

``build_convnext_norm`` returns the NumPy module's forward and torch's two routes for the same
weights, for the checks below and for timing.  Run ``python examples/convnext_norm.py``: it
prints one line when all agree to float32 precision (forward and backward), and fails otherwise.
"""

from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

import layernorm

# The largest difference allowed, relative to the largest value: float32 roundings of the
# formula's few steps (torch's routes compute their statistics in float32).
TOLERANCE = 2e-6
EPS = 1e-6  # ConvNeXt's


class Built(NamedTuple):
    """The same channels-first LayerNorm three ways, and an input."""

    numpy: Callable[[np.ndarray], np.ndarray]  # layernorm.LayerNorm(C, axis=1), eval mode
    torch_formula: Callable[[torch.Tensor], torch.Tensor]  # ConvNeXt's code
    torch_permute: Callable[[torch.Tensor], torch.Tensor]  # NCHW -> NHWC, F.layer_norm, back
    module: layernorm.LayerNorm
    input: np.ndarray


def build_convnext_norm(shape=(2, 96, 14, 14), seed: int = 0) -> Built:
    channels = shape[1]
    rng = np.random.default_rng(seed)
    weight = (1 + 0.1 * rng.standard_normal(channels)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(channels)).astype(np.float32)
    module = layernorm.LayerNorm(channels, eps=EPS, axis=1)
    module.load_state_dict({"weight": weight, "bias": bias})
    w, b = torch.from_numpy(weight), torch.from_numpy(bias)

    def torch_formula(x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        return w[:, None, None] * ((x - u) / torch.sqrt(s + EPS)) + b[:, None, None]

    def torch_permute(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), (channels,), w, b, EPS).permute(0, 3, 1, 2)

    x = (rng.standard_normal(shape) + 0.5).astype(np.float32)
    return Built(module.eval(), torch_formula, torch_permute, module, x)


def relative_difference(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def forward_differences(built: Built) -> dict:
    """How far the NumPy output is from each torch route (and from the float64 formula)."""
    ours = built.numpy(built.input)
    assert ours.shape == built.input.shape and ours.flags.c_contiguous
    xt = torch.from_numpy(built.input)
    with torch.no_grad():
        routes = {"formula": built.torch_formula(xt).numpy(), "permute": built.torch_permute(xt).numpy()}
    x64 = built.input.astype(np.float64)
    u = x64.mean(1, keepdims=True)
    exact = ((x64 - u) / np.sqrt(((x64 - u) ** 2).mean(1, keepdims=True) + EPS)
             * built.module.weight[:, None, None] + built.module.bias[:, None, None])
    return {"float64": relative_difference(ours, exact),
            **{name: relative_difference(ours, out) for name, out in routes.items()}}


def backward_differences(built: Built) -> dict:
    """One training step: grad_input and the parameter gradients against torch autograd of the
    formula (in float64)."""
    grad_output = np.random.default_rng(1).standard_normal(built.input.shape).astype(np.float32)
    module = built.module.train()
    module.zero_grad()
    module(built.input)
    grad_input = module.backward(grad_output)
    xt = torch.from_numpy(built.input.astype(np.float64)).requires_grad_(True)
    wt = torch.from_numpy(module.weight.astype(np.float64)).requires_grad_(True)
    bt = torch.from_numpy(module.bias.astype(np.float64)).requires_grad_(True)
    u = xt.mean(1, keepdim=True)
    s = (xt - u).pow(2).mean(1, keepdim=True)
    (wt[:, None, None] * ((xt - u) / torch.sqrt(s + EPS)) + bt[:, None, None]).backward(
        torch.from_numpy(grad_output.astype(np.float64)))
    module.eval()
    return {"grad_input": relative_difference(grad_input, xt.grad), "grad_weight": relative_difference(
        module.weight_grad, wt.grad), "grad_bias": relative_difference(module.bias_grad, bt.grad)}


def main() -> None:
    built = build_convnext_norm()
    differences = {**forward_differences(built), **backward_differences(built)}
    for name, diff in differences.items():
        if not diff <= TOLERANCE:
            raise SystemExit(f"LayerNorm(C, axis=1) vs {name}: differs by {diff:.2e} of the largest value")
    print(f"convnext_norm: LayerNorm({built.input.shape[1]}, axis=1) on {built.input.shape} matches, worst "
          f"{max(differences, key=differences.get)} {max(differences.values()):.1e} (tolerance {TOLERANCE:.0e})")


if __name__ == "__main__":
    main()
