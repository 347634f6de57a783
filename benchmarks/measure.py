"""Measuring the cases: each section of a case is first checked against its reference at every
thread count, then its calls are timed together; a measurement's rounds merge into one result
per thread count."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import cases, peers, references, timing
from .cases import EPS, MODULE_BASELINE, SECTION_PREFIXES

# What results are checked against, and what the "max |ours-...|" columns name.
REFERENCE = "torch" if peers.torch_version() else references.NAME

# Largest tolerated max|ours - reference| / max(1, max|reference|), per input dtype.
# torch keeps float16/bfloat16 statistics in those dtypes (ours: float32), hence their loose bounds.
FORWARD_TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-4, "float64": 1e-10}
BACKWARD_TOLERANCE = {"float16": 5e-2, "bfloat16": 2e-1, "float32": 1e-3, "float64": 1e-8}


@dataclass(frozen=True)
class RunOptions:
    settings: timing.Settings
    thread_counts: tuple[int, ...]  # each measured in its own tables
    fresh: bool  # every timed call gets newly allocated arrays


@dataclass
class Result:
    """Timings (seconds per call) of one case in one section ("forward", "backward" or "module")
    at one thread count."""

    case: cases.Case
    section: str
    threads: int
    times: dict = field(default_factory=dict)  # name -> seconds; missing name = not available
    max_diff: float = math.nan
    reference: str = REFERENCE  # what max_diff was measured against
    bytes_moved: int = 0
    error: str = ""

    @property
    def label(self):
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


def time_checked(functions, results, options):
    """`results` (one per thread count) with the times of those that passed their check: every
    call of `functions` (name -> Timed) timed in one round-robin, threaded calls at each passing
    thread count, single-threaded ones once for all."""
    passed = [result.threads for result in results if not result.error]
    if not passed:
        return results
    timed_calls = {}
    for name, timed in functions.items():
        for threads in peers.floor_thread_counts(name, passed) if timed.threaded else [None]:
            timed_calls[name, threads] = timed if threads is None else timed.at(threads)
    best = peers.floor_times(timing.best_times_round_robin(timed_calls, options.settings, options.fresh))
    for result in results:
        if not result.error:
            result.times = {name: seconds for (name, threads), seconds in best.items()
                            if threads in (None, result.threads)}
    return results


def measure_forward(case, data, options):
    """ours, torch, ONNX Runtime and JAX (each when installed), the NumPy formula and the copy of
    x; checked against torch, or without it against the float64 reference."""
    functions = {"ours": cases.ours_forward(case, data)}
    torch_call = peers.torch_forward(case, data)
    if torch_call:
        functions["torch"] = torch_call
        reference = peers.values_of(torch_call.run())
    else:
        reference = references.forward(data.x, (case.cols,), data.weight, data.bias, EPS)
    for name, peer in (("ort", peers.ort_forward), ("jax", peers.jax_forward)):
        call = peer(case, data)
        if call:
            functions[name] = call
    functions["numpy"] = peers.numpy_forward(data)
    functions["copy"] = peers.copy(cases.floor_array("forward", data))

    def checked(threads):
        result = Result(case, "forward", threads, bytes_moved=cases.forward_bytes(data))
        result.max_diff, scaled = scaled_max_diff(functions["ours"].at(threads).run(), reference)
        if not scaled <= FORWARD_TOLERANCE[case.dtype]:
            result.error = "WRONG"
        return result

    return time_checked(functions, [checked(threads) for threads in options.thread_counts], options)


def measure_backward(case, data, options):
    """ours, torch (when installed and able to run the case) and the copy of 1.5 times x; checked
    against torch, or else against the float64 reference."""
    functions = {"ours": cases.ours_backward(case, data)}
    torch_call = peers.torch_backward(case, data)
    if torch_call:
        functions["torch"] = torch_call
        reference = [peers.values_of(tensor) for tensor in torch_call.run()]
        reference_name = "torch"
    else:
        reference = references.backward(data.grad_output, data.x, (case.cols,), data.weight, data.bias, EPS)
        reference_name = references.NAME
    functions["copy"] = peers.copy(cases.floor_array("backward", data))

    def checked(threads):
        gradients = functions["ours"].at(threads).run()
        result = Result(case, "backward", threads, reference=reference_name,
                        bytes_moved=cases.backward_bytes(data, gradients))
        _, scaled = worst_scaled_diff(gradients, reference)
        result.max_diff = scaled  # the gradients differ in scale (grad_weight sums over rows): report scaled
        if not scaled <= BACKWARD_TOLERANCE[case.dtype]:
            result.error = "WRONG"
        return result

    return time_checked(functions, [checked(threads) for threads in options.thread_counts], options)


def measure_module(case, data, options):
    """The module calls and the functional call they wrap, which must give the same bits, and the
    copy of x (what training mode's saved copy costs is set against it)."""
    calls = cases.module_calls(data)
    functions = {**calls, "copy": peers.copy(data.x)}

    def checked(threads):
        outputs = {name: timed.at(threads).run() for name, timed in calls.items()}
        result = Result(case, "module", threads, reference=MODULE_BASELINE)
        result.max_diff = max(scaled_max_diff(output, outputs[MODULE_BASELINE])[0] for output in outputs.values())
        if result.max_diff != 0:
            result.error = "WRONG"
        return result

    return time_checked(functions, [checked(threads) for threads in options.thread_counts], options)


SECTION_MEASURES = {"forward": measure_forward, "backward": measure_backward, "module": measure_module}


def measure_safely(case, section, data, options):
    """One result per thread count; an exception becomes an error row instead of ending the benchmark."""
    try:
        return SECTION_MEASURES[section](case, data, options)
    except Exception as error:  # report and carry on with the other cases
        message = f"error: {type(error).__name__}: {error}".replace("|", "/").replace("\n", " ")
        return [Result(case, section, threads, error=message[:120]) for threads in options.thread_counts]


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


def run_all(runs, options, report_progress):
    """Results of the planned (case, section) runs, one per thread count, each the merge of its
    rounds; report_progress(round, index, total, result) is called after each measurement."""
    rng = np.random.default_rng(0)
    merged = {}  # (index in runs, threads) -> Result
    for round_number in range(1, options.settings.rounds + 1):
        data_case, data = None, None
        for index, (case, section) in enumerate(runs):
            if case != data_case:
                data = None  # free the previous case's arrays first
                data_case, data = case, cases.make_case_data(case, rng)
            for result in measure_safely(case, section, data, options):
                key = (index, result.threads)
                merged[key] = merge_rounds(merged[key], result) if key in merged else result
                report_progress(round_number, index + 1, len(runs), result)
    return list(merged.values())
