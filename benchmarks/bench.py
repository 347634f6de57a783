"""Benchmark layernorm against torch's CPU LayerNorm, a plain NumPy formula and a memory copy.

Usage:
    python benchmarks/bench.py [--threads N] [--quick] [--cases SUBSTRING] [--simd LEVEL]
                               [--markdown PATH] [--plot PATH]

    --threads N       thread count for both layernorm and torch (default 2)
    --quick           few repetitions of short loops (smoke test, < 30 s)
    --cases SUBSTRING only run cases whose label contains SUBSTRING, e.g. "float16" or "2048x"
    --simd LEVEL      force layernorm.set_simd_level(LEVEL) ("scalar", "avx2", "avx512")
    --markdown PATH   also write the result tables to PATH
    --plot PATH       write a PNG bar chart of the ours/torch time ratios (needs matplotlib)

Examples:
    python benchmarks/bench.py --quick
    python benchmarks/bench.py --markdown bench.md --plot bench.png
    python benchmarks/bench.py --threads 1 --simd avx2 --cases float32

What is timed, per case (rows x cols, normalized over the last axis of cols elements):
    ours   layernorm.layer_norm(x, (cols,), weight, bias)  (float32 weight/bias)
    torch  torch.nn.functional.layer_norm on torch.from_numpy(x), weight/bias in x's dtype, no_grad
    numpy  (x - x.mean(-1)) / np.sqrt(x.var(-1) + eps) * weight + bias, all in x's dtype
    copy   np.copyto(destination, x): the memory-bandwidth floor
The "out=" case passes a preallocated output to ours (torch and numpy allocate as usual).
Backward: layernorm.layer_norm_backward vs torch.ops.aten.native_layer_norm_backward,
each fed the mean/rstd of its own forward pass.

Method: the functions of a case run interleaved, round-robin (ours, torch, numpy, copy, ours, ...).
Each turn is a loop of k calls, k calibrated so one loop takes about 30 ms (2 ms with --quick);
the reported time per call is the best turn out of R repetitions. Before timing a case its result
is compared with torch's; a case whose answer is wrong is reported as WRONG and not timed, and
the script then exits with status 1.
"""

import argparse
import datetime
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

import layernorm

EPS = 1e-5

FULL_SETTINGS = {"repetitions": 25, "loop_seconds": 0.030}
QUICK_SETTINGS = {"repetitions": 3, "loop_seconds": 0.002}

# Largest tolerated max|ours - reference| / max(1, max|reference|), per input dtype.
# torch keeps float16 statistics in float16 (ours: float32), hence the loose float16 bounds.
FORWARD_TOLERANCE = {"float16": 1e-2, "float32": 1e-4, "float64": 1e-10}
BACKWARD_TOLERANCE = {"float16": 5e-2, "float32": 1e-3, "float64": 1e-8}


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


@dataclass
class CaseData:
    x: np.ndarray
    weight: np.ndarray  # float32, the parameters ours gets
    bias: np.ndarray
    grad_output: np.ndarray


@dataclass
class Result:
    """Timings (seconds per call) of one case in one direction ("forward" or "backward")."""

    case: Case
    direction: str
    times: dict = field(default_factory=dict)  # name -> seconds; missing name = not available
    max_diff: float = math.nan
    bytes_moved: int = 0
    error: str = ""

    @property
    def short_label(self):
        return ("fwd " if self.direction == "forward" else "bwd ") + self.case.label

    def ratio(self, numerator, denominator):
        if numerator in self.times and denominator in self.times:
            return self.times[numerator] / self.times[denominator]
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


def reference_backward_float64(grad_output, x, weight):
    """grad_input, grad_weight, grad_bias of layer_norm computed in float64 (fallback check)."""
    x = x.astype(np.float64)
    dy = grad_output.astype(np.float64)
    n = x.shape[-1]
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
    """Number of calls that makes one timed loop last about loop_seconds."""
    function()  # warm-up
    calls = 1
    elapsed = time_loop(function, calls)
    while elapsed < loop_seconds / 10 and calls < 10_000_000:
        calls *= 2
        elapsed = time_loop(function, calls)
    return max(1, round(calls * loop_seconds / elapsed))


