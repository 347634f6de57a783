"""The float64 ground truth that results are checked against when torch is not installed: a thin
adapter over layernorm._reference, the one definition the tests share, imported when first needed."""

from __future__ import annotations

NAME = "float64 reference"  # how the report names it


def forward(x, normalized_shape, weight, bias, eps):
    """layer_norm's output, in float64."""
    from layernorm import _reference

    output, _, _ = _reference.layer_norm(x, normalized_shape, weight, bias, eps)
    return output


def backward(grad_output, x, normalized_shape, weight, bias, eps):
    """(grad_input, grad_weight, grad_bias) of layer_norm, in float64."""
    from layernorm import _reference

    return _reference.layer_norm_backward(grad_output, x, normalized_shape, weight, bias, eps)
