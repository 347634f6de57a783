"""Benchmark layernorm against torch's CPU LayerNorm, a plain NumPy formula and a memory copy.

Usage:
    python benchmarks/bench.py [--threads N] [--quick] [--cases SUBSTRING] [--simd LEVEL]
                               [--markdown PATH] [--plot PATH]

    --threads N       thread count for both layernorm and torch (default 2)
    --quick           few repetitions of short loops (smoke test, < 30 s)
    --cases SUBSTRING only run cases whose label contains SUBSTRING, e.g. "float16", "2048x" or
                      "module" (the module-overhead section is labelled "module 4x20 float32")
    --simd LEVEL      force layernorm.set_simd_level(LEVEL) ("scalar", "avx2", "avx512")
    --markdown PATH   also write the report to PATH
    --plot PATH       write a PNG bar chart of the ours/torch time ratios (needs matplotlib:
                      python -m pip install ".[bench]"; and torch)

Examples:
    python benchmarks/bench.py --quick
    python benchmarks/bench.py --markdown bench.md --plot bench.png
    python benchmarks/bench.py --threads 1 --simd avx2 --cases float32

What is timed, per case (rows x cols, normalized over the last axis of cols elements):
    ours   layernorm.layer_norm(x, (cols,), weight, bias)  (float32 weight/bias)
    torch  torch.nn.functional.layer_norm on torch.from_numpy(x), weight/bias in x's dtype, no_grad
    numpy  (x - x.mean(-1)) / np.sqrt(x.var(-1) + eps) * weight + bias, all in x's dtype
    copy   np.copyto(destination, x): the memory-bandwidth floor
The "out=" case passes a preallocated output to ours (torch and numpy allocate as usual: torch
has no allocation-free layer_norm), so its target is ours/copy, not ours/torch.
Backward: layernorm.layer_norm_backward vs torch.ops.aten.native_layer_norm_backward,
each fed the mean/rstd of its own forward pass.
Module overhead: layernorm.LayerNorm(20)(x), in training mode and after .eval(), vs
layernorm.layer_norm(x, 20, weight, bias) on 4x20 float32.

torch is optional. Without it the torch columns show "—", the backward section times ours only,
and every result is checked against a float64 NumPy reference instead of torch.

Method: the functions of a case run interleaved, round-robin (ours, torch, numpy, copy, ours, ...).
Each turn is a loop of k calls, k calibrated so one loop takes about 30 ms (2 ms with --quick),
after 20 ms idle (torch's OpenMP workers spin for milliseconds after a call and would take a
core from the next turn). The whole list of cases is run 3 times (rounds; 1 with --quick), 10
turns per function per case and round (3 with --quick), so each case is measured at three moments
of the run; the reported time per call is the best turn of all of them. Before timing a case its result
is compared with torch's (or the float64 reference); a case whose answer is wrong is reported as
WRONG and not timed, and the script then exits with status 1. The report ends with the targets
of issue 4 as a checklist (met / NOT met); missing a target does not change the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import layernorm

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # torch is optional: without it ours is checked against float64 NumPy
    torch = None

EPS = 1e-5

# A round goes through every case once; each case gets `repetitions` turns per round.  The
# machine is shared: another tenant's burst of memory traffic can last seconds and slow every
# turn of a case, whoever's turn it is.  Spreading a case's turns over rounds a minute or so
# apart lets its best turn come from a quiet moment, for ours and torch alike.
FULL_SETTINGS = {"rounds": 3, "repetitions": 10, "loop_seconds": 0.030}
QUICK_SETTINGS = {"rounds": 1, "repetitions": 3, "loop_seconds": 0.002}

# What results are checked against, and what the "max |ours-...|" columns name.
FLOAT64_REFERENCE = "float64 numpy"
REFERENCE = "torch" if torch else FLOAT64_REFERENCE

# Largest tolerated max|ours - reference| / max(1, max|reference|), per input dtype.
# torch keeps float16 statistics in float16 (ours: float32), hence the loose float16 bounds.
FORWARD_TOLERANCE = {"float16": 1e-2, "float32": 1e-4, "float64": 1e-10}
BACKWARD_TOLERANCE = {"float16": 5e-2, "float32": 1e-3, "float64": 1e-8}

MISSING = "—"  # table cell of a time or ratio that was not measured


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
    Case(512, 768),
    Case(2048, 4096),
    Case(1_000_000, 8),
    Case(8, 1_000_000),
    Case(1024, 1024, "float64"),
    Case(2048, 1024, "float16"),
    Case(2048, 4096, use_out=True),
]

# The module-overhead section's input, and what it times (name -> how the report writes the call):
# each module call is compared with the baseline, the functional call it wraps.
MODULE_CASE = Case(4, 20)
MODULE_BASELINE = "layer_norm"
MODULE_VARIANTS = ("module train", "module eval")
MODULE_CALLS = {
    MODULE_BASELINE: f"layer_norm(x, {MODULE_CASE.cols}, w, b)",
    "module train": f"LayerNorm({MODULE_CASE.cols})(x) (training mode)",
    "module eval": f"LayerNorm({MODULE_CASE.cols}).eval()(x)",
}

# Issue 4's targets.
SMALL_CASES = (Case(4, 20), Case(16, 768))  # forward ours/torch <= SMALL_TORCH_LIMIT
SMALL_TORCH_LIMIT = 0.5
TORCH_LIMIT = 0.9  # ours/torch of every other forward case and of every backward case
COPY_CASE = Case(2048, 4096, use_out=True)  # ours/copy <= COPY_LIMIT
COPY_LIMIT = 1.3
MODULE_OVERHEAD_LIMIT_US = 1.0  # each module call's time minus layer_norm's

SECTION_PREFIXES = {"forward": "fwd", "backward": "bwd", "module": "module"}
MODULE_LABEL = f"{SECTION_PREFIXES['module']} {MODULE_CASE.label}"  # what --cases matches for that section


@dataclass
class CaseData:
    x: np.ndarray
    weight: np.ndarray  # float32, the parameters ours gets
    bias: np.ndarray
    grad_output: np.ndarray


@dataclass
class Result:
    """Timings (seconds per call) of one case in one section ("forward", "backward" or "module")."""

    case: Case
    section: str
    times: dict = field(default_factory=dict)  # name -> seconds; missing name = not available
    max_diff: float = math.nan
    reference: str = REFERENCE  # what max_diff was measured against
    bytes_moved: int = 0
    error: str = ""

    @property
    def short_label(self):
        return f"{SECTION_PREFIXES[self.section]} {self.case.label}"

    def ratio(self, numerator, denominator):
        if numerator in self.times and denominator in self.times:
            return self.times[numerator] / self.times[denominator]
        return None

    def extra_microseconds(self, name, baseline):
        """How many µs more a call of `name` takes than one of `baseline` (None if not timed)."""
        if name in self.times and baseline in self.times:
            return (self.times[name] - self.times[baseline]) * 1e6
        return None


# ----------------------------------------------------------------------------- data


def make_case_data(case, rng):
    """Random input, weight, bias and grad_output for a case.

    weight/bias are rounded through float16 so that they are exactly the same numbers
    whether a library receives them as float16, float32 or float64.
    """
    shape = (case.rows, case.cols)
    generate_dtype = np.float64 if case.dtype == "float64" else np.float32
    x = rng.standard_normal(shape, dtype=generate_dtype).astype(case.dtype, copy=False)
    weight = rng.standard_normal(case.cols).astype(np.float16).astype(np.float32)
    bias = rng.standard_normal(case.cols).astype(np.float16).astype(np.float32)
    grad_output = np.empty(0)
    if case.has_backward:
        grad_output = rng.standard_normal(shape, dtype=generate_dtype).astype(case.dtype, copy=False)
    return CaseData(x, weight, bias, grad_output)


def as_torch(array, dtype):
    return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype))


def numpy_layer_norm(x, weight, bias, eps):
    """The textbook formula in x's own dtype (no float64 upcast)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def reference_forward_float64(x, weight, bias):
    """layer_norm computed in float64: the check when torch is not installed."""
    return numpy_layer_norm(x.astype(np.float64), weight.astype(np.float64), bias.astype(np.float64), EPS)


