"""Bad input to every public entry point, one case per test id: the exact exception type and
the exact message.

Each case is a Python expression evaluated after SETUP, which names an input ``x``, its
statistics, parameters and a module.  Where torch refuses the same mistake the case also holds
torch's expression: with torch installed, torch must raise it too, and a RuntimeError's text
(torch's wording of a bad value, which we raise as ValueError) must be part of our message.

Cases that could crash, hang or exhaust memory (huge sizes, products that overflow,
allocations that must fail) are ``isolated``: they run in a child process under a memory limit
and a timeout (``helpers.run_in_child``), so that a crash fails the case instead of ending the
run.  ``peak`` bounds how far such a child's resident memory may grow during the call.
"""

import re
from typing import NamedTuple, Optional, Pattern, Union

import pytest

from helpers import requires_torch, run_in_child

SETUP = """
import numpy as np
import layernorm
from layernorm import LayerNorm, layer_norm, layer_norm_backward, native_layer_norm
from layernorm.testing import assert_layer_norm_close, assert_rms_norm_close, diagnose
x = np.arange(8, dtype=np.float32).reshape(2, 4)
y, mean, rstd = native_layer_norm(x, (4,))
module = LayerNorm(4)

def broadcast(value, shape):  # a float32 array of `shape` in no memory: one value everywhere
    return np.broadcast_to(np.float32(value), shape)

def broadcast_row(length, rows):  # `rows` rows that are one float32 row of ones, read in place
    return np.broadcast_to(np.ones(length, np.float32), (rows, length))
"""

TORCH_SETUP = """
import torch
import torch.nn.functional as F
tx = torch.arange(8, dtype=torch.float32).reshape(2, 4)
"""

MiB = 2**20
NOT_BOOL = "normalized_shape must be an int or a sequence of ints, not bool"


def unknown_level(quoted):
    """set_simd_level's refusal of the name `quoted`, on any CPU."""
    return re.compile(re.escape(f"unknown or unsupported SIMD level {quoted}; this CPU runs ")
                      + r"(scalar|avx2|avx512)" + re.escape(" or below (levels: scalar, avx2, avx512)"))


class Case(NamedTuple):
    call: str  # a Python expression, evaluated after SETUP
    error: type  # the exact exception class
    message: Union[str, Pattern[str]]  # the exact text, or a pattern all of it matches
    torch: Optional[str] = None  # torch's expression for the same mistake (after TORCH_SETUP)
    isolated: bool = False  # run in a child process, under a memory limit and a timeout
    peak: Optional[int] = None  # isolated: bytes the child's resident memory may grow by
    memory: int = 2 * 2**30  # isolated: bytes the child's address space may grow by


