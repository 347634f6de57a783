"""Bad input to every public entry point, one case per test id: the exact exception type and
the exact message.

Each case is a Python expression evaluated after SETUP, which names an input ``x``, its
statistics, a module and helpers.  Where torch refuses the same mistake the case also holds
torch's expression: with torch installed, torch must raise it too, an exception of the kind
TORCH_KINDS pairs with ours, and where torch words the mistake itself (not its argument parser)
its text must be part of our message.

Cases that could crash, hang or exhaust memory (huge sizes, products that overflow,
allocations that must fail) are ``isolated``: they run in a child process under a memory limit
and a timeout (``helpers.run_in_child``), so that a crash fails the case instead of ending the
run.  ``peak`` bounds how far such a child's resident memory may grow during the call.
"""

import re
from typing import NamedTuple, Optional, Pattern, Union

import numpy as np
import pytest

import layernorm

from helpers import requires_torch, run_in_child
from layernorm.modules import _TrainingModeError

SETUP = """
import pickle
import numpy as np
import layernorm
from layernorm import LayerNorm, layer_norm, layer_norm_backward, native_layer_norm
from layernorm.testing import assert_layer_norm_close, assert_rms_norm_close, diagnose
x = np.arange(8, dtype=np.float32).reshape(2, 4)
y, mean, rstd = native_layer_norm(x, (4,))  # rstd: also native_rms_norm's shape and dtype
module = LayerNorm(4)
read_only = np.zeros((2, 4), np.float32)
read_only.flags.writeable = False

def broadcast(value, shape):  # a float32 array of `shape` in no memory: one value everywhere
    return np.broadcast_to(np.float32(value), shape)

class ArrayOfOne:  # another library's array of one element, which float() converts (torch's does)
    ndim = 1
    def __float__(self):
        return 1e-5

def broadcast_row(length, rows):  # `rows` rows that are one float32 row of ones, read in place
    return np.broadcast_to(np.ones(length, np.float32), (rows, length))

class Reshaping:  # an argument whose conversion (the caller's own code) reshapes `array`
    def __init__(self, array, shape):
        self.array, self.shape = array, shape
    def __array__(self, dtype=None, copy=None):
        self.array.shape = self.shape
        return np.zeros(self.shape, np.float32)

class ReshapingIndex(Reshaping):  # an axis whose __index__ reshapes `array`
    def __init__(self, array, shape, value):
        super().__init__(array, shape)
        self.value = value
    def __index__(self):
        self.array.shape = self.shape
        return self.value

class Shrinking:  # a bias or an axis whose conversion frees most of `array` (resize without refcheck)
    def __init__(self, array, value):
        self.array, self.value = array, value
    def __array__(self, dtype=None, copy=None):
        self.array.resize((1,), refcheck=False)
        return self.value
    def __index__(self):
        self.array.resize((1,), refcheck=False)
        return self.value
"""

TORCH_SETUP = """
import torch
import torch.nn.functional as F
tx = torch.arange(8, dtype=torch.float32).reshape(2, 4)
"""

MiB = 2**20
AxisError = np.exceptions.AxisError if hasattr(np, "exceptions") else np.AxisError
NOT_BOOL = "normalized_shape must be an int or a sequence of ints, not bool"