def best_times_round_robin(functions, repetitions, loop_seconds):
    """Best seconds-per-call of each function, running them interleaved round-robin."""
    calls = {name: calibrate_loop_calls(fn, loop_seconds) for name, fn in functions.items()}
    best = {name: math.inf for name in functions}
    for _ in range(repetitions):
        for name, function in functions.items():
            seconds_per_call = time_loop(function, calls[name]) / calls[name]
            best[name] = min(best[name], seconds_per_call)
    return best


# ----------------------------------------------------------------------------- forward


def forward_functions(case, data):
    """The four timed callables of a forward case, by name."""
    x, weight, bias = data.x, data.weight, data.bias
    shape = (case.cols,)
    x_t = torch.from_numpy(x)
    weight_t = as_torch(weight, x.dtype)
    bias_t = as_torch(bias, x.dtype)
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

    return {
        "ours": ours,
        "torch": lambda: F.layer_norm(x_t, shape, weight_t, bias_t, EPS),
        "numpy": lambda: numpy_layer_norm(x, weight_x, bias_x, EPS),
        "copy": lambda: np.copyto(copy_destination, x),
    }


def forward_bytes(data):
    """Bytes read and written by one forward call: input + output + weight + bias."""
    return 2 * data.x.nbytes + data.weight.nbytes + data.bias.nbytes


def run_forward_case(case, data, settings):
    result = Result(case, "forward", bytes_moved=forward_bytes(data))
    functions = forward_functions(case, data)
    ours_output = functions["ours"]()
    torch_output = functions["torch"]().numpy()
    result.max_diff, scaled = scaled_max_diff(ours_output, torch_output)
    if not scaled <= FORWARD_TOLERANCE[case.dtype]:
        result.error = "WRONG"
        return result
    result.times = best_times_round_robin(functions, settings["repetitions"], settings["loop_seconds"])
    return result


# ----------------------------------------------------------------------------- backward


def backward_functions(case, data):
    """Timed callables 'ours' and (when torch supports the case) 'torch' of a backward case."""
    x, weight, bias, grad_output = data.x, data.weight, data.bias, data.grad_output
    shape = (case.cols,)
    _, mean, rstd = layernorm.native_layer_norm(x, shape, weight, bias, EPS)

    x_t = torch.from_numpy(x)
    grad_output_t = torch.from_numpy(grad_output)
    weight_t = as_torch(weight, x.dtype)
    bias_t = as_torch(bias, x.dtype)
    _, mean_t, rstd_t = torch.ops.aten.native_layer_norm(x_t, list(shape), weight_t, bias_t, EPS)

    functions = {
        "ours": lambda: layernorm.layer_norm_backward(grad_output, x, shape, mean, rstd, weight, bias),
        "torch": lambda: torch.ops.aten.native_layer_norm_backward(
            grad_output_t, x_t, list(shape), mean_t, rstd_t, weight_t, bias_t, [True, True, True]
        ),
    }
    try:
        functions["torch"]()
    except RuntimeError as error:
        print(f"  torch backward unsupported for {case.label}: {error}", file=sys.stderr)
        del functions["torch"]
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
    _, scaled = worst_scaled_diff(ours_outputs, reference)
    result.max_diff = scaled  # the gradients differ in scale (grad_weight sums over rows): report scaled
    if not scaled <= BACKWARD_TOLERANCE[case.dtype]:
        result.error = "WRONG"
        return result
    result.times = best_times_round_robin(functions, settings["repetitions"], settings["loop_seconds"])
    return result


# ----------------------------------------------------------------------------- reporting


def format_microseconds(seconds):
    if seconds is None:
        return "n/a"
    microseconds = seconds * 1e6
    if microseconds < 10:
        return f"{microseconds:.2f}"
    if microseconds < 100:
        return f"{microseconds:.1f}"
    return f"{microseconds:,.0f}"


def format_ratio(ratio):
    return "n/a" if ratio is None else f"{ratio:.2f}"


def format_gigabytes_per_second(result):
    if "ours" not in result.times:
        return "n/a"
    return f"{result.bytes_moved / result.times['ours'] / 1e9:.1f}"


