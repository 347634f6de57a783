"""The Markdown report: a header, one table per section and thread count, and the performance
targets as a checklist; also the progress line printed after each measurement."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from dataclasses import dataclass

import numpy as np

import layernorm

from . import peers, timing
from .cases import EPS, MODULE_BASELINE, MODULE_VARIANTS, SECTION_PREFIXES, TRAINING_CASE, Case, module_call_text
from .measure import REFERENCE
from .timing import threads_text

MISSING = "n/a"  # table cell of a time or ratio that was not measured

# The performance targets.  ours/torch: on every forward and backward case but the out= one (see
# result_checks), the bound by case below.  x floor: on the large float32 cases and the large
# float16/bfloat16 ones.
TINY_CASES = (Case(4, 20),)  # forward ours/torch <= TINY_TORCH_LIMIT, backward as every other
TINY_TORCH_LIMIT = 0.5
SMALL_CASES = (Case(16, 768), Case(1, 4096))  # ours/torch <= SMALL_TORCH_LIMIT, forward and backward
SMALL_TORCH_LIMIT = 0.33
FORWARD_TORCH_LIMIT = 0.9  # ours/torch of every other forward case
BACKWARD_TORCH_LIMIT = 0.6  # ours/torch of every other backward case
BFLOAT16_TORCH_LIMIT = 0.5  # ours/torch of the bfloat16 cases, forward and backward
# float32 arrays of 19 to 32 MiB, past a core's L2 and most of an L3 (6304x768 is 32x197x768,
# a ViT-B/16 batch of 32, flattened)
LARGE_FLOAT32_CASES = (Case(2048, 4096), Case(1_000_000, 8), Case(8, 1_000_000), Case(6304, 768),
                       Case(2048, 4096, use_out=True))
FORWARD_FLOOR_LIMIT = 1.1  # x floor of the large float32 forward cases
BACKWARD_FLOOR_LIMIT = 1.3  # x floor of the large float32 backward cases
HALF_FLOOR_LIMIT = 1.3  # x floor of the large float16 and bfloat16 cases, forward and backward
LARGE_BYTES = 16 * 2**20  # a float16/bfloat16 case of this many input bytes has the floor target
MODULE_OVERHEAD_LIMIT_US = 1.0  # each module call's time minus layer_norm's, except on TRAINING_CASE
TRAINING_LIMIT = 1.15  # on TRAINING_CASE: the training-mode module's time / the eval-mode module's


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Check:
    """One target on one measured case at one thread count."""

    target: str  # e.g. "fwd 4x20 float32 (1 thread) ours/torch ≤ 0.5"
    measured: str  # the measured value as printed, or MISSING
    met: bool | None  # None: not measured
    why_not_measured: str = ""


def why_not_timed(result, name):
    if result.error:
        return result.error
    if name == "torch" and not peers.torch_version():
        return "torch not installed"
    return f"no {name} time"


def torch_limit(result):
    """The bound on ours/torch for a forward or backward result."""
    if result.case.dtype == "bfloat16":
        return BFLOAT16_TORCH_LIMIT
    if result.case in SMALL_CASES:
        return SMALL_TORCH_LIMIT
    if result.section == "backward":
        return BACKWARD_TORCH_LIMIT
    return TINY_TORCH_LIMIT if result.case in TINY_CASES else FORWARD_TORCH_LIMIT


def floor_limit(result):
    """The bound on x floor for a forward or backward result, or None where it has none."""
    case = result.case
    if case in LARGE_FLOAT32_CASES:
        return FORWARD_FLOOR_LIMIT if result.section == "forward" else BACKWARD_FLOOR_LIMIT
    if case.dtype in ("float16", "bfloat16") and case.rows * case.cols * 2 >= LARGE_BYTES:
        return HALF_FLOOR_LIMIT
    return None


def ratio_check(result, quantity, denominator, limit):
    target = f"{result.label} ({threads_text(result.threads)}) {quantity} ≤ {limit}"
    ratio = result.ratio("ours", denominator)
    if ratio is None:
        return Check(target, MISSING, None, why_not_timed(result, denominator))
    return Check(target, f"{ratio:.2f}", ratio <= limit)


def module_overhead_check(result, name):
    cols = result.case.cols
    calls = f"{module_call_text(name, cols)} − {module_call_text(MODULE_BASELINE, cols)}"
    target = f"{calls} ({threads_text(result.threads)}) < {MODULE_OVERHEAD_LIMIT_US:g} µs"
    extra = result.extra_microseconds(name, MODULE_BASELINE)
    if extra is None:
        return Check(target, MISSING, None, why_not_timed(result, name))
    return Check(target, f"{extra:+.2f} µs", extra < MODULE_OVERHEAD_LIMIT_US)


def training_mode_check(result):
    target = f"{result.label} ({threads_text(result.threads)}) module train / module eval ≤ {TRAINING_LIMIT}"
    ratio = result.ratio("module train", "module eval")
    if ratio is None:
        return Check(target, MISSING, None, why_not_timed(result, "module train"))
    return Check(target, f"{ratio:.2f}", ratio <= TRAINING_LIMIT)


def result_checks(result):
    if result.section == "module":
        if result.case == TRAINING_CASE:
            return [training_mode_check(result)]
        return [module_overhead_check(result, name) for name in MODULE_VARIANTS]
    # with out=, ours writes into a given array and torch (which has no allocation-free
    # layer_norm) allocates as usual: ours/torch is not like for like, the target is the copy
    checks = [] if result.case.use_out else [ratio_check(result, "ours/torch", "torch", torch_limit(result))]
    floor = floor_limit(result)
    if floor is not None:
        checks.append(ratio_check(result, "x floor", "copy", floor))
    return checks


def check_status(check):
    if check.met is None:
        return f"not measured ({check.why_not_measured})"
    return "met" if check.met else "NOT met"


def checklist_line(check):
    box = "x" if check.met else " "
    return f"- [{box}] {check.target}: measured {check.measured}, {check_status(check)}"


def checklist_lines(results):
    """The targets of every result: by thread count, then forward, backward and module."""
    sections = list(SECTION_PREFIXES)
    ordered = sorted(results, key=lambda result: (result.threads, sections.index(result.section)))
    checks = [check for result in ordered for check in result_checks(result)]
    met = sum(check.met is True for check in checks)
    not_measured = sum(check.met is None for check in checks)
    summary = f"{met} of {len(checks)} met" + (f", {not_measured} not measured" if not_measured else "")
    return [f"## Targets (cases of this run): {summary}", ""] + [checklist_line(check) for check in checks]


# ----------------------------------------------------------------------------- cells


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


# ----------------------------------------------------------------------------- progress


def result_summary(result):
    """The headline numbers of a result for the progress line."""
    if result.section == "module":
        extras = [f"{name} {format_extra_microseconds(result.extra_microseconds(name, MODULE_BASELINE))} us"
                  for name in MODULE_VARIANTS]
        return f"over {MODULE_BASELINE}: " + ", ".join(extras)
    ratios = [f"{quantity} {format_ratio(result.ratio('ours', name))}"
              for quantity, name in (("ours/torch", "torch"), ("x floor", "copy")) if name in result.times]
    return ", ".join(ratios)


def progress_line(index, total, result):
    """One stderr line summarising a finished case at one thread count."""
    head = f"[{index}/{total}] {result.label}, {threads_text(result.threads)}:"
    if result.error:
        return f"{head} {result.error} (max |ours-{result.reference}| {format_diff(result.max_diff)})"
    times = ", ".join(f"{name} {format_microseconds(seconds)} us" for name, seconds in result.times.items())
    return f"{head} {times}  {result_summary(result)}".rstrip()


# ----------------------------------------------------------------------------- header


def cpu_model_name():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load_average_text(load_averages):
    return ", ".join(f"{value:.2f}" for value in load_averages)


def thread_counts_text(thread_counts):
    """e.g. "1 and 2", "1, 2 and 4"."""
    names = [str(threads) for threads in thread_counts]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def turns_text(settings):
    """How many turns each time is the best of, e.g. "3 rounds x 6"."""
    if settings.rounds == 1:
        return f"{settings.repetitions}"
    return f"{settings.rounds} rounds x {settings.repetitions}"


def arrays_line(fresh):
    if not fresh:
        return ("- arrays: every call of a case gets the same arrays, warm in cache where they fit"
                " (--fresh: new ones for every call)")
    return (f"- arrays (--fresh): every timed call gets arrays of its own (inputs, out= and the copy's"
            f" destination), copied before its turn; a turn makes at most {timing.FRESH_MAX_CALLS} calls"
            f" and {timing.FRESH_MAX_BYTES >> 20} MiB of arrays")


def torch_header_lines():
    if peers.torch_version():
        return []
    return [f"- torch: not installed; its columns show {MISSING}, and every result is checked against"
            " a float64 reference"]


def header_lines(options, load_at_start, load_at_end):
    torch_version = peers.torch_version()
    torch_text = f"torch {torch_version}" if torch_version else "torch not installed"
    settings = options.settings
    return [
        "# layernorm benchmark",
        "",
        f"- machine: {cpu_model_name()}, {timing.usable_cores()} usable cores ({os.cpu_count()} logical CPUs)",
        f"- simd level: {layernorm.simd_level()} (available: {', '.join(layernorm.available_simd_levels())})",
        f"- threads: {thread_counts_text(options.thread_counts)}, for layernorm and torch alike, each in its own"
        " tables (the numpy formula is single-threaded; the copy is timed at each thread count, cut into a"
        " part per thread, and a table takes the fastest copy of at most its thread count; JAX runs on"
        " XLA's own pool at every count)",
        f"- versions: numpy {np.__version__}, {torch_text}, layernorm {layernorm.__version__},"
        f" python {sys.version.split()[0]}",
        *torch_header_lines(),
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- load average (1, 5, 15 min): {load_average_text(load_at_start)} before the run (other processes:"
        f" above ~0.5 the timings are noisy), {load_average_text(load_at_end)} after it (includes this benchmark)",
        f"- method: best of {turns_text(settings)} interleaved repetitions, each a loop of calls lasting"
        f" ~{settings.loop_seconds * 1e3:.0f} ms after {timing.TURN_GAP_SECONDS * 1e3:.0f} ms idle; eps={EPS};"
        f" ratios below 1 mean ours is faster",
        arrays_line(options.fresh),
        "- ours GB/s: bytes a call reads and writes / its time; x floor: ours time / the copy's time, the copy"
        " moving the bytes a call cannot avoid: x once for forward (read x, write y), 1.5 times x for backward"
        " (read x and dy, write dx)",
    ]


# ----------------------------------------------------------------------------- tables


def run_sweep_script(doc, measure, report, argv=None, add_options=None):
    """The command line of a sweep script (benchmarks.placement, benchmarks.row_lengths,
    benchmarks.param_dtypes): --threads N[,M], --quick and --markdown PATH, and the script's own
    options, which add_options(parser) adds and which go to measure and report as keywords;
    measure(thread_counts, quick, **options) is reported by report(results, quick, (load average
    before, after), **options) to stdout and to PATH."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=None, help="thread counts, e.g. 1,2")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--markdown", default=None)
    if add_options:
        add_options(parser)
    arguments = vars(parser.parse_args(argv))
    threads, quick, markdown = arguments.pop("threads"), arguments.pop("quick"), arguments.pop("markdown")
    thread_counts = tuple(int(value) for value in threads.split(",")) if threads else timing.default_thread_counts()
    load_at_start = os.getloadavg()
    results = measure(thread_counts, quick, **arguments)
    text = report(results, quick, (load_at_start, os.getloadavg()), **arguments)
    sys.stdout.write(text)
    if markdown:
        with open(markdown, "w", encoding="utf-8") as markdown_file:
            markdown_file.write(text)


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