CASES = {
    # ------------------------------------------------------------------ sizes at the limits
    "module-training-stats-bytes-overflow-to-zero": Case(
        "LayerNorm(0)(np.empty((2**61, 0), np.float16))",
        MemoryError,
        "LayerNorm: cannot allocate the values saved for backward, 2 statistics of 2305843009213693952 "
        "rows and 2 parameters of 0 elements, 4 bytes each: more than an address space holds",
        isolated=True),
    "module-training-stats-bytes-overflow-to-16": Case(
        "LayerNorm(0)(np.empty((2**61 + 1, 0), np.float16))",
        MemoryError,
        "LayerNorm: cannot allocate the values saved for backward, 2 statistics of 2305843009213693953 "
        "rows and 2 parameters of 0 elements, 4 bytes each: more than an address space holds",
        isolated=True),
    # results are allocated before copies of the arguments: broadcast statistics are not
    # expanded to full size only to find that grad_input does not fit
    "layer_norm_backward-broadcast-statistics-not-copied-first": Case(
        "layer_norm_backward(broadcast(1, (2**26, 16)), broadcast(1, (2**26, 16)), 16, "
        "broadcast(0, (2**26, 1)), broadcast(1, (2**26, 1)))",
        MemoryError,
        "layer_norm_backward: could not allocate grad_input, a float32 array of shape [67108864, 16]: "
        "4294967296 bytes",
        isolated=True, peak=64 * MiB),
    "layer_norm_backward-broadcast-statistics-of-2**32-rows": Case(
        "layer_norm_backward(broadcast(1, (2**32, 16)), broadcast(1, (2**32, 16)), 16, "
        "broadcast(0, (2**32, 1)), broadcast(1, (2**32, 1)))",
        MemoryError,
        "layer_norm_backward: could not allocate grad_input, a float32 array of shape [4294967296, 16]: "
        "274877906944 bytes",
        isolated=True, peak=64 * MiB),
    # every MemoryError says what could not be allocated, and how big
    "native_layer_norm-output-too-big": Case(
        "native_layer_norm(broadcast(1, (2**36, 16)), 16)",
        MemoryError,
        "native_layer_norm: could not allocate the output, a float32 array of shape [68719476736, 16]: "
        "4398046511104 bytes",
        isolated=True),
    "native_layer_norm-statistics-of-empty-rows-too-big": Case(
        "native_layer_norm(np.empty((2**40, 0), np.float32), 0)",
        MemoryError,
        "native_layer_norm: could not allocate mean, a float32 array of shape [1099511627776, 1]: "
        "4398046511104 bytes",
        isolated=True),
    "native_layer_norm-input-copy-too-big": Case(
        "native_layer_norm(broadcast(1, (2**22, 16)), 16)",  # a zero inner stride: rows to copy
        MemoryError,
        "native_layer_norm: could not allocate a C-contiguous copy of the input, a float32 array of "
        "shape [4194304, 16]: 268435456 bytes",
        isolated=True, memory=384 * MiB),
    "LayerNorm-training-saved-values-too-big": Case(
        "LayerNorm(0)(np.empty((2**40, 0), np.float32))",
        MemoryError,
        "LayerNorm: could not allocate the values saved for backward: 8796093022208 bytes",
        isolated=True),
    "LayerNorm-training-saved-input-too-big": Case(
        "LayerNorm(16)(np.broadcast_to(np.ones(16, np.float32), (2**22, 16)))",  # rows in place
        MemoryError,
        "LayerNorm: could not allocate the copy of the input saved for backward, a float32 array of "
        "shape [4194304, 16]: 268435456 bytes",
        isolated=True, memory=384 * MiB),
    "layer_norm_backward-kernel-scratch-too-big": Case(
        "(layernorm.set_num_threads(1), layer_norm_backward(*[broadcast_row(2**24, 2)] * 2, 2**24, "
        "np.zeros((2, 1), np.float32), np.ones((2, 1), np.float32), *[np.ones(2**24, np.float32)] * 2, "
        "(False, True, True)))",
        MemoryError,
        "layer_norm_backward: the kernel could not allocate its scratch memory for 2 rows of 16777216 "
        "elements",
        isolated=True, memory=448 * MiB),
    "LayerNorm-parameters-too-big": Case(
        "LayerNorm(2**40)",
        MemoryError,
        "LayerNorm: could not allocate weight, a float32 array of shape [1099511627776]: 4398046511104 bytes",
        isolated=True),
    # a product of sizes that overflows is refused before anything multiplies it
    "layer_norm-normalized-size-overflows": Case(
        "layer_norm(x, (2**40, 2**40))",
        ValueError,
        "Given normalized_shape=[1099511627776, 1099511627776], expected input with shape "
        "[*, 1099511627776, 1099511627776], but got input of size[2, 4]",
        torch="F.layer_norm(tx, (2**40, 2**40))"),
    "native_layer_norm-normalized-size-overflows-before-a-zero": Case(
        "native_layer_norm(x, (2**62, 2**62, 0))",
        ValueError,
        "Given normalized_shape=[4611686018427387904, 4611686018427387904, 0], expected input with "
        "shape [*, 4611686018427387904, 4611686018427387904, 0], but got input of size[2, 4]",
        torch="torch.native_layer_norm(tx, (2**62, 2**62, 0), None, None, 1e-5)"),
    "layer_norm_backward-normalized-size-overflows": Case(
        "layer_norm_backward(x, x, (2**40, 2**40), mean, rstd)",
        ValueError,
        "Given normalized_shape=[1099511627776, 1099511627776], expected input with shape "
        "[*, 1099511627776, 1099511627776], but got input of size[2, 4]"),
    "module-without-affine-normalized-size-overflows": Case(
        "LayerNorm((2**40, 2**40), elementwise_affine=False)(x)",
        ValueError,
        "Given normalized_shape=[1099511627776, 1099511627776], expected input with shape "
        "[*, 1099511627776, 1099511627776], but got input of size[2, 4]",
        torch="torch.nn.LayerNorm((2**40, 2**40), elementwise_affine=False)(tx)"),
    # normalized_shape: True is not 1 (torch refuses it)
    "layer_norm-normalized-shape-True": Case(
        "layer_norm(x, True)", TypeError, NOT_BOOL, torch="F.layer_norm(tx, True)"),
    "native_layer_norm-normalized-shape-numpy-True": Case(
        "native_layer_norm(x, np.True_)", TypeError, NOT_BOOL),
    "layer_norm-normalized-shape-0-d-bool-array": Case(
        "layer_norm(x, np.array(True))", TypeError, NOT_BOOL),
    "layer_norm_backward-normalized-shape-True": Case(
        "layer_norm_backward(x, x, True, mean, rstd)", TypeError, NOT_BOOL),
    "LayerNorm-normalized-shape-True": Case(
        "LayerNorm(True)", TypeError, NOT_BOOL, torch="torch.nn.LayerNorm(True)"),
    "assert_layer_norm_close-normalized-shape-True": Case(
        "assert_layer_norm_close(x, x, True)", TypeError, NOT_BOOL),
    "diagnose-normalized-shape-True": Case(
        "diagnose(module, True)", TypeError, NOT_BOOL),
    # set_simd_level: a level's exact name, nothing after it
    "set_simd_level-embedded-NUL": Case(
        "layernorm.set_simd_level('scalar\\x00junk')", ValueError, unknown_level("'scalar\\x00junk'")),
    "set_simd_level-unknown-name": Case(
        "layernorm.set_simd_level('fast')", ValueError, unknown_level("'fast'")),
    "set_simd_level-upper-case": Case(
        "layernorm.set_simd_level('AVX2')", ValueError, unknown_level("'AVX2'")),
    "set_simd_level-empty": Case(
        "layernorm.set_simd_level('')", ValueError, unknown_level("''")),
    "set_simd_level-bytes": Case(
        "layernorm.set_simd_level(b'scalar')", TypeError, "set_simd_level() takes a str, got bytes"),
    "set_simd_level-None": Case(
        "layernorm.set_simd_level(None)", TypeError, "set_simd_level() takes a str, got NoneType"),
    # set_num_threads: a positive int (above 256 counts as 256)
    "set_num_threads-zero": Case(
        "layernorm.set_num_threads(0)", ValueError, "set_num_threads() needs n >= 1, got 0"),
    "set_num_threads-negative": Case(
        "layernorm.set_num_threads(-1)", ValueError, "set_num_threads() needs n >= 1, got -1"),
    "set_num_threads-negative-beyond-64-bits": Case(
        "layernorm.set_num_threads(-10**30)", ValueError,
        "set_num_threads() needs n >= 1, got -1000000000000000000000000000000"),
    "set_num_threads-str": Case(
        "layernorm.set_num_threads('2')", TypeError, "set_num_threads() takes an int, got str"),
    "set_num_threads-float": Case(
        "layernorm.set_num_threads(2.0)", TypeError, "set_num_threads() takes an int, got float"),
    "set_num_threads-bool": Case(
        "layernorm.set_num_threads(True)", TypeError, "set_num_threads() takes an int, got bool"),
    # a parameter given as text is a type mistake, not a shape one
    "layer_norm-weight-str": Case(
        "layer_norm(x, 4, 'abcd')", TypeError, "weight must be an array of floats or None, got str",
        torch="F.layer_norm(tx, (4,), 'abcd')"),
    "layer_norm-bias-bytes": Case(
        "layer_norm(x, 4, None, b'abcd')", TypeError, "bias must be an array of floats or None, got bytes",
        torch="F.layer_norm(tx, (4,), None, b'abcd')"),
    "native_layer_norm-weight-bytearray": Case(
        "native_layer_norm(x, 4, bytearray(16))", TypeError,
        "weight must be an array of floats or None, got bytearray"),
    "layer_norm_backward-weight-str": Case(
        "layer_norm_backward(x, x, 4, mean, rstd, 'abcd')", TypeError,
        "weight must be an array of floats or None, got str"),
    "LayerNorm-forward-weight-set-to-str": Case(
        "(setattr(module, 'weight', 'abcd'), module(x))", TypeError,
        "weight must be an array of floats or None, got str"),
    # eps: a real number, not a complex one (whose imaginary part would be dropped)
    "layer_norm-eps-complex": Case(
        "layer_norm(x, 4, eps=1j)", TypeError, "eps must be a real number, got complex",
        torch="F.layer_norm(tx, (4,), eps=1j)"),
    "layer_norm-eps-numpy-complex": Case(
        "layer_norm(x, 4, eps=np.complex128(1e-5 + 1j))", TypeError,
        "eps must be a real number, got numpy.complex128"),
    "native_layer_norm-eps-array-of-one": Case(
        "native_layer_norm(x, 4, None, None, np.array([1e-5]))", TypeError,
        "eps must be a real number, got numpy.ndarray"),
    "layer_norm-eps-str": Case(
        "layer_norm(x, 4, eps='1e-5')", TypeError, "eps must be a real number, got str",
        torch="F.layer_norm(tx, (4,), eps='1e-5')"),
    "LayerNorm-eps-None-at-forward": Case(
        "LayerNorm(4, eps=None)(x)", TypeError, "eps must be a real number, got NoneType",
        torch="torch.nn.LayerNorm(4, eps=None)(tx)"),
    # layernorm.testing: its arguments are checked as the functions' are
    "assert_layer_norm_close-eps-str": Case(
        "assert_layer_norm_close(x, x, 4, eps='1e-5')", TypeError, "eps must be a real number, got str"),
    "assert_rms_norm_close-eps-str": Case(
        "assert_rms_norm_close(x, x, 4, eps='1e-5')", TypeError, "eps must be a real number, got str"),
    "diagnose-eps-str": Case(
        "diagnose(module, 4, eps='1e-5')", TypeError, "eps must be a real number, got str"),
    "diagnose-empty-normalized-shape": Case(
        "diagnose(module, ())", ValueError, "normalized_shape must have at least one dimension, as in torch"),
    "diagnose-normalized-shape-not-the-modules": Case(
        "diagnose(module, 5)", ValueError, "fn's weight has shape (4,), normalized_shape is (5,)"),
    "diagnose-fn-not-callable": Case(
        "diagnose(None, 4)", TypeError, "fn must be a function or a module to call, got NoneType"),
}


