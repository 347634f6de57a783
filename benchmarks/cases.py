"""The cases measured, their data, and what ours computes on each.

A case is rows x cols, normalized over the last axis of cols elements.  Each case has a forward
section (layer_norm) and, unless it writes into out=, a backward one (layer_norm_backward); one
more section times the LayerNorm module against the functional call it wraps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import layernorm

from .timing import Timed

EPS = 1e-5


@dataclass(frozen=True)
class Case:
    rows: int
    cols: int
    dtype: str = "float32"
    use_out: bool = False

    @property
    def label(self):
        text = f"{self.rows}x{self.cols} {self.dtype}"
        return text + " out=" if self.use_out else text

    @property
    def has_backward(self):
        return not self.use_out


CASES = [
    Case(4, 20),
    Case(16, 768),
    Case(1, 4096),
    Case(512, 768),
    Case(6304, 768),  # a ViT-B/16 batch, 32x197x768, flattened
    Case(2048, 4096),
    Case(1_000_000, 8),
    Case(8, 1_000_000),
    Case(1024, 1024, "float64"),
    Case(2048, 1024, "float16"),
    Case(2048, 4096, "float16"),
    Case(2048, 4096, use_out=True),
    # bfloat16, as LLM weights and activations come (ml_dtypes' dtype; torch's peer is bfloat16 too)
    Case(512, 768, "bfloat16"),
    Case(2048, 1024, "bfloat16"),
    Case(2048, 4096, "bfloat16"),
]

# The module section's inputs.  Each times the LayerNorm module, in training mode and after .eval(),
# with the functional call it wraps (the baseline) on the same input.  On 4x20 the target is what a
# module call adds; on 512x768 (a (4, 128, 768) batch of BERT-base activations, flattened) it is
# what training mode costs, since the module then keeps a copy of its input for backward.
MODULE_CASES = (Case(4, 20), Case(512, 768))
TRAINING_CASE = MODULE_CASES[1]
MODULE_BASELINE = "layer_norm"
MODULE_VARIANTS = ("module train", "module eval")

SECTION_PREFIXES = {"forward": "fwd", "backward": "bwd", "module": "module"}


def module_call_text(name, cols):
    """How the report writes a call of the module section (MODULE_BASELINE or a MODULE_VARIANTS name)."""
    return {
        MODULE_BASELINE: f"layer_norm(x, {cols}, w, b)",
        "module train": f"LayerNorm({cols})(x) (training mode)",
        "module eval": f"LayerNorm({cols}).eval()(x)",
    }[name]


def module_label(case):
    """What --cases matches for the module section of a case."""
    return f"{SECTION_PREFIXES['module']} {case.label}"


@dataclass
class CaseData:
    x: np.ndarray
    weight: np.ndarray  # float32, the parameters ours gets
    bias: np.ndarray
    grad_output: np.ndarray


def numpy_dtype(name):
    """The NumPy dtype of a case's dtype name; bfloat16 is ml_dtypes' (imported only for it)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_case_data(case, rng):
    """Random input, weight, bias and grad_output for a case.

    weight/bias are rounded through bfloat16 so that they are exactly the same numbers
    whether a library receives them as float16, bfloat16, float32 or float64 (bfloat16's 8
    significant bits fit float16's 11 for these magnitudes).
    """
    shape = (case.rows, case.cols)
    dtype = numpy_dtype(case.dtype)
    generate_dtype = np.float64 if case.dtype == "float64" else np.float32
    x = rng.standard_normal(shape, dtype=generate_dtype).astype(dtype, copy=False)
    weight = _exact_in_16_bits(rng.standard_normal(case.cols))
    bias = _exact_in_16_bits(rng.standard_normal(case.cols))
    grad_output = np.empty(0)
    if case.has_backward:
        grad_output = rng.standard_normal(shape, dtype=generate_dtype).astype(dtype, copy=False)
    return CaseData(x, weight, bias, grad_output)


def _exact_in_16_bits(values):
    """float32 values with 8 significant bits, so exact in float16 and bfloat16 alike."""
    values = values.astype(np.float32)
    mantissa, exponent = np.frexp(values)
    return np.ldexp(np.round(mantissa * 256) / 256, exponent).astype(np.float32)


# ----------------------------------------------------------------------------- what ours computes


def ours_forward(case, data):
    """layernorm.layer_norm(x, (cols,), weight, bias), into out= for the out= case."""
    shape = (case.cols,)
    if case.use_out:
        def layer_norm_into(x, weight, bias, out):
            return layernorm.layer_norm(x, shape, weight, bias, EPS, out=out)

        return Timed(layer_norm_into, (data.x, data.weight, data.bias, np.empty_like(data.x)),
                     set_num_threads=layernorm.set_num_threads)
    return Timed(layernorm.layer_norm, (data.x, shape, data.weight, data.bias, EPS),
                 set_num_threads=layernorm.set_num_threads)


def ours_backward(case, data):
    """layernorm.layer_norm_backward, fed the mean and rstd of layernorm's own forward pass."""
    shape = (case.cols,)
    _, mean, rstd = layernorm.native_layer_norm(data.x, shape, data.weight, data.bias, EPS)
    return Timed(layernorm.layer_norm_backward, (data.grad_output, data.x, shape, mean, rstd, data.weight, data.bias),
                 set_num_threads=layernorm.set_num_threads)


def module_calls(data):
    """The module section's calls (module_call_text names them) on the same input, parameters
    and eps."""
    x = data.x
    size = x.shape[-1]
    training_module = layernorm.LayerNorm(size)
    eval_module = layernorm.LayerNorm(size).eval()
    weight, bias = training_module.weight, training_module.bias
    threads = layernorm.set_num_threads
    return {
        MODULE_BASELINE: Timed(layernorm.layer_norm, (x, size, weight, bias), set_num_threads=threads),
        "module train": Timed(training_module, (x,), set_num_threads=threads),
        "module eval": Timed(eval_module, (x,), set_num_threads=threads),
    }


# ----------------------------------------------------------------------------- bytes moved


def compute_itemsize(dtype):
    """Bytes per value of the compute dtype (mean, rstd, parameter gradients) for an input dtype."""
    return 8 if dtype == "float64" else 4


def forward_bytes(data):
    """Bytes read and written by one forward call: input + output + weight + bias."""
    return 2 * data.x.nbytes + data.weight.nbytes + data.bias.nbytes


def backward_bytes(data, gradients):
    """Bytes read (grad_output, input, mean, rstd, weight) and written (the three gradients)."""
    rows = data.x.shape[0]
    stats_bytes = 2 * rows * compute_itemsize(data.x.dtype)  # mean and rstd, one value per row each
    read = data.grad_output.nbytes + data.x.nbytes + stats_bytes + data.weight.nbytes
    written = sum(gradient.nbytes for gradient in gradients if gradient is not None)
    return read + written


def floor_array(section, data):
    """The array whose plain copy moves the bytes a call cannot avoid: x for forward (read x,
    write y: one copy), 1.5 times x for backward (read x and dy, write dx)."""
    if section == "forward":
        return data.x
    return np.concatenate((data.x.ravel(), data.grad_output.ravel()[: data.x.size // 2]))


def planned_runs(substring, with_backward):
    """(case, section) pairs whose label contains `substring`, in order; a case's sections run
    one after the other."""
    runs = []
    for case in CASES:
        if substring in case.label:
            runs.append((case, "forward"))
            if with_backward and case.has_backward:
                runs.append((case, "backward"))
    runs += [(case, "module") for case in MODULE_CASES if substring in module_label(case)]
    return runs