def reference_backward_float64(grad_output, x, weight):
    """grad_input, grad_weight, grad_bias of layer_norm computed in float64.

    With g = grad_output * weight and x_hat = (x - mean) * rstd:
    grad_input = rstd * (g - mean(g) - x_hat * mean(g * x_hat)), grad_weight = sum(grad_output * x_hat),
    grad_bias = sum(grad_output), the means over a row and the sums over rows.
    """
    x = x.astype(np.float64)
    dy = grad_output.astype(np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + EPS)
    x_hat = (x - mean) * rstd
    g = dy * weight.astype(np.float64)
    grad_input = rstd * (g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))
    return grad_input, (dy * x_hat).sum(axis=0), dy.sum(axis=0)


def scaled_max_diff(ours, reference):
    """(max |ours - reference|, that divided by max(1, max |reference|)), in float64."""
    ours = np.asarray(ours, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if reference.size == 0:
        return 0.0, 0.0
    diff = float(np.max(np.abs(ours - reference)))
    scale = max(1.0, float(np.max(np.abs(reference))))
    return diff, diff / scale


def worst_scaled_diff(ours_arrays, reference_arrays):
    """Largest raw and scaled difference over pairs of arrays."""
    pairs = [scaled_max_diff(o, r) for o, r in zip(ours_arrays, reference_arrays)]
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


# ----------------------------------------------------------------------------- timing


def time_loop(function, calls):
    """Seconds taken by `calls` back-to-back calls, with the garbage collector paused."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            function()
        return time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()


def calibrate_loop_calls(function, loop_seconds):
    """Number of calls that makes one timed loop last about loop_seconds.

    Each trial loop is timed three times and the fastest counts, so one preemption (the machine
    is shared) cannot stop the doubling early and leave every timed loop a single call long.
    """
    function()  # warm-up

    def fastest_loop(calls):
        return min(time_loop(function, calls) for _ in range(3))

    calls = 1
    elapsed = fastest_loop(calls)
    while elapsed < loop_seconds / 10 and calls < 10_000_000:
        calls *= 2
        elapsed = fastest_loop(calls)
    return max(1, round(calls * loop_seconds / elapsed))


# Idle time before each turn.  After a parallel region torch's OpenMP workers (libgomp) keep
# spinning for milliseconds, and on 2 cores a spinning worker takes a core from whatever runs
# next: measured on an AMD EPYC, ours right after torch's turn was 1.2x slower than ours after
# a pause (1024x1024 float64 backward).  With the gap each turn starts on an idle machine;
# within its own turn torch still gets the benefit of its spinning workers.
TURN_GAP_SECONDS = 0.02


def best_times_round_robin(functions, settings):
    """Best seconds-per-call of each function, running them interleaved round-robin."""
    loop_seconds = settings["loop_seconds"]
    calls = {name: calibrate_loop_calls(fn, loop_seconds) for name, fn in functions.items()}
    best = {name: math.inf for name in functions}
    for _ in range(settings["repetitions"]):
        for name, function in functions.items():
            time.sleep(TURN_GAP_SECONDS)
            seconds_per_call = time_loop(function, calls[name]) / calls[name]
            best[name] = min(best[name], seconds_per_call)
    return best


# ----------------------------------------------------------------------------- forward


def forward_functions(case, data):
    """The timed callables of a forward case by name: ours, torch (when installed), numpy, copy."""
    x, weight, bias = data.x, data.weight, data.bias
    shape = (case.cols,)
    weight_x = weight.astype(x.dtype)
    bias_x = bias.astype(x.dtype)
    copy_destination = np.empty_like(x)

    if case.use_out:
        out = np.empty_like(x)

        def ours():
            return layernorm.layer_norm(x, shape, weight, bias, EPS, out=out)
    else:

        def ours():
            return layernorm.layer_norm(x, shape, weight, bias, EPS)

    functions = {"ours": ours}
    if torch:
        x_t, weight_t, bias_t = torch.from_numpy(x), as_torch(weight, x.dtype), as_torch(bias, x.dtype)
        functions["torch"] = lambda: F.layer_norm(x_t, shape, weight_t, bias_t, EPS)
    functions["numpy"] = lambda: numpy_layer_norm(x, weight_x, bias_x, EPS)
    functions["copy"] = lambda: np.copyto(copy_destination, x)
    return functions


def forward_bytes(data):
    """Bytes read and written by one forward call: input + output + weight + bias."""
    return 2 * data.x.nbytes + data.weight.nbytes + data.bias.nbytes


def forward_reference(functions, data):
    """torch's output when torch is installed, else the float64 formula's."""
    if "torch" in functions:
        return functions["torch"]().numpy()
    return reference_forward_float64(data.x, data.weight, data.bias)


def run_forward_case(case, data, settings):
    result = Result(case, "forward", bytes_moved=forward_bytes(data))
    functions = forward_functions(case, data)
    result.max_diff, scaled = scaled_max_diff(functions["ours"](), forward_reference(functions, data))
    if not scaled <= FORWARD_TOLERANCE[case.dtype]:
        result.error = "WRONG"
        return result
    result.times = best_times_round_robin(functions, settings)
    return result


# ----------------------------------------------------------------------------- backward


def torch_backward_function(case, data):
    """aten.native_layer_norm_backward on the case, or None if torch is absent or cannot run it."""
    if not torch:
        return None
    x_t = torch.from_numpy(data.x)
    grad_output_t = torch.from_numpy(data.grad_output)
    weight_t = as_torch(data.weight, data.x.dtype)
    bias_t = as_torch(data.bias, data.x.dtype)
    shape = [case.cols]
    _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(x_t, shape, weight_t, bias_t, EPS)

    def torch_backward():
        return torch.ops.aten.native_layer_norm_backward(
            grad_output_t, x_t, shape, mean_t, rstd_t, weight_t, bias_t, [True, True, True]
        )

    try:
        torch_backward()
    except RuntimeError as error:
        print(f"  torch backward unsupported for {case.label}: {error}", file=sys.stderr)
        return None
    return torch_backward


def backward_functions(case, data):
    """Timed callables 'ours' and (when torch is installed and supports the case) 'torch'."""
    x, weight, bias, grad_output = data.x, data.weight, data.bias, data.grad_output
    shape = (case.cols,)
    _, mean, rstd = layernorm.native_layer_norm(x, shape, weight, bias, EPS)
    functions = {"ours": lambda: layernorm.layer_norm_backward(grad_output, x, shape, mean, rstd, weight, bias)}
    torch_backward = torch_backward_function(case, data)
    if torch_backward:
        functions["torch"] = torch_backward
    return functions


def compute_itemsize(dtype):
    """Bytes per value of the compute dtype (mean, rstd, parameter gradients) for an input dtype."""
    return 8 if dtype == "float64" else 4


def backward_bytes(data, ours_outputs):
    """Bytes read (grad_output, input, mean, rstd, weight) and written (the three gradients)."""
    rows = data.x.shape[0]
    stats_bytes = 2 * rows * compute_itemsize(data.x.dtype)  # mean and rstd, one value per row each
    read = data.grad_output.nbytes + data.x.nbytes + stats_bytes + data.weight.nbytes
    written = sum(output.nbytes for output in ours_outputs if output is not None)
    return read + written


def run_backward_case(case, data, settings):
    result = Result(case, "backward")
    functions = backward_functions(case, data)
    ours_outputs = functions["ours"]()
    result.bytes_moved = backward_bytes(data, ours_outputs)
    if "torch" in functions:
        reference = [tensor.numpy() for tensor in functions["torch"]()]
    else:
        reference = reference_backward_float64(data.grad_output, data.x, data.weight)
        result.reference = FLOAT64_REFERENCE
    _, scaled = worst_scaled_diff(ours_outputs, reference)
    result.max_diff = scaled  # the gradients differ in scale (grad_weight sums over rows): report scaled
    if not scaled <= BACKWARD_TOLERANCE[case.dtype]:
        result.error = "WRONG"
        return result
    result.times = best_times_round_robin(functions, settings)
    return result


# ----------------------------------------------------------------------------- module overhead


def module_functions(data):
    """The calls of MODULE_CALLS on the same input, parameters and eps."""
    x = data.x
    size = x.shape[-1]
    training_module = layernorm.LayerNorm(size)
    eval_module = layernorm.LayerNorm(size).eval()
    weight, bias = training_module.weight, training_module.bias
    return {
        MODULE_BASELINE: lambda: layernorm.layer_norm(x, size, weight, bias),
        "module train": lambda: training_module(x),
        "module eval": lambda: eval_module(x),
    }


def run_module_case(case, data, settings):
    result = Result(case, "module", reference=MODULE_BASELINE)
    functions = module_functions(data)
    outputs = {name: function() for name, function in functions.items()}
    result.max_diff = max(scaled_max_diff(output, outputs[MODULE_BASELINE])[0] for output in outputs.values())
    if result.max_diff != 0:
        result.error = "WRONG"
        return result
    result.times = best_times_round_robin(functions, settings)
    return result


SECTION_RUNNERS = {"forward": run_forward_case, "backward": run_backward_case, "module": run_module_case}


# ----------------------------------------------------------------------------- checklist


@dataclass(frozen=True)
class Check:
    """One target of issue 4 on one measured case."""

    target: str  # e.g. "fwd 4x20 float32 ours/torch ≤ 0.5"
    measured: str  # the measured value as printed, or MISSING
    met: bool | None  # None: not measured
    why_not_measured: str = ""


def why_not_timed(result, name):
    if result.error:
        return result.error
    if name == "torch" and not torch:
        return "torch not installed"
    return f"no {name} time"


def torch_limit(result):
    """Issue 4's bound on ours/torch for a forward or backward result."""
    if result.section == "forward" and result.case in SMALL_CASES:
        return SMALL_TORCH_LIMIT
    return TORCH_LIMIT


def ratio_check(result, numerator, denominator, limit):
    target = f"{result.short_label} {numerator}/{denominator} ≤ {limit}"
    ratio = result.ratio(numerator, denominator)
    if ratio is None:
        return Check(target, MISSING, None, why_not_timed(result, denominator))
    return Check(target, f"{ratio:.2f}", ratio <= limit)


def module_overhead_check(result, name):
    target = f"{MODULE_CALLS[name]} − {MODULE_CALLS[MODULE_BASELINE]} < {MODULE_OVERHEAD_LIMIT_US:g} µs"
    extra = result.extra_microseconds(name, MODULE_BASELINE)
    if extra is None:
        return Check(target, MISSING, None, why_not_timed(result, name))
    return Check(target, f"{extra:+.2f} µs", extra < MODULE_OVERHEAD_LIMIT_US)


def result_checks(result):
    if result.section == "module":
        return [module_overhead_check(result, name) for name in MODULE_VARIANTS]
    if result.case.use_out:
        # ours writes into a given array; torch (which has no allocation-free layer_norm)
        # allocates as usual, so ours/torch is not like for like here: the target is the copy.
        return [ratio_check(result, "ours", "copy", COPY_LIMIT)]
    return [ratio_check(result, "ours", "torch", torch_limit(result))]


def target_checks(results):
    return [check for result in results for check in result_checks(result)]


def check_status(check):
    if check.met is None:
        return f"not measured ({check.why_not_measured})"
    return "met" if check.met else "NOT met"


def checklist_line(check):
    box = "x" if check.met else " "
    return f"- [{box}] {check.target}: measured {check.measured}, {check_status(check)}"


def checklist_lines(results):
    checks = target_checks(results)
    met = sum(check.met is True for check in checks)
    not_measured = sum(check.met is None for check in checks)
    summary = f"{met} of {len(checks)} met" + (f", {not_measured} not measured" if not_measured else "")
    return [f"## Targets (issue 4, cases of this run): {summary}", ""] + [checklist_line(c) for c in checks]


# ----------------------------------------------------------------------------- reporting


def format_microseconds(seconds):
    if seconds is None:
        return MISSING
    microseconds = seconds * 1e6
    if microseconds < 10:
        return f"{microseconds:.2f}"
    if microseconds < 100:
        return f"{microseconds:.1f}"
    return f"{microseconds:,.0f}"


def format_ratio(ratio):
    return MISSING if ratio is None else f"{ratio:.2f}"


def format_extra_microseconds(microseconds):
    return MISSING if microseconds is None else f"{microseconds:+.2f}"


def format_gigabytes_per_second(result):
    if "ours" not in result.times:
        return MISSING
    return f"{result.bytes_moved / result.times['ours'] / 1e9:.1f}"


def format_diff(value):
    return MISSING if math.isnan(value) else f"{value:.1e}"


def format_diff_with_reference(result):
    """max_diff, naming its reference when that is not the table's (torch could not run the case)."""
    text = format_diff(result.max_diff)
    return text if result.reference == REFERENCE else f"{text} (vs {result.reference})"


def result_summary(result):
    """The headline number of a result for the progress line."""
    if result.section == "module":
        extras = [f"{name} {format_extra_microseconds(result.extra_microseconds(name, MODULE_BASELINE))} us"
                  for name in MODULE_VARIANTS]
        return f"over {MODULE_BASELINE}: " + ", ".join(extras)
    ratio = result.ratio("ours", "torch")
    return "" if ratio is None else f"ours/torch {format_ratio(ratio)}"


def progress_line(index, total, result):
    """One stderr line summarising a finished case."""
    head = f"[{index}/{total}] {result.short_label}:"
    if result.error:
        return f"{head} {result.error} (max |ours-{result.reference}| {format_diff(result.max_diff)})"
    times = ", ".join(f"{name} {format_microseconds(seconds)} us" for name, seconds in result.times.items())
    return f"{head} {times}  {result_summary(result)}".rstrip()


def cpu_model_name():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def load_average_text(load_averages):
    return ", ".join(f"{value:.2f}" for value in load_averages)


def torch_header_lines():
    if torch:
        return []
    return ["- torch: not installed; its columns show —, the backward section times ours only, and every"
            " result is checked against a float64 NumPy reference"]


def turns_text(settings):
    """How many turns each time is the best of, e.g. "3 rounds x 10"."""
    if settings["rounds"] == 1:
        return f"{settings['repetitions']}"
    return f"{settings['rounds']} rounds x {settings['repetitions']}"


def header_lines(settings, load_at_start, load_at_end):
    torch_threads = f"torch {torch.get_num_threads()}" if torch else "torch not installed"
    torch_version = f"torch {torch.__version__}" if torch else "torch not installed"
    return [
        "# layernorm benchmark",
        "",
        f"- machine: {cpu_model_name()}, {usable_cores()} usable cores ({os.cpu_count()} logical CPUs)",
        f"- simd level: {layernorm.simd_level()} (available: {', '.join(layernorm.available_simd_levels())})",
        f"- threads: layernorm {layernorm.get_num_threads()}, {torch_threads}"
        " (numpy formula and copy are single-threaded)",
        f"- versions: numpy {np.__version__}, {torch_version}, layernorm {layernorm.__version__},"
        f" python {sys.version.split()[0]}",
        *torch_header_lines(),
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- load average (1, 5, 15 min): {load_average_text(load_at_start)} before the run (other processes:"
        f" above ~0.5 the timings are noisy), {load_average_text(load_at_end)} after it (includes this benchmark)",
        f"- method: best of {turns_text(settings)} interleaved repetitions, each a loop of calls lasting"
        f" ~{settings['loop_seconds'] * 1e3:.0f} ms after {TURN_GAP_SECONDS * 1e3:.0f} ms idle; eps={EPS};"
        f" ratios below 1 mean ours is faster",
    ]


def table_lines(title, columns, rows):
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    return [
        title,
        "",
        "| " + " | ".join(columns) + " |",
        "|---|" + "---:|" * (len(columns) - 1),
        *("| " + " | ".join(cells) + " |" for cells in rows),
    ]


def error_row(result, width):
    """A table row for a case that was not timed: its error, blanks, and the difference found."""
    return [result.case.label, result.error] + [""] * (width - 3) + [format_diff_with_reference(result)]


def forward_table_lines(results):
    columns = ["case", "ours µs", "torch µs", "numpy µs", "copy µs", "ours GB/s", "ours/torch", "ours/copy",
               f"max \\|ours-{REFERENCE}\\|"]

    def row(result):
        if result.error:
            return error_row(result, len(columns))
        return [
            result.case.label,
            format_microseconds(result.times.get("ours")),
            format_microseconds(result.times.get("torch")),
            format_microseconds(result.times.get("numpy")),
            format_microseconds(result.times.get("copy")),
            format_gigabytes_per_second(result),
            format_ratio(result.ratio("ours", "torch")),
            format_ratio(result.ratio("ours", "copy")),
            format_diff_with_reference(result),
        ]

    return table_lines("## Forward: layer_norm(x, (cols,), weight, bias)", columns, map(row, results))


def backward_table_lines(results):
    columns = ["case", "ours µs", "torch µs", "ours/torch", "ours GB/s", f"max \\|ours-{REFERENCE}\\| scaled"]

    def row(result):
        if result.error:
            return error_row(result, len(columns))
        return [
            result.case.label,
            format_microseconds(result.times.get("ours")),
            format_microseconds(result.times.get("torch")),
            format_ratio(result.ratio("ours", "torch")),
            format_gigabytes_per_second(result),
            format_diff_with_reference(result),
        ]

    compared_with = " vs aten.native_layer_norm_backward" if torch else ""
    title = f"## Backward: layer_norm_backward{compared_with} (all three gradients)"
    note = f"scaled: max over the three gradients of max|ours-{REFERENCE}| / max(1, max|{REFERENCE}|)"
    note += "; torch computes float16 statistics in float16, ours in float32." if torch else "."
    return table_lines(title, columns, map(row, results)) + ["", note]


def module_table_lines(result):
    calls = f"LayerNorm({result.case.cols})(x) vs {MODULE_CALLS[MODULE_BASELINE]}"
    title = f"## Module overhead: {calls}, {result.case.label}"
    if result.error:
        return [title, "", f"{result.error} (max \\|module - {MODULE_BASELINE}\\| {format_diff(result.max_diff)})"]
    baseline_row = [MODULE_CALLS[MODULE_BASELINE], format_microseconds(result.times.get(MODULE_BASELINE)), ""]
    variant_rows = [
        [MODULE_CALLS[name], format_microseconds(result.times.get(name)),
         format_extra_microseconds(result.extra_microseconds(name, MODULE_BASELINE))]
        for name in MODULE_VARIANTS
    ]
    return table_lines(title, ["call", "µs", f"over {MODULE_BASELINE} µs"], [baseline_row] + variant_rows)


def slower_than_torch_lines(results):
    slower = [r for r in results if (r.ratio("ours", "torch") or 0) > 1]
    if not slower:
        return []
    return ["", "Slower than torch: " + "; ".join(
        f"{r.section} {r.case.label} ({r.ratio('ours', 'torch'):.2f}x)" for r in slower)]


def results_of(results, section):
    return [result for result in results if result.section == section]


def markdown_report(settings, loads, results, backward_note):
    forward_results = results_of(results, "forward")
    backward_results = results_of(results, "backward")
    module_results = results_of(results, "module")
    lines = header_lines(settings, *loads)
    if forward_results:
        lines += [""] + forward_table_lines(forward_results)
    if backward_results:
        lines += [""] + backward_table_lines(backward_results)
    elif backward_note:
        lines += ["", f"## Backward: {backward_note}"]
    for module_result in module_results:
        lines += [""] + module_table_lines(module_result)
    lines += slower_than_torch_lines(forward_results + backward_results)
    lines += [""] + checklist_lines(forward_results + backward_results + module_results)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plot


def import_pyplot():
    """matplotlib.pyplot with the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_title(settings):
    run = "quick run, " if settings is QUICK_SETTINGS else ""
    return (f"layernorm time / torch time per call ({run}best of {turns_text(settings)})\n"
            f"{cpu_model_name()}, {layernorm.get_num_threads()} threads, simd {layernorm.simd_level()},"
            f" torch {torch.__version__}")


def write_plot(path, results, title):
    """Horizontal bars of ours/torch per case, green where the case meets its target, red where not."""
    plt = import_pyplot()
    # (the out= case is left out: ours without an allocation against torch with one)
    plotted = [r for r in results if r.ratio("ours", "torch") is not None and not r.case.use_out]
    if not plotted:
        print("no ours/torch ratio was measured: no plot written", file=sys.stderr)
        return
    labels = [r.short_label for r in plotted]
    ratios = [r.ratio("ours", "torch") for r in plotted]
    colors = ["tab:green" if ratio <= torch_limit(r) else "tab:red" for r, ratio in zip(plotted, ratios)]

    figure, axes = plt.subplots(figsize=(8, 1.6 + 0.32 * len(plotted)))
    positions = range(len(plotted))
    axes.barh(positions, ratios, color=colors, zorder=2)
    axes.set_yticks(list(positions), labels)
    axes.invert_yaxis()
    forward_count = len(results_of(plotted, "forward"))
    if 0 < forward_count < len(plotted):
        axes.axhline(forward_count - 0.5, color="grey", linewidth=0.8)
    for position, ratio in zip(positions, ratios):
        axes.text(ratio, position, f" {ratio:.2f}", va="center", fontsize=8, zorder=4,
                  bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
    axes.axvline(1.0, color="black", linewidth=1, zorder=3, label="1.0: as fast as torch")
    axes.axvline(TORCH_LIMIT, color="tab:blue", linestyle="--", linewidth=1.5, zorder=3,
                 label=f"{TORCH_LIMIT} target (every other case)")
    axes.axvline(SMALL_TORCH_LIMIT, color="tab:purple", linestyle="--", linewidth=1.5, zorder=3,
                 label=f"{SMALL_TORCH_LIMIT} target (fwd {', '.join(case.label for case in SMALL_CASES)})")
    axes.set_xlim(0, max(ratios + [1.0]) * 1.12)
    axes.set_xlabel("ours time / torch time (lower is better; green: target met, red: not met)")
    axes.set_title(title, fontsize=9)
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"plot written to {path}", file=sys.stderr)


def check_plot_prerequisites():
    """Exit before any timing if --plot cannot be honoured."""
    if not torch:
        sys.exit("--plot draws ours/torch ratios, and torch is not installed")
    if import_pyplot() is None:
        sys.exit('--plot needs matplotlib: python -m pip install ".[bench]" (from the repository root)')


# ----------------------------------------------------------------------------- main


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads for layernorm and torch (default 2)")
    parser.add_argument("--quick", action="store_true", help="few short repetitions (smoke test)")
    parser.add_argument("--cases", default="", help="only cases whose label contains this substring")
    parser.add_argument("--simd", help="force layernorm.set_simd_level(LEVEL)")
    parser.add_argument("--markdown", help="also write the Markdown report to this file")
    parser.add_argument("--plot", help="write a PNG bar chart of ours/torch ratios to this file")
    return parser.parse_args(argv)


def configure_libraries(arguments):
    layernorm.set_num_threads(arguments.threads)
    if torch:
        torch.set_num_threads(arguments.threads)
    if arguments.simd:
        try:
            layernorm.set_simd_level(arguments.simd)
        except ValueError as error:
            available = ", ".join(layernorm.available_simd_levels())
            sys.exit(f"--simd {arguments.simd}: {error} (available here: {available})")


def planned_runs(substring, with_backward):
    """(case, section) pairs to measure, in order; a case's sections run one after the other."""
    runs = []
    for case in CASES:
        if substring in case.label:
            runs.append((case, "forward"))
            if with_backward and case.has_backward:
                runs.append((case, "backward"))
    if substring in MODULE_LABEL:
        runs.append((MODULE_CASE, "module"))
    return runs


def run_safely(case, section, data, settings):
    """Run one measurement; an exception becomes an error row instead of ending the benchmark."""
    try:
        return SECTION_RUNNERS[section](case, data, settings)
    except Exception as error:  # report and carry on with the other cases
        message = f"error: {type(error).__name__}: {error}".replace("|", "/").replace("\n", " ")
        return Result(case, section, error=message[:120])


def merge_rounds(earlier, later):
    """One result of a measurement made in two rounds: the best time of each function, the
    larger difference, and an error if either round had one."""
    if earlier.error:
        return earlier
    if later.error:
        return later
    for name, seconds in later.times.items():
        earlier.times[name] = min(seconds, earlier.times.get(name, math.inf))
    earlier.max_diff = max(earlier.max_diff, later.max_diff)
    return earlier


def run_all(runs, settings):
    """Results of the planned runs, each the merge of its rounds, printing a progress line after
    each measurement."""
    rng = np.random.default_rng(0)
    results = [None] * len(runs)
    rounds = settings["rounds"]
    for round_number in range(1, rounds + 1):
        data_case, data = None, None
        for index, (case, section) in enumerate(runs):
            if case != data_case:
                data = None  # free the previous case's arrays first
                data_case, data = case, make_case_data(case, rng)
            result = run_safely(case, section, data, settings)
            results[index] = result if results[index] is None else merge_rounds(results[index], result)
            progress = progress_line(index + 1, len(runs), result)
            print(f"round {round_number}/{rounds} {progress}", file=sys.stderr, flush=True)
    return results


def main(argv=None):
    arguments = parse_arguments(argv)
    configure_libraries(arguments)
    settings = QUICK_SETTINGS if arguments.quick else FULL_SETTINGS
    with_backward = hasattr(layernorm, "layer_norm_backward")
    backward_note = "" if with_backward else "skipped (this layernorm has no layer_norm_backward)"
    runs = planned_runs(arguments.cases, with_backward)
    if not runs:
        labels = [case.label for case in CASES] + [MODULE_LABEL]
        sys.exit(f"no case label contains {arguments.cases!r}; labels: {labels}")
    if arguments.plot:
        check_plot_prerequisites()

    load_at_start = os.getloadavg()
    started = time.perf_counter()
    with torch.no_grad() if torch else contextlib.nullcontext():
        results = run_all(runs, settings)
    print(f"finished in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    loads = (load_at_start, os.getloadavg())

    report = markdown_report(settings, loads, results, backward_note)
    sys.stdout.write(report)
    if arguments.markdown:
        with open(arguments.markdown, "w", encoding="utf-8") as markdown_file:
            markdown_file.write(report)
    if arguments.plot:
        write_plot(arguments.plot, results_of(results, "forward") + results_of(results, "backward"),
                   plot_title(settings))

    if any(result.error for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