def format_diff(value):
    return "n/a" if math.isnan(value) else f"{value:.1e}"


def progress_line(index, total, result):
    """One stderr line summarising a finished case."""
    head = f"[{index}/{total}] {result.short_label}:"
    if result.error:
        return f"{head} {result.error} (max |ours-torch| {format_diff(result.max_diff)})"
    parts = [f"{name} {format_microseconds(seconds)} us" for name, seconds in result.times.items()]
    return f"{head} " + ", ".join(parts) + f"  ours/torch {format_ratio(result.ratio('ours', 'torch'))}"


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


def header_lines(settings, load_at_start, load_at_end):
    return [
        "# layernorm benchmark",
        "",
        f"- machine: {cpu_model_name()}, {usable_cores()} usable cores ({os.cpu_count()} logical CPUs)",
        f"- simd level: {layernorm.simd_level()} (available: {', '.join(layernorm.available_simd_levels())})",
        f"- threads: layernorm {layernorm.get_num_threads()}, torch {torch.get_num_threads()}"
        " (numpy formula and copy are single-threaded)",
        f"- versions: numpy {np.__version__}, torch {torch.__version__}, layernorm {layernorm.__version__},"
        f" python {sys.version.split()[0]}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- load average (1, 5, 15 min): {load_average_text(load_at_start)} before the run (other processes:"
        f" above ~0.5 the timings are noisy), {load_average_text(load_at_end)} after it (includes this benchmark)",
        f"- method: best of {settings['repetitions']} interleaved repetitions, each a loop of calls lasting"
        f" ~{settings['loop_seconds'] * 1e3:.0f} ms; eps={EPS}; ratios below 1 mean ours is faster",
    ]