def _check(case, error_name, message):
    assert error_name == case.error.__name__, f"raised {error_name}: {message}"
    if isinstance(case.message, str):
        assert message == case.message
    else:
        assert case.message.fullmatch(message), message


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name):
    case = CASES[name]
    if case.isolated:
        outcome = run_in_child(case.call, SETUP, memory=case.memory)
        _check(case, outcome.error, outcome.message)
        if case.peak is not None and outcome.peak_growth is not None:
            assert outcome.peak_growth <= case.peak, f"resident memory grew by {outcome.peak_growth} bytes"
        return
    space = {}
    exec(SETUP, space)
    with pytest.raises(BaseException) as info:
        eval(case.call, space)
    assert type(info.value) is case.error, info.value
    _check(case, type(info.value).__name__, str(info.value))


@requires_torch
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.torch])
def test_torch_refuses_alike(name):
    case = CASES[name]
    space = {}
    exec(TORCH_SETUP, space)
    with pytest.raises(Exception) as info:
        eval(case.torch, space)
    if isinstance(info.value, TypeError):
        assert issubclass(case.error, TypeError), info.value
    else:
        assert type(info.value) is RuntimeError, info.value
        assert issubclass(case.error, ValueError) or case.error is RuntimeError
        assert str(info.value) in case.message, str(info.value)
