"""Row-length benchmark: forward and backward over rows of 4 to 3 * 2**20 elements, against torch.

Usage, from the repository root:
    python -m benchmarks.row_lengths [--threads N[,M]] [--quick] [--markdown PATH] [--elements N]

    --threads N[,M]  thread counts for layernorm and torch (default: 1 and all usable cores)
    --quick          a few row lengths, few turns (smoke test, < 1 min)
    --markdown PATH  also write the report to PATH
    --elements N     elements in all for rows of up to 1024 (default 2**21); 2**23 (32 MiB)
                     leaves L3 on most machines, and its output is written past the caches

Case: float32 rows of n elements, 2**21 elements in all (8 MiB, in L3) for rows of up to 1024
elements, 3 * 2**20 (12 MiB) for the longer ones, weight and bias, the same arrays every call:
layer_norm against torch.nn.functional.layer_norm (no_grad), and layer_norm_backward (all three
gradients) against torch.ops.aten.native_layer_norm_backward.  The standard cases (python -m
benchmarks) have rows of 8, 20 and 768 elements and more; the models people run in NumPy also
have rows of 16 to 256 (small transformers' hidden sizes, ConvNeXt's channels-last LayerNorm
over 96 to 768 channels, per-head norms), where a kernel's cost per row, not per element,
decides its speed.  At the other end, rows of a million elements and more (a whole image or
signal normalized at once) carry weights and biases as large as the input, read once a row.

Method: the calls of one row length and thread count take turns, each the best of its turns
(benchmarks.timing's round robin).  Reported: microseconds per call, nanoseconds per row and
ours / torch, per row length and thread count.
"""

from __future__ import annotations

import datetime
import os
import sys

import numpy as np

import layernorm

from . import peers
from .cases import EPS
from .report import cpu_model_name, load_average_text, run_sweep_script, table_lines, thread_counts_text
from .timing import FULL_SETTINGS, QUICK_SETTINGS, Timed, best_times_round_robin, threads_text

ELEMENTS = 2**21
LONG_ELEMENTS = 3 * 2**20  # rows longer than 1024: 48 rows of 2**16 down to one row
ROW_LENGTHS = (4, 8, 16, 24, 32, 40, 48, 64, 96, 100, 128, 192, 256, 384, 512, 768, 1000, 1024, 2**16, 2**20,
               3 * 2**20)
QUICK_ROW_LENGTHS = (8, 32, 256, 3 * 2**20)


def row_count(n, elements=ELEMENTS):
    """The rows of n elements a case of `elements` elements (rows of up to 1024) has."""
    return (elements if n <= 1024 else LONG_ELEMENTS) // n


def calls(n, threads, elements):
    """name -> Timed for rows of n elements: ours and torch's forward and backward."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((row_count(n, elements), n)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    _, mean, rstd = layernorm.native_layer_norm(x, (n,), weight, bias, EPS)
    ours = {
        "ours fwd": Timed(layernorm.layer_norm, (x, (n,), weight, bias, EPS), layernorm.set_num_threads),
        "ours bwd": Timed(layernorm.layer_norm_backward, (dy, x, (n,), mean, rstd, weight, bias),
                          layernorm.set_num_threads),
    }
    torch = peers.torch
    if torch is None:
        return {name: timed.at(threads) for name, timed in ours.items()}
    tx, tdy, tw, tb = (torch.from_numpy(a) for a in (x, dy, weight, bias))
    _, tmean, trstd = torch.native_layer_norm(tx, (n,), tw, tb, EPS)

    def torch_forward():
        with torch.no_grad():
            return torch.nn.functional.layer_norm(tx, (n,), tw, tb, EPS)

    def torch_backward():
        return torch.ops.aten.native_layer_norm_backward(tdy, tx, (n,), tmean, trstd, tw, tb, (True, True, True))

    theirs = {
        "torch fwd": Timed(torch_forward, (), torch.set_num_threads),
        "torch bwd": Timed(torch_backward, (), torch.set_num_threads),
    }
    return {name: timed.at(threads) for name, timed in {**ours, **theirs}.items()}


def measure(thread_counts, quick, elements):
    """{threads: {n: {name: seconds}}}."""
    settings = QUICK_SETTINGS if quick else FULL_SETTINGS
    lengths = QUICK_ROW_LENGTHS if quick else ROW_LENGTHS
    results = {threads: {} for threads in thread_counts}
    for _ in range(settings.rounds):
        for threads in thread_counts:
            for n in lengths:
                best = best_times_round_robin(calls(n, threads, elements), settings)
                previous = results[threads].get(n, {})
                results[threads][n] = {name: min(t, previous.get(name, t)) for name, t in best.items()}
                print(f"  {threads_text(threads)}, n={n}: "
                      + ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in best.items()), file=sys.stderr)
    return results


def report(results, quick, loads, elements):
    lines = [
        "# layernorm row-length benchmark",
        "",
        f"- machine: {cpu_model_name()}, {os.cpu_count()} cores; simd level {layernorm.simd_level()}",
        f"- versions: numpy {np.__version__}, torch {peers.torch_version() or 'not installed'},"
        f" layernorm {layernorm.__version__}",
        f"- load average: {load_average_text(loads[0])} before, {load_average_text(loads[1])} after",
        f"- float32 rows of n elements, {elements} elements in all ({LONG_ELEMENTS} for rows longer than 1024),"
        " weight and bias, the same arrays every"
        f" call; {'quick run' if quick else 'best of interleaved turns'} at {thread_counts_text(list(results))}"
        " threads",
        f"- {datetime.date.today().isoformat()}",
    ]
    for threads, by_length in results.items():
        rows = []
        for n, times in by_length.items():
            cells = [str(n)]
            for direction in ("fwd", "bwd"):
                ours, theirs = times[f"ours {direction}"], times.get(f"torch {direction}")
                cells += [f"{ours * 1e6:.1f}", f"{ours / row_count(n, elements) * 1e9:.1f}",
                          f"{ours / theirs:.2f}" if theirs else "n/a"]
            rows.append(cells)
        lines += [""] + table_lines(
            f"## {threads_text(threads)}",
            ["n", "fwd µs", "fwd ns/row", "fwd ours / torch", "bwd µs", "bwd ns/row", "bwd ours / torch"],
            rows,
        )
    return "\n".join(lines) + "\n"


def add_options(parser):
    parser.add_argument("--elements", type=int, default=ELEMENTS,
                        help="elements in all for rows of up to 1024 (default 2**21)")


def main(argv=None):
    run_sweep_script(__doc__, measure, report, argv, add_options)


if __name__ == "__main__":
    main()