def forward_table_lines(results):
    lines = [
        "## Forward: layer_norm(x, (cols,), weight, bias)",
        "",
        "| case | ours µs | torch µs | numpy µs | copy µs | ours GB/s | ours/torch | ours/copy | max \\|ours-torch\\| |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        if result.error:
            lines.append(f"| {result.case.label} | {result.error} | | | | | | | {format_diff(result.max_diff)} |")
            continue
        cells = [
            result.case.label,
            format_microseconds(result.times.get("ours")),
            format_microseconds(result.times.get("torch")),
            format_microseconds(result.times.get("numpy")),
            format_microseconds(result.times.get("copy")),
            format_gigabytes_per_second(result),
            format_ratio(result.ratio("ours", "torch")),
            format_ratio(result.ratio("ours", "copy")),
            format_diff(result.max_diff),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def backward_table_lines(results):
    lines = [
        "## Backward: layer_norm_backward vs aten.native_layer_norm_backward (all three gradients)",
        "",
        "| case | ours µs | torch µs | ours/torch | ours GB/s | max \\|ours-torch\\| scaled |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        if result.error:
            lines.append(f"| {result.case.label} | {result.error} | | | | {format_diff(result.max_diff)} |")
            continue
        cells = [
            result.case.label,
            format_microseconds(result.times.get("ours")),
            format_microseconds(result.times.get("torch")),
            format_ratio(result.ratio("ours", "torch")),
            format_gigabytes_per_second(result),
            format_diff(result.max_diff),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "scaled: max over the three gradients of max|ours-torch| / max(1, max|torch|);"
              " torch computes float16 statistics in float16, ours in float32."]
    return lines


def markdown_report(settings, loads, forward_results, backward_results, backward_note):
    lines = header_lines(settings, *loads) + [""] + forward_table_lines(forward_results) + [""]
    if backward_results:
        lines += backward_table_lines(backward_results)
    else:
        lines.append(f"## Backward: {backward_note}")
    slower = [r for r in forward_results + backward_results if (r.ratio("ours", "torch") or 0) > 1]
    if slower:
        lines += ["", "Slower than torch: " + "; ".join(
            f"{r.direction} {r.case.label} ({r.ratio('ours', 'torch'):.2f}x)" for r in slower)]
    return "\n".join(lines) + "\n"


def write_plot(path, results, title):
    """Horizontal bars of ours/torch per case, with lines at 1.0 (solid) and 0.5/0.9 (dotted)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)", file=sys.stderr)
        return
    plotted = [r for r in results if r.ratio("ours", "torch") is not None]
    labels = [r.short_label for r in plotted]
    ratios = [r.ratio("ours", "torch") for r in plotted]
    colors = ["tab:green" if ratio <= 1.0 else "tab:red" for ratio in ratios]

    figure, axes = plt.subplots(figsize=(8, 1.2 + 0.35 * len(plotted)))
    positions = range(len(plotted))
    axes.barh(positions, ratios, color=colors)
    axes.set_yticks(list(positions), labels)
    axes.invert_yaxis()
    for position, ratio in zip(positions, ratios):
        axes.text(ratio, position, f" {ratio:.2f}", va="center", fontsize=8)
    axes.axvline(1.0, color="black", linewidth=1, label="1.0: as fast as torch")
    axes.axvline(0.9, color="tab:blue", linestyle=":", linewidth=1.5, label="0.9 target")
    axes.axvline(0.5, color="tab:purple", linestyle=":", linewidth=1.5, label="0.5 target")
    axes.legend(loc="lower right", fontsize=8)
    axes.set_xlim(0, max(ratios + [1.0]) * 1.15)
    axes.set_xlabel("ours time / torch time (lower is better)")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"plot written to {path}", file=sys.stderr)


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
    torch.set_num_threads(arguments.threads)
    if arguments.simd:
        try:
            layernorm.set_simd_level(arguments.simd)
        except ValueError as error:
            available = ", ".join(layernorm.available_simd_levels())
            sys.exit(f"--simd {arguments.simd}: {error} (available here: {available})")


def selected_cases(substring):
    return [case for case in CASES if substring in case.label]


def run_case_safely(run, case, data, settings):
    """Run one measurement; an exception becomes an error row instead of ending the benchmark."""
    try:
        return run(case, data, settings)
    except Exception as error:  # report and carry on with the other cases
        direction = "forward" if run is run_forward_case else "backward"
        message = f"error: {type(error).__name__}: {error}".replace("|", "/").replace("\n", " ")
        return Result(case, direction, error=message[:120])


def run_all_cases(cases, settings, with_backward):
    forward_results, backward_results = [], []
    total = len(cases) + (sum(case.has_backward for case in cases) if with_backward else 0)
    rng = np.random.default_rng(0)
    done = 0
    for case in cases:
        data = make_case_data(case, rng)
        forward_results.append(run_case_safely(run_forward_case, case, data, settings))
        done += 1
        print(progress_line(done, total, forward_results[-1]), file=sys.stderr, flush=True)
        if with_backward and case.has_backward:
            backward_results.append(run_case_safely(run_backward_case, case, data, settings))
            done += 1
            print(progress_line(done, total, backward_results[-1]), file=sys.stderr, flush=True)
        del data
    return forward_results, backward_results


def main(argv=None):
    arguments = parse_arguments(argv)
    configure_libraries(arguments)
    settings = QUICK_SETTINGS if arguments.quick else FULL_SETTINGS
    cases = selected_cases(arguments.cases)
    if not cases:
        sys.exit(f"no case label contains {arguments.cases!r}; labels: {[c.label for c in CASES]}")
    with_backward = hasattr(layernorm, "layer_norm_backward")
    backward_note = "" if with_backward else "skipped (this layernorm has no layer_norm_backward)"

    load_at_start = os.getloadavg()
    started = time.perf_counter()
    with torch.no_grad():
        forward_results, backward_results = run_all_cases(cases, settings, with_backward)
    print(f"finished in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    loads = (load_at_start, os.getloadavg())

    report = markdown_report(settings, loads, forward_results, backward_results, backward_note)
    sys.stdout.write(report)
    if arguments.markdown:
        with open(arguments.markdown, "w", encoding="utf-8") as markdown_file:
            markdown_file.write(report)
    if arguments.plot:
        title = (f"layernorm vs torch, {cpu_model_name()}, {layernorm.get_num_threads()} threads,"
                 f" simd {layernorm.simd_level()}")
        write_plot(arguments.plot, forward_results + backward_results, title)

    if any(result.error for result in forward_results + backward_results):
        sys.exit(1)


if __name__ == "__main__":
    main()