def unknown_level(quoted):
    """set_simd_level's refusal of the name `quoted`, on any CPU."""
    return re.compile(re.escape(f"unknown or unsupported SIMD level {quoted}; this CPU runs ")
                      + re.escape(repr(layernorm.available_simd_levels())))


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
    # out= overlapping part of the input: the input is copied first, and a copy that cannot be
    # allocated is a MemoryError (it was a crash: the failed copy left no input to name)
    "layer_norm-out-overlap-copy-too-big": Case(
        "(lambda buf: layer_norm(np.lib.stride_tricks.as_strided(buf, (2**40, 8), (0, 4)), 8, "
        "out=np.lib.stride_tricks.as_strided(buf[1:], (2**40, 8), (0, 4), writeable=True)))"
        "(np.zeros(9, np.float32))",
        MemoryError,
        "layer_norm: could not allocate a copy of an input that a result overlaps, a float32 array of shape "
        "[1099511627776, 8]: 35184372088832 bytes",
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
        "native_layer_norm: could not allocate a copy of the input in rows the kernel can walk, a float32 array of "
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
    # set_result_cache: an int >= 0
    "set_result_cache-negative": Case(
        "layernorm.set_result_cache(-1)", ValueError, "set_result_cache() needs max_bytes >= 0, got -1"),
    "set_result_cache-str": Case(
        "layernorm.set_result_cache('1')", TypeError, "set_result_cache() takes an int, got str"),
    "set_result_cache-float": Case(
        "layernorm.set_result_cache(1e9)", TypeError, "set_result_cache() takes an int, got float"),
    "set_result_cache-bool": Case(
        "layernorm.set_result_cache(False)", TypeError, "set_result_cache() takes an int, got bool"),
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
    "LayerNorm-weight-set-to-str": Case(
        "setattr(module, 'weight', 'abcd')", TypeError,
        "cannot assign 'str' as parameter 'weight' (numpy.ndarray, torch.Tensor or None expected)",
        torch="setattr(torch.nn.LayerNorm(4), 'weight', 'abcd')"),
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
    "layer_norm-eps-other-array-of-one": Case(
        "layer_norm(x, 4, eps=ArrayOfOne())", TypeError, "eps must be a real number, got ArrayOfOne",
        torch="F.layer_norm(tx, (4,), eps=torch.tensor([1e-5]))"),
    "layer_norm-eps-str": Case(
        "layer_norm(x, 4, eps='1e-5')", TypeError, "eps must be a real number, got str",
        torch="F.layer_norm(tx, (4,), eps='1e-5')"),
    "layer_norm-eps-0-d-text-array": Case(
        "layer_norm(x, 4, eps=np.array('1e-5'))", TypeError, "eps must be a real number, got numpy.ndarray"),
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

    # ------------------------------------------------------------------ layer_norm, native_layer_norm
    "layer_norm-empty-normalized-shape": Case(
        "layer_norm(x, ())", ValueError,
        "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one element, "
        "but got normalized_shape = []",
        torch="F.layer_norm(tx, ())"),
    "layer_norm-trailing-shape": Case(
        "layer_norm(x, (3,))", ValueError,
        "Given normalized_shape=[3], expected input with shape [*, 3], but got input of size[2, 4]",
        torch="F.layer_norm(tx, (3,))"),
    "native_layer_norm-more-normalized-dims-than-input": Case(
        "native_layer_norm(x, (2, 4, 1))", ValueError,
        "Given normalized_shape=[2, 4, 1], expected input with shape [*, 2, 4, 1], but got input of size[2, 4]",
        torch="torch.native_layer_norm(tx, (2, 4, 1), None, None, 1e-5)"),
    "layer_norm-0-d-input": Case(
        "layer_norm(np.float32(3), (1,))", ValueError,
        "Given normalized_shape=[1], expected input with shape [*, 1], but got input of size[]",
        torch="F.layer_norm(torch.tensor(3.0), (1,))"),
    "layer_norm-negative-size": Case(
        "layer_norm(x, (-4,))", ValueError,
        "normalized_shape must not contain negative sizes, but got normalized_shape = [-4]"),
    "layer_norm-size-beyond-an-index": Case(
        "layer_norm(x, 2**63)", ValueError,
        "normalized_shape sizes must fit in an index (9223372036854775807 at most), got 9223372036854775808"),
    "layer_norm-size-beyond-an-index-in-a-sequence": Case(
        "layer_norm(x, (4, -2**64))", ValueError,
        "normalized_shape sizes must fit in an index (9223372036854775807 at most), got -18446744073709551616"),
    "layer_norm-normalized-shape-float": Case(
        "layer_norm(x, 4.0)", TypeError, "normalized_shape must be an int or a sequence of ints, got float",
        torch="F.layer_norm(tx, 4.0)"),
    "layer_norm-normalized-shape-str-element": Case(
        "layer_norm(x, ('4',))", TypeError,
        "normalized_shape must be an int or a sequence of ints, but found element of type str at pos 0",
        torch="F.layer_norm(tx, ('4',))"),
    "native_layer_norm-normalized-shape-None": Case(
        "native_layer_norm(x, None)", TypeError,
        "normalized_shape must be an int or a sequence of ints, got NoneType"),
    "layer_norm-weight-shape": Case(
        "layer_norm(x, (4,), np.ones(3, np.float32))", ValueError,
        "Expected weight to be of same shape as normalized_shape, but got weight of shape [3] and "
        "normalized_shape = [4]",
        torch="F.layer_norm(tx, (4,), torch.ones(3))"),
    "native_layer_norm-bias-shape": Case(
        "native_layer_norm(x, (4,), None, np.ones((4, 1), np.float32))", ValueError,
        "Expected bias to be of same shape as normalized_shape, but got bias of shape [4, 1] and "
        "normalized_shape = [4]",
        torch="torch.native_layer_norm(tx, (4,), None, torch.ones(4, 1), 1e-5)"),
    "layer_norm-weight-int": Case(
        "layer_norm(x, 4, np.ones(4, np.int64))", TypeError, "weight must have a floating-point dtype, got dtype int64"),
    "layer_norm-bias-complex": Case(
        "layer_norm(x, 4, None, np.ones(4, np.complex64))", TypeError,
        "bias must have a floating-point dtype, got dtype complex64"),
    "layer_norm-input-int64": Case(
        "layer_norm(x.astype(np.int64), 4)", TypeError,
        "\"LayerNormKernelImpl\" not implemented for 'Long': layer_norm takes float16, bfloat16, float32 or float64 "
        "arrays, got dtype int64; convert it first, e.g. x.astype(np.float32)",
        torch="F.layer_norm(tx.long(), (4,))"),
    "native_layer_norm-input-bool": Case(
        "native_layer_norm(x.astype(bool), 4)", TypeError,
        "\"LayerNormKernelImpl\" not implemented for 'Bool': native_layer_norm takes float16, bfloat16, float32 or "
        "float64 arrays, got dtype bool; convert it first, e.g. x.astype(np.float32)",
        torch="torch.native_layer_norm(tx.bool(), (4,), None, None, 1e-5)"),
    "layer_norm-input-complex64": Case(
        "layer_norm(x.astype(np.complex64), 4)", TypeError,
        "\"LayerNormKernelImpl\" not implemented for 'ComplexFloat': layer_norm takes float16, bfloat16, float32 or "
        "float64 arrays, got dtype complex64; convert it first, e.g. x.astype(np.float32)",
        torch="F.layer_norm(tx.to(torch.complex64), (4,))"),
    "layer_norm-input-object": Case(
        "layer_norm(x.astype(object), 4)", TypeError,
        "layer_norm takes float16, bfloat16, float32 or float64 arrays, got dtype object; convert it first, e.g. "
        "x.astype(np.float32)"),
    "layer_norm-input-str": Case(
        "layer_norm('abcd', 4)", TypeError,
        "layer_norm takes float16, bfloat16, float32 or float64 arrays, got dtype <U4; convert it first, e.g. "
        "x.astype(np.float32)"),
    "layer_norm-input-datetime64": Case(
        "layer_norm(x.astype('datetime64[s]'), 4)", TypeError,
        "layer_norm takes float16, bfloat16, float32 or float64 arrays, got dtype datetime64[s]; convert it first, "
        "e.g. x.astype(np.float32)"),
    "native_layer_norm-input-None": Case(
        "native_layer_norm(None, 4)", TypeError,
        "native_layer_norm takes float16, bfloat16, float32 or float64 arrays, got dtype object; convert it first, "
        "e.g. x.astype(np.float32)"),
    "layer_norm-out-dtype": Case(
        "layer_norm(x, 4, out=np.empty((2, 4), np.float64))", TypeError,
        "out has dtype float64, but the result has dtype float32"),
    # the result's dtype is named in native order, whatever the input's order
    "layer_norm-out-byte-swapped": Case(
        "layer_norm(x.astype('>f4'), 4, out=np.empty((2, 4), '>f4'))", TypeError,
        "out has dtype >f4, but the result has dtype float32"),
    "layer_norm-out-shape": Case(
        "layer_norm(x, 4, out=np.empty((2, 5), np.float32))", ValueError,
        "out has shape [2, 5], but the result has shape [2, 4]"),
    "layer_norm-out-read-only": Case(
        "layer_norm(x, 4, out=read_only)", ValueError, "out is read-only"),
    "layer_norm-out-list": Case(
        "layer_norm(x, 4, out=[[0.0] * 4] * 2)", TypeError, "out must be a numpy.ndarray, got list"),
    "layer_norm-unknown-keyword": Case(
        "layer_norm(x, 4, epsilon=1e-5)", TypeError, "layer_norm() got an unexpected keyword argument 'epsilon'"),
    "layer_norm-no-normalized-shape": Case(
        "layer_norm(x)", TypeError, "layer_norm() missing 1 required positional argument: 'normalized_shape'"),
    "layer_norm-out-by-position": Case(
        "layer_norm(x, 4, None, None, 1e-5, None)", TypeError,
        "layer_norm() takes from 2 to 5 positional arguments but 6 were given"),
    "native_layer_norm-out": Case(
        "native_layer_norm(x, 4, out=None)", TypeError, "native_layer_norm() got an unexpected keyword argument 'out'"),
    "layer_norm-weight-twice": Case(
        "layer_norm(x, 4, np.ones(4, np.float32), weight=np.ones(4, np.float32))", TypeError,
        "layer_norm() got multiple values for argument 'weight'"),
    # ------------------------------------------------------------------ layer_norm_backward
    "layer_norm_backward-output-mask-of-two": Case(
        "layer_norm_backward(x, x, 4, mean, rstd, output_mask=(True, True))", ValueError,
        "output_mask must be a sequence of three bools"),
    "layer_norm_backward-output-mask-None": Case(
        "layer_norm_backward(x, x, 4, mean, rstd, output_mask=None)", TypeError,
        "output_mask must be a sequence of three bools"),
    "layer_norm_backward-output-mask-str-entry": Case(
        "layer_norm_backward(x, x, 4, mean, rstd, output_mask=('False', True, True))", TypeError,
        "output_mask must be a sequence of three bools, got ('False', True, True)"),
    "layer_norm_backward-output-mask-str": Case(
        "layer_norm_backward(x, x, 4, mean, rstd, output_mask='TTT')", TypeError,
        "output_mask must be a sequence of three bools, got 'TTT'"),
    "layer_norm_backward-grad-output-shape": Case(
        "layer_norm_backward(x[:1], x, 4, mean, rstd)", ValueError,
        "grad_output of shape [1, 4] does not match input of size[2, 4]"),
    "layer_norm_backward-grad-output-int": Case(
        "layer_norm_backward(x.astype(np.int32), x, 4, mean, rstd)", TypeError,
        "grad_output must have a floating-point dtype, got dtype int32"),
    "layer_norm_backward-mean-too-short": Case(
        "layer_norm_backward(x, x, 4, mean[:1], rstd)", ValueError,
        "mean must be a float array with one value per normalized row (2), as native_layer_norm returns it; "
        "got 1 value of dtype float32"),
    "layer_norm_backward-rstd-None": Case(
        "layer_norm_backward(x, x, 4, mean, None)", TypeError,
        "rstd must be a float array, as native_layer_norm returns it; got None of dtype object"),
    "layer_norm_backward-mean-int": Case(
        "layer_norm_backward(x, x, 4, mean.astype(np.int64), rstd)", TypeError,
        "mean must be a float array, as native_layer_norm returns it; got <class 'numpy.ndarray'> of dtype int64"),
    "layer_norm_backward-weight-shape": Case(
        "layer_norm_backward(x, x, 4, mean, rstd, np.ones(5, np.float32))", ValueError,
        "Expected weight to be of same shape as normalized_shape, but got weight of shape [5] and "
        "normalized_shape = [4]"),
    "layer_norm_backward-trailing-shape": Case(
        "layer_norm_backward(x, x, (5,), mean, rstd)", ValueError,
        "Given normalized_shape=[5], expected input with shape [*, 5], but got input of size[2, 4]"),
    "layer_norm_backward-input-int64": Case(
        "layer_norm_backward(x, x.astype(np.int64), 4, mean, rstd)", TypeError,
        "\"LayerNormBackwardKernelImpl\" not implemented for 'Long': layer_norm_backward takes float16, "
        "bfloat16, float32 or float64 arrays, got dtype int64; convert it first, e.g. x.astype(np.float32)"),
    "layer_norm_backward-no-rstd": Case(
        "layer_norm_backward(x, x, 4, mean)", TypeError,
        "layer_norm_backward() missing 1 required positional argument: 'rstd'"),
    "layer_norm_backward-unknown-keyword": Case(
        "layer_norm_backward(x, x, 4, mean, rstd, mask=(True, True, True))", TypeError,
        "layer_norm_backward() got an unexpected keyword argument 'mask'"),
    # ------------------------------------------------------------------ LayerNorm
    "LayerNorm-negative-size": Case(
        "LayerNorm(-1)", ValueError,
        "Trying to create tensor with negative dimension -1: [-1] (normalized_shape sizes must be >= 0)",
        torch="torch.nn.LayerNorm(-1)"),
    "LayerNorm-negative-size-of-two": Case(
        "LayerNorm((2, -3))", ValueError,
        "Trying to create tensor with negative dimension -3: [2, -3] (normalized_shape sizes must be >= 0)",
        torch="torch.nn.LayerNorm((2, -3))"),
    "LayerNorm-size-float": Case(
        "LayerNorm(4.0)", TypeError, "normalized_shape must be an int or a sequence of ints, got float 4.0",
        torch="torch.nn.LayerNorm(4.0)"),
    "LayerNorm-size-0d-array": Case(  # torch iterates what is not an int: "iteration over a 0-d array"
        "LayerNorm(np.array(4))", TypeError, "normalized_shape must be an int or a sequence of ints, got ndarray array(4)",
        torch="torch.nn.LayerNorm(torch.tensor(4))"),
    "LayerNorm-axis-array": Case(
        "LayerNorm(3, axis=np.array([1]))", TypeError, "axis must be an int or a tuple of ints, got array([1])"),
    "LayerNorm-to-two-dtypes": Case(
        "module.to(np.float64, np.float64)", TypeError,
        "to() got an unexpected combination of arguments, (<class 'numpy.float64'>, <class 'numpy.float64'>) and "
        "keywords []: it takes (device, dtype, non_blocking), (dtype, non_blocking) or (array_or_tensor, non_blocking)",
        torch="torch.nn.LayerNorm(4).to(torch.float64, torch.float64)"),
    "LayerNorm-to-two-devices": Case(
        "module.to('cpu', 'cpu')", TypeError, "dtype must be a float dtype (float16, bfloat16, float32, float64), got 'cpu'",
        torch="torch.nn.LayerNorm(4).to('cpu', 'cpu')"),
    "LayerNorm-to-dtype-and-device-keyword": Case(
        "module.to(np.float64, device='cpu')", TypeError,
        "to() got an unexpected combination of arguments, (<class 'numpy.float64'>,) and keywords ['device']: it "
        "takes (device, dtype, non_blocking), (dtype, non_blocking) or (array_or_tensor, non_blocking)",
        torch="torch.nn.LayerNorm(4).to(torch.float64, device='cpu')"),
    "LayerNorm-to-dtype-twice": Case(
        "module.to(np.float64, dtype=np.float32)", TypeError,
        "to() got an unexpected combination of arguments, (<class 'numpy.float64'>,) and keywords ['dtype']: it "
        "takes (device, dtype, non_blocking), (dtype, non_blocking) or (array_or_tensor, non_blocking)",
        torch="torch.nn.LayerNorm(4).to(torch.float64, dtype=torch.float32)"),
    "LayerNorm-to-bool": Case(
        "module.to(True)", TypeError,
        "to() got an unexpected combination of arguments, (True,) and keywords []: it "
        "takes (device, dtype, non_blocking), (dtype, non_blocking) or (array_or_tensor, non_blocking)",
        torch="torch.nn.LayerNorm(4).to(True)"),
    "LayerNorm-to-dtype-name-as-device": Case(  # torch: "Invalid device string: 'float64'"
        "module.to('float64')", ValueError,
        "layernorm runs on the CPU only: device must be None or 'cpu', got 'float64'"),
    "LayerNorm-size-str": Case(
        "LayerNorm('4')", TypeError, "normalized_shape must contain ints, got str '4'"),
    "LayerNorm-size-None": Case(
        "LayerNorm(None)", TypeError, "normalized_shape must be an int or a sequence of ints, got NoneType None",
        torch="torch.nn.LayerNorm(None)"),
    "LayerNorm-dtype-int32": Case(
        "LayerNorm(4, dtype=np.int32)", TypeError, "LayerNorm supports float16, bfloat16, float32 and float64 parameters, got int32"),
    "LayerNorm-dtype-unknown-name": Case(
        "LayerNorm(4, dtype='float8')", TypeError,
        "dtype must be a float dtype (float16, bfloat16, float32, float64), got 'float8'"),
    "LayerNorm-device-cuda": Case(
        "LayerNorm(4, device='cuda')", ValueError,
        "layernorm runs on the CPU only: device must be None or 'cpu', got 'cuda'"),
    "LayerNorm-forward-empty-normalized-shape": Case(
        "LayerNorm(())(x)", ValueError,
        "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one element, "
        "but got normalized_shape = []",
        torch="torch.nn.LayerNorm(())(tx)"),
    "LayerNorm-forward-trailing-shape": Case(
        "LayerNorm(5)(x)", ValueError,
        "Given normalized_shape=[5], expected input with shape [*, 5], but got input of size[2, 4]",
        torch="torch.nn.LayerNorm(5)(tx)"),
    "LayerNorm-forward-int-input": Case(
        "LayerNorm(4)(x.astype(np.int64))", TypeError,
        "\"LayerNormKernelImpl\" not implemented for 'Long': LayerNorm takes float16, bfloat16, float32 or float64 "
        "arrays, got dtype int64; convert it first, e.g. x.astype(np.float32)",
        torch="F.layer_norm(tx.long(), (4,))"),  # the module refuses the mix first
    "LayerNorm-eval-forward-int-input": Case(
        "LayerNorm(4).eval()(x.astype(np.int64))", TypeError,
        "\"LayerNormKernelImpl\" not implemented for 'Long': layer_norm takes float16, bfloat16, float32 or float64 "
        "arrays, got dtype int64; convert it first, e.g. x.astype(np.float32)",
        torch="F.layer_norm(tx.long(), (4,))"),
    "LayerNorm-forward-None": Case(
        "LayerNorm(4)(None)", TypeError,
        "LayerNorm takes float16, bfloat16, float32 or float64 arrays, got dtype object; convert it first, e.g. "
        "x.astype(np.float32)"),
    "LayerNorm-backward-before-forward": Case(
        "LayerNorm(4).backward(x)", RuntimeError,
        "backward() needs a training-mode forward first: put the module in training mode with .train() and "
        "call it on an input before calling backward()."),
    "LayerNorm-backward-twice": Case(
        "(lambda m: (m(x), m.backward(x), m.backward(x)))(LayerNorm(4))", RuntimeError,
        "Trying to backward through the graph a second time: the values saved by the last training-mode "
        "forward were freed by the previous backward(). Call the module on an input again before calling "
        "backward()."),
    "LayerNorm-backward-after-eval-forward": Case(
        "(lambda m: (m.eval()(x), m.backward(x)))(LayerNorm(4))", RuntimeError,
        "backward() needs a training-mode forward first: put the module in training mode with .train() and "
        "call it on an input before calling backward()."),
    "LayerNorm-backward-grad-shape": Case(  # torch's words, its shapes written as NumPy's
        "(lambda m: (m(x), m.backward(x[:1])))(LayerNorm(4))", ValueError,
        "Mismatch in shape: grad_output[0] has a shape of (1, 4) and output[0] has a shape of (2, 4)."),
    "RMSNorm-backward-grad-shape": Case(
        "(lambda m: (m(x), m.backward(x[0])))(layernorm.RMSNorm(4))", ValueError,
        "Mismatch in shape: grad_output[0] has a shape of (4,) and output[0] has a shape of (2, 4)."),
    "LayerNorm-backward-grad-list-shape": Case(
        "(lambda m: (m(x), m.backward([[1.0] * 4])))(LayerNorm(4))", ValueError,
        "Mismatch in shape: grad_output[0] has a shape of (1, 4) and output[0] has a shape of (2, 4)."),
    "LayerNorm-backward-grad-number": Case(
        "(lambda m: (m(x), m.backward(1.0)))(LayerNorm(4))", ValueError,
        "Mismatch in shape: grad_output[0] has a shape of () and output[0] has a shape of (2, 4)."),
    "LayerNorm-backward-grad-str": Case(
        "(lambda m: (m(x), m.backward('abcd')))(LayerNorm(4))", TypeError,
        "grad_output must have a floating-point dtype, got dtype <U4"),
    "LayerNorm-backward-weight-changed-in-place": Case(
        "(lambda m: (m(x), m.weight.__imul__(2), m.backward(x)))(LayerNorm(4))", RuntimeError,
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        "LayerNorm.weight [float32 array [4]] changed after the forward call. Call the module on its input "
        "again before backward()."),
    "LayerNorm-backward-weight-replaced": Case(
        "(lambda m: (m(x), setattr(m, 'weight', None), m.backward(x)))(LayerNorm(4))", RuntimeError,
        "LayerNorm.weight was replaced after the forward call (float32 array [4] by None): call the module "
        "on its input again before backward()."),
    "LayerNorm-load_state_dict-list": Case(
        "module.load_state_dict([('weight', np.ones(4))])", TypeError,
        "Expected state_dict to be dict-like, got <class 'list'>.",
        torch="torch.nn.LayerNorm(4).load_state_dict([('weight', torch.ones(4))])"),
    "LayerNorm-load_state_dict-None": Case(
        "module.load_state_dict(None)", TypeError, "Expected state_dict to be dict-like, got <class 'NoneType'>."),
    "LayerNorm-load_state_dict-missing-key": Case(
        "module.load_state_dict({'weight': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tMissing key(s) in state_dict: \"bias\". ",
        torch="torch.nn.LayerNorm(4).load_state_dict({'weight': torch.ones(4)})"),
    "LayerNorm-load_state_dict-unexpected-key": Case(
        "module.load_state_dict({'weight': np.ones(4), 'bias': np.ones(4), 'extra': np.ones(1)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tUnexpected key(s) in state_dict: \"extra\". ",
        torch="torch.nn.LayerNorm(4).load_state_dict({'weight': torch.ones(4), 'bias': torch.ones(4), "
              "'extra': torch.ones(1)})"),
    "LayerNorm-load_state_dict-shape": Case(
        "module.load_state_dict({'weight': np.ones(5), 'bias': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tsize mismatch for weight: copying a param with "
        "shape (5,) from checkpoint, the shape in current model is (4,)."),
    "LayerNorm-load_state_dict-str-values": Case(
        "module.load_state_dict({'weight': np.array(['a'] * 4), 'bias': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tWhile copying the parameter named \"weight\", "
        "expected real numbers from checkpoint but received an array of dtype <U1"),
    "LayerNorm-load_state_dict-complex-values": Case(
        "module.load_state_dict({'weight': np.ones(4, np.complex64), 'bias': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tWhile copying the parameter named \"weight\", "
        "expected real numbers from checkpoint but received an array of dtype complex64"),
    "LayerNorm-load_state_dict-None-value": Case(
        "module.load_state_dict({'weight': None, 'bias': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tWhile copying the parameter named \"weight\", "
        "expected torch.Tensor or Tensor-like object from checkpoint but received <class 'NoneType'>",
        torch="torch.nn.LayerNorm(4).load_state_dict({'weight': None, 'bias': torch.ones(4)})"),
    "LayerNorm-load_state_dict-str-value": Case(
        "module.load_state_dict({'weight': 'abcd', 'bias': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tWhile copying the parameter named \"weight\", "
        "expected torch.Tensor or Tensor-like object from checkpoint but received <class 'str'>",
        torch="torch.nn.LayerNorm(4).load_state_dict({'weight': 'abcd', 'bias': torch.ones(4)})"),
    "LayerNorm-load_state_dict-object-values": Case(
        "module.load_state_dict({'weight': [None] * 4, 'bias': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tWhile copying the parameter named \"weight\", "
        "expected real numbers from checkpoint but received an array of dtype object"),
    "LayerNorm-load_state_dict-int-keys": Case(
        "module.load_state_dict({1: np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for LayerNorm:\n\tMissing key(s) in state_dict: \"weight\", "
        "\"bias\". \n\tUnexpected key(s) in state_dict: \"1\". "),
    "LayerNorm-state_dict-positional-destination": Case(
        "module.state_dict({})", TypeError,
        re.compile(r"(NormModule\.)?state_dict\(\) takes 1 positional argument but 2 were given")),
    "LayerNorm-train-str": Case(
        "module.train('yes')", _TrainingModeError, "training mode is expected to be boolean",
        torch="torch.nn.LayerNorm(4).train('yes')"),
    "LayerNorm-train-None": Case(
        "module.train(None)", _TrainingModeError, "training mode is expected to be boolean",
        torch="torch.nn.LayerNorm(4).train(None)"),
    "LayerNorm-eval-argument": Case(
        "module.eval(True)", TypeError,
        re.compile(r"(NormModule\.)?eval\(\) takes 1 positional argument but 2 were given")),
    "LayerNorm-weight-set-to-generator": Case(
        "setattr(module, 'weight', (i for i in range(4)))", TypeError,
        "cannot assign 'generator' as parameter 'weight' (numpy.ndarray, torch.Tensor or None expected)",
        torch="setattr(torch.nn.LayerNorm(4), 'weight', (i for i in range(4)))"),
    # ------------------------------------------------------------------ runtime controls: arity
    "set_num_threads-no-argument": Case(
        "layernorm.set_num_threads()", TypeError,
        re.compile(r"(layernorm\._layernorm\.)?set_num_threads\(\) takes exactly one argument \(0 given\)")),
    "set_simd_level-two-arguments": Case(
        "layernorm.set_simd_level('scalar', 'avx2')", TypeError,
        re.compile(r"(layernorm\._layernorm\.)?set_simd_level\(\) takes exactly one argument \(2 given\)")),
    # ------------------------------------------------------------------ layernorm.testing
    "assert_layer_norm_close-rtol-alone": Case(
        "assert_layer_norm_close(x, x, 4, rtol=1e-3)", ValueError, "rtol and atol must both be given or both be omitted"),
    "assert_rms_norm_close-atol-alone": Case(
        "assert_rms_norm_close(x, x, 4, atol=1e-3)", ValueError, "rtol and atol must both be given or both be omitted"),
    "assert_layer_norm_close-empty-normalized-shape": Case(
        "assert_layer_norm_close(x, x, ())", ValueError, "normalized_shape must have at least one dimension, as in torch"),
    "assert_layer_norm_close-trailing-shape": Case(
        "assert_layer_norm_close(x, x, 5)", ValueError,
        "normalized_shape (5,) does not match the input's shape (2, 4) over its last 1 dims"),
    "assert_layer_norm_close-weight-shape": Case(
        "assert_layer_norm_close(x, x, 4, np.ones(3))", ValueError, "weight has shape (3,), normalized_shape is (4,)"),
    "assert_layer_norm_close-input-str": Case(
        "assert_layer_norm_close(x, x.astype('U3'), 4)", TypeError, "input must hold real numbers, got dtype <U3"),
    "assert_layer_norm_close-output-str": Case(
        "assert_layer_norm_close('abc', x, 4)", TypeError, "the output must hold real numbers, got dtype <U3"),
    "assert_layer_norm_close-axis-out-of-bounds": Case(
        "assert_layer_norm_close(x, x, 4, axis=5)", ValueError, "axis 5 is out of bounds for an array of dimension 2"),
    "assert_layer_norm_close-repeated-axis": Case(
        "assert_layer_norm_close(x, x, (2, 4), axis=(0, 0))", ValueError, "repeated axis in (0, 0)"),
    "assert_rms_norm_close-axis-count": Case(
        "assert_rms_norm_close(x, x, (2, 4), axis=0)", ValueError, "axis (0,) names 1 axes, normalized_shape (2, 4) has 2"),
    "diagnose-unknown-kind": Case(
        "diagnose(module, 4, kind='batch_norm')", ValueError, "kind must be 'layer_norm' or 'rms_norm', got 'batch_norm'"),
    "diagnose-rms-norm-with-bias": Case(
        "diagnose(module, 4, kind='rms_norm', bias=np.zeros(4))", ValueError, "RMSNorm has no bias"),
    "diagnose-int-dtype": Case(
        "diagnose(module, 4, dtype=np.int32)", TypeError, "dtype must be float16, bfloat16, float32 or float64, got int32"),
    "diagnose-negative-size": Case(
        "diagnose(module, -4)", ValueError,
        "Trying to create tensor with negative dimension -4: [-4] (normalized_shape sizes must be >= 0)"),

    # ------------------------------------------------------------------ the norm family: sizes at the limits
    "rms_norm-output-too-big": Case(
        "layernorm.rms_norm(broadcast(1, (2**36, 16)), 16)",
        MemoryError,
        "rms_norm: could not allocate the output, a float32 array of shape [68719476736, 16]: 4398046511104 bytes",
        isolated=True),
    "native_rms_norm-statistics-of-empty-rows-too-big": Case(
        "layernorm.native_rms_norm(np.empty((2**40, 0), np.float32), 0)",
        MemoryError,
        "native_rms_norm: could not allocate rstd, a float32 array of shape [1099511627776, 1]: 4398046511104 bytes",
        isolated=True),
    "layer_norm-axis1-output-too-big": Case(
        "layernorm.layer_norm(broadcast(1, (2**30, 16, 4)), 16, axis=1)",
        MemoryError,
        "layer_norm: could not allocate the output, a float32 array of shape [1073741824, 16, 4]: 274877906944 bytes",
        isolated=True),
    "add_layer_norm-results-too-big": Case(
        "layernorm.add_layer_norm(broadcast(1, (2**36, 16)), broadcast(2, (2**36, 16)), 16)",
        MemoryError,
        re.compile(r"add_layer_norm: could not allocate (the output|the sum), a float32 array of shape "
                   r"\[68719476736, 16\]: 4398046511104 bytes"),
        isolated=True),
    "RMSNorm-parameters-too-big": Case(
        "layernorm.RMSNorm(2**40)",
        MemoryError,
        "RMSNorm: could not allocate weight, a float32 array of shape [1099511627776]: 4398046511104 bytes",
        isolated=True),
    "RMSNorm-training-saved-input-too-big": Case(
        "layernorm.RMSNorm(16)(np.broadcast_to(np.ones(16, np.float32), (2**22, 16)))",
        MemoryError,
        "RMSNorm: could not allocate the copy of the input saved for backward, a float32 array of "
        "shape [4194304, 16]: 268435456 bytes",
        isolated=True, memory=384 * MiB),
    "layer_norm-axis-normalized-size-overflows": Case(
        "layernorm.layer_norm(x, (2**40, 2**40), axis=(0, 1))",
        ValueError,
        "Given normalized_shape=[1099511627776, 1099511627776] and axis=(0, 1), expected input with sizes "
        "[1099511627776, 1099511627776] along those axes, but got input of size[2, 4]",
        isolated=True),
    "rms_norm_backward-broadcast-rstd-of-2**32-rows": Case(
        "layernorm.rms_norm_backward(broadcast(1, (2**32, 16)), broadcast(1, (2**32, 16)), 16, "
        "broadcast(1, (2**32, 1)))",
        MemoryError,
        "rms_norm_backward: could not allocate grad_input, a float32 array of shape [4294967296, 16]: "
        "274877906944 bytes",
        isolated=True, peak=64 * MiB),
    # ------------------------------------------------------------------ axis=
    "layer_norm-axis-out-of-bounds": Case(
        "layernorm.layer_norm(x, 4, axis=2)", AxisError, "axis 2 is out of bounds for array of dimension 2"),
    "native_rms_norm-axis-negative-out-of-bounds": Case(
        "layernorm.native_rms_norm(x, 4, axis=-3)", AxisError, "axis -3 is out of bounds for array of dimension 2"),
    "layer_norm_backward-axis-out-of-bounds-in-a-tuple": Case(
        "layernorm.layer_norm_backward(x, x, (2, 4), mean, rstd, axis=(0, 5))", AxisError,
        "axis 5 is out of bounds for array of dimension 2"),
    "add_layer_norm-axis-out-of-bounds": Case(
        "layernorm.add_layer_norm(x, x, 4, axis=7)", AxisError, "axis 7 is out of bounds for array of dimension 2"),
    "LayerNorm-axis-out-of-bounds": Case(
        "layernorm.LayerNorm(4, axis=3)(x)", AxisError, "axis 3 is out of bounds for array of dimension 2"),
    "RMSNorm-axis-out-of-bounds": Case(
        "layernorm.RMSNorm(4, axis=-3)(x)", AxisError, "axis -3 is out of bounds for array of dimension 2"),
    "rms_norm-repeated-axis": Case(
        "layernorm.rms_norm(x, (4, 4), axis=(1, 1))", ValueError, re.compile(r".*repeated axis.*", re.S)),
    "layer_norm-repeated-axis-negative": Case(
        "layernorm.layer_norm(x, (4, 4), axis=(1, -1))", ValueError, re.compile(r".*repeated axis.*", re.S)),
    "native_layer_norm-axis-count": Case(
        "layernorm.native_layer_norm(x, (4,), axis=(0, 1))", ValueError,
        "normalized_shape=[4] and axis=(0, 1) differ in length"),
    "add_rms_norm-axis-count": Case(
        "layernorm.add_rms_norm(x, x, (2, 4), axis=(1,))", ValueError,
        "normalized_shape=[2, 4] and axis=(1,) differ in length"),
    "rms_norm-axis-sizes": Case(
        "layernorm.rms_norm(x, (4,), axis=(0,))", ValueError,
        "Given normalized_shape=[4] and axis=(0,), expected input with sizes [4] along those axes, but got input "
        "of size[2, 4]"),
    "rms_norm_backward-axis-sizes": Case(
        "layernorm.rms_norm_backward(x, x, (4, 2), rstd, axis=(0, 1))", ValueError,
        "Given normalized_shape=[4, 2] and axis=(0, 1), expected input with sizes [4, 2] along those axes, but got "
        "input of size[2, 4]"),
    "layer_norm-axis-float": Case(
        "layernorm.layer_norm(x, 4, axis=1.0)", TypeError, re.compile(r".*axis.*", re.S)),
    "rms_norm-axis-list": Case(
        "layernorm.rms_norm(x, 4, axis=[1])", TypeError, re.compile(r".*axis.*", re.S)),
    "RMSNorm-axis-str": Case(
        "layernorm.RMSNorm(4, axis='1')(x)", TypeError, re.compile(r".*axis.*", re.S)),
    # ------------------------------------------------------------------ rms_norm, native_rms_norm, rms_norm_backward
    "rms_norm-empty-normalized-shape": Case(
        "layernorm.rms_norm(x, ())", ValueError,
        "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one element, "
        "but got normalized_shape = []",
        torch="F.rms_norm(tx, ())"),
    "layer_norm-masked-input": Case(
        "layernorm.layer_norm(np.ma.masked_array(x, mask=x > 5), (4,))", ValueError,
        "masked arrays with masked elements are not supported (the kernels would read the values under the "
        "mask): pass a.filled(fill_value), or the rows without masked elements"),
    "layer_norm_backward-masked-grad_output": Case(
        "layernorm.layer_norm_backward(np.ma.masked_array(x, mask=x > 5), x, (4,), mean, rstd)", ValueError,
        re.compile(r"masked arrays with masked elements are not supported .*")),
    "RMSNorm-masked-input": Case(
        "layernorm.RMSNorm(4)(np.ma.masked_array(x, mask=x > 5))", ValueError,
        re.compile(r"masked arrays with masked elements are not supported .*")),
    "rms_norm-trailing-shape": Case(
        "layernorm.rms_norm(x, (3,))", ValueError,
        "Given normalized_shape=[3], expected input with shape [*3], but got input of size[2, 4]",
        torch="F.rms_norm(tx, (3,))"),
    "rms_norm-fewer-dims": Case(
        "layernorm.rms_norm(x, (3, 2, 4))", ValueError,
        "Input tensor must have at least 3 dimensions, but got 2 (normalized_shape=[3, 2, 4], input of "
        "size[2, 4])",
        torch="F.rms_norm(tx, (3, 2, 4))"),
    "RMSNorm-forward-trailing-shape": Case(
        "layernorm.RMSNorm(3)(x)", ValueError,
        "Given normalized_shape=[3], expected input with shape [*3], but got input of size[2, 4]",
        torch="torch.nn.RMSNorm(3)(tx)"),
    "native_rms_norm-weight-shape": Case(
        "layernorm.native_rms_norm(x, (4,), np.ones(3, np.float32))", ValueError,
        "Expected weight to be of same shape as normalized_shape, but got weight of shape [3] and "
        "normalized_shape = [4]",
        torch="F.rms_norm(tx, (4,), torch.ones(3))"),
    "rms_norm-input-int64": Case(
        "layernorm.rms_norm(x.astype(np.int64), 4)", TypeError,
        "\"rms_norm\" not implemented for 'Long': rms_norm takes float16, bfloat16, float32 or float64 arrays, got dtype "
        "int64; convert it first, e.g. x.astype(np.float32)",
        torch="F.rms_norm(tx.long(), (4,))"),
    # torch's F.rms_norm takes an integer weight (unfused, with a warning) and multiplies by it;
    # ours refuses it as layer_norm does (README: Deliberate differences)
    "rms_norm-weight-int": Case(
        "layernorm.rms_norm(x, 4, np.ones(4, np.int64))", TypeError,
        "weight must have a floating-point dtype, got dtype int64"),
    # torch's rms_norm computes complex input: ours refuses it in words of its own
    "rms_norm-input-complex64": Case(
        "layernorm.rms_norm(x.astype(np.complex64), 4)", TypeError,
        "rms_norm takes float16, bfloat16, float32 or float64 arrays, got dtype complex64; convert it first, "
        "e.g. x.astype(np.float32)"),
    "rms_norm-bias": Case(
        "layernorm.rms_norm(x, 4, bias=np.zeros(4, np.float32))", TypeError,
        "rms_norm() got an unexpected keyword argument 'bias'",
        torch="F.rms_norm(tx, (4,), bias=torch.zeros(4))"),
    "rms_norm-out-by-position": Case(
        "layernorm.rms_norm(x, 4, None, None, None)", TypeError,
        "rms_norm() takes from 2 to 4 positional arguments but 5 were given"),
    "native_rms_norm-out": Case(
        "layernorm.native_rms_norm(x, 4, out=None)", TypeError,
        "native_rms_norm() got an unexpected keyword argument 'out'"),
    "rms_norm-eps-str": Case(
        "layernorm.rms_norm(x, 4, eps='1e-5')", TypeError, "eps must be a real number, got str"),
    "rms_norm_backward-output-mask-of-three": Case(
        "layernorm.rms_norm_backward(x, x, 4, rstd, output_mask=(True, True, True))", ValueError,
        re.compile(r"output_mask must be a sequence of two bools.*", re.S)),
    "rms_norm_backward-no-rstd": Case(
        "layernorm.rms_norm_backward(x, x, 4)", TypeError,
        "rms_norm_backward() missing 1 required positional argument: 'rstd'"),
    "rms_norm_backward-grad-output-shape": Case(
        "layernorm.rms_norm_backward(x[:1], x, 4, rstd)", ValueError,
        "grad_output of shape [1, 4] does not match input of size[2, 4]"),
    # ------------------------------------------------------------------ add_layer_norm, add_rms_norm
    "add_layer_norm-residual-shape": Case(
        "layernorm.add_layer_norm(x, x[:, :3], 4)", ValueError,
        "residual has shape [2, 3], but input has shape [2, 4]"),
    "add_rms_norm-residual-broadcast": Case(
        "layernorm.add_rms_norm(x, x[0], 4)", ValueError, "residual has shape [4], but input has shape [2, 4]"),
    "add_layer_norm-residual-dtype": Case(
        "layernorm.add_layer_norm(x, x.astype(np.float64), 4)", TypeError,
        "residual has dtype float64, but input has dtype float32"),
    "add_rms_norm-residual-list": Case(
        "layernorm.add_rms_norm(x, x.tolist(), 4)", TypeError,
        "residual has dtype float64, but input has dtype float32"),
    # the residual's conversion runs after the input's: the shapes are checked after both
    "add_layer_norm-residual-reshapes-input": Case(
        "(lambda a: layernorm.add_layer_norm(a, Reshaping(a, (2, 6)), 4))(np.zeros((3, 4), np.float32))",
        ValueError, "Given normalized_shape=[4], expected input with shape [*, 4], but got input of size[2, 6]",
        isolated=True),
    # backward's grad_output and statistics, and an axis' __index__, likewise
    "layer_norm_backward-grad-output-reshapes-input": Case(
        "(lambda a: layernorm.layer_norm_backward(Reshaping(a, (2, 6)), a, 4, mean[:1], rstd[:1]))"
        "(np.zeros((3, 4), np.float32))",
        ValueError, "Given normalized_shape=[4], expected input with shape [*, 4], but got input of size[2, 6]",
        isolated=True),
    "layer_norm_backward-mean-reshapes-input": Case(
        "(lambda a: layernorm.layer_norm_backward(a, a, 4, Reshaping(a, (2, 6)), rstd[:1], np.ones(4, np.float32)))"
        "(np.zeros((3, 4), np.float32))",
        ValueError, "Given normalized_shape=[4], expected input with shape [*, 4], but got input of size[2, 6]",
        isolated=True),
    "rms_norm_backward-rstd-reshapes-input": Case(
        "(lambda a: layernorm.rms_norm_backward(a, a, 4, Reshaping(a, (2, 6)), np.ones(4, np.float32)))"
        "(np.zeros((3, 4), np.float32))",
        ValueError, "Given normalized_shape=[4], expected input with shape [*4], but got input of size[2, 6]",
        isolated=True),
    "layer_norm-axis-index-reshapes-input": Case(
        "(lambda a: layernorm.layer_norm(a, 4, axis=ReshapingIndex(a, (12, 4), 2)))(np.zeros((2, 6, 4), np.float32))",
        AxisError, "axis 2 is out of bounds for array of dimension 2", isolated=True),
    # a parameter is checked once the caller's code has run, not before: a shrunken weight was
    # read at its old length (past the end of its memory)
    "layer_norm-bias-shrinks-weight": Case(
        "(lambda w: layer_norm(np.ones((2, 2**20), np.float32), 2**20, w, Shrinking(w, np.zeros(2**20, np.float32))))"
        "(np.ones(2**20, np.float32))",
        ValueError, "Expected weight to be of same shape as normalized_shape, but got weight of shape [1] and "
        "normalized_shape = [1048576]", isolated=True),
    "rms_norm-axis-index-shrinks-weight": Case(
        "(lambda w: layernorm.rms_norm(np.ones((2, 2**20), np.float32), 2**20, w, axis=Shrinking(w, 1)))"
        "(np.ones(2**20, np.float32))",
        ValueError, "Expected weight to be of same shape as normalized_shape, but got weight of shape [1] and "
        "normalized_shape = [1048576]", isolated=True),
    "layer_norm_backward-bias-shrinks-weight": Case(
        "(lambda x, w: layer_norm_backward(x, x, 2**20, *native_layer_norm(x, 2**20)[1:], w, "
        "Shrinking(w, np.zeros(2**20, np.float32))))(np.ones((2, 2**20), np.float32), np.ones(2**20, np.float32))",
        ValueError, "Expected weight to be of same shape as normalized_shape, but got weight of shape [1] and "
        "normalized_shape = [1048576]", isolated=True),
    "_layer_norm_part_normalize-row-len-shrinks-weight": Case(
        "(lambda w: layernorm._layernorm._layer_norm_part_normalize(np.ones((2, 2**20), np.float32), 2**20, "
        "np.zeros(2), np.ones(2), w, None, row_len=Shrinking(w, 2**20)))(np.ones(2**20, np.float32))",
        ValueError, "Expected weight to be of same shape as normalized_shape, but got weight of shape [1] and "
        "normalized_shape = [1048576]", isolated=True),
    "add_layer_norm-no-residual": Case(
        "layernorm.add_layer_norm(x, normalized_shape=4)", TypeError,
        "add_layer_norm() missing 1 required positional argument: 'residual'"),
    "add_rms_norm-axis-by-position": Case(
        "layernorm.add_rms_norm(x, x, 4, None, None, 1)", TypeError,
        "add_rms_norm() takes from 3 to 5 positional arguments but 6 were given"),
    # ------------------------------------------------------------------ RMSNorm
    "RMSNorm-negative-size": Case(
        "layernorm.RMSNorm(-1)", ValueError,
        "Trying to create tensor with negative dimension -1: [-1] (normalized_shape sizes must be >= 0)",
        torch="torch.nn.RMSNorm(-1)"),
    "RMSNorm-dtype-int32": Case(
        "layernorm.RMSNorm(4, dtype=np.int32)", TypeError,
        "RMSNorm supports float16, bfloat16, float32 and float64 parameters, got int32"),
    "RMSNorm-bias": Case(
        "layernorm.RMSNorm(4, bias=False)", TypeError, re.compile(r".*unexpected keyword argument 'bias'"),
        torch="torch.nn.RMSNorm(4, bias=False)"),
    "RMSNorm-forward-int-input": Case(
        "layernorm.RMSNorm(4)(x.astype(np.int64))", TypeError,
        "\"rms_norm\" not implemented for 'Long': RMSNorm takes float16, bfloat16, float32 or float64 arrays, got dtype "
        "int64; convert it first, e.g. x.astype(np.float32)",
        torch="F.rms_norm(tx.long(), (4,))"),
    "RMSNorm-backward-before-forward": Case(
        "layernorm.RMSNorm(4).backward(x)", RuntimeError,
        "backward() needs a training-mode forward first: put the module in training mode with .train() and "
        "call it on an input before calling backward()."),
    "RMSNorm-backward-weight-changed-in-place": Case(
        "(lambda m: (m(x), m.weight.__imul__(2), m.backward(x)))(layernorm.RMSNorm(4))", RuntimeError,
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        "RMSNorm.weight [float32 array [4]] changed after the forward call. Call the module on its input "
        "again before backward()."),
    "RMSNorm-load_state_dict-bias": Case(
        "layernorm.RMSNorm(4).load_state_dict({'weight': np.ones(4), 'bias': np.ones(4)})", RuntimeError,
        "Error(s) in loading state_dict for RMSNorm:\n\tUnexpected key(s) in state_dict: \"bias\". ",
        torch="torch.nn.RMSNorm(4).load_state_dict({'weight': torch.ones(4), 'bias': torch.ones(4)})"),
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


RETYPING_SETUP = SETUP + """
x = np.arange(16, dtype=np.float32).reshape(2, 8)
class Retyping:  # an eps whose conversion makes x's bytes float16 elements, (2, 16) of them
    def __float__(self):
        x.dtype = np.float16
        return 1e-5
"""


SUBCLASS_SETUP = SETUP + """
N = 2**20
w = np.ones(N, np.float32)
hooks = []
class Hooked(np.ndarray):  # results whose __array_function__ would shrink the weight
    def __array_function__(self, func, types, args, kwargs):
        hooks.append(func.__name__)
        w.resize((1,), refcheck=False)
        return super().__array_function__(func, types, args, kwargs)
buffer = np.zeros((2, 2 * N), np.float32).view(Hooked)
"""


def test_results_of_an_array_subclass_run_none_of_its_code_after_the_checks():
    # the test of out= against residual_out= in one buffer went through np.shares_memory, which
    # hands a subclass to its __array_function__: the weight shrank under the kernel
    outcome = run_in_child("(layernorm.add_layer_norm(np.ones((2, N), np.float32), np.ones((2, N), np.float32), N, w, "
                           "out=buffer[:, :N], residual_out=buffer[:, N:]), (hooks, w.shape))[1]", SUBCLASS_SETUP)
    assert (outcome.error, outcome.message) == (None, "([], (1048576,))")


def test_an_eps_that_retypes_the_input_gets_the_kernel_of_the_new_dtype():
    # eps is read before the input's dtype chooses the kernel: the float32 kernel read rows of
    # float16 elements as float32, past the end of their memory
    outcome = run_in_child("(lambda y: (y.dtype == np.float16, np.array_equal(y, layer_norm(x, 16))))"
                           "(layer_norm(x, 16, eps=Retyping()))", RETYPING_SETUP)
    assert (outcome.error, outcome.message) == (None, "(True, True)")


@requires_torch
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype_name", ["float8_e4m3fn", "complex32"])
def test_a_tensor_of_a_dtype_numpy_lacks_says_what_to_do(dtype_name):
    import torch

    tensor = torch.ones(2, 4).to(getattr(torch, dtype_name))
    for call in (lambda: layernorm.layer_norm(tensor, 4), lambda: layernorm.rms_norm(tensor, 4)):
        with pytest.raises(TypeError, match=rf"^a torch tensor of dtype torch.{dtype_name} has no NumPy dtype to "
                                            r"compute in: convert it first, e.g. tensor.float\(\)"):
            call()


@requires_torch
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["to_sparse", "to_sparse_csr", "to_mkldnn"])
def test_a_tensor_of_another_layout_gets_torchs_own_words(layout):
    # its dtype is float32: the refusal is torch's .numpy() of a tensor not in strided memory
    import torch

    tensor = getattr(torch.ones(2, 4), layout)()
    for call in (lambda: layernorm.layer_norm(tensor, 4), lambda: layernorm.rms_norm(tensor, 4)):
        with pytest.raises(TypeError, match=r"^can't convert \w+ layout tensor to numpy. Use Tensor.to_dense"):
            call()


# What each exception of torch's is here: (torch's class, ours, whether torch's text is in ours).
# A dtype torch has no kernel for is its NotImplementedError and our TypeError; a bad value is
# its RuntimeError (or ValueError) and our ValueError, or RuntimeError where ours is a state
# error too; a TypeError of torch's argument parser is a TypeError in other words here.
TORCH_KINDS = [
    (NotImplementedError, TypeError, True),
    (TypeError, TypeError, False),
    (ValueError, ValueError, True),
    (RuntimeError, (ValueError, RuntimeError), True),
]


@requires_torch
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.torch])
def test_torch_refuses_alike(name):
    case = CASES[name]
    space = {}
    exec(TORCH_SETUP, space)
    with pytest.raises(Exception) as info:
        eval(case.torch, space)
    theirs, ours, same_text = next(kind for kind in TORCH_KINDS if isinstance(info.value, kind[0]))
    assert issubclass(case.error, ours), f"torch raises {type(info.value).__name__}: {info.value}"
    if same_text:
        assert str(info.value) in case.message, str(info.value)
