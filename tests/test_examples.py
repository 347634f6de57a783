"""The scripts in examples/ run and check themselves: each prints one summary line when NumPy with
layernorm matches the torch models it takes its weights from, and nothing else.  Their builders
(what a benchmark times) work at other sizes too.  They compare with torch: without it they skip.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import requires_torch

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
EXAMPLES = ["transformer_blocks", "convnext_norm"]


def load(name):
    """The example as a module."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", os.path.join(EXAMPLES_DIR, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_torch
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_prints_one_summary_line(name):
    import layernorm

    root = os.path.dirname(os.path.dirname(os.path.abspath(layernorm.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES_DIR, name + ".py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(name + ": "), proc.stdout


@requires_torch
@pytest.mark.parametrize("builder", ["build_gpt2", "build_llama"])
def test_transformer_blocks_at_other_sizes(builder):
    example = load("transformer_blocks")
    built = getattr(example, builder)(d_model=48, n_heads=3, n_layers=3, batch=3, seq=7, seed=5)
    assert built.input.shape == (3, 7, 48)
    assert example.difference(built) <= example.TOLERANCE


@requires_torch
def test_transformer_blocks_tolerance_catches_a_wrong_eps():
    """The Llama stack in NumPy with eps 1e-5 against torch's with 1e-6 (the same weights)."""
    example = load("transformer_blocks")
    right, wrong = example.build_llama(eps=1e-6), example.build_llama(eps=1e-5)
    assert example.difference(example.Built(wrong.numpy, right.torch, right.input)) > example.TOLERANCE


@requires_torch
def test_convnext_norm_at_another_size():
    example = load("convnext_norm")
    built = example.build_convnext_norm(shape=(1, 40, 7, 9), seed=3)
    for name, difference in {**example.forward_differences(built), **example.backward_differences(built)}.items():
        assert difference <= example.TOLERANCE, name
