"""Benchmark layernorm against torch's CPU LayerNorm, a plain NumPy formula and a memory copy.

Usage, from the repository root:
    python -m benchmarks [--threads N[,M...]] [--fresh] [--quick] [--cases SUBSTRING] [--simd LEVEL]
                         [--markdown PATH] [--plot PATH]

    --threads N[,M]   thread counts for layernorm and torch, each measured in its own tables
                      (default: 1 and all usable cores)
    --fresh           every timed call gets arrays of its own (inputs, out= and the copy's
                      destination, copied before its turn) instead of the same arrays every call
    --quick           few repetitions of short loops (smoke test, < 1 min)
    --cases SUBSTRING only run cases whose label contains SUBSTRING, e.g. "float16", "2048x" or
                      "module" (the module sections are labelled "module 4x20 float32" and
                      "module 512x768 float32")
    --simd LEVEL      force layernorm.set_simd_level(LEVEL) ("scalar", "avx2", "avx512", "avx512bf16")
    --markdown PATH   also write the report to PATH
    --plot PATH       write a PNG bar chart of ours/torch and of x floor per case against its
                      target, a column of panels per thread count (needs matplotlib:
                      python -m pip install -e ".[bench]"; and torch)

Examples:
    python -m benchmarks --quick
    python -m benchmarks --markdown benchmarks/results.md --plot benchmarks/results.png
    python -m benchmarks --threads 1 --simd avx2 --cases float32 --fresh

What is timed, per case (rows x cols, normalized over the last axis of cols elements):
    ours   layernorm.layer_norm(x, (cols,), weight, bias)  (float32 weight/bias)
    torch  torch.nn.functional.layer_norm on torch.from_numpy(x), weight/bias in x's dtype, no_grad
    ort    ONNX Runtime's LayerNormalization (opset 17), a session per thread count, weight/bias
           in x's dtype (when onnxruntime is installed: python -m pip install -e ".[bench]")
    jax    a jitted JAX layer norm in x's dtype called on the NumPy arrays, result back as one
           (when jax is installed); XLA sizes its pool once per process (all cores), so it is timed
           once and shown in every table, the 1-thread ones too
    numpy  (x - x.mean(-1)) / np.sqrt(x.var(-1) + eps) * weight + bias, all in x's dtype
    copy   np.copyto(destination, x), cut into a part per thread at each thread count: the
           memory-bandwidth floor; a table of n threads takes the fastest copy of at most n
The "out=" case passes a preallocated output to ours (torch and numpy allocate as usual: torch
has no allocation-free layer_norm), so its target is its x floor, not ours/torch.
Backward: layernorm.layer_norm_backward vs torch.ops.aten.native_layer_norm_backward, each fed
the mean/rstd of its own forward pass, and a copy of 1.5 times x's bytes (read x and dy, write dx).
Module: layernorm.LayerNorm(cols)(x), in training mode and after .eval(), vs
layernorm.layer_norm(x, cols, weight, bias), on 4x20 float32 (what a module call adds) and on
512x768 float32 (what training mode, which keeps a copy of x for backward, costs over eval mode).
Each row reports ours GB/s (bytes read and written / time), ours/torch, and x floor: ours time /
the copy's time.

torch is optional. Without it the torch columns show "n/a", and every result is checked against
the float64 reference (layernorm._reference) instead of torch.

Method: the functions of a case run interleaved, round-robin (ours, torch, numpy, copy, ours, ...;
ours and torch once per thread count). Each turn is a loop of k calls, k calibrated so one loop
takes about 30 ms (2 ms with --quick), after 20 ms idle (torch's OpenMP workers spin for
milliseconds after a call and would take a core from the next turn). The whole list of cases is
run 3 times (rounds; 1 with --quick), 6 turns per function per case and round (3 with --quick),
so each case is measured at three moments of the run; the reported time per call is the best turn
of all of them. Before timing a case its result is compared with torch's (or the float64
reference's) at every thread count; a case whose answer is wrong is reported as WRONG and not
timed, and the script then exits with status 1. The report ends with the performance targets as
a checklist (met / NOT met); missing a target does not change the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import layernorm

from . import cases, peers, timing
from .measure import RunOptions, run_all
from .plot import check_plot_prerequisites, write_plot
from .report import markdown_report, progress_line


def thread_counts(text):
    """argparse type of --threads: "2" -> (2,), "1,2" -> (1, 2), in the order given, no repeats."""
    try:
        counts = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,M,... (thread counts), got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"thread counts are at least 1, got {text!r}")
    return counts


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=thread_counts, default=timing.default_thread_counts(), metavar="N[,M]",
                        help="thread counts for layernorm and torch, e.g. 1,2 (default: 1 and all usable cores)")
    parser.add_argument("--fresh", action="store_true", help="newly allocated arrays for every timed call")
    parser.add_argument("--quick", action="store_true", help="few short repetitions (smoke test)")
    parser.add_argument("--cases", default="", help="only cases whose label contains this substring")
    parser.add_argument("--simd", help="force layernorm.set_simd_level(LEVEL)")
    parser.add_argument("--markdown", help="also write the Markdown report to this file")
    parser.add_argument("--plot", help="write a PNG bar chart of ours/torch ratios to this file")
    return parser.parse_args(argv)


def force_simd_level(level):
    try:
        layernorm.set_simd_level(level)
    except ValueError as error:
        available = ", ".join(layernorm.available_simd_levels())
        sys.exit(f"--simd {level}: {error} (available here: {available})")


def main(argv=None):
    arguments = parse_arguments(argv)
    if arguments.simd:
        force_simd_level(arguments.simd)
    options = RunOptions(timing.QUICK_SETTINGS if arguments.quick else timing.FULL_SETTINGS,
                         arguments.threads, arguments.fresh)
    with_backward = hasattr(layernorm, "layer_norm_backward")
    backward_note = "" if with_backward else "skipped (this layernorm has no layer_norm_backward)"
    runs = cases.planned_runs(arguments.cases, with_backward)
    if not runs:
        labels = [case.label for case in cases.CASES] + [cases.module_label(case) for case in cases.MODULE_CASES]
        sys.exit(f"no case label contains {arguments.cases!r}; labels: {labels}")
    if arguments.plot:
        check_plot_prerequisites()

    def print_progress(round_number, index, total, result):
        rounds = options.settings.rounds
        print(f"round {round_number}/{rounds} {progress_line(index, total, result)}", file=sys.stderr, flush=True)

    load_at_start = os.getloadavg()
    started = time.perf_counter()
    with peers.torch_no_grad():
        results = run_all(runs, options, print_progress)
    print(f"finished in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    loads = (load_at_start, os.getloadavg())

    report = markdown_report(options, loads, results, backward_note)
    sys.stdout.write(report)
    if arguments.markdown:
        with open(arguments.markdown, "w", encoding="utf-8") as markdown_file:
            markdown_file.write(report)
    if arguments.plot:
        write_plot(arguments.plot, results, options)

    if any(result.error for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
