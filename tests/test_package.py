"""The package's surface: its public names, the stub of the compiled core, py.typed."""

import ast
import os
import subprocess
import sys

import pytest

import layernorm
from layernorm import _layernorm

PACKAGE = os.path.dirname(layernorm.__file__)
PUBLIC = ["LayerNorm", "RMSNorm", "add_layer_norm", "add_rms_norm", "available_simd_levels", "get_num_threads",
          "layer_norm", "layer_norm_backward", "native_layer_norm", "native_rms_norm", "result_cache_info",
          "rms_norm", "rms_norm_backward", "set_num_threads", "set_result_cache", "set_simd_level", "simd_level"]


def test_all_lists_the_public_names():
    assert sorted(layernorm.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(layernorm, name) is not None, name


def test_stub_names_what_the_core_exports():
    with open(os.path.join(PACKAGE, "_layernorm.pyi"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    stubbed = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    exported = {name for name in dir(_layernorm) if not name.startswith("__")}
    assert stubbed == exported


def test_py_typed_is_shipped():
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))


def test_stub_agrees_with_the_core_under_stubtest(tmp_path):
    # mypy's stubtest imports the core and compares every signature with the stub.
    pytest.importorskip("mypy", reason="mypy is not installed: it checks the stub")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "layernorm._layernorm", "--mypy-config-file", os.devnull],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(PACKAGE), MYPY_CACHE_DIR=str(tmp_path / "cache")),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("module", ["layernorm", "layernorm.modules", "layernorm.testing"])
def test_docstring_examples_print_what_they_show(module):
    import doctest
    import importlib

    results = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted > 0 and results.failed == 0
