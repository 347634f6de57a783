"""Placement benchmark: how backward's time depends on where x and dy start within a page.

Usage, from the repository root:
    python -m benchmarks.placement [--threads N[,M]] [--quick] [--markdown PATH] [--fused-add]

    --threads N[,M]  thread counts for layernorm and torch (default: 1 and all usable cores)
    --quick          a few placements, one round (smoke test, < 1 min)
    --markdown PATH  also write the report to PATH
    --fused-add      sweep add_layer_norm instead (below)

Case: layer_norm_backward on 512 x 4096 float32 with weight and bias, all three gradients, x and
dy reused call after call.  A program does not choose where its arrays start: NumPy puts a new
array 16 to 112 bytes past a page boundary, a slice starts anywhere.  Arrays whose addresses agree
in their low 12 bits can slow each other down (a load that looks like it depends on an earlier
store to another array, "4 KiB aliasing"), so the sweep places x and dy at every pair of page
offsets 0, 16, ..., 240 bytes (256 placements), and x at 256, 512, ..., 3840 with dy at 0 (15
more).  dx is allocated by each call, where the allocator puts it; its page offsets are reported.
torch.ops.aten.native_layer_norm_backward runs the same sweep on the same arrays when torch is
installed (it allocates its own gradients).

With --fused-add the case is add_layer_norm on 2048 x 4096 float32 into out= and residual_out=,
input and residual 16 bytes into a page (where NumPy puts arrays this large), and the sweep
places residual_out and out at every pair of page offsets 0, 16, ..., 240 (and residual_out at
256, 512, ..., 3840 with out at 0); the peer, "unfused", is np.add into residual_out followed by
layer_norm into out, at the same placements.  No target: the report shows the spread.

Method: a round times every placement once (a loop of calls lasting about LOOP_SECONDS), in
order; the time of a placement is its best over ROUNDS rounds, so a neighbour's burst of memory
traffic during one round does not count against one placement.  On a shared machine that is not
enough: of 271 placements a few have all their rounds slowed, and the sweep's slowest is then a
moment, not a placement.  So the CHECKED slowest placements are each timed again PAIRS times,
every time right after the fastest placement, and a placement's checked ratio is its best over
those timings divided by the fastest's best over the same pairs: both are measured in the same
seconds, so a slow stretch of the machine slows both, while a placement that is slow of itself
(as one that 4 KiB aliasing slows) is slow in every pair and keeps its ratio.  Reported per
thread count: fastest, median and slowest placement of the sweep, the sweep's slowest / fastest,
the largest checked ratio (the target: at most 1.2) and the placements with the largest ones.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import numpy as np

import layernorm

from .report import cpu_model_name, load_average_text, run_sweep_script, table_lines
from .timing import TURN_GAP_SECONDS, garbage_collector_paused, threads_text

ROWS, COLS = 512, 4096
ADD_ROWS = 2048
ADD_INPUTS_OFFSET = 16
PAGE = 4096
GRID_OFFSETS = tuple(range(0, 256, 16))
FAR_OFFSETS = tuple(range(256, PAGE, 256))
ROUNDS = 3
CHECKED = 16
PAIRS = 20
LOOP_SECONDS = 0.01
SLOWEST_SHOWN = 5
TARGET = 1.2  # slowest placement / fastest placement


def placements(quick):
    """(x offset, dy offset) pairs in bytes past a page boundary."""
    if quick:
        return [(0, 0), (16, 16), (64, 0), (0, 64), (2048, 0)]
    return [(x, dy) for x in GRID_OFFSETS for dy in GRID_OFFSETS] + [(x, 0) for x in FAR_OFFSETS]


def placed_copy(values, offset):
    """A copy of `values` starting `offset` bytes past a page boundary (a view into a buffer with
    a page of slack, which it keeps alive)."""
    buffer = np.empty(values.nbytes + 2 * PAGE, np.uint8)
    start = -buffer.ctypes.data % PAGE + offset
    placed = buffer[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    placed[...] = values
    return placed


def page_offset(array):
    return array.ctypes.data % PAGE


def placed_views(shape, dtype, offsets):
    """{offset: an uninitialised array of shape and dtype starting offset bytes past a page
    boundary}, all views of one buffer: placements are timed one at a time."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buffer = np.empty(nbytes + 2 * PAGE, np.uint8)
    base = -buffer.ctypes.data % PAGE
    return {offset: buffer[base + offset:base + offset + nbytes].view(dtype).reshape(shape) for offset in offsets}