def forward_table_lines(results, threads):
    columns = ["case", "ours µs", "torch µs", "ort µs", "jax µs", "numpy µs", "copy µs", "ours GB/s", "ours/torch",
               "ours/ort", "ours/jax", "x floor", f"max \\|ours-{REFERENCE}\\|"]

    def row(result):
        if result.error:
            return error_row(result, len(columns))
        return [
            result.case.label,
            *(format_microseconds(result.times.get(name)) for name in ("ours", "torch", "ort", "jax", "numpy", "copy")),
            format_gigabytes_per_second(result),
            *(format_ratio(result.ratio("ours", name)) for name in ("torch", "ort", "jax", "copy")),
            format_diff_with_reference(result),
        ]

    title = f"## Forward, {threads_text(threads)}: layer_norm(x, (cols,), weight, bias)"
    return table_lines(title, columns, map(row, results))


def backward_table_lines(results, threads):
    columns = ["case", "ours µs", "torch µs", "copy µs", "ours GB/s", "ours/torch", "x floor",
               f"max \\|ours-{REFERENCE}\\| scaled"]

    def row(result):
        if result.error:
            return error_row(result, len(columns))
        return [
            result.case.label,
            format_microseconds(result.times.get("ours")),
            format_microseconds(result.times.get("torch")),
            format_microseconds(result.times.get("copy")),
            format_gigabytes_per_second(result),
            format_ratio(result.ratio("ours", "torch")),
            format_ratio(result.ratio("ours", "copy")),
            format_diff_with_reference(result),
        ]

    compared_with = " vs aten.native_layer_norm_backward" if peers.torch_version() else ""
    title = f"## Backward, {threads_text(threads)}: layer_norm_backward{compared_with} (all three gradients)"
    note = f"scaled: max over the three gradients of max|ours-{REFERENCE}| / max(1, max|{REFERENCE}|)"
    note += ("; torch computes float16/bfloat16 statistics in those dtypes, ours in float32."
             if peers.torch_version() else ".")
    return table_lines(title, columns, map(row, results)) + ["", note]


