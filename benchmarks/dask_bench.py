"""Dask benchmark: layernorm.layer_norm on a dask array against the same graph doing the cheapest
elementwise work, and against the hand-written dask formula.

Usage, from the repository root:
    python -m benchmarks.dask_bench [--quick] [--markdown PATH]

    --quick          arrays of 1/16 the size, one round (smoke test, < 1 min)
    --markdown PATH  also write the report to PATH

Cases: 1 GiB of float32 held in memory, as da.from_array(x, chunks) with 64 MiB chunks:
    rows held whole   262144 x 1024, chunks of 16384 rows (each chunk holds whole rows)
    rows split        64 x 4194304, chunks of 262144 columns (every row spread over 16 chunks)

Timed, each a compute() of the whole graph into one NumPy array (dask's threaded scheduler,
2 worker threads):
    layernorm           layernorm.layer_norm(x, cols).compute()
    layernorm, 1 thread the same, after layernorm.set_num_threads(1) (no kernel pool inside the tasks)
    elementwise         (x * 1).compute(): the same graph shape with the least work per chunk
    formula             ((x - x.mean(-1, keepdims=True)) / da.sqrt(x.var(-1, keepdims=True) + eps)).compute()

Method: the calls of a case take turns round-robin, 3 rounds (1 with --quick); the reported time is
each call's best.  Before timing, layernorm's result is checked against the float64 reference on a
sample of rows (the script exits with status 1 if it is off).  The report ends with the targets as
a checklist.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict

import numpy as np

import layernorm
from layernorm import _reference

from .report import cpu_model_name, load_average_text, table_lines
from .timing import usable_cores

EPS = 1e-5
DASK_THREADS = 2
ROUNDS = 3
SAMPLE_ROWS = 8  # rows checked against the float64 reference

# Tolerance against the float64 reference, relative to |xhat| + 1 (float32 output, as the tests
# hold it: a few float32 roundings from float64 statistics).
TOLERANCE = 4 * float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class Case:
    label: str
    rows: int
    cols: int
    chunk_rows: int
    chunk_cols: int


CASES = (
    Case("rows held whole", 262144, 1024, 16384, 1024),
    Case("rows split", 64, 4194304, 64, 262144),
)
QUICK_CASES = (
    Case("rows held whole", 16384, 1024, 1024, 1024),
    Case("rows split", 16, 1048576, 16, 65536),
)

# The targets: the largest time ratio each case may have to each peer.
TARGETS = {
    "rows held whole": {"elementwise": 1.2, "formula": 0.3},
    "rows split": {"elementwise": 2.0, "formula": 0.6},
}


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dask_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller arrays, one round")
    parser.add_argument("--markdown", help="also write the Markdown report to this file")
    return parser.parse_args(argv)


def with_kernel_threads(threads: int, compute: Callable[[], object]) -> Callable[[], object]:
    """`compute` run with layernorm.set_num_threads(threads), the previous count restored after."""

    def run():
        previous = layernorm.get_num_threads()
        layernorm.set_num_threads(threads)
        try:
            return compute()
        finally:
            layernorm.set_num_threads(previous)

    return run


def timed_calls(x) -> Dict[str, Callable[[], object]]:
    import dask.array as da

    cols = x.shape[-1]

    def ours():
        return layernorm.layer_norm(x, cols, eps=EPS).compute()

    return {
        "layernorm": ours,
        "layernorm, 1 thread": with_kernel_threads(1, ours),
        "elementwise": lambda: (x * 1).compute(),
        "formula": lambda: ((x - x.mean(-1, keepdims=True)) / da.sqrt(x.var(-1, keepdims=True) + EPS)).compute(),
    }


def check(case: Case, data: np.ndarray, output: np.ndarray) -> float:
    """The largest error of `output` on a sample of rows, in units of the tolerance."""
    rows = np.linspace(0, case.rows - 1, min(SAMPLE_ROWS, case.rows)).astype(int)
    expected, _, _ = _reference.layer_norm(data[rows], case.cols, eps=EPS)
    error = np.abs(output[rows].astype(np.float64) - expected)
    return float((error / (TOLERANCE * (np.abs(expected) + 1))).max())


def measure(cases, rounds):
    import dask
    import dask.array as da

    rng = np.random.default_rng(0)
    results = {}
    with dask.config.set(scheduler="threads", num_workers=DASK_THREADS):
        for case in cases:
            data = rng.standard_normal((case.rows, case.cols), dtype=np.float32)
            x = da.from_array(data, chunks=(case.chunk_rows, case.chunk_cols))
            calls = timed_calls(x)
            violation = check(case, data, calls["layernorm"]())
            best = dict.fromkeys(calls, float("inf"))
            for round_number in range(1, rounds + 1):
                for name, call in calls.items():
                    started = time.perf_counter()
                    call()
                    best[name] = min(best[name], time.perf_counter() - started)
                print(f"{case.label}, round {round_number}/{rounds}: "
                      + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in best.items()),
                      file=sys.stderr, flush=True)
            results[case] = (best, violation, data.nbytes)
            del x, data
    return results


def report(cases, results, loads, rounds):
    import dask

    lines = [
        "# layernorm on dask arrays",
        "",
        f"- machine: {cpu_model_name()}, {usable_cores()} usable cores ({os.cpu_count()} logical CPUs)",
        f"- versions: dask {dask.__version__}, numpy {np.__version__}, layernorm {layernorm.__version__},"
        f" python {sys.version.split()[0]}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- load average (1, 5, 15 min): {load_average_text(loads[0])} before the run (other processes:"
        f" above ~0.5 the timings are noisy), {load_average_text(loads[1])} after it",
        f"- method: dask's threaded scheduler with {DASK_THREADS} worker threads; layernorm's own pool at"
        f" {layernorm.get_num_threads()} threads unless the row says 1; each time the best of {rounds}"
        " interleaved rounds; a call is compute() of the whole graph into one NumPy array",
        "",
    ]
    checklist = []
    for case in cases:
        best, violation, nbytes = results[case]
        title = (f"## {case.label}: {case.rows} x {case.cols} float32 ({nbytes / 2**30:g} GiB), chunks"
                 f" {case.chunk_rows} x {case.chunk_cols} ({case.chunk_rows * case.chunk_cols * 4 / 2**20:g} MiB)")
        rows = [
            [name, f"{seconds:.3f}", f"{seconds / best['elementwise']:.2f}", f"{seconds / best['formula']:.2f}",
             f"{2 * nbytes / seconds / 1e9:.2f}"]
            for name, seconds in best.items()
        ]
        lines += table_lines(title, ["call", "seconds", "x elementwise", "x formula", "GB/s"], rows)
        lines += ["", f"layernorm's largest error on {SAMPLE_ROWS} rows: {violation:.2f} x the tolerance", ""]
        for peer, limit in TARGETS[case.label].items():
            ratio = best["layernorm"] / best[peer]
            status = "met" if ratio <= limit else "NOT met"
            checklist.append(f"- [{'x' if ratio <= limit else ' '}] {case.label}: layernorm / {peer}"
                             f" {ratio:.2f} ≤ {limit} ({status})")
    lines += ["## Targets", "", *checklist, ""]
    return "\n".join(lines)


def main(argv=None):
    arguments = parse_arguments(argv)
    cases = QUICK_CASES if arguments.quick else CASES
    rounds = 1 if arguments.quick else ROUNDS
    load_at_start = os.getloadavg()
    results = measure(cases, rounds)
    text = report(cases, results, (load_at_start, os.getloadavg()), rounds)
    sys.stdout.write(text)
    if arguments.markdown:
        with open(arguments.markdown, "w", encoding="utf-8") as markdown_file:
            markdown_file.write(text)
    if any(violation > 1 for _, violation, _ in results.values()):
        sys.exit("layernorm's result is off: see the tables")


if __name__ == "__main__":
    main()