class Sweep:
    """One library's backward over every placement: its calls, and the best seconds of each."""

    def __init__(self, name, make_call, pairs, arrays):
        self.name = name
        self.calls = {pair: make_call(*arrays[pair]) for pair in pairs}
        self.best = dict.fromkeys(pairs, float("inf"))
        self.checked = {}  # placement: its checked ratio (see the module's docstring)
        self.loop_calls = 1
        self.dx_offsets = set()

    def calibrate(self):
        call = next(iter(self.calls.values()))
        call()
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        self.loop_calls = max(1, round(LOOP_SECONDS / max(seconds, 1e-9)))

    def time_placement(self, pair):
        """Seconds per call of one loop of calls at the placement."""
        call = self.calls[pair]
        time.sleep(TURN_GAP_SECONDS)  # torch's OpenMP workers spin on after its calls (timing.py)
        with garbage_collector_paused():
            start = time.perf_counter()
            for _ in range(self.loop_calls):
                result = call()
            seconds = (time.perf_counter() - start) / self.loop_calls
        self.dx_offsets.add(result)
        return seconds

    def time_round(self):
        for pair in self.calls:
            self.best[pair] = min(self.best[pair], self.time_placement(pair))

    def fastest(self):
        return min(self.best, key=self.best.get)

    def slowest(self, count):
        return sorted(self.best, key=self.best.get, reverse=True)[:count]

    def check_slowest(self, count, pairs):
        """The checked ratios of the `count` slowest placements, each from `pairs` timings right
        after the fastest's."""
        reference = self.fastest()
        timings = {pair: ([], []) for pair in self.slowest(count) if pair != reference}
        for _ in range(pairs):
            for pair, (reference_seconds, pair_seconds) in timings.items():
                reference_seconds.append(self.time_placement(reference))
                pair_seconds.append(self.time_placement(pair))
        self.checked = {pair: min(pair_seconds) / min(reference_seconds)
                        for pair, (reference_seconds, pair_seconds) in timings.items()}


def layernorm_call(x, dy, mean, rstd, weight, bias):
    def call():
        grad_input = layernorm.layer_norm_backward(dy, x, (COLS,), mean, rstd, weight, bias)[0]
        return page_offset(grad_input)
    return call


def torch_call_maker(mean, rstd, weight, bias):
    import torch

    tensors = [torch.from_numpy(array) for array in (mean, rstd, weight, bias)]

    def make(x, dy):
        x_tensor, dy_tensor = torch.from_numpy(x), torch.from_numpy(dy)

        def call():
            with torch.no_grad():
                grad_input = torch.ops.aten.native_layer_norm_backward(
                    dy_tensor, x_tensor, [COLS], *tensors, [True, True, True])[0]
            return grad_input.data_ptr() % PAGE
        return call
    return make


def set_threads(name, threads):
    """The thread count of the library a sweep times: torch's for torch, else layernorm's (the
    unfused peer's layer_norm; its np.add has one thread)."""
    if name == "torch":
        import torch
        torch.set_num_threads(threads)
    else:
        layernorm.set_num_threads(threads)


def fused_add_arrays_and_makers(pairs, rng):
    """measure's arrays and call makers for --fused-add: (residual_out, out) placements."""
    shape = (ADD_ROWS, COLS)
    x = placed_copy(rng.standard_normal(shape).astype(np.float32), ADD_INPUTS_OFFSET)
    residual = placed_copy(rng.standard_normal(shape).astype(np.float32), ADD_INPUTS_OFFSET)
    weight = rng.standard_normal(COLS).astype(np.float32)
    bias = rng.standard_normal(COLS).astype(np.float32)
    sum_at = placed_views(shape, np.float32, {total for total, _ in pairs})
    out_at = placed_views(shape, np.float32, {out for _, out in pairs})
    arrays = {(total, out): (sum_at[total], out_at[out]) for total, out in pairs}

    def fused(total, out):
        def call():
            layernorm.add_layer_norm(x, residual, (COLS,), weight, bias, out=out, residual_out=total)
            return page_offset(out)
        return call

    def unfused(total, out):
        def call():
            np.add(x, residual, out=total)
            layernorm.layer_norm(total, (COLS,), weight, bias, out=out)
            return page_offset(out)
        return call

    return arrays, {"layernorm": fused, "unfused": unfused}


def measure(thread_counts, quick, fused_add=False):
    rng = np.random.default_rng(0)
    pairs = placements(quick)
    if fused_add:
        arrays, makers = fused_add_arrays_and_makers(pairs, rng)
        return run_sweeps(thread_counts, quick, pairs, arrays, makers)
    x_values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    dy_values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    weight = rng.standard_normal(COLS).astype(np.float32)
    bias = rng.standard_normal(COLS).astype(np.float32)
    _, mean, rstd = layernorm.native_layer_norm(x_values, (COLS,), weight, bias)
    x_at = {offset: placed_copy(x_values, offset) for offset in {x for x, _ in pairs}}
    dy_at = {offset: placed_copy(dy_values, offset) for offset in {dy for _, dy in pairs}}
    arrays = {(x, dy): (x_at[x], dy_at[dy]) for x, dy in pairs}
    makers = {"layernorm": lambda x, dy: layernorm_call(x, dy, mean, rstd, weight, bias)}
    try:
        makers["torch"] = torch_call_maker(mean, rstd, weight, bias)
    except ImportError:
        pass
    return run_sweeps(thread_counts, quick, pairs, arrays, makers)