def module_table_lines(result):
    cols = result.case.cols
    calls = f"LayerNorm({cols})(x) vs {module_call_text(MODULE_BASELINE, cols)}"
    title = f"## Module, {threads_text(result.threads)}: {calls}, {result.case.label}"
    if result.error:
        return [title, "", f"{result.error} (max \\|module - {MODULE_BASELINE}\\| {format_diff(result.max_diff)})"]
    rows = [
        [module_call_text(name, cols), format_microseconds(result.times.get(name)),
         "" if name == MODULE_BASELINE else format_extra_microseconds(result.extra_microseconds(name, MODULE_BASELINE)),
         format_ratio(result.ratio(name, "module eval"))]
        for name in (MODULE_BASELINE, *MODULE_VARIANTS)
    ]
    copy_row = ["copy of x (the fastest of at most this many threads)", format_microseconds(result.times.get("copy")),
                "", ""]
    return table_lines(title, ["call", "µs", f"over {MODULE_BASELINE} µs", "/ module eval"], rows + [copy_row])


def slower_than_torch_lines(results):
    slower = [r for r in results if (r.ratio("ours", "torch") or 0) > 1 and not r.case.use_out]
    if not slower:
        return []
    return ["", "Slower than torch: " + "; ".join(
        f"{r.section} {r.case.label} at {threads_text(r.threads)} ({r.ratio('ours', 'torch'):.2f}x)"
        for r in slower)]


def results_of(results, section, threads=None):
    """The results of one section, of one thread count unless threads is None."""
    return [result for result in results
            if result.section == section and threads in (None, result.threads)]


def markdown_report(options, loads, results, backward_note):
    lines = header_lines(options, *loads)
    for threads in options.thread_counts:
        forward_results = results_of(results, "forward", threads)
        if forward_results:
            lines += [""] + forward_table_lines(forward_results, threads)
    for threads in options.thread_counts:
        backward_results = results_of(results, "backward", threads)
        if backward_results:
            lines += [""] + backward_table_lines(backward_results, threads)
    if backward_note:
        lines += ["", f"## Backward: {backward_note}"]
    for module_result in sorted(results_of(results, "module"), key=lambda result: (result.case.rows, result.threads)):
        lines += [""] + module_table_lines(module_result)
    timed_against_torch = results_of(results, "forward") + results_of(results, "backward")
    lines += slower_than_torch_lines(timed_against_torch)
    lines += [""] + checklist_lines(results)
    return "\n".join(lines) + "\n"