def run_sweeps(thread_counts, quick, pairs, arrays, makers):
    """{threads: [Sweep of each maker's calls]}, the makers taking turns round by round."""
    results = {}
    for threads in thread_counts:
        sweeps = [Sweep(name, make, pairs, arrays) for name, make in makers.items()]
        for sweep in sweeps:
            set_threads(sweep.name, threads)
            sweep.calibrate()
        for _ in range(1 if quick else ROUNDS):
            for sweep in sweeps:  # libraries take turns round by round
                set_threads(sweep.name, threads)
                sweep.time_round()
        for sweep in sweeps:
            set_threads(sweep.name, threads)
            sweep.check_slowest(2 if quick else CHECKED, 1 if quick else PAIRS)
        results[threads] = sweeps
    return results


def sweep_row(sweep):
    times = np.array(list(sweep.best.values()))
    fastest, slowest = times.min(), times.max()
    checked = max(sweep.checked.values(), default=1.0)
    dx = ", ".join(str(offset) for offset in sorted(sweep.dx_offsets))
    return [sweep.name, f"{fastest * 1e3:.3f}", f"{np.median(times) * 1e3:.3f}", f"{slowest * 1e3:.3f}",
            f"{slowest / fastest:.2f}", f"{checked:.2f}", dx], checked


def report(results, quick, loads, fused_add=False):
    placed = "residual_out and out" if fused_add else "x and dy"
    case = (f"add_layer_norm, {ADD_ROWS} x {COLS} float32 into out= and residual_out=, input and residual"
            f" {ADD_INPUTS_OFFSET} bytes into a page, weight and bias" if fused_add else
            f"layer_norm_backward, {ROWS} x {COLS} float32, weight and bias, all gradients")
    lines = [
        "# add_layer_norm against the placement of its results" if fused_add else
        "# Backward against the placement of its arrays",
        "",
        f"- machine: {cpu_model_name()}, {os.cpu_count()} logical CPUs; layernorm {layernorm.__version__},"
        f" numpy {np.__version__}, python {sys.version.split()[0]}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- load average (1, 5, 15 min): {load_average_text(loads[0])} before, {load_average_text(loads[1])}"
        " after (above ~0.5 the timings are noisy)",
        f"- case: {case};"
        f" {len(next(iter(results.values()))[0].best)} placements of {placed}; each the best of"
        f" {1 if quick else ROUNDS} rounds; the {2 if quick else CHECKED} slowest then checked against the"
        f" fastest in {1 if quick else PAIRS} pairs of timings each",
        "",
    ]
    first, second = ("residual_out", "out") if fused_add else ("x", "dy")
    checklist = []
    for threads, sweeps in results.items():
        rows = []
        for sweep in sweeps:
            row, ratio = sweep_row(sweep)
            rows.append(row[:-1] if fused_add else row)  # the fused add's results are all placed
            if sweep.name == "layernorm" and not fused_add:
                met = ratio <= TARGET
                checklist.append(f"- [{'x' if met else ' '}] {threads_text(threads)}: slowest / fastest,"
                                 f" checked, {ratio:.2f} ≤ {TARGET} ({'met' if met else 'NOT met'})")
        columns = ["library", "fastest ms", "median ms", "slowest ms", "slowest / fastest",
                   "checked slowest / fastest"] + ([] if fused_add else ["dx page offsets"])
        lines += table_lines(f"## {threads_text(threads)}", columns, rows)
        for sweep in sweeps:
            fastest_a, fastest_b = sweep.fastest()
            checked = sorted(sweep.checked.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]
            shown = ", ".join(f"{first} {a} {second} {b}: {ratio:.2f}" for (a, b), ratio in checked)
            lines += ["", f"{sweep.name}'s fastest placement: {first} {fastest_a} {second} {fastest_b}; the largest"
                          f" checked ratios (bytes past a page boundary): {shown}"]
        lines.append("")
    if checklist:
        lines += ["## Target", "", *checklist, ""]
    return "\n".join(lines)


def main(argv=None):
    sys.stderr.write("placement sweep...\n")
    run_sweep_script(__doc__, measure, report, argv,
                     add_options=lambda parser: parser.add_argument("--fused-add", action="store_true"))


if __name__ == "__main__":
    main()
